"""``training.env_steps``: a run stops cleanly once the buffer has counted that many env
steps, with both schedulers (the supervisor with worker processes, and ``--workers 0``),
and says so in its last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpper import ReplayBuffer
from mpper.algos.configs import config_from_dict
from mpper.runtime.run import Run

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 600


def test_the_stop_rule_reads_the_env_step_counter(tmp_path):
    run = Run(config_from_dict({"training": {"env_steps": BUDGET}}, check_env=False), tmp_path)
    assert run.stop_reason(env_steps=BUDGET - 1) is None
    reason = f"env-step budget reached: {BUDGET} env steps stored (training.env_steps {BUDGET})"
    assert run.stop_reason(env_steps=BUDGET) == reason
    assert Run(config_from_dict({}, check_env=False), tmp_path).stop_reason(env_steps=10**9) is None


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_stops_at_its_env_step_budget(tmp_path, workers):
    """CartPole, small; a training-step budget and a time limit far beyond what the env
    steps allow, so that only the env-step budget can end the run with this line."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "run.py", "--config", "cartpole", "--device", "cpu", "--workers", str(workers),
            "--run-dir", str(run_dir), "--env-steps", str(BUDGET), "--max-train-steps", "1000000",
            "--time-limit", "360", "--set", "training.min_buffer_steps=200", "--set", "training.batch_size=16",
            "--set", "mcts.num_simulations=4", "--set", "runtime.envs_per_worker=2",
            "--set", "runtime.evaluation_interval_s=1000", "--set", "runtime.solve_return=null",
            "--set", "training.samples_per_insert=null"]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=390, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("mpper: env-step budget reached: ") and f"(training.env_steps {BUDGET})" in last, last
    stored = int(last.split("budget reached: ")[1].split()[0])
    assert stored >= BUDGET
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "end" and records[-1]["env_steps"] >= BUDGET
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snapshot:
        assert snapshot.counters["steps"] >= stored
    assert json.loads((run_dir / "config.json").read_text())["training"]["env_steps"] == BUDGET
