"""The solve confirmation (``runtime.solve_confirm_episodes``): an evaluation that
reaches ``runtime.solve_return`` plays more greedy episodes with the same weights, and
the run counts as solved only if the mean over all of them holds.

The reference is a plain loop (``tests/greedy_reference.py``): a real CartPole env reset
with each episode's seed, the action the argmax of the Q-network's output.
"""

from __future__ import annotations

import greedy_reference
import numpy as np
import pytest

from mpper.algos.configs import config_from_dict
from mpper.runtime.evaluation import evaluate
from mpper.runtime.run import Run

SEED = 100  # the evaluation's seed: episode i starts from a reset with SEED + i


def dqn_config(solve_return: float | None, confirm: int, episodes: int = 4):
    return config_from_dict({
        "algorithm": "dqn", "env": {"id": "CartPole-v1"}, "dqn": {"hidden": [16], "dueling": False},
        "runtime": {"evaluation_episodes": episodes, "solve_return": solve_return, "solve_confirm_episodes": confirm},
    })  # fmt: skip


def network_where(condition, episodes: int = 10):
    """A network of :func:`greedy_reference.network_where` for seeds ``SEED ..``."""
    return greedy_reference.network_where(condition, SEED, episodes)


def stops(config, evaluation: dict, tmp_path) -> bool:
    run = Run(config, tmp_path)
    run.evaluated({"training_step": 1, **evaluation})
    return run.stop_reason(env_steps=0) is not None


def test_a_crossing_that_the_confirmation_does_not_back_does_not_stop_the_run(tmp_path):
    network, returns = network_where(lambda r: np.mean(r[:4]) > np.mean(r))
    solve = float(np.mean(returns[:4]))  # the evaluation's 4 episodes reach it exactly
    report = evaluate(dqn_config(solve, confirm=6), network, seed=SEED)
    assert report["returns"] == returns
    assert report["mean_return"] == pytest.approx(np.mean(returns))
    assert report["mean_return"] < solve
    assert report["confirmation"] == {"episodes": 6, "mean_return": pytest.approx(np.mean(returns[4:]))}
    assert not stops(dqn_config(solve, confirm=6), report, tmp_path)
    # without the confirmation the same evaluation stops the run
    report = evaluate(dqn_config(solve, confirm=0), network, seed=SEED)
    assert report == {"mean_return": pytest.approx(solve), "returns": returns[:4]}
    assert stops(dqn_config(solve, confirm=0), report, tmp_path)


def test_a_confirmed_crossing_stops_the_run_and_more_episodes_than_envs_are_played_in_turns(tmp_path):
    network, returns = network_where(lambda r: np.mean(r) >= np.mean(r[:3]), episodes=3 + 7)
    solve = float(np.mean(returns[:3]))
    config = dqn_config(solve, confirm=7, episodes=3)  # 7 episodes on 3 envs: 3 + 3 + 1
    report = evaluate(config, network, seed=SEED)
    assert report["returns"] == returns
    assert report["confirmation"]["episodes"] == 7
    assert stops(config, report, tmp_path)


def test_no_confirmation_below_the_solve_return_or_without_one(tmp_path):
    network, returns = network_where(lambda r: len(set(r)) > 1, episodes=4)
    below = evaluate(dqn_config(float(np.mean(returns)) + 1, confirm=6), network, seed=SEED)
    assert below["returns"] == returns and "confirmation" not in below
    unset = evaluate(dqn_config(None, confirm=6), network, seed=SEED)
    assert unset["returns"] == returns and "confirmation" not in unset


def test_the_key_is_checked():
    from mpper.config import ConfigError

    with pytest.raises(ConfigError, match=r"runtime\.solve_confirm_episodes: expected an integer in \[0, 1000000\], got -1"):
        dqn_config(475.0, confirm=-1)


def test_a_passing_evaluation_stops_the_run_though_a_failing_one_arrives_before_the_check(tmp_path):
    """Evaluations can come faster than the supervisor asks for a stop reason (weights
    that collapse fail theirs in a few moves): the first one at the solve return stops
    the run, whatever came after it."""
    run = Run(dqn_config(475.0, confirm=0), tmp_path)
    run.evaluated({"training_step": 900, "mean_return": 120.0, "returns": [120.0] * 4})
    assert run.stop_reason(env_steps=0) is None
    run.evaluated({"training_step": 5360, "mean_return": 500.0, "returns": [500.0] * 4})
    run.evaluated({"training_step": 5770, "mean_return": 9.0, "returns": [9.0] * 4})
    assert run.stop_reason(env_steps=0) == "solved: mean greedy return 500.0 >= 475 at training step 5360"
    assert run.evaluation["training_step"] == 5770  # the records still show the latest
