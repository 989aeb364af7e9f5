"""The batched MuZero search tree: K trees, one per root, searched together; the search
policies (pUCT in :mod:`.mcts`, Gumbel MuZero in :mod:`.gumbel`) are small classes over it.

The split is mctx's ``search`` / ``policies``: this module owns everything a search does
whatever its policy, written once: the tree arrays, the root inference, the simulation
loop, expansion and backup, and reading the root's visits into a :class:`SearchResult`.
A policy (a :class:`BatchedSearch` subclass) says only what differs:

* ``draw``: the random inputs of one search, drawn before it starts (pUCT: tie keys and
  Dirichlet noise; Gumbel: the root's Gumbel noise), or given, to replay a search;
* ``root_prior``: the root's priors from the network's (pUCT mixes its noise in);
* ``select``: one compiled kernel that walks every tree from its root to an unexpanded
  child, choosing at each node by the policy's rule and moving with :func:`step_down`;
* ``decide``: after the simulations, the action and the policy target, where the policy
  chooses them (Gumbel) rather than leaving the action to the player's temperature (pUCT).

Layout. Every simulation expands exactly one new node in every tree, so node ``s + 1`` is
the one simulation ``s`` creates, in all K trees at once. A tree is a set of arrays
indexed by (tree, node) or (tree, node, action), preallocated for ``num_simulations + 1``
nodes; ``children[k, n, a]`` is the node reached by action ``a`` from node ``n``, -1 while
that child is not expanded; hidden states stay in one torch tensor (K, nodes, *hidden). A
simulation is:

1. the policy's ``select`` walks each tree down to an unexpanded child: (parent, action,
   path, depth);
2. one ``recurrent_inference`` on the K (parent hidden state, action) pairs;
3. :func:`_expand_and_backup` writes node ``s + 1`` of every tree (reward, value and priors
   from the logits) and backs its value up the K paths.

Values follow muzero-general's ``MCTS`` (``self_play.py``): ``Q(s, a) = r(s, a) + discount
* V(child)`` (``- V(child)`` in two-player games, where a node's value is from the view of
its ``to_play``, which alternates down the tree, and a node's reward from the view of the
player who moved into it); priors are the softmax of the policy logits over the legal
actions at the root and over all actions below it (the model does not know the rules).

With EfficientZero's value prefix (a network whose ``lstm_horizon_len`` is set, see
:mod:`.networks`), each node also keeps the LSTM state that produced its prefix, in a
torch tensor (K, nodes, 2, H) beside the hidden states (an inference server's network:
tokens, zeros naming the zero state); step 2 passes the parent's, zeros
where the parent's depth is a multiple of ``lstm_horizon_len`` (the root included), and
step 3 stores the prefix and sets the node's reward to ``prefix(node) - prefix(parent)``,
or ``prefix(node)`` where the parent's state was reset (EfficientZero's ctree,
``is_reset``). Everything after expansion reads rewards as ever.

Why numba for steps 1 and 3: the work per tree level is tiny (K x A numbers), so
vectorised numpy over K with a Python loop over depth paid a few dozen calls of fixed
overhead per level and most of a search went to tree bookkeeping, the more so with the
deep trees of a trained network's peaked priors. The kernels do the same loops per tree
in compiled code, so the network's inference is most of a search's time
(``bench/mcts_speed.py``). They are cached on disk (``cache=True``): a fresh process
loads them quickly, only the very first compile takes seconds. A policy's ``select`` is
its own kernel rather than a function handed to a shared walk because numba's disk cache
never serves a kernel that takes another as an argument (the argument's type carries its
address): every process would compile it again.

The network runs under ``torch.inference_mode()`` on whatever device its parameters are on
(self-play keeps it on the CPU); hidden states never leave torch. Per simulation the only
torch -> numpy transfer is one (K, 2(2S+1) + A) array of logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from ..muzero_family import EPS, support_to_scalar
from .config import MCTSConfig

__all__ = ["BatchedSearch", "SearchResult", "Tree", "step_down"]


@dataclass
class SearchResult:
    root_values: np.ndarray  # (K,) float64: mean backed-up value of the root (muzero-general's root.value())
    child_visits: np.ndarray  # (K, A) float64: root visit distribution, sums to 1, 0 on illegal actions
    visit_counts: np.ndarray  # (K, A) int64: visits of each root child
    root_predicted_values: np.ndarray  # (K,) float64: the network's value of the root observation (no search)
    max_tree_depth: int  # deepest search path in the batch, in edges (diagnostics)
    # (K, A) float64: what the policy head learns from this search (stored as the row's
    # child_visits): the visit distribution for pUCT, the improved policy for Gumbel.
    policy_target: np.ndarray
    # (K,) int64: the action the search chose (Gumbel); None: the player picks from the
    # visit counts with its temperature (pUCT).
    actions: np.ndarray | None = None


class Tree:
    """K search trees of ``num_nodes`` nodes each (node 0 is the root), as arrays.

    Per node (K, num_nodes): ``visit_count`` int64, ``value_sum``, ``reward`` (the root's
    stays 0), ``raw_value`` (the network's value of the node, before any backup; Gumbel's
    completed Q-values need it), ``node_to_play`` int64, ``value_prefix`` (the network's
    value prefix of the node, with a value prefix; else 0). Per edge (K, num_nodes, A):
    ``prior``, ``children`` int64 (-1: not expanded). Per tree (K,): ``q_min``/``q_max``,
    the min-max statistics of every Q the backup has seen (pUCT's ``MinMaxStats``).
    The walk of the current simulation, written by a policy's ``select``: ``path``
    (K, num_nodes + 1), the nodes from the root; ``depth`` (K,), the new leaf's depth in
    edges; ``parent`` and ``action`` (K,), the node expanded and the action taken there.
    All float arrays are float64.
    """

    def __init__(self, k_trees: int, num_nodes: int, legal: np.ndarray, to_play: np.ndarray):
        num_actions = legal.shape[1]
        self.legal = legal  # (K, A) bool: the root's legal actions
        self.visit_count = np.zeros((k_trees, num_nodes), dtype=np.int64)
        self.value_sum = np.zeros((k_trees, num_nodes))
        self.reward = np.zeros((k_trees, num_nodes))  # the root's stays 0: the support of 0
        self.raw_value = np.zeros((k_trees, num_nodes))
        self.value_prefix = np.zeros((k_trees, num_nodes))  # the root's stays 0: nothing summed yet
        self.node_to_play = np.zeros((k_trees, num_nodes), dtype=np.int64)
        self.node_to_play[:, 0] = np.asarray(to_play, dtype=np.int64).reshape(k_trees)
        self.prior = np.zeros((k_trees, num_nodes, num_actions))
        self.children = np.full((k_trees, num_nodes, num_actions), -1, dtype=np.int64)
        self.q_min = np.full(k_trees, np.inf)
        self.q_max = np.full(k_trees, -np.inf)
        self.path = np.zeros((k_trees, num_nodes + 1), dtype=np.int64)  # path[k, d]: node at depth d
        self.depth = np.zeros(k_trees, dtype=np.int64)
        self.parent = np.zeros(k_trees, dtype=np.int64)
        self.action = np.zeros(k_trees, dtype=np.int64)

    def root_visit_counts(self) -> np.ndarray:
        """(K, A) int64: the visits of each root child; 0 where never expanded (e.g. illegal)."""
        root_children = self.children[:, 0]
        visits = np.take_along_axis(self.visit_count, np.maximum(root_children, 0), 1)
        return np.where(root_children >= 0, visits, 0)


class BatchedSearch:
    """A MuZero search over K roots at once, whose policy a subclass supplies.

    Args:
        num_actions: A, the size of the action space (actions are 0 .. A-1).
        config: the search's constants, discount and ``num_simulations``.
        support_size: S of the network's value/reward supports.
        two_player: the players alternate (0, 1, 0, ...) down the tree and values are
            negated between plies; otherwise one player and no sign flips.
    """

    def __init__(self, num_actions: int, config: MCTSConfig, support_size: int, two_player: bool = False):
        if config.num_simulations < 1:
            raise ValueError(f"mcts.num_simulations must be >= 1, got {config.num_simulations}")
        self.num_actions = num_actions
        self.config = config
        self.support_size = support_size
        self.two_player = two_player
        self.value_sign = -1.0 if two_player else 1.0  # V(child) as seen from the parent

    # ---- the policy: what a subclass supplies ---------------------------------------

    def draw(self, legal: np.ndarray, add_exploration_noise: bool, rng: np.random.Generator,
             root_noise: np.ndarray | None, tie_break: np.ndarray | None):  # fmt: skip
        """The random inputs of one search (any object the other three methods read),
        from ``rng`` or, where given, from ``root_noise`` and ``tie_break``."""
        raise NotImplementedError

    def root_prior(self, prior: np.ndarray, legal: np.ndarray, draws) -> np.ndarray:
        """The root priors (K, A) float64 the search starts from; ``prior``: the network's,
        softmax over the legal actions."""
        raise NotImplementedError

    def select(self, tree: Tree, draws) -> int:
        """Walk every tree to an unexpanded child, writing ``tree.path``, ``depth``,
        ``parent`` and ``action``; returns the deepest new leaf's depth (in edges)."""
        raise NotImplementedError

    def decide(self, tree: Tree, draws) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(policy target (K, A) float64, actions (K,) int64) after the simulations; None
        for either: the visit distribution, the player's choice from the visits."""
        raise NotImplementedError

    # ---- the search -----------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self,
        network,
        observations: np.ndarray,
        legal_actions: np.ndarray,
        to_play: np.ndarray,
        add_exploration_noise: bool,
        rng: np.random.Generator,
        root_noise: np.ndarray | None = None,
        tie_break: np.ndarray | None = None,
    ) -> SearchResult:
        """Search K roots with ``config.num_simulations`` simulations each.

        Args:
            network: anything with ``initial_inference(obs)`` and
                ``recurrent_inference(hidden, action)`` returning a ``NetworkOutput``
                (value and reward as support logits (K, 2S+1), policy logits (K, A)),
                e.g. a ``MuZeroNetwork`` in eval mode (BatchNorm!). One with a value
                prefix (``lstm_horizon_len`` set) takes and returns the LSTM state too
                (``recurrent_inference(hidden, action, reward_state)``); one-player only.
            observations: (K, *observation_shape) float32, stacked as the network expects.
            legal_actions: (K, A) bool; every row needs at least one legal action.
            to_play: (K,) int, the player to move at each root: 0 or 1 in two-player
                games (the player below a node is the other one), anything (0) otherwise.
            add_exploration_noise: explore with the policy's root noise.
            rng: draws what the search draws (not what ``root_noise``/``tie_break`` give).
            root_noise: optional (K, A) root noise, in the policy's terms, used instead of
                drawing it when ``add_exploration_noise``, to replay a search exactly.
            tie_break: optional (K, A) float keys for the policy's exact ties (pUCT).
        """
        num_sims, support_size = self.config.num_simulations, self.support_size
        legal = np.ascontiguousarray(legal_actions, dtype=bool)
        k_trees = legal.shape[0]
        if legal.ndim != 2 or legal.shape[1] != self.num_actions:
            raise ValueError(f"legal_actions must be (K, {self.num_actions}) bool, got shape {legal.shape}")
        if not legal.any(axis=1).all():
            raise ValueError(f"legal_actions: roots {np.flatnonzero(~legal.any(axis=1)).tolist()} have no legal action")
        horizon = int(getattr(network, "lstm_horizon_len", None) or 0)  # the value prefix's; 0: none
        if horizon and self.two_player:
            raise ValueError("a network with a value prefix (muzero.value_prefix) cannot search a two-player game")
        draws = self.draw(legal, add_exploration_noise, rng, root_noise, tie_break)
        param = next(iter(network.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        tree = Tree(k_trees, num_sims + 1, legal, to_play)

        # Root: initial inference; priors = softmax over the legal actions (then the policy's).
        out = network.initial_inference(torch.as_tensor(np.asarray(observations, dtype=np.float32), device=device))
        logits = out.policy_logits.masked_fill(~torch.as_tensor(legal, device=device), -torch.inf)
        root_t = torch.cat([support_to_scalar(out.value_logits, support_size)[:, None], torch.softmax(logits, dim=1)], 1)
        root = root_t.cpu().numpy().astype(np.float64)
        tree.raw_value[:, 0] = root[:, 0]
        tree.prior[:, 0] = self.root_prior(root[:, 1:], legal, draws)
        hidden_shape = (k_trees, num_sims + 1, *out.hidden_state.shape[1:])
        hidden = torch.empty(hidden_shape, dtype=out.hidden_state.dtype, device=device)
        hidden[:, 0] = out.hidden_state
        reward_states = None  # (K, nodes, 2, H): each node's LSTM state, with a value prefix
        if horizon:
            reward_states = out.reward_state.new_empty((k_trees, num_sims + 1, *out.reward_state.shape[1:]))
            reward_states[:, 0] = out.reward_state

        trees_t = torch.arange(k_trees, device=device)
        parent_t, action_t = torch.from_numpy(tree.parent), torch.from_numpy(tree.action)  # views, refreshed by select
        max_tree_depth = 0
        for sim in range(num_sims):
            max_tree_depth = max(max_tree_depth, self.select(tree, draws))
            if reward_states is None:
                out = network.recurrent_inference(hidden[trees_t, parent_t.to(device)], action_t.to(device))
            else:
                parents = parent_t.to(device)
                # the parent's LSTM state, zeros where the parent sits at a reset depth
                at_reset = torch.from_numpy((tree.depth - 1) % horizon == 0).to(device)
                state = reward_states[trees_t, parents]
                state = state.masked_fill(at_reset.view(-1, *[1] * (state.dim() - 1)), 0)
                out = network.recurrent_inference(hidden[trees_t, parents], action_t.to(device), state)
                reward_states[:, sim + 1] = out.reward_state
            hidden[:, sim + 1] = out.hidden_state
            logits = torch.cat([out.value_logits, out.reward_logits, out.policy_logits], 1).cpu().numpy()
            _expand_and_backup(
                sim + 1, logits, support_size, tree.parent, tree.action, tree.path, tree.depth, self.two_player,
                self.config.discount, tree.children, tree.visit_count, tree.value_sum, tree.reward, tree.node_to_play,
                tree.prior, tree.q_min, tree.q_max, tree.raw_value, horizon, tree.value_prefix,
            )  # fmt: skip

        policy_target, actions = self.decide(tree, draws)
        visit_counts = tree.root_visit_counts()
        child_visits = visit_counts / visit_counts.sum(axis=1, keepdims=True)
        return SearchResult(
            root_values=tree.value_sum[:, 0] / tree.visit_count[:, 0],
            child_visits=child_visits,
            visit_counts=visit_counts,
            root_predicted_values=root[:, 0],
            max_tree_depth=max_tree_depth,
            policy_target=child_visits if policy_target is None else policy_target,
            actions=actions,
        )


# --------------------------------------------------------------------------------------
# Kernels (compiled; one call per simulation for all K trees)
# --------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True, inline="always")
def step_down(k, node, best, d, children, path, depth, parent, action):
    """One step of tree ``k``'s walk, from ``node`` at depth ``d`` along action ``best``:
    (the child, ``d + 1``), the child entered as ``path[k, d + 1]``; or, where that child
    is not expanded yet, (-1, ``d + 1``) after writing the new leaf's ``parent[k]``,
    ``action[k]`` and ``depth[k] = d + 1``. A walk starts at node 0, depth 0
    (``path[k, 0]`` is always the root); its caller keeps ``d`` in a local rather than
    in ``depth[k]``, so that the walk's loop stays in registers."""
    child = children[k, node, best]
    if child < 0:
        parent[k] = node
        action[k] = best
        depth[k] = d + 1
        return -1, d + 1
    path[k, d + 1] = child
    return child, d + 1


@numba.njit(cache=True, nogil=True, inline="always")
def _logits_to_scalar(logits, start, support_size):
    """``support_to_scalar`` of ``logits[start : start + 2S + 1]`` (one row): softmax
    expectation over [-S, S], then the inverse of h (same formula as networks.h_inv)."""
    width = 2 * support_size + 1
    top = float(logits[start])  # float(): compute in float64 whatever the logits' dtype
    for i in range(1, width):
        top = max(top, float(logits[start + i]))
    total = 0.0
    expectation = 0.0
    for i in range(width):
        w = math.exp(float(logits[start + i]) - top)
        total += w
        expectation += w * (i - support_size)
    y = expectation / total
    a = abs(y) + 1 + EPS
    u = 2 * a / (math.sqrt(1 + 4 * EPS * a) + 1)
    return math.copysign(u * u - 1, y) if y != 0 else 0.0


@numba.njit(cache=True, nogil=True)
def _expand_and_backup(leaf, logits, support_size, parent, action, path, depth, two_player, discount,
                       children, visit_count, value_sum, reward, node_to_play, prior, q_min, q_max,
                       raw_value, lstm_horizon_len, value_prefix):  # fmt: skip
    """Create node ``leaf`` in every tree from the recurrent inference's ``logits``
    (K, value 2S+1 | reward 2S+1 | policy A), then back its value up the path.
    ``raw_value[k, leaf]`` keeps the network's value of the new node.

    ``lstm_horizon_len`` > 0: the middle logits are the value prefix, kept in
    ``value_prefix[k, leaf]``; the node's reward is it minus the parent's prefix, or the
    prefix itself where the parent's depth (``depth[k] - 1``) is a multiple of
    ``lstm_horizon_len`` (the LSTM was reset there: EfficientZero's ``is_reset``). 0: the
    middle logits are the reward.

    Backup is muzero-general's ``backpropagate``: ``value`` is the return seen by the
    leaf's player; each node on the path adds it (negated where the node's player is
    the other one), updates the tree's min-max statistics with its Q, and passes on
    ``r + discount * value`` (with r negated where the mover was the other player).
    """
    k_trees, num_actions = prior.shape[0], prior.shape[2]
    width = 2 * support_size + 1
    for k in range(k_trees):
        # Expansion.
        p = parent[k]
        children[k, p, action[k]] = leaf
        value = _logits_to_scalar(logits[k], 0, support_size)
        raw_value[k, leaf] = value
        r = _logits_to_scalar(logits[k], width, support_size)
        if lstm_horizon_len > 0:
            value_prefix[k, leaf] = r
            if (depth[k] - 1) % lstm_horizon_len != 0:
                r -= value_prefix[k, p]
        reward[k, leaf] = r
        leaf_to_play = (node_to_play[k, p] + 1) % 2 if two_player else node_to_play[k, p]
        node_to_play[k, leaf] = leaf_to_play
        top = float(logits[k, 2 * width])
        for a in range(1, num_actions):
            top = max(top, float(logits[k, 2 * width + a]))
        total = 0.0
        for a in range(num_actions):
            w = math.exp(float(logits[k, 2 * width + a]) - top)
            prior[k, leaf, a] = w
            total += w
        for a in range(num_actions):
            prior[k, leaf, a] /= total
        # Backup.
        path[k, depth[k]] = leaf
        for d in range(depth[k], -1, -1):
            n = path[k, d]
            visit_count[k, n] += 1
            if two_player:
                same = node_to_play[k, n] == leaf_to_play
                value_sum[k, n] += value if same else -value
                q = reward[k, n] - discount * value_sum[k, n] / visit_count[k, n]
                value = (-reward[k, n] if same else reward[k, n]) + discount * value
            else:
                value_sum[k, n] += value
                q = reward[k, n] + discount * value_sum[k, n] / visit_count[k, n]
                value = reward[k, n] + discount * value
            q_min[k] = min(q_min[k], q)
            q_max[k] = max(q_max[k], q)
