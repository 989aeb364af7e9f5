"""Sampled MuZero's stored rows and the unroll targets built from them at sample time.

Episode layout as every algorithm's (:class:`~mpper.algos.base.EpisodeRows`): T moves are
T + 1 rows; row i holds o_i, the action a_{i-1} that led to it (a float vector (A,) in
[-1, 1]^A: the env's Box rescaled, what the dynamics see; row 0: zeros) and r_i; and the
search at o_i: its K sampled root actions ``sampled_actions`` (K, A), their visit shares
``child_visits`` (K,) (the policy target: n_k / N), and the root value (row T: the
network's value of o_T, what a truncated episode bootstraps from).

Targets per sampled position t and unroll step k = 0..K' (index i = t + k), MuZero's:
value the n-step return (reanalysed values where stored), reward r_i, action a_i (column 0
unused), the policy target at o_i for i < T (a reanalysing search's samples and policy
where stored); absorbing past a terminal, masked past a cut.
The arithmetic is numpy over the whole batch, a loop over the n-step horizon only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...replay.schema import Schema
from ...replay.targets import gather_rows

__all__ = ["REANALYSE_COUNTERS", "SampledTargets", "initial_priorities", "sampled_schema"]

REANALYSE_COUNTERS = ("reanalysed_episodes", "reanalysed_dropped")


def sampled_schema(observation_shape: Sequence[int], action_dim: int, num_sampled_actions: int,
                   observation_dtype="float32") -> Schema:  # fmt: skip
    """The fields of one stored row for actions of ``action_dim`` dimensions and K =
    ``num_sampled_actions`` root samples, and the reanalyser's counters."""
    k = int(num_sampled_actions)
    fields = {
        "observation": (tuple(observation_shape), observation_dtype),
        "action": ((action_dim,), "float32"),
        "reward": ((), "float32"),
        "root_value": ((), "float32"),
        "child_visits": ((k,), "float32"),
        "sampled_actions": ((k, action_dim), "float32"),
        "reanalysed_value": ((), "float32", float("nan")),  # NaN: not reanalysed yet
        # a new search's root samples and policy target (NaN: not searched again yet)
        "reanalysed_policy": ((k,), "float32", float("nan")),
        "reanalysed_actions": ((k, action_dim), "float32", float("nan")),
    }
    return Schema(fields, counters=REANALYSE_COUNTERS)


@dataclass(frozen=True)
class SampledTargets:
    """Builds ``observation`` (B, *obs) float32, ``actions`` (B, K'+1, A), ``target_value``,
    ``target_reward``, ``target_mask`` (value and reward), ``policy_mask`` (B, K'+1),
    ``target_policy`` (B, K'+1, K) visit shares and ``target_actions`` (B, K'+1, K, A)
    the sampled root actions they are shares of (K' = ``num_unroll_steps``). With
    ``next_observations`` (the consistency loss) also ``next_observation`` (B, K', *obs)
    float32, o_{t+k} for k = 1..K' (row T past the episode's end), and
    ``next_observation_mask`` (B, K'): 1 where t + k <= T."""

    num_unroll_steps: int
    td_steps: int
    discount: float
    next_observations: bool = False

    def build(self, fields, slots, pos, moves, terminated, rng, training_step=None):
        slots, pos, moves = (np.asarray(x, np.int64) for x in (slots, pos, moves))
        terminated = np.asarray(terminated, bool)
        k1 = self.num_unroll_steps + 1
        batch = slots.shape[0]
        action_dim = fields["action"].shape[1]
        start = slots - pos
        i = pos[:, None] + np.arange(k1)[None]  # (B, K'+1) index in the episode
        big_t = moves[:, None]
        before_end, at_or_before_end = i < big_t, i <= big_t
        rows = start[:, None] + np.minimum(i, big_t)  # ring rows (past the end: row T)
        reanalysed = fields.get("reanalysed_value")

        def stored_value(r):
            v = fields["root_value"][r].astype(np.float64)
            if reanalysed is not None:
                fresh = reanalysed[r]
                v = np.where(np.isnan(fresh), v, fresh)
            return v

        v_end = np.where(terminated, 0.0, stored_value(start + moves))[:, None]  # (B, 1)
        value = np.zeros((batch, k1))
        for m in range(1, self.td_steps + 1):  # a loop over the horizon, not over the batch
            j = i + m
            take = before_end & (j <= big_t)
            reward = fields["reward"][start[:, None] + np.minimum(j, big_t)]
            value += np.where(take, self.discount ** (m - 1) * reward, 0)
        boot = i + self.td_steps
        inside = before_end & (boot < big_t)
        bootstrap = stored_value(start[:, None] + np.minimum(boot, big_t))
        value += np.where(inside, self.discount**self.td_steps * bootstrap, 0)
        cut = before_end & (boot >= big_t)
        value += np.where(cut, self.discount ** (big_t - i).clip(0) * v_end, 0)
        value = np.where(i == big_t, v_end, value)
        out = {
            "observation": gather_rows(fields["observation"], slots).astype(np.float32, copy=False),
            "target_value": value.astype(np.float32),
            "target_reward": np.where(at_or_before_end, fields["reward"][rows], 0).astype(np.float32),
            "target_mask": (terminated[:, None] | at_or_before_end).astype(np.float32),
            "policy_mask": before_end.astype(np.float32),
        }
        random_actions = rng.uniform(-1, 1, (batch, k1, action_dim))
        stored_actions = fields["action"][rows]
        out["actions"] = np.where(at_or_before_end[..., None], stored_actions, random_actions).astype(np.float32)
        policy, samples = fields["child_visits"][rows], fields["sampled_actions"][rows]
        if "reanalysed_policy" in fields and "reanalysed_actions" in fields:
            # a new search's, where every entry of both rows is stored (none NaN)
            fresh_policy, fresh_samples = fields["reanalysed_policy"][rows], fields["reanalysed_actions"][rows]
            fresh = ~np.isnan(fresh_policy).any(-1) & ~np.isnan(fresh_samples).any((-2, -1))
            policy = np.where(fresh[..., None], fresh_policy, policy)
            samples = np.where(fresh[..., None, None], fresh_samples, samples)
        out["target_policy"] = np.where(before_end[..., None], policy, 0).astype(np.float32)
        out["target_actions"] = np.where(before_end[..., None, None], samples, 0).astype(np.float32)
        if self.next_observations:
            # an episode's rows are contiguous in the ring: o_{t+k} is row slot + k (k <= T - t)
            ahead = rows[:, 1:]  # (B, K'): rows of o_{t+1} .. o_{t+K'}, clamped to row T
            out["next_observation"] = gather_rows(fields["observation"], ahead.reshape(-1)).reshape(
                batch, k1 - 1, *fields["observation"].shape[1:]).astype(np.float32, copy=False)  # fmt: skip
            out["next_observation_mask"] = at_or_before_end[:, 1:].astype(np.float32)
        return out


def initial_priorities(arrays: dict[str, np.ndarray], td_steps: int, discount: float,
                       terminated: bool = True) -> np.ndarray:  # fmt: skip
    """|root value - n-step value target| (raw) of the T positions of one episode's rows,
    from the very builder the learner samples with (the rows serve as a tiny ring)."""
    moves = arrays["root_value"].shape[0] - 1
    slots = np.arange(moves, dtype=np.int64)
    no_random_actions = np.random.default_rng(0)  # unroll 0: no step past the end
    built = SampledTargets(0, td_steps, discount).build(arrays, slots, slots, np.full(moves, moves),
                                                         np.full(moves, terminated), no_random_actions)  # fmt: skip
    return np.abs(arrays["root_value"][:moves].astype(np.float64) - built["target_value"][:, 0])
