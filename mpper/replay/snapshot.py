"""Buffer snapshots: a directory of ``.npy`` files plus ``manifest.json``; no pickle.

Layout of ``<dir>/``::

    manifest.json        format, version, schema, capacity, priority settings, counters,
                         user "extra" (e.g. the run config), and per file: sha256, shape, dtype
    field.<name>.npy     each schema field, (capacity, *shape)
    tree_leaves.npy      the sum tree's leaves (internal nodes are rebuilt on load)
    generation.npy, info.npy, episodes.npy, ring.npy, counters.npy, max_priority.npy

Atomicity: everything is written into a hidden temporary directory beside ``<dir>``,
fsynced, and renamed into place (the old snapshot is renamed aside first and removed
last). A crash at any point leaves either the previous snapshot or the new one whole;
if it hit between the two renames, ``load`` finds the previous one under its aside name.

Consistency with live writers: the small bookkeeping arrays are copied under the lock,
the big field arrays are written without it (so training goes on). Episodes that a
writer was still copying, or that were evicted while the fields were being written
(their generation changed), are saved as holes: priority 0, never sampled.

Loading trusts nothing but the format: files are opened only as regular files inside
the directory (a symbolic link, FIFO or device is refused), the sizes the manifest
declares are bounded before any file is hashed, and the manifest's numbers, the episode
table, the ring, the slot records, the priorities and the published rows' data are
checked once, before anything is allocated or sampled (``snapshot_checks``).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..atomic import fsync_dir
from .episode_ring import FREE, HEAD_ID, NEXT_ID, NUM_POSITIONS, PUBLISHED, ROWS, START, STATE, make_unsampleable
from .layout import array_specs
from .schema import normalize_schema, schema_from_json, schema_to_json
from .snapshot_checks import (
    FORMAT,
    FORMAT_VERSION,
    INTERNAL,
    MANIFEST,
    SnapshotError,
    check_bookkeeping,
    check_declared_size,
    check_field_data,
    check_new_priorities,
    load_array,
    manifest_priorities,
    manifest_sizes,
    read_manifest,
    resolve,
)

# How long a save waits for the buffer's lock. Writers hold it for microseconds, and a
# holder that dies frees it at once (a robust mutex: the save then repairs the buffer);
# a lock held this long belongs to a live process that is stuck or stopped, and without
# a limit the save, and the run's shutdown with it, would wait for ever.
LOCK_TIMEOUT_S = 30.0

__all__ = ["FORMAT_VERSION", "SnapshotError", "load_buffer", "save_snapshot"]


class _HashingFile:
    """File wrapper that feeds every written byte to sha256 (numpy writes in chunks)."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, data):
        self.sha.update(data)
        return self.f.write(data)


def _write_npy(path: Path, array: np.ndarray) -> dict:
    with open(path, "wb") as f:
        hf = _HashingFile(f)
        # a strided field view is written in C order, 16 MiB at a time (numpy buffers it)
        np.lib.format.write_array(hf, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hf.sha.hexdigest(), "shape": list(array.shape), "dtype": array.dtype.str}


def save_snapshot(buf, path, extra: dict | None = None) -> None:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SnapshotError(f"{path} exists and is a file, not a snapshot directory; refusing to replace it")
    if path.exists() and not (path / MANIFEST).exists() and any(path.iterdir()):
        raise SnapshotError(f"{path} exists and is not an mpper snapshot; refusing to replace it")
    try:
        json.dumps(extra or {})
    except (TypeError, ValueError) as exc:
        raise TypeError(f"snapshot 'extra' must be JSON-serialisable (plain dicts, lists, numbers, strings): {exc}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{secrets.token_hex(3)}"
    tmp = path.parent / f".{path.name}.tmp-{token}"
    tmp.mkdir()
    aside = path.parent / f".{path.name}.old-{token}"
    try:
        lock = buf._locked.lock
        if not lock.acquire(True, LOCK_TIMEOUT_S):
            raise TimeoutError(f"the buffer's lock was not released within {LOCK_TIMEOUT_S:g} s (process "
                               f"{lock.holder() if hasattr(lock, 'holder') else '?'} holds it); no snapshot "
                               f"written to {path}")  # fmt: skip
        try:
            meta = {name: buf._arrays["_" + name].copy() for name in INTERNAL}
            leaves = buf._tree.leaves.copy()
        finally:
            lock.release()
        files = {}
        for f in buf.schema:
            files[f"field.{f.name}.npy"] = _write_npy(tmp / f"field.{f.name}.npy", buf.fields[f.name])
        _make_holes(meta, leaves, changed=buf._generation != meta["generation"])
        files["tree_leaves.npy"] = _write_npy(tmp / "tree_leaves.npy", leaves)
        for name in INTERNAL:
            files[f"{name}.npy"] = _write_npy(tmp / f"{name}.npy", meta[name])

        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_unix": time.time(),
            "capacity": buf.capacity,
            "max_episodes": int(meta["episodes"].shape[0]),
            "alpha": buf.alpha,
            "priority_eps": buf.priority_eps,
            "priority_clip": buf.priority_clip,
            "initial_priority": buf.initial_priority,
            "schema": schema_to_json(buf.schema),
            "positions": int(meta["ring"][NUM_POSITIONS]),
            "counters": {name: int(meta["counters"][i]) for i, name in enumerate(buf.counter_names)},
            "extra": extra or {},
            "files": files,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if path.exists():
            os.rename(path, aside)
        os.rename(tmp, path)
        fsync_dir(path.parent)
        # the one just set aside, and any left by a save that crashed between its renames
        for stale in path.parent.glob(f".{path.name}.old-*"):
            shutil.rmtree(stale, ignore_errors=True)
    except BaseException:  # an error, or a Ctrl-C that quits at once: the previous snapshot stays in place
        if aside.exists() and not path.exists():
            os.rename(aside, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_holes(meta: dict, leaves: np.ndarray, changed: np.ndarray) -> None:
    """Turn unpublished episodes, and those rewritten during the save, into holes."""
    table, ring = meta["episodes"], meta["ring"]
    rewritten = np.concatenate([[0], np.cumsum(changed)])  # rewritten slots before each slot
    for episode_id in range(int(ring[HEAD_ID]), int(ring[NEXT_ID])):
        row = episode_id % table.shape[0]
        state = table[row, STATE]
        start, rows = int(table[row, START]), int(table[row, ROWS])
        intact = rewritten[start + rows] == rewritten[start]
        if state == FREE or (state == PUBLISHED and intact):
            continue
        if state == PUBLISHED:
            ring[NUM_POSITIONS] -= rows - 1
        leaves[start : start + rows - 1] = 0.0
        make_unsampleable(meta["generation"][start : start + rows])
        table[row, STATE] = FREE


# A live run replaces its snapshot every runtime interval: a load that finds its
# snapshot replaced while it read it tries the new one, this many times at most.
REPLACED_RETRIES = 3


def _identity(path: Path) -> tuple | None:
    """What a save changes: the inode of the directory at ``path`` (a save renames a new
    one into place) and of its manifest; None while none is there."""
    try:
        return os.stat(path).st_ino, os.stat(path / MANIFEST).st_ino
    except OSError:
        return None


def load_buffer(cls, path, mmap: bool = False, verify: bool = True, mp_context=None, num_actions: int | None = None,
                add_fields=None):  # fmt: skip
    """See ``ReplayBuffer.load``. ``verify=False`` skips the checksums (faster); the
    structure is checked either way (``check_bookkeeping``, ``check_field_data``).
    ``num_actions``: the action count of the env that will use the buffer, to check
    stored actions against (a schema with ``child_visits`` carries its own).
    ``add_fields``: ``{name: (shape, dtype[, fill])}``, fields the buffer gets, every row
    at its fill value, where the snapshot lacks them (a schema's ``optional`` fields);
    those the snapshot has are loaded as stored.

    A snapshot that a save replaced while it was read (a live run's, read by
    ``--inspect``) gives files of two snapshots, whose checksums or bookkeeping disagree:
    that is not corruption, and the load starts again on the new snapshot (up to
    ``REPLACED_RETRIES`` times, then a SnapshotError that says so). An error found while
    the snapshot stayed in place stands."""
    path = Path(path)
    for _ in range(REPLACED_RETRIES + 1):
        before = _identity(path)
        try:
            return _load_buffer_once(cls, path, mmap, verify, mp_context, num_actions, add_fields)
        except SnapshotError:
            if _identity(path) == before:
                raise
    raise SnapshotError(f"{path}: replaced by a new save {REPLACED_RETRIES + 1} times while it was read (a live run "
                        f"is saving it); try again")  # fmt: skip


def _load_buffer_once(cls, path: Path, mmap: bool, verify: bool, mp_context, num_actions: int | None, add_fields):
    path = resolve(path)
    manifest = read_manifest(path)
    mpath = path / MANIFEST
    capacity, max_episodes = manifest_sizes(mpath, manifest)
    params = manifest_priorities(mpath, manifest)
    try:
        fields = schema_from_json(manifest["schema"])
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise SnapshotError(f"{mpath}: bad schema ({exc})") from None
    check_declared_size(mpath, fields, capacity, max_episodes, shared_memory=not mmap)
    layout = array_specs(fields, capacity, max_episodes)
    files = manifest["files"]

    def load(fname, key):
        shape, dtype = layout[key]
        if key == "_tree":
            shape = (capacity,)
        return load_array(path / fname, files.get(fname), shape, dtype, verify)

    arrays = {f.name: load(f"field.{f.name}.npy", f.name) for f in fields}
    leaves = np.array(load("tree_leaves.npy", "_tree"))
    internal = {"_" + name: np.array(load(f"{name}.npy", "_" + name)) for name in INTERNAL}
    if not (np.isfinite(leaves).all() and (leaves >= 0).all()):
        raise SnapshotError(f"{path / 'tree_leaves.npy'}: priorities must be finite and >= 0")
    in_episode = check_bookkeeping(path, capacity, internal, leaves)
    check_new_priorities(path, params, float(internal["_max_priority"][0]))
    check_field_data(path, fields, arrays, in_episode, num_actions)
    stored = {f.name for f in fields}
    added = tuple(f for f in (normalize_schema(add_fields) if add_fields else ()) if f.name not in stored)
    fields += added
    for f in added:
        arrays[f.name] = np.full((capacity, *f.shape), f.fill, f.dtype)

    if mmap:
        arrays.update(internal)
        arrays["_tree"] = np.zeros(layout["_tree"][0], np.float64)
        info = SimpleNamespace(fields=fields, capacity=capacity, max_episodes=max_episodes, **params)
        buf = cls(None, arrays, threading.Lock(), read_only=True, params=info)
    else:
        buf = cls.create({f.name: (f.shape, f.dtype, f.fill) for f in fields}, capacity,
                         max_episodes=max_episodes, mp_context=mp_context, **params)  # fmt: skip
        for name, arr in {**arrays, **internal}.items():
            buf._arrays[name][...] = arr
    base = buf._tree._leaf_base
    buf._tree.tree[base : base + capacity] = leaves
    buf._tree.rebuild()
    buf.snapshot_manifest = manifest  # "extra" (e.g. the run config) and counters at save time
    return buf
