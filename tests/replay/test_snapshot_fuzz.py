"""Snapshots from someone else: randomly corrupted copies of a real snapshot, with every
checksum recomputed so that they pass it. Loading one either fails with a SnapshotError
that names a file of it, or gives a buffer whose samples are finite and in range and
that takes new episodes and saves again; never a crash, a hang or a huge allocation."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import make_episode
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mpper import ReplayBuffer, SnapshotError
from mpper.algos.muzero.targets import MuZeroTargets, muzero_schema
from mpper.replay.episode_ring import ID, ROWS
from mpper.tools.inspect_snapshot import snapshot_stats

pytestmark = pytest.mark.timeout(900)

CAPACITY = 64
NUM_ACTIONS = 3
ALLOCATION_LIMIT = 64 << 20  # bytes; a sane snapshot of 64 slots needs well under 1 MiB
ARRAYS = ["ring.npy", "episodes.npy", "info.npy", "generation.npy", "tree_leaves.npy", "counters.npy",
          "max_priority.npy", "field.action.npy", "field.reward.npy", "field.root_value.npy",
          "field.child_visits.npy", "field.reanalysed_value.npy", "field.to_play.npy"]  # fmt: skip
MANIFEST_KEYS = ["capacity", "max_episodes", "alpha", "priority_eps", "priority_clip", "initial_priority"]

SPECIAL_INTS = [0, 1, 2, -1, -7, CAPACITY - 1, CAPACITY, CAPACITY + 1, 2 * 10**8, 1 << 30, 1 << 31, 1 << 32,
                1 << 62, 10**15, 2**63 - 1, -(2**63)]  # fmt: skip
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-300, 5e-324, 1e308]
ints = st.one_of(st.sampled_from(SPECIAL_INTS), st.integers(-3, CAPACITY + 3), st.integers(-(2**63), 2**63 - 1))
floats = st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
# a slot's info as a writer packs it (position << 32 | T << 2 | terminated << 1), for any numbers
packed_infos = st.builds(lambda pos, moves, term: (pos << 32) | (moves << 2) | (term << 1),
                         st.integers(0, 70), st.integers(0, 70), st.integers(0, 1))  # fmt: skip
json_values = st.one_of(ints, floats, st.none(), st.booleans(), st.text(max_size=3), st.lists(st.integers(), max_size=2))


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    """A real snapshot that wrapped its ring: evicted episodes, holes, a truncated one, a
    reanalysed one, updated priorities."""
    path = tmp_path_factory.mktemp("fuzz") / "snapshot"
    buf = ReplayBuffer.create(muzero_schema((4,), NUM_ACTIONS), CAPACITY, alpha=0.6, priority_eps=1e-3)
    try:
        rng = np.random.default_rng(0)
        for k in range(30):
            T = int(rng.integers(1, 12))
            pr = None if k % 4 == 0 else rng.uniform(0.01, 5.0, T)
            buf.add_episode(make_episode(rng, T, num_actions=NUM_ACTIONS), priorities=pr, terminated=k % 5 != 2)
        batch = buf.sample(16, 0.4, rng=rng)
        buf.update_priorities(batch.indices, batch.generations, rng.uniform(0, 3, 16))
        ref = buf.episodes()[-1]
        buf.rewrite_rows(ref, {"reanalysed_value": np.linspace(-1, 1, ref.rows - 1)})
        res = buf._reserve(3, True)  # an episode still being written when the save starts: a hole
        buf.save(path)
        buf._ring.abandon(res)
    finally:
        buf.close()
    return path


def _recompute_checksum(snap: Path, name: str) -> None:
    manifest = json.loads((snap / "manifest.json").read_text())
    manifest["files"][name]["sha256"] = hashlib.sha256((snap / name).read_bytes()).hexdigest()
    (snap / "manifest.json").write_text(json.dumps(manifest))


def _corrupt(snap: Path, data) -> None:
    """One random edit of one file, checksum recomputed."""
    target = data.draw(st.sampled_from(ARRAYS + ["manifest.json"]), label="file")
    if target == "manifest.json":
        manifest = json.loads((snap / target).read_text())
        key = data.draw(st.sampled_from(MANIFEST_KEYS), label="key")
        manifest[key] = data.draw(json_values, label="value")
        (snap / target).write_text(json.dumps(manifest))
        return
    array = np.load(snap / target)
    flat = array.reshape(-1)
    index = data.draw(st.integers(0, flat.size - 1), label="index")
    if target == "info.npy":
        value = data.draw(st.one_of(packed_infos, ints), label="value")
    elif array.dtype.kind == "f":
        value = data.draw(floats, label="value")
    else:
        info = np.iinfo(array.dtype)
        value = data.draw(ints, label="value")
        value = min(max(value, info.min), info.max)
    with np.errstate(over="ignore"):  # 1e308 stored as float32: inf, on purpose
        flat[index] = value
    np.save(snap / target, array)
    _recompute_checksum(snap, target)


def _check_usable(buf: ReplayBuffer, snap: Path) -> None:
    """Samples finite and in range; the buffer reports, takes new episodes and saves."""
    snapshot_stats(buf)  # what --inspect prints
    if len(buf) > 0:
        targets = MuZeroTargets(num_unroll_steps=5, td_steps=30_000_000, discount=0.997, num_actions=NUM_ACTIONS,
                                stacked_observations=2)  # fmt: skip
        batch = buf.sample(32, 0.4, targets=targets, rng=np.random.default_rng(1))
        assert ((batch.indices >= 0) & (batch.indices < buf.capacity)).all()
        assert np.isfinite(batch.weights).all() and np.isfinite(batch.probabilities).all()
        for name, value in batch.data.items():
            assert np.isfinite(value).all(), name
        assert ((batch.data["actions"] >= 0) & (batch.data["actions"] < NUM_ACTIONS)).all()
    if not buf.read_only:
        rng = np.random.default_rng(2)
        for T in (5, 20, 40, 63):  # wraps the ring, evicting what the snapshot held
            assert buf.add_episode(make_episode(rng, T, num_actions=NUM_ACTIONS))
        with tempfile.TemporaryDirectory(dir=snap.parent) as again:
            buf.save(Path(again) / "snapshot")
            ReplayBuffer.load(Path(again) / "snapshot", mmap=True).close()


@pytest.mark.slow
@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "shm"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_snapshot_with_valid_checksums_is_refused_or_usable(snapshot, mmap, data):
    with tempfile.TemporaryDirectory(dir=snapshot.parent) as work:
        snap = Path(work) / "snapshot"
        shutil.copytree(snapshot, snap)
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            _corrupt(snap, data)
        tracemalloc.start()
        try:
            try:
                buf = ReplayBuffer.load(snap, mmap=mmap)
            except SnapshotError as exc:
                assert str(snap) in str(exc) and "\n" not in str(exc), str(exc)
                event("refused")
            else:
                event("loaded")
                with buf:
                    _check_usable(buf, snap)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < ALLOCATION_LIMIT, f"loading allocated {peak} bytes"


def test_the_uncorrupted_snapshot_loads_and_is_usable(snapshot):
    """The fuzzed snapshot itself is valid: refusals above come from the edits."""
    for mmap in (True, False):
        with ReplayBuffer.load(snapshot, mmap=mmap) as buf:
            assert len(buf) > 0 and any(not ref.terminated for ref in buf.episodes())
            _check_usable(buf, snapshot)


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "shm"])
def test_a_generation_near_the_int64_limit_is_refused(snapshot, tmp_path, mmap):
    """A slot whose generation would overflow after a few writes (the buffer would then
    save a snapshot it cannot load again) is refused at load, naming the slot."""
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    generation = np.load(snap / "generation.npy")
    slot = len(generation) - 1
    generation[slot] = 1 << 62  # even: as a published slot's may be
    np.save(snap / "generation.npy", generation)
    _recompute_checksum(snap, "generation.npy")
    with pytest.raises(SnapshotError, match=rf"generation.npy: slot {slot} has the generation {1 << 62}, "
                                            r"expected 0 <= generation < 2\^62$"):
        ReplayBuffer.load(snap, mmap=mmap)


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "shm"])
@pytest.mark.parametrize("value", [-1, 1 << 62, np.iinfo(np.int64).max])
def test_a_counter_out_of_range_is_refused(snapshot, tmp_path, mmap, value):
    """A counter that is negative, or so near the int64 limit that the next episode would
    overflow it (the buffer would then save a snapshot it cannot load again), is refused
    at load, naming the counter."""
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    counters = np.load(snap / "counters.npy")
    counters[0] = value
    np.save(snap / "counters.npy", counters)
    _recompute_checksum(snap, "counters.npy")
    with pytest.raises(SnapshotError, match=rf"counters.npy: counter 0 is {value}, expected 0 <= counter < 2\^62$"):
        ReplayBuffer.load(snap, mmap=mmap)


def test_a_huge_counter_below_the_bound_is_usable(snapshot, tmp_path):
    """Counters far beyond any real run (2^61) load, take new episodes, and the buffer's
    next snapshot loads again: the bound refuses only what could overflow."""
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    counters = np.load(snap / "counters.npy")
    counters[:] = 1 << 61
    np.save(snap / "counters.npy", counters)
    _recompute_checksum(snap, "counters.npy")
    with ReplayBuffer.load(snap, mmap=False) as buf:
        _check_usable(buf, snap)


def _edit(snapshot: Path, tmp_path: Path, name: str, edit) -> Path:
    """A copy of ``snapshot`` whose array ``name`` went through ``edit(array, episodes)``
    (``episodes``: the snapshot's EpisodeRefs, oldest first), checksum recomputed."""
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    with ReplayBuffer.load(snapshot, mmap=True) as buf:
        episodes = buf.episodes()
    array = np.load(snap / name)
    edit(array, episodes)
    np.save(snap / name, array)
    _recompute_checksum(snap, name)
    return snap


def _odd_generation(array, episodes):
    array[episodes[0].start + 1] += 1


def _one_slot_overlap(array, episodes):
    # the first of two neighbours grows by one row into the second, which shrinks by one:
    # as many positions as before, one slot claimed twice
    a, b = next((x, y) for x, y in zip(episodes, episodes[1:]) if x.start + x.rows == y.start and y.rows > 2)
    rows = {int(r[ID]): i for i, r in enumerate(array)}
    array[rows[a.episode_id], ROWS] += 1
    array[rows[b.episode_id], ROWS] -= 1


def _priority_on_a_final_row(array, episodes):
    last = episodes[-1]
    array[last.start + last.rows - 1] = 1.0  # the row after the last move: no position


def _episode_id_of_another_lap(array, episodes):
    # the row of the oldest resident episode names the episode that will reuse that row
    # one lap of the table later
    row = next(i for i, r in enumerate(array) if int(r[ID]) == episodes[0].episode_id)
    array[row, ID] += array.shape[0]


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "shm"])
@pytest.mark.parametrize("name, edit, message", [
    ("generation.npy", _odd_generation, r"generation.npy: slot \d+ of a published episode has the odd generation"),
    ("episodes.npy", _one_slot_overlap, r"episodes.npy: episode \d+ .* overlaps the next or breaks the ring order"),
    ("tree_leaves.npy", _priority_on_a_final_row, r"tree_leaves.npy: slot \d+ has priority 1.0 but holds no position"),
    ("episodes.npy", _episode_id_of_another_lap, r"episodes.npy: row \d+ holds episode id \d+, the ring says episode"),
], ids=["odd-generation", "one-slot-overlap", "priority-on-a-final-row", "episode-id-of-another-lap"])  # fmt: skip
def test_a_snapshot_that_breaks_one_bookkeeping_rule_is_refused_by_that_rule(snapshot, tmp_path, mmap, name, edit,
                                                                              message):  # fmt: skip
    """Each edit breaks exactly one invariant the ring and the sampler rely on, in a copy
    whose checksums are recomputed: the load refuses it, naming the rule it breaks (not
    merely some later symptom, and never loading it as usable)."""
    snap = _edit(snapshot, tmp_path, name, edit)
    with pytest.raises(SnapshotError, match=message):
        ReplayBuffer.load(snap, mmap=mmap)


def test_a_manifest_field_of_seventy_dimensions_is_refused_in_one_line(snapshot, tmp_path):
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    manifest = json.loads((snap / "manifest.json").read_text())
    manifest["schema"][0]["shape"] = [1] * 70
    (snap / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match=r"manifest.json: bad schema \(schema field .*: at most 16 dimensions, "
                                            r"got 70\)"):  # fmt: skip
        ReplayBuffer.load(snap, mmap=True)


# ---- classes of crafted snapshots that bench/snapshot_fuzz.py found: each was a traceback (or
# a buffer that loaded and then failed in use) before the loader refused it in one line
def _manifest_edit(snapshot: Path, tmp_path: Path, edit) -> Path:
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    manifest = json.loads((snap / "manifest.json").read_text())
    edit(manifest)
    (snap / "manifest.json").write_text(json.dumps(manifest))
    return snap


def _field(manifest: dict, name: str) -> dict:
    return next(f for f in manifest["schema"] if f["name"] == name)


def _set_entry_shape_to_a_number(m):
    m["files"]["ring.npy"]["shape"] = 4


def _set_alpha_beyond_any_float(m):
    m["alpha"] = 10**400


def _set_fill_beyond_the_dtype(m):
    _field(m, "action")["fill"] = 10**30


def _set_fill_beyond_any_float(m):
    _field(m, "reward")["fill"] = 10**400


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "shm"])
@pytest.mark.parametrize("edit, message", [
    (_set_entry_shape_to_a_number, r"manifest.json: ring.npy is listed as <i8 4, the schema needs <i8 \[4\]$"),
    (_set_alpha_beyond_any_float, r"manifest.json: alpha must be a finite number >= 0, got 1000+$"),
    (_set_fill_beyond_the_dtype, r"manifest.json: bad schema \(schema field 'action': fill 1e\+30 is not a value of int64\)$"),
    (_set_fill_beyond_any_float, r"manifest.json: bad schema \(int too large to convert to float\)$"),
], ids=["entry-shape-a-number", "alpha-10^400", "fill-beyond-int64", "fill-beyond-float"])  # fmt: skip
def test_a_manifest_value_of_the_wrong_kind_is_refused_in_one_line(snapshot, tmp_path, mmap, edit, message):
    snap = _manifest_edit(snapshot, tmp_path, edit)
    with pytest.raises(SnapshotError, match=message):
        ReplayBuffer.load(snap, mmap=mmap)


@pytest.mark.parametrize("text, message", [
    ('{"format": "mpper-replay-snapshot", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}",
     r"manifest.json: not a manifest \(JSON nested deeper than Python reads\)$"),
    ('{"format": "mpper-replay-snapshot", "capacity": ' + "9" * 5000 + "}",
     r"manifest.json: not valid JSON \(Exceeds the limit \(4300 digits\) .*\)$"),
], ids=["nested-100000-deep", "5000-digit-number"])  # fmt: skip
def test_a_manifest_that_python_cannot_read_as_json_is_refused_in_one_line(snapshot, tmp_path, text, message):
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    (snap / "manifest.json").write_text(text)
    with pytest.raises(SnapshotError, match=message) as info:
        ReplayBuffer.load(snap, mmap=True)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [">f4", "<f2"])
def test_a_field_the_kernels_cannot_read_is_refused_at_load(snapshot, tmp_path, dtype):
    """A field in another byte order, or float16, consistently in the schema, the file
    and its checksum: numba's gathers cannot read it, so the buffer could be loaded but
    never sampled. It is refused when the snapshot loads, naming the field."""
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    manifest = json.loads((snap / "manifest.json").read_text())
    _field(manifest, "observation")["dtype"] = dtype
    array = np.load(snap / "field.observation.npy").astype(dtype)
    np.save(snap / "field.observation.npy", array)
    entry = manifest["files"]["field.observation.npy"]
    entry["dtype"], entry["sha256"] = array.dtype.str, hashlib.sha256((snap / "field.observation.npy").read_bytes()).hexdigest()
    (snap / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match=r"manifest.json: bad schema \(schema field 'observation': dtype"):
        ReplayBuffer.load(snap, mmap=True)


def test_an_action_field_of_a_row_shape_is_checked_per_row(snapshot, tmp_path):
    """``action`` stored as a (2,) row per slot (schema, file and checksum agree): a
    stored action out of range is refused naming the slot, not a broadcasting error."""
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    manifest = json.loads((snap / "manifest.json").read_text())
    _field(manifest, "action")["shape"] = [2]
    with ReplayBuffer.load(snapshot, mmap=True) as buf:
        slot = buf.episodes()[0].start + 1
    actions = np.repeat(np.load(snap / "field.action.npy")[:, None], 2, axis=1)
    actions[slot, 1] = NUM_ACTIONS
    np.save(snap / "field.action.npy", actions)
    manifest["files"]["field.action.npy"]["shape"] = list(actions.shape)
    (snap / "manifest.json").write_text(json.dumps(manifest))
    _recompute_checksum(snap, "field.action.npy")
    with pytest.raises(SnapshotError, match=rf"field.action.npy: slot {slot}, in a published episode, holds an "
                                            rf"action outside \[0, {NUM_ACTIONS}\)$"):  # fmt: skip
        ReplayBuffer.load(snap, mmap=True)


# ---- declared sizes: bounded before anything is hashed or mapped
def _declare_huge_observation(snap: Path, rows: int, per_row: int) -> Path:
    """The observation field declared (per_row,) float32, consistently in the schema and
    its file entry, with a sparse file of exactly the declared size (no disk used)."""
    manifest = json.loads((snap / "manifest.json").read_text())
    _field(manifest, "observation")["shape"] = [per_row]
    manifest["files"]["field.observation.npy"] = {"sha256": "0" * 64, "shape": [rows, per_row], "dtype": "<f4"}
    (snap / "manifest.json").write_text(json.dumps(manifest))
    path = snap / "field.observation.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_2_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, per_row)})
        f.truncate(f.tell() + rows * per_row * 4)
    return path


def _refuse_to_open(monkeypatch, path: Path) -> list:
    """Fail the test if the loader opens ``path`` (to hash or map it)."""
    from mpper.replay import snapshot_checks

    opened, real = [], snapshot_checks.open_regular

    def spy(p):
        opened.append(p)
        assert Path(p) != path, f"{path} was opened: hashed or mapped before its declared size was checked"
        return real(p)

    monkeypatch.setattr(snapshot_checks, "open_regular", spy)
    return opened


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "shm"])
def test_a_sparse_file_larger_than_its_file_system_is_refused_before_it_is_read(snapshot, tmp_path, monkeypatch,
                                                                                 mmap):  # fmt: skip
    """A manifest that declares a field larger than the file system holding it, with a
    sparse file of exactly that size (consistent with the manifest, so the size check of
    each file passes): refused on the declared size, before the file is opened, where
    hashing it whole would read every byte of its holes."""
    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    fs = os.statvfs(snap)
    per_row = fs.f_blocks * fs.f_frsize // (CAPACITY * 4) + 1
    path = _declare_huge_observation(snap, CAPACITY, per_row)
    assert path.stat().st_blocks * 512 < 1 << 20  # sparse: the test costs no disk
    opened = _refuse_to_open(monkeypatch, path)
    with pytest.raises(SnapshotError, match=r"manifest.json: its sizes declare .* of arrays, more than the file system "
                                            r"holding the snapshot can store .*: files that size can only be sparse, "
                                            r"not data \(refused before reading them\)$"):  # fmt: skip
        ReplayBuffer.load(snap, mmap=mmap)
    assert [Path(p).name for p in opened] == ["manifest.json"]  # read; no array file opened


def test_a_sparse_buffer_larger_than_shared_memory_is_refused_before_it_is_read(snapshot, tmp_path, monkeypatch):
    """A load into shared memory of a buffer larger than the room in /dev/shm (its sparse
    file consistent with the manifest) is refused before any file is hashed; where the
    file system is smaller than that, its own bound refuses it first."""
    from mpper.shm import SHM_DIR, free_bytes

    snap = shutil.copytree(snapshot, tmp_path / "snapshot")
    per_row = (free_bytes(SHM_DIR) + (1 << 30)) // (CAPACITY * 4)
    path = _declare_huge_observation(snap, CAPACITY, per_row)
    opened = _refuse_to_open(monkeypatch, path)
    with pytest.raises(SnapshotError, match=r"manifest.json: (the buffer it declares needs .* of shared memory, "
                                            r"/dev/shm has .* free|its sizes declare .* more than the file system)"):  # fmt: skip
        ReplayBuffer.load(snap, mmap=False)
    assert [Path(p).name for p in opened] == ["manifest.json"]  # read; no array file opened


@pytest.fixture(scope="module")
def dqn_run(tmp_path_factory) -> Path:
    """A real DQN run directory on CartPole (config.json, checkpoint.pt, buffer/), short."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path_factory.mktemp("dqn") / "run"
    args = [sys.executable, str(root / "run.py"), "--config", "cartpole_dqn", "--workers", "0", "--run-dir", str(run_dir)]
    for setting in ("replay.capacity=256", "env.max_episode_steps=60", "training.min_buffer_steps=64",
                    "training.batch_size=32", "training.env_steps=300", "runtime.time_limit_s=120"):  # fmt: skip
        args += ["--set", setting]
    proc = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_on_snapshot_refuses_a_dqn_action_outside_the_envs_actions(dqn_run, tmp_path, capsys):
    """A DQN schema has no child_visits to bound its actions: ``--on-snapshot`` checks
    them against the run's env, so a stored action of 2^40 is one line and exit code 2,
    not an index error inside the network's gather."""
    from mpper.cli import main

    snap = shutil.copytree(dqn_run / "buffer", tmp_path / "snapshot")
    with ReplayBuffer.load(snap, mmap=True) as buf:
        slot = buf.episodes()[0].start + 1
    actions = np.load(snap / "field.action.npy")
    actions[slot] = 1 << 40
    np.save(snap / "field.action.npy", actions)
    _recompute_checksum(snap, "field.action.npy")
    assert main(["--evaluate", str(dqn_run), "--on-snapshot", str(snap)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {snap}/field.action.npy: slot {slot}, in a published episode, holds an action outside [0, 2)"
