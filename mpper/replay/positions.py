"""Every sampleable position of a buffer, as ``ReplayBuffer.sample`` hands positions to
a target builder: what a whole-buffer pass (``--on-snapshot``) iterates over."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .buffer import ReplayBuffer

__all__ = ["Positions", "all_positions"]


@dataclass(frozen=True)
class Positions:
    """Sampleable positions, as ``ReplayBuffer.sample`` hands them to a target builder:
    each (N,) int64 / bool. ``slots``: ring slot; ``pos``: t, the position in its episode
    (0 .. T-1); ``moves``: the episode's T; ``terminated``: it ended by termination
    (False: cut by a time limit)."""

    slots: np.ndarray
    pos: np.ndarray
    moves: np.ndarray
    terminated: np.ndarray

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    def batches(self, size: int) -> Iterator[Positions]:
        """Consecutive slices of at most ``size`` positions (episode by episode, in order)."""
        for lo in range(0, len(self), size):
            sl = slice(lo, lo + size)
            yield Positions(self.slots[sl], self.pos[sl], self.moves[sl], self.terminated[sl])


def all_positions(buf: ReplayBuffer) -> Positions:
    """Every sampleable position of every published episode, oldest episode first.

    An episode of T moves starting at slot s has positions t = 0 .. T-1 in slots
    s .. s+T-1 (its last row, the final observation, is never a position).
    """
    refs = buf.episodes()
    moves = np.array([r.rows - 1 for r in refs], np.int64)
    starts = np.array([r.start for r in refs], np.int64)
    first = np.concatenate([[0], np.cumsum(moves)])  # index of each episode's position 0
    pos = np.arange(first[-1], dtype=np.int64) - np.repeat(first[:-1], moves)
    return Positions(np.repeat(starts, moves) + pos, pos, np.repeat(moves, moves),
                     np.repeat(np.array([r.terminated for r in refs], bool), moves))  # fmt: skip
