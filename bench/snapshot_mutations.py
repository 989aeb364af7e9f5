"""The mutations of ``bench/snapshot_fuzz.py`` and its oracle.

A mutation edits a copy of a real snapshot in place and re-hashes every file it changed
(the manifest's sha256, shape and dtype entries follow the edited file), so that a load
gets past the checksums and what is tested is the loader's deeper checks. Each returns
what a correct loader must do with the result:

- ``"refuse"``: the edit breaks a rule the buffer relies on; the load must be refused;
- ``"any"``: it may or may not break one (a random value); a load that succeeds is then
  judged by ``oracle``, which re-checks the loaded buffer independently of the loader.

``oracle`` uses ``mpper.replay.consistency.problems`` (the episode ring, generations,
infos, leaves, the sum tree) and adds what that module leaves to the loader: episodes in
ring order without overlap, value ranges (counters, generations, priorities) and the
stored rows of published episodes (finite floats, bool bytes 0 or 1, actions in range).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpper.replay import consistency
from mpper.replay.episode_ring import (
    FREE,
    HEAD_ID,
    ID,
    NEXT_ID,
    NUM_POSITIONS,
    PUBLISHED,
    ROWS,
    START,
    STATE,
    TERMINATED,
    WRITE_POS,
    pack_info,
)

MANIFEST = "manifest.json"
INTERNAL = ["generation.npy", "info.npy", "episodes.npy", "ring.npy", "counters.npy", "max_priority.npy",
            "tree_leaves.npy"]  # fmt: skip
LIMIT = 1 << 62  # counters, generations and episode ids stay below this
LEAF_RANGE = (1e-100, 1e100)
SPECIAL_INTS = [0, 1, 2, 3, -1, -2, 7, 63, 64, 255, 256, 257, 1 << 30, 1 << 31, 1 << 32, 1 << 61, 1 << 62, 2**63 - 1,
                -(2**63), 10**15]  # fmt: skip
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-300, 5e-324, 1e-101, 1e101, 1e308, 0.5, 3.0]
JSON_VALUES = [0, 1, -1, 2, 3, 255, 256, 1 << 30, 1 << 31, 2**63, -(2**63), 10**30, 0.5, -0.5, 1e308, 1e-320, "max",
               "", "x", None, True, False, [], [1], {}, {"a": 1}, "nan", "inf"]  # fmt: skip


@dataclass
class Base:
    """A real snapshot to mutate: its directory, the run directory that wrote it and the
    facts a mutation needs (schema fields, resident episodes oldest first)."""

    name: str
    snapshot: Path
    run_dir: Path
    num_actions: int
    capacity: int
    fields: list  # [{"name", "shape", "dtype", "fill"}] as in the manifest
    episodes: list  # [(id, start, rows, state, terminated)], oldest first
    write_pos: int
    disk_bytes: int = 0


# ---- file helpers ---------------------------------------------------------------------------
def read_manifest(snap: Path) -> dict:
    return json.loads((snap / MANIFEST).read_text())


def write_manifest(snap: Path, manifest: dict) -> None:
    (snap / MANIFEST).write_text(json.dumps(manifest))


def rehash(snap: Path, name: str, manifest: dict | None = None, array: np.ndarray | None = None) -> None:
    """The manifest's entry for ``name`` made to match the file (sha256; shape and dtype
    from ``array`` when given)."""
    m = manifest if manifest is not None else read_manifest(snap)
    entry = m["files"].setdefault(name, {})
    entry["sha256"] = hashlib.sha256((snap / name).read_bytes()).hexdigest()
    if array is not None:
        entry["shape"], entry["dtype"] = list(array.shape), array.dtype.str
    if manifest is None:
        write_manifest(snap, m)


def rewrite(snap: Path, name: str, array: np.ndarray) -> None:
    np.save(snap / name, array, allow_pickle=False)
    rehash(snap, name, array=array)


def field_files(base: Base) -> list[str]:
    return [f"field.{f['name']}.npy" for f in base.fields]


def published(base: Base) -> list:
    return [e for e in base.episodes if e[3] == PUBLISHED]


def set_value(array: np.ndarray, index, value) -> None:
    """array[index] = value, clipped into an integer dtype's range (the edit is the value)."""
    if array.dtype.kind in "iu":
        info = np.iinfo(array.dtype)
        value = int(min(max(int(value) if math.isfinite(value) else 0, info.min), info.max))
    with np.errstate(all="ignore"):
        array[index] = value


def pick_value(rng, array: np.ndarray):
    if array.dtype.kind == "f":
        return SPECIAL_FLOATS[rng.integers(len(SPECIAL_FLOATS))] if rng.random() < 0.8 else float(rng.normal() * 10)
    if array.dtype.kind == "b":
        return int(rng.integers(0, 2))
    return SPECIAL_INTS[rng.integers(len(SPECIAL_INTS))] if rng.random() < 0.7 else int(rng.integers(-3, 300))


# ---- mutations: each edits ``snap`` and returns "refuse" or "any" ---------------------------------
def array_value(rng, snap, base):
    """One element of any array set to a special or random value."""
    name = (INTERNAL + field_files(base))[rng.integers(len(INTERNAL) + len(base.fields))]
    array = np.load(snap / name)
    flat = array.reshape(-1)
    i = int(rng.integers(flat.size))
    if array.dtype.kind == "b":
        flat.view(np.uint8)[i] = int(rng.integers(0, 256))
    else:
        set_value(flat, i, pick_value(rng, array))
    rewrite(snap, name, array)
    return "any"


def published_row_value(rng, snap, base):
    """A stored field of a published episode's row set to NaN, inf, a bool byte 2..255,
    or an action out of range."""
    eps = published(base)
    ep = eps[rng.integers(len(eps))]
    slot = ep[1] + int(rng.integers(ep[2]))
    f = base.fields[rng.integers(len(base.fields))]
    name = f"field.{f['name']}.npy"
    array = np.load(snap / name)
    row = array[slot].reshape(-1) if array.ndim > 1 else array[slot : slot + 1]
    k = int(rng.integers(row.size))
    if array.dtype.kind == "b":
        row.view(np.uint8)[k] = int(rng.integers(2, 256))
        expect = "refuse"
    elif array.dtype.kind == "f":
        value = [math.nan, math.inf, -math.inf][rng.integers(3)]
        row[k] = value
        expect = "any" if (math.isnan(value) and str(f["fill"]) == "nan") else "refuse"
    else:
        value = [base.num_actions, -1, 1 << 40, -(2**63)][rng.integers(4)] if f["name"] == "action" else int(
            rng.integers(-5, 5))
        set_value(row, k, value)
        expect = "any"
    rewrite(snap, name, array)
    return expect


def odd_generation(rng, snap, base):
    """One slot of a published episode given an odd generation (survivor case)."""
    ep = published(base)[rng.integers(len(published(base)))]
    gen = np.load(snap / "generation.npy")
    gen[ep[1] + int(rng.integers(ep[2]))] |= 1
    rewrite(snap, "generation.npy", gen)
    return "refuse"


def one_slot_overlap(rng, snap, base):
    """An episode grown by one row into its neighbour, which shrinks by one: as many
    positions as before, one slot claimed twice (survivor case)."""
    pairs = [(a, b) for a, b in zip(base.episodes, base.episodes[1:]) if a[1] + a[2] == b[1] and b[2] > 2]
    if not pairs:
        return None
    a, b = pairs[rng.integers(len(pairs))]
    table = np.load(snap / "episodes.npy")
    rows = {int(r[ID]): i for i, r in enumerate(table)}
    table[rows[a[0]], ROWS] += 1
    table[rows[b[0]], ROWS] -= 1
    rewrite(snap, "episodes.npy", table)
    return "refuse"


def final_row_priority(rng, snap, base):
    """A priority on a published episode's final row (no position) (survivor case)."""
    ep = published(base)[rng.integers(len(published(base)))]
    leaves = np.load(snap / "tree_leaves.npy")
    leaves[ep[1] + ep[2] - 1] = [1.0, 0.5, 1e-50][rng.integers(3)]
    rewrite(snap, "tree_leaves.npy", leaves)
    return "refuse"


def episode_id_other_lap(rng, snap, base):
    """A resident episode's table row naming the episode that reuses that row a lap of
    the table later (survivor case)."""
    ep = base.episodes[rng.integers(len(base.episodes))]
    table = np.load(snap / "episodes.npy")
    row = next(i for i, r in enumerate(table) if int(r[ID]) == ep[0])
    table[row, ID] += table.shape[0] * int(rng.choice([1, -1, 2]))
    rewrite(snap, "episodes.npy", table)
    return "refuse"


def ring_edit(rng, snap, base):
    """WRITE_POS, NEXT_ID, HEAD_ID or NUM_POSITIONS moved by a little or a lot."""
    ring = np.load(snap / "ring.npy")
    i = int(rng.integers(4))
    value = int(ring[i]) + int(rng.choice([-2, -1, 1, 2])) if rng.random() < 0.6 else SPECIAL_INTS[
        rng.integers(len(SPECIAL_INTS))]
    set_value(ring, i, value)
    rewrite(snap, "ring.npy", ring)
    return "any"


def table_edit(rng, snap, base):
    """A resident episode's start, rows, state or terminated flag changed."""
    ep = base.episodes[rng.integers(len(base.episodes))]
    table = np.load(snap / "episodes.npy")
    row = next(i for i, r in enumerate(table) if int(r[ID]) == ep[0])
    col = [START, ROWS, STATE, TERMINATED][rng.integers(4)]
    value = int(table[row, col]) + int(rng.choice([-1, 1, 2, -2])) if rng.random() < 0.6 else SPECIAL_INTS[
        rng.integers(len(SPECIAL_INTS))]
    set_value(table[row], col, value)
    rewrite(snap, "episodes.npy", table)
    return "any"


def info_edit(rng, snap, base):
    """A slot's packed info set to another episode's (position, moves, terminated)."""
    info = np.load(snap / "info.npy")
    slot = int(rng.integers(info.size))
    pos, moves, term = (int(v) for v in rng.integers(0, 70, 3))
    info[slot] = pack_info(moves + 1, bool(term & 1))[min(pos, moves)]
    rewrite(snap, "info.npy", info)
    return "any"


def priority_edit(rng, snap, base):
    """A leaf of a position, or the running maximum priority, set to a special value."""
    name = "tree_leaves.npy" if rng.random() < 0.7 else "max_priority.npy"
    array = np.load(snap / name)
    set_value(array, int(rng.integers(array.size)), SPECIAL_FLOATS[rng.integers(len(SPECIAL_FLOATS))])
    rewrite(snap, name, array)
    return "any"


def counter_edit(rng, snap, base):
    """A counter or a generation set near, at or past the limits (2^62, int64)."""
    name = "counters.npy" if rng.random() < 0.5 else "generation.npy"
    array = np.load(snap / name)
    # near the limit: LIMIT - 2^20 (a few writes below it loads, and the buffer's snapshot after them is refused)
    value = [-1, LIMIT - (1 << 20), LIMIT, LIMIT + 2, 2**63 - 1, -(2**63), 1 << 40][rng.integers(7)]
    set_value(array, int(rng.integers(array.size)), value)
    rewrite(snap, name, array)
    return "refuse" if value < 0 or value >= LIMIT else "any"


def hole(rng, snap, base):
    """A published episode turned into a hole as a save makes one (valid: must load)."""
    ep = published(base)[rng.integers(len(published(base)))]
    table, ring = np.load(snap / "episodes.npy"), np.load(snap / "ring.npy")
    gen, leaves = np.load(snap / "generation.npy"), np.load(snap / "tree_leaves.npy")
    row = next(i for i, r in enumerate(table) if int(r[ID]) == ep[0])
    table[row, STATE] = FREE
    ring[NUM_POSITIONS] -= ep[2] - 1
    leaves[ep[1] : ep[1] + ep[2]] = 0.0
    gen[ep[1] : ep[1] + ep[2]] |= 1
    for name, array in (("episodes.npy", table), ("ring.npy", ring), ("generation.npy", gen),
                        ("tree_leaves.npy", leaves)):  # fmt: skip
        rewrite(snap, name, array)
    return "any"


def evict_oldest(rng, snap, base):
    """The oldest episode evicted as the ring does it (valid: must load)."""
    ring, gen, leaves = (np.load(snap / n) for n in ("ring.npy", "generation.npy", "tree_leaves.npy"))
    ep = base.episodes[0]
    ring[HEAD_ID] += 1
    if ep[3] == PUBLISHED:
        ring[NUM_POSITIONS] -= ep[2] - 1
    leaves[ep[1] : ep[1] + ep[2]] = 0.0
    gen[ep[1] : ep[1] + ep[2]] |= 1
    for name, array in (("ring.npy", ring), ("generation.npy", gen), ("tree_leaves.npy", leaves)):
        rewrite(snap, name, array)
    return "any"


def dtype_of_file(rng, snap, base):
    """An array saved with another dtype than its schema's, the manifest entry following
    the file (refused: the schema decides)."""
    name = (INTERNAL + field_files(base))[rng.integers(len(INTERNAL) + len(base.fields))]
    array = np.load(snap / name)
    other = [np.float64, np.float32, np.int8, np.int32, np.uint8, np.bool_, np.float16, ">f4", ">i8"]
    dtype = np.dtype(other[rng.integers(len(other))])
    if dtype == array.dtype:
        dtype = np.dtype(np.int16)
    with np.errstate(all="ignore"):
        rewrite(snap, name, array.astype(dtype))
    return "refuse"


def dtype_of_field(rng, snap, base):
    """A field's dtype changed consistently in the schema, the file and its entry: a
    snapshot of another schema (may be valid)."""
    m = read_manifest(snap)
    f = m["schema"][rng.integers(len(m["schema"]))]
    name = f"field.{f['name']}.npy"
    array = np.load(snap / name)
    other = [np.float64, np.float32, np.int8, np.int64, np.uint8, np.bool_, np.float16, ">f4", ">i8", np.complex64]
    dtype = np.dtype(other[rng.integers(len(other))])
    with np.errstate(all="ignore"):
        new = array.astype(dtype)
    np.save(snap / name, new)
    f["dtype"] = dtype.str
    rehash(snap, name, m, new)
    write_manifest(snap, m)
    return "any"


def shape_of_file(rng, snap, base):
    """An array saved with another shape (a row more or less, a dimension added), the
    manifest entry following the file (refused)."""
    name = (INTERNAL + field_files(base))[rng.integers(len(INTERNAL) + len(base.fields))]
    array = np.load(snap / name)
    how = rng.integers(3)
    new = array[:-1] if how == 0 and array.shape[0] > 1 else np.concatenate([array, array[:1]]) if how < 2 else \
        array[..., None]  # fmt: skip
    rewrite(snap, name, np.ascontiguousarray(new))
    return "refuse"


def shape_of_field(rng, snap, base):
    """A field's row shape changed consistently in the schema, the file and its entry (a
    snapshot of another schema: may be valid)."""
    m = read_manifest(snap)
    f = m["schema"][rng.integers(len(m["schema"]))]
    name = f"field.{f['name']}.npy"
    array = np.load(snap / name)
    row = list(array.shape[1:])
    how = rng.integers(3)
    shape = row + [2] if how == 0 else [max(1, math.prod(row) + 1)] if how == 1 else [1] * int(rng.integers(1, 16))
    new = np.resize(array, (array.shape[0], *shape))
    np.save(snap / name, new)
    f["shape"] = shape
    rehash(snap, name, m, new)
    write_manifest(snap, m)
    return "any"


def manifest_value(rng, snap, base):
    """A manifest key (sizes, priority settings, format, counters, a schema entry's
    name, shape, dtype or fill, a file entry's shape or dtype) set to a JSON value."""
    m = read_manifest(snap)
    value = JSON_VALUES[rng.integers(len(JSON_VALUES))]
    where = rng.integers(4)
    if where == 0:
        keys = ["capacity", "max_episodes", "alpha", "priority_eps", "priority_clip", "initial_priority",
                "format_version", "format", "positions", "created_unix", "counters", "extra", "schema", "files"]  # fmt: skip
        m[keys[rng.integers(len(keys))]] = value
    elif where == 1:
        f = m["schema"][rng.integers(len(m["schema"]))]
        f[["name", "shape", "dtype", "fill"][rng.integers(4)]] = value
    elif where == 2:
        entry = list(m["files"].values())[rng.integers(len(m["files"]))]
        entry[["shape", "dtype", "sha256"][rng.integers(3)]] = value
    else:
        name = list(m["files"])[rng.integers(len(m["files"]))]
        m["files"][name] = value
    write_manifest(snap, m)
    return "any"


def declared_size(rng, snap, base):
    """Sizes the manifest declares, edited consistently with nothing else: a schema shape
    with a negative, zero or huge dimension or 17 dimensions, a capacity or max_episodes
    doubled, huge or negative."""
    m = read_manifest(snap)
    how = rng.integers(3)
    if how == 0:
        f = m["schema"][rng.integers(len(m["schema"]))]
        shapes = [[-1], [0], [4, -4], [1 << 31], [1 << 40, 1 << 40], [1] * 17, [2**63], [3, 0]]
        f["shape"] = shapes[rng.integers(len(shapes))]
    else:
        key = "capacity" if how == 1 else "max_episodes"
        m[key] = [m[key] * 2, m[key] + 1, 1 << 30, (1 << 30) + 1, -m[key], 2**63][rng.integers(6)]
    write_manifest(snap, m)
    return "refuse"


def manifest_missing_key(rng, snap, base):
    """A manifest key, a schema entry's key or a file's entry removed."""
    m = read_manifest(snap)
    where = rng.integers(3)
    if where == 0:
        keys = list(m)
        del m[keys[rng.integers(len(keys))]]
    elif where == 1:
        f = m["schema"][rng.integers(len(m["schema"]))]
        del f[list(f)[rng.integers(len(f))]]
    else:
        del m["files"][list(m["files"])[rng.integers(len(m["files"]))]]
    write_manifest(snap, m)
    return "any"


def manifest_text(rng, snap, base):
    """The manifest as text no manifest is: nested 100,000 deep, a 5,000-digit number,
    not UTF-8, cut short, a JSON list, or larger than any manifest (sparse)."""
    how = rng.integers(6)
    path = snap / MANIFEST
    text = path.read_text()
    if how == 0:
        path.write_text(text[:-1] + ', "extra2": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif how == 1:
        path.write_text(re.sub(r'"(capacity|alpha|max_episodes)": [^,]*', lambda mt: f'"{mt[1]}": ' + "9" * 5000, text, 1))
    elif how == 2:
        path.write_bytes(b"\xff\xfe" + text.encode())
    elif how == 3:
        path.write_text(text[: int(rng.integers(1, len(text)))])
    elif how == 4:
        path.write_text("[" + text + "]")
    else:
        with open(path, "r+b") as f:
            f.truncate(65 << 20)  # sparse: holes after the JSON
    return "refuse"


def file_bytes(rng, snap, base):
    """An array file truncated, padded, or its .npy header edited (object dtype, Fortran
    order, another shape, an unknown version), checksum recomputed."""
    name = (INTERNAL + field_files(base))[rng.integers(len(INTERNAL) + len(base.fields))]
    path = snap / name
    data = path.read_bytes()
    how = rng.integers(6)
    if how == 0:
        data = data[: int(rng.integers(0, len(data)))]
    elif how == 1:
        data = data + bytes(int(rng.integers(1, 5000)))
    elif how == 2:
        data = data.replace(b"'descr': '", b"'descr': '|O', 'x': '", 1)
    elif how == 3:
        data = data.replace(b"'fortran_order': False", b"'fortran_order': True ", 1)
    elif how == 4:
        data = data[:6] + bytes([int(rng.integers(0, 256)), 0]) + data[8:]
    else:
        data = data.replace(b"'shape': (", b"'shape': (1, ", 1)
    path.write_bytes(data)
    rehash(snap, name)
    return "refuse"


def file_kind(rng, snap, base):
    """A file missing, or replaced by a symbolic link (to a copy outside), a FIFO, or a
    directory; or an extra file beside them (valid: must load)."""
    names = INTERNAL + field_files(base) + [MANIFEST]
    name = names[rng.integers(len(names))]
    path = snap / name
    how = rng.integers(5)
    if how == 0:
        path.unlink()
    elif how == 1:
        outside = snap.parent / f"outside-{name}"  # in the case directory, beside the snapshot
        shutil.copy(path, outside)
        path.unlink()
        os.symlink(outside, path)
    elif how == 2:
        path.unlink()
        os.mkfifo(path)
    elif how == 3:
        path.unlink()
        path.mkdir()
    else:
        (snap / "field.unknown.npy").write_bytes(b"not listed")
        (snap / "notes.txt").write_text("extra")
        return "any"
    return "refuse"


def sparse_huge(rng, snap, base):
    """A field declared huge, consistently in the schema and its file entry, with a sparse
    file of exactly the declared size (its checksum cannot be recomputed: the loader must
    refuse it on its size before hashing it)."""
    m = read_manifest(snap)
    f = m["schema"][rng.integers(len(m["schema"]))]
    name = f"field.{f['name']}.npy"
    fs = os.statvfs(snap)
    disk = fs.f_blocks * fs.f_frsize
    itemsize = np.dtype(f["dtype"]).itemsize
    per_row = disk // (base.capacity * itemsize) + int(rng.integers(1, 1 << 20))
    shape = [per_row] if per_row < (1 << 31) and rng.random() < 0.5 else [1 << 16, -(-per_row // (1 << 16))]
    f["shape"] = shape
    full = (base.capacity, *shape)
    m["files"][name] = {"sha256": "0" * 64, "shape": list(full), "dtype": f["dtype"]}
    write_manifest(snap, m)
    with open(snap / name, "wb") as out:
        np.lib.format.write_array_header_2_0(out, {"descr": f["dtype"], "fortran_order": False, "shape": full})
        out.truncate(out.tell() + math.prod(full) * itemsize)
    return "refuse"


MUTATIONS = {
    "array-value": array_value,
    "published-row-value": published_row_value,
    "odd-generation": odd_generation,
    "one-slot-overlap": one_slot_overlap,
    "final-row-priority": final_row_priority,
    "episode-id-other-lap": episode_id_other_lap,
    "ring-counter": ring_edit,
    "episode-table": table_edit,
    "slot-info": info_edit,
    "priority": priority_edit,
    "counter-limit": counter_edit,
    "hole (valid)": hole,
    "evict-oldest (valid)": evict_oldest,
    "dtype-of-file": dtype_of_file,
    "dtype-of-field": dtype_of_field,
    "shape-of-file": shape_of_file,
    "shape-of-field": shape_of_field,
    "manifest-value": manifest_value,
    "declared-size": declared_size,
    "manifest-missing-key": manifest_missing_key,
    "manifest-text": manifest_text,
    "file-bytes": file_bytes,
    "file-kind": file_kind,
    "sparse-huge": sparse_huge,
}


def mutate(kind: str, rng, snap: Path, base: Base) -> tuple[str, str]:
    """Apply ``kind`` to ``snap``; returns (the kind applied, the expectation). A kind that
    does not apply to this snapshot (no two adjacent episodes) falls back to ``array-value``."""
    expect = MUTATIONS[kind](rng, snap, base)
    if expect is None:  # not applicable to this snapshot
        kind, expect = "array-value", array_value(rng, snap, base)
    return kind, expect


# ---- oracle --------------------------------------------------------------------------------------
def oracle(buf, num_actions: int | None) -> list[str]:
    """What is wrong with a loaded buffer (empty: nothing), checked independently of the
    loader. ``num_actions``: the action count stored actions must stay below (None:
    the width of child_visits if the schema has it, else only >= 0)."""
    out = list(consistency.problems(buf))
    cap = buf.capacity
    table, ring = buf._episodes, buf._ring_state
    head, nxt, write_pos = int(ring[HEAD_ID]), int(ring[NEXT_ID]), int(ring[WRITE_POS])
    if not (0 <= write_pos <= cap and 0 <= head <= nxt < LIMIT):
        return out + [f"ring out of range: WRITE_POS {write_pos}, HEAD_ID {head}, NEXT_ID {nxt}"]
    published_slots = np.zeros(cap, bool)
    claimed = np.zeros(cap, np.int64)
    prev_end = 0
    for episode_id in range(head, nxt):
        row = table[episode_id % table.shape[0]]
        start, rows, state, term = int(row[START]), int(row[ROWS]), int(row[STATE]), int(row[TERMINATED])
        if state not in (FREE, PUBLISHED) or term not in (0, 1) or not (0 <= start and 2 <= rows and start + rows <= cap):
            out.append(f"episode {episode_id}: state {state}, terminated {term}, slots {start}+{rows}")
            continue
        claimed[start : start + rows] += 1
        offset = (start - write_pos) % cap
        if offset < prev_end:
            out.append(f"episode {episode_id}: out of ring order or overlapping the previous one")
        prev_end = offset + rows
        if state == PUBLISHED:
            published_slots[start : start + rows] = True
    if nxt > head and prev_end != cap:
        out.append(f"the newest episode does not end at WRITE_POS {write_pos}")
    if (claimed > 1).any():
        out.append(f"{int((claimed > 1).sum())} slots claimed by two episodes")
    for name, arr in (("counters", buf._arrays["_counters"]), ("generation", buf._generation)):
        if ((arr < 0) | (arr >= LIMIT)).any():
            out.append(f"{name} outside [0, 2^62)")
    leaves = buf._tree.leaves
    if not np.isfinite(leaves).all() or ((leaves != 0) & ((leaves < LEAF_RANGE[0]) | (leaves > LEAF_RANGE[1]))).any():
        out.append("a priority that is not 0 or within [1e-100, 1e100]")
    top = float(buf._arrays["_max_priority"][0])
    if not (math.isfinite(top) and top >= 0):
        out.append(f"max_priority {top}")
    if num_actions is None and "child_visits" in buf.fields:
        num_actions = buf.fields["child_visits"].shape[1]
    for f in buf.schema:
        data = np.asarray(buf.fields[f.name])[published_slots]
        if f.dtype.kind == "f":
            ok = np.isfinite(data) | (np.isnan(data) if math.isnan(f.fill) else False)
            if not ok.all():
                out.append(f"{f.name}: a value that is not finite in a published row")
        elif f.dtype.kind == "b":
            if (data.view(np.uint8) > 1).any():
                out.append(f"{f.name}: a bool byte other than 0 or 1")
        elif f.name == "action":
            if (data < 0).any() or (num_actions is not None and (data >= num_actions).any()):
                out.append(f"action outside [0, {num_actions})")
    return out
