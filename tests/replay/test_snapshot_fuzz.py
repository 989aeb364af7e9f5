"""Snapshots from someone else: randomly corrupted copies of a real snapshot, with every
checksum recomputed so that they pass it. Loading one either fails with a SnapshotError
that names a file of it, or gives a buffer whose samples are finite and in range and
that takes new episodes and saves again; never a crash, a hang or a huge allocation."""

from __future__ import annotations

import hashlib
import json
import math
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
