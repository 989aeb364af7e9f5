"""The two-player environment contract, and a check of it run once at the start of a run.

A two-player environment is a gymnasium ``Env`` with a ``Discrete(A)`` action space that

* reports in ``info``, at ``reset`` and after every ``step``:

  - ``to_play``: the player to move next, the int 0 or 1;
  - ``action_mask``: a bool numpy array of shape ``(A,)``, True where the action is
    legal; at least one action is legal in every state that is not terminal (at a
    terminal state the mask is not read);

* gives each reward from the point of view of the player who just moved (the one who
  was ``to_play`` before the step): +1 to the mover for a win, for example;
* has ``env.unwrapped.two_player = True`` (what :mod:`mpper.runtime.roles` reads to run the
  search with alternating players and sign flips);
* optionally, ``env.unwrapped.evaluation_opponents(seed) -> {name: agent}`` (a method,
  staticmethod or classmethod): the opponents the evaluator plays the trained agent
  against, weakest first, each an :data:`AgentFn` with its own generator seeded from
  ``seed``. Without it the evaluator plays a uniformly random legal-move player
  (:func:`random_legal_agent`). See :func:`evaluation_opponents`.

The search assumes the players alternate inside its tree (as muzero-general's
``virtual_to_play`` does); the value targets (:mod:`mpper.replay.targets`) follow whatever
``to_play`` the episode recorded.

:func:`check_two_player_env` resets an env once and steps it once with a legal action,
and raises a ``ValueError`` naming the env and what is missing or malformed.
:func:`mpper.envs.spec.env_spec` calls it for every env whose ``unwrapped.two_player`` is
true, so a broken env fails the run at its start, with one clear message, instead of a
worker crashing later (or, worse, a search that silently treats every action as legal).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = [
    "AgentFn",
    "check_two_player_env",
    "check_two_player_info",
    "evaluation_opponents",
    "is_two_player",
    "random_legal_agent",
]

# A player for an arena (mpper.algos.muzero.arena.play_match): (observation of the player to move,
# bool legal-action mask (A,), that player's number 0 or 1) -> action.
AgentFn = Callable[[np.ndarray, np.ndarray, int], int]


def is_two_player(env: gym.Env) -> bool:
    """Whether ``env`` declares itself a two-player env (``env.unwrapped.two_player``)."""
    return bool(getattr(env.unwrapped, "two_player", False))


def random_legal_agent(seed: int | None = None) -> AgentFn:
    """An agent that plays a uniformly random legal move (from the mask; the observation
    is not read), with its own generator seeded by ``seed``: the default opponent."""
    rng = np.random.default_rng(seed)

    def act(observation: np.ndarray, mask: np.ndarray, to_play: int) -> int:
        legal = np.flatnonzero(np.asarray(mask, bool))
        if legal.size == 0:
            raise ValueError("random_legal_agent: no legal move in the mask")
        return int(rng.choice(legal))

    return act


def evaluation_opponents(env: gym.Env, seed: int = 0) -> dict[str, AgentFn]:
    """The opponents a two-player ``env`` is evaluated against: name -> agent, weakest
    first (the evaluator reports its headline score against the LAST one).

    ``env.unwrapped.evaluation_opponents(seed)`` when the env provides it (TicTacToe:
    ``{"random": ..., "perfect": ...}``), else ``{"random": random_legal_agent(seed)}``.
    Raises ``ValueError`` when the hook returns no opponent or something not callable.
    """
    hook = getattr(env.unwrapped, "evaluation_opponents", None)
    if hook is None:
        return {"random": random_legal_agent(seed)}
    opponents = dict(hook(seed))
    name = _env_name(env)
    if not opponents:
        raise ValueError(f"two-player env {name!r}: evaluation_opponents({seed}) returned no opponent")
    for key, agent in opponents.items():
        if not isinstance(key, str) or not callable(agent):
            raise ValueError(f"two-player env {name!r}: evaluation_opponents({seed}) must map names (str) to agents "
                             f"(observation, mask, to_play) -> action; got {key!r}: {agent!r}")  # fmt: skip
    return opponents


def _env_name(env: gym.Env) -> str:
    spec = getattr(env, "spec", None)
    if spec is not None and getattr(spec, "id", None):
        return str(spec.id)
    return type(env.unwrapped).__name__


def check_two_player_info(info: Any, num_actions: int, terminal: bool, name: str, where: str) -> None:
    """Raise ``ValueError`` unless ``info`` (returned by ``where``, e.g. ``"reset()"``)
    holds ``to_play`` in {0, 1} and a bool ``action_mask`` of shape ``(num_actions,)``
    with at least one legal action when the state is not ``terminal``."""
    prefix = f"two-player env {name!r}: info returned by {where}"
    if not isinstance(info, dict):
        raise ValueError(f"{prefix} is a {type(info).__name__}, not a dict")
    if "to_play" not in info:
        raise ValueError(f"{prefix} has no 'to_play' (the player to move next, 0 or 1); keys: {sorted(map(str, info))}")
    to_play = info["to_play"]
    # bool is an int subclass: refuse it, a True/False player is almost surely a mistake
    integral = isinstance(to_play, (int, np.integer)) and not isinstance(to_play, (bool, np.bool_))
    if not integral or int(to_play) not in (0, 1):
        raise ValueError(f"{prefix}: 'to_play' must be the int 0 or 1, got {to_play!r} ({type(to_play).__name__})")
    if "action_mask" not in info:
        raise ValueError(
            f"{prefix} has no 'action_mask' (bool array of shape ({num_actions},), True where legal); "
            f"keys: {sorted(map(str, info))}"
        )
    mask = info["action_mask"]
    if not isinstance(mask, np.ndarray):
        raise ValueError(f"{prefix}: 'action_mask' must be a numpy bool array of shape ({num_actions},), "
                         f"got a {type(mask).__name__}")  # fmt: skip
    if mask.dtype != np.bool_:
        raise ValueError(f"{prefix}: 'action_mask' must have dtype bool, got {mask.dtype}")
    if mask.shape != (num_actions,):
        raise ValueError(f"{prefix}: 'action_mask' must have shape ({num_actions},) (one entry per action), "
                         f"got {mask.shape}")  # fmt: skip
    if not terminal and not mask.any():
        raise ValueError(f"{prefix}: 'action_mask' is all False in a state that is not terminal "
                         "(the player to move has no legal action)")  # fmt: skip


def check_two_player_env(env: gym.Env, name: str | None = None) -> None:
    """Check ``env`` against the two-player contract (module docstring): reset it once,
    check ``info``, step once with the first legal action and check again.

    The env is left mid-game: use a fresh env, or reset it, afterwards. ``name`` (the
    config's env id, say) names the env in the messages; by default its spec id or class
    name. Raises ``ValueError`` on the first thing missing or malformed.
    """
    name = name or _env_name(env)
    if not isinstance(env.action_space, gym.spaces.Discrete):
        raise ValueError(f"two-player env {name!r}: needs a Discrete action space, got {env.action_space}")
    if not is_two_player(env):
        raise ValueError(f"two-player env {name!r}: env.unwrapped.two_player is not true")
    num_actions = int(env.action_space.n)
    _, info = env.reset()
    check_two_player_info(info, num_actions, False, name, "reset()")
    action = int(np.flatnonzero(info["action_mask"])[0])
    _, _, terminated, truncated, info = env.step(action)
    check_two_player_info(info, num_actions, bool(terminated or truncated), name, f"step({action})")
