"""bench/atari100k.py --quick on the CPU: the Atari 100k check's smoke test, one seed of
Pong from the shipped config at a few hundred agent steps, into its JSON and table. Its
run is also the suite's short Atari 100k run: a tiny network, one self-play worker process,
trained on the stored 96 x 96 RGB frames, stopped cleanly at its last training step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpper import ReplayBuffer
from mpper.algos.configs import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_runs_a_seed_to_its_final_evaluation(tmp_path):
    out = tmp_path / "atari100k"
    proc = subprocess.run([sys.executable, "bench/atari100k.py", "--quick", "--games", "pong", "--seeds", "0",
                           "--workers", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=580)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads((out / "atari100k.json").read_text())["rows"]
    assert row["exit"] == 0 and "note" not in row, row
    assert row["command"].startswith("python run.py --config configs/atari100k_pong.json --seed 0 --workers 1 "
                                     "--device cpu --time-limit 120 ")  # fmt: skip
    assert row["training_steps"] == 40 and row["agent_steps"] >= 128  # --quick's budget, past min_buffer_steps
    assert len(row["final_returns"]) == 2 and row["final_mean"] == pytest.approx(sum(row["final_returns"]) / 2)
    assert row["training_steps_per_s"] > 0 and row["training_wall_s"] <= row["wall_s"]
    table = (out / "atari100k.md").read_text()
    assert "| pong | 0 | " in table and "pong: median final mean" in table
    # the run itself: the protocol's training-only env settings, and the frames it stored and trained on
    run_dir = out / "pong-seed0"
    config = load_config(run_dir / "config.json")
    assert config.env.episodic_life and config.env.clip_rewards and config.env.preprocessing_kwargs["screen_size"] == 96
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["learner"].get("training_step", 0) for r in records if "learner" in r) == 40
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        observation = snap.fields["observation"]
        assert observation.dtype == np.uint8 and observation.shape[1:] == (3, 96, 96)
        assert snap.counters["steps"] >= 128  # past min_buffer_steps
