"""The Sampled MuZero search written as a plain loop: the straightforward per-tree, per-node
Python version of the paper's rules (Hubert et al. 2021, the sampled-policy correction and pUCT
over K samples; Danihelka et al. 2022, Gumbel MuZero's rules over the samples), walking numpy
trees one node at a time. The package's compiled search (``mpper.algos.sampled_muzero.search``)
must give the same results from the same seeds: it draws from the generator in the same order
and amounts, so actions, visit counts, policy targets, values and chosen samples match.

Not for use in the package: it is the reference the compiled kernels are tested against.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mpper.algos.muzero_family import considered_visits
from mpper.algos.sampled_muzero.config import SampledMCTSConfig
from mpper.algos.sampled_muzero.networks import support_to_scalar_np
from mpper.algos.sampled_muzero.search import SampledSearchResult

__all__ = ["ReferenceSampledSearch", "reference_sampled_prior"]


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


_TINY = np.finfo(np.float64).tiny
_LOW_LOGIT = -1e9  # mctx's floor of the root score


class ReferenceGumbelRoots:
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


def reference_sampled_prior(
    actions: np.ndarray, log_pi: np.ndarray, log_beta: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The sampled-policy correction at one node: for K sampled ``actions`` (K, A) with
    log pi (K,) and log beta (K,) of each, (prior (K,) float64, distinct (K,) bool): the
    first of each group of equal samples holds ``beta_hat(a) / beta(a) * pi(a)``
    normalised over the distinct samples (beta_hat(a) = count(a) / K), its repeats prior 0
    and ``distinct`` False."""
    k = actions.shape[0]
    _, first, inverse, counts = np.unique(actions, axis=0, return_index=True, return_inverse=True,
                                          return_counts=True)  # fmt: skip
    distinct = np.zeros(k, bool)
    distinct[first] = True
    beta_hat = counts[inverse.reshape(-1)] / k
    log_weight = np.log(beta_hat) + log_pi - log_beta
    weight = np.where(distinct, np.exp(log_weight - log_weight[distinct].max()), 0.0)
    return weight / weight.sum(), distinct


class _Trees:
    """N trees of ``nodes`` nodes with ``k`` edges each (node 0: the root)."""

    def __init__(self, n: int, nodes: int, k: int, action_dim: int):
        self.visit_count = np.zeros((n, nodes), np.int64)
        self.value_sum = np.zeros((n, nodes))
        self.reward = np.zeros((n, nodes))
        self.raw_value = np.zeros((n, nodes))  # the network's value of the node (Gumbel's completed Q)
        self.prior = np.zeros((n, nodes, k))
        self.valid = np.zeros((n, nodes, k), bool)
        self.children = np.full((n, nodes, k), -1, np.int64)
        self.actions = np.zeros((n, nodes, k, action_dim))
        self.q_min = np.full(n, np.inf)
        self.q_max = np.full(n, -np.inf)


class ReferenceSampledSearch:
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

    def _expand(self, trees: _Trees, nodes: np.ndarray, params: np.ndarray, policy, rng, temperature: float,
                noise: bool) -> None:  # fmt: skip
        """Node ``nodes[t]`` of every tree t: K samples from beta (policy ``params`` (N, P) at
        ``temperature``), their corrected priors (with the root's noise when ``noise``)."""
        actions, log_beta = policy.sample(params, self.k, rng, temperature)
        log_pi = policy.log_prob_np(params, actions)
        for t, node in enumerate(nodes):
            self._set_edges(trees, t, int(node), actions[t], log_pi[t], log_beta[t], rng, noise)

    def _set_edges(self, trees: _Trees, tree: int, node: int, actions: np.ndarray, log_pi: np.ndarray,
                   log_beta: np.ndarray, rng, noise: bool) -> None:  # fmt: skip
        prior, distinct = reference_sampled_prior(actions, log_pi, log_beta)
        if noise:
            cfg = self.config
            gammas = rng.standard_gamma(cfg.root_dirichlet_alpha, size=self.k) * distinct
            total = gammas.sum()
            dirichlet = gammas / total if total > 0 else distinct / distinct.sum()
            prior = np.where(distinct, prior * (1 - cfg.root_exploration_fraction)
                             + dirichlet * cfg.root_exploration_fraction, 0.0)  # fmt: skip
        trees.actions[tree, node] = actions
        trees.prior[tree, node] = prior
        trees.valid[tree, node] = distinct

    def _select(self, trees: _Trees, tree: int, tie_break: np.ndarray) -> tuple[list[int], int, int]:
        """Walk tree ``tree`` from its root by pUCT to an unexpanded child: (path of nodes,
        parent, edge)."""
        cfg = self.config
        span = trees.q_max[tree] - trees.q_min[tree]
        node, path = 0, [0]
        while True:
            n_parent = trees.visit_count[tree, node]
            pb_c = (math.log((n_parent + cfg.pb_c_base + 1) / cfg.pb_c_base) + cfg.pb_c_init) * math.sqrt(n_parent)
            best, best_score = -1, -np.inf
            prior = trees.prior[tree, node]
            for e in range(self.k):
                if not trees.valid[tree, node, e]:
                    continue
                child = trees.children[tree, node, e]
                n_child = trees.visit_count[tree, child] if child >= 0 else 0
                score = pb_c * prior[e] / (n_child + 1)
                if n_child > 0:
                    q = trees.reward[tree, child] + cfg.discount * trees.value_sum[tree, child] / n_child
                    if span > 0:
                        q = (q - trees.q_min[tree]) / span
                    score += q
                if score > best_score or (
                    score == best_score
                    and (prior[e] > prior[best] or (prior[e] == prior[best] and tie_break[e] > tie_break[best]))
                ):
                    best, best_score = e, score
            child = trees.children[tree, node, best]
            if child < 0:
                return path, node, best
            node = int(child)
            path.append(node)

    def _backup(self, trees: _Trees, tree: int, path: list[int], value: float) -> None:
        discount = self.config.discount
        for node in reversed(path):
            trees.visit_count[tree, node] += 1
            trees.value_sum[tree, node] += value
            q = trees.reward[tree, node] + discount * trees.value_sum[tree, node] / trees.visit_count[tree, node]
            trees.q_min[tree] = min(trees.q_min[tree], q)
            trees.q_max[tree] = max(trees.q_max[tree], q)
            value = trees.reward[tree, node] + discount * value

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
        param = next(iter(network.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        trees = _Trees(n, sims + 1, self.k, self.action_dim)
        out = network.initial_inference(torch.as_tensor(np.asarray(observations, np.float32), device=device))
        root_value = support_to_scalar_np(out.value_logits.cpu().numpy(), self.support_size)
        params = out.policy_logits.cpu().numpy().astype(np.float64)
        temperature = cfg.root_sampling_temperature if explore else 1.0
        gumbel = cfg.kind == "gumbel"
        trees.raw_value[:, 0] = root_value
        self._expand(trees, np.zeros(n, np.int64), params, policy, rng, temperature, explore and not gumbel)
        roots = None
        if gumbel:
            noise = np.zeros((n, self.k))
            if explore:
                noise = cfg.gumbel_scale * rng.gumbel(size=(n, self.k)) if root_noise is None else root_noise
            roots = ReferenceGumbelRoots(cfg, trees, np.asarray(noise, np.float64), sims, cfg.discount)
        hidden = torch.empty((n, sims + 1, *out.hidden_state.shape[1:]), dtype=out.hidden_state.dtype, device=device)
        hidden[:, 0] = out.hidden_state
        parents, edges = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for sim in range(sims):
            paths: list[list[int]] = []
            for t in range(n):
                path, parents[t], edges[t] = self._select(trees, t, tie_break[t]) if roots is None else roots.select(t)
                paths.append(path)
            taken = trees.actions[np.arange(n), parents, edges].astype(np.float32)
            parent_states = hidden[torch.arange(n, device=device), torch.from_numpy(parents).to(device)]
            out = network.recurrent_inference(parent_states, torch.from_numpy(taken).to(device))
            leaf = sim + 1
            hidden[:, leaf] = out.hidden_state
            values = support_to_scalar_np(out.value_logits.cpu().numpy(), self.support_size)
            rewards = support_to_scalar_np(out.reward_logits.cpu().numpy(), self.support_size)
            leaf_params = out.policy_logits.cpu().numpy().astype(np.float64)
            self._expand(trees, np.full(n, leaf), leaf_params, policy, rng, 1.0, False)
            for t in range(n):
                trees.children[t, parents[t], edges[t]] = leaf
                trees.reward[t, leaf] = rewards[t]
                trees.raw_value[t, leaf] = values[t]
                self._backup(trees, t, paths[t] + [leaf], float(values[t]))
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
