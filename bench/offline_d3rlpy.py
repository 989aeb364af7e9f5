"""d3rlpy 2.8's DiscreteCQL on an mpper snapshot (exported with
``mpper.tools.d3rlpy_export``), until a greedy mean return over 10 episodes of the env of
mpper's ``--config`` reaches ``--solve`` or the time limit: the peer of ``bench/offline.py``.
An evaluation that reaches it is confirmed as mpper's are: ``--confirm-episodes`` more
episodes (default: the config's ``runtime.solve_confirm_episodes``) with the same weights,
and the mean over all of them has to reach it too.
Its training clock runs from the fitter's start, the network and optimizer built before
it, to the evaluation at the target, the evaluations taken out.
The hyperparameters are the mpper config's: learning rate, batch, target-copy interval,
discount and, for vector observations, the hidden layers (d3rlpy's own encoder, ReLU);
image observations get the MinAtar paper's network (one 3x3 convolution of 16 channels, a
128-unit layer), as mpper's MinAtar DQN config has. d3rlpy backs up one step and samples
uniformly whatever the config's ``dqn.n_step`` and prioritized replay say (the JSON line
records what it ran with). Runs in d3rlpy's own venv (docs/offline.md); prints one JSON
line.

    PYTHONPATH=. <d3rlpy-venv>/bin/python bench/offline_d3rlpy.py SNAPSHOT --seed 0 --config cartpole_dqn
"""

from __future__ import annotations

import argparse
import json
import time

import d3rlpy
import numpy as np
import torch

from mpper.algos.configs import load_config
from mpper.config_files import config_name_path
from mpper.envs.spec import make_env
from mpper.tools.d3rlpy_export import transitions


def greedy_returns(algo, env_config, episodes: int, seed: int) -> list[float]:
    """``episodes`` greedy episodes, the k-th reset with ``seed + k``: their returns."""
    env = make_env(env_config)
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
    return returns


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("snapshot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="cartpole_dqn", help="mpper config whose env evaluates")
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--solve", type=float, default=475.0)
    p.add_argument("--steps-per-evaluation", type=int, default=1000)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--confirm-episodes", type=int, help="default: the config's runtime.solve_confirm_episodes")
    args = p.parse_args()
    torch.set_num_threads(1)
    d3rlpy.seed(args.seed)
    config = load_config(config_name_path(args.config))
    env_config, dqn, training = config.env, config.dqn, config.training
    confirm = config.runtime.solve_confirm_episodes if args.confirm_episodes is None else args.confirm_episodes
    probe = make_env(env_config)
    num_actions = int(probe.action_space.n)
    image = len(probe.observation_space.shape) == 3
    probe.close()
    t = transitions(args.snapshot, num_actions=num_actions)
    # d3rlpy's networks take float or uint8 observations, not MinAtar's bool planes
    observations = t.observations.astype(np.float32) if t.observations.dtype == bool else t.observations
    dataset = d3rlpy.dataset.MDPDataset(observations=observations, actions=t.actions, rewards=t.rewards,
                                        terminals=t.terminals, timeouts=t.timeouts,
                                        action_space=d3rlpy.constants.ActionSpace.DISCRETE,
                                        action_size=num_actions)  # fmt: skip
    encoder = (
        d3rlpy.models.PixelEncoderFactory(filters=[[16, 3, 1]], feature_size=128)
        if image
        else d3rlpy.models.VectorEncoderFactory(hidden_units=list(dqn.hidden))
    )
    hyperparameters = {"alpha": args.alpha, "learning_rate": training.lr_init, "batch_size": training.batch_size,
                       "target_update_interval": dqn.target_update_interval, "gamma": dqn.gamma}  # fmt: skip
    cql = d3rlpy.algos.DiscreteCQLConfig(**hyperparameters, encoder_factory=encoder).create(device="cpu:0")
    # the network and its optimizer built before the clock starts, as mpper's learner is
    # before its first update (the first torch optimizer imports torch._dynamo: seconds)
    cql.build_with_dataset(dataset)
    started = time.monotonic()
    evaluating = 0.0  # seconds spent in the greedy evaluations, inside the wall time
    result = {"seed": args.seed, "transitions": dataset.transition_count, "solved": False, "evaluations": [],
              "hyperparameters": {**hyperparameters, "hidden_units": None if image else list(dqn.hidden)},
              "confirm_episodes": confirm}
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
        returns = greedy_returns(cql, env_config, 10, 10_000 * epoch)
        evaluation = {"steps": epoch * args.steps_per_evaluation}
        if np.mean(returns) >= args.solve and confirm > 0:
            more = greedy_returns(cql, env_config, confirm, 10_000 * epoch + len(returns))
            evaluation["confirmation"] = {"episodes": confirm, "mean_return": float(np.mean(more))}
            returns += more
        mean = float(np.mean(returns))
        evaluating += time.monotonic() - t0
        wall = time.monotonic() - started
        evaluation.update(mean_return=mean, wall_s=round(wall, 2), unix_time=round(time.time(), 3))
        result["evaluations"].append(evaluation)
        if mean >= args.solve:
            result.update(
                solved=True,
                wall_s=round(wall, 2),
                training_s=round(wall - evaluating, 2),
                steps=epoch * args.steps_per_evaluation,
                solved_unix_time=round(time.time(), 3),
            )
            break
        if wall >= args.time_limit:
            break
    result["total_wall_s"] = round(time.monotonic() - started, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
