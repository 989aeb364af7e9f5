"""DQN's stored rows and the n-step transitions built from them at sample time.

Row layout: an episode of T moves is T + 1 rows; row i holds o_i, the action a_{i-1}
that led to it and the reward r_i it brought (row 0: placeholders).

Frames are stored once (one row per step, in the env's dtype); a stack of the last k
(``dqn.frame_stack``, the Nature DQN's 4 on Atari) is built here when a batch is drawn,
and by the player from its episode when it acts, with the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

from ...replay.targets import gather_rows

__all__ = ["NStepTargets", "dqn_schema", "stack_frames", "stacked_frames_shape"]


def stacked_frames_shape(observation_shape: Sequence[int], frame_stack: int) -> tuple[int, ...]:
    """The network input for ``frame_stack`` frames of ``observation_shape`` (C, ...):
    (k C, ...), the frames along the first axis, oldest first."""
    channels, *rest = observation_shape
    return (frame_stack * channels, *rest)


def stack_frames(observation: np.ndarray, slots: np.ndarray, pos: np.ndarray, frame_stack: int) -> np.ndarray:
    """The last ``frame_stack`` frames up to each row: (B, k C, ...) in the field's dtype.

    ``observation`` is a field (rows of (C, ...)), ``slots`` (B,) the rows of o_t and
    ``pos`` (B,) their positions t in their episodes (whose rows are contiguous).
    Frames before the episode's start are zeros (SB3's VecFrameStack and Dopamine pad
    this way), never another episode's rows.
    """
    current = gather_rows(observation, slots)
    if frame_stack == 1:
        return current
    batch, channels = slots.shape[0], observation.shape[1]
    out = np.zeros((batch, frame_stack * channels, *observation.shape[2:]), observation.dtype)
    out[:, (frame_stack - 1) * channels :] = current
    for back in range(1, frame_stack):  # a loop over stack depth, not over the batch
        valid = pos >= back
        frames = gather_rows(observation, np.where(valid, slots - back, slots))
        frames[~valid] = 0
        lo = (frame_stack - 1 - back) * channels
        out[:, lo : lo + channels] = frames
    return out


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
    discount (gamma^m), next_observation, done (bool), each with leading dim B; the
    observations stacks of ``frame_stack`` frames (:func:`stack_frames`)."""

    n: int
    gamma: float
    frame_stack: int = 1

    def __post_init__(self):
        if self.n < 1 or self.frame_stack < 1:
            raise ValueError(f"NStepTargets needs n >= 1 and frame_stack >= 1, got {self}")

    def build(self, fields, slots, pos, moves, terminated, rng, training_step=None):
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
            "observation": stack_frames(obs, slots, pos, self.frame_stack),
            "action": act,
            "reward": ret,
            "discount": disc,
            "next_observation": stack_frames(obs, nxt, pos + (nxt - slots), self.frame_stack),
            "done": done,
        }


def dqn_schema(observation_shape: Sequence[int], observation_dtype="float32") -> dict:
    """Fields a DQN worker stores per row: o_i, a_{i-1}, r_i."""
    return {
        "observation": (tuple(observation_shape), observation_dtype),
        "action": ((), "int64"),
        "reward": ((), "float32"),
    }
