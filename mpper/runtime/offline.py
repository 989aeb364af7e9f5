"""Offline runs (``--offline SNAPSHOT ...``): the replay buffer filled once from saved
buffer snapshots, then the learner (and MuZero's reanalyser) trains with no self-play.

- :func:`read_sources` opens each snapshot as a received one (``ReplayBuffer.load``:
  regular files only, sizes bounded, checksums and bookkeeping checked), counts what it
  holds and names it by the SHA-256 of its ``manifest.json``, which lists the SHA-256 of
  every file the load checked. Nothing is allocated beyond the memory map.
- :func:`check_sources` holds them against the run's config and env before the run
  directory is claimed: the env the snapshot was recorded on (``extra.config.env``,
  when the snapshot says), the fields both schemas have (shape and dtype), the stored
  actions against the env's action count.
- :func:`fill_buffer` copies every published episode of every snapshot, in the order
  given, into the run's new buffer: the fields both schemas have; a field the run's
  schema has and the snapshot lacks gets its fill value (a DQN snapshot in a MuZero
  run: no search statistics, which the reanalyser then computes). Each snapshot is
  checked again against the checksum the run records, so the data trained on is the
  data ``offline.json`` names.

The run's buffer counts the loaded steps in its ``steps`` counter; whatever self-play
stores comes on top (none in an offline run): ``Run.record`` writes both
``dataset_env_steps`` and ``selfplay_env_steps``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import write_json_atomic
from ..replay.buffer import ReplayBuffer
from ..replay.schema import normalize_schema
from ..replay.snapshot import SnapshotError
from ..replay.snapshot_checks import MANIFEST

__all__ = ["OfflineData", "OfflineError", "OfflineSource", "check_env", "check_sources", "fill_buffer", "read_sources",
           "write_record"]  # fmt: skip

# The fields every algorithm's schema has (algos/base.py EpisodeRows): an offline run needs them
CORE_FIELDS = ("observation", "action", "reward")
RECORD_NAME = "offline.json"
# What names an env's dynamics and observations (a time limit, env.max_episode_steps, may differ)
ENV_KEYS = ("id", "kwargs", "preprocessing", "preprocessing_kwargs")


class OfflineError(ValueError):
    """A snapshot an offline run cannot learn from, said in one line."""


@dataclass(frozen=True)
class OfflineSource:
    """One snapshot an offline run learns from: ``path`` (absolute), ``manifest_sha256``
    (the SHA-256 of its ``manifest.json``, which holds every file's), ``episodes``
    (published), ``steps`` (their transitions, T per episode), ``rows`` (T + 1 per episode),
    ``env`` (the :data:`ENV_KEYS` of the env it was recorded on, or None when it does not say),
    ``fields`` ({name: (shape, dtype str)}) and ``max_action`` (-1 when empty)."""

    path: str
    manifest_sha256: str
    episodes: int
    steps: int
    rows: int
    env: dict | None
    fields: dict
    max_action: int

    def record(self) -> dict:
        return {"path": self.path, "manifest_sha256": self.manifest_sha256, "episodes": self.episodes,
                "steps": self.steps, "env": self.env}  # fmt: skip


@dataclass(frozen=True)
class OfflineData:
    """The snapshots of an offline run, in the order they are loaded."""

    sources: tuple[OfflineSource, ...]

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.sources)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.sources)

    @property
    def episodes(self) -> int:
        return sum(s.episodes for s in self.sources)

    def record(self) -> dict:
        """What ``offline.json`` holds: each snapshot by path and checksum, and the totals."""
        return {"snapshots": [s.record() for s in self.sources], "episodes": self.episodes, "steps": self.steps}


def _manifest_sha256(path: Path) -> str:
    return hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()


def read_sources(paths: list[str | Path]) -> OfflineData:
    """Open and check every snapshot (checksums included); OfflineError for one that is
    missing, corrupt, empty, or named twice."""
    sources: list[OfflineSource] = []
    seen: dict[str, str] = {}
    for given in paths:
        path = Path(given)
        if not path.is_dir() or path.is_symlink():
            raise OfflineError(f"--offline {given}: no such snapshot directory")
        try:
            with ReplayBuffer.load(path, mmap=True, verify=True) as buf:
                refs = buf.episodes()
                steps = sum(ref.rows - 1 for ref in refs)
                rows = sum(ref.rows for ref in refs)
                max_action = max((int(buf.fields["action"][r.start : r.start + r.rows].max()) for r in refs),
                                 default=-1) if "action" in buf.fields else -1  # fmt: skip
                fields = {f.name: (tuple(f.shape), f.dtype.str) for f in buf.schema}
                extra = buf.snapshot_manifest.get("extra") or {}
            digest = _manifest_sha256(path)
        except (SnapshotError, OSError) as e:
            raise OfflineError(f"--offline {given}: {' '.join(str(e).splitlines())}") from None
        if steps == 0:
            raise OfflineError(f"--offline {given}: the snapshot holds no transitions (no stored episode with a move)")
        if digest in seen:
            raise OfflineError(f"--offline {given}: the same snapshot as {seen[digest]} (manifest SHA-256 {digest})")
        seen[digest] = str(given)
        env = None
        config = extra.get("config") if isinstance(extra, dict) else None
        if isinstance(config, dict) and isinstance(config.get("env"), dict) and "id" in config["env"]:
            env = {key: config["env"][key] for key in ENV_KEYS if key in config["env"]}
        sources.append(OfflineSource(str(path.resolve()), digest, len(refs), steps, rows, env, fields, max_action))
    if not sources:
        raise OfflineError("--offline: name at least one snapshot directory")
    return OfflineData(tuple(sources))


def check_env(data: OfflineData, config) -> None:
    """OfflineError for a snapshot recorded on another env than the run's (``env.id``,
    ``env.kwargs`` or the preprocessing: :data:`ENV_KEYS`, those it records); one that
    does not say is judged by its fields (:func:`check_sources`)."""
    for source in data.sources:
        if source.env is None:
            continue
        env = {key: getattr(config.env, key) for key in source.env}
        if source.env != env:
            raise OfflineError(f"--offline {source.path}: recorded on env {json.dumps(source.env)}, but the run's env "
                               f"is {json.dumps(env)}")  # fmt: skip


def check_sources(data: OfflineData, config, spec, schema) -> None:
    """OfflineError when a snapshot does not fit the run: recorded on another env
    (:func:`check_env`), a core field missing, a field both schemas have of another shape
    or dtype, or an action outside the env's ``spec.num_actions``."""
    check_env(data, config)
    wanted = {f.name: (tuple(f.shape), f.dtype.str) for f in normalize_schema(schema)}
    for source in data.sources:
        where = f"--offline {source.path}"
        for name in CORE_FIELDS:
            if name not in source.fields:
                raise OfflineError(f"{where}: the snapshot has no {name!r} field (it holds {sorted(source.fields)})")
        for name, (shape, dtype) in source.fields.items():
            if name in wanted and wanted[name] != (shape, dtype):
                raise OfflineError(f"{where}: field {name!r} is {_describe(shape, dtype)} in the snapshot, but the "
                                   f"run stores {_describe(*wanted[name])} (another env or observation shape)")  # fmt: skip
        if source.max_action >= spec.num_actions:
            raise OfflineError(f"{where}: holds action {source.max_action}, but the run's env has "
                               f"{spec.num_actions} actions")  # fmt: skip


def _describe(shape: tuple, dtype: str) -> str:
    return f"shape {shape} {np.dtype(dtype).name}"


def fill_buffer(buf: ReplayBuffer, data: OfflineData) -> int:
    """Copy every published episode of ``data``'s snapshots into ``buf`` (empty, and
    large enough: ``replay.capacity`` >= ``data.rows``), oldest first, snapshot after
    snapshot, with the buffer's initial priorities; returns the steps stored.
    SnapshotError when a snapshot changed since :func:`read_sources` (its checksum),
    or when the buffer could not keep every episode."""
    names = {f.name for f in buf.schema}
    for source in data.sources:
        path = Path(source.path)
        with ReplayBuffer.load(path, mmap=True, verify=True) as snapshot:
            if _manifest_sha256(path) != source.manifest_sha256:
                raise SnapshotError(f"{path}: changed since the run checked it (its manifest's SHA-256 is no longer "
                                    f"{source.manifest_sha256})")  # fmt: skip
            shared = [name for name in snapshot.fields if name in names]
            for ref in snapshot.episodes():
                rows = snapshot.read_episode(ref, names=shared)
                assert rows is not None  # a read-only snapshot: nothing evicts
                buf.add_episode(rows, terminated=ref.terminated)
    stored = len(buf.episodes())
    if stored != data.episodes or buf.counters["steps"] != data.steps:
        raise SnapshotError(f"the run's buffer kept {stored} of the {data.episodes} episodes of the snapshots "
                            f"(replay.capacity {buf.capacity}, {data.rows} rows needed)")  # fmt: skip
    return data.steps


def write_record(run_dir: Path, data: OfflineData) -> None:
    """``offline.json`` in the run directory: the snapshots learned from, by checksum."""
    write_json_atomic(run_dir / RECORD_NAME, data.record(), indent=2)
