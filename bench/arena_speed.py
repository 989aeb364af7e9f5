"""Arena speed: games/s of a greedy MCTS agent (configs/tictactoe.json, 25 simulations,
an untrained network) against the random and the perfect player, played one game and
one search at a time (the agent wrapped in a plain function) and batched (all games
together, one search for every game where the agent is to move).

Usage::

    python bench/arena_speed.py --games 100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpper.algos.configs import load_config  # noqa: E402
from mpper.algos.muzero.arena import mcts_agent, play_match  # noqa: E402
from mpper.algos.registry import algorithm_of  # noqa: E402
from mpper.envs.tictactoe import TicTacToeEnv, perfect_agent, random_agent  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=int, default=100, help="games per opponent and path (half first, half second)")
    ap.add_argument("--paths", nargs="+", default=["single", "batched"], choices=["single", "batched"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = load_config(ROOT / "configs" / "tictactoe.json")
    network = algorithm_of(config).make_network(config, (3, 3, 3), 9).eval()
    print("| path | opponent | games | seconds | games/s |\n|---|---|---|---|---|")
    for path in args.paths:
        for name, make in (("random", random_agent), ("perfect", perfect_agent)):
            agent = mcts_agent(config, network, seed=0)
            player = agent if path == "batched" else (lambda o, m, p, agent=agent: agent(o, m, p))
            t0 = time.perf_counter()
            for first in (True, False):
                play_match(TicTacToeEnv, player, make(1), agent_first=first, games=args.games // 2, seed=0)
            dt = time.perf_counter() - t0
            print(f"| {path} | {name} | {args.games} | {dt:.2f} | {args.games / dt:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
