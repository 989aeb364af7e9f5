"""How the greedy episodes of a CartPole-v1 run end: pole down or cart off the track.

Plays ``--episodes`` greedy episodes (search without noise, most visited action; the
evaluator's play) with a run's checkpoint and prints, per episode, its length, the
final observation (cart position x, cart velocity, pole angle, pole angular velocity),
why it ended (|x| > 2.4: off the track; |angle| > 0.2095 rad: pole down; 500: time
limit), and the search's root value every 50 moves beside the discounted return of the
moves that actually followed.

Usage::

    python bench/cartpole_failures.py RUN_DIR [--checkpoint RUN_DIR/best.pt] [--episodes 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpper.algos.configs import load_run_config  # noqa: E402
from mpper.algos.registry import algorithm_of  # noqa: E402
from mpper.checkpoint import load_checkpoint, load_network_weights  # noqa: E402
from mpper.envs import env_spec, make_env  # noqa: E402
from mpper.runtime.evaluation import play_greedy  # noqa: E402

X_LIMIT, ANGLE_LIMIT = 2.4, 12 * 2 * np.pi / 360  # gymnasium's CartPole-v1 termination bounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = load_run_config(args.run_dir)
    checkpoint = args.checkpoint or args.run_dir / "checkpoint.pt"
    state = load_checkpoint(checkpoint)
    spec = env_spec(config.env)
    network = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions)
    load_network_weights(network, state["network"], checkpoint).eval()
    envs = [make_env(config.env) for _ in range(args.episodes)]
    episodes = play_greedy(config, envs, network, args.seed)
    gamma = config.mcts.discount
    print(f"{checkpoint} (training step {int(state['training_step'])}), {args.episodes} greedy episodes, seed {args.seed}")
    for k, ep in enumerate(episodes):
        x, v, angle, w = np.asarray(ep.observation[-1], float)
        why = "off the track" if abs(x) > X_LIMIT else "pole down" if abs(angle) > ANGLE_LIMIT else "time limit"
        rewards = np.asarray(ep.reward[1:], float)
        returns = [float(np.sum(rewards[i:] * gamma ** np.arange(len(rewards) - i))) for i in range(0, ep.moves, 50)]
        values = [float(ep.root_value[i]) for i in range(0, ep.moves, 50)]
        pairs = ", ".join(f"{vv:.0f}/{rr:.0f}" for vv, rr in zip(values, returns))
        print(f"episode {k}: {ep.moves} moves, {why}: x {x:+.2f}, velocity {v:+.2f}, angle {angle:+.3f}, "
              f"angular velocity {w:+.2f}; root value / discounted return every 50 moves: {pairs}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
