"""Runs on MinAtar Breakout, end to end (``python run.py --workers 0``, a few training
steps): both algorithms store the bool planes as they came, one byte per value; MuZero
with Gumbel search and the consistency loss, DQN with MinAtar's conv network and frame
stacking.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mpper import ReplayBuffer
from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of

ROOT = Path(__file__).resolve().parents[1]
MINATAR = ["--set", "env.id=MinAtar/Breakout-v1", "--set", "env.preprocessing=channels_first"]
SMALL = ["--set", "training.min_buffer_steps=100", "--set", "training.batch_size=16", "--set",
         "runtime.envs_per_worker=2", "--set", "training.samples_per_insert=4",
         "--set", "runtime.evaluation_episodes=2", "--set", "runtime.evaluation_interval_s=1"]  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def run(tmp_path: Path, config: str, *extra: str) -> tuple[Path, list[dict]]:
    run_dir = tmp_path / "run"
    args = [sys.executable, "run.py", "--config", config, "--workers", "0", "--device", "cpu", "--run-dir",
            str(run_dir), "--max-train-steps", "12", *MINATAR, *SMALL, *extra]  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["learner"]["training_step"] == 12
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        observation = snap.fields["observation"]
        assert observation.dtype == np.bool_ and observation.shape[1:] == (4, 10, 10)
        assert snap.counters["steps"] >= 100 and observation[: snap.counters["positions"]].any()
    # the checkpoint loads into the network the run's config builds
    config = load_config(run_dir / "config.json")
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    algorithm_of(config).make_network(config, (4, 10, 10), 3).load_state_dict(checkpoint["network"])  # strict
    return run_dir, records


def test_muzero_on_minatar_with_gumbel_search_and_the_consistency_loss(tmp_path):
    run_dir, records = run(tmp_path, "configs/cartpole.json", "--set", "mcts.kind=gumbel", "--set",
                           "mcts.num_simulations=4", "--set", "muzero.consistency_loss_weight=2", "--set",
                           "network.projection_size=16")  # fmt: skip
    unroll = load_config(run_dir / "config.json").muzero.num_unroll_steps
    learner = [r["learner"] for r in records if "total_loss" in r.get("learner", {})]
    # a sum over K steps of negative cosines in [-1, 1], importance weights <= 1
    assert learner and all(-unroll <= r["consistency_loss"] <= unroll for r in learner)
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        rows = snap.fields["child_visits"][: snap.counters["positions"]]
        stored = rows[rows.sum(1) > 0]  # row T of each episode holds no policy
        np.testing.assert_allclose(stored.sum(1), 1.0, rtol=1e-5)
        # Gumbel's improved policy, not a visit share of 4 simulations (multiples of 1/4)
        assert (np.abs(stored * 4 - np.round(stored * 4)) > 1e-3).any()


def test_dqn_on_minatar_with_the_conv_network_and_frame_stacks(tmp_path):
    run_dir, records = run(tmp_path, "configs/cartpole_dqn.json", "--set", "dqn.torso=minatar", "--set",
                           "dqn.hidden=[32]", "--set", "dqn.frame_stack=2")  # fmt: skip
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["network"]["torso.0.weight"].shape == (16, 8, 3, 3)  # 2 stacked frames of 4 planes
