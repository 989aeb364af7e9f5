"""Make a dataset: ``python run.py --collect RUN_DIR --env-steps N --epsilon E --out DIR
[--checkpoint FILE] [--seed S]``.

Plays the run's weights (``best.pt`` when the run has one, else ``checkpoint.pt``;
``--checkpoint FILE`` chooses) for exactly N env steps in ``runtime.envs_per_worker``
envs at once, each action the greedy one (what ``--evaluate`` plays: argmax Q, or
MuZero's search without noise) replaced, with probability E, by a uniformly random one
(epsilon-greedy over the checkpoint's greedy policy), and writes the transitions as a
buffer snapshot at DIR: the fields every algorithm stores (``observation``, ``action``,
``reward``: DQN's schema), with the run's config and what was collected in the
manifest's ``extra``, so that ``--offline``, ``--inspect`` and ``--evaluate
--on-snapshot`` read it as any snapshot. Episodes still running after N steps are
stored cut (truncated, as a time limit cuts them) and left out of the mean return.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..algos.base import EpisodeRows, as_stored
from ..algos.configs import load_run_config
from ..algos.registry import algorithm_of, load_run_checkpoint
from ..checkpoint import CheckpointError
from ..config import ConfigError, config_to_dict
from ..envs.spec import env_spec, make_env
from ..replay.buffer import ReplayBuffer
from ..replay.snapshot import SnapshotError
from ..runtime.procs import torch_configured
from .evaluate import load_network, run_weights

__all__ = ["CollectError", "collect", "collect_main", "dataset_schema"]


class CollectError(ValueError):
    """A collection that cannot start, said in one line; nothing was written."""


def dataset_schema(observation_shape: Sequence[int], observation_dtype) -> dict:
    """The fields of a collected snapshot: what every algorithm's schema has (row i: o_i,
    a_{i-1}, r_i; :class:`~mpper.algos.base.EpisodeRows`)."""
    return {"observation": (tuple(observation_shape), np.dtype(observation_dtype).str),
            "action": ((), "int64"), "reward": ((), "float32")}  # fmt: skip


def collect(run_dir: Path, env_steps: int, epsilon: float, out: Path, checkpoint: Path | None = None,
            seed: int = 0, overrides: Sequence[str] = ()) -> dict:  # fmt: skip
    """Collect ``env_steps`` transitions with the run's weights and ``epsilon``-noise into
    a snapshot at ``out``; returns what was collected (also in the manifest's
    ``extra["collected"]``). CollectError, ConfigError or CheckpointError before anything
    is written."""
    if not 0.0 <= epsilon <= 1.0:
        raise CollectError(f"--epsilon: expected a number in [0, 1], got {epsilon:g}")
    if env_steps < 1:
        raise CollectError(f"--env-steps: expected an integer >= 1, got {env_steps}")
    if os.path.lexists(out):
        raise CollectError(f"--out {out}: already exists; name a new directory for the snapshot")
    if not out.parent.is_dir():
        raise CollectError(f"--out {out}: no directory {out.parent} to create it in")
    config = load_run_config(run_dir, overrides)
    named = checkpoint is not None
    checkpoint = checkpoint or run_weights(run_dir)
    spec = env_spec(config.env)
    if spec.two_player:
        raise CollectError(f"--collect {run_dir}: a two-player env ({config.env.id}); collection plays one-player envs")
    if spec.continuous_actions:
        raise CollectError(f"--collect {run_dir}: a continuous (Box) action space ({config.env.id}); collection plays "
                           "Discrete-action envs")  # fmt: skip
    state = load_run_checkpoint(checkpoint, config, spec, follow_links=named)
    network = load_network(config, spec, state, checkpoint)
    count = max(1, min(config.runtime.envs_per_worker, env_steps))
    envs = [make_env(config.env) for _ in range(count)]
    player = algorithm_of(config).make_player(config, envs, network, explore=False, seed=seed)
    rng = np.random.default_rng([seed, 0xC011EC7])
    started = time.monotonic()
    stored: list[EpisodeRows] = []
    try:
        episodes = []
        for k, env in enumerate(envs):
            obs, _ = env.reset(seed=seed + k)
            episodes.append(EpisodeRows(observation=[as_stored(obs)]))
        resets = len(envs)
        steps = 0
        while steps < env_steps:
            live = min(len(envs), env_steps - steps)  # the last round may step fewer envs
            inputs = np.stack([player.network_input(ep) for ep in episodes[:live]])
            with torch_configured(config.runtime.torch_threads):  # as the run's evaluator plays
                actions = np.asarray(player.greedy_actions(inputs), np.int64)
            noisy = rng.random(live) < epsilon
            actions = np.where(noisy, rng.integers(0, spec.num_actions, live), actions)
            for k in range(live):
                obs, reward, terminated, truncated, _ = envs[k].step(int(actions[k]))
                ep = episodes[k]
                ep.observation.append(as_stored(obs))
                ep.action.append(int(actions[k]))
                ep.reward.append(float(reward))
                if terminated or truncated:
                    ep.terminated = bool(terminated)
                    stored.append(ep)
                    obs, _ = envs[k].reset(seed=seed + resets)
                    resets += 1
                    episodes[k] = EpisodeRows(observation=[as_stored(obs)])
            steps += live
        complete = len(stored)
        stored += [ep for ep in episodes if ep.moves > 0]  # cut by the step budget: truncated
    finally:
        for env in envs:
            env.close()
    returns = [ep.total_reward for ep in stored[:complete]]
    collected = {
        "run_dir": str(run_dir), "checkpoint": str(checkpoint),
        "checkpoint_sha256": hashlib.sha256(Path(checkpoint).read_bytes()).hexdigest(),
        "training_step": int(state["training_step"]), "epsilon": epsilon, "seed": seed, "env_steps": steps,
        "episodes": len(stored), "complete_episodes": complete,
        "mean_return": float(np.mean(returns)) if returns else None, "returns": returns,
        "seconds": round(time.monotonic() - started, 3),
    }  # fmt: skip
    rows = sum(ep.moves + 1 for ep in stored)
    with ReplayBuffer.create(dataset_schema(spec.observation_shape, spec.observation_dtype), rows) as buf:
        for ep in stored:
            buf.add_episode(ep.rows(), terminated=ep.terminated)
        if buf.counters["steps"] != steps or len(buf.episodes()) != len(stored):  # the ring kept every row
            raise SnapshotError(f"collected {steps} steps, stored {buf.counters['steps']}")
        buf.save(out, extra={"config": config_to_dict(config), "collected": collected})
    return collected


def collect_main(run_dir: str, env_steps: int | None, epsilon: float, out: str | None, checkpoint: str | None,
                 seed: int, overrides: Sequence[str] = ()) -> int:  # fmt: skip
    """``--collect``: one-line errors (exit code 2) for what cannot be collected."""
    path = Path(run_dir)
    try:
        if env_steps is None or out is None:
            raise CollectError("--collect needs --env-steps N and --out DIR")
        if not os.path.lexists(path / "config.json"):
            raise CollectError(f"--collect {run_dir}: no run directory with a config.json there")
        collected = collect(path, env_steps, epsilon, Path(out), None if checkpoint is None else Path(checkpoint),
                            seed, overrides)  # fmt: skip
    except (CollectError, ConfigError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    mean = collected["mean_return"]
    behaviour = "no episode ended" if mean is None else f"mean return {mean:.2f}"
    print(f"collected {collected['env_steps']} env steps with epsilon {epsilon:g} from {collected['checkpoint']} "
          f"(training step {collected['training_step']}): {collected['episodes']} episodes, "
          f"{collected['complete_episodes']} complete, {behaviour}")  # fmt: skip
    print(f"written: {out} (train on it: --offline {out})")
    return 0
