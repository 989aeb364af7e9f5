"""Offline runs (``--offline SNAPSHOT ...``): the buffer filled from snapshots, no
self-play, the roles of a normal run; what the run records; bad snapshots refused."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from counting_env import read_log

from mpper import ReplayBuffer
from mpper.algos.dqn.targets import dqn_schema
from mpper.cli import main

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SMALL = ["--device", "cpu", "--set", "training.min_buffer_steps=64", "--set", "training.batch_size=32",
         "--set", "runtime.evaluation_episodes=2", "--set", "runtime.evaluation_interval_s=0.5",
         "--set", "runtime.solve_return=null", "--set", "runtime.log_interval_s=0.5",
         "--set", "training.publish_interval=5"]  # fmt: skip


def random_snapshot(path: Path, env: dict, episodes: int = 12, seed: int = 0, obs_shape=(4,),
                    record_env: bool = True, max_episode_steps: int = 500) -> int:  # fmt: skip
    """A snapshot of random-policy CartPole episodes in DQN's schema (``env``: the
    ``{"id", "kwargs"}`` it says it was recorded on, when ``record_env``), cut at
    ``max_episode_steps`` moves (truncated); returns its transitions."""
    rng = np.random.default_rng(seed)
    game = gym.make("CartPole-v1", max_episode_steps=max_episode_steps)
    buf = ReplayBuffer.create(dqn_schema(obs_shape), 4096)
    steps = 0
    try:
        for k in range(episodes):
            obs, _ = game.reset(seed=seed * 1000 + k)
            rows = {"observation": [obs[: obs_shape[0]]], "action": [0], "reward": [0.0]}
            terminated = truncated = False
            while not (terminated or truncated):
                action = int(rng.integers(2))
                obs, reward, terminated, truncated, _ = game.step(action)
                rows["observation"].append(obs[: obs_shape[0]])
                rows["action"].append(action)
                rows["reward"].append(float(reward))
            steps += len(rows["action"]) - 1
            buf.add_episode({"observation": np.stack(rows["observation"]).astype(np.float32),
                             "action": np.array(rows["action"], np.int64),
                             "reward": np.array(rows["reward"], np.float32)}, terminated=terminated)  # fmt: skip
        extra = {"config": {"env": env}} if record_env else {}
        buf.save(path, extra=extra)
    finally:
        buf.close()
        game.close()
    return steps


def counting_env(log: Path) -> dict:
    return {"id": "counting_env:make", "kwargs": {"log": str(log), "max_episode_steps": 60}}


def env_args(env: dict) -> list[str]:
    return ["--set", f"env.id={env['id']}", "--set", f"env.kwargs={json.dumps(env['kwargs'])}"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)  # fmt: skip


SELFPLAY_MAKERS = {"run_selfplay", "SelfPlay", "_streams", "play_streams", "run_stream_host"}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_offline_dqn_run_takes_no_env_step_and_writes_what_a_run_writes(tmp_path, workers):
    log = tmp_path / "steps.log"
    env = counting_env(log)
    data = tmp_path / "data"
    steps = random_snapshot(data, env)
    run_dir = tmp_path / "run"
    proc = run_cli(["--config", "cartpole_dqn", "--workers", str(workers), "--run-dir", str(run_dir),
                    "--offline", str(data), "--max-train-steps", "120", *SMALL, *env_args(env)])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "training finished (120 steps)" in proc.stdout
    # the snapshot it learned from, by checksum
    offline = json.loads((run_dir / "offline.json").read_text())
    manifest_sha = hashlib.sha256((data / "manifest.json").read_bytes()).hexdigest()
    assert offline["snapshots"] == [{"path": str(data.resolve()), "manifest_sha256": manifest_sha, "episodes": 12,
                                     "steps": steps, "env": env}]  # fmt: skip
    assert offline["steps"] == steps
    # no env step by the training side: counted by the envs themselves
    envs = read_log(log)
    assert not [e for e in envs.values() if SELFPLAY_MAKERS & set(e["makers"])]
    evaluating = [e for e in envs.values() if {"evaluate", "Evaluation", "run_evaluator"} & set(e["makers"])]
    assert sum(e["steps"] for e in evaluating) > 0
    assert sum(e["steps"] for e in envs.values() if e not in evaluating) == 0
    # ... and by the run's own counts: the buffer holds the snapshot's steps, and nothing more
    written = records(run_dir)
    assert written and all(r["selfplay_env_steps"] == 0 and r["dataset_env_steps"] == steps for r in written)
    assert written[-1]["event"] == "end" and written[-1]["env_steps"] == steps
    assert written[-1]["learner"]["training_step"] == 120
    assert any(r["event"] == "evaluation" for r in written)
    assert (run_dir / "episodes.jsonl").read_text() == ""
    assert (run_dir / "best.pt").is_file()
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["training_step"] == 120
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as saved:
        assert saved.counters["steps"] == steps and saved.counters["priority_updates_applied"] > 0
    if workers:
        assert set(json.loads((run_dir / "processes.json").read_text())) == {"supervisor", "learner", "evaluator"}
    assert_training_clock(written, in_turns=workers == 0)


def assert_training_clock(written: list[dict], in_turns: bool) -> None:
    """A run in turns gives each evaluation the seconds it trained for its weights, its
    evaluations left out (``training_s``): growing with the step, while the rest of the
    run's clock (start-up, evaluations) grows by each evaluation's own time (a clock that
    counted the evaluations would keep that rest constant). Processes evaluate beside the
    learner: no such figure."""
    evaluations = [r for r in written if r["event"] == "evaluation"]
    if not in_turns:
        assert not any("training_s" in r["evaluation"] for r in evaluations)
        return
    clocks = [r["evaluation"]["training_s"] for r in evaluations]
    assert clocks and clocks[0] >= 0 and clocks == sorted(clocks)
    rest = [r["time_s"] - r["evaluation"]["training_s"] for r in evaluations]
    # strictly: an evaluation takes milliseconds at least, more than the rounding to 1 ms of both clocks
    assert all(later > earlier for earlier, later in zip(rest, rest[1:])), rest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_offline_lockstep_run_evaluates_every_n_steps_with_its_training_clock(tmp_path):
    """``runtime.lockstep`` in an offline run: evaluations at every
    ``runtime.evaluation_interval_steps`` training steps exactly (bench/offline.py times
    CQL so, as d3rlpy's loop evaluates), each with its training clock."""
    env = {"id": "CartPole-v1", "kwargs": {}}
    data = tmp_path / "data"
    random_snapshot(data, env)
    run_dir = tmp_path / "run"
    proc = run_cli(["--config", "cartpole_cql", "--workers", "0", "--run-dir", str(run_dir), "--offline", str(data),
                    "--max-train-steps", "120", *SMALL, "--set", "runtime.lockstep=true",
                    "--set", "runtime.evaluation_interval_steps=40"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    written = records(run_dir)
    assert [r["evaluation"]["training_step"] for r in written if r["event"] == "evaluation"] == [40, 80, 120]
    assert_training_clock(written, in_turns=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_offline_muzero_run_combines_snapshots_and_searches_every_reanalysed_episode(tmp_path):
    env = {"id": "CartPole-v1", "kwargs": {}}
    first, second = tmp_path / "a", tmp_path / "b"
    steps = random_snapshot(first, env, episodes=8, seed=1) + random_snapshot(second, env, episodes=8, seed=2)
    run_dir = tmp_path / "run"
    proc = run_cli(["--config", "cartpole", "--workers", "0", "--run-dir", str(run_dir), "--offline", str(first),
                    str(second), "--max-train-steps", "40", *SMALL, "--set", "mcts.num_simulations=4",
                    "--set", "muzero.num_unroll_steps=3", "--set", "muzero.td_steps=10"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    offline = json.loads((run_dir / "offline.json").read_text())
    assert [s["path"] for s in offline["snapshots"]] == [str(first.resolve()), str(second.resolve())]
    assert offline["episodes"] == 16 and offline["steps"] == steps
    config = json.loads((run_dir / "config.json").read_text())
    assert config["reanalyse"]["enabled"] and config["reanalyse"]["search_fraction"] == 1.0
    assert config["training"]["samples_per_insert"] is None
    end = records(run_dir)[-1]
    assert end["selfplay_env_steps"] == 0 and end["env_steps"] == steps
    reanalysed = end["reanalyse"]
    assert reanalysed["episodes"] > 0 and reanalysed["searched_episodes"] == reanalysed["episodes"]
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as saved:
        searched = [r for r in saved.episodes() if not np.isnan(saved.fields["reanalysed_policy"][r.start]).any()]
        assert searched  # policy targets of a new search (a DQN snapshot has none of its own)
        ref = searched[0]
        assert np.isfinite(saved.fields["reanalysed_value"][ref.start : ref.start + ref.rows]).all()
        policy = saved.fields["reanalysed_policy"][ref.start : ref.start + ref.rows - 1]
        np.testing.assert_allclose(policy.sum(axis=1), 1.0, rtol=1e-5)


# ---- bad input: one line, exit 2, nothing written --------------------------------------


@pytest.fixture(scope="module")
def good_snapshot(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "data"
    random_snapshot(path, {"id": "CartPole-v1", "kwargs": {}}, episodes=6)
    return path


def refused(tmp_path, capsys, *args: str) -> str:
    run_dir = tmp_path / "run"
    code = main(["--config", "cartpole_dqn", "--workers", "0", "--run-dir", str(run_dir), *SMALL, *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert not run_dir.exists()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def copy_of(snapshot: Path, where: Path) -> Path:
    import shutil

    shutil.copytree(snapshot, where)
    return where


def test_a_missing_snapshot_is_refused(tmp_path, capsys):
    err = refused(tmp_path, capsys, "--offline", str(tmp_path / "nowhere"))
    assert "nowhere: no such snapshot directory" in err


def test_a_truncated_snapshot_is_refused(tmp_path, capsys, good_snapshot):
    bad = copy_of(good_snapshot, tmp_path / "bad")
    field = bad / "field.observation.npy"
    field.write_bytes(field.read_bytes()[:-100])
    assert "field.observation.npy" in refused(tmp_path, capsys, "--offline", str(bad))


def test_a_snapshot_with_a_changed_byte_is_refused(tmp_path, capsys, good_snapshot):
    bad = copy_of(good_snapshot, tmp_path / "bad")
    field = bad / "field.reward.npy"
    data = bytearray(field.read_bytes())
    data[-1] ^= 0xFF
    field.write_bytes(bytes(data))
    assert "sha256" in refused(tmp_path, capsys, "--offline", str(bad)).lower()


def test_a_crafted_manifest_is_refused(tmp_path, capsys, good_snapshot):
    bad = copy_of(good_snapshot, tmp_path / "bad")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["capacity"] = 2**40
    (bad / "manifest.json").write_text(json.dumps(manifest))
    assert "manifest.json" in refused(tmp_path, capsys, "--offline", str(bad))


def test_a_snapshot_of_another_env_is_refused(tmp_path, capsys):
    other = tmp_path / "other"
    random_snapshot(other, {"id": "CartPole-v0", "kwargs": {}}, episodes=3)
    err = refused(tmp_path, capsys, "--offline", str(other))
    assert 'recorded on env {"id": "CartPole-v0"' in err and '"CartPole-v1"' in err


def test_a_snapshot_of_other_shapes_is_refused(tmp_path, capsys):
    other = tmp_path / "other"
    random_snapshot(other, {}, episodes=12, obs_shape=(3,), record_env=False)
    err = refused(tmp_path, capsys, "--offline", str(other))
    assert "field 'observation' is shape (3,) float32 in the snapshot, but the run stores shape (4,) float32" in err


def test_an_empty_snapshot_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    with ReplayBuffer.create(dqn_schema((4,)), 256) as buf:
        buf.save(empty, extra={"config": {"env": {"id": "CartPole-v1", "kwargs": {}}}})
    assert "holds no transitions" in refused(tmp_path, capsys, "--offline", str(empty))


def test_the_same_snapshot_twice_is_refused(tmp_path, capsys, good_snapshot):
    err = refused(tmp_path, capsys, "--offline", str(good_snapshot), str(good_snapshot))
    assert "the same snapshot as" in err


def test_keys_an_offline_run_cannot_use_are_refused(tmp_path, capsys, good_snapshot):
    err = refused(tmp_path, capsys, "--offline", str(good_snapshot), "--set", "training.samples_per_insert=4")
    assert "training.samples_per_insert does not apply to --offline runs" in err
    err = refused(tmp_path, capsys, "--offline", str(good_snapshot), "--set", "training.min_buffer_steps=100000",
                  "--set", "replay.capacity=200000")  # fmt: skip
    assert "fewer than training.min_buffer_steps 100000" in err
    assert "--env-steps does not apply to --offline" in refused(tmp_path, capsys, "--offline", str(good_snapshot),
                                                                 "--env-steps", "100")  # fmt: skip
    assert "does not apply to --resume" in refused(tmp_path, capsys, "--resume", str(tmp_path), "--offline",
                                                    str(good_snapshot))  # fmt: skip


def test_the_python_api_takes_offline_snapshots_and_refuses_a_bad_one_in_one_line(tmp_path, good_snapshot):
    import mpper
    from mpper.launch import LaunchError

    with pytest.raises(LaunchError, match=r"^--offline \S+: no such snapshot directory$"):
        mpper.train("cartpole_dqn", workers=0, run_dir=tmp_path / "run", offline=[tmp_path / "nowhere"])
    with pytest.raises(LaunchError, match="training.env_steps does not apply to --offline runs"):
        mpper.train("cartpole_dqn", workers=0, run_dir=tmp_path / "run", offline=[good_snapshot], env_steps=500,
                    overrides={"training.min_buffer_steps": 64})  # fmt: skip
    assert not (tmp_path / "run").exists()
