"""``--collect``: a dataset of a checkpoint's epsilon-greedy behaviour, as a snapshot that
``--offline``, ``--inspect`` and ``--evaluate --on-snapshot`` read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from counting_env import read_log

from mpper import ReplayBuffer
from mpper.algos.configs import config_from_dict
from mpper.algos.registry import algorithm_of
from mpper.checkpoint import save_network_checkpoint
from mpper.cli import main
from mpper.config import config_to_dict
from mpper.envs.spec import env_spec
from mpper.runtime.offline import check_sources, read_sources

TESTS = Path(__file__).resolve().parents[1]
TRUST = ["--set", "env.id=counting_env:make"]  # a run directory's config.json names no code by itself


def dqn_run_dir(path: Path, env: dict) -> Path:
    """A run directory as a DQN run leaves one: config.json and best.pt (fresh weights,
    seeded; no training needed to play them)."""
    config = config_from_dict({"algorithm": "dqn", "env": env, "dqn": {"hidden": [16]},
                               "runtime": {"envs_per_worker": 3}})  # fmt: skip
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_to_dict(config)))
    spec = env_spec(config.env)
    torch.manual_seed(3)
    network = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions)
    save_network_checkpoint(path / "best.pt", network, 17, {"mean_return": 9.0})
    return path


@pytest.fixture
def counting(tmp_path, monkeypatch):
    """The counting CartPole (tests/counting_env.py) and its log."""
    monkeypatch.syspath_prepend(str(TESTS))
    log = tmp_path / "steps.log"
    return {"id": "counting_env:make", "kwargs": {"log": str(log), "max_episode_steps": 40}}, log


def stored_transitions(path: Path):
    """(observations o_t, actions a_t) of every stored transition, and the episodes."""
    with ReplayBuffer.load(path, mmap=True) as snap:
        refs = snap.episodes()
        obs = np.concatenate([snap.fields["observation"][r.start : r.start + r.rows - 1] for r in refs])
        actions = np.concatenate([snap.fields["action"][r.start + 1 : r.start + r.rows] for r in refs])
        rewards = [float(snap.fields["reward"][r.start + 1 : r.start + r.rows].sum()) for r in refs]
        extra = snap.snapshot_manifest["extra"]
        return obs, actions, refs, rewards, extra


def greedy(run_dir: Path, obs: np.ndarray) -> np.ndarray:
    state = torch.load(run_dir / "best.pt", weights_only=True)
    from mpper.algos.dqn.dqn import QNetwork

    net = QNetwork((4,), 2, [16], dueling=False)
    net.load_state_dict(state["network"])
    with torch.no_grad():
        return net(torch.from_numpy(obs)).argmax(1).numpy()


@pytest.mark.slow
def test_collect_takes_exactly_the_steps_asked_and_acts_greedily_without_noise(tmp_path, counting, capsys):
    env, log = counting
    run_dir = dqn_run_dir(tmp_path / "run", env)
    log.unlink()
    out = tmp_path / "data"
    assert main(["--collect", str(run_dir), *TRUST, "--env-steps", "301", "--epsilon", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "collected 301 env steps with epsilon 0" in printed and f"--offline {out}" in printed
    assert sum(e["steps"] for e in read_log(log).values()) == 301  # counted by the envs themselves
    obs, actions, refs, rewards, extra = stored_transitions(out)
    assert len(actions) == 301
    np.testing.assert_array_equal(actions, greedy(run_dir, obs))  # every action the checkpoint's greedy one
    collected = extra["collected"]
    assert collected["env_steps"] == 301 and collected["training_step"] == 17 and collected["epsilon"] == 0
    complete = collected["complete_episodes"]
    assert collected["returns"] == rewards[:complete]
    assert collected["mean_return"] == pytest.approx(np.mean(rewards[:complete]))
    assert len(refs) - complete <= 3  # the episodes cut by the budget, one per env at most
    assert {key: extra["config"]["env"][key] for key in env} == env


@pytest.mark.slow
def test_epsilon_replaces_greedy_actions_at_its_rate(tmp_path, counting):
    env, _ = counting
    run_dir = dqn_run_dir(tmp_path / "run", env)
    for epsilon, low, high in ((1.0, 0.35, 0.65), (0.4, 0.1, 0.3)):  # 2 actions: a random one differs half the time
        out = tmp_path / f"data-{epsilon}"
        assert main(["--collect", str(run_dir), *TRUST, "--env-steps", "600", "--epsilon", str(epsilon), "--out", str(out),
                     "--seed", "4"]) == 0  # fmt: skip
        obs, actions, *_ = stored_transitions(out)
        differ = float(np.mean(actions != greedy(run_dir, obs)))
        assert low < differ < high, (epsilon, differ)


@pytest.mark.slow
def test_a_collected_snapshot_is_one_offline_inspect_and_on_snapshot_read(tmp_path, counting, capsys):
    env, _ = counting
    run_dir = dqn_run_dir(tmp_path / "run", env)
    out = tmp_path / "data"
    assert main(["--collect", str(run_dir), *TRUST, "--env-steps", "200", "--epsilon", "0.5", "--out", str(out)]) == 0
    data = read_sources([out])
    assert data.steps == 200 and data.sources[0].env == {**env, "preprocessing": "none", "preprocessing_kwargs": {}}
    config = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    spec = env_spec(config.env)
    check_sources(data, config, spec, algorithm_of(config).schema(spec.observation_shape, spec.num_actions,
                                                                  spec.observation_dtype))  # fmt: skip
    muzero = config_from_dict({"env": env})  # a MuZero run takes the same transitions
    check_sources(data, muzero, spec, algorithm_of(muzero).schema(spec.observation_shape, spec.num_actions,
                                                                  spec.observation_dtype))  # fmt: skip
    capsys.readouterr()
    assert main(["--inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["positions"] == 200
    shutil.copy(run_dir / "best.pt", run_dir / "checkpoint.pt")
    assert main(["--evaluate", str(run_dir), "--on-snapshot", str(out), *TRUST]) == 0


def test_bad_collections_are_one_line_and_write_nothing(tmp_path, counting, capsys):
    env, _ = counting
    run_dir = dqn_run_dir(tmp_path / "run", env)
    out = tmp_path / "data"
    cases = [
        (["--epsilon", "1.5", "--env-steps", "10", "--out", str(out)], "--epsilon: expected a number in [0, 1]"),
        (["--env-steps", "0", "--out", str(out)], "--env-steps: expected an integer >= 1"),
        (["--env-steps", "10"], "--collect needs --env-steps N and --out DIR"),
        (["--env-steps", "10", "--out", str(tmp_path)], "already exists"),
        (["--env-steps", "10", "--out", str(tmp_path / "no" / "data")], "no directory"),
        (["--env-steps", "10", "--out", str(out), "--checkpoint", str(tmp_path / "none.pt")], "none.pt"),
        (["--env-steps", "10", "--out", str(out), "--workers", "2"], "--workers does not apply to --collect"),
    ]
    for args, message in cases:
        assert main(["--collect", str(run_dir), *TRUST, *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
        assert not os.path.lexists(out)
    assert main(["--collect", str(tmp_path / "nowhere"), "--env-steps", "10", "--out", str(out)]) == 2
    assert "no run directory with a config.json" in capsys.readouterr().err
