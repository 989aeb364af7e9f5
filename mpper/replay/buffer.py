"""The prioritized replay buffer, in shared memory, shared by all mpper processes.

Storage is a ring of steps: each schema field is one array ``(capacity, *shape)``;
an ``EpisodeRing`` places whole episodes in contiguous slots and evicts the oldest; a
``SumTree`` holds one leaf per slot (0 for slots that cannot be sampled). All of it,
plus generations, counters and the episode table, lives in one shared-memory segment
whose layout follows from the schema and capacity, so another process attaches from a
small handle and copies nothing.

Concurrency: one lock serialises the *writers* of the tree, the episode table and the
ring (``add_episode``, ``update_priorities``, ``rewrite_rows``); sampling takes no lock
at all. The lock is a robust, process-shared pthread mutex in the segment itself
(``mpper.shm.RobustLock``): any process that maps the segment shares it, and if its
holder dies inside a critical section (SIGKILL), the next locker is told, repairs what
was half-written from the ring's journal (``EpisodeRing.repair``: the episode being
reserved or published is dropped, an eviction completed, the sum tree rebuilt from its
leaves), prints one line on stderr naming the dead pid, and goes on. A priority update
takes the mutex inside its compiled kernel (``kernels.locked_update``), and the Python
way only when it finds it held or its holder dead:

- a writer reserves slots under the lock (evicting, zeroing priorities, making the
  slots' generations odd), copies its episode *without* the lock, then publishes its
  priorities under the lock (generations become even). A slot is sampleable only while
  its generation is even;
- ``sample`` descends the tree, reads each drawn slot's generation and episode bounds,
  gathers rows and builds targets, then reads the generations again (a seqlock). Rows
  whose slot was unsampleable or rewritten meanwhile are drawn again, so a batch never
  holds a torn row. The learner therefore never waits for a writer, and a writer waits
  at most for another writer's few-microsecond critical section or a priority update;
- ``update_priorities`` and ``rewrite_rows`` apply only where the slot's generation
  still matches what was sampled or referenced.

Priorities: callers pass raw priorities ``p >= 0`` (|TD error|, |value error|); the
tree stores ``min(p + priority_eps, priority_clip) ** alpha``, so ``P(i) = leaf_i / sum``
and ``alpha = 0`` is uniform sampling. Importance weights are ``(N * P(i)) ** -beta``
divided by the batch maximum, N the number of sampleable positions.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .. import shm as shm_mod
from . import episode_ring
from .consistency import problems as consistency_problems
from .consistency import repair_after_death, repair_after_error
from .episode_ring import MAX_CAPACITY, NUM_POSITIONS, OP_PRIORITIES, EpisodeRing, RingBusy
from .episodes import EpisodeAccess, EpisodeRef
from .kernels import (
    apply_update,
    check_update,
    draw_kernel,
    empty_draw,
    find_torn,
    locked_update,
    tear_update,
    warm_kernels,
)
from .layout import (
    COUNTERS,
    POSITIONS,
    counters_by_name,
    extra_counter_names,
    segment_bytes,
    segment_layout,
    segment_offsets,
)
from .locking import SpinThenBlock, weak_call
from .schema import Field, normalize_schema
from .snapshot import SnapshotError, load_buffer, save_snapshot
from .sum_tree import SumTree
from .targets import RawRows

__all__ = ["COUNTERS", "Batch", "BufferHandle", "EpisodeRef", "ReplayBuffer", "load_snapshot", "segment_bytes",
           "warm_kernels"]

# How long add_episode waits for a live writer's unpublished episode to get out of the way.
_RESERVE_TIMEOUT_S = 60.0
# The buffer's own counters come first in every buffer's counter slots.
_COUNTER = {name: i for i, name in enumerate(COUNTERS)}


@dataclass(frozen=True)
class BufferHandle:
    """Everything another process needs to attach: plain data, picklable anywhere (the
    lock lives in the segment, so attaching the segment shares it)."""

    segment: str
    fields: tuple[Field, ...]
    capacity: int
    max_episodes: int
    alpha: float
    priority_eps: float
    priority_clip: float | None
    initial_priority: str | float
    counters: tuple[str, ...] = ()  # the schema's counters, in the slots after COUNTERS

    def portable(self) -> "BufferHandle":
        """This handle for a process of this machine that multiprocessing did not start
        (a Ray actor beside the learner). The handle is plain data and the lock lives in
        the segment, so it is the handle itself: the process that attaches it locks the
        same mutex as every other writer."""
        return self


@dataclass
class Batch:
    """A sampled batch. ``indices``/``generations`` go back to ``update_priorities``."""

    indices: np.ndarray  # (B,) int64 slot of each sampled position
    generations: np.ndarray  # (B,) int64 generation of that slot when sampled
    weights: np.ndarray  # (B,) float32 importance weights, max 1
    probabilities: np.ndarray  # (B,) float64 P(i)
    data: dict[str, np.ndarray]


class ReplayBuffer(EpisodeAccess, shm_mod.SharedObject):
    """Prioritized episode replay in shared memory. Build with ``create``, ``attach``
    or ``load``; see the module docstring for the concurrency rules."""

    def __init__(self, handle: BufferHandle | None, arrays: dict[str, np.ndarray], lock=None,
                 *, segment=None, owner=False, read_only=False, params=None) -> None:  # fmt: skip
        """``lock``: None for the segment's own mutex (``arrays["_lock"]``), or a lock
        object for a buffer outside shared memory (a read-only snapshot)."""
        self.handle = handle
        params = params or handle
        if lock is None:
            lock = shm_mod.RobustLock(arrays["_lock"], on_owner_death=weak_call(self, "_repair"))
        self._lock = lock
        self._locked = SpinThenBlock(lock, on_error=weak_call(self, "_repair_after_error"))
        # the mutex as compiled code takes it (kernels.locked_update); None: no shared mutex
        self._lock_calls, self._holder = lock.kernel_calls() if isinstance(lock, shm_mod.RobustLock) else (None, None)
        self._segment = segment
        self._owner = owner
        self.read_only = read_only
        self.capacity = params.capacity
        self.alpha = float(params.alpha)
        self.priority_eps = float(params.priority_eps)
        self.priority_clip = None if params.priority_clip is None else float(params.priority_clip)
        self.initial_priority = params.initial_priority
        self.schema: tuple[Field, ...] = params.fields
        self.counter_names: tuple[str, ...] = COUNTERS + tuple(getattr(params, "counters", ()))
        self._counter_index = {name: i for i, name in enumerate(self.counter_names)}
        self._arrays = arrays
        self.fields = {f.name: arrays[f.name] for f in self.schema}
        self._tree = SumTree(self.capacity, arrays["_tree"])
        self._generation = arrays["_generation"]
        self._info = arrays["_info"]
        self._episodes = arrays["_episodes"]
        self._ring_state = arrays["_ring"]
        self._counters = arrays["_counters"]
        self._max_priority = arrays["_max_priority"]
        self._ring = EpisodeRing(self.capacity, self._episodes, self._ring_state, self._generation,
                                 self._info, self._tree, self._counters, _COUNTER,
                                 arrays.get("_journal"))  # fmt: skip
        self._rng = np.random.default_rng()
        self.snapshot_manifest: dict | None = None  # set by load(): the manifest it came from
        self._raw_rows = RawRows()

    # ---- construction --------------------------------------------------------------
    @classmethod
    def create(
        cls,
        schema: Mapping[str, tuple],
        capacity: int,
        *,
        alpha: float = 0.6,
        priority_eps: float = 1e-6,
        priority_clip: float | None = None,
        initial_priority: str | float = "max",
        max_episodes: int | None = None,
        tag: str = "replay",
        mp_context=None,
        counters: Sequence[str] = (),
    ) -> "ReplayBuffer":
        """Create a buffer in a new shared-memory segment owned by this process.

        Args:
            schema: ``{field: (shape, dtype[, fill])}`` per-step fields; a ``Schema`` also
                names the extra event counters its algorithm counts (``counters``).
            capacity: number of step slots (rows) in the ring.
            alpha: priority exponent; 0 samples uniformly.
            priority_eps: added to raw priorities so nothing is starved (easy-rl's epsilon).
            priority_clip: raw priorities above this are clipped (easy-rl's abs_err_upper).
            initial_priority: ``"max"`` (largest raw priority seen so far, starting at 1)
                or a number, for episodes added without priorities.
            max_episodes: rows in the episode table (default: capacity // 2, enough for
                episodes of 2 rows, the shortest possible).
            mp_context: accepted and unused: the lock lives in the segment, so every start
                method (fork, forkserver, spawn) and any other process shares it alike.
            counters: extra event counters beside those of ``schema`` (identifiers; at
                most ``COUNTER_SLOTS - len(COUNTERS)`` in all), reported by ``counters``.
        """
        fields = normalize_schema(schema)
        extra_counters = extra_counter_names(tuple(getattr(schema, "counters", ())) + tuple(counters))
        capacity = int(capacity)
        if not 2 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be between 2 (one move) and {MAX_CAPACITY} slots, got {capacity}")
        max_episodes = int(max_episodes or max(1, capacity // 2))
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be >= 1, got {max_episodes}")
        if not alpha >= 0 or not np.isfinite(alpha):
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        if not priority_eps >= 0:
            raise ValueError(f"priority_eps must be >= 0, got {priority_eps}")
        if priority_clip is not None and not priority_clip > 0:
            raise ValueError(f"priority_clip must be > 0 or None, got {priority_clip}")
        if not (initial_priority == "max" or (isinstance(initial_priority, (int, float)) and initial_priority >= 0)):
            raise ValueError(f"initial_priority must be 'max' or a number >= 0, got {initial_priority!r}")
        layout = segment_layout(fields, capacity, max_episodes)
        offsets, nbytes = segment_offsets(layout)
        segment = shm_mod.create(nbytes, tag, what=f"a replay buffer of {capacity} steps")
        try:
            handle = BufferHandle(segment.name, fields, capacity, max_episodes, float(alpha),
                                  float(priority_eps), priority_clip, initial_priority, extra_counters)  # fmt: skip
            arrays = _map_arrays(segment.buf, layout, offsets)
            shm_mod.RobustLock.initialize(arrays["_lock"])
            for f in fields:
                if f.fill != 0:
                    arrays[f.name][...] = f.fill
            arrays["_max_priority"][0] = 1.0
            return cls(handle, arrays, segment=segment, owner=True)
        except BaseException:
            shm_mod.release(segment, unlink=True)
            raise

    @classmethod
    def attach(cls, handle: BufferHandle) -> "ReplayBuffer":
        """Map the buffer described by ``handle`` (from another process)."""
        segment = shm_mod.attach(handle.segment)
        layout = segment_layout(handle.fields, handle.capacity, handle.max_episodes)
        offsets, nbytes = segment_offsets(layout)
        if segment.size < nbytes:
            shm_mod.release(segment, unlink=False)
            raise ValueError(f"segment {handle.segment} holds {segment.size} bytes, the handle describes {nbytes}")
        return cls(handle, _map_arrays(segment.buf, layout, offsets), segment=segment)

    @classmethod
    def load(cls, path, mmap: bool = False, **kwargs) -> "ReplayBuffer":
        """Load a snapshot written by ``save``.

        ``mmap=False``: into a new shared-memory buffer owned by this process (to resume
        training). ``mmap=True``: read-only, fields memory-mapped from the files (for
        evaluation; a snapshot larger than RAM still opens). ``verify=False`` skips the
        checksums; ``num_actions`` (the env's) bounds the stored actions of a schema
        without ``child_visits``; ``add_fields`` (``{name: (shape, dtype[, fill])}``):
        fields the snapshot may lack, which the buffer then has at their fill value (a
        schema's ``optional`` fields, for a run resumed from an older snapshot).

        A snapshot may come from someone else: its files must be regular files of the
        directory, and its manifest, episode table, ring, slot records, priorities and
        the published rows' data are checked for consistency before anything is
        allocated; any problem is a SnapshotError naming the file and the entry.

        The counters are placed by the names the manifest lists them under, so a
        snapshot written when the counters sat in other slots loads them right; its
        names beyond ``COUNTERS`` become this buffer's extra counters.
        """
        buf = load_buffer(cls, path, mmap=mmap, **kwargs)
        try:
            buf._place_counters(path, buf.snapshot_manifest.get("counters"))
        except BaseException:
            buf.close()
            raise
        return buf

    def _place_counters(self, path, listed) -> None:
        """Set the counters to a snapshot manifest's ``{name: value}`` (None: a manifest
        without names; the slots stay as loaded) and adopt its extra names."""
        if listed is None:
            return
        try:
            extra, values = counters_by_name(listed)
        except ValueError as exc:
            raise SnapshotError(f"{path}/manifest.json: 'counters': {exc}") from None
        self.counter_names = COUNTERS + extra
        self._counter_index = {name: i for i, name in enumerate(self.counter_names)}
        self._counters[:] = values
        if self.handle is not None:
            self.handle = dataclasses.replace(self.handle, counters=extra)

    def save(self, path, extra: dict | None = None) -> None:
        """Write an atomic, checksummed, pickle-free snapshot directory at ``path``."""
        save_snapshot(self, path, extra=extra)

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Detach; the owner also unlinks the shared memory. Idempotent."""
        segment, self._segment = self._segment, None
        if segment is not None:
            if isinstance(self._lock, shm_mod.RobustLock):
                self._lock.close()
            self._lock_calls = self._holder = None
            self.fields = {}
            self._arrays = {}
            self._tree = self._ring = None
            self._generation = self._info = self._episodes = None
            self._ring_state = self._counters = self._max_priority = None
            shm_mod.release(segment, unlink=self._owner)

    # ---- writing -------------------------------------------------------------------
    def add_episode(self, arrays: Mapping[str, np.ndarray], priorities: np.ndarray | None = None,
                    terminated: bool = True) -> bool:  # fmt: skip
        """Store one episode of ``L = T + 1`` rows; returns True once it is sampleable.

        Args:
            arrays: ``{field: array (L, *shape)}``; fields left out get their fill value.
            priorities: raw priorities of the T positions, shape ``(T,)``, or None for
                ``initial_priority``.
            terminated: False when the episode was cut by a time limit (truncated).
        """
        if self.read_only:
            raise PermissionError("this buffer was loaded read-only (mmap=True)")
        warm_kernels()
        rows, prepared = self._prepare_episode(arrays)
        leaf = None if priorities is None else self._leaf_values(priorities, expect=rows - 1)
        res = self._reserve(rows, terminated)
        try:
            sl = slice(res.start, res.start + rows)
            for f in self.schema:
                if f.name in prepared:
                    self.fields[f.name][sl] = prepared[f.name]
                else:
                    self.fields[f.name][sl] = f.fill
        except BaseException:
            with self._locked:
                self._ring.abandon(res)
            raise
        with self._locked:
            if leaf is None:
                leaf = np.full(rows - 1, self._leaf_of(self._default_priority()))
            else:
                self._max_priority[0] = max(self._max_priority[0], float(np.max(priorities, initial=0.0)))
            return self._ring.publish(res, leaf)

    def _reserve(self, rows: int, terminated: bool):
        deadline = None
        while True:
            with self._locked:
                try:
                    return self._ring.reserve(rows, terminated)
                except RingBusy:
                    pass
            deadline = deadline or time.monotonic() + _RESERVE_TIMEOUT_S
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {_RESERVE_TIMEOUT_S:.0f} s for other writers' unpublished episodes; "
                    f"capacity {self.capacity} is too small for the episodes in flight"
                )
            time.sleep(0.001)

    def _prepare_episode(self, arrays: Mapping[str, np.ndarray]) -> tuple[int, dict]:
        known = {f.name: f for f in self.schema}
        unknown = sorted(set(arrays) - set(known))
        if unknown:
            raise ValueError(f"add_episode: unknown field(s) {unknown}; schema has {sorted(known)}")
        if not arrays:
            raise ValueError("add_episode needs at least one field")
        prepared, rows = {}, None
        for name, value in arrays.items():
            f = known[name]
            arr = np.asarray(value)
            if arr.shape[1:] != f.shape or arr.ndim != 1 + len(f.shape):
                raise ValueError(f"add_episode: field {name!r} has shape {arr.shape}, expected (L, *{f.shape})")
            if rows is None:
                rows = arr.shape[0]
            elif arr.shape[0] != rows:
                raise ValueError(f"add_episode: field {name!r} has {arr.shape[0]} rows, others have {rows}")
            if not np.can_cast(arr.dtype, f.dtype, casting="same_kind"):
                raise ValueError(f"add_episode: field {name!r} of dtype {arr.dtype} cannot be stored as {f.dtype}")
            prepared[name] = arr
        if rows < 2:
            raise ValueError(f"add_episode: an episode needs at least 2 rows (one move), got {rows}")
        if rows > self.capacity:
            raise ValueError(f"add_episode: an episode of {rows} rows is longer than the capacity {self.capacity}")
        return rows, prepared

    # ---- priorities ----------------------------------------------------------------
    def _leaf_values(self, priorities, expect: int | None = None) -> np.ndarray:
        p = np.asarray(priorities, dtype=np.float64)
        if expect is not None and p.shape != (expect,):
            raise ValueError(f"priorities must have shape ({expect},), got {p.shape}")
        bad = ~np.isfinite(p) | (p < 0)
        if bad.any():
            where = np.flatnonzero(bad)[:8]
            raise ValueError(
                f"priorities must be finite and >= 0; bad at positions {where.tolist()}: {p[where].tolist()}"
            )
        return self._transform(p)

    def _transform(self, p: np.ndarray) -> np.ndarray:
        p = p + self.priority_eps
        if self.priority_clip is not None:
            p = np.minimum(p, self.priority_clip)
        return p**self.alpha

    def _leaf_of(self, p: float) -> float:
        return float(self._transform(np.array([p]))[0])

    def _default_priority(self) -> float:
        if self.initial_priority == "max":
            return float(self._max_priority[0])
        return float(self.initial_priority)

    def update_priorities(self, indices: np.ndarray, generations: np.ndarray, priorities: np.ndarray) -> tuple[int, int]:
        """Set raw priorities where the slot still holds what was sampled.

        ``priorities``: (B,) for the sampled positions, or (B, M) where column k is the
        priority of the position k moves after the sampled one in the same episode
        (muzero-general writes the errors of all K + 1 unrolled positions); columns past
        the episode's last position are ignored. Returns ``(applied, dropped)`` in
        sampled rows; a row is dropped when its slot's generation changed since
        ``sample`` (the episode was evicted or rewritten).
        """
        if self.read_only:
            raise PermissionError("this buffer was loaded read-only (mmap=True)")
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        gen = np.ascontiguousarray(generations, dtype=np.int64)
        p = np.ascontiguousarray(priorities, dtype=np.float64)
        if idx.ndim != 1 or gen.shape != idx.shape or p.shape[:1] != idx.shape or p.ndim not in (1, 2):
            raise ValueError(
                f"indices and generations must be 1-D of equal length B and priorities (B,) or (B, M), got "
                f"{idx.shape}, {gen.shape} and {p.shape}"
            )
        p = p.reshape(idx.shape[0], -1)
        warm_kernels()
        clip = np.inf if self.priority_clip is None else self.priority_clip
        tree = self._tree
        if self._lock_calls is not None and episode_ring._fault is None:  # one compiled call: lock, update, unlock
            bad, rc, applied = locked_update(self._lock_calls, shm_mod.PID, self._holder, self._ring.journal,
                                             self._counters, self._max_priority, self.capacity, tree.tree,
                                             tree._leaf_base, self._generation, self._info, idx, gen, p,
                                             self.priority_eps, clip, self.alpha)  # fmt: skip
            if rc == 0 and bad < 0:
                self._locked.wait_hist[0] += 1
                return applied, idx.shape[0] - applied
        else:
            bad, rc = check_update(self.capacity, idx, p), errno.EBUSY
        if bad >= 0:  # nothing written
            if not 0 <= idx[bad] < self.capacity:
                raise IndexError(f"update_priorities: index {idx[bad]} at position {bad} outside [0, {self.capacity})")
            self._leaf_values(p[:, 0] if p.shape[1] == 1 else p)  # raises the ValueError naming the bad positions
        if rc < 0:
            raise OSError(-rc, f"pthread_mutex_unlock: {os.strerror(-rc)}")
        with self._locked.after_trylock(rc):  # held by another (EBUSY), or taken from a dead holder: repaired first
            self._ring.mark(OP_PRIORITIES)
            if episode_ring._fault is not None:  # test-only: die with half the leaves written, no sums
                episode_ring._fault.reached("priorities", tear=lambda: tear_update(tree, self._generation, self._info,
                                                                                    idx, gen))  # fmt: skip
            applied, top = apply_update(tree.tree, tree._leaf_base, self._generation, self._info, idx, gen, p,
                                         self.priority_eps, clip, self.alpha)  # fmt: skip
            if top > self._max_priority[0]:
                self._max_priority[0] = top
            self._counters[_COUNTER["priority_updates_applied"]] += applied
            self._counters[_COUNTER["priority_updates_dropped"]] += idx.shape[0] - applied
            self._ring.end()
        return applied, idx.shape[0] - applied

    # ---- sampling ------------------------------------------------------------------
    def _draw(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        """Draw ``batch_size`` sampleable slots.

        Returns arrays (slot, generation, info, P(i), position, T, terminated), each (B,).
        No lock: a concurrent writer can only make a drawn row unsampleable (odd
        generation, 0 leaf); such rows are drawn again. P(i) is read as the descent
        found it; with writers active it is that of a tree a few microseconds old.
        """
        out = empty_draw(batch_size)
        tree = self._tree
        rows, todo = out, None
        for _ in range(1000):
            if not tree.tree[1] > 0.0:
                raise ValueError("cannot sample: the buffer holds no sampleable positions yet")
            rejected = draw_kernel(tree.tree, tree._leaf_base, rng.random(rows[0].size), self._generation,
                                    self._info, *rows)  # fmt: skip
            if todo is not None:  # a redraw: put the new rows in place
                for full, part in zip(out, rows):
                    full[todo] = part
            if rejected == 0:
                break
            todo = np.flatnonzero(out[1] < 0)
            rows = empty_draw(todo.size)
        else:  # pragma: no cover - the tree kept changing under 1000 redraws
            raise RuntimeError("sample: could not draw sampleable rows; is a writer stuck?")
        # exact with one sampling process (the learner); no lock, so not with several
        self._counters[_COUNTER["samples"]] += batch_size
        return out

    def sample(self, batch_size: int, beta: float = 0.4, targets=None, rng: np.random.Generator | None = None,
               training_step: int | None = None) -> Batch:  # fmt: skip
        """Draw ``batch_size`` positions with probability ``P(i)`` (stratified) and build
        targets for them (``MuZeroTargets``, ``NStepTargets`` or None for raw rows);
        ``training_step``, the learner's completed updates, goes to the targets (whose
        value horizon may depend on the data's age).

        Raises ValueError when nothing is sampleable.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rng = self._rng if rng is None else rng
        targets = self._raw_rows if targets is None else targets
        slots, gen, info, prob, pos, moves, term = self._draw(batch_size, rng)
        data = targets.build(self.fields, slots, pos, moves, term, rng, training_step=training_step)
        # Seqlock check: a writer makes the generation of every slot of an episode odd
        # before it touches any of them, so an unchanged (even) generation and info mean
        # the rows gathered are intact. Rewritten rows are drawn and gathered again.
        for _ in range(1000):
            torn = find_torn(self._generation, self._info, slots, gen, info)
            if torn.size == 0:
                break
            self._counters[_COUNTER["torn_rows_redrawn"]] += torn.size  # statistics only
            s2, g2, i2, p2, pos2, m2, t2 = self._draw(torn.size, rng)
            d2 = targets.build(self.fields, s2, pos2, m2, t2, rng, training_step=training_step)
            slots[torn], gen[torn], info[torn], prob[torn] = s2, g2, i2, p2
            for key in data:
                data[key][torn] = d2[key]
        else:  # pragma: no cover - would need writers lapping the ring 1000 times in a row
            raise RuntimeError("sample: rows kept being rewritten while gathering; capacity too small?")
        # (N * P(i)) ** -beta / max_j (N * P(j)) ** -beta: N cancels, the max is at min P
        # in float32, the precision of the weights handed to the loss: half the cost
        weights = (prob * (1.0 / prob.min())).astype(np.float32) ** np.float32(-beta)
        return Batch(slots, gen, weights, prob, data)

    # ---- statistics ----------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        """Shared counters by name, the buffer's own (``COUNTERS``), then its schema's,
        then ``positions`` (sampleable now); read without the lock: each value is one
        aligned int64."""
        out = {name: int(self._counters[i]) for i, name in enumerate(self.counter_names)}
        out[POSITIONS] = int(self._ring_state[NUM_POSITIONS])
        return out

    def __len__(self) -> int:
        """Number of sampleable positions (not the total priority, unlike easy-rl)."""
        return int(self._ring_state[NUM_POSITIONS])

    def lock_wait_stats(self) -> dict:
        """How long this process has waited for the buffer's lock, over all its locked
        operations so far (in the learner: ``update_priorities``, its only one):
        ``lock_wait_hist_us`` counts per log2 bin of microseconds (index 0: under 1 us;
        index i: ``[2^(i-1), 2^i)`` us; trailing empty bins left out) and
        ``lock_wait_max_us`` the longest wait."""
        hist = list(self._locked.wait_hist)
        while len(hist) > 1 and hist[-1] == 0:
            hist.pop()
        return {"lock_wait_hist_us": hist, "lock_wait_max_us": self._locked.wait_max_ns / 1000}

    def _repair(self, dead_pid: int) -> None:
        """The lock's ``on_owner_death`` (``consistency.repair_after_death``)."""
        repair_after_death(self, dead_pid)

    def _repair_after_error(self) -> None:
        """The locked block's ``on_error`` (``consistency.repair_after_error``)."""
        repair_after_error(self)

    def check_consistency(self) -> list[str]:
        """Problems with the buffer's bookkeeping, none when consistent (takes the lock;
        see ``mpper.replay.consistency.problems``)."""
        with self._locked:
            return consistency_problems(self)

    @property
    def total_priority(self) -> float:
        return self._tree.total

    @property
    def max_priority(self) -> float:
        return float(self._max_priority[0])

    def priorities(self, indices: np.ndarray) -> np.ndarray:
        """Current leaf values (transformed priorities) at ``indices``."""
        return self._tree.get(indices)

    def __repr__(self) -> str:
        return (f"ReplayBuffer(capacity={self.capacity}, positions={len(self) if self._ring_state is not None else '?'}, "
                f"fields={[f.name for f in self.schema]})")  # fmt: skip


def _map_arrays(buf, layout, offsets) -> dict[str, np.ndarray]:
    """Logical arrays (see ``array_specs``) as views into a segment's buffer."""
    stored = {name: np.ndarray(shape, dtype=dtype, buffer=buf, offset=off)
              for (name, shape, dtype), off in zip(layout, offsets)}  # fmt: skip
    records = stored.pop("_records")
    return {name: records[name] for name in records.dtype.names} | stored


def load_snapshot(path) -> ReplayBuffer:
    """A read-only buffer over a snapshot directory, for notebooks and tools:
    ``episodes()``, ``read_episode()``, ``sample()`` with the stored priorities,
    ``counters``; ``add_episode`` and ``update_priorities`` raise PermissionError.
    Memory-mapped: a snapshot larger than RAM still opens."""
    return ReplayBuffer.load(path, mmap=True)
