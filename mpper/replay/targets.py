"""What ``ReplayBuffer.sample`` turns sampled positions into: the target-builder contract.

An episode of ``T`` moves is stored as ``T + 1`` consecutive rows (row ``i`` holds
observation ``o_i``; what else a row holds is the algorithm's schema). A sampled
position is a slot ``s`` with position ``t = s - start`` in ``0 .. T-1``.

A :class:`TargetBuilder` gets the field arrays (full ring, shape ``(capacity, ...)``)
and, per sampled row, the slot, its position ``t``, the episode's ``T`` and whether it
ended by termination, and the learner's training step (where the sampler says it), and
returns a dict of batch arrays. The algorithms' builders
(``mpper.algos.muzero.targets``, ``mpper.algos.dqn.targets``) loop over the batch in
numba kernels; :func:`gather_rows` is the shared row gather, :class:`RawRows` the
builder that returns the stored rows as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numba
import numpy as np

__all__ = ["RawRows", "TargetBuilder", "gather_rows"]


class TargetBuilder(Protocol):
    """Builds a batch from sampled positions. Arguments: ``fields`` (name -> array of
    shape ``(capacity, ...)``), then per sampled row (each ``(B,)``): ``slots`` (int64
    ring slot), ``pos`` (int64 position t in its episode), ``moves`` (int64 T of its
    episode), ``terminated`` (bool: ended by termination, not a time limit), and
    ``rng`` (numpy Generator, for any random choice), and ``training_step`` (int, the
    learner's completed updates, for targets that depend on the data's age, e.g. MuZero's
    off-policy correction; None where the sampler does not say). Returns name ->
    ``(B, ...)`` array."""

    def build(self, fields: Mapping[str, np.ndarray], slots: np.ndarray, pos: np.ndarray, moves: np.ndarray,
              terminated: np.ndarray, rng: np.random.Generator,
              training_step: int | None = None) -> dict[str, np.ndarray]: ...  # fmt: skip


@numba.njit(cache=True, nogil=True)
def _gather_2d(src, rows, out):
    for j in range(rows.shape[0]):
        row = src[rows[j]]
        for c in range(row.shape[0]):
            out[j, c] = row[c]


def gather_rows(src: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``src[rows]`` as a new contiguous array, for a field array ``(capacity, ...)``.

    The fields of a shared buffer are strided views into per-slot records; numpy's
    fancy indexing walks rows of them through its generic strided machinery, where a
    compiled loop is about twice as fast, while for one value per row numpy is faster
    than the cost of calling a compiled function (``bench/kernels.py``). np.take would
    even copy the whole field first.
    """
    if src.ndim == 1:
        return src[rows]
    out = np.empty((rows.shape[0], *src.shape[1:]), src.dtype)
    if src.ndim == 2:
        _gather_2d(src, rows, out)
    elif _rows_contiguous(src):  # so this reshape is a view, never a copy of the field
        _gather_2d(src.reshape(src.shape[0], -1), rows, out.reshape(rows.shape[0], -1))
    else:
        out[...] = src[rows]
    return out


def _rows_contiguous(src: np.ndarray) -> bool:
    """Whether each row ``src[i]`` is one C-contiguous block."""
    expected = src.itemsize
    for dim, stride in zip(reversed(src.shape[1:]), reversed(src.strides[1:])):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


@dataclass(frozen=True)
class RawRows:
    """No targets: each schema field's row at the sampled slots."""

    def build(self, fields, slots, pos, moves, terminated, rng, training_step=None):
        # fancy indexing, not np.take: take copies a non-contiguous (strided) source whole
        return {name: gather_rows(arr, slots) for name, arr in fields.items()}
