"""Batched MuZero MCTS: K search trees, one per environment, searched together.

Semantics are muzero-general's ``MCTS`` (``self_play.py``), which follows the MuZero
paper's pseudocode:

* pUCT selection ``score(a) = P(s, a) * sqrt(N(s)) / (1 + N(s, a)) * (c_init +
  log((N(s) + c_base + 1) / c_base)) + Q_norm(s, a)``, with ``Q_norm = 0`` for an
  unvisited child and ``Q(s, a) = r(s, a) + discount * V(child)`` (``- V(child)`` in
  two-player games: the child's value is from the view of the player to move there);
* priors: softmax of the policy logits over the legal actions at the root, over all
  actions below it (the model does not know the rules); Dirichlet noise mixed into the
  root priors when exploring;
* one min-max statistic per tree normalises Q to [0, 1] once two different values were
  seen (before that, Q is used as is);
* backup along the search path with the discount; in two-player games a node's value
  is from the view of its ``to_play``, which alternates down the tree (muzero-general's
  ``virtual_to_play``), and a node's reward is from the view of the player who moved
  into it.

One deliberate difference: exact ties in selection go to the child with the larger
prior, then to the larger of per-root random tie keys (``tie_break``, drawn from the
search's generator), where muzero-general draws uniformly among the tied actions. Ties
are the rule, not the exception, at the root's first simulation: the root has no visit
yet, so every pUCT score is 0. A fixed order there (the lowest index, say) always
expands the same action first, and since an unvisited child scores the bottom of the
min-max range after that, the first-visited child tends to stay ahead: on a random
CartPole network action 0 got more than twice its share of 25 simulations. With the
rule above the first simulation expands the most probable (noisy) action, as in mctx,
where the root counts its own initial visit, and no index is favoured. The keys are an
input, not hidden state, so a batched search stays bit-for-bit equal to K single
searches given the same keys.

How it is batched. Every simulation expands exactly one new node in every tree, so node
``s + 1`` is the one simulation ``s`` creates, in all K trees at once. A tree is a set of
arrays indexed by (tree, node) or (tree, node, action), preallocated for
``num_simulations + 1`` nodes; ``children[k, n, a]`` is the node reached by action ``a``
from node ``n``, -1 while that child is not expanded; hidden states stay in one torch
tensor (K, nodes, *hidden). A simulation is:

1. ``_select`` walks each tree down to an unexpanded child: (parent, action, path);
2. one ``recurrent_inference`` on the K (parent hidden state, action) pairs;
3. ``_expand_and_backup`` writes node ``s + 1`` of every tree (reward, value and priors
   from the logits) and backs its value up the K paths.

Why numba for steps 1 and 3: the first version did them with vectorised numpy (a
Python loop over depth, numpy over K). The work per level is tiny (K x A numbers), so
every level paid ~20 numpy calls of fixed overhead: with K = 64, 50 simulations and
the CartPole network, 54 % of a search went to tree bookkeeping with depth-7 trees, and
moves/s fell from 1700 to 780 with depth-33 trees (peaked priors, as a trained network
has). The kernels below do the same loops per tree in compiled code: about 4200
moves/CPU-s at K = 64 for both tree shapes, the network's inference now being most of
the time (``bench/mcts_speed.py``). numba is already a dependency (the replay buffer's
sum tree). The kernels are cached on disk (``cache=True``): a fresh process loads them in
well under a second, the very first compile takes about 2 s.

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

from .config import MCTSConfig
from .networks import EPS, support_to_scalar

__all__ = ["BatchedMCTS", "SearchResult", "select_action", "temperature_at"]


@dataclass
class SearchResult:
    root_values: np.ndarray  # (K,) float64: mean backed-up value of the root (muzero-general's root.value())
    child_visits: np.ndarray  # (K, A) float64: root visit distribution, sums to 1, 0 on illegal actions
    visit_counts: np.ndarray  # (K, A) int64: visits of each root child
    root_predicted_values: np.ndarray  # (K,) float64: the network's value of the root observation (no search)
    max_tree_depth: int  # deepest search path in the batch, in edges (diagnostics)
    # (K, A) float64: what the policy head learns from this search (stored as the row's
    # child_visits): the visit distribution for pUCT, the improved policy for Gumbel.
    policy_target: np.ndarray | None = None
    # (K,) int64: the action the search chose (Gumbel); None: the player picks from the
    # visit counts with its temperature (pUCT).
    actions: np.ndarray | None = None

    def __post_init__(self):
        if self.policy_target is None:
            self.policy_target = self.child_visits


class BatchedMCTS:
    """MCTS for K environments at once; ``run`` searches all K roots together.

    Args:
        num_actions: A, the size of the action space (actions are 0 .. A-1).
        config: pUCT constants, discount, Dirichlet noise, ``num_simulations``.
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

    def sample_root_noise(self, legal_actions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Dirichlet(alpha) noise over each root's legal actions: (K, A) float64, 0 on
        illegal actions, rows summing to 1.

        Drawn as normalised Gamma(alpha, 1) variables (the definition of the Dirichlet),
        so K roots with different numbers of legal actions cost one numpy call. A row
        whose gammas all underflow to 0 (tiny alpha) falls back to uniform.
        """
        legal = np.asarray(legal_actions, dtype=bool)
        gammas = rng.standard_gamma(self.config.root_dirichlet_alpha, size=legal.shape) * legal
        totals = gammas.sum(axis=1, keepdims=True)
        uniform = legal / legal.sum(axis=1, keepdims=True)
        return np.where(totals > 0, gammas / np.where(totals > 0, totals, 1.0), uniform)

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
                e.g. a ``MuZeroNetwork`` in eval mode (BatchNorm!).
            observations: (K, *observation_shape) float32, stacked as the network expects.
            legal_actions: (K, A) bool; every row needs at least one legal action.
            to_play: (K,) int, the player to move at each root: 0 or 1 in two-player
                games (the player below a node is the other one), anything (0) otherwise.
            add_exploration_noise: mix Dirichlet noise into the root priors.
            rng: draws the noise (only when it is added and ``root_noise`` is None).
            root_noise: optional (K, A) noise used instead of drawing it when
                ``add_exploration_noise`` (rows summing to 1 over the legal actions,
                e.g. from ``sample_root_noise``), to replay a search exactly.
            tie_break: optional (K, A) float keys for the exact ties in selection that
                remain after comparing priors (the larger key wins, at every node of
                tree k); drawn uniformly from ``rng`` when None.
        """
        cfg = self.config
        num_sims, num_actions, support_size = cfg.num_simulations, self.num_actions, self.support_size
        legal = np.ascontiguousarray(legal_actions, dtype=bool)
        k_trees = legal.shape[0]
        if legal.ndim != 2 or legal.shape[1] != num_actions:
            raise ValueError(f"legal_actions must be (K, {num_actions}) bool, got shape {legal.shape}")
        if not legal.any(axis=1).all():
            raise ValueError(f"legal_actions: roots {np.flatnonzero(~legal.any(axis=1)).tolist()} have no legal action")
        if tie_break is None:
            tie_break = rng.random(legal.shape)
        tie_break = np.ascontiguousarray(tie_break, dtype=np.float64)
        if tie_break.shape != legal.shape:
            raise ValueError(f"tie_break must be (K, A) = {legal.shape}, got shape {tie_break.shape}")
        param = next(iter(network.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")

        # Tree storage: node 0 is the root, node s+1 is created by simulation s.
        num_nodes = num_sims + 1
        visit_count = np.zeros((k_trees, num_nodes), dtype=np.int64)
        value_sum = np.zeros((k_trees, num_nodes))
        reward = np.zeros((k_trees, num_nodes))  # the root's stays 0: the support of 0
        raw_value = np.zeros((k_trees, num_nodes))  # the network's value of each node (written, unused by pUCT)
        node_to_play = np.zeros((k_trees, num_nodes), dtype=np.int64)
        prior = np.zeros((k_trees, num_nodes, num_actions))
        children = np.full((k_trees, num_nodes, num_actions), -1, dtype=np.int64)
        q_min = np.full(k_trees, np.inf)  # per-tree MinMaxStats
        q_max = np.full(k_trees, -np.inf)
        path = np.zeros((k_trees, num_nodes + 1), dtype=np.int64)  # path[k, d]: node at depth d
        depth = np.zeros(k_trees, dtype=np.int64)  # depth of the new leaf (edges from the root)
        parent = np.zeros(k_trees, dtype=np.int64)
        action = np.zeros(k_trees, dtype=np.int64)

        # Root: initial inference; priors = softmax over the legal actions (+ noise).
        out = network.initial_inference(torch.as_tensor(np.asarray(observations, dtype=np.float32), device=device))
        logits = out.policy_logits.masked_fill(~torch.as_tensor(legal, device=device), -torch.inf)
        root = torch.cat([support_to_scalar(out.value_logits, support_size)[:, None], torch.softmax(logits, dim=1)], 1)
        root = root.cpu().numpy().astype(np.float64)
        root_prior = root[:, 1:]
        if add_exploration_noise:
            noise = self.sample_root_noise(legal, rng) if root_noise is None else np.asarray(root_noise, np.float64)
            if noise.shape != legal.shape:
                raise ValueError(f"root_noise must be (K, A) = {legal.shape}, got shape {noise.shape}")
            frac = cfg.root_exploration_fraction
            root_prior = np.where(legal, root_prior * (1 - frac) + noise * frac, 0.0)
        prior[:, 0] = root_prior
        node_to_play[:, 0] = np.asarray(to_play, dtype=np.int64).reshape(k_trees)
        hidden = torch.empty((k_trees, num_nodes, *out.hidden_state.shape[1:]), dtype=out.hidden_state.dtype, device=device)  # fmt: skip
        hidden[:, 0] = out.hidden_state

        trees_t = torch.arange(k_trees, device=device)
        parent_t, action_t = torch.from_numpy(parent), torch.from_numpy(action)  # views: refreshed in place by _select
        value_sign = -1.0 if self.two_player else 1.0  # V(child) as seen from the parent
        max_tree_depth = 0
        for sim in range(num_sims):
            sim_depth = _select(
                children, visit_count, value_sum, reward, prior, q_min, q_max, legal, tie_break,
                cfg.discount, value_sign, cfg.pb_c_base, cfg.pb_c_init, path, depth, parent, action,
            )  # fmt: skip
            max_tree_depth = max(max_tree_depth, sim_depth)
            out = network.recurrent_inference(hidden[trees_t, parent_t.to(device)], action_t.to(device))
            hidden[:, sim + 1] = out.hidden_state
            logits = torch.cat([out.value_logits, out.reward_logits, out.policy_logits], 1).cpu().numpy()
            _expand_and_backup(
                sim + 1, logits, support_size, parent, action, path, depth, self.two_player, cfg.discount,
                children, visit_count, value_sum, reward, node_to_play, prior, q_min, q_max, raw_value,
            )  # fmt: skip

        # Root children's visits; -1 (never expanded, e.g. illegal) counts 0.
        root_children = children[:, 0]
        visit_counts = np.where(root_children >= 0, np.take_along_axis(visit_count, np.maximum(root_children, 0), 1), 0)
        return SearchResult(
            root_values=value_sum[:, 0] / visit_count[:, 0],
            child_visits=visit_counts / visit_counts.sum(axis=1, keepdims=True),
            visit_counts=visit_counts,
            root_predicted_values=root[:, 0],
            max_tree_depth=max_tree_depth,
        )


# --------------------------------------------------------------------------------------
# Tree kernels (compiled; one call per simulation for all K trees)
# --------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _select(children, visit_count, value_sum, reward, prior, q_min, q_max, legal, tie_break,
            discount, value_sign, pb_c_base, pb_c_init, path, depth, parent, action):  # fmt: skip
    """Walk every tree from the root to an unexpanded child by maximal pUCT score.

    Writes, per tree k: ``path[k, :depth[k]]`` the nodes visited (root first),
    ``depth[k]`` the depth the new leaf will have, and (``parent[k]``, ``action[k]``)
    the expanded node and the action whose child is not expanded yet. Only legal
    actions are considered at the root. Exact ties go to the larger prior, then to the
    larger ``tie_break[k, a]``. Returns the largest new-leaf depth.
    """
    k_trees, _, num_actions = children.shape
    deepest = 0
    for k in range(k_trees):
        node = 0
        d = 0
        path[k, 0] = 0
        span = q_max[k] - q_min[k]  # MinMaxStats.normalize applies only once max > min
        while True:
            n_parent = visit_count[k, node]
            pb_c = (math.log((n_parent + pb_c_base + 1) / pb_c_base) + pb_c_init) * math.sqrt(n_parent)
            best_score = -np.inf
            best = -1
            for a in range(num_actions):
                if node == 0 and not legal[k, a]:
                    continue
                child = children[k, node, a]
                n_child = visit_count[k, child] if child >= 0 else 0
                score = pb_c * prior[k, node, a] / (n_child + 1)
                if n_child > 0:  # unvisited children: Q term 0 (muzero-general)
                    q = reward[k, child] + discount * value_sign * (value_sum[k, child] / n_child)
                    if span > 0:
                        q = (q - q_min[k]) / span
                    score += q
                if score > best_score or (
                    score == best_score
                    and (prior[k, node, a] > prior[k, node, best]
                         or (prior[k, node, a] == prior[k, node, best] and tie_break[k, a] > tie_break[k, best]))
                ):  # fmt: skip
                    best_score = score
                    best = a
            child = children[k, node, best]
            if child < 0:
                parent[k] = node
                action[k] = best
                depth[k] = d + 1
                break
            node = child
            d += 1
            path[k, d] = node
        deepest = max(deepest, d + 1)
    return deepest


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
                       raw_value):  # fmt: skip
    """Create node ``leaf`` in every tree from the recurrent inference's ``logits``
    (K, value 2S+1 | reward 2S+1 | policy A), then back its value up the path.
    ``raw_value[k, leaf]`` keeps the network's value of the new node (the Gumbel
    search's completed Q-values need it after later visits have moved its mean).

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
        reward[k, leaf] = _logits_to_scalar(logits[k], width, support_size)
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


# --------------------------------------------------------------------------------------
# Acting on the search
# --------------------------------------------------------------------------------------


def select_action(visit_counts: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """Actions (K,) from root visit counts (K, A).

    temperature 0: the most visited action, ties broken at random; ``inf``: uniform over
    the visited actions, the limit of ``counts ** (1 / T)`` (muzero-general draws from
    every legal action, visited or not); otherwise sampled with probability proportional to
    ``counts ** (1 / T)``, computed as ``(counts / max) ** (1 / T)`` so that a small T
    cannot overflow.
    """
    counts = np.asarray(visit_counts, dtype=np.float64)
    if temperature == 0:
        best = counts == counts.max(axis=1, keepdims=True)
        return np.where(best, rng.random(counts.shape), -1.0).argmax(axis=1)
    if np.isinf(temperature):
        weights = (counts > 0).astype(np.float64)
    else:
        weights = (counts / np.maximum(counts.max(axis=1, keepdims=True), 1e-300)) ** (1.0 / temperature)
    cumulative = np.cumsum(weights, axis=1)
    draw = rng.random(counts.shape[0]) * cumulative[:, -1]
    # The first action whose cumulative weight exceeds the draw; zero-weight actions never win.
    return np.minimum((cumulative <= draw[:, None]).sum(axis=1), counts.shape[1] - 1)


def temperature_at(schedule: list, progress: float) -> float:
    """Visit-count temperature at ``progress`` (fraction of the training steps done) for
    ``MCTSConfig.temperature_schedule`` ``[[fraction, T], ...]``: the T of the last
    entry whose fraction is <= progress (the first entry's T before it); a step function
    like muzero-general's ``visit_softmax_temperature_fn``."""
    entries = sorted((float(f), float(t)) for f, t in schedule)
    if not entries:
        raise ValueError("temperature_schedule is empty")
    temperature = entries[0][1]
    for fraction, t in entries:
        if progress >= fraction:
            temperature = t
    return temperature
