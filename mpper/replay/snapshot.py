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
the directory (a symbolic link, FIFO or device is refused), and the manifest's numbers,
the episode table, the ring, the slot records, the priorities and the published rows'
data are checked once, before anything is allocated or sampled (see "loading" below).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import secrets
import shutil
import stat
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..atomic import fsync_dir
from .episode_ring import (
    FREE,
    HEAD_ID,
    ID,
    MAX_CAPACITY,
    MOVES_SHIFT,
    NEXT_ID,
    NUM_POSITIONS,
    POS_SHIFT,
    PUBLISHED,
    ROWS,
    START,
    STATE,
    TERMINATED,
    TERMINATED_BIT,
    make_unsampleable,
)
from .layout import array_specs
from .schema import schema_from_json, schema_to_json

FORMAT = "mpper-replay-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_INTERNAL = ("generation", "info", "episodes", "ring", "counters", "max_priority")
# How long a save waits for the buffer's lock. Writers hold it for microseconds, and a
# holder that dies frees it at once (a robust mutex: the save then repairs the buffer);
# a lock held this long belongs to a live process that is stuck or stopped, and without
# a limit the save, and the run's shutdown with it, would wait for ever.
LOCK_TIMEOUT_S = 30.0

__all__ = ["FORMAT_VERSION", "SnapshotError", "load_buffer", "save_snapshot"]


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
            meta = {name: buf._arrays["_" + name].copy() for name in _INTERNAL}
            leaves = buf._tree.leaves.copy()
        finally:
            lock.release()
        files = {}
        for f in buf.schema:
            files[f"field.{f.name}.npy"] = _write_npy(tmp / f"field.{f.name}.npy", buf.fields[f.name])
        _make_holes(meta, leaves, changed=buf._generation != meta["generation"])
        files["tree_leaves.npy"] = _write_npy(tmp / "tree_leaves.npy", leaves)
        for name in _INTERNAL:
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


# ---- loading ---------------------------------------------------------------------------
# A snapshot may come from someone else. Its checksums prove that its files are the ones
# its manifest lists, not that they make sense: every file is opened as a regular file
# of the snapshot (no FIFO, device or symbolic link), and every sizing and bookkeeping
# value is checked once, here, before anything is allocated or sampled. The compiled
# kernels trust the episode table and the slot records: these checks are what keeps
# them inside their arrays.
_MANIFEST_MAX_BYTES = 64 << 20  # far above any real manifest (schema, counters, run config)
_MAX_EPISODE_ID = 1 << 62  # ids count episodes ever stored; above this int64 arithmetic nears overflow
_MAX_COUNTER = 1 << 62  # the counters (games, steps, samples ...) add up for the buffer's life
_MAX_GENERATION = 1 << 62  # a slot's generation counts its writes (2 per write); the same margin
_CHECK_CHUNK_BYTES = 16 << 20  # field data is checked in blocks of about this size
# A stored priority (tree leaf) is min(p + eps, clip) ** alpha. Sampling divides leaves by
# their sum and importance weights divide the smallest drawn probability by the others:
# within this range, over 2^30 slots, every such ratio stays a normal float64.
_LEAF_RANGE = (1e-100, 1e100)


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


def _open_regular(path: Path):
    """``path`` opened for reading (binary), refused unless it is a regular file of its
    own: a symbolic link (which could lead anywhere) and a FIFO or device (whose reads
    never end) are SnapshotErrors. Opened without blocking, so a FIFO cannot hang the
    open itself."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotError(f"{path}: missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SnapshotError(f"{path}: is a symbolic link; a snapshot's files must be regular files "
                                "inside it (refused)") from None  # fmt: skip
        raise SnapshotError(f"{path}: cannot be opened ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise SnapshotError(f"{path}: is {kind}, not a regular file (refused)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST
    with _open_regular(mpath) as f:
        size = os.fstat(f.fileno()).st_size
        if size > _MANIFEST_MAX_BYTES:
            raise SnapshotError(f"{mpath}: {size} bytes, larger than any mpper manifest (at most "
                                f"{_MANIFEST_MAX_BYTES >> 20} MiB)")  # fmt: skip
        raw = f.read(size)
    try:
        manifest = json.loads(raw.decode("utf-8"))
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
    if not isinstance(manifest["files"], dict):
        raise SnapshotError(f"{mpath}: 'files' must be an object, got {type(manifest['files']).__name__}")
    return manifest


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _manifest_sizes(mpath: Path, manifest: dict) -> tuple[int, int]:
    """(capacity, max_episodes), checked: integers the buffer can have."""
    capacity, max_episodes = manifest["capacity"], manifest["max_episodes"]
    if not (_is_int(capacity) and 2 <= capacity <= MAX_CAPACITY):
        raise SnapshotError(f"{mpath}: capacity must be an integer in [2, {MAX_CAPACITY}], got {capacity!r}")
    if not (_is_int(max_episodes) and 1 <= max_episodes <= MAX_CAPACITY):
        raise SnapshotError(f"{mpath}: max_episodes must be an integer in [1, {MAX_CAPACITY}], got {max_episodes!r}")
    return capacity, max_episodes


def _manifest_priorities(mpath: Path, manifest: dict) -> dict:
    """alpha, priority_eps, priority_clip, initial_priority, checked as
    ``ReplayBuffer.create`` needs them (finite numbers, the right types)."""
    alpha, eps, clip, initial = (manifest[k] for k in ("alpha", "priority_eps", "priority_clip", "initial_priority"))
    if not (_is_number(alpha) and alpha >= 0):
        raise SnapshotError(f"{mpath}: alpha must be a finite number >= 0, got {alpha!r}")
    if not (_is_number(eps) and eps >= 0):
        raise SnapshotError(f"{mpath}: priority_eps must be a finite number >= 0, got {eps!r}")
    if not (clip is None or (_is_number(clip) and clip > 0)):
        raise SnapshotError(f"{mpath}: priority_clip must be null or a finite number > 0, got {clip!r}")
    if not (initial == "max" or (_is_number(initial) and initial >= 0)):
        raise SnapshotError(f'{mpath}: initial_priority must be "max" or a finite number >= 0, got {initial!r}')
    return dict(alpha=float(alpha), priority_eps=float(eps), priority_clip=None if clip is None else float(clip),
                initial_priority=initial if initial == "max" else float(initial))  # fmt: skip


def _load_array(path: Path, entry, shape: tuple, dtype: np.dtype, verify: bool) -> np.ndarray:
    """The array of one ``.npy`` file, memory-mapped read-only, after checking that the
    manifest lists it with ``shape`` and ``dtype``, that its header says the same, that
    its size is exactly that, and (``verify``) its sha256."""
    if not isinstance(entry, dict):
        raise SnapshotError(f"{path.parent / MANIFEST}: lists no entry for {path.name}")
    try:
        listed_dtype = np.dtype(entry.get("dtype", "V"))
    except (TypeError, ValueError):
        listed_dtype = None
    if list(entry.get("shape", [])) != list(shape) or listed_dtype != dtype:
        raise SnapshotError(
            f"{path.parent / MANIFEST}: {path.name} is listed as {entry.get('dtype')} {entry.get('shape')}, "
            f"the schema needs {dtype.str} {list(shape)}"
        )
    with _open_regular(path) as f:
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
        expected = data_offset + math.prod(shape) * dtype.itemsize
        actual = os.fstat(f.fileno()).st_size
        if actual != expected:
            raise SnapshotError(f"{path}: truncated or padded: {actual} bytes, expected {expected}")
        if verify:
            f.seek(0)
            sha = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 22), b""):
                sha.update(chunk)
            if sha.hexdigest() != entry.get("sha256"):
                raise SnapshotError(f"{path}: sha256 checksum mismatch (file corrupted or edited)")
        # mapped from this open file, so the data read is the file checked above
        return np.memmap(f, dtype=dtype, mode="r", offset=data_offset, shape=shape)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _check_bookkeeping(path: Path, capacity: int, internal: dict, leaves: np.ndarray) -> np.ndarray:
    """The invariants the episode ring, the sampler and the target kernels rely on;
    SnapshotError naming the file and the entry that breaks one. Returns the (capacity,)
    bool mask of the slots that belong to a published episode (checked field data).

    - ring: 0 <= WRITE_POS <= capacity, 0 <= HEAD_ID <= NEXT_ID < 2^62, at most
      max_episodes resident episodes (HEAD_ID .. NEXT_ID - 1);
    - each resident episode's table row holds its id, a known state (free or published;
      a save turns episodes still being written into free holes), 2 <= rows, and lies
      within the ring; resident episodes follow each other in ring order without
      overlapping, the newest ending at WRITE_POS;
    - NUM_POSITIONS is the number of positions (moves) of the published episodes;
    - every slot of a published episode has an even generation (sampleable) and the
      info of its place in that episode; no other slot, and no episode's last row, has
      a priority, and each priority is 0 or within ``_LEAF_RANGE``;
    - generations, counters and the running maximum priority are >= 0 (and finite).
    """
    ring, table = internal["_ring"], internal["_episodes"]
    generation, info = internal["_generation"], internal["_info"]
    max_episodes = table.shape[0]
    rfile, tfile = path / "ring.npy", path / "episodes.npy"
    write_pos, next_id, head_id, positions = (int(v) for v in ring[:4])
    if not 0 <= write_pos <= capacity:
        raise SnapshotError(f"{rfile}: WRITE_POS {write_pos} outside [0, {capacity}] (the capacity)")
    if not 0 <= head_id <= next_id < _MAX_EPISODE_ID:
        raise SnapshotError(f"{rfile}: needs 0 <= HEAD_ID <= NEXT_ID < 2^62, got HEAD_ID {head_id}, NEXT_ID {next_id}")
    if next_id - head_id > max_episodes:
        raise SnapshotError(f"{rfile}: {next_id - head_id} resident episodes (NEXT_ID {next_id} - HEAD_ID {head_id}) "
                            f"but the episode table has {max_episodes} rows")  # fmt: skip
    ids = np.arange(head_id, next_id, dtype=np.int64)
    rows = ids % max_episodes
    ep = table[rows]
    wrong = ep[:, ID] != ids
    if wrong.any():
        j = _first(wrong)
        raise SnapshotError(f"{tfile}: row {rows[j]} holds episode id {ep[j, ID]}, the ring says episode {ids[j]}")
    state = ep[:, STATE]
    wrong = (state != FREE) & (state != PUBLISHED)
    if wrong.any():
        j = _first(wrong)
        raise SnapshotError(f"{tfile}: episode {ids[j]} has state {state[j]}; a snapshot holds only free (0) "
                            f"and published (2) episodes")  # fmt: skip
    start, length = ep[:, START], ep[:, ROWS]
    wrong = (start < 0) | (start >= capacity) | (length < 2) | (length > capacity - start)
    if wrong.any():
        j = _first(wrong)
        raise SnapshotError(f"{tfile}: episode {ids[j]} has start {start[j]} and {length[j]} rows; "
                            f"it must lie within the ring of {capacity} slots and have >= 2 rows")  # fmt: skip
    terminated = ep[:, TERMINATED]
    wrong = (terminated != 0) & (terminated != 1)
    if wrong.any():
        j = _first(wrong)
        raise SnapshotError(f"{tfile}: episode {ids[j]} has terminated flag {terminated[j]}, expected 0 or 1")
    if ids.size:
        offset = (start - write_pos) % capacity  # slots after the write position: oldest first
        end = offset + length
        wrong = np.append(end[:-1] > offset[1:], end[-1] != capacity)
        if wrong.any():
            j = _first(wrong)
            raise SnapshotError(f"{tfile}: episode {ids[j]} (slots {start[j]}..{start[j] + length[j] - 1}) "
                                f"overlaps the next or breaks the ring order ending at WRITE_POS {write_pos}")  # fmt: skip

    published = state == PUBLISHED
    p_start, p_rows, p_term = start[published], length[published], terminated[published]
    moves = int((p_rows - 1).sum())
    if positions != moves:
        raise SnapshotError(f"{rfile}: NUM_POSITIONS {positions}, but the published episodes hold {moves} positions")
    first_row = np.repeat(np.cumsum(p_rows) - p_rows, p_rows)
    place = np.arange(int(p_rows.sum()), dtype=np.int64) - first_row  # each slot's position in its episode
    slots = np.repeat(p_start, p_rows) + place
    big_t = np.repeat(p_rows - 1, p_rows)
    expected = (place << POS_SHIFT) | (big_t << MOVES_SHIFT) | (np.repeat(p_term, p_rows) * TERMINATED_BIT)
    wrong = info[slots] != expected
    if wrong.any():
        j = _first(wrong)
        raise SnapshotError(f"{path / 'info.npy'}: slot {slots[j]} holds {info[slots[j]]}, expected {expected[j]} "
                            f"(position {place[j]} of an episode of {big_t[j]} moves)")  # fmt: skip
    gen = generation[slots]
    wrong = (gen & 1) != 0
    if wrong.any():
        j = _first(wrong)
        raise SnapshotError(f"{path / 'generation.npy'}: slot {slots[j]} of a published episode has the odd "
                            f"generation {gen[j]} (odd: not sampleable)")  # fmt: skip
    # Every write adds to a slot's generation: one near the int64 limit would overflow
    # after a few writes (and the buffer then save a snapshot it cannot load again).
    bad = (generation < 0) | (generation >= _MAX_GENERATION)
    if bad.any():
        j = _first(bad)
        raise SnapshotError(f"{path / 'generation.npy'}: slot {j} has the generation {generation[j]}, expected "
                            f"0 <= generation < 2^62")  # fmt: skip
    in_episode = np.zeros(capacity, bool)
    in_episode[slots] = True
    position = np.zeros(capacity, bool)
    position[slots[place < big_t]] = True
    wrong = (leaves > 0) & ~position
    if wrong.any():
        j = _first(wrong)
        raise SnapshotError(f"{path / 'tree_leaves.npy'}: slot {j} has priority {leaves[j]} but holds no position "
                            f"of a published episode")  # fmt: skip
    low, high = _LEAF_RANGE
    wrong = (leaves != 0) & ((leaves < low) | (leaves > high))
    if wrong.any():
        j = _first(wrong)
        raise SnapshotError(f"{path / 'tree_leaves.npy'}: slot {j} has priority {leaves[j]}; a stored priority is 0 "
                            f"or within [{low:g}, {high:g}]")  # fmt: skip
    counters = internal["_counters"]
    # Counters only grow: one at the int64 limit would overflow at the next add (the same
    # margin as the generations').
    bad = (counters < 0) | (counters >= _MAX_COUNTER)
    if bad.any():
        j = _first(bad)
        raise SnapshotError(f"{path / 'counters.npy'}: counter {j} is {counters[j]}, expected 0 <= counter < 2^62")
    top = float(internal["_max_priority"][0])
    if not (math.isfinite(top) and top >= 0):
        raise SnapshotError(f"{path / 'max_priority.npy'}: must be finite and >= 0, got {top}")
    return in_episode


def _check_new_priorities(path: Path, params: dict, max_priority: float) -> None:
    """New episodes get the priority ``initial_priority`` (``"max"``: the running
    maximum); the leaf it makes must be 0 or in ``_LEAF_RANGE`` like the stored ones."""
    use_max = params["initial_priority"] == "max"
    raw = max_priority if use_max else params["initial_priority"]
    clip = math.inf if params["priority_clip"] is None else params["priority_clip"]
    try:
        leaf = min(raw + params["priority_eps"], clip) ** params["alpha"]
    except OverflowError:
        leaf = math.inf
    low, high = _LEAF_RANGE
    if leaf != 0 and not low <= leaf <= high:
        where = path / ("max_priority.npy" if use_max else MANIFEST)
        raise SnapshotError(f"{where}: new episodes would get the priority {leaf:g} (min({raw:g} + priority_eps, "
                            f"priority_clip) ** alpha {params['alpha']:g}); a priority is 0 or within "
                            f"[{low:g}, {high:g}]")  # fmt: skip


def _check_field_data(path: Path, fields, arrays: dict, in_episode: np.ndarray, num_actions: int | None) -> None:
    """The rows of published episodes, which the targets are built from: float fields
    finite (NaN where the field's fill is NaN: "not set"), bool fields 0 or 1, actions in [0, num_actions)
    (num_actions: the width of child_visits, else the caller's). Read in blocks, so a
    memory-mapped snapshot is not copied whole."""
    if num_actions is None and "child_visits" in arrays:
        num_actions = int(arrays["child_visits"].shape[1])
    capacity = in_episode.shape[0]
    for f in fields:
        checks_action = f.name == "action" and f.dtype.kind in "iu"
        if f.dtype.kind not in "fb" and not checks_action:
            continue
        data = arrays[f.name]
        row_bytes = max(1, math.prod(f.shape) * f.dtype.itemsize)
        step = max(1, _CHECK_CHUNK_BYTES // row_bytes)
        for lo in range(0, capacity, step):
            mask = in_episode[lo : lo + step]
            if not mask.any():
                continue
            block = np.asarray(data[lo : lo + step])
            if checks_action:
                bad = (block < 0) | (block >= num_actions) if num_actions is not None else block < 0
                what = f"an action outside [0, {num_actions})" if num_actions is not None else "a negative action"
            elif f.dtype.kind == "b":  # a bool is one byte, 0 or 1; numpy reads any other byte as true
                bad = (block.view(np.uint8) > 1).reshape(block.shape[0], -1).any(axis=1)
                what = "a bool byte other than 0 or 1"
            else:
                finite = np.isfinite(block)
                if math.isnan(f.fill):
                    finite |= np.isnan(block)
                bad = ~finite.reshape(block.shape[0], -1).all(axis=1)
                what = "a value that is not finite"
            bad &= mask
            if bad.any():
                slot = lo + _first(bad)
                raise SnapshotError(f"{path / f'field.{f.name}.npy'}: slot {slot}, in a published episode, "
                                    f"holds {what}")  # fmt: skip


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


def load_buffer(cls, path, mmap: bool = False, verify: bool = True, mp_context=None, num_actions: int | None = None):
    """See ``ReplayBuffer.load``. ``verify=False`` skips the checksums (faster); the
    structure is checked either way (``_check_bookkeeping``, ``_check_field_data``).
    ``num_actions``: the action count of the env that will use the buffer, to check
    stored actions against (a schema with ``child_visits`` carries its own).

    A snapshot that a save replaced while it was read (a live run's, read by
    ``--inspect``) gives files of two snapshots, whose checksums or bookkeeping disagree:
    that is not corruption, and the load starts again on the new snapshot (up to
    ``REPLACED_RETRIES`` times, then a SnapshotError that says so). An error found while
    the snapshot stayed in place stands."""
    path = Path(path)
    for _ in range(REPLACED_RETRIES + 1):
        before = _identity(path)
        try:
            return _load_buffer_once(cls, path, mmap, verify, mp_context, num_actions)
        except SnapshotError:
            if _identity(path) == before:
                raise
    raise SnapshotError(f"{path}: replaced by a new save {REPLACED_RETRIES + 1} times while it was read (a live run "
                        f"is saving it); try again")  # fmt: skip


def _load_buffer_once(cls, path: Path, mmap: bool, verify: bool, mp_context, num_actions: int | None):
    path = _resolve(path)
    manifest = _read_manifest(path)
    mpath = path / MANIFEST
    capacity, max_episodes = _manifest_sizes(mpath, manifest)
    params = _manifest_priorities(mpath, manifest)
    try:
        fields = schema_from_json(manifest["schema"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotError(f"{mpath}: bad schema ({exc})") from None
    layout = array_specs(fields, capacity, max_episodes)
    files = manifest["files"]

    def load(fname, key):
        shape, dtype = layout[key]
        if key == "_tree":
            shape = (capacity,)
        return _load_array(path / fname, files.get(fname), shape, dtype, verify)

    arrays = {f.name: load(f"field.{f.name}.npy", f.name) for f in fields}
    leaves = np.array(load("tree_leaves.npy", "_tree"))
    internal = {"_" + name: np.array(load(f"{name}.npy", "_" + name)) for name in _INTERNAL}
    if not (np.isfinite(leaves).all() and (leaves >= 0).all()):
        raise SnapshotError(f"{path / 'tree_leaves.npy'}: priorities must be finite and >= 0")
    in_episode = _check_bookkeeping(path, capacity, internal, leaves)
    _check_new_priorities(path, params, float(internal["_max_priority"][0]))
    _check_field_data(path, fields, arrays, in_episode, num_actions)

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
