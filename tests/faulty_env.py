"""Tiny gymnasium envs for the fault tests, referenced from a config as
``"faulty_env:<factory>"`` (the tests put this directory on ``PYTHONPATH``).

``raising``: CartPole-shaped (observation (4,), 2 actions, reward 1, episodes of
``episode_steps`` moves) whose ``step`` raises ``RuntimeError`` after ``fail_after``
steps, but only in a self-play worker (the process ``mpper-worker-*``, or a Ray
self-play actor, whose process title Ray sets to ``ray::SelfPlayActor...``) and only for
the ``fail_instance``-th env that process creates; everywhere else (the supervisor's env
check, the evaluator, other envs of the worker) it plays normally.
"""

from __future__ import annotations

import multiprocessing
import sys

import gymnasium as gym
import numpy as np

_created = 0  # envs made by this process, in order


class Walk(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, episode_steps: int = 20, fail_after: int | None = None):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.episode_steps = episode_steps
        self.fail_after = fail_after
        self.t = 0
        self.steps = 0  # over all episodes

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        self.steps += 1
        if self.fail_after is not None and self.steps > self.fail_after:
            raise RuntimeError(f"simulated env failure after {self.fail_after} steps")
        obs = np.full(4, (self.t / self.episode_steps) * (1 if action else -1), np.float32)
        return obs, 1.0, self.t >= self.episode_steps, False, {}


def _in_ray_selfplay_actor() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().startswith(b"ray::SelfPlayActor")
    except OSError:
        return False


def raising(fail_after: int = 30, fail_instance: int = 1, episode_steps: int = 20) -> Walk:
    global _created
    index, _created = _created, _created + 1
    in_worker = multiprocessing.current_process().name.startswith("mpper-worker-") or _in_ray_selfplay_actor()
    return Walk(episode_steps, fail_after if in_worker and index == fail_instance else None)


def failing_seed(seed: int, fail_after: int = 30, episode_steps: int = 20) -> Walk:
    """A ``Walk`` whose ``step`` raises after ``fail_after`` steps when this process runs the
    run of ``--seed seed`` (read from its command line, as ``mpper sweep`` starts it), and
    never in any other run."""
    argv = sys.argv
    mine = "--seed" in argv[:-1] and argv[argv.index("--seed") + 1] == str(seed)
    return Walk(episode_steps, fail_after if mine else None)
