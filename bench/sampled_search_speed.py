"""Sampled MuZero search speed: milliseconds per batched search, and where they go.

One batched search is ``--roots`` roots searched together with the config's
``num_simulations`` and ``num_sampled_actions`` K (root noise on, as in self-play), on a
freshly initialised network of the config (torch limited to one thread, as a self-play
worker is). Besides the whole search, two of its parts are timed alone on the same shapes:

* ``network``: the torch calls, one initial inference and one recurrent inference per
  simulation for all roots, with their logits brought to numpy;
* ``sampling``: the policy's numpy work, K samples and their log densities per expanded
  node (``SquashedGaussian.sample`` and ``log_prob_np``), one call per simulation.

``tree`` is what remains: selection, the sampled-policy correction, noise, backup and the
Gumbel decision. ``--reference`` also times the plain loop version of the same search
(``tests/algos/sampled_muzero/python_search_reference.py``, the same results from the same
seeds) for a before/after in one run. Figures are medians over ``--repeats`` searches of
wall time and of process CPU time.

Usage::

    python bench/sampled_search_speed.py --reference
    python bench/sampled_search_speed.py --kinds gumbel --roots 32 --repeats 50
    python bench/sampled_search_speed.py --config configs/halfcheetah_sampled.json --obs-dim 17 --action-dim 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from mpper.algos.configs import load_config  # noqa: E402
from mpper.algos.sampled_muzero.networks import make_network  # noqa: E402
from mpper.algos.sampled_muzero.search import SampledSearch  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median wall ms, median CPU ms) of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(1000 * (time.perf_counter() - wall0))
        cpus.append(1000 * (time.process_time() - cpu0))
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", default=os.path.join(ROOT, "configs", "pendulum_sampled.json"), help="a sampled_muzero config"
    )
    parser.add_argument("--obs-dim", type=int, default=3, help="observation size (Pendulum: 3)")
    parser.add_argument("--action-dim", type=int, default=1, help="action dimensions (Pendulum: 1)")
    parser.add_argument("--kinds", nargs="+", default=["puct", "gumbel"], choices=["puct", "gumbel"])
    parser.add_argument("--roots", type=int, default=10, help="roots per batched search")
    parser.add_argument("--repeats", type=int, default=30, help="searches timed per figure")
    parser.add_argument("--reference", action="store_true", help="also time the plain loop version")
    args = parser.parse_args()

    torch.set_num_threads(1)
    reference = None
    if args.reference:
        sys.path.insert(0, os.path.join(ROOT, "tests", "algos", "sampled_muzero"))
        from python_search_reference import ReferenceSampledSearch as reference
    observations = np.random.default_rng(0).standard_normal((args.roots, args.obs_dim)).astype(np.float32)
    for kind in args.kinds:
        config = load_config(args.config, [f'sampled_mcts.kind="{kind}"'])
        mcts, net_cfg = config.sampled_mcts, config.sampled_network
        torch.manual_seed(0)
        network = make_network(net_cfg, (args.obs_dim,), args.action_dim).eval()
        rng = np.random.default_rng(0)
        search = SampledSearch(mcts, args.action_dim, net_cfg.support_size)
        total = timed(lambda: search.run(network, observations, True, rng), args.repeats)

        hidden0 = network.initial_inference(torch.from_numpy(observations)).hidden_state
        actions = torch.zeros((args.roots, args.action_dim))

        @torch.inference_mode()
        def network_calls():
            out = network.initial_inference(torch.from_numpy(observations))
            out.value_logits.numpy(), out.policy_logits.numpy()
            for _ in range(mcts.num_simulations):
                out = network.recurrent_inference(hidden0, actions)
                torch.cat([out.value_logits, out.reward_logits]).numpy(), out.policy_logits.numpy()

        params = np.random.default_rng(1).normal(size=(args.roots, 2 * args.action_dim))

        def sampling():
            for _ in range(mcts.num_simulations + 1):
                sampled, _ = network.policy.sample(params, mcts.num_sampled_actions, rng)
                network.policy.log_prob_np(params, sampled)

        net, samp = timed(network_calls, args.repeats), timed(sampling, args.repeats)
        tree = (total[0] - net[0] - samp[0], total[1] - net[1] - samp[1])
        print(f"{kind:>6}: {args.roots} roots x {mcts.num_simulations} simulations x K={mcts.num_sampled_actions}, "
              f"ms per batched search (wall / CPU)", flush=True)  # fmt: skip
        for name, (wall, cpu) in [("search", total), ("network", net), ("sampling", samp), ("tree", tree)]:
            print(f"    {name:<10} {wall:7.2f} / {cpu:7.2f}", flush=True)
        if reference is not None:
            slow = reference(mcts, args.action_dim, net_cfg.support_size)
            before = timed(lambda: slow.run(network, observations, True, rng), max(3, args.repeats // 3))
            slow_tree = (before[0] - net[0] - samp[0], before[1] - net[1] - samp[1])
            print(f"    {'plain loop search':<10} {before[0]:7.2f} / {before[1]:7.2f}", flush=True)
            print(f"    {'plain loop tree':<10} {slow_tree[0]:7.2f} / {slow_tree[1]:7.2f}   "
                  f"tree work {slow_tree[1] / max(tree[1], 1e-9):.1f}x faster (CPU)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
