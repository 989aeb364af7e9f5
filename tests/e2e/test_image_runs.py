"""Runs of the shipped image configs, end to end (``python run.py --workers 0``, a few
training steps, small batches): on MinAtar Breakout both algorithms store the bool planes
as they came, one byte per value (MuZero with Gumbel search and the consistency loss, DQN
with MinAtar's conv network, here with frame stacking); on Atari Pong MuZero stores the
84 x 84 uint8 frames once and trains its downsampling network on stacked ones.
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

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "training.min_buffer_steps=100", "--set", "training.batch_size=16", "--set",
         "runtime.envs_per_worker=2", "--set", "training.samples_per_insert=4",
         "--set", "runtime.evaluation_episodes=2", "--set", "runtime.evaluation_interval_s=1"]  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def run(tmp_path: Path, config: str, *extra: str, frame=((4, 10, 10), np.bool_), num_actions=3,
        steps=12) -> tuple[Path, list[dict]]:  # fmt: skip
    run_dir = tmp_path / "run"
    args = [sys.executable, "run.py", "--config", config, "--workers", "0", "--device", "cpu", "--run-dir",
            str(run_dir), "--max-train-steps", str(steps), *SMALL, *extra]  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["learner"]["training_step"] == steps
    shape, dtype = frame
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        observation = snap.fields["observation"]
        assert observation.dtype == dtype and observation.shape[1:] == shape
        assert snap.counters["steps"] >= 100 and observation[: snap.counters["positions"]].any()
    # the checkpoint loads into the network the run's config builds
    config = load_config(run_dir / "config.json")
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    algorithm_of(config).make_network(config, shape, num_actions).load_state_dict(checkpoint["network"])  # strict
    return run_dir, records


def test_muzero_on_minatar_with_gumbel_search_and_the_consistency_loss(tmp_path):
    run_dir, records = run(tmp_path, "configs/minatar_breakout.json", "--set", "mcts.num_simulations=4",
                           "--set", "network.projection_size=16")  # fmt: skip
    config = load_config(run_dir / "config.json")
    assert config.mcts.kind == "gumbel" and config.muzero.consistency_loss_weight > 0
    unroll = config.muzero.num_unroll_steps
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
    run_dir, records = run(tmp_path, "configs/minatar_breakout_dqn.json", "--set", "dqn.hidden=[32]",
                           "--set", "dqn.frame_stack=2")  # fmt: skip
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["network"]["torso.0.weight"].shape == (16, 8, 3, 3)  # 2 stacked frames of 4 planes


def test_muzero_on_atari_pong_stores_frames_once_and_trains_on_stacks(tmp_path):
    """configs/atari_pong.json with its downsampling network and 4 stacked frames; episodes
    cut at 200 emulator frames, 50 moves (a Pong game lasts thousands), a small ring, no
    evaluation (each would play two more episodes with the conv network)."""
    run_dir, _ = run(tmp_path, "configs/atari_pong.json", "--set", "mcts.num_simulations=2", "--set",
                     "env.max_episode_steps=200", "--set", "replay.capacity=2000", "--set", "network.projection_size=16",
                     "--set", "runtime.evaluation_interval_s=1000", frame=((1, 84, 84), np.uint8), num_actions=6,
                     steps=3)  # fmt: skip
    config = load_config(run_dir / "config.json")
    assert config.network.downsample and config.muzero.stacked_observations == 4


def test_dqn_on_atari_pong_stores_frames_once_and_trains_the_nature_cnn_on_stacks(tmp_path):
    """configs/atari_pong_dqn.json: 84 x 84 uint8 frames stored once, the Nature CNN fed
    4 stacked frames; short episodes and a small ring as above."""
    run_dir, _ = run(tmp_path, "configs/atari_pong_dqn.json", "--set", "env.max_episode_steps=200", "--set",
                     "replay.capacity=2000", "--set", "runtime.evaluation_interval_s=1000",
                     frame=((1, 84, 84), np.uint8), num_actions=6, steps=3)  # fmt: skip
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["network"]["torso.1.weight"].shape == (32, 4, 8, 8)  # 4 stacked grayscale frames
