"""Evaluations that stop early (``runtime.max_episode_return``): once the mean of an
evaluation's episodes can no longer reach the bar (the solve return or the best mean so
far, the lower), play stops, the evaluation counts as failing and keeps no ``best.pt``.

The reference is a plain loop (``tests/greedy_reference.py``): real CartPole envs reset
with each episode's seed, the action the argmax of the Q-network's output; the stopping
move is worked out here from the plain returns (CartPole pays 1 per move, so a return is
the episode's length, and the envs of a batch move in lockstep).
"""

from __future__ import annotations

import json
from pathlib import Path

import greedy_reference
import gymnasium as gym
import numpy as np
import pytest
import torch

from mpper.algos.configs import config_from_dict
from mpper.algos.dqn.dqn import QNetwork
from mpper.runtime.evaluation import evaluate, evaluation_bar, greedy_returns
from mpper.runtime.progress import eval_text
from mpper.runtime.run import BestCheckpoint, Run

SEED = 300  # episode i starts from a reset with SEED + i
MAX_RETURN = 500.0  # CartPole-v1


def dqn_config(max_episode_return: float | None = MAX_RETURN, solve_return: float | None = 475.0, episodes: int = 6):
    return config_from_dict({
        "algorithm": "dqn", "env": {"id": "CartPole-v1"}, "dqn": {"hidden": [16], "dueling": False},
        "runtime": {"evaluation_episodes": episodes, "solve_return": solve_return,
                    "max_episode_return": max_episode_return},
    })  # fmt: skip


def network_where(condition, episodes: int):
    """A network of :func:`greedy_reference.network_where` for seeds ``SEED ..``."""
    return greedy_reference.network_where(condition, SEED, episodes)


def expected_finished(returns: list[float], batch: int, bar: float, best_case: float = MAX_RETURN) -> list[float]:
    """The returns finished when play stops: batches of ``batch`` episodes in lockstep,
    the bar checked after every move while a batch has unfinished episodes."""
    count, finished = len(returns), []
    for start in range(0, count, batch):
        lengths = returns[start : start + batch]
        for move in range(1, int(max(lengths)) + 1):
            done = [r for r in lengths if r <= move]
            if len(done) == len(lengths):
                break
            if (sum(finished) + sum(done) + (count - len(finished) - len(done)) * best_case) / count < bar:
                return finished + [r for r in lengths if r <= move]
        finished += lengths
    return finished


def out_of_reach(returns: list[float]) -> float:
    """A mean just out of reach once every episode but the longest has ended."""
    return float(np.mean(returns)) + (MAX_RETURN - max(returns)) / len(returns) + 1.0


def varied(returns: list[float]) -> bool:
    """Returns that end at different moves, some short and some long."""
    return len(set(returns)) == len(returns) and min(returns) < 60 and max(returns) > 150


def test_an_evaluation_that_cannot_reach_the_bar_stops_and_keeps_the_finished_returns():
    network, returns = network_where(varied, episodes=6)
    bar = out_of_reach(returns)
    want = expected_finished(returns, batch=6, bar=bar)
    assert 0 < len(want) < 6
    report = evaluate(dqn_config(), network, seed=SEED, must_reach=bar)
    assert report["stopped_early"] is True and "mean_return" not in report
    assert report["returns"] == [r for r in returns if r in want]  # env order
    assert report["mean_return_at_most"] == pytest.approx((sum(want) + (6 - len(want)) * MAX_RETURN) / 6)
    assert report["mean_return_at_most"] < bar


def test_an_evaluation_that_can_still_reach_the_bar_plays_every_episode():
    network, returns = network_where(varied, episodes=6)
    bar = float(np.mean(returns))  # reached exactly at the last move
    assert evaluate(dqn_config(), network, seed=SEED, must_reach=bar) == {
        "mean_return": pytest.approx(bar), "returns": returns}  # fmt: skip
    # without a bound on one episode's return, or without a bar, nothing stops early
    too_high = out_of_reach(returns)
    assert evaluate(dqn_config(max_episode_return=None), network, seed=SEED, must_reach=too_high)["returns"] == returns
    assert evaluate(dqn_config(), network, seed=SEED, must_reach=None)["returns"] == returns


def test_the_bound_counts_episodes_of_earlier_batches():
    network, returns = network_where(varied, episodes=7)
    config = dqn_config(episodes=3)
    envs = [gym.make("CartPole-v1") for _ in range(3)]
    # out of reach once the second batch (episodes 3-5) has only its longest unfinished
    bar = (sum(returns) - max(returns[3:6]) - returns[6] + 2 * MAX_RETURN) / 7 + 1.0
    want = expected_finished(returns, batch=3, bar=bar)
    got = greedy_returns(config, envs, network, SEED, 7, must_reach=bar)
    assert 3 <= len(got) < 6
    assert got == want  # batch by batch, env order within a batch
    assert greedy_returns(config, envs, network, SEED, 7, must_reach=float(np.mean(returns))) == returns


def test_a_bound_below_a_real_return_is_refused_by_name():
    network, returns = network_where(varied, episodes=6)
    config = dqn_config(max_episode_return=max(returns) - 1)
    # found out by the first evaluation already, which plays every episode to the end
    with pytest.raises(ValueError, match=r"runtime\.max_episode_return is \d+, but a greedy episode returned \d+"):
        evaluate(config, network, seed=SEED, must_reach=None)


def test_the_bar_is_the_solve_return_or_the_best_so_far_whichever_is_lower():
    assert evaluation_bar(dqn_config(), -np.inf) is None  # the first evaluation plays to the end
    assert evaluation_bar(dqn_config(), 120.0) == 120.0
    assert evaluation_bar(dqn_config(solve_return=100.0), 120.0) == 100.0
    assert evaluation_bar(dqn_config(solve_return=None), 120.0) == 120.0
    assert evaluation_bar(dqn_config(max_episode_return=None), 120.0) is None


def test_a_stopped_evaluation_neither_stops_the_run_nor_replaces_best(tmp_path):
    config = dqn_config(solve_return=100.0)
    stopped = {"training_step": 7, "stopped_early": True, "mean_return_at_most": 90.0, "returns": [12.0]}
    best = BestCheckpoint(tmp_path)
    network = QNetwork((4,), 2, [16])
    assert not best.offer(network, 7, stopped)
    assert not (tmp_path / "best.pt").exists() and best.best == -np.inf
    run = Run(config, tmp_path)
    run.evaluated(stopped)
    assert run.stop_reason(env_steps=0) is None
    assert eval_text(stopped) == "eval <90.0"


def test_the_key_is_checked():
    from mpper.config import ConfigError

    with pytest.raises(ConfigError, match=r"runtime\.max_episode_return"):
        dqn_config(max_episode_return="a lot")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_run_in_one_process_stops_hopeless_evaluations_and_keeps_best_from_whole_ones(tmp_path, capsys):
    """--workers 0 evaluates between its turns (here after every one): evaluations stop
    early by the bar of the best whole evaluation before them, and ``best.pt`` holds the
    best whole one. One process: the same seed plays the same run."""
    from mpper import cli

    run_dir = tmp_path / "run"
    episodes, most = 4, 30.0
    config = Path(__file__).resolve().parents[2] / "configs" / "cartpole.json"
    rc = cli.main(["--config", str(config), "--workers", "0", "--device", "cpu", "--seed", "0",
                   "--run-dir", str(run_dir), "--max-train-steps", "120", "--time-limit", "100",
                   "--set", "training.min_buffer_steps=64", "--set", "training.batch_size=16",
                   "--set", "mcts.num_simulations=4", "--set", "runtime.envs_per_worker=4",
                   "--set", "runtime.evaluation_interval_s=0.001", "--set", f"runtime.evaluation_episodes={episodes}",
                   "--set", "env.max_episode_steps=30", "--set", f"runtime.max_episode_return={most}",
                   "--set", "runtime.solve_return=null", "--set", "reanalyse.enabled=false",
                   "--set", "replay.capacity=2000"])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r["evaluation"] for r in records if r["event"] == "evaluation"]
    best_before = -np.inf
    whole, stopped = [], []
    for ev in evaluations:
        if ev.get("stopped_early"):
            stopped.append(ev)
            assert len(ev["returns"]) < episodes
            bound = (sum(ev["returns"]) + (episodes - len(ev["returns"])) * most) / episodes
            assert ev["mean_return_at_most"] == pytest.approx(bound) and bound < best_before
            assert ev["best_mean_return"] == best_before
        else:
            whole.append(ev)
            assert len(ev["returns"]) == episodes and ev["mean_return"] == pytest.approx(np.mean(ev["returns"]))
            best_before = max(best_before, ev["mean_return"])
            assert ev["best_mean_return"] == best_before
    assert stopped and len(whole) > 1
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert best["extra"]["mean_return"] == max(ev["mean_return"] for ev in whole)
