"""``training.env_steps``: a run stops cleanly once the buffer has counted that many env
steps (``training.after_env_steps`` "stop"), or self-play ends there and the learner
trains on to ``training.training_steps`` ("train"), with both schedulers (the supervisor
with worker processes, and ``--workers 0``); ``training.replay_ratio`` paces the two;
``runtime.final_evaluation_episodes`` plays the final weights once the run has ended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpper import ReplayBuffer
from mpper.algos.configs import config_from_dict
from mpper.config import ConfigError
from mpper.runtime.run import Run, selfplay_over

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 600


def test_the_stop_rule_reads_the_env_step_counter(tmp_path):
    run = Run(config_from_dict({"training": {"env_steps": BUDGET}}, check_env=False), tmp_path)
    assert run.stop_reason(env_steps=BUDGET - 1) is None
    reason = f"env-step budget reached: {BUDGET} env steps stored (training.env_steps {BUDGET})"
    assert run.stop_reason(env_steps=BUDGET) == reason
    assert Run(config_from_dict({}, check_env=False), tmp_path).stop_reason(env_steps=10**9) is None


def test_with_training_on_the_budget_ends_self_play_and_not_the_run(tmp_path):
    config = config_from_dict({"training": {"env_steps": BUDGET, "after_env_steps": "train"}}, check_env=False)
    assert Run(config, tmp_path).stop_reason(env_steps=BUDGET + 1) is None
    assert not selfplay_over(config.training, BUDGET - 1) and selfplay_over(config.training, BUDGET)
    stopping = config_from_dict({"training": {"env_steps": BUDGET}}, check_env=False)
    assert not selfplay_over(stopping.training, 10**9)  # "stop": the run ends instead


@pytest.mark.parametrize("training, message", [
    ({"replay_ratio": 0.5, "samples_per_insert": 8}, "training.replay_ratio: and training.samples_per_insert say "
                                                     "the same pacing two ways"),
    ({"after_env_steps": "train"}, 'training.after_env_steps: "train" needs training.env_steps'),
    ({"after_env_steps": "later", "env_steps": 600}, "training.after_env_steps: expected one of"),
])  # fmt: skip
def test_pacing_and_budget_mistakes_are_one_line(training, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        config_from_dict({"training": training}, check_env=False)
    assert "\n" not in str(err.value)


def test_the_replay_ratio_is_updates_per_env_step():
    training = config_from_dict({"training": {"replay_ratio": 0.25, "batch_size": 64}}, check_env=False).training
    assert training.paced_samples_per_insert == 16.0
    assert config_from_dict({}, check_env=False).training.paced_samples_per_insert is None


def _cartpole_argv(run_dir, workers: int, *more: str) -> list[str]:
    return [sys.executable, "run.py", "--config", "cartpole", "--device", "cpu", "--workers", str(workers),
            "--run-dir", str(run_dir), "--env-steps", str(BUDGET), "--time-limit", "360",
            "--set", "training.min_buffer_steps=200", "--set", "training.batch_size=16",
            "--set", "mcts.num_simulations=4", "--set", "runtime.envs_per_worker=2",
            "--set", "runtime.evaluation_interval_s=1000", "--set", "runtime.solve_return=null", *more]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("workers", [0, 2])
def test_self_play_ends_at_the_budget_and_the_learner_trains_on(tmp_path, workers):
    """A replay ratio of 0.25 updates per env step allows at most 0.25 * 600 * 1.2 = 180
    updates before self-play ends at 600 env steps: the 300 the run makes show the
    learner trained on alone. Then the final evaluation plays 3 greedy episodes."""
    run_dir = tmp_path / "run"
    argv = _cartpole_argv(run_dir, workers, "--max-train-steps", "300", "--set", "training.after_env_steps=train",
                          "--set", "training.replay_ratio=0.25", "--set", "training.samples_per_insert=null",
                          "--set", "runtime.final_evaluation_episodes=3", "--set", "runtime.log_interval_s=0.5")  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=390, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("mpper: training finished (300 steps); "), last
    assert "self-play ended at " in proc.stderr and "the learner trains on to 300 steps" in proc.stderr
    assert "died" not in proc.stderr and "restarting" not in proc.stderr  # workers that ended were left ended
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ended_at = records[-1]["env_steps"]
    assert BUDGET <= ended_at < BUDGET + 2 * 2 * 500  # at most the episodes in play when the budget was crossed
    past = [r["env_steps"] for r in records if r["env_steps"] >= BUDGET]
    assert len(set(past[1:])) <= 1  # nothing stored after the workers saw the budget
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snapshot:
        assert snapshot.counters["steps"] == ended_at
        assert snapshot.counters["samples"] in (300 * 16, 301 * 16)  # the learner's process draws one batch ahead
    final = json.loads((run_dir / "final_evaluation.json").read_text())
    assert (final["training_step"], final["env_steps"], final["episodes"]) == (300, ended_at, 3)
    assert len(final["returns"]) == 3 and final["mean_return"] == pytest.approx(sum(final["returns"]) / 3)
    assert f"final evaluation: mean greedy return {final['mean_return']:g} over 3 episodes (training step 300, " \
           f"{ended_at} env steps)" in last
    assert [r["event"] for r in records[-2:]] == ["final_evaluation", "end"]
    assert records[-2]["evaluation"] == final


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_stops_at_its_env_step_budget(tmp_path):
    """CartPole, small; a training-step budget and a time limit far beyond what the env
    steps allow, so that only the env-step budget can end the run with this line."""
    run_dir = tmp_path / "run"
    argv = _cartpole_argv(run_dir, 2, "--max-train-steps", "1000000", "--set", "training.samples_per_insert=null")
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


@pytest.mark.parametrize("config", ["cartpole", "cartpole_dqn"])
def test_the_final_evaluation_searches_on_cuda_only_where_there_is_one_and_a_search(tmp_path, config):
    """MuZero's final evaluation plays on the learner's CUDA device, when there is one;
    on the CPU, and for DQN (no search), it plays the network it was given."""
    import torch

    from mpper.algos.configs import load_config
    from mpper.runtime.roles import Evaluation
    from mpper.runtime.setup import RunSetup
    from mpper.runtime.weights import WeightStore

    setup = RunSetup.create(load_config(ROOT / "configs" / f"{config}.json"), tmp_path / "run")
    network = setup.make_network()
    with WeightStore.create(network.num_flat_weights()) as store:
        played = Evaluation(setup, store)._searching_device(network)
    on_cuda = torch.cuda.is_available() and config == "cartpole"
    assert (played is network) is not on_cuda
    assert next(played.parameters()).device.type == ("cuda" if on_cuda else "cpu")
