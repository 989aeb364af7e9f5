"""Batched Gumbel MuZero search (Danihelka et al., "Policy improvement by planning with
Gumbel", ICLR 2022): the Gumbel policy over the batched tree of :mod:`.tree`.

The semantics are those of mctx's ``gumbel_muzero_policy`` with its default
``qtransform_completed_by_mix_value`` (a test runs both on the same model and noise):

* **Root: Gumbel-top-m and Sequential Halving.** Every root draws Gumbel noise
  ``g(a)`` (scale ``gumbel_scale``; 0 when not exploring). The simulations are spent in
  rounds: a root child may be visited when its visit count equals the count Sequential
  Halving allows at this simulation (``considered_visits``: m actions, then m/2, ...,
  down to 2, each round giving the survivors about ``n / (log2(m) m)`` visits), and
  among those the one with the largest ``g(a) + logits(a) + sigma(q_hat(a))`` is
  visited. The m actions of the first round are thus the top m of ``g + logits``:
  Gumbel-top-k sampling without replacement.
* **The action** is the survivor: the most visited actions' largest
  ``g + logits + sigma(q_hat)``. With noise it is a sample from an improved policy;
  without, the greedy choice.
* **The policy target** is ``softmax(logits + sigma(q_hat))`` over the legal actions.
* **Completed Q-values** ``q_hat``: a visited child's ``r + discount * V(child)``; an
  unvisited child's is the node's mixed value ``v_mix = (v_raw + N * sum_visited
  pi(a) q(a) / sum_visited pi(a)) / (1 + N)`` (the paper's appendix D), with ``v_raw``
  the network's value of the node and ``pi`` its prior. Then rescaled to [0, 1] by the
  node's min and max (``mcts.gumbel_q_bounds: "node"``, mctx's ``rescale_values``), or by
  the min and max over the whole tree (``"tree"``: every visited edge's ``r + discount *
  V(child)`` and the node's completed values; as pUCT's MinMaxStats, from the tree's
  current values), and
  ``sigma(q_hat) = (c_visit + max_b N(b)) * c_scale * q_hat``. With two actions the
  node's own bounds put the two children a full ``(c_visit + max N) * c_scale`` apart
  however close their values; the tree's bounds scale that gap by how far apart they are
  against everything the search has seen.
* **Interior nodes** take the deterministic action of the paper's section 5: the argmax
  of ``softmax(logits + sigma(q_hat))(a) - N(a) / (1 + sum_b N(b))``, so that visit
  frequencies follow the improved policy. The model does not know the rules: below the
  root, every action is considered (as in the pUCT search).

The tree, its simulation loop, two-player signs, discount and the backup are
:mod:`.tree`'s, shared with the pUCT search; this module is the policy: the root's
Gumbel noise, the selection kernel and the decision after the simulations.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np

from ..muzero_family import considered_visits
from .config import MCTSConfig
from .tree import BatchedSearch, Tree, step_down

__all__ = ["GumbelMCTS", "considered_visits_table"]


def considered_visits_table(max_num_considered_actions: int, num_simulations: int) -> np.ndarray:
    """(m + 1, n) int64: row j is :func:`considered_visits` for j actions considered (a
    root with fewer legal actions than m considers all of them)."""
    return np.array([considered_visits(j, num_simulations) for j in range(max_num_considered_actions + 1)],
                    dtype=np.int64).reshape(max_num_considered_actions + 1, num_simulations)  # fmt: skip


class GumbelDraws(NamedTuple):
    """What one Gumbel search draws before it starts."""

    gumbel: np.ndarray  # (K, A) float64: the roots' Gumbel noise, scaled (0 when not exploring)
    num_considered: np.ndarray  # (K,) int64: the actions Sequential Halving starts from at each root
    scratch: np.ndarray  # (A,) float64: one node's completed Q-values, in the kernels


class GumbelMCTS(BatchedSearch):
    """Gumbel MuZero search for K environments at once (``mcts.kind: "gumbel"``).

    Same constructor and ``run`` arguments as :class:`~.mcts.BatchedMCTS`; ``run``'s
    ``SearchResult`` carries the chosen ``actions`` and the improved-policy
    ``policy_target``. Exploration is the root's Gumbel noise (``mcts.gumbel_scale``);
    the Dirichlet keys and the visit-count temperature do not apply. In ``run``:
    ``add_exploration_noise`` draws Gumbel noise (times ``mcts.gumbel_scale``) for the
    roots, without it the noise is 0 (the greedy choice); ``root_noise``, optional (K, A)
    Gumbel noise, already scaled, replays a search exactly; ``tie_break`` is unused (ties
    go to the lowest index, as in mctx's argmax).
    """

    def __init__(self, num_actions: int, config: MCTSConfig, support_size: int, two_player: bool = False):
        super().__init__(num_actions, config, support_size, two_player)
        self.table = considered_visits_table(min(config.max_num_considered_actions, num_actions),
                                             config.num_simulations)  # fmt: skip
        self.tree_bounds = config.gumbel_q_bounds == "tree"

    def draw(self, legal, add_exploration_noise, rng, root_noise, tie_break) -> GumbelDraws:
        if add_exploration_noise:
            gumbel = self.config.gumbel_scale * rng.gumbel(size=legal.shape) if root_noise is None else root_noise
            gumbel = np.ascontiguousarray(gumbel, dtype=np.float64)
            if gumbel.shape != legal.shape:
                raise ValueError(f"root_noise must be (K, A) = {legal.shape}, got shape {gumbel.shape}")
        else:
            gumbel = np.zeros(legal.shape)
        num_considered = np.minimum(self.table.shape[0] - 1, legal.sum(axis=1)).astype(np.int64)
        return GumbelDraws(gumbel, num_considered, np.empty(self.num_actions))

    def root_prior(self, prior, legal, draws):
        return prior

    def select(self, tree: Tree, draws: GumbelDraws) -> int:
        cfg = self.config
        return _gumbel_select(tree.children, tree.visit_count, tree.value_sum, tree.reward, tree.raw_value,
                              tree.prior, tree.legal, draws.gumbel, self.table, draws.num_considered, cfg.discount,
                              self.value_sign, cfg.c_visit, cfg.c_scale, self.tree_bounds, tree.path, tree.depth,
                              tree.parent, tree.action, draws.scratch)  # fmt: skip

    def decide(self, tree: Tree, draws: GumbelDraws):
        k_trees = tree.legal.shape[0]
        actions = np.empty(k_trees, dtype=np.int64)
        policy = np.empty((k_trees, self.num_actions))
        cfg = self.config
        _gumbel_decide(tree.children, tree.visit_count, tree.value_sum, tree.reward, tree.raw_value, tree.prior,
                       tree.legal, draws.gumbel, cfg.discount, self.value_sign, cfg.c_visit, cfg.c_scale,
                       self.tree_bounds, actions, policy, draws.scratch)  # fmt: skip
        return policy, actions


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------

_TINY = np.finfo(np.float64).tiny
_LOW_LOGIT = -1e9  # mctx's floor of the root score, so that -inf appears only as the penalty


@numba.njit(cache=True, nogil=True)
def _q_bounds(k, tree_bounds, children, visit_count, value_sum, reward, discount, value_sign):
    """The bounds that widen every node's own in the Q rescaling of tree ``k``: with
    ``tree_bounds``, (min, max) over the tree of every visited edge's ``r + discount *
    V(child)`` (from the side of the player taking the edge); otherwise, or before any
    visit, (inf, -inf)."""
    low = np.inf
    high = -np.inf
    if not tree_bounds:
        return low, high
    _, num_nodes, num_actions = children.shape
    for node in range(num_nodes):
        for a in range(num_actions):
            child = children[k, node, a]
            if child >= 0 and visit_count[k, child] > 0:
                q = reward[k, child] + discount * value_sign * (value_sum[k, child] / visit_count[k, child])
                low = min(low, q)
                high = max(high, q)
    return low, high


@numba.njit(cache=True, nogil=True)
def _completed_q(k, node, children, visit_count, value_sum, reward, raw_value, prior,
                 discount, value_sign, c_visit, c_scale, low, high, out):  # fmt: skip
    """``sigma(q_hat)`` of every action at ``node`` of tree ``k`` into ``out`` (A,),
    rescaled by the node's completed values widened to [``low``, ``high``] (inf, -inf:
    the node's own bounds); returns the children's largest visit count."""
    num_actions = out.shape[0]
    total_visits = 0
    max_visits = 0
    sum_probs = 0.0
    weighted = 0.0
    for a in range(num_actions):
        child = children[k, node, a]
        n = visit_count[k, child] if child >= 0 else 0
        if n > 0:
            q = reward[k, child] + discount * value_sign * (value_sum[k, child] / n)
            out[a] = q
            p = max(_TINY, prior[k, node, a])
            sum_probs += p
            weighted += p * q
            total_visits += n
            max_visits = max(max_visits, n)
    mixed = raw_value[k, node]
    if total_visits > 0:
        mixed = (raw_value[k, node] + total_visits * (weighted / sum_probs)) / (total_visits + 1)
    for a in range(num_actions):
        child = children[k, node, a]
        if child < 0 or visit_count[k, child] == 0:
            out[a] = mixed
        low = min(low, out[a])
        high = max(high, out[a])
    scale = (c_visit + max_visits) * c_scale / max(high - low, 1e-8)
    for a in range(num_actions):
        out[a] = (out[a] - low) * scale
    return max_visits


@numba.njit(cache=True, nogil=True, inline="always")
def _log(p):
    return math.log(p) if p > 0 else -np.inf


@numba.njit(cache=True, nogil=True)
def _root_score(k, children, visit_count, prior, legal, gumbel, q, considered_visit, best_logit, a):
    """mctx's ``score_considered`` for root action ``a`` (-inf: not to be visited now)."""
    child = children[k, 0, a]
    n = visit_count[k, child] if child >= 0 else 0
    if n != considered_visit or not legal[k, a]:
        return -np.inf
    return max(_LOW_LOGIT, gumbel[k, a] + (_log(prior[k, 0, a]) - best_logit) + q[a])


@numba.njit(cache=True, nogil=True)
def _gumbel_select(children, visit_count, value_sum, reward, raw_value, prior, legal, gumbel, table,
                   num_considered, discount, value_sign, c_visit, c_scale, tree_bounds, path, depth, parent, action,
                   q):  # fmt: skip
    """Walk every tree from the root to an unexpanded child (:func:`.tree.step_down`
    writes the walk): Sequential Halving with Gumbel at the root, the deterministic
    improved-policy rule below it. ``tree_bounds``: rescale Q by the whole tree's bounds
    (``mcts.gumbel_q_bounds: "tree"``). ``q`` is scratch space (A,). Returns the deepest
    new leaf's depth.

    The rules are written here, not in functions of their own: a compiled call per node
    that takes the tree's arrays costs more than the choice itself."""
    k_trees, _, num_actions = children.shape
    deepest = 0
    for k in range(k_trees):
        low, high = _q_bounds(k, tree_bounds, children, visit_count, value_sum, reward, discount, value_sign)
        node, d = 0, 0
        while node >= 0:
            _completed_q(k, node, children, visit_count, value_sum, reward, raw_value, prior,
                         discount, value_sign, c_visit, c_scale, low, high, q)  # fmt: skip
            best = -1
            if node == 0:
                root_visits = 0
                best_logit = -np.inf
                for a in range(num_actions):
                    child = children[k, 0, a]
                    root_visits += visit_count[k, child] if child >= 0 else 0
                    if legal[k, a]:
                        best_logit = max(best_logit, _log(prior[k, 0, a]))
                considered_visit = table[num_considered[k], root_visits]
                best_score = -np.inf
                for a in range(num_actions):
                    score = _root_score(k, children, visit_count, prior, legal, gumbel, q, considered_visit,
                                        best_logit, a)  # fmt: skip
                    if best < 0 and legal[k, a] or score > best_score:
                        best_score = score
                        best = a
            else:
                # softmax(log prior + sigma(q_hat)) - N(a) / (1 + sum N)
                top = -np.inf
                total_visits = 0
                for a in range(num_actions):
                    q[a] += _log(prior[k, node, a])
                    top = max(top, q[a])
                    child = children[k, node, a]
                    total_visits += visit_count[k, child] if child >= 0 else 0
                norm = 0.0
                for a in range(num_actions):
                    q[a] = math.exp(q[a] - top)
                    norm += q[a]
                best_score = -np.inf
                for a in range(num_actions):
                    child = children[k, node, a]
                    n = visit_count[k, child] if child >= 0 else 0
                    score = q[a] / norm - n / (1 + total_visits)
                    if score > best_score:
                        best_score = score
                        best = a
            node, d = step_down(k, node, best, d, children, path, depth, parent, action)
        deepest = max(deepest, d)
    return deepest


@numba.njit(cache=True, nogil=True)
def _gumbel_decide(children, visit_count, value_sum, reward, raw_value, prior, legal, gumbel,
                   discount, value_sign, c_visit, c_scale, tree_bounds, actions, policy, q):  # fmt: skip
    """After the simulations, per tree: the action (among the most visited root
    children, the largest ``g + logits + sigma(q_hat)``) and the policy target
    ``softmax(logits + sigma(q_hat))`` over the legal actions."""
    k_trees, _, num_actions = children.shape
    for k in range(k_trees):
        low, high = _q_bounds(k, tree_bounds, children, visit_count, value_sum, reward, discount, value_sign)
        most = _completed_q(k, 0, children, visit_count, value_sum, reward, raw_value, prior,
                            discount, value_sign, c_visit, c_scale, low, high, q)  # fmt: skip
        best_logit = -np.inf
        for a in range(num_actions):
            if legal[k, a]:
                best_logit = max(best_logit, _log(prior[k, 0, a]))
        best = -1
        best_score = -np.inf
        for a in range(num_actions):
            score = _root_score(k, children, visit_count, prior, legal, gumbel, q, most, best_logit, a)
            if best < 0 and legal[k, a] or score > best_score:
                best_score = score
                best = a
        actions[k] = best
        top = -np.inf
        for a in range(num_actions):
            if legal[k, a]:
                top = max(top, _log(prior[k, 0, a]) + q[a])
        norm = 0.0
        for a in range(num_actions):
            w = math.exp(_log(prior[k, 0, a]) + q[a] - top) if legal[k, a] else 0.0
            policy[k, a] = w
            norm += w
        for a in range(num_actions):
            policy[k, a] /= norm
