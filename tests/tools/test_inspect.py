"""`python run.py --inspect SNAPSHOT_DIR` and `mpper.load_snapshot`, on snapshots made here."""

import json

import numpy as np
import pytest

from mpper import ReplayBuffer, load_snapshot
from mpper.algos.muzero.reanalyse import store_reanalysed
from mpper.algos.muzero.targets import muzero_schema
from mpper.cli import main


@pytest.fixture
def snapshot(tmp_path):
    """Three episodes with known rewards and priorities; one reanalysed, one searched again."""
    buf = ReplayBuffer.create(muzero_schema((4,), 2), 100, alpha=1.0, priority_eps=0.0)
    try:
        for moves, reward, prio in ((3, 1.0, 1.0), (5, 2.0, 2.0), (10, 0.5, 4.0)):
            buf.add_episode({"observation": np.zeros((moves + 1, 4)), "reward": np.full(moves + 1, reward)},
                            priorities=np.full(moves, prio))  # fmt: skip
        ref, searched = buf.episodes()[:2]
        store_reanalysed(buf, ref, np.ones(3))
        store_reanalysed(buf, searched, np.ones(5), np.full((5, 2), 0.5))
        buf.save(tmp_path / "snap")
    finally:
        buf.close()
    return tmp_path / "snap"


def test_inspect_json_reports_what_the_snapshot_holds(snapshot, capsys):
    assert main(["--inspect", str(snapshot), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["episodes"] == 3 and stats["positions"] == 18 and stats["capacity"] == 100
    # returns exclude row 0 (no reward arrives at the first observation)
    assert stats["episode_return"]["min"] == 3.0 and stats["episode_return"]["max"] == 10.0
    assert stats["episode_return"]["mean"] == pytest.approx((3.0 + 10.0 + 5.0) / 3)
    assert stats["episode_length"]["median"] == 5.0
    assert stats["episode_ids"] == {"oldest": 0, "newest": 2}
    leaves = np.array([1.0] * 3 + [2.0] * 5 + [4.0] * 10)
    p = stats["priorities"]
    assert (p["leaf_min"], p["leaf_max"]) == (1.0, 4.0)
    assert p["effective_sample_size"] == pytest.approx(leaves.sum() ** 2 / (leaves**2).sum())
    assert p["top_1_percent_mass_share"] == pytest.approx(4.0 / leaves.sum())  # 1 % of 18 -> 1 position
    assert stats["reanalysed_share"] == pytest.approx(8 / 18)
    assert stats["reanalysed_policy_share"] == pytest.approx(5 / 18)
    assert stats["counters"]["games"] == 3


def test_inspect_text_and_errors(snapshot, tmp_path, capsys):
    assert main(["--inspect", str(snapshot)]) == 0
    out = capsys.readouterr().out
    assert "18 sampleable positions" in out and "episodes 3" in out and "reanalysed value: 44.4%" in out
    assert "reanalysed policy (searched again): 27.8%" in out
    assert main(["--inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0] and err[0].startswith("error:")
    (snapshot / "episodes.npy").write_bytes(b"\x93NUMPY")  # corrupt: truncated
    assert main(["--inspect", str(snapshot)]) == 2
    assert "episodes.npy" in capsys.readouterr().err


def test_load_snapshot_is_read_only_and_samples_the_stored_priorities(snapshot):
    with load_snapshot(snapshot) as buf:
        assert buf.read_only
        with pytest.raises(PermissionError):
            buf.add_episode({"observation": np.zeros((2, 4))})
        batch = buf.sample(18_000, beta=1.0, rng=np.random.default_rng(0))
        counts = np.bincount(batch.indices, minlength=buf.capacity)
        # alpha 1: probability proportional to the stored priority (1, 2 or 4)
        ep = buf.episodes()
        per_position = [counts[r.start : r.start + r.rows - 1].mean() for r in ep]
        mass = 3 * 1.0 + 5 * 2.0 + 10 * 4.0
        expected = [18_000 * prio / mass for prio in (1.0, 2.0, 4.0)]
        assert per_position == pytest.approx(expected, rel=0.01)  # stratified: near exact
