"""Sampled MuZero's update: MuZero's unrolled losses, with the paper's policy loss over the
sampled root actions, ``-sum_k n_k / N * log pi(a_k | s)``, and optionally EfficientZero's
consistency loss (``sampled_muzero.consistency_loss_weight``)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ...replay.buffer import Batch
from ..base import Trainer
from ..muzero_family import consistency_loss, scalar_to_support, support_to_scalar
from .config import SampledMuZeroRunConfig
from .networks import SampledMuZeroNetwork

__all__ = ["SampledMuZeroTrainer", "sampled_policy_loss"]


def sampled_policy_loss(network: SampledMuZeroNetwork, policy_params: torch.Tensor, target_actions: torch.Tensor,
                        target_policy: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The paper's policy loss per position: ``-sum_k target_policy[k] * log pi(target_actions[k])``
    for params (N, 2A), actions (N, K, A), visit shares (N, K) -> (N,)."""
    return -(target_policy * network.policy.log_prob(policy_params, target_actions)).sum(-1)


def _mean(loss: torch.Tensor) -> float:
    """The batch mean of a per-position loss."""
    return float(loss.detach().mean())


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -(target * torch.log_softmax(logits, dim=-1)).sum(-1)


class SampledMuZeroTrainer(Trainer[SampledMuZeroRunConfig]):
    """``train_step(batch)``: one update on a batch of :class:`~.targets.SampledTargets`;
    returns the metrics and the new raw priorities |v - z| of the sampled positions."""

    network: SampledMuZeroNetwork

    def train_step(self, batch: Batch) -> tuple[dict[str, float], np.ndarray]:
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        d = self._to_device({**batch.data, "weights": batch.weights})
        cfg = self.config.sampled_muzero
        support = self.network.support_size
        unroll = d["actions"].shape[1] - 1
        # the statistics first, from the root observations: this batch is normalised with them
        self.network.update_observation_statistics(d["observation"])
        hidden = self.network.representation(d["observation"])
        zero = torch.zeros(d["observation"].shape[0], device=self.device)
        value_loss, reward_loss, policy_loss, entropy = zero, zero, zero, zero
        root_value = None
        unrolled = []  # the dynamics' hidden states after 1..K' actions (the consistency loss's)
        for k in range(unroll + 1):
            if k > 0:
                hidden, reward_logits = self.network.dynamics(hidden, d["actions"][:, k])
                unrolled.append(hidden)
                hidden = hidden * 0.5 + hidden.detach() * 0.5  # the paper's scale_gradient(s, 1/2)
                target = scalar_to_support(d["target_reward"][:, k], support)
                reward_loss = reward_loss + _cross_entropy(reward_logits, target) * d["target_mask"][:, k] / unroll
            value_logits, params = self.network.prediction(hidden)
            scale = 1.0 if k == 0 else 1.0 / unroll
            target = scalar_to_support(d["target_value"][:, k], support)
            value_loss = value_loss + _cross_entropy(value_logits, target) * d["target_mask"][:, k] * scale
            policy_loss = policy_loss + sampled_policy_loss(self.network, params, d["target_actions"][:, k],
                                                            d["target_policy"][:, k]) * d["policy_mask"][:, k] * scale
            if cfg.policy_entropy_weight > 0:  # the Gaussian's entropy before tanh: sum of log std + const
                entropy = entropy + self.network.policy.split(params)[1].sum(-1) * d["policy_mask"][:, k] * scale
            if k == 0:
                root_value = support_to_scalar(value_logits.detach(), support)
        per_position = (cfg.value_loss_weight * value_loss + reward_loss + policy_loss
                        - cfg.policy_entropy_weight * entropy)  # fmt: skip
        consistency = zero
        if cfg.consistency_loss_weight > 0 and unroll > 0:
            # -cos(predicted, real) per step, averaged over the unroll like the other losses'
            # steps; none past the episode's end, where no real observation follows
            negative_cosine = consistency_loss(self.network, torch.stack(unrolled, 1), d["next_observation"])
            consistency = (negative_cosine * d["next_observation_mask"]).sum(1) / unroll
            per_position = per_position + cfg.consistency_loss_weight * consistency
        loss = (per_position * d["weights"]).mean()
        norm = self.backward(loss)
        total = float(loss.detach())
        if not math.isfinite(total):
            raise FloatingPointError(f"non-finite loss at training step {self.training_step}")
        if not math.isfinite(float(norm)):
            raise FloatingPointError(f"non-finite gradient norm at training step {self.training_step}")
        self.optimizer.step()
        self.training_step += 1
        assert root_value is not None
        priorities = (root_value - d["target_value"][:, 0]).abs().detach().cpu().double().numpy()
        metrics = {
            "total_loss": total,
            "value_loss": _mean(value_loss),
            "reward_loss": _mean(reward_loss),
            "policy_loss": _mean(policy_loss),
            **({"consistency_loss": _mean(consistency)} if cfg.consistency_loss_weight > 0 else {}),
            "grad_norm": float(norm),
            "lr": lr,
            "training_step": self.training_step,
        }
        return metrics, priorities
