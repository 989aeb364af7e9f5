"""Reading a buffer snapshot that may come from someone else: its files opened safely, its
manifest and arrays checked before anything is allocated, hashed in full or sampled.

Its checksums prove that its files are the ones its manifest lists, not that they make
sense: every file is opened as a regular file of the snapshot (no FIFO, device or
symbolic link), the sizes the manifest declares are bounded before any file is hashed
or mapped, and every sizing and bookkeeping value is checked once, here. The compiled
kernels trust the episode table and the slot records: these checks are what keeps them
inside their arrays. ``snapshot.load_buffer`` runs them in order; ``snapshot`` writes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import warnings
from pathlib import Path

import numpy as np

from ..shm import SHM_DIR, free_bytes, human_bytes
from .episode_ring import (
    FREE,
    ID,
    MAX_CAPACITY,
    MOVES_SHIFT,
    POS_SHIFT,
    PUBLISHED,
    ROWS,
    START,
    STATE,
    TERMINATED,
    TERMINATED_BIT,
)
from .layout import array_specs, segment_bytes

FORMAT = "mpper-replay-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INTERNAL = ("generation", "info", "episodes", "ring", "counters", "max_priority")  # the buffer's own arrays


class SnapshotError(ValueError):
    """A snapshot directory or file is missing, corrupt or of an unknown format."""


_MANIFEST_MAX_BYTES = 64 << 20  # far above any real manifest (schema, counters, run config)
_MAX_EPISODE_ID = 1 << 62  # ids count episodes ever stored; above this int64 arithmetic nears overflow
_MAX_COUNTER = 1 << 62  # the counters (games, steps, samples ...) add up for the buffer's life
_MAX_GENERATION = 1 << 62  # a slot's generation counts its writes (2 per write); the same margin
_CHECK_CHUNK_BYTES = 16 << 20  # field data is checked in blocks of about this size
# A stored priority (tree leaf) is min(p + eps, clip) ** alpha. Sampling divides leaves by
# their sum and importance weights divide the smallest drawn probability by the others:
# within this range, over 2^30 slots, every such ratio stays a normal float64.
_LEAF_RANGE = (1e-100, 1e100)


def resolve(path: Path) -> Path:
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


def open_regular(path: Path):
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


def read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST
    with open_regular(mpath) as f:
        size = os.fstat(f.fileno()).st_size
        if size > _MANIFEST_MAX_BYTES:
            raise SnapshotError(f"{mpath}: {size} bytes, larger than any mpper manifest (at most "
                                f"{_MANIFEST_MAX_BYTES >> 20} MiB)")  # fmt: skip
        raw = f.read(size)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise SnapshotError(f"{mpath}: not valid JSON ({' '.join(str(exc).split())})") from None
    except RecursionError:
        raise SnapshotError(f"{mpath}: not a manifest (JSON nested deeper than Python reads)") from None
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
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer beyond any float
        return False


def manifest_sizes(mpath: Path, manifest: dict) -> tuple[int, int]:
    """(capacity, max_episodes), checked: integers the buffer can have."""
    capacity, max_episodes = manifest["capacity"], manifest["max_episodes"]
    if not (_is_int(capacity) and 2 <= capacity <= MAX_CAPACITY):
        raise SnapshotError(f"{mpath}: capacity must be an integer in [2, {MAX_CAPACITY}], got {capacity!r}")
    if not (_is_int(max_episodes) and 1 <= max_episodes <= MAX_CAPACITY):
        raise SnapshotError(f"{mpath}: max_episodes must be an integer in [1, {MAX_CAPACITY}], got {max_episodes!r}")
    return capacity, max_episodes


def check_declared_size(mpath: Path, fields, capacity: int, max_episodes: int, shared_memory: bool) -> None:
    """The bytes the manifest's sizes declare (its schema ``fields``, ``capacity`` and
    ``max_episodes``), bounded before any file is hashed or mapped: each file is checked
    to be exactly its declared size, but a sparse file can have any size while it costs
    nothing on disk, and hashing it reads every byte. Real data cannot outgrow the file
    system that holds it; a buffer loaded into shared memory (``shared_memory``) must
    fit the room there as well."""
    internal = array_specs((), capacity, max_episodes)  # without fields: no slot record to build yet
    internal["_tree"] = ((capacity,), np.dtype(np.float64))  # tree_leaves.npy: the leaves only
    declared = sum(capacity * math.prod(f.shape) * f.dtype.itemsize for f in fields)
    declared += sum(math.prod(shape) * dtype.itemsize for shape, dtype in internal.values())
    fs = os.statvfs(mpath.parent)
    disk = fs.f_blocks * fs.f_frsize
    if 0 < disk < declared:  # (a file system that reports no size, as some network ones do, bounds nothing)
        raise SnapshotError(f"{mpath}: its sizes declare {human_bytes(declared)} of arrays, more than the file system "
                            f"holding the snapshot can store ({human_bytes(disk)}): files that size can only be "
                            f"sparse, not data (refused before reading them)")  # fmt: skip
    try:  # every snapshot was a buffer's segment: its fields must make one slot record
        nbytes = segment_bytes(fields, capacity, max_episodes)
    except ValueError as exc:
        raise SnapshotError(f"{mpath}: its schema makes no buffer ({exc})") from None
    if shared_memory and os.path.isdir(SHM_DIR) and nbytes > free_bytes(SHM_DIR):
        raise SnapshotError(f"{mpath}: the buffer it declares needs {human_bytes(nbytes)} of shared memory, "
                            f"{SHM_DIR} has {human_bytes(free_bytes(SHM_DIR))} free (refused before reading "
                            f"its files)")  # fmt: skip


def manifest_priorities(mpath: Path, manifest: dict) -> dict:
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


def load_array(path: Path, entry, shape: tuple, dtype: np.dtype, verify: bool) -> np.ndarray:
    """The array of one ``.npy`` file, memory-mapped read-only, after checking that the
    manifest lists it with ``shape`` and ``dtype``, that its header says the same, that
    its size is exactly that, and (``verify``) its sha256."""
    if not isinstance(entry, dict):
        raise SnapshotError(f"{path.parent / MANIFEST}: lists no entry for {path.name}")
    try:  # a dtype is listed as its string (e.g. "<f4"); anything else is no dtype of a snapshot
        listed_dtype = np.dtype(entry["dtype"]) if isinstance(entry.get("dtype"), str) else None
    except (TypeError, ValueError):
        listed_dtype = None
    if entry.get("shape") != list(shape) or listed_dtype != dtype:
        raise SnapshotError(
            f"{path.parent / MANIFEST}: {path.name} is listed as {entry.get('dtype')} {entry.get('shape')}, "
            f"the schema needs {dtype.str} {list(shape)}"
        )
    with open_regular(path) as f:
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


def check_bookkeeping(path: Path, capacity: int, internal: dict, leaves: np.ndarray) -> np.ndarray:
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


def check_new_priorities(path: Path, params: dict, max_priority: float) -> None:
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


def check_field_data(path: Path, fields, arrays: dict, in_episode: np.ndarray, num_actions: int | None) -> None:
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
                bad = bad.reshape(block.shape[0], -1).any(axis=1)  # an action of a row shape: any element
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
