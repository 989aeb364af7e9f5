"""Whole episodes of a replay buffer: references, reads and generation-guarded rewrites.

Reanalyse and inspection work on whole episodes rather than sampled positions. An
``EpisodeRef`` records where an episode lay and the generation of its first slot; a read
or a rewrite through it applies only while the episode is still the same one (the
buffer's generation rule), so nothing computed from an evicted episode reaches its
successor's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from . import episode_ring
from .episode_ring import ID, OP_REWRITE, PUBLISHED, ROWS, START, STATE, TERMINATED

__all__ = ["EpisodeAccess", "EpisodeRef"]


@dataclass(frozen=True)
class EpisodeRef:
    """A stored episode as seen at one moment (for reanalyse and inspection)."""

    episode_id: int
    start: int  # first slot
    rows: int  # T + 1
    generation: int  # generation of its first slot when referenced
    terminated: bool


class EpisodeAccess:
    """The whole-episode methods of ``ReplayBuffer`` (its base class), which provides
    what they use: ``_locked`` (the writers' lock), ``_ring``, ``_episodes``,
    ``_generation``, ``fields``, ``schema``, the counters and ``_rng``."""

    def sample_episodes(self, count: int, rng: np.random.Generator | None = None) -> list[EpisodeRef]:
        """Up to ``count`` distinct published episodes, uniformly at random."""
        rng = self._rng if rng is None else rng
        with self._locked:
            rows = self._ring.published_rows()
            if rows.size == 0:
                return []
            return self._refs(rows[rng.choice(rows.size, size=min(count, rows.size), replace=False)])

    def episodes(self) -> list[EpisodeRef]:
        """All published episodes, oldest first."""
        with self._locked:
            return self._refs(self._ring.published_rows())

    def _refs(self, table_rows: np.ndarray) -> list[EpisodeRef]:
        """EpisodeRefs of episode-table rows (call with the lock held)."""
        ep = self._episodes[table_rows]
        gens = self._generation[ep[:, START]]
        return [EpisodeRef(int(e[ID]), int(e[START]), int(e[ROWS]), int(g), bool(e[TERMINATED]))
                for e, g in zip(ep, gens)]  # fmt: skip

    def read_episode(self, ref: EpisodeRef, names=None) -> dict[str, np.ndarray] | None:
        """Copies of an episode's rows, or None if it was evicted before or during the read."""
        sl = slice(ref.start, ref.start + ref.rows)
        out = {name: self.fields[name][sl].copy() for name in (names or self.fields)}
        return out if self._generation[ref.start] == ref.generation else None

    def rewrite_rows(self, ref: EpisodeRef, rows: Mapping[str, np.ndarray],
                     counters: tuple[str, str] | None = None) -> bool:  # fmt: skip
        """Write new values over rows of the episode ``ref`` if it is still the same
        episode (its generation, id and publication unchanged since ``ref`` was taken);
        returns whether they were written.

        Args:
            rows: ``{field: array (n, *shape)}``, written over the episode's first ``n``
                rows (``1 <= n <= ref.rows``, per field); float values must be finite
                once stored in the field's dtype.
            counters: ``(written, dropped)``, the names of two of the schema's counters:
                one of them counts this call.

        Everything is checked before anything is written. The rows change in place,
        under the lock and journaled (a death inside is repaired, what was written
        kept), but their generations do not: a sampler may gather a row half old, half
        new, so a rewrite suits fields whose old and new values are both valid targets.
        """
        if self.read_only:
            raise PermissionError("this buffer was loaded read-only (mmap=True)")
        known = {f.name: f for f in self.schema}
        prepared = {}
        for name, value in rows.items():
            f = known.get(name)
            if f is None:
                raise ValueError(f"rewrite_rows: unknown field {name!r}; schema has {sorted(known)}")
            arr = np.asarray(value)
            if arr.ndim != 1 + len(f.shape) or arr.shape[1:] != f.shape or not 1 <= arr.shape[0] <= ref.rows:
                raise ValueError(f"rewrite_rows: field {name!r} has shape {arr.shape}, expected (n, *{f.shape}) with "
                                 f"1 <= n <= {ref.rows} (the rows of episode {ref.episode_id})")  # fmt: skip
            if not np.can_cast(arr.dtype, f.dtype, casting="same_kind"):
                raise ValueError(f"rewrite_rows: field {name!r} of dtype {arr.dtype} cannot be stored as {f.dtype}")
            with np.errstate(over="ignore", invalid="ignore"):  # out of range: refused as not finite below
                arr = arr.astype(f.dtype, copy=False)
            if f.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ValueError(f"rewrite_rows: field {name!r} for episode {ref.episode_id} must be finite")
            prepared[name] = arr
        if counters is not None:
            unknown = [name for name in counters if name not in self._counter_index]
            if len(counters) != 2 or unknown:
                raise ValueError(f"rewrite_rows: counters must be two of the buffer's counters "
                                 f"{list(self.counter_names)}, got {list(counters)}")  # fmt: skip
        with self._locked:
            self._ring.mark(OP_REWRITE, ref.episode_id)
            row = self._episodes[ref.episode_id % self._episodes.shape[0]]
            ok = (self._generation[ref.start] == ref.generation and row[ID] == ref.episode_id
                  and row[STATE] == PUBLISHED)  # fmt: skip
            if ok:
                for name, arr in prepared.items():
                    self.fields[name][ref.start : ref.start + arr.shape[0]] = arr
                    if episode_ring._fault is not None:  # test-only: die with some fields written
                        episode_ring._fault.reached("rewrite")
            if counters is not None:
                self._counters[self._counter_index[counters[0] if ok else counters[1]]] += 1
            self._ring.end()
        return bool(ok)
