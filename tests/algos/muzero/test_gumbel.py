"""Gumbel MuZero search (``mcts.kind: "gumbel"``) against DeepMind's mctx
(``mctx.gumbel_muzero_policy``, JAX on the CPU, float64), on the same model and the same
Gumbel noise: chosen actions, root visit counts and policy targets.

The model is a table, so both sides see exactly the same numbers: a state is an integer
id, action ``a`` leads from ``s`` to ``(31 s + 7 a + 1) mod P``, and each state has
policy logits, a value and a reward drawn once. mpper's search reads values and rewards
as support logits (``support_to_scalar``); mctx gets the scalars those logits stand for.
Two-player games are mctx's zero-sum convention: the recurrent function returns the
discount ``-discount``.

``mcts.gumbel_q_bounds: "tree"`` is checked the same way, mctx's search given a Q-transform
written here from the paper's appendix D (mctx's own completed-Q steps) whose [0, 1]
rescaling is bounded by every visited edge's Q in the whole tree instead of the node's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mctx
import numpy as np
import pytest
import torch
from mctx._src import qtransforms, seq_halving

from mpper.algos.muzero.config import MCTSConfig
from mpper.algos.muzero.gumbel import GumbelMCTS
from mpper.algos.muzero.networks import NetworkOutput, support_to_scalar
from mpper.algos.muzero.search import make_search
from mpper.algos.muzero_family import considered_visits

pytestmark = pytest.mark.timeout(300)

P = 1009  # states in the table
S = 5  # support size: 2S + 1 bins


class TableModel:
    """A MuZero "network" over a table of states; hidden state (B, 1) float64 = the id."""

    def __init__(self, num_actions: int, seed: int, value_spread: float = 3.0):
        rng = np.random.default_rng(seed)
        self.num_actions = num_actions
        self.policy_logits = rng.standard_normal((P, num_actions)) * 1.5
        # Support logits, peaked around a random bin so values spread over [-S, S].
        centre = rng.uniform(-S, S, P) * value_spread / S
        bins = np.arange(-S, S + 1)
        self.value_logits = -((bins[None, :] - centre[:, None]) ** 2) + rng.standard_normal((P, 2 * S + 1)) * 0.3
        self.reward_logits = -((bins[None, :] - rng.uniform(-1, 1, P)[:, None]) ** 2)
        as_scalar = lambda logits: support_to_scalar(torch.as_tensor(logits), S).numpy()  # noqa: E731
        self.values, self.rewards = as_scalar(self.value_logits), as_scalar(self.reward_logits)

    def parameters(self):
        return iter(())

    def initial_inference(self, observation: torch.Tensor) -> NetworkOutput:
        ids = observation[:, 0].to(torch.int64).numpy()
        zero = np.full((len(ids), 2 * S + 1), -1e9)
        zero[:, S] = 0.0
        return self._output(ids, torch.as_tensor(zero))

    def recurrent_inference(self, hidden: torch.Tensor, action: torch.Tensor) -> NetworkOutput:
        ids = (31 * hidden[:, 0].to(torch.int64).numpy() + 7 * action.numpy() + 1) % P
        return self._output(ids, torch.as_tensor(self.reward_logits[ids]))

    def _output(self, ids, reward_logits) -> NetworkOutput:
        return NetworkOutput(torch.as_tensor(self.value_logits[ids]), reward_logits,
                             torch.as_tensor(self.policy_logits[ids]), torch.as_tensor(ids, dtype=torch.float64)[:, None])  # fmt: skip


def qtransform_tree_bounds(tree, node_index, *, value_scale=0.1, maxvisit_init=50.0, epsilon=1e-8):
    """Completed Q-values (mixed value for the unvisited actions, as mctx's
    ``qtransform_completed_by_mix_value``) rescaled to [0, 1] by the bounds of the whole
    tree: every visited edge's ``r + discount * v(child)``, and the node's completed values."""
    qvalues = tree.qvalues(node_index)
    visits = tree.children_visits[node_index]
    prior = jax.nn.softmax(tree.children_prior_logits[node_index])
    mixed = qtransforms._compute_mixed_value(tree.raw_values[node_index], qvalues=qvalues, visit_counts=visits,
                                             prior_probs=prior)  # fmt: skip
    completed = jnp.where(visits > 0, qvalues, mixed)
    edge_q = tree.children_rewards + tree.children_discounts * tree.children_values
    visited = tree.children_visits > 0
    low = jnp.minimum(jnp.min(jnp.where(visited, edge_q, jnp.inf)), jnp.min(completed))
    high = jnp.maximum(jnp.max(jnp.where(visited, edge_q, -jnp.inf)), jnp.max(completed))
    scaled = (completed - low) / jnp.maximum(high - low, epsilon)
    return (maxvisit_init + jnp.max(visits)) * value_scale * scaled


def run_mctx(model: TableModel, roots: np.ndarray, legal: np.ndarray, key, num_simulations: int, m: int,
             discount: float, two_player: bool, gumbel_scale: float, q_bounds: str = "node"):  # fmt: skip
    table_logits = jnp.asarray(model.policy_logits)
    table_values = jnp.asarray(model.values)
    table_rewards = jnp.asarray(model.rewards)
    step_discount = -discount if two_player else discount

    def recurrent_fn(params, rng_key, action, embedding):
        nxt = (31 * embedding + 7 * action + 1) % P
        out = mctx.RecurrentFnOutput(reward=table_rewards[nxt], discount=jnp.full(nxt.shape, step_discount),
                                     prior_logits=table_logits[nxt], value=table_values[nxt])  # fmt: skip
        return out, nxt

    ids = jnp.asarray(roots, dtype=jnp.int64)
    root = mctx.RootFnOutput(prior_logits=table_logits[ids], value=table_values[ids], embedding=ids)
    output = mctx.gumbel_muzero_policy(
        params=(), rng_key=key, root=root, recurrent_fn=recurrent_fn, num_simulations=num_simulations,
        invalid_actions=jnp.asarray(~legal), max_num_considered_actions=m, gumbel_scale=gumbel_scale,
        qtransform=qtransform_tree_bounds if q_bounds == "tree" else qtransforms.qtransform_completed_by_mix_value,
    )  # fmt: skip
    visits = output.search_tree.summary().visit_counts
    return np.asarray(output.action), np.asarray(visits), np.asarray(output.action_weights)


def mctx_gumbel(key, shape, scale):
    """The noise gumbel_muzero_policy draws from ``key``."""
    _, gumbel_rng = jax.random.split(key)
    return np.asarray(scale * jax.random.gumbel(gumbel_rng, shape=shape, dtype=jnp.float64))


@pytest.fixture(scope="module", autouse=True)
def _x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


# Each case compiles mctx's search anew (seconds), so few cases, each varying several things.
CASES = [
    # (num_actions, num_simulations, m, two_player, some illegal root actions, gumbel scale, Q bounds)
    (2, 8, 16, False, False, 1.0, "node"),  # CartPole's shape: m > A, every action considered
    (5, 16, 4, False, True, 1.0, "node"),  # Sequential Halving from 4 of 5 actions, masks
    (9, 16, 16, True, True, 1.0, "node"),  # TicTacToe's shape: two players, masks
    (6, 50, 3, False, True, 1.0, "node"),  # a deep search, halving from 3
    (9, 8, 4, True, False, 0.0, "node"),  # no noise: the greedy choice
    (2, 8, 16, False, False, 1.0, "tree"),  # the tree's bounds: CartPole's shape
    (9, 16, 16, True, True, 1.0, "tree"),  # two players, masks
    (6, 50, 3, False, True, 0.0, "tree"),  # deep, no noise
]


@pytest.mark.slow  # each case compiles mctx's search (seconds)
@pytest.mark.parametrize("num_actions,num_simulations,m,two_player,masked,scale,q_bounds", CASES)
def test_gumbel_search_matches_mctx(num_actions, num_simulations, m, two_player, masked, scale, q_bounds):
    seed = 1000 * num_actions + num_simulations + 7 * m
    model = TableModel(num_actions, seed)
    k_roots = 24
    rng = np.random.default_rng(seed)
    roots = rng.integers(0, P, k_roots)
    legal = np.ones((k_roots, num_actions), bool)
    if masked:
        legal = rng.random((k_roots, num_actions)) < 0.6
        legal[np.arange(k_roots), rng.integers(0, num_actions, k_roots)] = True
    discount = 1.0 if two_player else 0.97
    key = jax.random.PRNGKey(seed)
    want_action, want_visits, want_weights = run_mctx(model, roots, legal, key, num_simulations, m, discount,
                                                      two_player, scale, q_bounds)  # fmt: skip

    config = MCTSConfig(kind="gumbel", num_simulations=num_simulations, discount=discount,
                        max_num_considered_actions=m, gumbel_scale=scale, gumbel_q_bounds=q_bounds)  # fmt: skip
    search = GumbelMCTS(num_actions, config, S, two_player=two_player)
    noise = mctx_gumbel(key, (k_roots, num_actions), scale)
    result = search.run(model, roots[:, None].astype(np.float32), legal, np.zeros(k_roots, np.int64),
                        True, np.random.default_rng(0), root_noise=noise)  # fmt: skip

    if scale == 0.0:  # no noise: the same search whatever the generator
        again = search.run(model, roots[:, None].astype(np.float32), legal, np.zeros(k_roots, np.int64),
                           False, np.random.default_rng(1))  # fmt: skip
        np.testing.assert_array_equal(again.actions, result.actions)
        np.testing.assert_array_equal(again.visit_counts, result.visit_counts)
    np.testing.assert_array_equal(result.visit_counts, want_visits)
    np.testing.assert_array_equal(result.actions, want_action)
    np.testing.assert_allclose(result.policy_target, want_weights, rtol=1e-6, atol=1e-9)
    assert legal[np.arange(k_roots), result.actions].all()
    assert (result.policy_target[~legal] == 0).all()
    assert result.visit_counts.sum(axis=1).tolist() == [num_simulations] * k_roots


def test_sequential_halving_schedule_is_mctx_s():
    for m in (1, 2, 3, 4, 9, 16):
        for n in (1, 2, 5, 8, 16, 25, 50, 200):
            assert considered_visits(m, n) == list(seq_halving.get_sequence_of_considered_visits(m, n)), (m, n)


def test_the_improved_policy_improves_on_the_prior_in_a_bandit():
    """As many simulations as actions: each root action is visited once, so its Q is the
    one-step ``r + discount * v(child)`` of the table. The policy target then puts more
    weight on higher Q than the prior does on every root (the paper's policy improvement)."""
    model = TableModel(6, 11, value_spread=4.0)
    roots = np.arange(200) * 13 % P
    config = MCTSConfig(kind="gumbel", num_simulations=6, discount=0.97, max_num_considered_actions=6)
    result = GumbelMCTS(6, config, S).run(model, roots[:, None].astype(np.float32), np.ones((200, 6), bool),
                                          np.zeros(200), True, np.random.default_rng(0))  # fmt: skip
    assert (result.visit_counts == 1).all()
    children = (31 * roots[:, None] + 7 * np.arange(6)[None, :] + 1) % P
    q = model.rewards[children] + 0.97 * model.values[children]
    prior = torch.softmax(torch.as_tensor(model.policy_logits[roots]), 1).numpy()
    improved = (result.policy_target * q).sum(1)
    baseline = (prior * q).sum(1)
    assert (improved >= baseline - 1e-9).all()
    assert improved.mean() > baseline.mean() + 0.2 * q.std()
    # and the chosen action is the best one more often than the prior would pick it
    best = q.argmax(1)
    assert (result.actions == best).mean() > prior[np.arange(200), best].mean() + 0.1


def test_make_search_picks_the_kind():
    assert isinstance(make_search(2, MCTSConfig(kind="gumbel"), S), GumbelMCTS)
    assert type(make_search(2, MCTSConfig(), S)).__name__ == "BatchedMCTS"


# --------------------------------------------------------------------------------------
# In the player, the arena and a run
# --------------------------------------------------------------------------------------


def gumbel_player_config(simulations: int = 4):
    import dataclasses

    from test_selfplay import make_config

    c = make_config()
    mcts = dataclasses.replace(c.mcts, kind="gumbel", num_simulations=simulations)
    return dataclasses.replace(c, mcts=mcts)


class _Recording:
    """Wraps a search and keeps each result the player acted on."""

    def __init__(self, inner):
        self.inner, self.results = inner, []

    def run(self, *args, **kwargs):
        self.results.append(self.inner.run(*args, **kwargs))
        self.noise = args[4]  # add_exploration_noise
        return self.results[-1]


def recorded_gumbel_player(num_envs: int, explore: bool, seed: int, torch_seed: int, simulations: int = 4):
    """A BatchedPlayer with Gumbel search on CartPole, its search calls recorded:
    (player, recording, network)."""
    import gymnasium as gym

    from mpper.algos.muzero.networks import make_network
    from mpper.algos.muzero.player import BatchedPlayer

    config = gumbel_player_config(simulations)
    torch.manual_seed(torch_seed)
    net = make_network(config.network, (4,), 2).eval()
    player = BatchedPlayer(config, [gym.make("CartPole-v1") for _ in range(num_envs)], net, explore=explore, seed=seed)
    player.mcts = recording = _Recording(player.mcts)
    return player, recording, net


def recorded_step(player, recording):
    """One player step: (the episodes played, each one's action count before the step,
    the step's search result)."""
    before = [len(ep.action) for ep in player.episodes]
    episodes = list(player.episodes)
    player.step()
    return episodes, before, recording.results[-1]


def test_the_player_acts_as_the_search_chose_and_stores_its_improved_policy():
    player, recording, _ = recorded_gumbel_player(4, explore=True, seed=0, torch_seed=0)
    for _ in range(6):
        episodes, before, result = recorded_step(player, recording)
        for k, ep in enumerate(episodes):
            assert ep.action[before[k]] == result.actions[k]
            np.testing.assert_array_equal(ep.child_visits[before[k] - 1], result.policy_target[k])


def test_an_evaluating_player_takes_the_greedy_choice_without_noise():
    player, recording, net = recorded_gumbel_player(3, explore=False, seed=4, torch_seed=1, simulations=8)
    for _ in range(5):
        episodes, before, result = recorded_step(player, recording)
        assert recording.noise is False
        again = recording.inner.run(net, result_inputs(episodes), np.ones((3, 2), bool), np.zeros(3), False,
                                    np.random.default_rng(99))  # fmt: skip
        np.testing.assert_array_equal(again.actions, result.actions)  # no noise: the same choice
        for k, ep in enumerate(episodes):
            assert ep.action[before[k]] == result.actions[k]


def result_inputs(episodes) -> np.ndarray:
    """The network inputs the player searched from: each episode's observation before its last move."""
    return np.stack([ep.observation[-2] for ep in episodes]).astype(np.float32)
