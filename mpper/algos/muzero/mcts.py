"""The pUCT search policy (muzero-general's ``MCTS``, ``self_play.py``, which follows the
MuZero paper's pseudocode) over the batched tree of :mod:`.tree`, and acting on its visits.

* pUCT selection ``score(a) = P(s, a) * sqrt(N(s)) / (1 + N(s, a)) * (c_init +
  log((N(s) + c_base + 1) / c_base)) + Q_norm(s, a)``, with ``Q_norm = 0`` for an
  unvisited child and ``Q(s, a) = r(s, a) + discount * V(child)`` (``- V(child)`` in
  two-player games: the child's value is from the view of the player to move there);
* Dirichlet noise mixed into the root priors when exploring;
* one min-max statistic per tree (the tree's ``q_min``/``q_max``, kept by the backup)
  normalises Q to [0, 1] once two different values were seen (before that, Q is used
  as is).

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
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np

from .tree import BatchedSearch, SearchResult, Tree, step_down

__all__ = ["BatchedMCTS", "SearchResult", "select_action"]


class PuctDraws(NamedTuple):
    """What one pUCT search draws before it starts."""

    tie_break: np.ndarray  # (K, A) float64: keys for exact ties, the larger wins
    noise: np.ndarray | None  # (K, A) float64: Dirichlet noise for the root priors; None: not exploring


class BatchedMCTS(BatchedSearch):
    """pUCT search for K environments at once (``mcts.kind: "puct"``); ``run`` (see
    :meth:`.tree.BatchedSearch.run`) searches all K roots together.

    ``run``'s ``root_noise`` is Dirichlet noise (K, A), rows summing to 1 over the legal
    actions (e.g. from :meth:`sample_root_noise`); ``tie_break`` (K, A) float keys decide
    the exact ties that remain after comparing priors (the larger key wins, at every node
    of tree k), drawn uniformly from ``rng`` when None. The ``SearchResult`` leaves the
    action to the player (visit counts and temperature).
    """

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

    def draw(self, legal, add_exploration_noise, rng, root_noise, tie_break) -> PuctDraws:
        if tie_break is None:
            tie_break = rng.random(legal.shape)
        tie_break = np.ascontiguousarray(tie_break, dtype=np.float64)
        if tie_break.shape != legal.shape:
            raise ValueError(f"tie_break must be (K, A) = {legal.shape}, got shape {tie_break.shape}")
        if not add_exploration_noise:
            return PuctDraws(tie_break, None)
        noise = self.sample_root_noise(legal, rng) if root_noise is None else np.asarray(root_noise, np.float64)
        if noise.shape != legal.shape:
            raise ValueError(f"root_noise must be (K, A) = {legal.shape}, got shape {noise.shape}")
        return PuctDraws(tie_break, noise)

    def root_prior(self, prior, legal, draws: PuctDraws):
        if draws.noise is None:
            return prior
        frac = self.config.root_exploration_fraction
        return np.where(legal, prior * (1 - frac) + draws.noise * frac, 0.0)

    def select(self, tree: Tree, draws: PuctDraws) -> int:
        cfg = self.config
        return _puct_select(tree.children, tree.visit_count, tree.value_sum, tree.reward, tree.prior, tree.q_min,
                            tree.q_max, tree.legal, draws.tie_break, cfg.discount, self.value_sign, cfg.pb_c_base,
                            cfg.pb_c_init, tree.path, tree.depth, tree.parent, tree.action)  # fmt: skip

    def decide(self, tree: Tree, draws):
        return None, None


# --------------------------------------------------------------------------------------
# Selection kernel (compiled; one call per simulation for all K trees)
# --------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _puct_select(children, visit_count, value_sum, reward, prior, q_min, q_max, legal, tie_break,
                 discount, value_sign, pb_c_base, pb_c_init, path, depth, parent, action):  # fmt: skip
    """Walk every tree from the root to an unexpanded child by maximal pUCT score
    (:func:`.tree.step_down` writes the walk). Only legal actions are considered at the
    root. Exact ties go to the larger prior, then to the larger ``tie_break[k, a]``.
    Returns the deepest new leaf's depth.

    The choice at a node is written here, not in a function of its own: a compiled call
    per node that takes the tree's arrays costs more than the choice between two actions."""
    k_trees, _, num_actions = children.shape
    deepest = 0
    for k in range(k_trees):
        span = q_max[k] - q_min[k]  # MinMaxStats.normalize applies only once max > min
        node, d = 0, 0
        while node >= 0:
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
            node, d = step_down(k, node, best, d, children, path, depth, parent, action)
        deepest = max(deepest, d)
    return deepest


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
