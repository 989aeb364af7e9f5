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

- ``journal``: int64 ``(JOURNAL_FIELDS,)``, what the holder of the buffer's lock is
  changing: every critical section that writes starts with ``begin`` (the ring and the
  counters as they were, then the operation and its episode; ``mark``, the operation
  alone, for priority updates and row rewrites) and ends with ``end``. If
  the holder dies in between (the lock is a robust mutex: the next locker learns it),
  ``repair`` restores the ring and counters from the journal and redoes the operation to
  a consistent end, whichever of its writes had happened: a reservation or a publication
  becomes a hole (dropped, never sampled), an eviction is completed, a priority update
  keeps the leaves it wrote and the sum tree is rebuilt from its leaves.

Episodes are reserved in order under the lock, so they sit in the ring in the order of
their ids: the oldest is always the first one at or after the write position. Writing
``rows`` slots therefore evicts from the head of the table until the head no longer
lies in the region the new episode consumes (the slots up to its end, plus the unused
tail when it wraps to slot 0), or until the table has a free row.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import numba
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
# Journal entries: the operation, its episode, then copies of the ring and the counters.
J_OP, J_EPISODE, J_ROW, J_START, J_ROWS, J_STATE, J_TERMINATED, J_PID = range(8)
J_RING, J_COUNTERS = 8, 16
JOURNAL_FIELDS = 32  # J_COUNTERS + the 16 counter slots of the segment
# Journal operations (OP_NONE: the lock holder is writing nothing).
OP_NONE, OP_RESERVE, OP_PUBLISH, OP_ABANDON, OP_EVICT, OP_PRIORITIES, OP_REWRITE = range(7)
OP_NAMES = {OP_RESERVE: "reserving episode", OP_PUBLISH: "publishing episode", OP_ABANDON: "abandoning episode",
            OP_EVICT: "evicting episode", OP_PRIORITIES: "updating priorities", OP_REWRITE: "rewriting rows of episode"}
# Test-only fault injection: "POINT[:N[:CLAIM]]" makes the process SIGKILL itself, lock held, at the
# N-th time (default 1) it reaches POINT ("reserve", "publish", "evict", "priorities" or "rewrite") inside a
# critical section; with CLAIM (a file path), only the first process to create that file does, once.
FAULT_ENV = "MPPER_FAULT_DIE_IN_LOCK"
_UNLOCKED_COUNTERS = ("samples", "torn_rows_redrawn")


def pack_info(rows: int, terminated: bool) -> np.ndarray:
    """INFO of the ``rows`` slots of a newly reserved episode."""
    pos = np.arange(rows, dtype=np.int64)
    return (pos << POS_SHIFT) | ((rows - 1) << MOVES_SHIFT) | (TERMINATED_BIT if terminated else 0)


def make_unsampleable(gen: np.ndarray) -> None:
    """Set generations to the next odd value (in place): evicted, reserved or a hole."""
    gen += 1 + (gen & 1)


# The ring's own writes to slot records, compiled: they run under the buffer's lock,
# where a few numpy calls per episode would cost more than the rest of the section.
@numba.njit(cache=True, nogil=True)
def unsampleable(generation, start, rows):
    """``make_unsampleable`` of the slots ``start .. start + rows - 1``."""
    for s in range(start, start + rows):
        generation[s] = (generation[s] + 1) | 1


@numba.njit(cache=True, nogil=True)
def sampleable(generation, start, rows):
    """The slots ``start .. start + rows - 1`` of a reserved episode (odd) become even."""
    for s in range(start, start + rows):
        generation[s] += 1


@numba.njit(cache=True, nogil=True)
def write_info(info, start, rows, terminated):
    """``pack_info(rows, terminated)`` written to the slots ``start .. start + rows - 1``."""
    moves = ((rows - 1) << MOVES_SHIFT) | (TERMINATED_BIT if terminated else 0)
    for k in range(rows):
        info[start + k] = (k << POS_SHIFT) | moves


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
        journal: np.ndarray | None = None,
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
        self.journal = np.zeros(JOURNAL_FIELDS, np.int64) if journal is None else journal
        self._journal_view, self._ring_view, self._counters_view = (
            memoryview(a).cast("B").cast("q") for a in (self.journal, ring, counters))  # fmt: skip

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
        pid = pid or os.getpid()
        self.begin(OP_RESERVE, episode_id, row, start, rows, terminated=int(terminated), pid=pid)
        table[row] = (episode_id, start, rows, RESERVED, pid, int(terminated))
        unsampleable(self.generation, start, rows)  # before the copy starts
        if _fault is not None:
            _fault.reached("reserve")
        write_info(self.info, start, rows, terminated)
        ring[NEXT_ID] = episode_id + 1
        ring[WRITE_POS] = start + rows
        self.end()
        return Reservation(episode_id, row, start, rows)

    def publish(self, res: Reservation, leaf_values: np.ndarray) -> bool:
        """Make a reserved episode sampleable with the given leaf values (rows - 1).

        Returns False when the reservation was taken back meanwhile (its writer was
        presumed dead); nothing is published then.
        """
        row = self.table[res.row]
        if row[ID] != res.episode_id or row[STATE] != RESERVED:
            return False
        self.begin(OP_PUBLISH, res.episode_id, res.row, res.start, res.rows)
        self.tree.set_range(res.start, leaf_values, check=False)  # checked by the buffer before the lock
        sampleable(self.generation, res.start, res.rows)
        if _fault is not None:
            _fault.reached("publish")
        row[STATE] = PUBLISHED
        positions = res.rows - 1
        self.ring[NUM_POSITIONS] += positions
        self.counters[self._c["games"]] += 1
        self.counters[self._c["steps"]] += positions
        self.end()
        return True

    def abandon(self, res: Reservation) -> None:
        """Give up a reservation whose copy failed: it becomes a hole, never sampled."""
        row = self.table[res.row]
        if row[ID] == res.episode_id and row[STATE] == RESERVED:
            self.begin(OP_ABANDON, res.episode_id, res.row, res.start, res.rows)
            self._drop(res.row, res.start, res.rows)
            self.end()

    def _drop(self, row: int, start: int, rows: int) -> None:
        """Turn a reserved (or half-published) episode into a hole: never sampled."""
        self.tree.set_range(start, np.zeros(rows - 1), check=False)
        unsampleable(self.generation, start, rows)
        self.table[row, STATE] = FREE
        self.counters[self._c["episodes_abandoned"]] += 1

    def _evict_head(self, head_row: int) -> None:
        row = self.table[head_row]
        state = int(row[STATE])
        start, rows = int(row[START]), int(row[ROWS])
        if state == RESERVED and pid_alive(int(row[PID])):
            raise RingBusy()
        self.begin(OP_EVICT, int(row[ID]), head_row, start, rows, state=state)
        self._evict(head_row, state, start, rows)
        self.end()

    def _evict(self, head_row: int, state: int, start: int, rows: int) -> None:
        if state == RESERVED:
            self.counters[self._c["episodes_abandoned"]] += 1  # its writer died mid-copy
        elif state == PUBLISHED:
            self.tree.set_range(start, np.zeros(rows - 1), check=False)
            if _fault is not None:
                _fault.reached("evict")
            self.ring[NUM_POSITIONS] -= rows - 1
            self.counters[self._c["episodes_evicted"]] += 1
        if state != FREE:
            unsampleable(self.generation, start, rows)
        self.table[head_row, STATE] = FREE
        self.ring[HEAD_ID] += 1

    # ---- the journal: what the lock holder is changing ---------------------------------
    def begin(self, op: int, episode_id: int = -1, row: int = -1, start: int = 0, rows: int = 0, *,
              state: int = FREE, terminated: int = 0, pid: int = 0) -> None:  # fmt: skip
        """Record, with the lock held and before the first write, the ring and counters
        as they are and the operation about to change them (see ``repair``)."""
        j = self._journal_view  # memoryviews: a fraction of numpy's cost per small write
        j[J_RING : J_RING + RING_FIELDS] = self._ring_view
        j[J_COUNTERS : J_COUNTERS + len(self._counters_view)] = self._counters_view
        j[J_EPISODE] = episode_id
        j[J_ROW] = row
        j[J_START] = start
        j[J_ROWS] = rows
        j[J_STATE] = state
        j[J_TERMINATED] = terminated
        j[J_PID] = pid
        j[J_OP] = op  # last: the entry counts only once it is whole

    def mark(self, op: int, episode_id: int = -1) -> None:
        """``begin`` for an operation whose repair needs no copies: it writes only leaves
        (rebuilt after any death) or values and statistics (kept as they are)."""
        j = self._journal_view
        j[J_EPISODE] = episode_id
        j[J_OP] = op

    def end(self) -> None:
        """The operation recorded by ``begin`` is complete."""
        self._journal_view[J_OP] = OP_NONE

    def repair(self) -> list[str]:
        """Bring the ring, table, generations, leaves and counters back to a consistent
        state after a lock holder died (call with the lock held). Idempotent: a repairer
        that dies too leaves the journal as it found it, for the next one.

        Returns what was repaired, one phrase each. The caller rebuilds the sum tree's
        internal nodes from its leaves afterwards (a writer may have died half-way up).
        """
        j = self.journal
        op = int(j[J_OP])
        done = []
        if op in (OP_PRIORITIES, OP_REWRITE):  # marked only: leaves and values stay as written
            done.append("a half-applied priority update kept as written" if op == OP_PRIORITIES
                        else f"the half-rewritten rows of episode {int(j[J_EPISODE])} kept as written")  # fmt: skip
            self.end()
        elif op != OP_NONE:
            # undo the counters and ring positions, then redo the operation to a consistent end
            self.ring[:] = j[J_RING : J_RING + RING_FIELDS]
            saved = j[J_COUNTERS : J_COUNTERS + self.counters.shape[0]].copy()
            for name in _UNLOCKED_COUNTERS:  # the sampler counts these without the lock: keep them
                saved[self._c[name]] = self.counters[self._c[name]]
            self.counters[:] = saved
            episode_id, row, start, rows = (int(j[k]) for k in (J_EPISODE, J_ROW, J_START, J_ROWS))
            if op == OP_RESERVE:  # completed as a hole
                self.table[row] = (episode_id, start, rows, RESERVED, int(j[J_PID]), int(j[J_TERMINATED]))
                write_info(self.info, start, rows, bool(j[J_TERMINATED]))
                self.ring[NEXT_ID] = episode_id + 1
                self.ring[WRITE_POS] = start + rows
                self._drop(row, start, rows)
                done.append(f"episode {episode_id} (being reserved) dropped")
            elif op in (OP_PUBLISH, OP_ABANDON):
                self._drop(row, start, rows)
                done.append(f"episode {episode_id} ({'being published' if op == OP_PUBLISH else 'abandoned'}) dropped")
            elif op == OP_EVICT:
                self._evict(row, int(j[J_STATE]), start, rows)
                done.append(f"the eviction of episode {episode_id} completed")
            self.end()
        # reservations of writers that are gone (died copying, outside the lock): holes now,
        # rather than at their eviction
        for row in self.resident_rows():
            if self.table[row, STATE] == RESERVED and not pid_alive(int(self.table[row, PID])):
                r = self.table[row]
                self.begin(OP_ABANDON, int(r[ID]), int(row), int(r[START]), int(r[ROWS]))
                self._drop(int(row), int(r[START]), int(r[ROWS]))
                self.end()
                done.append(f"episode {int(r[ID])} (its writer pid {int(r[PID])} gone) dropped")
        return done

    # ---- reading ---------------------------------------------------------------------
    def resident_rows(self) -> np.ndarray:
        """Table rows of the resident episodes, oldest first."""
        ids = np.arange(self.ring[HEAD_ID], self.ring[NEXT_ID], dtype=np.int64)
        return ids % self.max_episodes

    def published_rows(self) -> np.ndarray:
        rows = self.resident_rows()
        return rows[self.table[rows, STATE] == PUBLISHED]


class _Fault:
    """The test-only fault of ``FAULT_ENV``: die (SIGKILL, lock held) at a point."""

    def __init__(self, spec: str) -> None:
        point, _, rest = spec.partition(":")
        count, _, self.claim = rest.partition(":")
        self.point, self.remaining = point, int(count or 1)

    def reached(self, point: str, tear=None) -> None:
        if point != self.point:
            return
        self.remaining -= 1
        if self.remaining != 0:
            return
        if self.claim:
            try:
                os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                return  # another process took this fault already
        if tear is not None:
            tear()
        os.kill(os.getpid(), signal.SIGKILL)


_fault = _Fault(os.environ[FAULT_ENV]) if os.environ.get(FAULT_ENV) else None
