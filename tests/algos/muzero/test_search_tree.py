"""mpper.algos.muzero.tree: the batched tree under its policies, and the player's network
input, which reads only the rows it stacks.

* A policy of a few lines over ``BatchedSearch`` (always action 0) gets a searched chain
  whose visits and values are known in closed form: the tree's root inference, loop,
  expansion and backup, apart from pUCT and Gumbel.
* Gumbel over K roots equals K single searches bit for bit given the same noise, as
  pUCT does (``tests/algos/muzero/test_mcts.py``): no state of one tree leaks into another.
* The self-play player's stacked input equals a plain restack of the whole episode on
  every move of real CartPole games, across game segments.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from mpper.algos.muzero.config import MCTSConfig
from mpper.algos.muzero.gumbel import GumbelMCTS
from mpper.algos.muzero.networks import make_network
from mpper.algos.muzero.player import BatchedPlayer
from mpper.algos.muzero.targets import stacked_observations
from mpper.algos.muzero.tree import BatchedSearch, step_down

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_mcts import SUPPORT, TabularModel, random_tabular  # noqa: E402
from test_selfplay import make_config  # noqa: E402


class FirstAction(BatchedSearch):
    """A policy that always walks action 0: the tree grows a chain, one node a simulation."""

    def draw(self, legal, add_exploration_noise, rng, root_noise, tie_break):
        return None

    def root_prior(self, prior, legal, draws):
        return prior

    def select(self, tree, draws):
        for k in range(tree.depth.shape[0]):
            node, d = 0, 0
            while node >= 0:
                node, d = step_down(k, node, 0, d, tree.children, tree.path, tree.depth, tree.parent, tree.action)
        return int(tree.depth.max())

    def decide(self, tree, draws):
        return None, None


def test_a_policy_over_the_tree_gets_its_chain_searched_and_backed_up():
    # State s -> s + 1 on every action, reward 1 per step, value 0.5 everywhere: the
    # simulation that expands depth d returns sum_{i<d} discount^i + discount^d * 0.5.
    n_states, sims, discount = 12, 9, 0.9
    model = TabularModel(next_state=[[min(s + 1, n_states - 1)] * 2 for s in range(n_states)],
                         reward=np.ones((n_states, 2)), value=np.full(n_states, 0.5))  # fmt: skip
    search = FirstAction(2, MCTSConfig(num_simulations=sims, discount=discount), SUPPORT)
    result = search.run(model, np.zeros((3, 1), np.float32), np.ones((3, 2), bool), np.zeros(3, int), False,
                        np.random.default_rng(0))  # fmt: skip
    assert result.max_tree_depth == sims
    np.testing.assert_array_equal(result.visit_counts, [[sims, 0]] * 3)
    returns = [sum(discount**i for i in range(d)) + discount**d * 0.5 for d in range(1, sims + 1)]
    np.testing.assert_allclose(result.root_values, np.mean(returns), rtol=1e-5)
    np.testing.assert_allclose(result.root_predicted_values, 0.5, rtol=1e-5)
    assert result.actions is None and result.policy_target is result.child_visits


@pytest.mark.parametrize("two_player, q_bounds", [(False, "node"), (True, "tree")])
def test_batched_gumbel_search_equals_single_searches(two_player, q_bounds):
    rng = np.random.default_rng(2)
    model = random_tabular(rng)
    k_envs, n_actions = 10, 4
    obs = rng.integers(0, 40, size=(k_envs, 1)).astype(np.float32)  # the roots' states
    legal = rng.random((k_envs, n_actions)) < 0.7
    legal[np.arange(k_envs), rng.integers(0, n_actions, k_envs)] = True  # one legal action at least
    to_play = rng.integers(0, 2, size=k_envs) * two_player
    config = MCTSConfig(kind="gumbel", num_simulations=24, max_num_considered_actions=4, gumbel_q_bounds=q_bounds)
    search = GumbelMCTS(n_actions, config, SUPPORT, two_player)
    noise = rng.gumbel(size=legal.shape)
    batched = search.run(model, obs, legal, to_play, True, rng, root_noise=noise)
    for k in range(k_envs):
        single = search.run(model, obs[k : k + 1], legal[k : k + 1], to_play[k : k + 1], True, rng,
                            root_noise=noise[k : k + 1])  # fmt: skip
        np.testing.assert_array_equal(single.visit_counts[0], batched.visit_counts[k])
        np.testing.assert_array_equal(single.policy_target[0], batched.policy_target[k])
        assert single.actions[0] == batched.actions[k] and single.root_values[0] == batched.root_values[k]
    plain = search.run(model, obs, legal, to_play, False, rng)  # the noise was used
    assert not np.array_equal(plain.visit_counts, batched.visit_counts)


def test_the_players_stacked_input_is_a_restack_of_the_whole_episode_on_every_move():
    stacked, segment = 3, 7
    c = make_config()
    muzero = dataclasses.replace(c.muzero, stacked_observations=stacked, game_segment_length=segment)
    config = dataclasses.replace(c, muzero=muzero)
    torch.manual_seed(0)
    net = make_network(config.network, (4,), 2, stacked).eval()
    envs = [gym.wrappers.TimeLimit(gym.make("CartPole-v1").unwrapped, 40) for _ in range(3)]
    player = BatchedPlayer(config, envs, net, explore=True, seed=5)
    inner, seen_rows, checked = player.mcts, set(), 0

    class Checking:
        def run(self, network, observations, *args, **kwargs):
            nonlocal checked
            for k, ep in enumerate(player.episodes):
                t = len(ep.observation) - 1
                row = np.array([t])
                whole = stacked_observations(np.stack(ep.observation), np.asarray(ep.action, np.int64), row, row,
                                             stacked, 2)[0]  # fmt: skip
                np.testing.assert_array_equal(observations[k], whole)
                seen_rows.add(min(t, stacked + 1))
                checked += 1
            return inner.run(network, observations, *args, **kwargs)

    player.mcts = Checking()
    finished = []
    for _ in range(40):
        finished += player.step()
    assert checked == 120
    assert seen_rows == set(range(stacked + 2))  # rows before, at and past the stack's depth
    assert any(not ep.ends_game for ep in finished) and any(ep.ends_game for ep in finished)
