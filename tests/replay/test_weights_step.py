"""MuZero's ``weights_step`` row field (the off-policy correction's T_st) through the ring
and buffer snapshots, and an older snapshot without it, which a resumed run loads with
the field at its fill value 0 (the schema's ``optional`` fields)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_episode

from mpper import ReplayBuffer
from mpper.algos.muzero.targets import WEIGHTS_STEP, muzero_schema
from mpper.replay.schema import Schema, normalize_schema
from mpper.tools.evaluate_snapshot import SnapshotMismatchError, check_schema

# Written by mpper before rows stored their weights step (observations (2,), 2 actions).
OLD_SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "snapshot_v1_counters"


def stored_steps(buf: ReplayBuffer) -> dict[int, np.ndarray]:
    return {ref.episode_id: buf.read_episode(ref, [WEIGHTS_STEP])[WEIGHTS_STEP] for ref in buf.episodes()}


@pytest.mark.parametrize("mmap", [False, True])
def test_weights_step_round_trips_through_the_ring_and_a_snapshot(tmp_path, mmap):
    rng = np.random.default_rng(0)
    written = {}
    with ReplayBuffer.create(muzero_schema((4,), 2), capacity=64, alpha=0.6) as buf:
        for episode_id in range(12):  # 12 episodes of 5-12 rows through 64 slots: the ring wraps
            ep = make_episode(rng, int(rng.integers(4, 12)))
            ep[WEIGHTS_STEP] = np.sort(rng.integers(0, 1 << 40, len(ep["action"])))
            assert buf.add_episode(ep)
            written[episode_id] = ep[WEIGHTS_STEP]
        live = stored_steps(buf)
        assert 0 < len(live) < len(written)  # some were evicted
        for episode_id, steps in live.items():
            np.testing.assert_array_equal(steps, written[episode_id])
        buf.save(tmp_path / "snap")
    manifest = json.loads((tmp_path / "snap" / "manifest.json").read_text())
    assert {"name": WEIGHTS_STEP, "shape": [], "dtype": "<i8", "fill": 0.0} in manifest["schema"]
    with ReplayBuffer.load(tmp_path / "snap", mmap=mmap) as loaded:
        assert loaded.fields[WEIGHTS_STEP].dtype == np.int64
        restored = stored_steps(loaded)
    assert restored.keys() == live.keys()
    for episode_id, steps in restored.items():
        np.testing.assert_array_equal(steps, written[episode_id])


def test_a_snapshot_without_weights_step_loads_it_as_zero_and_stores_it_from_then_on(tmp_path):
    schema = muzero_schema((2,), 2)
    assert schema.optional == (WEIGHTS_STEP,)
    optional = {name: schema[name] for name in schema.optional}
    with ReplayBuffer.load(OLD_SNAPSHOT, mmap=True) as old:
        assert WEIGHTS_STEP not in old.fields
        # what --resume and --on-snapshot check: the snapshot may lack the optional field, not others
        check_schema(OLD_SNAPSHOT, tmp_path, old.schema, normalize_schema(schema), schema.optional)
        with pytest.raises(SnapshotMismatchError, match="fields the snapshot lacks: weights_step$"):
            check_schema(OLD_SNAPSHOT, tmp_path, old.schema, normalize_schema(schema))
        with pytest.raises(SnapshotMismatchError, match="fields the snapshot lacks: other$"):
            check_schema(OLD_SNAPSHOT, tmp_path, old.schema, normalize_schema({**schema, "other": ((), "float32")}),
                         schema.optional)  # fmt: skip
        before = {name: np.array(old.fields[name]) for name in old.fields}
    with ReplayBuffer.load(OLD_SNAPSHOT) as without:  # a new episode's weights step has nowhere to go
        with pytest.raises(ValueError, match="unknown field"):
            without.add_episode({"observation": np.zeros((3, 2), np.float32), WEIGHTS_STEP: np.zeros(3, np.int64)})
    for mmap in (True, False):
        with ReplayBuffer.load(OLD_SNAPSHOT, mmap=mmap, add_fields=optional) as resumed:
            assert resumed.fields[WEIGHTS_STEP].dtype == np.int64
            assert (resumed.fields[WEIGHTS_STEP] == 0).all()
            for name, values in before.items():  # everything else as stored
                np.testing.assert_array_equal(resumed.fields[name], values, err_msg=name)
            assert resumed.check_consistency() == []
    with ReplayBuffer.load(OLD_SNAPSHOT, add_fields=optional) as resumed:
        old_ids = set(stored_steps(resumed))
        ep = make_episode(np.random.default_rng(1), 3, obs_shape=(2,))
        ep[WEIGHTS_STEP] = np.array([40, 41, 42, 42])
        assert resumed.add_episode(ep)
        resumed.save(tmp_path / "again")
    with ReplayBuffer.load(tmp_path / "again") as again:
        steps = stored_steps(again)
    (new_id,) = set(steps) - old_ids
    np.testing.assert_array_equal(steps[new_id], [40, 41, 42, 42])
    assert all((steps[i] == 0).all() for i in set(steps) & old_ids)


def test_optional_names_fields_of_the_schema():
    assert Schema({"a": ((), "int64")}, optional=("a",)).optional == ("a",)
    with pytest.raises(ValueError, match=r"optional fields \['b'\] are not fields of the schema"):
        Schema({"a": ((), "int64")}, optional=("b",))
