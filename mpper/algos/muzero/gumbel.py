"""Batched Gumbel MuZero search (Danihelka et al., "Policy improvement by planning with
Gumbel", ICLR 2022), K trees searched together like :class:`~.mcts.BatchedMCTS`.

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

Two-player games (values negated between plies), discount and the tree layout (node
``s + 1`` created by simulation ``s`` in every tree, hidden states in one torch tensor)
are the pUCT search's; so is the backup kernel (:func:`.mcts._expand_and_backup`).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from .config import MCTSConfig
from .mcts import SearchResult, _expand_and_backup
from .networks import support_to_scalar

__all__ = ["GumbelMCTS", "considered_visits", "considered_visits_table"]


def considered_visits(max_num_considered_actions: int, num_simulations: int) -> list[int]:
    """Sequential Halving's schedule (mctx's ``get_sequence_of_considered_visits``): the
    visit count a root child must have to be visited at each of the ``num_simulations``
    simulations, with ``max_num_considered_actions`` = m actions considered at first.

    Rounds: the considered actions each get ``max(1, n // (ceil(log2 m) * considered))``
    more visits, then the number considered halves (never below 2)."""
    if max_num_considered_actions <= 1:
        return list(range(num_simulations))
    log2max = math.ceil(math.log2(max_num_considered_actions))
    sequence: list[int] = []
    visits = [0] * max_num_considered_actions
    considered = max_num_considered_actions
    while len(sequence) < num_simulations:
        extra = max(1, int(num_simulations / (log2max * considered)))
        for _ in range(extra):
            sequence.extend(visits[:considered])
            for i in range(considered):
                visits[i] += 1
        considered = max(2, considered // 2)
    return sequence[:num_simulations]


def considered_visits_table(max_num_considered_actions: int, num_simulations: int) -> np.ndarray:
    """(m + 1, n) int64: row j is :func:`considered_visits` for j actions considered (a
    root with fewer legal actions than m considers all of them)."""
    return np.array([considered_visits(j, num_simulations) for j in range(max_num_considered_actions + 1)],
                    dtype=np.int64).reshape(max_num_considered_actions + 1, num_simulations)  # fmt: skip


class GumbelMCTS:
    """Gumbel MuZero search for K environments at once (``mcts.kind: "gumbel"``).

    Same constructor and ``run`` arguments as :class:`~.mcts.BatchedMCTS`; ``run``'s
    ``SearchResult`` carries the chosen ``actions`` and the improved-policy
    ``policy_target``. Exploration is the root's Gumbel noise (``mcts.gumbel_scale``);
    the Dirichlet keys and the visit-count temperature do not apply.
    """

    def __init__(self, num_actions: int, config: MCTSConfig, support_size: int, two_player: bool = False):
        if config.num_simulations < 1:
            raise ValueError(f"mcts.num_simulations must be >= 1, got {config.num_simulations}")
        self.num_actions = num_actions
        self.config = config
        self.support_size = support_size
        self.two_player = two_player
        self.table = considered_visits_table(min(config.max_num_considered_actions, num_actions),
                                             config.num_simulations)  # fmt: skip

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

        Args: as :meth:`BatchedMCTS.run <.mcts.BatchedMCTS.run>`, except
            add_exploration_noise: draw Gumbel noise (times ``mcts.gumbel_scale``) for
                the roots; without it the noise is 0 (the greedy choice).
            root_noise: optional (K, A) Gumbel noise, already scaled, used instead of
                drawing it when ``add_exploration_noise`` (to replay a search exactly).
            tie_break: unused (ties in the Gumbel search go to the lowest index, as in
                mctx's argmax).
        """
        cfg = self.config
        num_sims, num_actions, support_size = cfg.num_simulations, self.num_actions, self.support_size
        legal = np.ascontiguousarray(legal_actions, dtype=bool)
        k_trees = legal.shape[0]
        if legal.ndim != 2 or legal.shape[1] != num_actions:
            raise ValueError(f"legal_actions must be (K, {num_actions}) bool, got shape {legal.shape}")
        if not legal.any(axis=1).all():
            raise ValueError(f"legal_actions: roots {np.flatnonzero(~legal.any(axis=1)).tolist()} have no legal action")
        if add_exploration_noise:
            gumbel = cfg.gumbel_scale * rng.gumbel(size=legal.shape) if root_noise is None else root_noise
            gumbel = np.ascontiguousarray(gumbel, dtype=np.float64)
            if gumbel.shape != legal.shape:
                raise ValueError(f"root_noise must be (K, A) = {legal.shape}, got shape {gumbel.shape}")
        else:
            gumbel = np.zeros(legal.shape)
        param = next(iter(network.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")

        num_nodes = num_sims + 1
        visit_count = np.zeros((k_trees, num_nodes), dtype=np.int64)
        value_sum = np.zeros((k_trees, num_nodes))
        reward = np.zeros((k_trees, num_nodes))
        raw_value = np.zeros((k_trees, num_nodes))  # the network's value of each node
        node_to_play = np.zeros((k_trees, num_nodes), dtype=np.int64)
        prior = np.zeros((k_trees, num_nodes, num_actions))
        children = np.full((k_trees, num_nodes, num_actions), -1, dtype=np.int64)
        q_min = np.full(k_trees, np.inf)  # kept by the shared backup kernel (history), unused here
        q_max = np.full(k_trees, -np.inf)
        tree_bounds = cfg.gumbel_q_bounds == "tree"
        path = np.zeros((k_trees, num_nodes + 1), dtype=np.int64)
        depth = np.zeros(k_trees, dtype=np.int64)
        parent = np.zeros(k_trees, dtype=np.int64)
        action = np.zeros(k_trees, dtype=np.int64)
        num_considered = np.minimum(self.table.shape[0] - 1, legal.sum(axis=1)).astype(np.int64)

        out = network.initial_inference(torch.as_tensor(np.asarray(observations, dtype=np.float32), device=device))
        logits = out.policy_logits.masked_fill(~torch.as_tensor(legal, device=device), -torch.inf)
        root = torch.cat([support_to_scalar(out.value_logits, support_size)[:, None], torch.softmax(logits, dim=1)], 1)
        root = root.cpu().numpy().astype(np.float64)
        raw_value[:, 0] = root[:, 0]
        prior[:, 0] = root[:, 1:]
        node_to_play[:, 0] = np.asarray(to_play, dtype=np.int64).reshape(k_trees)
        hidden = torch.empty((k_trees, num_nodes, *out.hidden_state.shape[1:]), dtype=out.hidden_state.dtype, device=device)  # fmt: skip
        hidden[:, 0] = out.hidden_state

        trees_t = torch.arange(k_trees, device=device)
        parent_t, action_t = torch.from_numpy(parent), torch.from_numpy(action)  # views: refreshed by _gumbel_select
        value_sign = -1.0 if self.two_player else 1.0
        scratch = np.empty(num_actions)
        max_tree_depth = 0
        for sim in range(num_sims):
            sim_depth = _gumbel_select(
                children, visit_count, value_sum, reward, raw_value, prior, legal, gumbel, self.table,
                num_considered, cfg.discount, value_sign, cfg.c_visit, cfg.c_scale, tree_bounds, path, depth, parent,
                action, scratch,
            )  # fmt: skip
            max_tree_depth = max(max_tree_depth, sim_depth)
            out = network.recurrent_inference(hidden[trees_t, parent_t.to(device)], action_t.to(device))
            hidden[:, sim + 1] = out.hidden_state
            logits = torch.cat([out.value_logits, out.reward_logits, out.policy_logits], 1).cpu().numpy()
            _expand_and_backup(
                sim + 1, logits, support_size, parent, action, path, depth, self.two_player, cfg.discount,
                children, visit_count, value_sum, reward, node_to_play, prior, q_min, q_max, raw_value,
            )  # fmt: skip

        actions = np.empty(k_trees, dtype=np.int64)
        policy = np.empty((k_trees, num_actions))
        _gumbel_decide(children, visit_count, value_sum, reward, raw_value, prior, legal, gumbel,
                       cfg.discount, value_sign, cfg.c_visit, cfg.c_scale, tree_bounds, actions, policy,
                       scratch)  # fmt: skip
        root_children = children[:, 0]
        visit_counts = np.where(root_children >= 0, np.take_along_axis(visit_count, np.maximum(root_children, 0), 1), 0)
        return SearchResult(
            root_values=value_sum[:, 0] / visit_count[:, 0],
            child_visits=visit_counts / visit_counts.sum(axis=1, keepdims=True),
            visit_counts=visit_counts,
            root_predicted_values=root[:, 0],
            max_tree_depth=max_tree_depth,
            policy_target=policy,
            actions=actions,
        )


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------

_TINY = np.finfo(np.float64).tiny
_LOW_LOGIT = -1e9  # mctx's floor of the root score, so that -inf appears only as the penalty


@numba.njit(cache=True, nogil=True)
def _tree_q_bounds(k, children, visit_count, value_sum, reward, discount, value_sign):
    """(min, max) over tree ``k`` of every visited edge's ``r + discount * V(child)``
    (from the side of the player taking the edge); (inf, -inf) before any visit."""
    low = np.inf
    high = -np.inf
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
    """Walk every tree from the root to an unexpanded child: Sequential Halving with
    Gumbel at the root, the deterministic improved-policy rule below it. Writes
    ``path``, ``depth``, ``parent`` and ``action`` as ``mcts._select`` does; returns
    the largest new-leaf depth. ``tree_bounds``: rescale Q by the whole tree's bounds
    (``mcts.gumbel_q_bounds: "tree"``). ``q`` is scratch space (A,)."""
    k_trees, _, num_actions = children.shape
    deepest = 0
    for k in range(k_trees):
        node = 0
        d = 0
        path[k, 0] = 0
        low, high = np.inf, -np.inf
        if tree_bounds:
            low, high = _tree_q_bounds(k, children, visit_count, value_sum, reward, discount, value_sign)
        while True:
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


@numba.njit(cache=True, nogil=True)
def _gumbel_decide(children, visit_count, value_sum, reward, raw_value, prior, legal, gumbel,
                   discount, value_sign, c_visit, c_scale, tree_bounds, actions, policy, q):  # fmt: skip
    """After the simulations, per tree: the action (among the most visited root
    children, the largest ``g + logits + sigma(q_hat)``) and the policy target
    ``softmax(logits + sigma(q_hat))`` over the legal actions."""
    k_trees, _, num_actions = children.shape
    for k in range(k_trees):
        low, high = np.inf, -np.inf
        if tree_bounds:
            low, high = _tree_q_bounds(k, children, visit_count, value_sum, reward, discount, value_sign)
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
