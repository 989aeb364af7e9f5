"""A MuZero network judged on stored data (``--evaluate RUN --on-snapshot DIR``)."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from ..base import SnapshotRun
from .config import MuZeroRunConfig
from .networks import PrefixOutput, lstm_horizon, make_network, support_to_scalar
from .targets import MuZeroTargets

__all__ = ["evaluate_muzero"]


def evaluate_muzero(run: SnapshotRun[MuZeroRunConfig]) -> dict:
    """MuZero: per unroll step k = 0..K, the mean over positions of

    - value error ``|v_k - z_k|``: the predicted scalar value (support -> scalar) against
      the n-step value target (reanalysed value where stored), in return units;
    - reward error ``|r_k - u_k|`` (k >= 1; step 0 predicts no reward), reward units (with
      ``muzero.value_prefix``, of the value prefix against its target);
    - policy KL ``KL(pi_k || p_k)`` and cross-entropy ``-sum pi_k log p_k`` (nats) of the
      predicted policy p against the stored visit distribution pi.

    Step k of position t looks at index i = t + k of the episode. Training also unrolls
    past the end (absorbing states with made-up targets: value 0, uniform policy); those
    are not stored data, so only i < T counts for value and policy, and i <= T for the
    reward (r_T, the last reward, is stored). ``positions`` per step says how many counted.
    """
    cfg, t = run.config, run.config.muzero
    K, num_actions = t.num_unroll_steps, run.spec.num_actions
    horizon = lstm_horizon(t)
    network = run.load_weights(make_network(cfg.network, run.spec.observation_shape, num_actions,
                                            t.stacked_observations, horizon))  # fmt: skip
    targets = MuZeroTargets(K, t.td_steps, cfg.mcts.discount, num_actions, t.stacked_observations,
                            value_prefix_horizon=horizon)  # fmt: skip
    support = cfg.network.support_size
    rng = np.random.default_rng(0)  # actions past an episode's end; those steps are masked out
    steps = np.arange(K + 1)
    sums = {name: np.zeros(K + 1) for name in ("value_error", "reward_error", "policy_kl", "policy_cross_entropy")}
    state_count = np.zeros(K + 1, np.int64)
    reward_count = np.zeros(K + 1, np.int64)
    with torch.no_grad():
        for p in run.positions.batches(run.batch_size):
            d = targets.build(run.buffer.fields, p.slots, p.pos, p.moves, p.terminated, rng)
            index = p.pos[:, None] + steps  # (B, K+1) index in the episode
            has_state = index < p.moves[:, None]
            has_reward = (index <= p.moves[:, None]) & (steps > 0)
            state_count += has_state.sum(0)
            reward_count += has_reward.sum(0)
            actions = torch.from_numpy(d["actions"])
            out = network.initial_inference(torch.from_numpy(d["observation"]))
            for k in range(K + 1):
                if k > 0:
                    # the value prefix's LSTM state, zeros (None) at the root and after each horizon
                    carried = None
                    if isinstance(out, PrefixOutput) and (k - 1) % cast(int, horizon) != 0:
                        carried = out.reward_state
                    out = network.recurrent_inference(out.hidden_state, actions[:, k], carried)
                    reward = support_to_scalar(out.reward_logits, support).numpy()
                    sums["reward_error"][k] += np.abs(reward - d["target_reward"][:, k])[has_reward[:, k]].sum()
                value = support_to_scalar(out.value_logits, support).numpy()
                sums["value_error"][k] += np.abs(value - d["target_value"][:, k])[has_state[:, k]].sum()
                target = torch.from_numpy(d["target_policy"][:, k])
                cross_entropy = -(target * torch.log_softmax(out.policy_logits, dim=1)).sum(1)
                kl = cross_entropy + torch.xlogy(target, target).sum(1)  # KL = CE - H(pi), 0 log 0 = 0
                sums["policy_cross_entropy"][k] += cross_entropy.numpy()[has_state[:, k]].sum()
                sums["policy_kl"][k] += kl.numpy()[has_state[:, k]].sum()
            run.advance(len(p))

    def mean(total: float, count: int) -> float | None:
        return float(total / count) if count else None

    def row(k, states: int, rewards: int, pick) -> dict:
        return {
            "k": k,
            "positions": int(states),  # counted for value and policy
            "value_error": mean(pick(sums["value_error"]), states),
            "reward_positions": int(rewards),
            "reward_error": mean(pick(sums["reward_error"]), rewards),
            "policy_kl": mean(pick(sums["policy_kl"]), states),
            "policy_cross_entropy": mean(pick(sums["policy_cross_entropy"]), states),
        }

    table = [row(k, state_count[k], reward_count[k], lambda a, k=k: a[k]) for k in range(K + 1)]
    overall = row("all", state_count.sum(), reward_count.sum(), np.sum)  # pooled over every counted step
    return {"num_unroll_steps": K, "per_step": table, "overall": overall, "table": [*table, overall]}
