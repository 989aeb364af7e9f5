"""docs/replay_api.md's snapshot example (the README links to it) runs, as written, in a
fresh Python process against a snapshot made here, and prints what that snapshot holds: it
cannot go stale."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import make_episode

from mpper import ReplayBuffer
from mpper.algos.muzero.targets import muzero_schema

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Reading a snapshot in Python"


PAGE = ROOT / "docs" / "replay_api.md"


def snapshot_example() -> str:
    """The first ```python block under the snapshot heading of docs/replay_api.md."""
    text = PAGE.read_text()
    assert HEADING in text, f"{PAGE} has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert match, f"no ```python block under {HEADING!r}"
    return match.group(1)


@pytest.mark.timeout(120)
def test_the_snapshot_example_runs_and_reports_the_snapshot(tmp_path):
    code = snapshot_example()
    path = re.search(r'load_snapshot\("([^"]+)"\)', code).group(1)  # where the example looks
    # three CartPole-like episodes: 10, 20 and 30 moves of reward 1, priorities 1, 2 and 4
    buf = ReplayBuffer.create(muzero_schema((4,), 2), 1000, alpha=1.0, priority_eps=0.0)
    try:
        rng = np.random.default_rng(0)
        for moves, priority in ((10, 1.0), (20, 2.0), (30, 4.0)):
            ep = make_episode(rng, moves)
            ep["reward"] = np.r_[0.0, np.ones(moves)].astype(np.float32)
            buf.add_episode(ep, priorities=np.full(moves, priority))
        buf.rewrite_rows(buf.episodes()[0], {"reanalysed_value": np.zeros(10)})
        buf.save(tmp_path / path)
    finally:
        buf.close()
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=100, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "positions=60" in out and "- 3 games played" in out
    assert "3 episodes: return mean 20.0, max 30.0; length median 20" in out
    mass = 10 * 1 + 20 * 2 + 30 * 4  # alpha 1, no eps: P(i) = priority / 170
    assert f"the top 1 % of positions hold {4 / mass:.1%} of the sampling mass" in out
    ess = round(mass**2 / (10 * 1 + 20 * 4 + 30 * 16))  # Kish: (sum p)^2 / sum p^2
    assert f"effective sample size {ess} of 60 positions; reanalysed 17%" in out
    assert "value targets at k = 0:" in out
