"""The self-play worker process: K environments played by the algorithm's player with
the newest published weights, whole episodes stored in the shared buffer (within the
samples-per-insert ratio), one report per episode.

``LatestWeights`` (a network kept in step with the weight store) and ``LabelledEnv``
(an env whose errors say which process and env raised) are shared with the evaluator.
"""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np
import torch

from ..algos.registry import algorithm_of
from ..config import Config
from ..envs.spec import make_env
from .procs import child_process

__all__ = ["EnvError", "LabelledEnv", "LatestWeights", "labelled_envs", "run_selfplay"]


class EnvError(RuntimeError):
    """An env's ``reset`` or ``step`` raised; the message says where (see ``LabelledEnv``)."""


class LabelledEnv(gym.Wrapper):
    """An env that names itself when it fails: whatever its ``step`` or ``reset`` raises
    comes out as ``EnvError("worker-3 env 1 (CartPole-v1): step raised ValueError: ...")``
    (process, index of the env in that process, env id), the original exception chained
    to it, so the traceback the supervisor prints and its one-line summary say which
    env of which worker broke."""

    def __init__(self, env: gym.Env, where: str) -> None:
        super().__init__(env)
        self.where = where

    def step(self, action):
        try:
            return self.env.step(action)
        except Exception as exc:
            raise EnvError(f"{self.where}: step raised {type(exc).__name__}: {exc}") from exc

    def reset(self, **kwargs):
        try:
            return self.env.reset(**kwargs)
        except Exception as exc:
            raise EnvError(f"{self.where}: reset raised {type(exc).__name__}: {exc}") from exc


def labelled_envs(config: Config, process: str, count: int) -> list[gym.Env]:
    return [LabelledEnv(make_env(config.env), f"{process} env {k} ({config.env.id})") for k in range(count)]


class LatestWeights:
    """A network kept in step with the weight store (copies only on a new version)."""

    def __init__(self, config: Config, store, observation_shape, num_actions) -> None:
        self.store = store
        self.network = algorithm_of(config).make_network(config, observation_shape, num_actions).eval()
        self.flat = np.empty(self.network.num_flat_weights(), np.float32)
        self.version = 0
        self.training_step = 0

    def refresh(self) -> bool:
        if self.store.version == self.version:
            return False
        self.version, self.training_step = self.store.read_into(self.flat)
        self.network.set_flat_weights(self.flat)
        return True

    def wait_first(self, stop) -> bool:
        """Block until the learner published once (False if stopped first)."""
        while self.store.version == 0:
            if stop.wait(0.05):
                return False
        return self.refresh() or True


def run_selfplay(worker_id: int, config: Config, buffer_handle, weight_handle, stop, reports, seed: int,
                 rate=None) -> None:  # fmt: skip
    """Self-play worker process: play, store whole episodes (or the pieces of a game the
    algorithm stores as it goes), report the returns of the games that end."""
    name = f"worker-{worker_id}"
    with child_process(name, config, reports, stop, buffer_handle, weight_handle) as (buf, store):
        if config.runtime.selfplay_niceness:
            os.nice(config.runtime.selfplay_niceness)
        torch.manual_seed(seed)
        envs = labelled_envs(config, name, config.runtime.envs_per_worker)
        obs_shape = buf.fields["observation"].shape[1:]
        weights = LatestWeights(config, store, obs_shape, int(envs[0].action_space.n))
        if not weights.wait_first(stop):
            return
        player = algorithm_of(config).make_player(config, envs, weights.network, explore=True, seed=seed, worker_id=worker_id)
        total_steps = config.training.training_steps
        while not stop.is_set():
            weights.refresh()
            for ep in player.step(weights.training_step / total_steps):
                ended = time.monotonic()
                arrays, priorities = player.stored(ep)
                waited = 0.0
                if rate is not None:
                    waited = rate.wait_to_insert(lambda: buf.counters["steps"], lambda: buf.counters["samples"],
                                                 stop).seconds  # fmt: skip
                buf.add_episode(arrays, priorities=priorities, terminated=ep.terminated)
                if rate is not None:
                    rate.notify()
                if not ep.ends_game:
                    continue
                # store_latency_s: from the episode's last move to its being sampleable, the
                # samples-per-insert wait (insert_wait_s) included
                reports.put(("episode", name, {"return": ep.game_return, "length": ep.game_moves,
                                               "weights_version": weights.version, "insert_wait_s": round(waited, 6),
                                               "store_latency_s": round(time.monotonic() - ended, 6)}))  # fmt: skip
