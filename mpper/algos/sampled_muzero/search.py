"""The Sampled MuZero search (Hubert et al. 2021): pUCT over K actions sampled at each
expanded node, with the sampled-policy correction.

At each expanded node the search draws K actions from beta (the network's policy pi; at
the root in self-play, pi at ``sampled_mcts.root_sampling_temperature``) and gives sampled action a
the prior ``beta_hat(a) / beta(a) * pi(a)``, normalised over the node's distinct samples,
where beta_hat is the empirical distribution of the K samples (a drawn n times: n / K;
its duplicates share one child). With beta = pi the prior is beta_hat.

Everything else is MuZero's pUCT as :mod:`mpper.algos.muzero.mcts` runs it (muzero-general's
``MCTS``, the paper's pseudocode), over a node's sampled actions instead of the whole action
set: ``score = P * sqrt(N(s)) / (1 + N(s, a)) * (c_init + log((N(s) + c_base + 1) / c_base))
+ Q_norm`` (Q_norm 0 for an unvisited child, min-max normalised once two values were seen),
exact ties to the larger prior, then to the larger per-root tie key; Dirichlet noise over the
root's distinct samples when exploring; backup ``value = r + discount * value``. One player.
With ``sampled_mcts.kind: "gumbel"`` the selection and the decision are Gumbel MuZero's over
the sampled actions (:mod:`.gumbel`).

Layout, as MuZero's search (:mod:`mpper.algos.muzero.tree`): N trees of arrays indexed by
(tree, node) or (tree, node, edge), node ``s + 1`` the one simulation ``s`` expands in every
tree; one batched recurrent inference per simulation for all roots, in torch. The tree work
of a simulation is compiled (numba, cached on disk): one kernel walks every tree down to an
unexpanded child (pUCT here, Gumbel's in :mod:`.gumbel`), one finds each new node's repeated
samples, one backs the leaves' values up. What the search draws (the samples, Dirichlet
gammas, Gumbel noise, tie keys) is drawn in numpy, in the order of the plain loop version of
these rules, and the arithmetic follows that version operation for operation, with numpy
doing the logarithms, exponentials and sums it does there: the same seeds give the same
search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from .config import SampledMCTSConfig
from .gumbel import GumbelRoots
from .networks import support_to_scalar_np

__all__ = ["SampledSearch", "SampledSearchResult", "choose", "corrected_priors", "sampled_prior"]


def corrected_priors(actions: np.ndarray, log_pi: np.ndarray, log_beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sampled-policy correction at N nodes: for K sampled ``actions`` (N, K, A) per
    node with log pi (N, K) and log beta (N, K) of each, (prior (N, K) float64, distinct
    (N, K) bool): the first of each group of equal samples holds ``beta_hat(a) / beta(a) *
    pi(a)`` normalised over the node's distinct samples (beta_hat(a) = count(a) / K), its
    repeats prior 0 and ``distinct`` False."""
    actions = np.ascontiguousarray(actions, np.float64)
    n, k = actions.shape[:2]
    counts = np.empty((n, k), np.int64)
    distinct = np.empty((n, k), bool)
    _count_samples(actions, counts, distinct)
    log_weight = np.log(counts / k) + log_pi - log_beta
    top = np.where(distinct, log_weight, -np.inf).max(1, keepdims=True)
    weight = np.where(distinct, np.exp(log_weight - top), 0.0)
    return weight / weight.sum(1, keepdims=True), distinct


def sampled_prior(actions: np.ndarray, log_pi: np.ndarray, log_beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`corrected_priors` at one node: ``actions`` (K, A), log pi (K,), log beta (K,)
    -> (prior (K,) float64, distinct (K,) bool)."""
    prior, distinct = corrected_priors(np.asarray(actions)[None], np.asarray(log_pi)[None], np.asarray(log_beta)[None])
    return prior[0], distinct[0]


@dataclass
class SampledSearchResult:
    actions: np.ndarray  # (N, K, A) float64: the root's sampled actions, in [-1, 1]
    distinct: np.ndarray  # (N, K) bool: False for a repeat of an earlier sample (no child of its own)
    visit_counts: np.ndarray  # (N, K) int64: visits of each root child
    policy_target: np.ndarray  # (N, K) float64: visit shares n_k / N over the root's samples
    root_values: np.ndarray  # (N,) float64: mean backed-up value of the root
    root_predicted_values: np.ndarray  # (N,) float64: the network's value of the root observation
    prior: np.ndarray  # (N, K) float64: the root's priors, after noise
    # (N,) int64: the root sample the search chose (Gumbel); None: the player picks from the
    # visit counts with its temperature (pUCT)
    chosen: np.ndarray | None = None


class _Trees:
    """N trees of ``nodes`` nodes with ``k`` edges each (node 0: the root), and the walk of
    the current simulation: ``path[t, :depth[t]]`` the nodes from the root down to the new
    leaf's ``parent[t]``, reached through its edge ``edge[t]``."""

    def __init__(self, n: int, nodes: int, k: int, action_dim: int):
        self.visit_count = np.zeros((n, nodes), np.int64)
        self.value_sum = np.zeros((n, nodes))
        self.reward = np.zeros((n, nodes))
        self.raw_value = np.zeros((n, nodes))  # the network's value of the node (Gumbel's completed Q)
        self.prior = np.zeros((n, nodes, k))
        self.log_prior = np.zeros((n, nodes, k))  # numpy's log of ``prior``: Gumbel's logits below the root
        self.valid = np.zeros((n, nodes, k), bool)
        self.children = np.full((n, nodes, k), -1, np.int64)
        self.actions = np.zeros((n, nodes, k, action_dim))
        self.q_min = np.full(n, np.inf)
        self.q_max = np.full(n, -np.inf)
        self.path = np.zeros((n, nodes + 1), np.int64)
        self.depth = np.zeros(n, np.int64)
        self.parent = np.zeros(n, np.int64)
        self.edge = np.zeros(n, np.int64)


class SampledSearch:
    """The batched search of ``config`` (pUCT; ``num_sampled_actions`` K) for actions of
    ``action_dim`` dimensions and value/reward supports of ``support_size``.

    ``run(network, observations, explore, rng)`` needs a network with
    ``initial_inference(obs)`` and ``recurrent_inference(hidden, actions (N, A) float32)``
    returning value and reward support logits, policy parameters and a hidden state, and a
    ``policy`` (the network's own unless given) with ``sample(params, K, rng, temperature)
    -> (actions (N, K, A), log beta (N, K))`` and ``log_prob_np(params, actions) -> (N, K)``.
    """

    def __init__(self, config: SampledMCTSConfig, action_dim: int, support_size: int):
        if config.kind not in ("puct", "gumbel"):
            raise ValueError(f'sampled_mcts.kind must be "puct" or "gumbel", got {config.kind!r}')
        self.config = config
        self.action_dim = action_dim
        self.support_size = support_size
        self.k = int(config.num_sampled_actions)

    def _expand(self, trees: _Trees, node: int, params: np.ndarray, policy, rng, temperature: float,
                noise: bool) -> None:  # fmt: skip
        """Node ``node`` of every tree: K samples from beta (policy ``params`` (N, P) at
        ``temperature``), their corrected priors (with the root's Dirichlet noise when
        ``noise``, one row of K gammas per tree)."""
        actions, log_beta = policy.sample(params, self.k, rng, temperature)
        log_pi = policy.log_prob_np(params, actions)
        prior, distinct = corrected_priors(actions, log_pi, log_beta)
        if noise:
            cfg = self.config
            gammas = rng.standard_gamma(cfg.root_dirichlet_alpha, size=distinct.shape) * distinct
            totals = gammas.sum(1, keepdims=True)
            dirichlet = np.where(totals > 0, gammas / np.where(totals > 0, totals, 1.0),
                                 distinct / distinct.sum(1, keepdims=True))  # fmt: skip
            prior = np.where(distinct, prior * (1 - cfg.root_exploration_fraction)
                             + dirichlet * cfg.root_exploration_fraction, 0.0)  # fmt: skip
        trees.actions[:, node] = actions
        trees.prior[:, node] = prior
        trees.valid[:, node] = distinct
        if self.config.kind == "gumbel":
            with np.errstate(divide="ignore"):
                trees.log_prior[:, node] = np.log(prior)

    @torch.inference_mode()
    def run(self, network, observations: np.ndarray, explore: bool, rng: np.random.Generator, policy=None,
            tie_break: np.ndarray | None = None, num_simulations: int | None = None,
            root_noise: np.ndarray | None = None) -> SampledSearchResult:  # fmt: skip
        """Search N roots (``observations`` (N, *obs) float32) together. ``explore``: the
        root samples at ``root_sampling_temperature`` and gets its noise (pUCT: Dirichlet
        over the priors; Gumbel: Gumbel noise times ``gumbel_scale``, or ``root_noise``
        (N, K) when given); else beta = pi everywhere and no noise. ``tie_break`` (N, K):
        pUCT's keys for exact ties (drawn from ``rng`` when None)."""
        cfg = self.config
        policy = network.policy if policy is None else policy
        sims = int(num_simulations or cfg.num_simulations)
        n = len(observations)
        if tie_break is None:
            tie_break = rng.random((n, self.k))
        tie_break = np.ascontiguousarray(tie_break, np.float64)
        param = next(iter(network.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        trees = _Trees(n, sims + 1, self.k, self.action_dim)
        out = network.initial_inference(torch.as_tensor(np.asarray(observations, np.float32), device=device))
        root_value = support_to_scalar_np(out.value_logits.cpu().numpy(), self.support_size)
        params = out.policy_logits.cpu().numpy().astype(np.float64)
        temperature = cfg.root_sampling_temperature if explore else 1.0
        gumbel = cfg.kind == "gumbel"
        trees.raw_value[:, 0] = root_value
        self._expand(trees, 0, params, policy, rng, temperature, explore and not gumbel)
        roots = None
        if gumbel:
            noise = np.zeros((n, self.k))
            if explore:
                noise = cfg.gumbel_scale * rng.gumbel(size=(n, self.k)) if root_noise is None else root_noise
            roots = GumbelRoots(cfg, trees, np.asarray(noise, np.float64), sims, cfg.discount)
        hidden = torch.empty((n, sims + 1, *out.hidden_state.shape[1:]), dtype=out.hidden_state.dtype, device=device)
        hidden[:, 0] = out.hidden_state
        trees_np, trees_t = np.arange(n), torch.arange(n, device=device)
        discount = float(cfg.discount)
        for sim in range(sims):
            if roots is None:
                _puct_select(trees.children, trees.visit_count, trees.value_sum, trees.reward, trees.prior, trees.valid,
                             trees.q_min, trees.q_max, tie_break, discount, float(cfg.pb_c_base), float(cfg.pb_c_init),
                             trees.path, trees.depth, trees.parent, trees.edge)  # fmt: skip
            else:
                roots.select()
            taken = trees.actions[trees_np, trees.parent, trees.edge].astype(np.float32)
            parent_states = hidden[trees_t, torch.from_numpy(trees.parent).to(device)]
            out = network.recurrent_inference(parent_states, torch.from_numpy(taken).to(device))
            leaf = sim + 1
            hidden[:, leaf] = out.hidden_state
            # values and rewards decoded together: the same rows, one numpy pass
            decoded = support_to_scalar_np(torch.cat([out.value_logits, out.reward_logits]).cpu().numpy(),
                                           self.support_size)  # fmt: skip
            leaf_params = out.policy_logits.cpu().numpy().astype(np.float64)
            self._expand(trees, leaf, leaf_params, policy, rng, 1.0, False)
            _backup(leaf, decoded[:n], decoded[n:], discount, trees.path, trees.depth, trees.parent, trees.edge,
                    trees.children, trees.visit_count, trees.value_sum, trees.reward, trees.raw_value, trees.q_min,
                    trees.q_max)  # fmt: skip
        root_children = trees.children[:, 0]
        visits = np.where(root_children >= 0, np.take_along_axis(trees.visit_count, np.maximum(root_children, 0), 1), 0)
        chosen, target = None, visits / np.maximum(visits.sum(1, keepdims=True), 1)
        if roots is not None:
            chosen, target = roots.decide()
        return SampledSearchResult(
            actions=trees.actions[:, 0].copy(), distinct=trees.valid[:, 0].copy(), visit_counts=visits,
            policy_target=target, chosen=chosen,
            root_values=trees.value_sum[:, 0] / np.maximum(trees.visit_count[:, 0], 1),
            root_predicted_values=root_value, prior=trees.prior[:, 0].copy(),
        )  # fmt: skip


# --------------------------------------------------------------------------------------
# Kernels (compiled; one call per simulation for all N trees)
# --------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _count_samples(actions, counts, distinct):
    """For the K samples of each of N nodes, ``actions`` (N, K, A): ``counts[t, j]`` (N, K)
    how many of the node's samples equal sample j (every coordinate ==, as ``np.unique``
    compares rows), ``distinct[t, j]`` (N, K) whether j is the first of them."""
    n, k, action_dim = actions.shape
    first = np.empty(k, np.int64)
    for t in range(n):
        for j in range(k):
            first[j] = j
            for i in range(j):
                if first[i] != i:
                    continue
                same = True
                for d in range(action_dim):
                    if actions[t, i, d] != actions[t, j, d]:
                        same = False
                        break
                if same:
                    first[j] = i
                    break
            counts[t, j] = 0
        for j in range(k):
            counts[t, first[j]] += 1
        for j in range(k):
            distinct[t, j] = first[j] == j
            counts[t, j] = counts[t, first[j]]


@numba.njit(cache=True, nogil=True)
def _puct_select(children, visit_count, value_sum, reward, prior, valid, q_min, q_max, tie_break, discount, pb_c_base,
                 pb_c_init, path, depth, parent, edge):  # fmt: skip
    """Walk each of the N trees (arrays (N, nodes) per node, (N, nodes, K) per edge) from
    its root by maximal pUCT score over the valid edges to an unexpanded child; exact ties go
    to the larger prior, then to the larger ``tie_break[t, e]`` (N, K). Writes the walk:
    ``path[t, :depth[t]]`` the nodes from the root, ``parent[t]`` and ``edge[t]`` the new
    leaf's parent and edge.

    The choice at a node is written here, not in a function of its own: a compiled call per
    node that takes the tree's arrays costs more than the choice among K edges."""
    n_trees, _, k = children.shape
    for t in range(n_trees):
        span = q_max[t] - q_min[t]  # MinMaxStats.normalize applies only once max > min
        node = 0
        d = 0
        path[t, 0] = 0
        while True:
            n_parent = visit_count[t, node]
            pb_c = (math.log((n_parent + pb_c_base + 1) / pb_c_base) + pb_c_init) * math.sqrt(n_parent)
            best = -1
            best_score = -np.inf
            for e in range(k):
                if not valid[t, node, e]:
                    continue
                child = children[t, node, e]
                n_child = visit_count[t, child] if child >= 0 else 0
                score = pb_c * prior[t, node, e] / (n_child + 1)
                if n_child > 0:  # unvisited children: Q term 0 (muzero-general)
                    q = reward[t, child] + discount * value_sum[t, child] / n_child
                    if span > 0:
                        q = (q - q_min[t]) / span
                    score += q
                if score > best_score or (
                    score == best_score
                    and (prior[t, node, e] > prior[t, node, best]
                         or (prior[t, node, e] == prior[t, node, best] and tie_break[t, e] > tie_break[t, best]))
                ):  # fmt: skip
                    best = e
                    best_score = score
            child = children[t, node, best]
            if child < 0:
                parent[t] = node
                edge[t] = best
                depth[t] = d + 1
                break
            node = child
            d += 1
            path[t, d] = node


@numba.njit(cache=True, nogil=True)
def _backup(leaf, values, rewards, discount, path, depth, parent, edge, children, visit_count, value_sum, reward,
            raw_value, q_min, q_max):  # fmt: skip
    """Attach node ``leaf`` (the network's ``values`` (N,) and ``rewards`` (N,) of it) below
    each tree's ``parent[t]`` at ``edge[t]``, then back its value up the walk
    ``path[t, :depth[t]]``: each node counts a visit, adds the value, widens the tree's
    min-max statistics ``q_min``/``q_max`` (N,) with its ``r + discount * V`` and passes on
    ``r + discount * value``."""
    for t in range(values.shape[0]):
        children[t, parent[t], edge[t]] = leaf
        reward[t, leaf] = rewards[t]
        raw_value[t, leaf] = values[t]
        path[t, depth[t]] = leaf
        value = values[t]
        for d in range(depth[t], -1, -1):
            node = path[t, d]
            visit_count[t, node] += 1
            value_sum[t, node] += value
            q = reward[t, node] + discount * value_sum[t, node] / visit_count[t, node]
            q_min[t] = min(q_min[t], q)
            q_max[t] = max(q_max[t], q)
            value = reward[t, node] + discount * value


def choose(visit_counts: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """Root sample indices (N,) from visit counts (N, K): temperature 0, the most visited
    (ties at random); else drawn with probability proportional to ``counts ** (1 / T)``."""
    counts = np.asarray(visit_counts, np.float64)
    if temperature == 0:
        best = counts == counts.max(axis=1, keepdims=True)
        return np.where(best, rng.random(counts.shape), -1.0).argmax(axis=1)
    weights = (counts / np.maximum(counts.max(axis=1, keepdims=True), 1e-300)) ** (1.0 / temperature)
    cumulative = np.cumsum(weights, axis=1)
    draw = rng.random(counts.shape[0]) * cumulative[:, -1]
    return np.minimum((cumulative <= draw[:, None]).sum(axis=1), counts.shape[1] - 1)
