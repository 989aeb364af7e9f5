"""Where everything of a buffer lives in its one shared-memory segment: the slot records
(schema fields beside their generation and info), the sum tree, the episode table, the
ring counters and the event counters, each aligned to 64 bytes. The buffer maps it,
a snapshot writes and reads it array by array."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..shm import RobustLock
from .episode_ring import JOURNAL_FIELDS, RING_FIELDS, TABLE_COLUMNS
from .schema import Field, normalize_counters, normalize_schema
from .sum_tree import SumTree

__all__ = ["COUNTERS", "COUNTER_SLOTS", "POSITIONS", "array_specs", "counters_by_name", "extra_counter_names", "segment_layout", "segment_offsets", "record_dtype", "segment_bytes"]


# Every buffer's own event counters, first in the counter slots; the slots after them
# hold the counters its schema declares (``Schema.counters``), in their order.
COUNTERS = (
    "games",  # episodes published
    "steps",  # positions (moves) published
    "samples",  # rows drawn by sample()
    "priority_updates_applied",
    "priority_updates_dropped",  # generation changed since sampling: slot rewritten
    "episodes_evicted",
    "episodes_abandoned",  # reserved but never published (writer died or failed)
    "torn_rows_redrawn",  # rows discarded by the post-gather generation check
)


COUNTER_SLOTS = 16
# Not a counter slot: ReplayBuffer.counters reports the sampleable positions under this name.
POSITIONS = "positions"
# Counters only grow; a loaded one must leave them room (as the snapshot's own checks).
_MAX_COUNTER = 1 << 62


def extra_counter_names(names) -> tuple[str, ...]:
    """The extra counters a buffer may have, checked (``normalize_counters``): not one of
    ``COUNTERS`` or ``positions``, and as many as the slots after ``COUNTERS`` hold."""
    return normalize_counters(names, COUNTERS + (POSITIONS,), COUNTER_SLOTS - len(COUNTERS))


def counters_by_name(listed) -> tuple[tuple[str, ...], np.ndarray]:
    """A snapshot manifest's counters, ``{name: value}``, as a buffer holds them: (the
    extra names, in their order; the (COUNTER_SLOTS,) int64 slot values, ``COUNTERS``
    first, a name not listed 0). ValueError naming a bad entry."""
    if not isinstance(listed, dict):
        raise ValueError("must be an object of names and integers")
    for name, value in listed.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_COUNTER):
            raise ValueError(f"{name!r} is {value!r}, expected an integer in [0, 2^62)")
    extra = extra_counter_names([name for name in listed if name not in COUNTERS])
    values = np.zeros(COUNTER_SLOTS, np.int64)
    values[: len(COUNTERS) + len(extra)] = [listed.get(name, 0) for name in COUNTERS + extra]
    return extra, values


_ALIGN = 64


def record_dtype(fields: tuple[Field, ...]) -> np.dtype:
    """One record per slot: its generation and packed info, then every schema field.

    Keeping a slot's bookkeeping and data side by side means a sampled slot costs one
    cache miss (for small rows: records are padded to 16, 32 or 64 bytes so that one
    never straddles two cache lines) instead of one per array. Each field is still an
    array of shape ``(capacity, *shape)``: a strided view of the records.
    """
    base = np.dtype([("_generation", "<i8"), ("_info", "<i8")] + [(f.name, f.dtype, f.shape) for f in fields],
                    align=True)  # fmt: skip
    size = base.itemsize
    padded = 1 << (size - 1).bit_length() if size <= 64 else -(-size // 64) * 64
    return np.dtype({"names": list(base.names), "formats": [base.fields[n][0] for n in base.names],
                     "offsets": [base.fields[n][1] for n in base.names], "itemsize": padded})  # fmt: skip


def segment_bytes(schema, capacity: int, max_episodes: int | None = None) -> int:
    """Bytes of the shared-memory segment of a buffer of ``schema`` (a mapping as
    ``ReplayBuffer.create`` takes, or normalized fields) and ``capacity`` rows, holding
    at most ``max_episodes`` episodes (default, as ``create``: ``capacity // 2``)."""
    fields = normalize_schema(schema) if isinstance(schema, Mapping) else tuple(schema)
    return segment_offsets(segment_layout(fields, capacity, max(1, capacity // 2) if max_episodes is None else max_episodes))[1]


def segment_layout(fields: tuple[Field, ...], capacity: int, max_episodes: int) -> list[tuple[str, tuple, np.dtype]]:
    """The arrays of a buffer's shared segment: (name, shape, dtype)."""
    return [
        ("_records", (capacity,), record_dtype(fields)),
        ("_tree", (SumTree.storage_size(capacity),), np.dtype(np.float64)),
        ("_episodes", (max_episodes, TABLE_COLUMNS), np.dtype(np.int64)),
        ("_ring", (RING_FIELDS,), np.dtype(np.int64)),
        ("_counters", (COUNTER_SLOTS,), np.dtype(np.int64)),
        ("_max_priority", (1,), np.dtype(np.float64)),
        ("_lock", (RobustLock.SIZE,), np.dtype(np.uint8)),  # the writers' robust mutex (mpper.shm.RobustLock)
        ("_journal", (JOURNAL_FIELDS,), np.dtype(np.int64)),  # what the lock holder is doing (EpisodeRing)
    ]


def array_specs(fields: tuple[Field, ...], capacity: int, max_episodes: int) -> dict[str, tuple[tuple, np.dtype]]:
    """Every logical array of a buffer, {name: (shape, dtype)}: the schema fields and the
    internal arrays (names starting with '_'), as a snapshot stores them."""
    specs = {f.name: ((capacity, *f.shape), f.dtype) for f in fields}
    specs["_generation"] = specs["_info"] = ((capacity,), np.dtype(np.int64))
    for name, shape, dtype in segment_layout(fields, capacity, max_episodes)[1:]:
        specs[name] = (shape, dtype)
    return specs


def segment_offsets(arrays) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for _, shape, dtype in arrays:
        offsets.append(pos)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        pos += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, pos
