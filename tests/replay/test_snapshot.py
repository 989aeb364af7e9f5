"""Snapshots: round trips, sampling equivalence, atomicity, corruption, live writers."""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from children import hold_the_buffer_lock_and_exit, hold_the_buffer_lock_until
from conftest import make_episode

import mpper.replay.snapshot
from mpper import ReplayBuffer, SnapshotError
from mpper import shm as mpper_shm
from mpper.algos.muzero.targets import REANALYSE_COUNTERS, muzero_schema

pytestmark = pytest.mark.timeout(60)

CAPACITY = 256
SCHEMA = {**muzero_schema((4,), 2), "tag": ((), "int64")}
EXTRA = {"run": "test", "config": {"lr": 0.001, "layers": [64, 64]}, "step": 12345}


def _fill(buf: ReplayBuffer, seed: int = 0, episodes: int = 40) -> None:
    """Enough episodes to wrap the ring (evictions, holes), varied priorities, a
    truncated episode, a priority update and a reanalysed episode."""
    rng = np.random.default_rng(seed)
    for k in range(episodes):
        T = int(rng.integers(2, 12))
        ep = make_episode(rng, T)
        ep["tag"] = np.full(T + 1, k, np.int64)
        pr = None if k % 5 == 0 else rng.uniform(0.01, 10.0, T)
        assert buf.add_episode(ep, priorities=pr, terminated=k % 7 != 3)
    batch = buf.sample(32, 0.4, rng=rng)
    applied, _ = buf.update_priorities(batch.indices, batch.generations, rng.uniform(0, 20, 32))
    assert applied > 0
    ref = buf.episodes()[-1]
    assert buf.rewrite_rows(ref, {"reanalysed_value": np.linspace(-1, 1, ref.rows - 1)})


@pytest.fixture
def filled():
    buf = ReplayBuffer.create(SCHEMA, CAPACITY, alpha=0.7, priority_eps=1e-3, priority_clip=15.0,
                              initial_priority="max")  # fmt: skip
    try:
        _fill(buf)
        yield buf
    finally:
        buf.close()


def _state(buf: ReplayBuffer) -> dict:
    """Copies of everything a snapshot must preserve."""
    return {
        "fields": {k: np.array(v) for k, v in buf.fields.items()},
        "leaves": buf._tree.leaves.copy(),
        "total": buf.total_priority,
        "generation": np.array(buf._generation),
        "info": np.array(buf._info),
        "episodes_table": np.array(buf._episodes),
        "ring": np.array(buf._ring_state),
        "counters": buf.counters,
        "max_priority": buf.max_priority,
        "schema": [(f.name, f.shape, f.dtype, repr(f.fill)) for f in buf.schema],  # NaN fill
        "params": (buf.capacity, buf.alpha, buf.priority_eps, buf.priority_clip, buf.initial_priority),
        "episodes": buf.episodes(),
        "len": len(buf),
    }


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a["fields"].keys() == b["fields"].keys()
    for k in a["fields"]:
        np.testing.assert_array_equal(a["fields"][k], b["fields"][k], err_msg=k)  # NaN == NaN here
    for k in ("leaves", "generation", "info", "episodes_table", "ring"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    for k in ("total", "counters", "max_priority", "schema", "params", "episodes", "len"):
        assert a[k] == b[k], k


def _own_segments() -> list[str]:
    """This process's segments (other test runs may share /dev/shm)."""
    return [n for n in mpper_shm.mpper_segments() if mpper_shm.owner_pid(n) == os.getpid()]


def _tree_of(path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, manifest) -> None:
    (path / "manifest.json").write_text(json.dumps(manifest))


# --------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------
def test_round_trip_shared_memory(filled, tmp_path):
    before = _state(filled)
    assert before["len"] > 0 and before["counters"]["episodes_evicted"] > 0  # the ring wrapped
    filled.save(tmp_path / "snap", extra=EXTRA)
    assert _manifest(tmp_path / "snap")["extra"] == EXTRA
    with ReplayBuffer.load(tmp_path / "snap") as loaded:
        assert not loaded.read_only
        assert loaded.snapshot_manifest["extra"] == EXTRA
        seg = loaded.handle.segment
        assert seg != filled.handle.segment and seg in mpper_shm.mpper_segments()
        assert mpper_shm.owner_pid(seg) == os.getpid()
        _assert_state_equal(_state(loaded), before)
        assert np.isnan(loaded.fields["reanalysed_value"][0])  # the NaN fill survived
        # it keeps training
        rng = np.random.default_rng(9)
        games = loaded.counters["games"]
        ep = make_episode(rng, 6)
        ep["tag"] = np.full(7, 999)
        assert loaded.add_episode(ep, priorities=np.full(6, 2.0))
        assert loaded.counters["games"] == games + 1
        assert loaded.episodes()[-1].rows == 7
        batch = loaded.sample(64, 0.4, rng=rng)
        assert np.all(loaded.priorities(batch.indices) > 0)
        applied, dropped = loaded.update_priorities(batch.indices, batch.generations, np.full(64, 3.0))
        assert (applied, dropped) == (64, 0)
        np.testing.assert_allclose(loaded.priorities(batch.indices), (3.0 + 1e-3) ** 0.7)
        # and is its own memory: the original did not change
        _assert_state_equal(_state(filled), before)
    assert seg not in mpper_shm.mpper_segments()


def test_round_trip_mmap_read_only(filled, tmp_path):
    before = _state(filled)
    filled.save(tmp_path / "snap", extra=EXTRA)
    segments = _own_segments()
    loaded = ReplayBuffer.load(tmp_path / "snap", mmap=True)
    try:
        assert _own_segments() == segments  # no shared memory for a read-only load
        assert loaded.read_only
        for name, arr in loaded.fields.items():
            assert isinstance(arr, np.memmap), name
            assert not arr.flags.writeable, name
        _assert_state_equal(_state(loaded), before)
        ep = make_episode(np.random.default_rng(1), 3)
        with pytest.raises(PermissionError):
            loaded.add_episode(ep)
        batch = loaded.sample(128, 0.4, rng=np.random.default_rng(2))
        with pytest.raises(PermissionError):
            loaded.update_priorities(batch.indices, batch.generations, np.ones(128))
        # sampled rows are the stored rows
        for k, v in batch.data.items():
            np.testing.assert_array_equal(v, before["fields"][k][batch.indices], err_msg=k)
        _assert_state_equal(_state(loaded), {**before, "counters": {**before["counters"], "samples": before["counters"]["samples"] + 128}})
    finally:
        loaded.close()


# Written by mpper before the buffer's counters named no algorithm: MuZero's reanalyse
# counters sat in slots 5 and 6, before episodes_evicted; its manifest lists them by name.
_OLD_SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "snapshot_v1_counters"
_OLD_COUNTERS = {"games": 7, "steps": 46, "samples": 8, "priority_updates_applied": 8, "priority_updates_dropped": 0,
                 "episodes_evicted": 2, "episodes_abandoned": 0, "torn_rows_redrawn": 0, "reanalysed_episodes": 2,
                 "reanalysed_dropped": 1, "positions": 34}  # fmt: skip


def test_a_snapshot_from_before_the_schemas_counters_loads_them_by_name_and_keeps_counting(tmp_path):
    for mmap in (True, False):
        with ReplayBuffer.load(_OLD_SNAPSHOT, mmap=mmap) as old:
            assert old.counters == _OLD_COUNTERS
            assert old.check_consistency() == []
    with ReplayBuffer.load(_OLD_SNAPSHOT) as resumed:
        ref = resumed.episodes()[-1]
        assert resumed.rewrite_rows(ref, {"reanalysed_value": np.ones(ref.rows - 1)}, counters=REANALYSE_COUNTERS)
        with ReplayBuffer.attach(resumed.handle) as child:  # a child process of the resumed run
            assert child.counters == resumed.counters
        resumed.save(tmp_path / "again")
    manifest = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert manifest["counters"]["reanalysed_episodes"] == 3
    with ReplayBuffer.load(tmp_path / "again") as again:
        assert again.counters == {**_OLD_COUNTERS, "reanalysed_episodes": 3}


@pytest.mark.parametrize("counters, match", [
    ([1, 2], "must be an object"),
    ({"games": -1}, "'games' is -1, expected an integer"),
    ({"games": 1.5}, "'games' is 1.5"),
    ({"games": 1 << 62}, "expected an integer in"),
    ({"two words": 1}, "must be an identifier"),
    ({f"c{i}": 1 for i in range(9)}, "at most 8 extra counters"),
])  # fmt: skip
def test_a_manifest_with_bad_counters_is_refused_in_one_line(tmp_path, counters, match):
    shutil.copytree(_OLD_SNAPSHOT, tmp_path / "snap")
    manifest = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    manifest["counters"] = counters
    (tmp_path / "snap" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match=match) as err:
        ReplayBuffer.load(tmp_path / "snap")
    assert "manifest.json: 'counters'" in str(err.value) and "\n" not in str(err.value)


def test_mmap_rewrite_rows_is_refused(filled, tmp_path):
    filled.save(tmp_path / "snap")
    loaded = ReplayBuffer.load(tmp_path / "snap", mmap=True)
    ref = loaded.episodes()[0]
    with pytest.raises(PermissionError):
        loaded.rewrite_rows(ref, {"reanalysed_value": np.zeros(ref.rows - 1)})


def _chi_square_limit(dof: int, z: float = 4.265) -> float:
    """Upper quantile of chi2(dof) at p = 1e-5 (Wilson-Hilferty)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * np.sqrt(h)) ** 3


@pytest.mark.parametrize("mmap", [False, True])
def test_loaded_snapshot_samples_same_distribution(filled, tmp_path, mmap):
    leaves, total = filled._tree.leaves.copy(), filled.total_priority
    assert len(np.unique(leaves[leaves > 0])) > 20  # a far from uniform distribution
    filled.save(tmp_path / "snap")
    loaded = ReplayBuffer.load(tmp_path / "snap", mmap=mmap)
    try:
        np.testing.assert_array_equal(loaded._tree.leaves, leaves)
        assert loaded.total_priority == pytest.approx(total, rel=1e-12)
        rng = np.random.default_rng(123)
        draws, batch = 60_000, 2_000
        counts = np.zeros(CAPACITY, np.int64)
        for _ in range(draws // batch):
            b = loaded.sample(batch, 0.4, rng=rng)
            np.testing.assert_allclose(b.probabilities, leaves[b.indices] / total, rtol=1e-12)
            counts += np.bincount(b.indices, minlength=CAPACITY)
        assert counts[leaves == 0].sum() == 0  # holes and final rows never drawn
        live = leaves > 0
        expected = draws * leaves[live] / total
        chi2 = float((((counts[live] - expected) ** 2) / expected).sum())
        assert chi2 < _chi_square_limit(int(live.sum()) - 1), chi2
    finally:
        loaded.close()


# --------------------------------------------------------------------------------------
# Atomicity
# --------------------------------------------------------------------------------------
def test_save_over_existing_snapshot_replaces_it(filled, tmp_path):
    path = tmp_path / "snap"
    filled.save(path, extra={"n": 1})
    _fill(filled, seed=1, episodes=5)
    after = _state(filled)
    filled.save(path, extra={"n": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]  # no temp or aside dirs
    assert _manifest(path)["extra"] == {"n": 2}
    with ReplayBuffer.load(path) as loaded:
        _assert_state_equal(_state(loaded), after)


def test_save_into_empty_directory(filled, tmp_path):
    (tmp_path / "snap").mkdir()
    filled.save(tmp_path / "snap")
    with ReplayBuffer.load(tmp_path / "snap") as loaded:
        assert loaded.counters == filled.counters


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_failed_save_leaves_previous_snapshot(filled, tmp_path, monkeypatch, error):
    path = tmp_path / "snap"
    filled.save(path, extra={"n": 1})
    old_state, old_files = _state(filled), _tree_of(path)
    _fill(filled, seed=2, episodes=5)
    real = mpper.replay.snapshot._write_npy
    calls = []

    def failing(p, array):
        calls.append(p.name)
        if len(calls) == 3:
            raise error
        return real(p, array)

    monkeypatch.setattr(mpper.replay.snapshot, "_write_npy", failing)
    with pytest.raises(type(error)):
        filled.save(path, extra={"n": 2})
    assert len(calls) == 3
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]  # the temp dir is gone
    assert _tree_of(path) == old_files
    with ReplayBuffer.load(path) as loaded:
        _assert_state_equal(_state(loaded), old_state)
    assert _manifest(path)["extra"] == {"n": 1}


def test_crash_between_renames_loads_previous(filled, tmp_path):
    path = tmp_path / "snap"
    filled.save(path)
    old_state = _state(filled)
    # the first rename of a later save happened, the second did not
    os.rename(path, tmp_path / ".snap.old-999-abcdef")
    _fill(filled, seed=3, episodes=5)
    filled.save(tmp_path / "other")  # an unrelated snapshot beside it is not picked
    with pytest.warns(UserWarning, match="previous snapshot"):
        loaded = ReplayBuffer.load(path)
    with loaded:
        _assert_state_equal(_state(loaded), old_state)
    with pytest.warns(UserWarning, match="previous snapshot"):
        ro = ReplayBuffer.load(path, mmap=True)
    _assert_state_equal(_state(ro), old_state)


def test_next_save_removes_snapshots_left_aside(filled, tmp_path):
    path = tmp_path / "snap"
    filled.save(path)
    os.rename(path, tmp_path / ".snap.old-999-abcdef")  # a crash between the renames
    filled.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]


def test_save_refuses_a_file_and_non_json_extra(filled, tmp_path):
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(SnapshotError, match="afile"):
        filled.save(tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "keep"
    with pytest.raises(TypeError, match="JSON"):
        filled.save(tmp_path / "snap", extra={"x": np.float32(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_refuses_to_overwrite_non_snapshot_directory(filled, tmp_path):
    path = tmp_path / "precious"
    path.mkdir()
    (path / "notes.txt").write_text("do not delete")
    with pytest.raises(SnapshotError, match="precious"):
        filled.save(path)
    assert [p.name for p in path.iterdir()] == ["notes.txt"]
    assert (path / "notes.txt").read_text() == "do not delete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]


# --------------------------------------------------------------------------------------
# Corrupt or missing snapshots: SnapshotError naming the file
# --------------------------------------------------------------------------------------
@pytest.fixture
def snap(tmp_path):
    buf = ReplayBuffer.create(SCHEMA, 64, alpha=0.6)
    try:
        _fill(buf, episodes=12)
        buf.save(tmp_path / "snap")
    finally:
        buf.close()
    return tmp_path / "snap"


def _data_offset(path) -> int:
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        read(f)
        return f.tell()


def _truncate_data(s):
    p = s / "field.observation.npy"
    p.write_bytes(p.read_bytes()[:-5])
    return "field.observation.npy"


def _truncate_header(s):
    p = s / "field.reward.npy"
    p.write_bytes(p.read_bytes()[:40])
    return "field.reward.npy"


def _empty_file(s):
    (s / "generation.npy").write_bytes(b"")
    return "generation.npy"


def _manifest_shape(s):
    m = _manifest(s)
    m["files"]["field.child_visits.npy"]["shape"] = [64, 3]
    _write_manifest(s, m)
    return "field.child_visits.npy"


def _manifest_dtype(s):
    m = _manifest(s)
    m["files"]["field.reward.npy"]["dtype"] = "<f8"
    _write_manifest(s, m)
    return "field.reward.npy"


def _manifest_schema_shape(s):
    m = _manifest(s)
    [obs] = [f for f in m["schema"] if f["name"] == "observation"]
    obs["shape"] = [5]
    _write_manifest(s, m)
    return "field.observation.npy"


def _flip_data_byte(s):
    p = s / "field.root_value.npy"
    raw = bytearray(p.read_bytes())
    raw[_data_offset(p) + 17] ^= 0x01
    p.write_bytes(bytes(raw))
    return "field.root_value.npy"


def _flip_leaf_byte(s):
    p = s / "tree_leaves.npy"
    raw = bytearray(p.read_bytes())
    raw[_data_offset(p) + 8 * 3] ^= 0x10  # low mantissa bit of leaf 3: still a valid priority
    p.write_bytes(bytes(raw))
    return "tree_leaves.npy"


def _format_version(s):
    m = _manifest(s)
    m["format_version"] = 99
    _write_manifest(s, m)
    return "manifest.json"


def _missing_array(s):
    (s / "tree_leaves.npy").unlink()
    return "tree_leaves.npy"


def _missing_manifest(s):
    (s / "manifest.json").unlink()
    return "manifest.json"


def _manifest_not_json(s):
    (s / "manifest.json").write_text('{"format": "mpper-replay-snapshot", ')
    return "manifest.json"


def _manifest_binary(s):
    (s / "manifest.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00garbage")
    return "manifest.json"


CORRUPTIONS = [
    _truncate_data, _truncate_header, _empty_file, _manifest_shape, _manifest_dtype,
    _manifest_schema_shape, _flip_data_byte, _flip_leaf_byte, _format_version, _missing_array,
    _missing_manifest, _manifest_not_json, _manifest_binary,
]  # fmt: skip


@pytest.mark.parametrize("mmap", [False, True], ids=["shm", "mmap"])
@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.lstrip("_"))
def test_corrupt_snapshot_raises_naming_file(snap, corrupt, mmap):
    segments = _own_segments()
    fname = corrupt(snap)
    with pytest.raises(SnapshotError) as info:
        ReplayBuffer.load(snap, mmap=mmap)
    assert fname in str(info.value), str(info.value)
    assert _own_segments() == segments  # no buffer was left half-built


class _Evil:
    """Unpickling this creates a directory: proof that the loader ran pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("mmap", [False, True], ids=["shm", "mmap"])
def test_pickled_object_array_is_refused_not_unpickled(snap, tmp_path, mmap):
    marker = str(tmp_path / "unpickled")
    target = snap / "field.observation.npy"
    shape = tuple(_manifest(snap)["files"][target.name]["shape"])
    evil = np.empty(shape, dtype=object)
    evil[0, 0] = _Evil(marker)
    np.save(target, evil, allow_pickle=True)
    with pytest.raises(SnapshotError) as info:
        ReplayBuffer.load(snap, mmap=mmap)
    assert target.name in str(info.value)
    assert not os.path.exists(marker)
    # The file really would run code when unpickled (so the check above can fail).
    np.load(target, allow_pickle=True)
    assert os.path.isdir(marker)


def test_missing_directory(tmp_path):
    with pytest.raises(SnapshotError) as info:
        ReplayBuffer.load(tmp_path / "no_such_snapshot")
    assert "no_such_snapshot" in str(info.value)


@pytest.mark.parametrize("mmap", [False, True], ids=["shm", "mmap"])
def test_truncated_file_refused_without_checksums(snap, mmap):
    fname = _truncate_data(snap)
    with pytest.raises(SnapshotError, match="truncated") as info:
        ReplayBuffer.load(snap, mmap=mmap, verify=False)
    assert fname in str(info.value)


@pytest.mark.parametrize("mmap", [False, True], ids=["shm", "mmap"])
def test_checksums_can_be_skipped(snap, mmap):
    """``verify=False`` (the documented escape hatch) loads a file whose checksum no longer
    matches, as it is on disk: the one flipped bit shows in the loaded field, every other
    value is the saved one. The same snapshot with checksums verified is refused."""
    saved = {name: np.load(snap / f"field.{name}.npy") for name in SCHEMA}
    leaves = np.load(snap / "tree_leaves.npy")
    fname = _flip_data_byte(snap)
    flipped = saved["root_value"].copy()
    flipped.view(np.uint8)[17] ^= 0x01  # the byte _flip_data_byte changed
    assert flipped[4] != saved["root_value"][4]
    with ReplayBuffer.load(snap, mmap=mmap, verify=False) as loaded:
        np.testing.assert_array_equal(loaded.fields["root_value"], flipped)
        for name in SCHEMA:
            if name != "root_value":
                np.testing.assert_array_equal(loaded.fields[name], saved[name], err_msg=name)
        np.testing.assert_array_equal(loaded._tree.leaves, leaves)
        assert loaded.capacity == 64 and loaded.counters["games"] == 12
    with pytest.raises(SnapshotError, match="checksum") as info:
        ReplayBuffer.load(snap, mmap=mmap)
    assert fname in str(info.value)


# --------------------------------------------------------------------------------------
# Saving while another process writes
# --------------------------------------------------------------------------------------
LIVE_CAPACITY = 10_000
LIVE_SCHEMA = {"observation": ((64,), "float32"), "action": ((), "int64"), "tag": ((), "int64")}


def _live_rows(k: int) -> int:
    return 3 + (k * 7) % 29


def _live_writer(handle, permits, written, stop):
    """Write episode k (tagged k) for every permit released, counting them in ``written``."""
    buf = ReplayBuffer.attach(handle)
    rng = np.random.default_rng(0)
    k = 0
    try:
        while not stop.is_set():
            if not permits.acquire(timeout=0.1):
                continue
            L = _live_rows(k)
            obs = np.full((L, 64), k, np.float32) + np.arange(L, dtype=np.float32)[:, None]
            ok = buf.add_episode({"observation": obs, "action": np.arange(L), "tag": np.full(L, k)},
                                 priorities=rng.uniform(0.1, 5.0, L - 1))  # fmt: skip
            assert ok
            k += 1
            with written.get_lock():
                written.value = k
    finally:
        buf.close()


def _release(permits, written, episodes: int) -> int:
    """Let the writer write ``episodes`` more episodes; returns the count to wait for."""
    target = written.value + episodes
    for _ in range(episodes):
        permits.release()
    return target


def _wait_written(written, target: int, proc) -> None:
    """Wait until the writer has written ``target`` episodes; fail if it dies or makes no
    progress for 120 s (generous: only a stuck writer gets near it)."""
    last, deadline = written.value, time.monotonic() + 120
    while last < target:
        assert proc.is_alive(), f"the writer died (exit code {proc.exitcode})"
        assert time.monotonic() < deadline, f"the writer is stuck at {last} of {target} episodes"
        time.sleep(0.005)
        if written.value != last:
            last, deadline = written.value, time.monotonic() + 120


def _check_live_snapshot(path, mmap):
    loaded = ReplayBuffer.load(path, mmap=mmap)
    try:
        refs = loaded.episodes()
        assert refs, "no published episode in the snapshot"
        tags, obs = loaded.fields["tag"], loaded.fields["observation"]
        covered = np.zeros(LIVE_CAPACITY, bool)
        for ref in refs:
            sl = slice(ref.start, ref.start + ref.rows)
            k = ref.episode_id
            assert ref.rows == _live_rows(k)
            np.testing.assert_array_equal(tags[sl], k)
            expected = np.float32(k) + np.arange(ref.rows, dtype=np.float32)[:, None]
            np.testing.assert_array_equal(obs[sl], np.broadcast_to(expected, (ref.rows, 64)))
            np.testing.assert_array_equal(loaded.fields["action"][sl], np.arange(ref.rows))
            covered[ref.start : ref.start + ref.rows - 1] = True
        leaves = loaded._tree.leaves
        assert np.all(leaves[~covered] == 0), "priority on a slot outside the published episodes"
        assert np.all(leaves[covered] > 0)
        assert len(loaded) == int(covered.sum())
        b = loaded.sample(4096, rng=np.random.default_rng(0))
        assert covered[b.indices].all()
        return loaded.counters["games"], {ref.episode_id for ref in refs}
    finally:
        loaded.close()


# Episodes the writer may write while one field file is being saved: at most 40 * 31 =
# 1240 rows per field, 3720 per save, so a save never sees the ring lapped (10,000 slots).
_PER_FIELD = 40


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_save_while_another_process_writes(tmp_path, monkeypatch):
    """Another process writes episodes while each of three saves writes its field files
    (a handshake releases a bounded number of episodes per file and waits for them, so
    every save races with evictions whatever the machine's speed). Each snapshot holds
    exactly the episodes published when the save began that the writer did not evict
    during it, every one intact (rows, tags, observations), and no priority on a hole."""
    buf = ReplayBuffer.create(LIVE_SCHEMA, LIVE_CAPACITY, alpha=0.6)
    ctx = mp.get_context("spawn")
    permits, written, stop = ctx.Semaphore(0), ctx.Value("q", 0), ctx.Event()
    proc = ctx.Process(target=_live_writer, args=(buf.handle, permits, written, stop))
    write = mpper.replay.snapshot._write_npy
    fields = {f"field.{name}.npy" for name in LIVE_SCHEMA}

    def write_while_the_writer_writes(path, array):
        if path.name not in fields:
            return write(path, array)
        target = _release(permits, written, _PER_FIELD)
        meta = write(path, array)  # the writer writes meanwhile
        _wait_written(written, target, proc)  # and has written them all before the save goes on
        return meta

    monkeypatch.setattr(mpper.replay.snapshot, "_write_npy", write_while_the_writer_writes)
    paths, expected = [], []
    try:
        proc.start()
        _wait_written(written, _release(permits, written, 1000), proc)  # about 17,000 rows: the ring has wrapped
        assert buf.counters["episodes_evicted"] > 0
        for i in range(3):
            _wait_written(written, _release(permits, written, 100), proc)
            before = {ref.episode_id for ref in buf.episodes()}
            paths.append(tmp_path / f"snap{i}")
            buf.save(paths[-1])
            after = {ref.episode_id for ref in buf.episodes()}
            assert written.value == 1000 + 100 * (i + 1) + 3 * _PER_FIELD * (i + 1)
            assert before - after, "the writer evicted nothing during the save: no hole was tested"
            expected.append(before & after)
        stop.set()
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        stop.set()
        if proc.is_alive():
            proc.kill()
            proc.join()
        buf.close()
    for i, path in enumerate(paths):
        games, ids = _check_live_snapshot(path, mmap=(i != 0))
        assert ids == expected[i]
        assert games == 1000 + 100 * (i + 1) + 3 * _PER_FIELD * i  # the counters of the save's start


# --------------------------------------------------------------------------------------
# Interrupted and failing saves, for real: SIGINT to the process writing, a full disk
# --------------------------------------------------------------------------------------
_SAVING_SCRIPT = r"""
import sys, time
import numpy as np
import mpper.replay.snapshot
from mpper import ReplayBuffer

path = sys.argv[1]
buf = ReplayBuffer.create({"observation": ((64,), "float32")}, capacity=4096)
buf.add_episode({"observation": np.ones((11, 64), np.float32)})
buf.save(path, extra={"n": 1})
buf.add_episode({"observation": np.full((21, 64), 2, np.float32)})
write = mpper.replay.snapshot._write_npy
files = []

def stuck_write(p, array):  # a disk that hangs after the second file of the second save
    meta = write(p, array)
    files.append(p.name)
    if len(files) == 2:
        print("mid-save", flush=True)
        time.sleep(600)  # until the signal
    return meta

mpper.replay.snapshot._write_npy = stuck_write
print("saving", flush=True)
buf.save(path, extra={"n": 2})
print("saved", flush=True)
"""


@pytest.mark.slow
def test_sigint_while_a_snapshot_is_written_leaves_the_previous_one_whole(tmp_path):
    """A process that owns a buffer gets SIGINT (Ctrl-C) in the middle of its second
    save (held there after two of its files): the first snapshot is still there, whole (checksums verified), no temporary
    directory is left beside it, and the owner still unlinked its segment."""
    path = tmp_path / "snap"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", _SAVING_SCRIPT, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout.readline() == "saving\n"
        assert proc.stdout.readline() == "mid-save\n"  # two of the ten files written
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".snap.tmp-")], "no save in progress"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "saved" not in out and "KeyboardInterrupt" in err and proc.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]  # the half-written temp dir is gone
    assert _manifest(path)["extra"] == {"n": 1}
    with ReplayBuffer.load(path) as loaded:  # verify=True: every checksum
        assert loaded.counters["games"] == 1 and len(loaded) == 10
        np.testing.assert_array_equal(loaded.fields["observation"][:11], 1)
    assert not [n for n in mpper_shm.mpper_segments() if mpper_shm.owner_pid(n) == proc.pid]


def test_a_save_cut_between_its_two_renames_puts_the_previous_snapshot_back(tmp_path, monkeypatch):
    """The save moves the previous snapshot aside, then renames the new one into place;
    a Ctrl-C (or any error) between the two leaves the previous one where it was, whole,
    and nothing beside it."""
    path = tmp_path / "snap"
    with ReplayBuffer.create({"observation": ((8,), "float32")}, capacity=256) as buf:
        buf.add_episode({"observation": np.ones((11, 8), np.float32)})
        buf.save(path, extra={"n": 1})
        buf.add_episode({"observation": np.full((21, 8), 2, np.float32)})
        rename = os.rename

        def interrupted_rename(src, dst):
            if os.path.basename(src).startswith(".snap.tmp-"):
                raise KeyboardInterrupt  # the previous snapshot has just been moved aside
            rename(src, dst)

        monkeypatch.setattr(os, "rename", interrupted_rename)
        with pytest.raises(KeyboardInterrupt):
            buf.save(path, extra={"n": 2})
        monkeypatch.setattr(os, "rename", rename)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    assert _manifest(path)["extra"] == {"n": 1}
    with ReplayBuffer.load(path) as loaded:  # every checksum
        assert loaded.counters["games"] == 1


def test_a_save_whose_lock_a_dead_process_held_repairs_and_saves(tmp_path, capfd):
    """A process that died holding the buffer's lock (a real child takes the real lock and
    exits): the save gets the lock at once (the kernel tells it the owner died), the
    buffer is repaired with one line naming the dead pid, and the snapshot is written."""
    path = tmp_path / "snap"
    with ReplayBuffer.create({"observation": ((8,), "float32")}, capacity=256) as buf:
        buf.add_episode({"observation": np.ones((11, 8), np.float32)})
        child = mp.get_context("spawn").Process(target=hold_the_buffer_lock_and_exit, args=(buf.handle,))
        child.start()
        child.join(120)
        assert child.exitcode == 0
        buf.save(path, extra={"n": 2})
        assert buf.check_consistency() == []
    err = capfd.readouterr().err
    assert f"mpper: process {child.pid} died holding the replay buffer's lock" in err, err
    assert _manifest(path)["extra"] == {"n": 2}
    with ReplayBuffer.load(path) as loaded:
        assert loaded.counters["games"] == 1 and loaded.check_consistency() == []


def test_a_save_whose_lock_a_live_process_keeps_fails_in_bounded_time(tmp_path, monkeypatch):
    """A live process that keeps the buffer's lock (stuck, or stopped): the save gives up
    after ``LOCK_TIMEOUT_S`` with an error naming the lock, rather than waiting for ever,
    and the previous snapshot is untouched."""
    path = tmp_path / "snap"
    monkeypatch.setattr(mpper.replay.snapshot, "LOCK_TIMEOUT_S", 1.0)
    ctx = mp.get_context("spawn")
    holding, release = ctx.Event(), ctx.Event()
    with ReplayBuffer.create({"observation": ((8,), "float32")}, capacity=256) as buf:
        buf.add_episode({"observation": np.ones((11, 8), np.float32)})
        buf.save(path, extra={"n": 1})
        child = ctx.Process(target=hold_the_buffer_lock_until, args=(buf.handle, holding, release))
        child.start()
        try:
            assert holding.wait(120)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="the buffer's lock was not released within 1 s"):
                buf.save(path, extra={"n": 2})
            assert time.monotonic() - t0 < 30
        finally:
            release.set()
            child.join(120)
        assert child.exitcode == 0
        buf.save(path, extra={"n": 3})  # released: the save goes through
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    assert _manifest(path)["extra"] == {"n": 3}


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MiB tmpfs at tmp_path/disk (a real full disk); None where mounting is not
    allowed (not root), and then the test simulates ENOSPC in the writes instead."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(disk)],
                           capture_output=True, text=True, check=False)  # fmt: skip
    if mount.returncode != 0:
        print(f"cannot mount a tmpfs ({mount.stderr.strip()}): ENOSPC is simulated")
        yield None
        return
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_leaves_the_previous_snapshot_whole(tmp_path, small_disk, monkeypatch):
    """The first snapshot (about 0.9 MiB) fits on the disk, the second does not (the new
    files are written beside the old ones before the rename): the save raises ENOSPC,
    the previous snapshot stays whole and loads, and no partial file is left."""
    buf = ReplayBuffer.create({"observation": ((48,), "float32")}, capacity=4096)
    try:
        buf.add_episode({"observation": np.ones((11, 48), np.float32)})
        root = small_disk if small_disk is not None else tmp_path / "simulated"
        path = root / "snap"
        buf.save(path, extra={"n": 1})
        size = sum(p.stat().st_size for p in path.iterdir())
        assert 0.75 * 2**20 < size < 1.5 * 2**20  # one fits, two do not
        buf.add_episode({"observation": np.full((21, 48), 2, np.float32)})
        if small_disk is None:  # the same failure, simulated: writes stop fitting after `size` bytes
            written = {"n": 0}
            real_write = mpper.replay.snapshot._HashingFile.write

            def write(self, data):
                written["n"] += memoryview(data).nbytes
                if written["n"] > 1.5 * 2**20 - size:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_write(self, data)

            monkeypatch.setattr(mpper.replay.snapshot._HashingFile, "write", write)
        with pytest.raises(OSError) as info:
            buf.save(path, extra={"n": 2})
        assert info.value.errno == errno.ENOSPC, info.value
        monkeypatch.undo()
        assert sorted(p.name for p in root.iterdir()) == ["snap"]  # the partial new snapshot is gone
        assert _manifest(path)["extra"] == {"n": 1}
        with ReplayBuffer.load(path) as loaded:
            assert loaded.counters["games"] == 1
            np.testing.assert_array_equal(loaded.fields["observation"][:11], 1)
    finally:
        buf.close()


@pytest.mark.parametrize("mmap", [False, True], ids=["shm", "mmap"])
def test_a_snapshot_replaced_by_a_save_while_it_is_read_loads_the_new_one_not_corrupted(filled, tmp_path, monkeypatch,
                                                                                         mmap):  # fmt: skip
    """A live run saves over its snapshot while ``--inspect`` reads it: the reader gets the
    manifest of one snapshot and the arrays of the next, whose checksums disagree. That is
    reported neither as corruption nor as a failure: the load starts again on the new
    snapshot. (Here the save lands right after the reader read the manifest.)"""
    from mpper.replay import snapshot

    path = tmp_path / "snap"
    filled.save(path)
    rng = np.random.default_rng(9)
    read_manifest, saves = snapshot.read_manifest, []

    def a_save_lands_after_the_manifest(where):
        manifest = read_manifest(where)
        if not saves:  # the first read only: new data, then the run's next save
            filled.add_episode(make_episode(rng, 30))
            filled.save(path)
            saves.append(where)
        return manifest

    monkeypatch.setattr(snapshot, "read_manifest", a_save_lands_after_the_manifest)
    with ReplayBuffer.load(path, mmap=mmap) as loaded:
        assert saves and loaded.counters["games"] == filled.counters["games"]
        assert len(loaded) == len(filled)


def test_a_snapshot_replaced_by_every_read_says_so(filled, tmp_path, monkeypatch):
    from mpper.replay import snapshot

    path = tmp_path / "snap"
    filled.save(path)
    read_manifest = snapshot.read_manifest
    rng = np.random.default_rng(10)

    def a_save_lands_after_every_manifest(where):
        manifest = read_manifest(where)
        filled.add_episode(make_episode(rng, 30))
        filled.save(path)
        return manifest

    monkeypatch.setattr(snapshot, "read_manifest", a_save_lands_after_every_manifest)
    with pytest.raises(SnapshotError, match=r"replaced by a new save 4 times while it was read .*; try again$"):
        ReplayBuffer.load(path)


def test_a_corrupt_snapshot_that_stays_in_place_is_still_corrupt(filled, tmp_path):
    path = tmp_path / "snap"
    filled.save(path)
    data = bytearray((path / "field.reward.npy").read_bytes())
    data[-1] ^= 0xFF
    (path / "field.reward.npy").write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=r"field.reward.npy: sha256 checksum mismatch \(file corrupted or edited\)"):
        ReplayBuffer.load(path)
