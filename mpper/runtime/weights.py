"""WeightStore: the latest network parameters in shared memory, for every process.

One segment holds a header ``[sequence, version, training_step, reached]`` (int64) and
the flat float32 parameters. The learner publishes; self-play workers, the reanalyser and
the evaluator copy only when ``version`` changed since their last copy. ``reached`` is the
evaluator's word to the learner: the training step + 1 of the first weights whose
evaluation reached ``training.lr_drop_return`` (0: none yet).

Consistency is a seqlock, so readers never block the learner: the publisher makes
``sequence`` odd, writes the parameters, then makes it even again; a reader copies the
parameters between two reads of ``sequence`` and retries if they differ or are odd.
A single publisher (the learner) writes, so writers need no lock among themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .. import shm as shm_mod

__all__ = ["WeightStore", "WeightHandle"]

_SEQ, _VERSION, _STEP, _REACHED = range(4)
_HEADER = 8  # int64 slots reserved for the header (64 bytes: parameters start aligned)


@dataclass(frozen=True)
class WeightHandle:
    """Picklable description of a weight store (segment name and parameter count)."""

    segment: str
    num_weights: int


class WeightStore(shm_mod.SharedObject):
    """Flat float32 parameters plus a version counter, shared by name."""

    def __init__(self, handle: WeightHandle, segment, owner: bool) -> None:
        self.handle = handle
        self._segment = segment
        self._owner = owner
        self._header = np.ndarray((_HEADER,), np.int64, buffer=segment.buf)
        self._weights = np.ndarray((handle.num_weights,), np.float32, buffer=segment.buf, offset=_HEADER * 8)

    @classmethod
    def create(cls, num_weights: int, tag: str = "weights") -> "WeightStore":
        """Create and own a store for ``num_weights`` float32 parameters (version 0: none)."""
        nbytes = _HEADER * 8 + 4 * int(num_weights)
        segment = shm_mod.create(nbytes, tag, what=f"the weight store ({num_weights} parameters)")
        return cls(WeightHandle(segment.name, int(num_weights)), segment, owner=True)

    @classmethod
    def attach(cls, handle: WeightHandle) -> "WeightStore":
        return cls(handle, shm_mod.attach(handle.segment), owner=False)

    @property
    def version(self) -> int:
        """Number of publications so far (0: nothing published yet)."""
        return int(self._header[_VERSION])

    @property
    def training_step(self) -> int:
        """Learner step of the latest publication."""
        return int(self._header[_STEP])

    @property
    def return_reached_at(self) -> int | None:
        """The training step of the first weights an evaluation found at
        ``training.lr_drop_return``; None until then."""
        reached = int(self._header[_REACHED])
        return reached - 1 if reached > 0 else None

    def mark_return_reached(self, training_step: int) -> None:
        """The evaluator's mark (the first one stays): weights of ``training_step`` reached
        ``training.lr_drop_return``. One aligned int64 store: readers see it whole."""
        if self._header[_REACHED] == 0:
            self._header[_REACHED] = training_step + 1

    def publish(self, flat: np.ndarray, training_step: int) -> int:
        """Write new parameters (single publisher); returns the new version."""
        flat = np.asarray(flat, dtype=np.float32)
        if flat.shape != self._weights.shape:
            raise ValueError(f"expected {self._weights.shape[0]} parameters, got {flat.shape}")
        header = self._header
        header[_SEQ] += 1  # odd: writing
        self._weights[:] = flat
        header[_STEP] = training_step
        header[_VERSION] += 1
        header[_SEQ] += 1  # even: consistent
        return int(header[_VERSION])

    def read_into(self, out: np.ndarray, timeout: float = 10.0) -> tuple[int, int]:
        """Copy the latest parameters into ``out``; returns (version, training_step)."""
        header = self._header
        deadline = time.monotonic() + timeout
        while True:
            before = int(header[_SEQ])
            if not before & 1:
                out[:] = self._weights
                version, step = int(header[_VERSION]), int(header[_STEP])
                if int(header[_SEQ]) == before:
                    return version, step
            if time.monotonic() > deadline:
                raise TimeoutError("weight store: the publisher did not finish a write in time")
            time.sleep(0.0005)

    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        segment, self._segment = self._segment, None
        if segment is not None:
            self._header = self._weights = None
            shm_mod.release(segment, unlink=self._owner)
