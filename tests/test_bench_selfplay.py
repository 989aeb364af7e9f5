"""bench/selfplay.py, as bench/gpu.py calls it: one command, both inference paths, the
figures in its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_selfplay_bench_measures_both_paths_and_writes_its_figures(tmp_path):
    out = tmp_path / "selfplay.json"
    args = [sys.executable, "bench/selfplay.py", "--workers", "1", "--selfplay-inference", "worker", "server",
            "--seconds", "2", "--warmup", "0", "--json", str(out), "--set", "env.max_episode_steps=20",
            "--set", "mcts.num_simulations=4", "--set", "runtime.envs_per_worker=2"]  # fmt: skip
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr
    assert "| 1 | worker | cpu |" in done.stdout and "| 1 | server | cpu |" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["selfplay_inference"] for r in results] == ["worker", "server"]
    for r in results:
        assert r["moves"] > 0 and r["agent_steps_per_s"] > 0
        assert r["simulations_per_s"] == pytest.approx(4 * r["agent_steps_per_s"])
    assert results[0]["rows_per_call"] is None and 1 <= results[1]["rows_per_call"] <= 2
