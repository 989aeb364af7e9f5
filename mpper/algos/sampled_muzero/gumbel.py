"""Gumbel MuZero's search policy (Danihelka et al., "Policy improvement by planning with
Gumbel", ICLR 2022) over a node's sampled actions, for ``sampled_mcts.kind: "gumbel"``.

The rules are those of MuZero's Gumbel search (:mod:`mpper.algos.muzero.gumbel`, mctx's
``gumbel_muzero_policy``) with a node's K sampled actions in place of the action set, as
the Gumbel paper treats large action spaces: the sampled actions are the ones considered,
and their logits are the log of the search's prior, the sampled-policy correction
``beta_hat / beta * pi`` (with beta = pi: equal logits, so the root ranks its samples by
``g + sigma(q_hat)``). At the root: Gumbel noise ``g`` per sample (``gumbel_scale``; 0 when
not exploring), Sequential Halving over ``max_num_considered_actions`` samples, the action
the survivor; the policy target ``softmax(logits + sigma(q_hat))`` over the root's samples.
Below the root: the argmax of ``softmax(logits + sigma(q_hat))(a) - N(a) / (1 + sum N)``.
Completed Q-values and their rescaling (``gumbel_q_bounds``) as MuZero's. A repeated sample
(no child of its own) is never chosen.

The selection over every tree and the root's decision are numba kernels over the search's
tree arrays (:class:`.search.SampledSearch` owns them), as MuZero's Gumbel search has them.
Arithmetic follows the plain loop version of these rules step for step (the same operations
in the same order, numpy's pairwise summation where that version sums with numpy), so the
kernels give its results; the policy target's softmax is computed in numpy, as there.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ..muzero_family import considered_visits

__all__ = ["GumbelRoots", "numpy_sum"]

_TINY = np.finfo(np.float64).tiny
_LOW_LOGIT = -1e9  # mctx's floor of the root score


class GumbelRoots:
    """The Gumbel policy of one batched search: the roots' noise and schedule, selection
    and the decision. ``trees``: the search's ``_Trees`` (with ``raw_value`` and
    ``log_prior``); ``gumbel`` (N, K): the roots' noise, already scaled."""

    def __init__(self, config, trees, gumbel: np.ndarray, num_simulations: int, discount: float):
        self.config = config
        self.trees = trees
        self.gumbel = np.ascontiguousarray(gumbel, np.float64)
        self.discount = float(discount)
        k = trees.prior.shape[2]
        m = min(config.max_num_considered_actions, k)
        self.table = np.array([considered_visits(j, num_simulations) for j in range(m + 1)],
                              np.int64).reshape(m + 1, num_simulations)  # fmt: skip
        self.num_considered = np.minimum(m, trees.valid[:, 0].sum(1)).astype(np.int64)
        self.tree_bounds = config.gumbel_q_bounds == "tree"
        self.sigma = np.empty(k)  # scratch: one node's sigma(q_hat)
        self.weights = np.empty(k)  # scratch: one node's softmax weights

    def select(self) -> None:
        """Walk every tree to an unexpanded child, writing the trees' ``path``, ``depth``,
        ``parent`` and ``edge``."""
        tr, cfg = self.trees, self.config
        _gumbel_select(tr.children, tr.visit_count, tr.value_sum, tr.reward, tr.raw_value, tr.prior, tr.log_prior,
                       tr.valid, self.gumbel, self.table, self.num_considered, self.discount, cfg.c_visit, cfg.c_scale,
                       self.tree_bounds, tr.path, tr.depth, tr.parent, tr.edge, self.sigma, self.weights)  # fmt: skip

    def decide(self) -> tuple[np.ndarray, np.ndarray]:
        """(chosen root edge (N,), policy target (N, K): ``softmax(logits + sigma(q_hat))``
        over each root's distinct samples)."""
        tr, cfg = self.trees, self.config
        n, k = tr.prior.shape[0], tr.prior.shape[2]
        chosen = np.empty(n, np.int64)
        sigma = np.empty((n, k))
        _gumbel_decide(tr.children, tr.visit_count, tr.value_sum, tr.reward, tr.raw_value, tr.prior, tr.valid,
                       self.gumbel, self.discount, cfg.c_visit, cfg.c_scale, self.tree_bounds, chosen, sigma)  # fmt: skip
        with np.errstate(divide="ignore"):
            scores = np.where(tr.valid[:, 0], np.log(tr.prior[:, 0]) + sigma, -math.inf)
        weights = np.exp(scores - scores.max(1, keepdims=True))
        return chosen, weights / weights.sum(1, keepdims=True)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _block_sum(x, start, count):
    """numpy's pairwise sum of ``x[start : start + count]`` for ``count`` <= 128: a plain
    loop under 8, else eight running sums, combined pairwise, then the remainder."""
    if count < 8:
        total = 0.0
        for i in range(start, start + count):
            total += x[i]
        return total
    r0, r1, r2, r3 = x[start], x[start + 1], x[start + 2], x[start + 3]
    r4, r5, r6, r7 = x[start + 4], x[start + 5], x[start + 6], x[start + 7]
    i = 8
    while i < count - count % 8:
        j = start + i
        r0 += x[j]
        r1 += x[j + 1]
        r2 += x[j + 2]
        r3 += x[j + 3]
        r4 += x[j + 4]
        r5 += x[j + 5]
        r6 += x[j + 6]
        r7 += x[j + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < count:
        total += x[start + i]
        i += 1
    return total


@numba.njit(cache=True, nogil=True)
def numpy_sum(x, start, count):
    """``x[start : start + count].sum()`` of a float64 array added up as numpy does (its
    pairwise summation: blocks of up to 128, halves at a multiple of 8 above), so that a
    kernel's sum equals numpy's to the last bit. The halving runs on an explicit stack, not
    by recursion: numba's disk cache does not load a recursive kernel safely."""
    if count <= 128:
        return _block_sum(x, start, count)
    task_start = np.empty(192, np.int64)  # what is left to do, last in first out; count -1: add two sums
    task_count = np.empty(192, np.int64)
    sums = np.empty(64)
    tasks, done = 1, 0
    task_start[0], task_count[0] = start, count
    while tasks > 0:
        tasks -= 1
        s, c = task_start[tasks], task_count[tasks]
        if c < 0:
            done -= 1
            sums[done - 1] += sums[done]
        elif c <= 128:
            sums[done] = _block_sum(x, s, c)
            done += 1
        else:
            half = c // 2
            half -= half % 8
            task_start[tasks], task_count[tasks] = 0, -1
            task_start[tasks + 1], task_count[tasks + 1] = s + half, c - half
            task_start[tasks + 2], task_count[tasks + 2] = s, half
            tasks += 3
    return sums[0]


@numba.njit(cache=True, nogil=True)
def _q_bounds(t, tree_bounds, children, visit_count, value_sum, reward, discount):
    """With ``tree_bounds``, (min, max) of every visited edge's ``r + discount * V(child)``
    in tree ``t``; otherwise, or before any visit, (inf, -inf): each node's own bounds."""
    low = np.inf
    high = -np.inf
    if not tree_bounds:
        return low, high
    _, num_nodes, k = children.shape
    for node in range(num_nodes):
        for e in range(k):
            child = children[t, node, e]
            if child >= 0 and visit_count[t, child] > 0:
                q = reward[t, child] + discount * value_sum[t, child] / visit_count[t, child]
                low = min(low, q)
                high = max(high, q)
    return low, high


@numba.njit(cache=True, nogil=True)
def _completed_q(t, node, children, visit_count, value_sum, reward, raw_value, prior, discount, c_visit, c_scale,
                 low, high, out):  # fmt: skip
    """``sigma(q_hat)`` of the K edges of ``node`` in tree ``t`` into ``out`` (K,): a
    visited child's ``r + discount * V``, an unvisited one's the node's mixed value,
    rescaled by their bounds widened to [``low``, ``high``]; returns the children's largest
    visit count."""
    k = out.shape[0]
    total = 0
    most = 0
    sum_probs = 0.0
    weighted = 0.0
    for e in range(k):
        child = children[t, node, e]
        n = visit_count[t, child] if child >= 0 else 0
        if n > 0:
            q = reward[t, child] + discount * value_sum[t, child] / n
            out[e] = q
            p = max(_TINY, prior[t, node, e])
            sum_probs += p
            weighted += p * q
            total += n
            most = max(most, n)
    mixed = raw_value[t, node]
    if total > 0:
        mixed = (raw_value[t, node] + total * (weighted / sum_probs)) / (total + 1)
    node_low = np.inf
    node_high = -np.inf
    for e in range(k):
        child = children[t, node, e]
        if child < 0 or visit_count[t, child] == 0:
            out[e] = mixed
        node_low = min(node_low, out[e])
        node_high = max(node_high, out[e])
    low = min(low, node_low)
    high = max(high, node_high)
    scale = (c_visit + most) * c_scale / max(high - low, 1e-8)
    for e in range(k):
        out[e] = (out[e] - low) * scale
    return most


@numba.njit(cache=True, nogil=True, inline="always")
def _log(p):
    return math.log(p) if p > 0 else -np.inf


@numba.njit(cache=True, nogil=True)
def _root_choice(t, children, visit_count, prior, valid, gumbel, sigma, considered_visit):
    """The root edge of tree ``t`` to visit: among the valid edges whose child has
    ``considered_visit`` visits, the largest ``g + logits - max logits + sigma`` (floored
    at mctx's -1e9); the first valid edge when none has."""
    k = sigma.shape[0]
    best_logit = -np.inf
    for e in range(k):
        if valid[t, 0, e]:
            best_logit = max(best_logit, _log(prior[t, 0, e]))
    best = -1
    best_score = -np.inf
    for e in range(k):
        child = children[t, 0, e]
        n = visit_count[t, child] if child >= 0 else 0
        score = -np.inf
        if n == considered_visit and valid[t, 0, e]:
            score = max(_LOW_LOGIT, gumbel[t, e] + (_log(prior[t, 0, e]) - best_logit) + sigma[e])
        if (best < 0 and valid[t, 0, e]) or score > best_score:
            best = e
            best_score = score
    return best


@numba.njit(cache=True, nogil=True)
def _gumbel_select(children, visit_count, value_sum, reward, raw_value, prior, log_prior, valid, gumbel, table,
                   num_considered, discount, c_visit, c_scale, tree_bounds, path, depth, parent, edge, sigma,
                   weights):  # fmt: skip
    """Walk each of the N trees (arrays (N, nodes) per node, (N, nodes, K) per edge) from
    its root to an unexpanded child: Sequential Halving with Gumbel at the root (``table``
    (m + 1, simulations): the visit count a root child needs, for ``num_considered[t]``
    samples considered), the deterministic improved-policy rule below it (``log_prior``:
    numpy's log of ``prior``). Writes the walk: ``path[t, :depth[t]]`` the nodes from the
    root, ``parent[t]`` and ``edge[t]`` the new leaf's parent and edge. ``sigma`` and
    ``weights`` (K,) are scratch."""
    n_trees, _, k = children.shape
    for t in range(n_trees):
        low, high = _q_bounds(t, tree_bounds, children, visit_count, value_sum, reward, discount)
        node = 0
        d = 0
        path[t, 0] = 0
        while True:
            _completed_q(t, node, children, visit_count, value_sum, reward, raw_value, prior, discount, c_visit,
                         c_scale, low, high, sigma)  # fmt: skip
            if node == 0:
                root_visits = 0
                for e in range(k):
                    child = children[t, 0, e]
                    if child >= 0:
                        root_visits += visit_count[t, child]
                best = _root_choice(t, children, visit_count, prior, valid, gumbel, sigma,
                                    table[num_considered[t], root_visits])  # fmt: skip
            else:
                # softmax(log prior + sigma(q_hat)) - N(a) / (1 + sum N), over the valid edges
                top = -np.inf
                total_visits = 0
                for e in range(k):
                    weights[e] = log_prior[t, node, e] + sigma[e]
                    top = max(top, weights[e])
                    child = children[t, node, e]
                    if child >= 0:
                        total_visits += visit_count[t, child]
                for e in range(k):
                    weights[e] = math.exp(weights[e] - top)
                norm = numpy_sum(weights, 0, k)
                best = 0
                best_score = -np.inf
                for e in range(k):
                    child = children[t, node, e]
                    n = visit_count[t, child] if child >= 0 else 0
                    score = weights[e] / norm - n / (1 + total_visits) if valid[t, node, e] else -np.inf
                    if e == 0 or score > best_score:
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
def _gumbel_decide(children, visit_count, value_sum, reward, raw_value, prior, valid, gumbel, discount, c_visit,
                   c_scale, tree_bounds, chosen, sigma):  # fmt: skip
    """After the simulations, per tree t: ``chosen[t]``, the root edge among the most
    visited children with the largest ``g + logits + sigma(q_hat)``, and ``sigma[t]`` (K,),
    the root's ``sigma(q_hat)`` (the policy target's, computed by the caller)."""
    n_trees = children.shape[0]
    for t in range(n_trees):
        low, high = _q_bounds(t, tree_bounds, children, visit_count, value_sum, reward, discount)
        most = _completed_q(t, 0, children, visit_count, value_sum, reward, raw_value, prior, discount, c_visit,
                            c_scale, low, high, sigma[t])  # fmt: skip
        chosen[t] = _root_choice(t, children, visit_count, prior, valid, gumbel, sigma[t], most)
