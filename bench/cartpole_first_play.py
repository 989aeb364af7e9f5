"""How an untrained MuZero network plays CartPole-v1 in self-play, before any training step.

For each seed S, builds the network the way a run with ``--seed S`` does (``torch.manual_seed(S)``,
then the config's network) and plays ``--episodes`` self-play episodes with it: Dirichlet
root noise, visit-count temperature at progress 0 (the first entry of
``mcts.temperature_schedule``), ``runtime.envs_per_worker`` envs batched, as one worker of
that run plays before the first weights are trained. Prints, per seed, the mean episode
length, the share of moves that took action 0 (left) and the mean share of the root's
visits that went to its most visited action; then the same for uniformly random actions.

A uniformly random policy balances CartPole about 22 moves on average. A network whose
value or reward heads happen to favour one action's child in every state makes its searches
push the cart one way, and its first episodes are shorter than random ones: those are the
data the first training steps learn from.

Usage::

    python bench/cartpole_first_play.py [--config configs/cartpole.json] [--seeds 0 1 2 ...]
        [--episodes 200] [--set network.zero_init_heads=true ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpper.algos.configs import load_config  # noqa: E402
from mpper.algos.muzero.player import BatchedPlayer  # noqa: E402
from mpper.algos.registry import algorithm_of  # noqa: E402
from mpper.envs import env_spec, make_env  # noqa: E402


def first_play(config, seed: int, episodes: int) -> dict:
    """Self-play with the untrained network of ``--seed seed``: episode lengths, actions, visit shares."""
    spec = env_spec(config.env)
    torch.manual_seed(seed)  # as the supervisor does before building the first weights
    network = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions).eval()
    envs = [make_env(config.env) for _ in range(config.runtime.envs_per_worker)]
    player = BatchedPlayer(config, envs, network, explore=True, seed=seed * 1000)
    played = []
    while len(played) < episodes:
        played += player.step(progress=0.0)
    for env in envs:
        env.close()
    played = played[:episodes]
    return {"length": float(np.mean([ep.moves for ep in played])),
            "left": float(np.mean(np.concatenate([np.equal(ep.action, 0) for ep in played]))),
            "top_share": float(np.mean(np.concatenate([np.max(ep.child_visits, axis=1) for ep in played])))}  # fmt: skip


def random_play(config, seed: int, episodes: int) -> dict:
    env = make_env(config.env)
    rng = np.random.default_rng(seed)
    lengths, left = [], []
    for k in range(episodes):
        env.reset(seed=seed * 1000 + k)
        moves, done = 0, False
        while not done:
            action = int(rng.integers(2))
            left.append(action == 0)
            _, _, terminated, truncated, _ = env.step(action)
            moves, done = moves + 1, terminated or truncated
        lengths.append(moves)
    env.close()
    return {"length": float(np.mean(lengths)), "left": float(np.mean(left)), "top_share": float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cartpole.json"))
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args()
    config = load_config(args.config, args.set)
    if config.algorithm != "muzero":
        raise SystemExit(f'{args.config}: algorithm must be "muzero", got {config.algorithm!r}')
    torch.set_num_threads(1)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{args.config} {' '.join('--set ' + s for s in args.set)}".rstrip())
    print(f"{args.episodes} self-play episodes per seed before any training, {started}\n")
    print("| seed | mean episode length | moves to the left | root visits on the most visited action |")
    print("|---|---|---|---|")
    lengths = []
    for seed in args.seeds:
        r = first_play(config, seed, args.episodes)
        lengths.append(r["length"])
        print(f"| {seed} | {r['length']:.1f} | {r['left']:.2f} | {r['top_share']:.2f} |", flush=True)
    r = random_play(config, 0, args.episodes)
    print(f"| uniformly random actions | {r['length']:.1f} | {r['left']:.2f} | - |")
    print(f"\nmedian over seeds {np.median(lengths):.1f}, shortest {min(lengths):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
