"""MuZero Unplugged's targets in an offline run: a DQN-schema snapshot (no search
statistics) in a MuZero buffer, every episode reanalysed with a fixed network and a new
search, and the learner's value and policy targets computed again here, by plain loops
over the stored rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_offline import random_snapshot

from mpper.algos.configs import config_from_dict, offline_overrides
from mpper.algos.registry import algorithm_of
from mpper.envs.spec import env_spec
from mpper.runtime.offline import fill_buffer, read_sources
from mpper.runtime.run import create_buffer
from mpper.runtime.weights import WeightStore

SUPPORT = 10
EPS = 0.001


def plain_value(logits: np.ndarray) -> float:
    """The network's scalar value by the MuZero paper's appendix: the expectation of the
    softmax over the support -S..S, then the inverse of h(x) = sign(x)(sqrt(|x|+1) - 1) + eps x."""
    exps = [math.exp(float(v) - float(max(logits))) for v in logits]
    y = sum(p / sum(exps) * s for p, s in zip(exps, range(-SUPPORT, SUPPORT + 1)))
    u = (math.sqrt(1 + 4 * EPS * (abs(y) + 1 + EPS)) - 1) / (2 * EPS)
    return math.copysign(u * u - 1, y)


def plain_value_target(rows: dict, terminated: bool, i: int, td: int, gamma: float) -> float:
    """compute_target_value of position i < T: n-step return of the stored rewards, then
    the reanalysed value td steps on, or at the cut of a truncated episode; 0 beyond a
    terminal end."""
    big_t = len(rows["reward"]) - 1
    end = min(i + td, big_t)
    value = sum(gamma ** (j - i - 1) * float(rows["reward"][j]) for j in range(i + 1, end + 1))
    if i + td < big_t:
        value += gamma**td * float(rows["reanalysed_value"][i + td])
    elif not terminated:
        value += gamma ** (big_t - i) * float(rows["reanalysed_value"][big_t])
    return value


@pytest.fixture(scope="module")
def reanalysed(tmp_path_factory):
    """A MuZero buffer filled from a DQN-schema snapshot (CartPole, cut at 15 moves: some
    episodes terminated, some truncated), every episode reanalysed once with a fixed network."""
    folder = tmp_path_factory.mktemp("offline")
    random_snapshot(folder / "data", {"id": "CartPole-v1", "kwargs": {}}, episodes=10, seed=5, max_episode_steps=15)
    settings = {"env": {"id": "CartPole-v1"},
                "network": {"support_size": SUPPORT, "encoding_size": 8, "hidden": [16]},
                "mcts": {"num_simulations": 6, "discount": 0.97},
                "muzero": {"td_steps": 4, "num_unroll_steps": 3},
                "reanalyse": {"batch_episodes": 64}, "replay": {"capacity": 4096}}  # fmt: skip
    config = config_from_dict(settings, overrides=offline_overrides("muzero"))
    assert config.reanalyse.search_fraction == 1.0 and config.reanalyse.enabled
    spec = env_spec(config.env)
    data = read_sources([folder / "data"])
    buf = create_buffer(config, spec)
    store = None
    try:
        fill_buffer(buf, data)
        algorithm = algorithm_of(config)
        torch.manual_seed(11)
        network = algorithm.make_network(config, spec.observation_shape, spec.num_actions).eval()
        store = WeightStore.create(network.num_flat_weights())
        store.publish(network.get_flat_weights(), 0)
        reanalyser = algorithm.make_reanalyser(config, buf, store)
        assert reanalyser.refresh_weights()
        stored, dropped = reanalyser.step()
        assert (stored, dropped) == (data.episodes, 0)  # one batch: every episode
        assert {ref.terminated for ref in buf.episodes()} == {True, False}  # ended, and cut at 15 moves
        yield config, buf, network, reanalyser
    finally:
        buf.close()
        if store is not None:
            store.close()


def test_every_episode_gets_search_policies_and_fresh_values(reanalysed):
    config, buf, network, reanalyser = reanalysed
    assert reanalyser.stats()["searched_episodes"] == len(buf.episodes())
    sims = config.mcts.num_simulations
    for ref in buf.episodes():
        rows = buf.read_episode(ref)
        assert not rows["child_visits"].any()  # the DQN snapshot had none: the policy targets are the search's
        policy = rows["reanalysed_policy"][:-1]
        np.testing.assert_allclose(policy.sum(axis=1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(policy * sims, np.round(policy * sims), atol=1e-4)  # visit counts / simulations
        assert np.isfinite(rows["reanalysed_value"]).all()
        # the final observation's value: the fixed network's, computed here by the formula
        with torch.no_grad():
            logits = network.initial_inference(torch.from_numpy(rows["observation"][-1:])).value_logits[0].numpy()
        assert rows["reanalysed_value"][-1] == pytest.approx(plain_value(logits), abs=1e-4)


def test_the_learners_targets_are_the_reanalysed_n_step_values_and_search_policies(reanalysed):
    config, buf, _, _ = reanalysed
    targets = algorithm_of(config).make_targets(config, 2)
    batch = buf.sample(64, 0.4, targets=targets, rng=np.random.default_rng(2))
    refs = buf.episodes()
    k1 = config.muzero.num_unroll_steps + 1
    for b, slot in enumerate(batch.indices):
        ref = next(r for r in refs if r.start <= slot < r.start + r.rows)
        rows = buf.read_episode(ref)
        t, big_t = int(slot - ref.start), ref.rows - 1
        for k in range(k1):
            i = t + k
            value = batch.data["target_value"][b, k]
            policy = batch.data["target_policy"][b, k]
            if i < big_t:
                want = plain_value_target(rows, ref.terminated, i, config.muzero.td_steps, config.mcts.discount)
                assert value == pytest.approx(want, abs=1e-4), (b, k)
                np.testing.assert_allclose(policy, rows["reanalysed_policy"][i], rtol=1e-6)
            else:
                want = 0.0 if ref.terminated or i > big_t else float(rows["reanalysed_value"][big_t])
                assert value == pytest.approx(want, abs=1e-5)
                np.testing.assert_allclose(policy, 0.5)
