"""Slot allocation for whole episodes in a ring of steps, with an episode table.

``EpisodeRing`` decides *where* an episode goes and *what it evicts*; it owns no data
arrays and no lock. The replay buffer calls it with its lock held.

State (all numpy arrays, normally views into shared memory):

- ``table``: ``(max_episodes, 6)`` int64, one row per episode, indexed by
  ``episode_id % max_episodes``; columns ``ID, START, ROWS, STATE, PID, TERMINATED``.
- ``ring``: int64 ``[WRITE_POS, NEXT_ID, HEAD_ID, NUM_POSITIONS]``. Episodes
  ``HEAD_ID .. NEXT_ID - 1`` are resident (reserved, published or freed holes).
- ``generation`` and ``info``: ``(capacity,)`` int64 each, stored side by side in each
  slot's record (with the slot's data; see ``replay_buffer``), so a sampler finds all
  it needs about a slot in one cache line.
  ``generation[s]`` is a seqlock counter: odd while the slot is not sampleable
  (reserved, being copied, evicted), even once published. It changes on every
  reservation, publication and eviction, always on every slot of the episode, so a
  reader that recorded an even generation can tell whether anything in that episode
  was rewritten since by reading it again.
  ``info[s]`` packs ``position << 32 | T << 2 | terminated << 1`` (position of the slot
  in its episode and the episode's number of moves T).

Episodes are reserved in order under the lock, so they sit in the ring in the order of
their ids: the oldest is always the first one at or after the write position. Writing
``rows`` slots therefore evicts from the head of the table until the head no longer
lies in the region the new episode consumes (the slots up to its end, plus the unused
tail when it wraps to slot 0), or until the table has a free row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..shm import pid_alive
from .sum_tree import SumTree

# Episode table columns.
ID, START, ROWS, STATE, PID, TERMINATED = range(6)
TABLE_COLUMNS = 6
# Episode states.
FREE, RESERVED, PUBLISHED = 0, 1, 2
# Ring state entries.
WRITE_POS, NEXT_ID, HEAD_ID, NUM_POSITIONS = range(4)
RING_FIELDS = 4
# Bits of a slot's info.
TERMINATED_BIT, MOVES_SHIFT, POS_SHIFT = 2, 2, 32
MAX_CAPACITY = 1 << 30  # T must fit the 30 bits between MOVES_SHIFT and POS_SHIFT


def pack_info(rows: int, terminated: bool) -> np.ndarray:
    """INFO of the ``rows`` slots of a newly reserved episode."""
    pos = np.arange(rows, dtype=np.int64)
    return (pos << POS_SHIFT) | ((rows - 1) << MOVES_SHIFT) | (TERMINATED_BIT if terminated else 0)


def make_unsampleable(gen: np.ndarray) -> None:
    """Set generations to the next odd value (in place): evicted, reserved or a hole."""
    gen += 1 + (gen & 1)


class RingBusy(Exception):
    """An episode still being copied by a live writer lies where the new one must go.

    Only happens when the capacity is small compared with (number of concurrent writers
    x episode length). The caller releases the lock, waits briefly and retries.
    """


@dataclass(frozen=True)
class Reservation:
    """Slots ``start .. start + rows - 1`` handed to one writer for one episode."""

    episode_id: int
    row: int
    start: int
    rows: int


class EpisodeRing:
    def __init__(
        self,
        capacity: int,
        table: np.ndarray,
        ring: np.ndarray,
        generation: np.ndarray,
        info: np.ndarray,
        tree: SumTree,
        counters: np.ndarray,
        counter_index: dict[str, int],
    ) -> None:
        self.capacity = capacity
        self.max_episodes = table.shape[0]
        self.table = table
        self.ring = ring
        self.generation = generation
        self.info = info
        self.tree = tree
        self.counters = counters
        self._c = counter_index

    # ---- writing ---------------------------------------------------------------------
    def reserve(self, rows: int, terminated: bool, pid: int | None = None) -> Reservation:
        """Claim ``rows`` contiguous slots, evicting the oldest episodes in the way.

        Raises RingBusy when a live writer's unpublished episode is in the way.
        """
        cap, ring, table = self.capacity, self.ring, self.table
        if not 1 <= rows <= cap:
            raise ValueError(f"an episode of {rows} rows does not fit a ring of {cap} slots")
        write_pos = int(ring[WRITE_POS])
        start = write_pos if write_pos + rows <= cap else 0
        # Slots consumed, counted from the write position (includes a skipped tail).
        consumed = rows if start == write_pos else (cap - write_pos) + rows
        while ring[HEAD_ID] < ring[NEXT_ID]:
            head_row = int(ring[HEAD_ID] % self.max_episodes)
            table_full = ring[NEXT_ID] - ring[HEAD_ID] >= self.max_episodes
            distance = (int(table[head_row, START]) - write_pos) % cap
            if distance >= consumed and not table_full:
                break
            self._evict_head(head_row)

        episode_id = int(ring[NEXT_ID])
        row = episode_id % self.max_episodes
        table[row] = (episode_id, start, rows, RESERVED, pid or os.getpid(), int(terminated))
        make_unsampleable(self.generation[start : start + rows])  # before the copy starts
        self.info[start : start + rows] = pack_info(rows, terminated)
        ring[NEXT_ID] = episode_id + 1
        ring[WRITE_POS] = start + rows
        return Reservation(episode_id, row, start, rows)

    def publish(self, res: Reservation, leaf_values: np.ndarray) -> bool:
        """Make a reserved episode sampleable with the given leaf values (rows - 1).

        Returns False when the reservation was taken back meanwhile (its writer was
        presumed dead); nothing is published then.
        """
        row = self.table[res.row]
        if row[ID] != res.episode_id or row[STATE] != RESERVED:
            return False
        self.tree.set_range(res.start, leaf_values)
        self.generation[res.start : res.start + res.rows] += 1  # odd -> even: sampleable
        row[STATE] = PUBLISHED
        positions = res.rows - 1
        self.ring[NUM_POSITIONS] += positions
        self.counters[self._c["games"]] += 1
        self.counters[self._c["steps"]] += positions
        return True

    def abandon(self, res: Reservation) -> None:
        """Give up a reservation whose copy failed: it becomes a hole, never sampled."""
        row = self.table[res.row]
        if row[ID] == res.episode_id and row[STATE] == RESERVED:
            row[STATE] = FREE
            make_unsampleable(self.generation[res.start : res.start + res.rows])
            self.counters[self._c["episodes_abandoned"]] += 1

    def _evict_head(self, head_row: int) -> None:
        row = self.table[head_row]
        state = int(row[STATE])
        start, rows = int(row[START]), int(row[ROWS])
        if state == RESERVED:
            if pid_alive(int(row[PID])):
                raise RingBusy()
            self.counters[self._c["episodes_abandoned"]] += 1  # its writer died mid-copy
        elif state == PUBLISHED:
            self.tree.set_range(start, np.zeros(rows - 1))
            self.ring[NUM_POSITIONS] -= rows - 1
            self.counters[self._c["episodes_evicted"]] += 1
        if state != FREE:
            make_unsampleable(self.generation[start : start + rows])
        row[STATE] = FREE
        self.ring[HEAD_ID] += 1

    # ---- reading ---------------------------------------------------------------------
    def resident_rows(self) -> np.ndarray:
        """Table rows of the resident episodes, oldest first."""
        ids = np.arange(self.ring[HEAD_ID], self.ring[NEXT_ID], dtype=np.int64)
        return ids % self.max_episodes

    def published_rows(self) -> np.ndarray:
        rows = self.resident_rows()
        return rows[self.table[rows, STATE] == PUBLISHED]
