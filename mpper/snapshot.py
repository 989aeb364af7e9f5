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
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .episode_ring import (
    FREE, HEAD_ID, NEXT_ID, NUM_POSITIONS, PUBLISHED, ROWS, START, STATE, make_unsampleable,
)  # fmt: skip
from .schema import schema_from_json, schema_to_json

FORMAT = "mpper-replay-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_INTERNAL = ("generation", "info", "episodes", "ring", "counters", "max_priority")

__all__ = ["SnapshotError", "save_snapshot", "load_snapshot", "FORMAT_VERSION"]


class SnapshotError(ValueError):
    """A snapshot directory or file is missing, corrupt or of an unknown format."""


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    try:
        with buf._locked:
            meta = {name: buf._arrays["_" + name].copy() for name in _INTERNAL}
            leaves = buf._tree.leaves.copy()
        files = {}
        for f in buf.schema:
            files[f"field.{f.name}.npy"] = _write_npy(tmp / f"field.{f.name}.npy", buf.fields[f.name])
        _make_holes(meta, leaves, changed=buf._generation != meta["generation"])
        files["tree_leaves.npy"] = _write_npy(tmp / "tree_leaves.npy", leaves)
        for name in _INTERNAL:
            files[f"{name}.npy"] = _write_npy(tmp / f"{name}.npy", meta[name])
        from .replay_buffer import COUNTERS

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
            "counters": {name: int(meta["counters"][i]) for i, name in enumerate(COUNTERS)},
            "extra": extra or {},
            "files": files,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if path.exists():
            aside = path.parent / f".{path.name}.old-{token}"
            os.rename(path, aside)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        # the one just set aside, and any left by a save that crashed between its renames
        for stale in path.parent.glob(f".{path.name}.old-*"):
            shutil.rmtree(stale, ignore_errors=True)
    except BaseException:
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


# ---- loading ---------------------------------------------------------------------------
def _resolve(path: Path) -> Path:
    if (path / MANIFEST).exists():
        return path
    # A crash between the two renames of save_snapshot leaves the previous snapshot aside.
    aside = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    aside = [p for p in aside if (p / MANIFEST).exists()]
    if aside:
        warnings.warn(f"{path} is incomplete; loading the previous snapshot {aside[-1]}", stacklevel=3)
        return aside[-1]
    if not path.exists():
        raise SnapshotError(f"{path}: no such snapshot directory")
    raise SnapshotError(f"{path / MANIFEST}: missing (not an mpper snapshot, or a save was cut short)")


def _read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"{mpath}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{mpath}: 'format' must be {FORMAT!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise SnapshotError(
            f"{mpath}: unknown format_version {version!r}; this mpper reads version {FORMAT_VERSION}"
        )
    for key in ("capacity", "max_episodes", "alpha", "priority_eps", "priority_clip",
                "initial_priority", "schema", "files"):  # fmt: skip
        if key not in manifest:
            raise SnapshotError(f"{mpath}: missing key {key!r}")
    return manifest


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    return sha.hexdigest()


def _load_array(path: Path, entry: dict | None, shape: tuple, dtype: np.dtype, mmap: bool, verify: bool):
    if entry is None:
        raise SnapshotError(f"{path.parent / MANIFEST}: lists no entry for {path.name}")
    if not path.exists():
        raise SnapshotError(f"{path}: missing")
    if list(entry.get("shape", [])) != list(shape) or np.dtype(entry.get("dtype", "V")) != dtype:
        raise SnapshotError(
            f"{path.parent / MANIFEST}: {path.name} is listed as {entry.get('dtype')} {entry.get('shape')}, "
            f"the schema needs {dtype.str} {list(shape)}"
        )
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                fshape, fortran, fdtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                fshape, fortran, fdtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}")
        except (ValueError, EOFError) as exc:
            raise SnapshotError(f"{path}: not a valid .npy file ({exc})") from None
        data_offset = f.tell()
    if fdtype.hasobject:
        raise SnapshotError(f"{path}: holds Python objects; refused (snapshots never load pickle)")
    if tuple(fshape) != tuple(shape) or fdtype != dtype or fortran:
        raise SnapshotError(f"{path}: holds {fdtype} {fshape}, expected {dtype} {tuple(shape)}")
    expected = data_offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise SnapshotError(f"{path}: truncated or padded: {actual} bytes, expected {expected}")
    if verify and _sha256(path) != entry.get("sha256"):
        raise SnapshotError(f"{path}: sha256 checksum mismatch (file corrupted or edited)")
    return np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)


def load_snapshot(cls, path, mmap: bool = False, verify: bool = True, mp_context=None):
    """See ``ReplayBuffer.load``. ``verify=False`` skips the checksums (faster)."""
    path = _resolve(Path(path))
    manifest = _read_manifest(path)
    try:
        fields = schema_from_json(manifest["schema"])
        capacity, max_episodes = int(manifest["capacity"]), int(manifest["max_episodes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"{path / MANIFEST}: bad schema or sizes ({exc})") from None
    from .replay_buffer import array_specs

    layout = array_specs(fields, capacity, max_episodes)
    files = manifest["files"]

    def load(fname, key, use_mmap=False):
        shape, dtype = layout[key]
        if key == "_tree":
            shape = (capacity,)
        return _load_array(path / fname, files.get(fname), shape, dtype, use_mmap, verify)

    arrays = {f.name: load(f"field.{f.name}.npy", f.name, mmap) for f in fields}
    leaves = load("tree_leaves.npy", "_tree")
    internal = {"_" + name: load(f"{name}.npy", "_" + name) for name in _INTERNAL}
    if not (np.isfinite(leaves).all() and (leaves >= 0).all()):
        raise SnapshotError(f"{path / 'tree_leaves.npy'}: priorities must be finite and >= 0")

    params = dict(
        alpha=float(manifest["alpha"]), priority_eps=float(manifest["priority_eps"]),
        priority_clip=manifest["priority_clip"], initial_priority=manifest["initial_priority"],
    )  # fmt: skip
    if mmap:
        arrays.update({k: np.array(v) for k, v in internal.items()})
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
