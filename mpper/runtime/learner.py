"""The learner process: wait for data, then sample -> train -> write priorities back ->
publish weights -> checkpoint, reporting metrics about once per second.

What one update does is the algorithm's (its ``make_trainer`` and ``make_targets``:
``mpper.algos.muzero.trainer``, ``mpper.algos.dqn.dqn``); this module is the loop around
it, the same for every algorithm: ``run_learner`` (the process main), ``beta_schedule``
(importance-sampling exponent), samples-per-insert control (``_rate_hooks``), the
checkpoint cadence and the metrics it reports.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..algos.registry import algorithm_of
from ..checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from ..config import Config, config_to_dict
from ..envs import env_spec
from ..replay.buffer import ReplayBuffer
from .procs import child_process
from .weights import WeightStore

__all__ = ["beta_schedule", "pick_device", "run_learner"]

_REPORT_INTERVAL_S = 1.0
_POLL_S = 0.1  # how long one sleep on the stop event lasts while the buffer fills


def pick_device(name: str) -> torch.device:
    """``"auto"``: CUDA when available, else the CPU; ``"cuda"`` without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError('runtime.device is "cuda" but torch.cuda.is_available() is false')
    return torch.device(name)


def run_learner(
    config: Config,
    buffer_handle,
    weight_handle,
    stop,
    reports,
    run_dir: str,
    resume_checkpoint: str | None = None,
    rate=None,
) -> None:
    """Entry point of the learner process (every argument is picklable for ``spawn``).

    ``buffer_handle`` / ``weight_handle``: ``ReplayBuffer.handle`` and
    ``WeightStore.handle`` (the supervisor owns both segments; this process attaches and
    closes). ``stop``: an event (``is_set()``, ``wait(timeout)``). ``reports``: a queue
    that receives ``("metrics", "learner", {...})`` about once per second and
    ``("error", "learner", {"traceback": ...})`` when this raises. ``run_dir``: where
    ``checkpoint.pt`` goes. ``resume_checkpoint``: a checkpoint to continue from.
    ``rate``: optional samples-per-insert control, an ``mpper.runtime.rate.RateLimiter`` or any
    object whose ``wait_to_sample(stop)`` blocks while the learner is ahead of
    self-play (see ``_rate_hooks``); called before each sample.
    """
    with child_process("learner", config, reports, stop, buffer_handle, weight_handle) as (buf, store):
        _learn(config, buf, store, stop, reports, Path(run_dir), resume_checkpoint, rate)


def _learn(config: Config, buf: ReplayBuffer, store: WeightStore, stop, reports, run_dir: Path,
           resume_checkpoint: str | None, rate) -> None:  # fmt: skip
    t = config.training
    device = pick_device(config.runtime.device)
    torch.manual_seed(config.runtime.seed)
    rng = np.random.default_rng([config.runtime.seed, 0x1EA2])  # the learner's own sampling stream

    # The model and its trainer, sized from the env (one instance, then closed).
    algorithm = algorithm_of(config)
    spec = env_spec(config.env)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions)
    trainer = algorithm.make_trainer(config, network, device)

    # Everyone must act with the weights the learner trains. Resuming: the checkpoint's
    # weights, published at once. Fresh: publish ours (version 1), unless someone (the
    # supervisor) already published initial weights, which we then adopt.
    if resume_checkpoint is not None:
        trainer.load_state_dict(load_checkpoint(resume_checkpoint))
        store.publish(trainer.published_network.get_flat_weights(), trainer.training_step)
    elif store.version == 0:
        store.publish(trainer.published_network.get_flat_weights(), trainer.training_step)
    else:
        flat = np.empty(store.handle.num_weights, np.float32)
        store.read_into(flat)
        trainer.adopt_weights(flat)
    published_at = trainer.training_step

    targets = algorithm.make_targets(config, spec.num_actions)
    wait_for_rate, notify_rate = _rate_hooks(rate, buf)

    def may_draw_ahead() -> bool:
        if rate is None:
            return True
        if hasattr(rate, "can_sample"):  # mpper.runtime.rate.RateLimiter: ask without waiting
            c = buf.counters
            return rate.can_sample(c["steps"], c["samples"])  # samples counts this batch already
        return False  # an unknown rate controller: only draw when it says so
    checkpoint_path = run_dir / CHECKPOINT_NAME
    meter = _Meter(reports, trainer.training_step, device, buf.lock_wait_stats)

    def checkpoint() -> None:
        extra = {"config": config_to_dict(config), "weights_version": store.version, "time": time.time()}
        save_checkpoint(checkpoint_path, trainer, extra)

    # 1. Wait until min_buffer_steps env steps have been stored, sleeping on the stop
    # event. Counted as the rate limiter and --workers 0 count them (steps ever stored),
    # not as the positions the ring holds now: whole episodes leave a gap at the wrap and
    # each keeps one row more than its moves, so a ring of capacity C never holds C
    # positions, and a learner waiting for them with min_buffer_steps == C never started.
    while buf.counters["steps"] < t.min_buffer_steps and not stop.is_set():
        t0 = time.perf_counter()
        stop.wait(_POLL_S)
        meter.waited += time.perf_counter() - t0
        meter.maybe_report(trainer.training_step, store.version, len(buf), state="waiting_for_data")

    # 2. Train. The next batch is drawn in a helper thread while this one trains (the
    # buffer's compiled kernels release the GIL, torch too), so sampling costs the
    # learner no time unless training outruns it. A batch is drawn ahead only when the
    # rate limiter would allow it now; otherwise the loop waits for the ratio first.
    last_checkpoint = time.monotonic()

    def beta_at(step: int) -> float:
        return beta_schedule(config, step)

    def draw(step: int):
        return prefetcher.submit(buf.sample, t.batch_size, beta_at(step), targets, rng)

    prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpper-prefetch")
    pending = None
    try:
        while trainer.training_step < t.training_steps and not stop.is_set():
            t0 = time.perf_counter()
            if pending is None:
                if wait_for_rate is not None:
                    wait_for_rate(stop)  # blocks while the learner is ahead of self-play
                    if stop.is_set():
                        meter.waited += time.perf_counter() - t0
                        break
                pending = draw(trainer.training_step)
            batch, beta = pending.result(), beta_at(trainer.training_step)
            pending = None
            if notify_rate is not None:
                notify_rate()  # the samples counter moved: wake writers the ratio held back
            meter.waited += time.perf_counter() - t0  # time not spent training: waiting for data
            if may_draw_ahead():
                pending = draw(trainer.training_step + 1)

            try:
                metrics, priorities = trainer.train_step(batch)
            except FloatingPointError:
                # Diverged. train_step raised before changing anything (no optimizer step,
                # no priority written back): keep the last finite weights, then stop.
                checkpoint()
                raise
            trainer.update_average()
            applied, dropped = buf.update_priorities(batch.indices, batch.generations, priorities)
            meter.applied += applied
            meter.dropped += dropped
            meter.last = {**metrics, "beta": beta}

            step = trainer.training_step
            if step % t.publish_interval == 0:
                store.publish(trainer.published_network.get_flat_weights(), step)
                published_at = step
            if time.monotonic() - last_checkpoint >= config.runtime.checkpoint_interval_s:
                try:
                    checkpoint()
                except OSError as exc:  # a full disk: the previous checkpoint stays whole (atomic write)
                    print(f"mpper: learner: checkpoint not written to {checkpoint_path} ({exc.strerror or exc}); "
                          f"the previous one there is unchanged; training goes on", file=sys.stderr, flush=True)
                last_checkpoint = time.monotonic()
            meter.maybe_report(step, store.version, len(buf), state="training")
    finally:
        prefetcher.shutdown(wait=True, cancel_futures=True)

    # 3. The end (training_steps reached, or stop): final weights, checkpoint, report.
    if trainer.training_step != published_at:
        store.publish(trainer.published_network.get_flat_weights(), trainer.training_step)
    checkpoint()
    meter.maybe_report(trainer.training_step, store.version, len(buf), state="done", force=True)


def beta_schedule(config: Config, step: int) -> float:
    """Importance-sampling exponent after ``step`` updates: linear from ``replay.beta``
    to 1 over ``replay.beta_anneal_steps`` (default: all training steps), then 1."""
    r = config.replay
    horizon = r.beta_anneal_steps or config.training.training_steps
    return r.beta + (1.0 - r.beta) * min(1.0, step / horizon)


def _rate_hooks(rate, buf: ReplayBuffer):
    """``(wait(stop), notify())`` for the rate controller ``rate`` (either may be None).

    Two kinds are accepted: ``mpper.runtime.rate.RateLimiter`` (it decides from the buffer's
    shared ``steps`` (inserted) and ``samples`` counters, and wants ``notify()`` after
    each sample so that self-play writers waiting on the ratio wake up), or any object
    whose ``wait_to_sample(stop)`` blocks while the learner is ahead."""
    if rate is None:
        return None, None
    if hasattr(rate, "can_sample"):  # mpper.runtime.rate.RateLimiter

        def inserted() -> int:
            return buf.counters["steps"]

        def sampled() -> int:
            return buf.counters["samples"]

        return (lambda stop: rate.wait_to_sample(inserted, sampled, stop)), rate.notify
    return rate.wait_to_sample, getattr(rate, "notify", None)


class _Meter:
    """Rates over each report interval, and the report itself.

    ``waited`` accumulates the seconds not spent training: the wait for the first
    ``min_buffer_steps``, the rate limiter, and sampling (the learner has no batch
    until ``sample`` returns). ``wait_fraction`` is its share of the interval's wall time.
    """

    def __init__(self, reports, step: int, device: torch.device, lock_stats=None):
        self.reports = reports
        self.lock_stats = lock_stats  # () -> the buffer's lock waits in this process, reported as they are
        self.device = str(device)
        self.t_last = time.perf_counter()
        self.step_last = step
        self.waited = 0.0
        self.applied = 0  # priority updates applied, cumulative
        self.dropped = 0  # ... dropped (slot rewritten since sampling), cumulative
        self.last: dict[str, float] = {}  # the latest train_step metrics (none before the first)

    def maybe_report(self, step: int, weights_version: int, buffer_steps: int, state: str, force: bool = False) -> None:
        now = time.perf_counter()
        elapsed = now - self.t_last
        if elapsed < _REPORT_INTERVAL_S and not force:
            return
        elapsed = max(elapsed, 1e-9)
        message = {
            **self.last,
            "training_step": step,
            "steps_per_s": (step - self.step_last) / elapsed,
            "wait_fraction": min(1.0, self.waited / elapsed),
            "priority_updates_applied": self.applied,
            "priority_updates_dropped": self.dropped,
            "weights_version": weights_version,
            "buffer_steps": buffer_steps,
            "device": self.device,
            "state": state,
            **(self.lock_stats() if self.lock_stats is not None else {}),
        }
        self.reports.put(("metrics", "learner", message))
        self.t_last, self.step_last, self.waited = now, step, 0.0
