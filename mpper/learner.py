"""The MuZero learner: one training update, checkpoints, and the learner process.

Read top-down:

1. ``cross_entropy``: the tensor helper of the loss (``scale_gradient`` is the
   network module's, where the unroll uses it).
2. ``MuZeroTrainer``: muzero-general's ``Trainer.update_weights`` / ``loss_function`` on
   an mpper ``Batch`` (built by ``MuZeroTargets``): unroll K steps, value / reward /
   policy cross-entropies, importance weights, new priorities, one optimizer step.
3. ``save_checkpoint`` / ``load_checkpoint``: atomic ``checkpoint.pt`` that loads with
   ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, dicts only).
4. ``run_learner``: the learner process (spawned by ``mpper.runtime``): wait for data,
   then sample -> train -> write priorities back -> publish weights -> checkpoint,
   reporting metrics about once per second.

Shapes: B is the batch, K = num_unroll_steps, A the number of actions, S the support
size (value and reward are distributions over 2S+1 bins).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from .config import Config, config_to_dict
from .envs import config_symmetries
from .networks import make_model, scalar_to_support, scale_gradient, support_to_scalar
from .procs import child_init, report_error
from .replay_buffer import Batch, ReplayBuffer
from .symmetry import SymmetryAugmented
from .targets import MuZeroTargets, NStepTargets
from .weights import WeightStore

__all__ = [
    "CheckpointError",
    "MuZeroTrainer",
    "Trainer",
    "cross_entropy",
    "beta_schedule",
    "load_checkpoint",
    "load_network_weights",
    "make_targets",
    "make_trainer",
    "pick_device",
    "run_learner",
    "save_checkpoint",
    "save_network_checkpoint",
    "scale_gradient",
]

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
_REPORT_INTERVAL_S = 1.0
_POLL_S = 0.1  # how long one sleep on the stop event lasts while the buffer fills


# --------------------------------------------------------------------------------------
# 1. Loss helpers
# --------------------------------------------------------------------------------------


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of a target distribution over the last axis:
    (..., N), (..., N) -> (...).

    muzero-general's ``loss_function`` (``-sum(target * log_softmax(logits))``): the
    targets are soft (two-hot supports, visit distributions), so this is not
    ``F.cross_entropy`` with class indices."""
    return -(target * torch.log_softmax(logits, dim=-1)).sum(dim=-1)


# --------------------------------------------------------------------------------------
# 2. The update
# --------------------------------------------------------------------------------------


class Trainer:
    """What every algorithm's trainer has: the network on its device, its optimizer, the
    training-step counter, the learning-rate schedule, host -> device copies of a batch,
    and the state a checkpoint holds. Subclasses add ``train_step(batch) -> (metrics,
    raw priorities)``: ``MuZeroTrainer`` below, ``mpper.dqn.DQNTrainer``.
    """

    def __init__(self, config: Config, network: torch.nn.Module, device: torch.device):
        self.config = config
        self.train_config = t = config.training
        self.device = torch.device(device)
        self.network = network.to(self.device)
        self.network.train()
        self.training_step = 0  # completed updates; the lr of the next one depends on it
        params = list(self.network.parameters())
        # One fused kernel for the whole Adam update instead of a dozen tensor ops per
        # parameter (torch >= 2.4, CPU and CUDA): the same arithmetic, and a whole DQN
        # learner step on CartPole data (sample, train, priorities; one thread) went
        # from 1.36 to 1.15 ms.
        self._fused = t.optimizer == "adam" and self.device.type in ("cpu", "cuda")
        if t.optimizer == "adam":
            self.optimizer = torch.optim.Adam(params, lr=t.lr_init, weight_decay=t.weight_decay,
                                              fused=self._fused or None)  # fmt: skip
        elif t.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=t.lr_init, momentum=t.momentum, weight_decay=t.weight_decay)
        else:
            raise ValueError(f'training.optimizer must be "adam" or "sgd", got {t.optimizer!r}')
        # Polyak averaging (training.ema_decay): the weights the run publishes -- self-play
        # acts with them, the evaluator judges them, checkpoint.pt's "network" holds them --
        # are an exponential moving average of the trained ones, which smooths the noise of
        # single SGD steps (on TicTacToe it made no measurable difference: README).
        self.averaged: AveragedModel | None = None
        if t.ema_decay is not None:
            self.averaged = AveragedModel(self.network, multi_avg_fn=get_ema_multi_avg_fn(t.ema_decay),
                                          use_buffers=True)  # fmt: skip
        # CUDA only: pinned host copies of the batch arrays, reused every step, and the
        # event that says the last copies out of them have finished (see _to_device).
        self._pinned: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    @property
    def published_network(self) -> torch.nn.Module:
        """The network everyone acts with: the moving average when ``ema_decay`` is set,
        else the trained network itself."""
        if self.averaged is None or int(self.averaged.n_averaged) == 0:  # nothing averaged yet
            return self.network
        return self.averaged.module

    def update_average(self) -> None:
        """Fold the trained weights into the moving average; call after each
        ``train_step`` (no-op without ``ema_decay``). The first call copies them."""
        if self.averaged is not None:
            self.averaged.update_parameters(self.network)

    def learning_rate(self, step: int | None = None) -> float:
        """``lr_init * lr_decay_rate ** (step / lr_decay_steps)`` (muzero-general's
        ``update_lr``), for ``step`` completed updates (default: now)."""
        t = self.train_config
        step = self.training_step if step is None else step
        return t.lr_init * t.lr_decay_rate ** (step / t.lr_decay_steps)

    # ---- host -> device ---------------------------------------------------------------
    def _to_device(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """numpy arrays -> tensors on the device.

        CPU: ``torch.from_numpy`` views, no copy at all. CUDA: each array is copied into
        a persistent page-locked (pinned) host tensor, from which the copy to the GPU
        runs asynchronously (``non_blocking``) and overlaps with the work queued before
        it. A pinned tensor is overwritten only after the previous step's copy out of it
        has finished (the event), never while the GPU may still be reading it.
        """
        if self.device.type != "cuda":
            return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
        if self._copied is not None:
            self._copied.synchronize()
        out = {}
        for key, value in arrays.items():
            host = torch.from_numpy(np.ascontiguousarray(value))
            pinned = self._pinned.get(key)
            if pinned is None or pinned.shape != host.shape or pinned.dtype != host.dtype:
                pinned = self._pinned[key] = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            pinned.copy_(host)
            out[key] = pinned.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Network, optimizer and step counter: tensors, numbers, strings, lists and
        dicts only, so that ``torch.load(weights_only=True)`` reads it back."""
        # "network" is always what the run published (evaluation, --evaluate and the
        # arena read it); with a moving average the trained weights go to "online_network".
        state = {
            "network": self.published_network.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "training_step": int(self.training_step),
        }
        if self.averaged is not None:
            state["online_network"] = self.network.state_dict()
            state["averaged_updates"] = int(self.averaged.n_averaged)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (or a checkpoint holding it). A checkpoint
        written without ``ema_decay`` starts the average afresh from its weights."""
        missing = [k for k in ("network", "optimizer", "training_step") if k not in state]
        if missing:
            raise ValueError(f"trainer state is missing {missing}; has {sorted(state)}")
        online = state.get("online_network", state["network"])
        self.network.load_state_dict(online)  # copies onto the network's device
        # This run's choice of fused kernel wins over the checkpoint's (one saved before
        # fusing, or on another device); set before loading, so that load_state_dict puts
        # Adam's step counters where a fused step wants them (on the params' device).
        optimizer_state = dict(state["optimizer"])
        optimizer_state["param_groups"] = [{**g, "fused": self._fused or None} for g in optimizer_state["param_groups"]]
        self.optimizer.load_state_dict(optimizer_state)  # moves the state to the params' device
        self.training_step = int(state["training_step"])
        if self.averaged is not None:
            self.averaged.module.load_state_dict(state["network"])
            self.averaged.n_averaged.fill_(int(state.get("averaged_updates", 0)))


class MuZeroTrainer(Trainer):
    """``train_step(batch)`` is one update on a batch sampled with ``MuZeroTargets``; it
    returns the metrics and the new raw priorities of the sampled positions (the buffer
    applies ``alpha`` itself).
    """

    # ---- one update ---------------------------------------------------------------------
    def train_step(self, batch: Batch) -> tuple[dict[str, float], np.ndarray]:
        """One optimizer step on ``batch``; returns (metrics, raw priorities float64: (B,),
        or (B, K+1) with ``training.priority_update`` "unrolled").

        ``batch.data`` (from ``MuZeroTargets``): observation (B, *obs), actions (B, K+1)
        (column 0 unused: the action that led to the root), target_value,
        target_reward, gradient_scale (B, K+1), target_policy (B, K+1, A);
        ``batch.weights`` (B,) importance weights.

        Raises FloatingPointError, before the optimizer step, if the loss or the
        gradient norm is not finite: the weights, the optimizer state and the step
        counter are then unchanged, and no priority comes back.
        """
        t = self.train_config
        net = self.network
        support = net.support_size
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        d = self._to_device({**batch.data, "weights": batch.weights})
        observation = d["observation"].float()  # (B, *obs)
        actions = d["actions"]  # (B, K+1) int64
        gradient_scale = d["gradient_scale"]  # (B, K+1)
        weights = d["weights"]  # (B,)
        target_policy = d["target_policy"]  # (B, K+1, A)
        batch_size, k1 = actions.shape
        # scalars (B, K+1) -> two-hot supports (B, K+1, 2S+1)
        target_value = scalar_to_support(d["target_value"].reshape(-1), support).view(batch_size, k1, -1)
        target_reward = scalar_to_support(d["target_reward"].reshape(-1), support).view(batch_size, k1, -1)

        # The unroll: step 0 from the real observation, steps 1..K through the dynamics
        # on the actions actually taken, the hidden state passed between dynamics steps
        # through scale_gradient(h, 0.5) as in the pseudocode's update_weights (so the
        # gradient of a loss k steps deep reaches the representation scaled by 0.5^(k-1);
        # muzero-general hooks the hidden state a step returns, which also halves the
        # gradient of that step's own predictions into the dynamics).
        unrolled = net.unroll(observation, actions[:, 1:], 0.5)
        value_ce = cross_entropy(unrolled.value_logits, target_value)  # (B, K+1)
        policy_ce = cross_entropy(unrolled.policy_logits, target_policy)  # (B, K+1)
        # No reward loss at step 0: nothing was received before the root (muzero-general
        # skips it as well).
        reward_ce = cross_entropy(unrolled.reward_logits, target_reward[:, 1:])  # (B, K)
        # Each unrolled step's gradient is divided by the number of unrolled steps
        # (muzero-general registers grad / gradient_scale hooks on these losses);
        # scale_gradient does the same and leaves the reported loss values alone.
        per_step = 1.0 / gradient_scale[:, 1:]  # (B, K)
        value_loss = value_ce[:, 0] + scale_gradient(value_ce[:, 1:], per_step).sum(1)  # (B,)
        policy_loss = policy_ce[:, 0] + scale_gradient(policy_ce[:, 1:], per_step).sum(1)
        reward_loss = scale_gradient(reward_ce, per_step).sum(1)

        # Per-sample loss (B,), weighted by the importance weights that correct the
        # prioritized sampling's bias, then the mean over the batch.
        per_sample = value_loss * t.value_loss_weight + reward_loss + policy_loss
        loss = (per_sample * weights).mean()

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for p in net.parameters() if p.grad is not None]
        if t.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)  # the norm before clipping
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])

        # New raw priorities |v - z|: of the sampled positions (B,), or of every unrolled
        # position (B, K+1) with training.priority_update "unrolled" (the buffer writes
        # column k to the position k moves later in the same episode, where there is one).
        with torch.no_grad():
            if t.priority_update == "unrolled":
                logits = unrolled.value_logits.detach()
                predicted = support_to_scalar(logits.reshape(-1, logits.shape[-1]), support).view(batch_size, k1)
                priorities = (predicted - d["target_value"]).abs().reshape(-1)
            else:
                root_value = support_to_scalar(unrolled.value_logits[:, 0].detach(), support)
                priorities = (root_value - d["target_value"][:, 0]).abs()
            # The reported component losses are IS-weighted batch means like the total,
            # so total = value_loss_weight * value + reward + policy holds exactly.
            stats = torch.stack([
                loss.detach(), (value_loss * weights).mean(), (reward_loss * weights).mean(),
                (policy_loss * weights).mean(), grad_norm.to(loss.dtype),
            ])  # fmt: skip
            # One device -> host transfer (one CUDA synchronisation) per step.
            host = torch.cat([stats, priorities.to(stats.dtype)]).to("cpu", torch.float64).numpy()
        total, value, reward, policy, norm = (float(x) for x in host[:5])
        priorities = host[5:].copy()
        if t.priority_update == "unrolled":
            priorities = priorities.reshape(batch_size, k1)
        if not (math.isfinite(total) and math.isfinite(value) and math.isfinite(reward) and math.isfinite(policy)):
            raise FloatingPointError(f"non-finite loss at training step {self.training_step}")
        if not math.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm at training step {self.training_step}")
        if not np.isfinite(priorities).all():  # pragma: no cover - finite logits give finite values
            raise FloatingPointError(f"non-finite priorities at training step {self.training_step}")

        self.optimizer.step()
        self.training_step += 1
        metrics = {
            "total_loss": total,
            "value_loss": value,
            "reward_loss": reward,
            "policy_loss": policy,
            "grad_norm": norm,
            "lr": lr,
            "training_step": self.training_step,
        }
        return metrics, priorities


# --------------------------------------------------------------------------------------
# 3. Checkpoints
# --------------------------------------------------------------------------------------


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read back (corrupt, truncated, or holding
    something other than tensors, numbers, strings, lists and dicts)."""


def save_checkpoint(path: str | os.PathLike, trainer: Trainer, extra: dict | None = None) -> None:
    """Write ``trainer.state_dict()`` plus ``extra`` (plain values) to ``path`` atomically.

    The file is written under a temporary name in the same directory, flushed to disk
    and renamed over ``path``: a crash at any moment leaves either the previous
    checkpoint or the new one, never a torn file.
    """
    _save_atomic(Path(path), {"format": CHECKPOINT_FORMAT, **trainer.state_dict(), "extra": dict(extra or {})})


def save_network_checkpoint(path: str | os.PathLike, network: torch.nn.Module, training_step: int,
                            extra: dict | None = None) -> None:  # fmt: skip
    """Write a network alone (no optimizer) as a checkpoint that ``load_checkpoint`` and
    ``--evaluate --checkpoint`` read: the evaluator's ``best.pt``."""
    payload = {"format": CHECKPOINT_FORMAT, "network": network.state_dict(), "training_step": int(training_step),
               "extra": dict(extra or {})}  # fmt: skip
    _save_atomic(Path(path), payload)


def _save_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a checkpoint written by ``save_checkpoint`` (tensors on the CPU).

    ``torch.load(weights_only=True)``: a file holding any other pickled object is
    refused without running its code. Raises FileNotFoundError or CheckpointError,
    naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError (bad zip), EOFError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path}: cannot be loaded with torch.load(weights_only=True): {first}"
        ) from exc
    if not isinstance(state, dict) or "network" not in state:
        raise CheckpointError(f"checkpoint {path}: not an mpper checkpoint (no 'network' entry)")
    return state


def load_network_weights(network: torch.nn.Module, weights: Mapping, path: str | os.PathLike,
                         entry: str = "network") -> torch.nn.Module:  # fmt: skip
    """Load ``weights`` (the ``entry`` state dict of checkpoint ``path``) into ``network``
    after checking that they fit it; CheckpointError, one line naming the first tensor
    that is missing, extra or of another shape (with both shapes), when they do not: a
    checkpoint written for another config (network sizes, env, algorithm)."""
    wanted = network.state_dict()
    where = f"checkpoint {path}: '{entry}'"
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{where} is not a state dict of tensors")
    for name, tensor in wanted.items():
        if name not in weights:
            raise CheckpointError(f"{where} has no tensor {name!r} (shape {tuple(tensor.shape)} in the network of "
                                  f"this config): written for another config")  # fmt: skip
        stored = weights[name]
        if not isinstance(stored, torch.Tensor):
            raise CheckpointError(f"{where}: {name!r} is a {type(stored).__name__}, not a tensor")
        if tuple(stored.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(stored.shape)}, the network of this "
                                  f"config has {tuple(tensor.shape)}: written for another config")  # fmt: skip
    extra = [name for name in weights if name not in wanted]
    if extra:
        shape = tuple(getattr(weights[extra[0]], "shape", ()))
        raise CheckpointError(f"{where} has tensor {extra[0]!r} (shape {shape}), which the network of this config "
                              f"does not: written for another config")  # fmt: skip
    network.load_state_dict(weights)
    return network


# --------------------------------------------------------------------------------------
# 4. The learner process
# --------------------------------------------------------------------------------------


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
    ``rate``: optional samples-per-insert control, an ``mpper.rate.RateLimiter`` or any
    object whose ``wait_to_sample(stop)`` blocks while the learner is ahead of
    self-play (see ``_rate_hooks``); called before each sample.
    """
    child_init(config.runtime.torch_threads)
    buf = store = None
    try:
        buf = ReplayBuffer.attach(buffer_handle)
        store = WeightStore.attach(weight_handle)
        _learn(config, buf, store, stop, reports, Path(run_dir), resume_checkpoint, rate)
    except Exception:
        report_error(reports, "learner")
        raise
    finally:
        if store is not None:
            store.close()
        if buf is not None:
            buf.close()


def _learn(config: Config, buf: ReplayBuffer, store: WeightStore, stop, reports, run_dir: Path,
           resume_checkpoint: str | None, rate) -> None:  # fmt: skip
    t = config.training
    device = pick_device(config.runtime.device)
    torch.manual_seed(config.runtime.seed)
    rng = np.random.default_rng([config.runtime.seed, 0x1EA2])  # the learner's own sampling stream

    # The model and its trainer, sized from the buffer's schema (and the env for DQN,
    # whose rows carry no per-action field).
    obs_shape = tuple(buf.fields["observation"].shape[1:])
    if config.algorithm == "dqn":
        from .envs import env_spec

        num_actions = env_spec(config.env).num_actions
    else:
        num_actions = int(buf.fields["child_visits"].shape[1])
    network = make_model(config, obs_shape, num_actions)
    trainer = make_trainer(config, network, device)

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
        network.set_flat_weights(flat)
        if hasattr(trainer, "sync_target"):  # DQN: the target starts as a copy of the online net
            trainer.sync_target()
    published_at = trainer.training_step

    targets = make_targets(config, num_actions)
    wait_for_rate, notify_rate = _rate_hooks(rate, buf)

    def may_draw_ahead() -> bool:
        if rate is None:
            return True
        if hasattr(rate, "can_sample"):  # mpper.rate.RateLimiter: ask without waiting
            c = buf.counters
            return rate.can_sample(c["steps"], c["samples"])  # samples counts this batch already
        return False  # an unknown rate controller: only draw when it says so
    checkpoint_path = run_dir / CHECKPOINT_NAME
    meter = _Meter(reports, trainer.training_step, device, buf.lock_wait_stats)

    def checkpoint() -> None:
        extra = {"config": config_to_dict(config), "weights_version": store.version, "time": time.time()}
        save_checkpoint(checkpoint_path, trainer, extra)

    # 1. Wait for min_buffer_steps stored positions, sleeping on the stop event.
    while len(buf) < t.min_buffer_steps and not stop.is_set():
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
            if step % t.checkpoint_interval == 0:
                store.publish(trainer.published_network.get_flat_weights(), step)
                published_at = step
            if time.monotonic() - last_checkpoint >= config.runtime.checkpoint_interval_s:
                checkpoint()
                last_checkpoint = time.monotonic()
            meter.maybe_report(step, store.version, len(buf), state="training")
    finally:
        prefetcher.shutdown(wait=True, cancel_futures=True)

    # 3. The end (training_steps reached, or stop): final weights, checkpoint, report.
    if trainer.training_step != published_at:
        store.publish(trainer.published_network.get_flat_weights(), trainer.training_step)
    checkpoint()
    meter.maybe_report(trainer.training_step, store.version, len(buf), state="done", force=True)


def make_trainer(config: Config, network, device: torch.device):
    """The trainer of ``config.algorithm``: ``MuZeroTrainer`` or ``mpper.dqn.DQNTrainer``
    (both: ``train_step(batch) -> (metrics, priorities)``, ``training_step``,
    ``network``, ``state_dict`` / ``load_state_dict``)."""
    if config.algorithm == "dqn":
        from .dqn import DQNTrainer

        return DQNTrainer(config, network, device)
    return MuZeroTrainer(config, network, device)


def make_targets(config: Config, num_actions: int):
    """What ``ReplayBuffer.sample`` builds for the learner: MuZero unroll targets (seen
    through a random board symmetry with ``training.symmetry_augmentation``), or DQN
    n-step transitions."""
    t = config.training
    if config.algorithm == "dqn":
        return NStepTargets(config.dqn.n_step, config.dqn.gamma)
    targets = MuZeroTargets(
        num_unroll_steps=t.num_unroll_steps, td_steps=t.td_steps, discount=config.mcts.discount,
        num_actions=num_actions, stacked_observations=t.stacked_observations,
    )  # fmt: skip
    if t.symmetry_augmentation:
        return SymmetryAugmented(targets, config_symmetries(config))
    return targets


def beta_schedule(config: Config, step: int) -> float:
    """Importance-sampling exponent after ``step`` updates: linear from ``replay.beta``
    to 1 over ``replay.beta_anneal_steps`` (default: all training steps), then 1."""
    r = config.replay
    horizon = r.beta_anneal_steps or config.training.training_steps
    return r.beta + (1.0 - r.beta) * min(1.0, step / horizon)


def _rate_hooks(rate, buf: ReplayBuffer):
    """``(wait(stop), notify())`` for the rate controller ``rate`` (either may be None).

    Two kinds are accepted: ``mpper.rate.RateLimiter`` (it decides from the buffer's
    shared ``steps`` (inserted) and ``samples`` counters, and wants ``notify()`` after
    each sample so that self-play writers waiting on the ratio wake up), or any object
    whose ``wait_to_sample(stop)`` blocks while the learner is ahead."""
    if rate is None:
        return None, None
    if hasattr(rate, "can_sample"):  # mpper.rate.RateLimiter

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
