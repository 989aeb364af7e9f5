"""CartPole that counts its own steps, for the tests that say who plays: referenced from a
config as ``"counting_env:make"`` with ``env.kwargs {"log": PATH}`` (the tests put this
directory on ``PYTHONPATH``).

Each env, when made, notes the functions that made it (the call stack's names, read
here, not told by mpper); each ``step`` appends ``"<pid> <env serial> step"`` to ``log``,
and the making appends ``"<pid> <env serial> made <name> <name> ..."``. :func:`read_log`
gives, per env, who made it and how many steps it took.
"""

from __future__ import annotations

import itertools
import os
import traceback
from pathlib import Path

import gymnasium as gym

_serial = itertools.count()


class Counting(gym.Wrapper):
    def __init__(self, env: gym.Env, log: str) -> None:
        super().__init__(env)
        self.log = log
        self.name = f"{os.getpid()}-{next(_serial)}"
        makers = " ".join(frame.name for frame in traceback.extract_stack()[:-1])
        self._write(f"made {makers}")

    def _write(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{self.name} {what}\n")

    def step(self, action):
        self._write("step")
        return self.env.step(action)


def make(log: str, max_episode_steps: int = 200) -> gym.Env:
    return Counting(gym.make("CartPole-v1", max_episode_steps=max_episode_steps), log)


def read_log(path: str | Path) -> dict[str, dict]:
    """``{env: {"makers": [function names, outermost first], "steps": n}}``."""
    envs: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        name, what, *rest = line.split()
        env = envs.setdefault(name, {"makers": [], "steps": 0})
        if what == "made":
            env["makers"] = rest
        else:
            env["steps"] += 1
    return envs
