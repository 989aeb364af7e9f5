"""mpper.algos.muzero.mcts: batched search against exact models, muzero-general's semantics, batching,
two-player signs, legal actions, action selection.

``TabularModel`` is an exact "network" for a finite deterministic game: the hidden state
is the state's id, and value, reward and policy come from tables. Its outputs do not
depend on the batch, so batched and single searches must agree bit for bit.
``reference_search`` is muzero-general's MCTS written plainly (one Python object per
node), with mpper's tie rule (larger prior, then larger tie key) in place of a random
choice among tied actions.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from mpper.algos.muzero.config import MCTSConfig, NetworkConfig
from mpper.algos.muzero.mcts import BatchedMCTS, select_action
from mpper.algos.muzero.networks import NetworkOutput, make_network, scalar_to_support, support_to_scalar
from mpper.algos.muzero_family import temperature_at

SUPPORT = 5


class TabularModel(nn.Module):
    """Exact model: ``next_state (S, A)``, ``reward (S, A)``, ``value (S,)``,
    ``policy_logits (S, A)``. Observations and hidden states are (B, 1) state ids."""

    def __init__(self, next_state, reward, value, policy_logits=None):
        super().__init__()
        next_state = torch.as_tensor(np.asarray(next_state), dtype=torch.long)
        n_states, n_actions = next_state.shape
        self.next_state = next_state
        # Logits whose softmax is the two-hot of the scalar (log 0 clamped to stay finite).
        def logits(x):
            return torch.log(scalar_to_support(torch.as_tensor(np.asarray(x), dtype=torch.float32).reshape(-1), SUPPORT)).clamp(min=-50)
        self.reward_logits = logits(reward).reshape(n_states, n_actions, -1)
        self.value_logits = logits(value)
        self.zero_reward = logits(np.zeros(1))
        pl = np.zeros((n_states, n_actions)) if policy_logits is None else np.asarray(policy_logits)
        self.policy_logits = torch.as_tensor(pl, dtype=torch.float32)

    def initial_inference(self, observation):
        s = observation[:, 0].long()
        return NetworkOutput(self.value_logits[s], self.zero_reward.expand(len(s), -1), self.policy_logits[s], observation.clone())

    def recurrent_inference(self, hidden_state, action):
        s = hidden_state[:, 0].long()
        nxt = self.next_state[s, action]
        return NetworkOutput(self.value_logits[nxt], self.reward_logits[s, action], self.policy_logits[nxt], nxt[:, None].float())


def search(model, states, legal, num_simulations, two_player=False, to_play=None, discount=0.997, **kw):
    """Search from ``states`` (state ids) without noise."""
    states = np.asarray(states)
    mcts = BatchedMCTS(np.asarray(legal).shape[1], MCTSConfig(num_simulations=num_simulations, discount=discount), SUPPORT, two_player)
    to_play = np.zeros(len(states), int) if to_play is None else to_play
    return mcts.run(model, states[:, None].astype(np.float32), np.asarray(legal, bool), to_play, False, np.random.default_rng(0), **kw)


# ---- exact models: the search finds the best action ------------------------------------


def test_one_step_game_picks_the_rewarding_action():
    # State 0: action 2 pays 1, actions 0 and 1 pay 0; everything then ends in state 1.
    # Priors favour action 0, so the search has to find action 2 by its reward.
    model = TabularModel(next_state=[[1, 1, 1], [1, 1, 1]], reward=[[0, 0, 1], [0, 0, 0]], value=[0, 0],
                         policy_logits=[[1.0, 0.5, 0.0], [0, 0, 0]])  # fmt: skip
    result = search(model, [0], np.ones((1, 3)), num_simulations=30)
    assert result.visit_counts.sum() == 30
    assert result.visit_counts[0].argmax() == 2
    assert result.visit_counts[0, 2] > 20
    assert np.isclose(result.child_visits.sum(), 1.0)
    assert result.root_values[0] > 0.5  # most simulations went through the reward


def test_two_step_chain_finds_the_delayed_payoff():
    # State 0: action 0 pays 0.5 now (state 1, a dead end); action 1 pays nothing now but
    # leads to state 2, where action 1 pays 1; action 2 leads to a dead end. State 4 ends.
    # Best first action: 1 (0.997 * 1 > 0.5), although action 0 is better greedily and
    # preferred by the priors. The model's values are 0, so only the search can see the
    # payoff; and since an unvisited child scores Q = 0 (muzero-general), which min-max
    # normalisation puts at the bottom, the search needs a few hundred simulations before
    # pUCT's exploration term revisits action 1 often enough (about 200 here).
    next_state = [[1, 2, 3], [4, 4, 4], [4, 4, 4], [4, 4, 4], [4, 4, 4]]
    reward = np.zeros((5, 3))
    reward[0, 0] = 0.5
    reward[2, 1] = 1.0
    policy = np.zeros((5, 3))
    policy[0] = [1.0, 0.0, 0.0]
    model = TabularModel(next_state, reward, np.zeros(5), policy)
    few = search(model, [0], np.ones((1, 3)), num_simulations=50)
    assert few.visit_counts[0].argmax() == 0
    result = search(model, [0], np.ones((1, 3)), num_simulations=400)
    assert result.visit_counts[0].argmax() == 1
    # The search value of the root moves towards the best return, 0.997.
    assert few.root_values[0] < 0.6 < result.root_values[0] <= 0.997 + 1e-6


def nim(max_stones: int) -> TabularModel:
    """Take 1 (action 0) or 2 (action 1) stones; taking the last stone pays 1 to the mover
    (rewards are from the mover's view, as in muzero-general). State n: n stones left;
    state 0: the game is over. Values 0 (the search has to find the win); priors favour
    the wrong move in the tested positions (taking 2 from 4, taking 1 from 5)."""
    n = max_stones + 1
    next_state = np.array([[max(s - 1, 0), max(s - 2, 0)] for s in range(n)])
    reward = np.array([[float(s > 0 and s - take <= 0) for take in (1, 2)] for s in range(n)])
    policy = np.zeros((n, 2))
    policy[4] = [0.0, 1.0]
    policy[5] = [1.0, 0.0]
    return TabularModel(next_state, reward, np.zeros(n), policy)


@pytest.mark.parametrize("stones, winning_action", [(4, 0), (5, 1), (2, 1), (1, 0)])
def test_two_player_search_finds_the_winning_move(stones, winning_action):
    # From 4 take 1 and from 5 take 2 (leave 3: every reply loses); from 2 take both;
    # from 1 the only legal move (taking 2 is illegal with one stone) wins.
    legal = np.array([[True, stones >= 2]])
    for to_play in (0, 1):  # the answer does not depend on who is to move
        result = search(nim(6), [stones], legal, 200, two_player=True, to_play=np.array([to_play]), discount=1.0)
        assert result.visit_counts[0].argmax() == winning_action
        assert result.root_values[0] > 0  # the player to move wins
    # A losing position has a negative value for the player to move.
    lost = search(nim(6), [3], np.ones((1, 2), bool), 200, two_player=True, discount=1.0)
    assert lost.root_values[0] < 0


def test_two_player_signs_matter():
    # Searched as a one-player game, Nim from 4 looks like a sum of rewards for "both
    # sides": taking 2 then 2 also collects the final reward, so the answer is wrong.
    one = search(nim(6), [4], np.ones((1, 2), bool), 200, two_player=False, discount=1.0)
    two = search(nim(6), [4], np.ones((1, 2), bool), 200, two_player=True, discount=1.0)
    assert two.visit_counts[0].argmax() == 0
    assert not np.array_equal(one.visit_counts, two.visit_counts)


# ---- batching --------------------------------------------------------------------------


def random_tabular(rng, n_states=40, n_actions=4) -> TabularModel:
    return TabularModel(
        next_state=rng.integers(0, n_states, size=(n_states, n_actions)),
        reward=rng.normal(size=(n_states, n_actions)).round(2),
        value=rng.normal(size=n_states).round(2) * 2,
        policy_logits=rng.normal(size=(n_states, n_actions)),
    )


@pytest.mark.parametrize("two_player", [False, True])
def test_batched_search_equals_single_searches(two_player):
    rng = np.random.default_rng(1)
    model = random_tabular(rng)
    k_envs, n_actions = 12, 4
    states = rng.integers(0, 40, size=k_envs)
    legal = rng.random((k_envs, n_actions)) < 0.7
    legal[~legal.any(1), 0] = True
    to_play = rng.integers(0, 2, size=k_envs) if two_player else np.zeros(k_envs, int)
    mcts = BatchedMCTS(n_actions, MCTSConfig(num_simulations=40), SUPPORT, two_player)
    noise = mcts.sample_root_noise(legal, rng)
    assert np.allclose(noise.sum(1), 1) and (noise[~legal] == 0).all()
    ties = rng.random(legal.shape)
    obs = states[:, None].astype(np.float32)
    batched = mcts.run(model, obs, legal, to_play, True, rng, root_noise=noise, tie_break=ties)
    for k in range(k_envs):
        single = mcts.run(model, obs[k : k + 1], legal[k : k + 1], to_play[k : k + 1], True, rng,
                          root_noise=noise[k : k + 1], tie_break=ties[k : k + 1])
        assert np.array_equal(single.visit_counts[0], batched.visit_counts[k])
        assert single.root_values[0] == batched.root_values[k]
    # The noise was used: without it the visits differ somewhere.
    plain = mcts.run(model, obs, legal, to_play, False, rng)
    assert not np.array_equal(plain.visit_counts, batched.visit_counts)


# ---- muzero-general's semantics, node by node ------------------------------------------


class Node:
    def __init__(self, prior: float):
        self.prior = prior
        self.visit_count = 0
        self.value_sum = 0.0
        self.reward = 0.0
        self.to_play = -1
        self.children: dict[int, Node] = {}
        self.hidden_state = None

    def value(self) -> float:
        return 0.0 if self.visit_count == 0 else self.value_sum / self.visit_count


def reference_search(network, observation, legal_actions, to_play, cfg: MCTSConfig, support_size, two_player, noise,
                     tie_keys):
    """muzero-general's MCTS.run / select_child / ucb_score / backpropagate for one root,
    with exact ties going to the larger prior, then the larger ``tie_keys[a]``, instead
    of a random one of them."""
    scalar = lambda logits: float(support_to_scalar(logits.double(), support_size)[0])
    out = network.initial_inference(torch.as_tensor(observation[None], dtype=torch.float32))
    root = Node(0.0)
    actions = [a for a in range(len(legal_actions)) if legal_actions[a]]
    root.to_play, root.reward, root.hidden_state = to_play, 0.0, out.hidden_state
    priors = torch.softmax(out.policy_logits[0, actions].double(), 0).tolist()
    for a, p in zip(actions, priors):
        root.children[a] = Node(p)
    if noise is not None:
        for a in actions:
            root.children[a].prior = root.children[a].prior * (1 - cfg.root_exploration_fraction) + noise[a] * cfg.root_exploration_fraction
    lo, hi = math.inf, -math.inf

    def normalize(v):
        return (v - lo) / (hi - lo) if hi > lo else v

    def ucb(parent, child):
        pb_c = math.log((parent.visit_count + cfg.pb_c_base + 1) / cfg.pb_c_base) + cfg.pb_c_init
        pb_c *= math.sqrt(parent.visit_count) / (child.visit_count + 1)
        value_score = 0.0
        if child.visit_count > 0:
            value_score = normalize(child.reward + cfg.discount * (-child.value() if two_player else child.value()))
        return pb_c * child.prior + value_score

    for _ in range(cfg.num_simulations):
        node, path, virtual_to_play = root, [root], to_play
        while node.children and node.hidden_state is not None:
            scores = {a: ucb(node, c) for a, c in node.children.items()}
            action = max(scores, key=lambda a: (scores[a], node.children[a].prior, tie_keys[a]))
            node = node.children[action]
            path.append(node)
            virtual_to_play = 1 - virtual_to_play if two_player else virtual_to_play
        parent = path[-2]
        out = network.recurrent_inference(parent.hidden_state, torch.tensor([action]))
        value = scalar(out.value_logits)
        node.to_play, node.reward, node.hidden_state = virtual_to_play, scalar(out.reward_logits), out.hidden_state
        for a, p in enumerate(torch.softmax(out.policy_logits[0].double(), 0).tolist()):
            node.children[a] = Node(p)
        for n in reversed(path):  # backpropagate
            if two_player:
                n.value_sum += value if n.to_play == virtual_to_play else -value
                n.visit_count += 1
                q = n.reward + cfg.discount * -n.value()
                value = (-n.reward if n.to_play == virtual_to_play else n.reward) + cfg.discount * value
            else:
                n.value_sum += value
                n.visit_count += 1
                q = n.reward + cfg.discount * n.value()
                value = n.reward + cfg.discount * value
            lo, hi = min(lo, q), max(hi, q)
    visits = [root.children[a].visit_count if a in root.children else 0 for a in range(len(legal_actions))]
    return np.array(visits), root.value()


@pytest.mark.parametrize("two_player", [False, True])
def test_matches_muzero_general_reference(two_player):
    """Same visits and root value as the plain per-node implementation, on a random
    fully connected MuZero network (one root at a time, so both see identical outputs)."""
    torch.manual_seed(0)
    net = make_network(NetworkConfig(encoding_size=8, hidden=[32], support_size=SUPPORT), (3,), 4).eval()
    cfg = MCTSConfig(num_simulations=30, discount=0.9)
    mcts = BatchedMCTS(4, cfg, SUPPORT, two_player)
    rng = np.random.default_rng(2)
    for trial in range(3):
        obs = rng.normal(size=(1, 3)).astype(np.float32) * 2
        legal = np.array([[True, trial != 1, True, trial != 2]])
        to_play = np.array([trial % 2])
        noise = mcts.sample_root_noise(legal, rng)
        ties = rng.random(legal.shape)
        result = mcts.run(net, obs, legal, to_play, True, rng, root_noise=noise, tie_break=ties)
        with torch.no_grad():
            visits, root_value = reference_search(net, obs[0], legal[0], int(to_play[0]), cfg, SUPPORT, two_player,
                                                  noise[0], ties[0])
        assert np.array_equal(result.visit_counts[0], visits)
        assert np.isclose(result.root_values[0], root_value, rtol=1e-6, atol=1e-6)


# ---- legal actions, results ------------------------------------------------------------


def test_illegal_actions_are_never_visited_at_the_root():
    torch.manual_seed(1)
    net = make_network(NetworkConfig(encoding_size=8, hidden=[16]), (4,), 5).eval()
    rng = np.random.default_rng(3)
    k_envs = 16
    legal = rng.random((k_envs, 5)) < 0.4
    legal[~legal.any(1), 3] = True
    legal[0] = [False, False, False, False, True]  # a single legal action gets every visit
    mcts = BatchedMCTS(5, MCTSConfig(num_simulations=40, root_exploration_fraction=0.5), 10)
    obs = rng.normal(size=(k_envs, 4)).astype(np.float32)
    for noise in (True, False):
        result = mcts.run(net, obs, legal, np.zeros(k_envs, int), noise, rng)
        assert (result.visit_counts[~legal] == 0).all()
        assert (result.child_visits[~legal] == 0).all()
        assert np.allclose(result.child_visits.sum(1), 1.0)
        assert (result.visit_counts.sum(1) == 40).all()
        assert result.visit_counts[0, 4] == 40
        assert result.root_values.shape == result.root_predicted_values.shape == (k_envs,)
        assert np.isfinite(result.root_values).all()


def test_no_legal_action_is_an_error():
    net = make_network(NetworkConfig(encoding_size=4, hidden=[8]), (4,), 2).eval()
    mcts = BatchedMCTS(2, MCTSConfig(num_simulations=2), 10)
    with pytest.raises(ValueError, match="no legal action"):
        mcts.run(net, np.zeros((2, 4), np.float32), np.array([[1, 1], [0, 0]], bool), np.zeros(2, int), False, np.random.default_rng())


# ---- acting ----------------------------------------------------------------------------


def test_select_action_temperatures():
    rng = np.random.default_rng(0)
    counts = np.array([[10, 30, 0, 10], [5, 5, 0, 0]])
    greedy = np.array([select_action(counts, 0.0, rng) for _ in range(200)])
    assert (greedy[:, 0] == 1).all()
    assert set(greedy[:, 1]) == {0, 1}  # ties broken at random
    many = np.array([select_action(counts, 1.0, rng) for _ in range(4000)])
    freq = np.bincount(many[:, 0], minlength=4) / len(many)
    assert np.allclose(freq, counts[0] / counts[0].sum(), atol=0.03)
    assert (many != 2).all()  # never an unvisited action
    sharp = np.array([select_action(counts, 0.25, rng) for _ in range(2000)])
    assert (sharp[:, 0] == 1).mean() > 0.95  # 30^4 / (2 * 10^4 + 30^4) = 0.976
    tiny = select_action(np.array([[1000, 999, 0]]), 1e-3, rng)  # (1000/999)^1000: no overflow
    assert tiny[0] in (0, 1)
    uniform = np.array([select_action(counts, float("inf"), rng) for _ in range(2000)])
    assert set(uniform[:, 0]) == {0, 1, 3} and set(uniform[:, 1]) == {0, 1}


def test_temperature_schedule():
    schedule = [[0.0, 1.0], [0.5, 0.5], [0.75, 0.25]]
    assert temperature_at(schedule, 0.0) == 1.0
    assert temperature_at(schedule, 0.49) == 1.0
    assert temperature_at(schedule, 0.5) == 0.5
    assert temperature_at(schedule, 0.9) == 0.25
    assert temperature_at(schedule, 1.0) == 0.25
    assert temperature_at([[0.0, 0.0]], 0.3) == 0.0


# ---- ties: no action index is favoured ------------------------------------------------


def symmetric_two_action_model():
    """Root 0; both actions lead to states worth the same (reward 0, value 1), then to
    an absorbing state; equal priors everywhere, so every comparison at the root of a
    fresh search is an exact tie between the two actions."""
    next_state = np.array([[1, 2], [3, 3], [3, 3], [3, 3]])
    return TabularModel(next_state, reward=np.zeros((4, 2)), value=np.array([0.0, 1.0, 1.0, 1.0]))


@pytest.mark.parametrize("explore", [False, True])
def test_first_simulation_favours_no_action_index(explore):
    """The root has no visit before the first simulation, so all pUCT scores are 0:
    which action is expanded first must not depend on its index. Over 400 roots of a
    model whose two actions are alike, action 0 comes first 200 times in expectation;
    [150, 250] holds with probability 1 - 6e-7 under a fair coin."""
    model = symmetric_two_action_model()
    mcts = BatchedMCTS(2, MCTSConfig(num_simulations=1), SUPPORT)
    roots = 400
    result = mcts.run(model, np.zeros((roots, 1), np.float32), np.ones((roots, 2), bool), np.zeros(roots, int),
                      explore, np.random.default_rng(5))  # fmt: skip
    first_is_0 = int(result.visit_counts[:, 0].sum())
    assert 150 <= first_is_0 <= 250, first_is_0


def test_first_simulation_takes_the_larger_prior():
    """A tie of scores goes to the larger prior (with noise: the noisy prior), as in
    mctx, whose root counts its own first visit."""
    next_state = np.array([[1, 2, 1], [3, 3, 3], [3, 3, 3], [3, 3, 3]])
    logits = np.zeros((4, 3))
    logits[0] = [0.0, 0.0, 0.5]  # action 2 is the most probable at the root
    model = TabularModel(next_state, reward=np.zeros((4, 3)), value=np.zeros(4), policy_logits=logits)
    mcts = BatchedMCTS(3, MCTSConfig(num_simulations=1), SUPPORT)
    result = mcts.run(model, np.zeros((50, 1), np.float32), np.ones((50, 3), bool), np.zeros(50, int), False,
                      np.random.default_rng(0))  # fmt: skip
    assert (result.visit_counts[:, 2] == 1).all()


def test_visit_shares_are_symmetric_on_a_symmetric_model():
    """Two equivalent actions, 25 simulations, no noise: each action leads in about half
    of the roots and gets half of the visits on average (a fixed tie order would put
    the same action ahead at every root)."""
    model = symmetric_two_action_model()
    mcts = BatchedMCTS(2, MCTSConfig(num_simulations=25), SUPPORT)
    roots = 400
    result = mcts.run(model, np.zeros((roots, 1), np.float32), np.ones((roots, 2), bool), np.zeros(roots, int),
                      False, np.random.default_rng(6))  # fmt: skip
    visits = result.visit_counts
    assert (visits.sum(1) == 25).all()
    zero_leads = int((visits[:, 0] > visits[:, 1]).sum())
    one_leads = int((visits[:, 1] > visits[:, 0]).sum())
    assert 150 <= zero_leads <= 250 and 150 <= one_leads <= 250, (zero_leads, one_leads)
    assert abs(visits[:, 0].mean() - visits[:, 1].mean()) < 0.5


def test_tie_break_keys_decide_exact_ties():
    """Given the keys, the outcome is determined: the larger key wins a tie of scores
    and priors."""
    model = symmetric_two_action_model()
    mcts = BatchedMCTS(2, MCTSConfig(num_simulations=1), SUPPORT)
    keys = np.array([[0.9, 0.1], [0.1, 0.9]])
    result = mcts.run(model, np.zeros((2, 1), np.float32), np.ones((2, 2), bool), np.zeros(2, int), False,
                      np.random.default_rng(0), tie_break=keys)  # fmt: skip
    assert result.visit_counts.tolist() == [[1, 0], [0, 1]]
    with pytest.raises(ValueError, match="tie_break"):
        mcts.run(model, np.zeros((2, 1), np.float32), np.ones((2, 2), bool), np.zeros(2, int), False,
                 np.random.default_rng(0), tie_break=np.zeros((2, 3)))  # fmt: skip
