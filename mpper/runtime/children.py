"""The process mains the supervisor starts: each one schedules one role of
``runtime/roles.py`` in its own process, until the run's stop signal.

    run_selfplay   SelfPlay.turn into a BufferSink, as fast as the ratio allows, until the
                   stop signal or the end of self-play (run.selfplay_over)
    run_learner    wait for min_buffer_steps, then Learner.sample/step (the next batch
                   drawn in a thread while this one trains), checkpoints, metrics reports
    run_reanalyser the algorithm's reanalyser, one batch per published weight version
    run_evaluator  an Evaluation round every runtime.evaluation_interval_s

Every argument is picklable (they start from a forkserver): the run's
:class:`~mpper.runtime.setup.RunSetup`, the handles of the shared buffer and weight
store (the supervisor owns both segments; a child attaches and closes), ``stop`` (a
:class:`~mpper.runtime.procs.StopSignal`, or any event: ``is_set()``, ``wait(timeout)``),
``reports`` (a queue to the supervisor: ``("episode" | "metrics" | "reanalyse" | "eval" |
"error", name, payload)``) and, for self-play and the learner, the run's
:class:`~mpper.runtime.rate.RateLimiter` (None without ``training.samples_per_insert`` or ``training.replay_ratio``).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..replay.buffer import ReplayBuffer
from .inference import InferenceHandle, InferenceSlots, InferenceStopped, SearchInterrupted, ServedWeights
from .procs import child_process
from .rate import RateLimiter
from .roles import BufferSink, Evaluation, LatestWeights, Learner, SelfPlay, evaluation_envs, selfplay_envs
from .run import selfplay_over
from .setup import RunSetup

__all__ = ["run_evaluator", "run_learner", "run_reanalyser", "run_selfplay"]

_REPORT_INTERVAL_S = 1.0
_POLL_S = 0.1  # how long one sleep on the stop event lasts while the buffer fills


def run_selfplay(setup: RunSetup, worker_id: int, buffer_handle, weight_handle, stop, reports, seed: int,
                 rate: RateLimiter | None = None, inference_handle: InferenceHandle | None = None) -> None:  # fmt: skip
    """Self-play worker ``worker-<worker_id>``: play, store whole episodes (or the pieces
    of a game the algorithm stores as it goes), report the games that end. With
    ``inference_handle``, its search's network is the inference server's (slot
    ``worker_id``; ``runtime/inference.py``) rather than a copy of its own."""
    name = f"worker-{worker_id}"
    config = setup.config
    with child_process(name, config, reports, stop, buffer_handle, weight_handle) as (buf, store):
        if config.runtime.selfplay_niceness:
            os.nice(config.runtime.selfplay_niceness)
        torch.manual_seed(seed)
        envs = selfplay_envs(config, name, config.runtime.envs_per_worker)
        slots = InferenceSlots.attach(inference_handle) if inference_handle is not None else None
        try:
            weights = LatestWeights(setup, store) if slots is None else ServedWeights(slots, worker_id, stop)
            if not weights.wait_first(stop):
                return
            selfplay = SelfPlay(setup, name, envs, weights, seed, worker_id)
            sink = BufferSink(buf, rate, stop, lambda source, report: reports.put(("episode", source, report)))
            # training.after_env_steps "train": self-play ends at the env-step budget; the learner goes on
            while not stop.is_set() and not selfplay_over(config.training, buf.counters["steps"]):
                try:
                    selfplay.turn(sink)
                except SearchInterrupted:  # the server restarted mid-search: no env stepped, play the move again
                    continue
                except InferenceStopped:
                    return
        finally:
            if slots is not None:
                slots.close()


def run_learner(setup: RunSetup, buffer_handle, weight_handle, stop, reports, rate: RateLimiter | None = None) -> None:
    """The learner: waits until ``training.min_buffer_steps`` env steps were stored, then
    trains until ``training.training_steps`` or ``stop``, within the ratio ``rate``
    allows; ``checkpoint.pt`` every ``runtime.checkpoint_interval_s`` and at the end;
    ``("metrics", "learner", {...})`` about once a second."""
    with child_process("learner", setup.config, reports, stop, buffer_handle, weight_handle) as (buf, store):
        _learn(setup, Learner(setup, buf, store), buf, stop, reports, rate)


def _learn(setup: RunSetup, learner: Learner, buf: ReplayBuffer, stop, reports, rate: RateLimiter | None) -> None:
    config = setup.config
    meter = _Meter(reports, learner, buf)

    # 1. Wait until min_buffer_steps env steps have been stored, sleeping on the stop
    # event. Counted as the rate limiter counts them (steps ever stored), not as the
    # positions the ring holds now: whole episodes leave a gap at the wrap and each keeps
    # one row more than its moves, so a ring of capacity C never holds C positions.
    while buf.counters["steps"] < config.training.min_buffer_steps and not stop.is_set():
        t0 = time.perf_counter()
        stop.wait(_POLL_S)
        meter.waited += time.perf_counter() - t0
        meter.maybe_report("waiting_for_data")

    # 2. Train. The next batch is drawn in a helper thread while this one trains (the
    # buffer's compiled kernels release the GIL, torch too), so sampling costs the
    # learner no time unless training outruns it. A batch is drawn ahead only when the
    # rate limiter would allow it now; otherwise the loop waits for the ratio first.
    def may_sample() -> bool:
        c = buf.counters
        return rate is None or rate.can_sample(c["steps"], c["samples"])  # samples counts the batch in hand

    last_checkpoint = time.monotonic()
    prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpper-prefetch")
    pending = None
    try:
        while not learner.done and not stop.is_set():
            t0 = time.perf_counter()
            if pending is None:
                if rate is not None:
                    rate.wait_to_sample(lambda: buf.counters["steps"], lambda: buf.counters["samples"], stop)
                    if stop.is_set():
                        meter.waited += time.perf_counter() - t0
                        break
                pending = prefetcher.submit(learner.sample, learner.training_step)
            batch, pending = pending.result(), None
            if rate is not None:
                rate.notify()  # the samples counter moved: wake writers the ratio held back
            meter.waited += time.perf_counter() - t0  # time not spent training: waiting for data
            if may_sample():
                pending = prefetcher.submit(learner.sample, learner.training_step + 1)
            learner.step(batch)
            if time.monotonic() - last_checkpoint >= config.runtime.checkpoint_interval_s:
                try:
                    learner.checkpoint()
                except OSError as exc:  # a full disk: the previous checkpoint stays whole (atomic write)
                    print(f"mpper: learner: checkpoint not written to {setup.run_dir.checkpoint} "
                          f"({exc.strerror or exc}); the previous one there is unchanged; training goes on",
                          file=sys.stderr, flush=True)  # fmt: skip
                last_checkpoint = time.monotonic()
            meter.maybe_report("training")
    finally:
        prefetcher.shutdown(wait=True, cancel_futures=True)

    # 3. The end (training_steps reached, or stop): final weights, checkpoint, report.
    learner.publish()
    learner.checkpoint()
    meter.maybe_report("done", force=True)


class _Meter:
    """The learner's report: rates over each report interval.

    ``waited`` accumulates the seconds not spent training: the wait for the first
    ``min_buffer_steps``, the rate limiter, and sampling (the learner has no batch
    until ``sample`` returns). ``wait_fraction`` is its share of the interval's wall time.
    """

    def __init__(self, reports, learner: Learner, buf: ReplayBuffer) -> None:
        self.reports, self.learner, self.buf = reports, learner, buf
        self.t_last = time.perf_counter()
        self.step_last = learner.training_step
        self.waited = 0.0

    def maybe_report(self, state: str, force: bool = False) -> None:
        now = time.perf_counter()
        elapsed = now - self.t_last
        if elapsed < _REPORT_INTERVAL_S and not force:
            return
        elapsed = max(elapsed, 1e-9)
        learner, step = self.learner, self.learner.training_step
        message = {
            **learner.metrics,
            "training_step": step,
            "steps_per_s": (step - self.step_last) / elapsed,
            "wait_fraction": min(1.0, self.waited / elapsed),
            "priority_updates_applied": learner.priorities_applied,  # cumulative
            "priority_updates_dropped": learner.priorities_dropped,  # slot rewritten since sampling, cumulative
            "weights_version": learner.store.version,
            "buffer_steps": len(self.buf),
            "device": str(learner.device),
            "state": state,
            **self.buf.lock_wait_stats(),
        }
        self.reports.put(("metrics", "learner", message))
        self.t_last, self.step_last, self.waited = now, step, 0.0


def run_reanalyser(setup: RunSetup, buffer_handle, weight_handle, stop, reports) -> None:
    """The algorithm's reanalyser until ``stop``: one batch per published weight version;
    ``("reanalyse", "reanalyser", {**stats(), "episodes_per_s"})`` about once a second
    (MuZero's stats: episodes, dropped, weights_version, searched_episodes,
    positions_searched) and once at exit."""
    name = "reanalyser"
    with child_process(name, setup.config, reports, stop, buffer_handle, weight_handle) as (buf, store):
        make_reanalyser = setup.algorithm.make_reanalyser
        assert make_reanalyser is not None  # started only for an algorithm that reanalyses
        worker = make_reanalyser(setup.config, buf, store)
        while store.version < 1:  # nothing published yet
            if stop.wait(0.1):
                return
        last_time, last_count = time.monotonic(), 0

        def report(now: float) -> None:
            stats = worker.stats()
            rate = (stats["episodes"] - last_count) / max(now - last_time, 1e-9)
            reports.put(("reanalyse", name, {**stats, "episodes_per_s": rate}))

        fresh = True
        while not stop.is_set():
            fresh = worker.refresh_weights() or fresh
            if not fresh:
                # One batch per published weight version: muzero-general reanalyses
                # flat out, which on a few cores takes the CPU self-play needs, and
                # values from the same weights would come out the same again.
                stop.wait(0.02)
            else:
                stored, dropped = worker.step()
                fresh = stored == 0 and dropped == 0  # empty buffer: try again soon
                if fresh:
                    stop.wait(0.1)
            now = time.monotonic()
            if now - last_time >= _REPORT_INTERVAL_S:
                report(now)
                last_time, last_count = now, worker.stats()["episodes"]
        report(time.monotonic())


def run_evaluator(setup: RunSetup, weight_handle, stop, reports) -> None:
    """The evaluator: an :class:`~mpper.runtime.roles.Evaluation` round with the newest
    weights every ``runtime.evaluation_interval_s``, reported as ``("eval", "evaluator",
    record)``; ``best.pt`` kept by the role."""
    name = "evaluator"
    config = setup.config
    with child_process(name, config, reports, stop, weight_handle=weight_handle) as (_, store):
        weights = LatestWeights(setup, store)
        if not weights.wait_first(stop):
            return
        evaluation = Evaluation(setup, store, evaluation_envs(config, name, config.runtime.evaluation_episodes))
        while not stop.is_set():
            started = time.monotonic()
            weights.refresh()
            record = evaluation.round(weights.network, weights.training_step, weights.version, stop)
            if record is not None:
                reports.put(("eval", name, record))
                evaluation.film(weights.network, weights.training_step, stop)
            stop.wait(max(0.0, config.runtime.evaluation_interval_s - (time.monotonic() - started)))
