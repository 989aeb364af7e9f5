"""Self-play search speed: moves per CPU-second of one process.

One "move" is one root searched: a search over K environments with ``num_simulations``
simulations yields K moves. The network is the CartPole one (observation (4,), 2 actions,
fc, encoding_size 16, hidden [64], support 10), in eval mode, with torch limited to one
thread as a self-play worker is. Two priors are measured:

* ``random``: a freshly initialised network (flat priors, shallow trees);
* ``peaked``: the same network with its policy head scaled up, so priors are sharp and
  trees deep, as with a trained network (tree cost grows with depth).

Root noise is on, as in self-play (Dirichlet for pUCT, Gumbel for Gumbel MuZero). Each
(search, priors, K) cell runs searches for about ``--seconds`` after one warm-up search;
the figure is K * searches / process CPU time. ``--searches`` lists the searches as
``kind:simulations`` (``mcts.kind`` and ``mcts.num_simulations``).

Usage::

    python bench/mcts_speed.py                      # pUCT-50; K = 1, 8, 32, 64; ~1 s per cell
    python bench/mcts_speed.py --ks 64 --seconds 3 --out bench/results/mcts.json
    python bench/mcts_speed.py --ks 64 --searches puct:25 puct:50 gumbel:4 gumbel:8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpper.algos.muzero.config import MCTSConfig, NetworkConfig
from mpper.algos.muzero.networks import make_network
from mpper.algos.muzero.search import Search, make_search


def measure(network, mcts: Search, k_envs: int, seconds: float, rng: np.random.Generator) -> dict:
    obs = rng.normal(0, 0.5, size=(k_envs, 4)).astype(np.float32)
    legal = np.ones((k_envs, 2), dtype=bool)
    to_play = np.zeros(k_envs, dtype=np.int64)
    mcts.run(network, obs, legal, to_play, True, rng)  # warm-up (numba kernels, allocator)
    searches, depth = 0, 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while True:
        result = mcts.run(network, obs, legal, to_play, True, rng)
        searches += 1
        depth = max(depth, result.max_tree_depth)
        wall = time.perf_counter() - wall0
        if wall >= seconds and searches >= 3:
            break
    cpu = time.process_time() - cpu0
    return {
        "K": k_envs,
        "searches": searches,
        "moves_per_cpu_s": k_envs * searches / cpu,
        "moves_per_wall_s": k_envs * searches / wall,
        "ms_per_search": 1000 * wall / searches,
        "max_tree_depth": depth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8, 32, 64], help="environments per search")
    parser.add_argument("--searches", nargs="+", default=["puct:50"], metavar="KIND:SIMULATIONS",
                        help='searches to measure, e.g. "puct:25 gumbel:8"')
    parser.add_argument("--seconds", type=float, default=1.0, help="time per cell")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    net_cfg = NetworkConfig(kind="fc", encoding_size=16, hidden=[64], support_size=10)
    searches = []
    for spec in args.searches:
        kind, _, simulations = spec.partition(":")
        if kind not in ("puct", "gumbel") or not simulations.isdigit() or int(simulations) < 1:
            parser.error(f"--searches: expected KIND:SIMULATIONS with KIND puct or gumbel, got {spec!r}")
        config = MCTSConfig(kind=kind, num_simulations=int(simulations))
        searches.append((spec, make_search(2, config, net_cfg.support_size)))
    rows = []
    for name, mcts in searches:
        for priors in ("random", "peaked"):
            torch.manual_seed(0)
            network = make_network(net_cfg, (4,), 2).eval()
            if priors == "peaked":
                with torch.no_grad():
                    network.prediction_policy_network[-1].weight.mul_(30.0)
            for k_envs in args.ks:
                row = {"search": name, "priors": priors, **measure(network, mcts, k_envs, args.seconds, rng)}
                rows.append(row)
                print(
                    f"{name:>9}  {priors:>6}  K={row['K']:>3}  {row['moves_per_cpu_s']:8.0f} moves/CPU-s  "
                    f"{row['moves_per_wall_s']:8.0f} moves/s wall  {row['ms_per_search']:7.1f} ms/search  "
                    f"max depth {row['max_tree_depth']}",
                    flush=True,
                )
    if args.out:
        meta = {"searches": args.searches, "torch_threads": 1, "torch": torch.__version__, "cpus": os.cpu_count()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
