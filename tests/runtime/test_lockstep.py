"""Lockstep runs (``runtime.lockstep``): the same config and seed give the same run at any
worker count. CartPole MuZero, CartPole DQN and TicTacToe MuZero, each at ``--workers``
0, 1, 2 and 8: every training step's losses in ``metrics.jsonl``, the self-play episodes
in ``episodes.jsonl`` (which stream, return, length, weights version, in order), the
evaluations by training step, and the final weights in ``checkpoint.pt`` (hashed) must be
equal, while the process layout differs (none, one, two or eight stream hosts).

A control shows the comparison can fail: another seed changes the losses and weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mpper import cli

ROOT = Path(__file__).resolve().parents[2]
WORKERS = (0, 1, 2, 8)
COMMON = [
    "runtime.lockstep=true", "runtime.lockstep_streams=8", "runtime.lockstep_moves=2",
    "runtime.evaluation_interval_steps=10", "runtime.evaluation_episodes=2", "runtime.envs_per_worker=2",
    "training.training_steps=24", "training.min_buffer_steps=64", "training.batch_size=16",
    "training.publish_interval=4", "training.samples_per_insert=1", "replay.capacity=4000",
    "env.max_episode_steps=60",
]  # fmt: skip
CONFIGS = {
    "cartpole": ["mcts.num_simulations=4", "runtime.solve_return=null"],
    "cartpole_dqn": ["runtime.solve_return=null"],
    "tictactoe": ["mcts.num_simulations=4", "runtime.solve_return=null", "env.max_episode_steps=null"],
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(config: str, workers: int, run_dir: Path, seed: int = 0) -> dict:
    sets = [*COMMON, *CONFIGS[config], f"runtime.seed={seed}"]
    rc = cli.main(["--config", str(ROOT / "configs" / f"{config}.json"), "--workers", str(workers), "--device", "cpu",
                   "--run-dir", str(run_dir), *(x for kv in sets for x in ("--set", kv))])  # fmt: skip
    assert rc == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    digest = hashlib.sha256()
    for name, tensor in sorted(state["network"].items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    return {
        "losses": [r for r in records if r["event"] == "train_step"],
        "evaluations": [(r["evaluation"]["training_step"], r["evaluation"].get("mean_return"),
                         r["evaluation"].get("returns")) for r in records if r["event"] == "evaluation"],  # fmt: skip
        "episodes": [(e["worker"], e["return"], e["length"], e["weights_version"]) for e in episodes],
        "training_step": state["training_step"],
        "weights": digest.hexdigest(),
    }


_RUNS: dict[str, dict] = {}


def _runs(config: str, tmp_path_factory) -> dict[int, dict]:
    """The config's runs at each worker count (made once per test session)."""
    if config not in _RUNS:
        folder = tmp_path_factory.mktemp(config)
        _RUNS[config] = {w: _run(config, w, folder / f"workers{w}") for w in WORKERS}
    return _RUNS[config]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_same_run_at_any_worker_count(config, tmp_path_factory):
    by_workers = _runs(config, tmp_path_factory)
    reference = by_workers[0]
    assert reference["training_step"] == 24
    assert [r["training_step"] for r in reference["losses"]] == list(range(1, 25))
    assert all(r["total_loss"] > 0 for r in reference["losses"])
    steps = [e[0] for e in reference["evaluations"]]
    assert len(steps) == 2 and 0 < steps[0] < steps[1] <= 24  # every 10 training steps, by the published weights
    assert len({e[0] for e in reference["episodes"]}) == 8  # every stream played and stored episodes
    for workers in WORKERS[1:]:
        run = by_workers[workers]
        assert run["losses"] == reference["losses"], f"{config}: losses at --workers {workers} differ from 0"
        assert run["episodes"] == reference["episodes"], f"{config}: episodes at --workers {workers} differ"
        assert run["evaluations"] == reference["evaluations"], f"{config}: evaluations at --workers {workers}"
        assert run["weights"] == reference["weights"], f"{config}: final weights at --workers {workers} differ"


def test_another_seed_gives_another_run(tmp_path_factory, tmp_path):
    reference = _runs("cartpole", tmp_path_factory)[0]
    other = _run("cartpole", 2, tmp_path / "seed1", seed=1)
    assert other["losses"] != reference["losses"]
    assert other["weights"] != reference["weights"]


# one round stores hundreds of steps at once: the rate then allows the whole run in one learning turn
BURST = [
    "runtime.lockstep=true", "runtime.lockstep_streams=2", "runtime.lockstep_moves=40", "runtime.envs_per_worker=4",
    "runtime.evaluation_interval_steps=20", "runtime.evaluation_episodes=2", "training.training_steps=120",
    "training.min_buffer_steps=64", "training.batch_size=16", "training.samples_per_insert=32",
    "training.publish_interval=4", "replay.capacity=4000", "env.max_episode_steps=60", "mcts.num_simulations=2",
]  # fmt: skip


@pytest.mark.parametrize("solve_return", [None, 0.0])
def test_evaluations_keep_their_interval_inside_a_long_learning_turn(solve_return, tmp_path):
    """Each evaluation comes at its multiple of ``evaluation_interval_steps`` even when one
    learning turn takes every training step of the run; and a run whose evaluation solves
    (``solve_return`` 0: any return) stops at that evaluation's step, not at the turn's end."""
    run_dir = tmp_path / "run"
    sets = [*BURST, f"runtime.solve_return={'null' if solve_return is None else solve_return}"]
    rc = cli.main(["--config", str(ROOT / "configs" / "cartpole.json"), "--workers", "0", "--device", "cpu",
                   "--run-dir", str(run_dir), *(x for kv in sets for x in ("--set", kv))])  # fmt: skip
    assert rc == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["evaluation"]["training_step"] for r in records if r["event"] == "evaluation"]
    stepped = [r["training_step"] for r in records if r["event"] == "train_step"]
    final = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)["training_step"]
    if solve_return is None:
        assert evaluated == [20, 40, 60, 80, 100, 120] and stepped == list(range(1, 121)) and final == 120
    else:
        assert evaluated == [20] and stepped == list(range(1, 21)) and final == 20


def test_a_stream_host_that_dies_stops_the_run_with_its_files(tmp_path):
    """SIGKILL of one of two stream hosts mid-run: a lockstep run cannot play its schedule
    without it, so the run stops with exit 1 and one line naming the host, after writing
    its final checkpoint and snapshot; the other host exits too (the conftest guard checks
    that no shared-memory segment is left)."""
    run_dir = tmp_path / "run"
    sets = [*COMMON, *CONFIGS["cartpole"], "training.training_steps=100000"]
    cmd = [sys.executable, str(ROOT / "run.py"), "--config", str(ROOT / "configs" / "cartpole.json"), "--workers", "2",
           "--device", "cpu", "--run-dir", str(run_dir), *(x for kv in sets for x in ("--set", kv))]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # generous: only a hang gets near it
        while not _trained(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        pids = json.loads((run_dir / "processes.json").read_text())
        os.kill(pids["host-1"], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    assert "mpper: run stopped: lockstep stream host host-1 (killed by signal 9) ended mid-round" in err
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["training_step"] > 0
    assert (run_dir / "buffer" / "manifest.json").exists()
    assert not _alive(pids["host-0"]) and not _alive(pids["supervisor"])


def _trained(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and '"event": "train_step"' in path.read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
