"""Private memory of one self-play actor over time, in this process.

Steps ``--envs`` environments of ``--config`` with the algorithm's exploring player
(random weights, one torch thread) for ``--steps`` steps and, every ``--every`` steps,
prints ``RssAnon`` of ``/proc/self/status`` beside the frames the player holds in its
episodes in progress. With ``--stored`` (the default) each finished episode goes
through the player's ``stored`` as a worker's would (DQN: the actor's initial TD
errors); ``--no-stored`` leaves that out, to tell the two apart. Nothing is written to a
buffer: this is the actor's own memory.

Usage::

    python bench/actor_memory.py --config configs/atari_pong_dqn.json --envs 16 --steps 4000
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
from mpper.algos.registry import algorithm_of, run_env_spec  # noqa: E402
from mpper.envs import make_env  # noqa: E402


def rss_anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/atari_pong_dqn.json")
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--stored", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    config = load_config(args.config, [f"runtime.envs_per_worker={args.envs}"])
    spec = run_env_spec(config)
    algorithm = algorithm_of(config)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions).eval()
    player = algorithm.make_player(config, [make_env(config.env) for _ in range(args.envs)], network,
                                   explore=True, seed=0)  # fmt: skip
    print(f"`python bench/actor_memory.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')})")
    print("| steps | RssAnon MiB | frames in episodes in progress | episodes ended | s |")
    print("|---|---|---|---|---|")
    t0, ended = time.monotonic(), 0
    for step in range(1, args.steps + 1):
        for episode in player.step():
            ended += 1
            if args.stored:
                player.stored(episode)
        if step % args.every == 0:
            live = sum(len(ep.observation) for ep in player.episodes)
            print(f"| {step} | {rss_anon_mib():.0f} | {live:,} | {ended} | {time.monotonic() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
