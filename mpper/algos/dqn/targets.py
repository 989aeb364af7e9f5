"""DQN's stored rows and the n-step transitions built from them at sample time.

Row layout: an episode of T moves is T + 1 rows; row i holds o_i, the action a_{i-1}
that led to it and the reward r_i it brought (row 0: placeholders).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

from ...replay.targets import gather_rows

__all__ = ["NStepTargets", "dqn_schema"]


@numba.njit(cache=True, nogil=True)
def _nstep_kernel(slots, pos, moves, terminated, reward, action, n, gamma,
                  out_return, out_discount, out_next, out_done, out_action):  # fmt: skip
    """(s_t, a_t, R_t^(m), gamma^m, s_{t+m}, done) with m = min(n, T - t).

    a_t is stored on row t + 1 (the action that led to o_{t+1}). ``done`` only when the
    episode terminated and the window reaches its end: a time-limit truncation
    bootstraps from the last observation.
    """
    for b in range(slots.shape[0]):
        s = slots[b]
        m = min(n, moves[b] - pos[b])
        ret = 0.0
        g = 1.0
        for j in range(m):
            ret += g * reward[s + 1 + j]
            g *= gamma
        out_return[b] = ret
        out_discount[b] = g
        out_next[b] = s + m
        out_done[b] = terminated[b] and pos[b] + m == moves[b]
        out_action[b] = action[s + 1]


@dataclass(frozen=True)
class NStepTargets:
    """DQN n-step transitions: observation, action, reward (the n-step return),
    discount (gamma^m), next_observation, done (bool), each with leading dim B."""

    n: int
    gamma: float

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"NStepTargets needs n >= 1, got {self.n}")

    def build(self, fields, slots, pos, moves, terminated, rng):
        batch = slots.shape[0]
        ret = np.empty(batch, np.float32)
        disc = np.empty(batch, np.float32)
        nxt = np.empty(batch, np.int64)
        done = np.empty(batch, np.bool_)
        act = np.empty(batch, fields["action"].dtype)
        _nstep_kernel(slots, pos, moves, terminated, fields["reward"], fields["action"],
                      self.n, float(self.gamma), ret, disc, nxt, done, act)  # fmt: skip
        obs = fields["observation"]
        return {
            "observation": gather_rows(obs, slots),
            "action": act,
            "reward": ret,
            "discount": disc,
            "next_observation": gather_rows(obs, nxt),
            "done": done,
        }


def dqn_schema(observation_shape: Sequence[int], observation_dtype="float32") -> dict:
    """Fields a DQN worker stores per row: o_i, a_{i-1}, r_i."""
    return {
        "observation": (tuple(observation_shape), observation_dtype),
        "action": ((), "int64"),
        "reward": ((), "float32"),
    }
