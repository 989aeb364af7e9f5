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
"""

from __future__ import annotations

import math

import numpy as np

from ..muzero_family import considered_visits

__all__ = ["GumbelRoots"]

_TINY = np.finfo(np.float64).tiny
_LOW_LOGIT = -1e9  # mctx's floor of the root score


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


class GumbelRoots:
    """The Gumbel policy of one batched search: the roots' noise and schedule, selection
    and the decision. ``trees``: the search's ``_Trees`` (with ``raw_value``); ``gumbel``
    (N, K): the roots' noise, already scaled."""

    def __init__(self, config, trees, gumbel: np.ndarray, num_simulations: int, discount: float):
        self.config = config
        self.trees = trees
        self.gumbel = gumbel
        self.discount = discount
        m = min(config.max_num_considered_actions, trees.prior.shape[2])
        self.table = [considered_visits(j, num_simulations) for j in range(m + 1)]
        self.num_considered = np.minimum(m, trees.valid[:, 0].sum(1))
        self.tree_bounds = config.gumbel_q_bounds == "tree"

    def _q(self, t: int, child: int) -> float:
        tr = self.trees
        return tr.reward[t, child] + self.discount * tr.value_sum[t, child] / tr.visit_count[t, child]

    def _bounds(self, t: int) -> tuple[float, float]:
        """(min, max) of every visited edge's Q in tree ``t`` with ``gumbel_q_bounds``
        "tree"; else (inf, -inf): each node's own bounds."""
        if not self.tree_bounds:
            return math.inf, -math.inf
        children = self.trees.children[t]
        visited = children[(children >= 0)]
        visited = visited[self.trees.visit_count[t, visited] > 0]
        if visited.size == 0:
            return math.inf, -math.inf
        q = [self._q(t, int(c)) for c in visited]
        return min(q), max(q)

    def completed_q(self, t: int, node: int, low: float, high: float) -> tuple[np.ndarray, int]:
        """``sigma(q_hat)`` (K,) of the edges of ``node`` and the children's largest visit count."""
        tr, k = self.trees, self.trees.prior.shape[2]
        out = np.empty(k)
        visited = np.zeros(k, bool)
        total = most = 0
        sum_probs = weighted = 0.0
        for e in range(k):
            child = tr.children[t, node, e]
            n = int(tr.visit_count[t, child]) if child >= 0 else 0
            if n > 0:
                q = self._q(t, int(child))
                out[e] = q
                visited[e] = True
                p = max(_TINY, tr.prior[t, node, e])
                sum_probs += p
                weighted += p * q
                total += n
                most = max(most, n)
        mixed = tr.raw_value[t, node]
        if total > 0:
            mixed = (tr.raw_value[t, node] + total * (weighted / sum_probs)) / (total + 1)
        out[~visited] = mixed
        low, high = min(low, out.min()), max(high, out.max())
        cfg = self.config
        return (out - low) * ((cfg.c_visit + most) * cfg.c_scale / max(high - low, 1e-8)), most

    def _root_choice(self, t: int, sigma: np.ndarray, considered_visit: int) -> int:
        tr = self.trees
        logits = [_log(p) for p in tr.prior[t, 0]]
        best_logit = max(logits[e] for e in range(len(logits)) if tr.valid[t, 0, e])
        best, best_score = -1, -math.inf
        for e in range(len(logits)):
            child = tr.children[t, 0, e]
            n = tr.visit_count[t, child] if child >= 0 else 0
            valid = tr.valid[t, 0, e]
            score = -math.inf
            if n == considered_visit and valid:
                score = max(_LOW_LOGIT, self.gumbel[t, e] + (logits[e] - best_logit) + sigma[e])
            if (best < 0 and valid) or score > best_score:
                best, best_score = e, score
        return best

    def select(self, t: int) -> tuple[list[int], int, int]:
        """Walk tree ``t`` to an unexpanded child: (path of nodes, parent, edge)."""
        tr = self.trees
        low, high = self._bounds(t)
        node, path = 0, [0]
        while True:
            sigma, _ = self.completed_q(t, node, low, high)
            if node == 0:
                root_children = tr.children[t, 0]
                root_visits = int(tr.visit_count[t, root_children[root_children >= 0]].sum())
                best = self._root_choice(t, sigma, self.table[self.num_considered[t]][root_visits])
            else:
                with np.errstate(divide="ignore"):
                    scores = np.log(tr.prior[t, node]) + sigma
                weights = np.exp(scores - scores.max())
                improved = weights / weights.sum()
                children = tr.children[t, node]
                visits = np.where(children >= 0, tr.visit_count[t, np.maximum(children, 0)], 0)
                score = np.where(tr.valid[t, node], improved - visits / (1 + visits.sum()), -math.inf)
                best = int(np.argmax(score))
            child = tr.children[t, node, best]
            if child < 0:
                return path, node, best
            node = int(child)
            path.append(node)

    def decide(self) -> tuple[np.ndarray, np.ndarray]:
        """(chosen root edge (N,), policy target (N, K): ``softmax(logits + sigma(q_hat))``
        over each root's distinct samples)."""
        tr = self.trees
        n, k = tr.prior.shape[0], tr.prior.shape[2]
        chosen = np.empty(n, np.int64)
        policy = np.zeros((n, k))
        for t in range(n):
            low, high = self._bounds(t)
            sigma, most = self.completed_q(t, 0, low, high)
            chosen[t] = self._root_choice(t, sigma, most)
            with np.errstate(divide="ignore"):
                scores = np.where(tr.valid[t, 0], np.log(tr.prior[t, 0]) + sigma, -math.inf)
            weights = np.exp(scores - scores.max())
            policy[t] = weights / weights.sum()
        return chosen, policy
