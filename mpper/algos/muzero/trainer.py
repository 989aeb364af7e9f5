"""MuZero's update: muzero-general's ``Trainer.update_weights`` / ``loss_function`` on an
mpper ``Batch`` (built by :class:`~mpper.algos.muzero.targets.MuZeroTargets`): unroll K
steps, value / reward / policy cross-entropies (and, with
``muzero.consistency_loss_weight``, EfficientZero's consistency loss), importance
weights, new priorities, one optimizer step.

Shapes: B is the batch, K = num_unroll_steps, A the number of actions, S the support
size (value and reward are distributions over 2S+1 bins).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple

import numpy as np
import torch

from ...replay.buffer import Batch
from ..base import Finished, Trainer
from ..muzero_family import consistency_loss
from .config import MuZeroRunConfig
from .networks import MuZeroNetwork, scalar_to_support, scale_gradient, support_to_scalar
from .static_step import StaticStep, static_mode
from .targets import MuZeroTargets

__all__ = ["Losses", "MuZeroTrainer", "cross_entropy", "stack_frames"]


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of a target distribution over the last axis:
    (..., N), (..., N) -> (...).

    muzero-general's ``loss_function`` (``-sum(target * log_softmax(logits))``): the
    targets are soft (two-hot supports, visit distributions), so this is not
    ``F.cross_entropy`` with class indices."""
    return -(target * torch.log_softmax(logits, dim=-1)).sum(dim=-1)


def stack_frames(d: dict[str, torch.Tensor], num_stacked: int, num_actions: int) -> torch.Tensor:
    """``MuZeroTargets(stack_on_device=True)``'s rows -> the stacked observations that
    ``stacked_observations`` makes on the host, (B, 1 + K', C + n (C + 1), ...) float32:
    column 0 of position t, column k of o_{t + frame_ahead[:, k - 1]}. Static shapes and
    no host synchronisation (the captured step runs it).

    ``d``: frames (B, W, C, ...) with W = n + 1 + K' (rows t - n .. t + K', clamped into
    the episode), frame_actions (B, W), frame_position (B,) and frame_ahead (B, K')."""
    frames, actions = d["frames"], d["frame_actions"]
    batch, window = frames.shape[:2]
    n = num_stacked
    centers = torch.cat([d["frame_ahead"].new_zeros(batch, 1), d["frame_ahead"]], 1)  # (B, M): rows after t
    back = torch.arange(n + 1, device=frames.device)  # s = 0 (the row itself) .. n
    index = n + centers[:, :, None] - back  # (B, M, n + 1): the window column of row c - s
    valid = (d["frame_position"][:, None, None] + centers[:, :, None] - back) >= 0  # row c - s is in the episode
    rows = torch.arange(batch, device=frames.device)[:, None, None]
    observed = frames[rows, index].float()  # (B, M, n + 1, C, ...)
    rest = (1,) * (observed.dim() - 3)
    observed = observed * valid.view(*valid.shape, *rest)
    if n == 0:
        return observed[:, :, 0]
    # the action taken at row c - s is on row c - s + 1 (in the window wherever c - s is valid)
    took = actions[rows, (index + 1).clamp(max=window - 1)].float() / num_actions * valid  # (B, M, n + 1)
    plane_shape = (*observed.shape[:3], 1, *observed.shape[4:])
    planes = took.view(*took.shape, *rest).expand(plane_shape)
    past = torch.cat([observed[:, :, 1:], planes[:, :, 1:]], 3)  # (B, M, n, C + 1, ...)
    return torch.cat([observed[:, :, 0], past.flatten(2, 3)], 2)


class Losses(NamedTuple):
    """One update's forward half on the device: the loss to minimise (0-d), the per-sample
    component losses (B,) before the importance weights, those weights (B,), and the new
    raw priorities, (B,) or (B * (K+1),) with ``muzero.priority_update`` "unrolled"."""

    loss: torch.Tensor
    value_loss: torch.Tensor
    reward_loss: torch.Tensor
    policy_loss: torch.Tensor
    consistency: torch.Tensor
    weights: torch.Tensor
    priorities: torch.Tensor

    def readout(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """What the host reads of one update, one float32 vector on the device: total,
        value, reward, policy losses, the gradient norm, the consistency loss, then the
        priorities. The reported component losses are IS-weighted batch means like the
        total, so total = value_loss_weight * value + reward + policy
        + consistency_loss_weight * consistency holds exactly."""
        w = self.weights
        stats = torch.stack([
            self.loss.detach(), (self.value_loss * w).mean(), (self.reward_loss * w).mean(),
            (self.policy_loss * w).mean(), grad_norm.to(self.loss.dtype), (self.consistency * w).mean(),
        ])  # fmt: skip
        return torch.cat([stats.detach(), self.priorities.to(stats.dtype)])


class MuZeroTrainer(Trainer[MuZeroRunConfig]):
    """``train_step(batch)`` is one update on a batch sampled with ``MuZeroTargets``; it
    returns the metrics and the new raw priorities of the sampled positions (the buffer
    applies ``alpha`` itself).
    """

    network: MuZeroNetwork

    def __init__(self, config: MuZeroRunConfig, network, device: torch.device) -> None:
        super().__init__(config, network, device)
        t = self.train_config
        mode = static_mode(t.capture, self.device)
        # training.capture: the static-shape step (static_step.py) on persistent tensors,
        # captured or compiled on CUDA; None: the eager step below
        self.static: StaticStep | None = None
        if mode is not None:
            self.static = StaticStep(self, mode, t.precision, fall_back=t.capture == "auto")
            self.optimizer = self.static.make_optimizer(list(self.network.parameters()))
        elif t.precision != "fp32":
            raise ValueError(
                f'training.precision: "{t.precision}" needs the static step, training.capture is "{t.capture}"'
            )

    # ---- the step as the learner runs it -------------------------------------------------
    def submit(self, batch: Batch) -> list[Finished]:
        """``Trainer.submit``: with the static step the results come one call late."""
        if self.static is None:
            return super().submit(batch)
        return self.static.submit(batch)

    def drain(self) -> list[Finished]:
        return [] if self.static is None else self.static.drain()

    def learner_targets(self, targets):
        """With the static step, stacked observations are built on the device from the rows
        they are made of (``MuZeroTargets.stack_on_device``: each row once, in its stored
        dtype, instead of ``stacked_observations + 1`` float32 copies per observation)."""
        if self.static is not None and isinstance(targets, MuZeroTargets) and targets.stacked_observations > 0:
            return dataclasses.replace(targets, stack_on_device=True)
        return targets

    def _group_overrides(self) -> dict:
        return super()._group_overrides() if self.static is None else self.static.group_overrides()

    def state_dict(self) -> dict:
        state = super().state_dict()
        # the static step's device-tensor learning rate is saved as the number it holds
        for group in state["optimizer"]["param_groups"]:
            if torch.is_tensor(group.get("lr")):
                group["lr"] = float(group["lr"])
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.static is not None:
            self.static.reset()  # the optimizer's state tensors are new: capture again

    # ---- the losses --------------------------------------------------------------------
    def _autocast(self, dtype: torch.dtype | None):
        """Autocast to ``dtype`` on the trainer's device; nothing at all (not even a
        disabled autocast's bookkeeping) for None, the eager float32 step."""
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def losses(self, d: dict[str, torch.Tensor], autocast: torch.dtype | None = None,
               channels_last: bool = False) -> Losses:  # fmt: skip
        """The forward half of one update on the device tensors ``d`` (the arrays of
        ``train_step``'s batch, importance weights as ``d["weights"]``): the unroll, the
        losses and the new raw priorities, with no host synchronisation (the captured
        step runs the same code). ``autocast``: the network runs under autocast to that
        dtype (bfloat16), its logits are cast back to float32 before the supports and the
        cross-entropies. ``channels_last``: the observations are laid out NHWC for the
        convolutions."""
        m = self.config.muzero
        net = self.network
        support = net.support_size
        next_observation: torch.Tensor | None  # (B, K, *obs): the consistency loss's
        if "frames" in d:  # the rows of the stacked observations (MuZeroTargets.stack_on_device)
            stacked = stack_frames(d, m.stacked_observations, net.num_actions)  # (B, 1 + K', *obs)
            observation, next_observation = stacked[:, 0], stacked[:, 1:]
        else:
            observation = d["observation"].float()  # (B, *obs)
            next_observation = d["next_observation"].float() if m.consistency_loss_weight > 0 else None
        if channels_last:
            observation = observation.contiguous(memory_format=torch.channels_last)
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
        with self._autocast(autocast):
            unrolled = net.unroll(observation, actions[:, 1:], 0.5)
        value_logits, reward_logits, policy_logits = (
            unrolled.value_logits,
            unrolled.reward_logits,
            unrolled.policy_logits,
        )
        if autocast is not None:  # supports, softmaxes and losses in float32
            value_logits, reward_logits, policy_logits = (
                value_logits.float(),
                reward_logits.float(),
                policy_logits.float(),
            )
        # Steps past the cut of a truncated episode (a time limit, a game segment) have
        # nothing recorded to learn from: masked out (MuZeroTargets).
        target_mask, policy_mask = d["target_mask"], d["policy_mask"]  # (B, K+1)
        value_ce = cross_entropy(value_logits, target_value) * target_mask  # (B, K+1)
        policy_ce = cross_entropy(policy_logits, target_policy) * policy_mask  # (B, K+1)
        # No reward loss at step 0: nothing was received before the root (muzero-general
        # skips it as well).
        reward_ce = cross_entropy(reward_logits, target_reward[:, 1:]) * target_mask[:, 1:]  # (B, K)
        # Each unrolled step's gradient is divided by the number of unrolled steps
        # (muzero-general registers grad / gradient_scale hooks on these losses);
        # scale_gradient does the same and leaves the reported loss values alone.
        per_step = 1.0 / gradient_scale[:, 1:]  # (B, K)
        value_loss = value_ce[:, 0] + scale_gradient(value_ce[:, 1:], per_step).sum(1)  # (B,)
        policy_loss = policy_ce[:, 0] + scale_gradient(policy_ce[:, 1:], per_step).sum(1)
        reward_loss = scale_gradient(reward_ce, per_step).sum(1)

        # Per-sample loss (B,), weighted by the importance weights that correct the
        # prioritized sampling's bias, then the mean over the batch.
        per_sample = value_loss * m.value_loss_weight + reward_loss + policy_loss
        if m.consistency_loss_weight > 0:
            # Steps past the episode's end (mask 0) have no real observation to match.
            mask = d["next_observation_mask"]  # (B, K)
            assert next_observation is not None
            with self._autocast(autocast):
                negative_cosine = consistency_loss(net, unrolled.hidden_states[:, 1:], next_observation)
            if autocast is not None:
                negative_cosine = negative_cosine.float()
            consistency = scale_gradient(negative_cosine * mask, per_step).sum(1)  # (B,)
            per_sample = per_sample + consistency * m.consistency_loss_weight
        else:
            consistency = torch.zeros_like(value_loss)
        loss = (per_sample * weights).mean()

        # New raw priorities |v - z|: of the sampled positions (B,), or of every unrolled
        # position (B, K+1) with muzero.priority_update "unrolled" (the buffer writes
        # column k to the position k moves later in the same episode, where there is one).
        with torch.no_grad():
            if m.priority_update == "unrolled":
                logits = value_logits.detach()
                predicted = support_to_scalar(logits.reshape(-1, logits.shape[-1]), support).view(batch_size, k1)
                priorities = (predicted - d["target_value"]).abs().reshape(-1)
            else:
                root_value = support_to_scalar(value_logits[:, 0].detach(), support)
                priorities = (root_value - d["target_value"][:, 0]).abs()
        return Losses(loss, value_loss, reward_loss, policy_loss, consistency, weights, priorities)

    # ---- one update ---------------------------------------------------------------------
    def train_step(self, batch: Batch) -> tuple[dict[str, float], np.ndarray]:
        """One optimizer step on ``batch``; returns (metrics, raw priorities float64: (B,),
        or (B, K+1) with ``muzero.priority_update`` "unrolled").

        ``batch.data`` (from ``MuZeroTargets``): observation (B, *obs), actions (B, K+1)
        (column 0 unused: the action that led to the root), target_value,
        target_reward, gradient_scale, target_mask, policy_mask (B, K+1), target_policy
        (B, K+1, A), and with the consistency loss next_observation (B, K, *obs) and
        next_observation_mask (B, K);
        ``batch.weights`` (B,) importance weights.

        Raises FloatingPointError, before the optimizer step, if the loss or the
        gradient norm is not finite: the weights, the optimizer state and the step
        counter are then unchanged, and no priority comes back.
        """
        if self.static is not None:  # the static step, its result waited for
            finished = self.static.submit(batch) + self.static.drain()
            return finished[-1].metrics, finished[-1].priorities
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        d = self._to_device({**batch.data, "weights": batch.weights})
        losses = self.losses(d)
        grad_norm = self.backward(losses.loss)  # the norm before clipping to training.grad_clip
        with torch.no_grad():
            values = losses.readout(grad_norm)
            # One device -> host transfer (one CUDA synchronisation) per step.
            host = values.to("cpu", torch.float64).numpy()
        metrics, priorities = self.read_update(host, lr, self.training_step + 1, d["actions"].shape)
        self.optimizer.step()
        self.training_step += 1
        return metrics, priorities

    def read_update(self, host: np.ndarray, lr: float, step: int, actions_shape) -> tuple[dict[str, float], np.ndarray]:
        """``Losses.readout`` as the host got it (float64) -> (metrics, raw priorities: (B,),
        or (B, K+1) with ``muzero.priority_update`` "unrolled"), for the update that makes
        ``step`` completed updates, with learning rate ``lr``; ``actions_shape`` is the
        batch's (B, K+1). Raises FloatingPointError on a non-finite loss, gradient norm or
        priority, naming the step (``step - 1`` completed updates before it)."""
        total, value, reward, policy, norm, consistency_mean = (float(x) for x in host[:6])
        priorities = host[6:].copy()
        if self.config.muzero.priority_update == "unrolled":
            priorities = priorities.reshape(actions_shape)
        if not all(math.isfinite(x) for x in (total, value, reward, policy, consistency_mean)):
            raise FloatingPointError(f"non-finite loss at training step {step - 1}")
        if not math.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm at training step {step - 1}")
        if not np.isfinite(priorities).all():  # pragma: no cover - finite logits give finite values
            raise FloatingPointError(f"non-finite priorities at training step {step - 1}")
        metrics = {
            "total_loss": total,
            "value_loss": value,
            "reward_loss": reward,
            "policy_loss": policy,
            "grad_norm": norm,
            "lr": lr,
            "training_step": step,
        }
        if self.config.muzero.consistency_loss_weight > 0:
            metrics["consistency_loss"] = consistency_mean
        return metrics, priorities
