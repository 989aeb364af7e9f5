"""d3rlpy 2.8's DiscreteCQL on an mpper snapshot (exported with
``mpper.tools.d3rlpy_export``), until a greedy mean return over 10 CartPole-v1 episodes
reaches ``--solve`` or the time limit: the peer of ``bench/offline.py``. Runs in d3rlpy's
own venv (docs/offline.md); prints one JSON line.

    PYTHONPATH=. <d3rlpy-venv>/bin/python bench/offline_d3rlpy.py SNAPSHOT --seed 0
"""

from __future__ import annotations

import argparse
import json
import time

import d3rlpy
import gymnasium as gym
import numpy as np
import torch

from mpper.tools.d3rlpy_export import to_mdp_dataset


def greedy_mean(algo, episodes: int, seed: int) -> float:
    env = gym.make("CartPole-v1")
    returns = []
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        done, total = False, 0.0
        while not done:
            action = int(algo.predict(np.asarray(obs, np.float32)[None])[0])
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("snapshot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--solve", type=float, default=475.0)
    p.add_argument("--steps-per-evaluation", type=int, default=1000)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--target-update-interval", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(1)
    d3rlpy.seed(args.seed)
    dataset = to_mdp_dataset(args.snapshot, num_actions=2)
    cql = d3rlpy.algos.DiscreteCQLConfig(
        alpha=args.alpha,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        target_update_interval=args.target_update_interval,
    ).create(device="cpu:0")
    started = time.monotonic()
    evaluating = 0.0  # seconds spent in the greedy evaluations, inside the wall time
    result = {"seed": args.seed, "transitions": dataset.transition_count, "solved": False, "evaluations": []}
    fitter = cql.fitter(
        dataset,
        n_steps=10**9,
        n_steps_per_epoch=args.steps_per_evaluation,
        show_progress=False,
        logger_adapter=d3rlpy.logging.NoopAdapterFactory(),
        save_interval=10**9,
    )
    for epoch, _ in fitter:
        t0 = time.monotonic()
        mean = greedy_mean(cql, 10, 10_000 * epoch)
        evaluating += time.monotonic() - t0
        wall = time.monotonic() - started
        result["evaluations"].append(
            {"steps": epoch * args.steps_per_evaluation, "mean_return": mean, "wall_s": round(wall, 2)}
        )
        if mean >= args.solve:
            result.update(
                solved=True,
                wall_s=round(wall, 2),
                training_s=round(wall - evaluating, 2),
                steps=epoch * args.steps_per_evaluation,
            )
            break
        if wall >= args.time_limit:
            break
    result["total_wall_s"] = round(time.monotonic() - started, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
