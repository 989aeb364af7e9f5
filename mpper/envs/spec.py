"""Environment construction and the facts about it the buffer and networks need."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any, cast

import gymnasium as gym
import numpy as np

from ..config import Config, ConfigError, EnvConfig
from ..env_ids import env_id_form, search_current_directory
from ..extras import register_env_family
from .atari import EpisodicLife, SignReward
from .symmetry import env_symmetries
from .two_player import check_two_player_env, is_two_player

__all__ = ["SUPPORTED_SPACES", "ChannelsFirst", "EnvSpec", "check_spaces", "config_symmetries", "env_spec",
           "has_training_settings", "make_env", "make_env_checked", "training_wrappers"]


class ChannelsFirst(gym.ObservationWrapper):
    """Image observations (H, W, C) -> (C, H, W), the layout of torch's convolutions;
    dtype (bool, uint8) unchanged. The array is a transposed view, not a copy."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 3:
            raise ValueError(f'env.preprocessing "channels_first" needs (H, W, C) Box observations, got {space}')
        self.observation_space = gym.spaces.Box(np.moveaxis(space.low, -1, 0), np.moveaxis(space.high, -1, 0),
                                                dtype=space.dtype)  # fmt: skip

    def observation(self, observation):
        return np.moveaxis(observation, -1, 0)


def make_env(config: EnvConfig, training: bool = False) -> gym.Env:
    """A gymnasium env from a registered id, a ``"module:callable"`` factory or gymnasium's
    ``"module:EnvId-v0"`` (:mod:`mpper.env_ids`), with the ``env.preprocessing`` wrappers.

    ``training=True`` (self-play's envs, and only theirs) adds the training-only settings
    on top (:func:`training_wrappers`); every other env (evaluation, videos,
    ``--evaluate``, ``mpper.load``) plays the game as it is.

    ``max_episode_steps`` wraps it in a TimeLimit (a truncation, not a termination).
    ``MinAtar/...`` and ``ALE/...`` ids are registered first (their packages register
    only on request). ``"atari"`` makes the env with ``frameskip=1`` and wraps it in
    gymnasium's ``AtariPreprocessing`` (its defaults: 30 no-op resets, 4 frames skipped
    with the last two max-pooled, grayscale, 84 x 84, no terminal on life loss; override
    them in ``env.preprocessing_kwargs``), then adds the channel axis: (1, 84, 84) uint8.
    """
    register_env_family(config.id)
    form = env_id_form(config.id)
    if form.imports:
        search_current_directory()  # a module beside where mpper runs (mpper.env_ids)
    if form.kind == "factory" and form.module is not None and form.name is not None:  # module:callable
        factory: Any = importlib.import_module(form.module)
        for part in form.name.split("."):
            factory = getattr(factory, part)
        env = factory(**config.kwargs)
        if not isinstance(env, gym.Env):
            raise TypeError(f"{config.id} returned {type(env).__name__}, expected a gymnasium.Env")
        if config.max_episode_steps is not None:
            env = gym.wrappers.TimeLimit(env, config.max_episode_steps)
    elif config.preprocessing == "atari":
        env = gym.make(config.id, max_episode_steps=config.max_episode_steps, **{"frameskip": 1, **config.kwargs})
    else:
        env = gym.make(config.id, max_episode_steps=config.max_episode_steps, **config.kwargs)
    if config.preprocessing == "atari":
        _check_screen_size(config.preprocessing_kwargs.get("screen_size", 84))
        env = gym.wrappers.AtariPreprocessing(env, **{"grayscale_newaxis": True, **config.preprocessing_kwargs})
    if config.preprocessing in ("atari", "channels_first"):
        env = ChannelsFirst(env)
    if training:
        env = training_wrappers(env, config)
    return env


def training_wrappers(env: gym.Env, config: EnvConfig) -> gym.Env:
    """``env`` with the training-only settings of ``config``, innermost first: a TimeLimit of
    ``env.training_max_episode_steps`` moves, :class:`~mpper.envs.atari.EpisodicLife`
    (``env.episodic_life``) over it, so that the limit counts whole games, not lives, and
    :class:`~mpper.envs.atari.SignReward` (``env.clip_rewards``)."""
    if config.training_max_episode_steps is not None:
        env = gym.wrappers.TimeLimit(env, config.training_max_episode_steps)
    if config.episodic_life:
        env = EpisodicLife(env)
    if config.clip_rewards:
        env = SignReward(env)
    return env


def has_training_settings(config: EnvConfig) -> bool:
    """Whether self-play's env differs from the game as it is (:func:`training_wrappers`)."""
    return config.episodic_life or config.clip_rewards or config.training_max_episode_steps is not None


# AtariPreprocessing allocates its frame buffers at the screen size as it is built: a side
# this large is far past the emulator's 210 x 160 and any network's input.
MAX_SCREEN_SIDE = 1024


def _check_screen_size(size) -> None:
    """ValueError unless ``env.preprocessing_kwargs.screen_size`` (an int, or a
    (width, height) pair) is a side in [1, MAX_SCREEN_SIDE]: checked before anything is
    allocated at that size."""
    sides = size if isinstance(size, (list, tuple)) else [size]
    if not (1 <= len(sides) <= 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in sides)
            and all(1 <= v <= MAX_SCREEN_SIDE for v in sides)):  # fmt: skip
        raise ValueError(f"env.preprocessing_kwargs.screen_size: expected an integer or a [width, height] pair in "
                         f"[1, {MAX_SCREEN_SIDE}], got {json.dumps(size)}")  # fmt: skip


def make_env_checked(config: EnvConfig, training: bool = False) -> gym.Env:
    """:func:`make_env` for the checks before a run: whatever stops the env from being
    made (kwargs it rejects, a factory the module lacks, a missing dependency, a
    training-only setting the env cannot take) is a one-line ConfigError naming env.id and
    env.kwargs instead of a traceback."""
    try:
        return make_env(config, training)
    except Exception as exc:
        detail = " ".join(str(exc).split()) or "no message"
        raise ConfigError(f"env.id {config.id!r} with env.kwargs {json.dumps(config.kwargs)}: the env cannot be "
                          f"made ({type(exc).__name__}: {detail})") from exc  # fmt: skip


SUPPORTED_SPACES = ("mpper supports a Discrete(n) action space starting at 0 or a bounded float Box action space "
                    "(\"algorithm\": \"sampled_muzero\"), and a Box observation space of at least one element with a "
                    "bool, integer or float dtype")


def check_spaces(observation_space, action_space, what: str) -> None:
    """ValueError, one line naming ``what``, the space and what mpper supports, unless the
    spaces are ones mpper trains on: actions ``Discrete(n)`` numbered from 0 (the networks'
    outputs are actions 0..n-1) or a float ``Box`` with finite bounds (which algorithm trains
    which is the registry's check), observations a numeric ``Box`` with at least one element
    (stored as one array per step; any shape: flattened by the "fc" networks, (C, H, W) for
    the convolutional ones)."""
    hint = ""
    box_problem = _box_action_problem(action_space) if isinstance(action_space, gym.spaces.Box) else None
    if isinstance(action_space, gym.spaces.Box) and box_problem is not None:
        problem = f"its action space {action_space} {box_problem}"
    elif not isinstance(action_space, (gym.spaces.Discrete, gym.spaces.Box)):
        problem = f"its action space {action_space} is neither Discrete nor a bounded Box"
    elif isinstance(action_space, gym.spaces.Discrete) and int(action_space.start) != 0:
        problem = (f"its action space {action_space} starts at {int(action_space.start)}; wrap the env so that "
                   "actions are numbered from 0")  # fmt: skip
    elif not isinstance(observation_space, gym.spaces.Box):
        flat = (gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary, gym.spaces.Dict, gym.spaces.Tuple)
        if isinstance(observation_space, flat):
            hint = "; gymnasium.wrappers.FlattenObservation turns it into a Box"
        problem = f"its observation space {observation_space} is not a Box{hint}"
    elif observation_space.dtype is None or observation_space.dtype.kind not in "biuf":
        problem = f"its observation space {observation_space} has dtype {observation_space.dtype}"
    elif len(observation_space.shape) == 0:
        problem = f"its observation space {observation_space} is a scalar (shape ()); give it shape (1,)"
    elif int(np.prod(observation_space.shape)) == 0:
        problem = f"its observation space {observation_space} has shape {observation_space.shape}, no element"
    else:
        return
    raise ValueError(f"{what}: {problem}; {SUPPORTED_SPACES}")


def _box_action_problem(space: gym.spaces.Box) -> str | None:
    """What keeps a Box action space from being trained (None: nothing): a non-float dtype,
    no element, or a bound that is not finite (the policy's actions are rescaled into it)."""
    if space.dtype is None or space.dtype.kind != "f":
        return f"has dtype {space.dtype}, not a float one"
    if int(np.prod(space.shape)) == 0:
        return f"has shape {space.shape}, no element"
    if not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
        return "has an infinite or non-finite bound; wrap the env so that every action dimension is bounded"
    if not (space.low < space.high).all():
        return "has a dimension whose low bound is not below its high bound"
    return None


@dataclass(frozen=True)
class EnvSpec:
    observation_shape: tuple[int, ...]
    observation_dtype: np.dtype
    num_actions: int  # Discrete(n): n; a Box action space: the length A of its flattened action vector
    two_player: bool = False  # env.unwrapped.two_player (checked against the contract)
    # the most moves a self-play episode can last (env.max_episode_steps, or the id's
    # registered limit, at most env.training_max_episode_steps); None when unknown: no
    # limit, or one counted in frames under frame skipping
    max_episode_steps: int | None = None
    continuous_actions: bool = False  # a bounded Box action space (``num_actions`` its vector's length)


def env_spec(config: EnvConfig) -> EnvSpec:
    """Observation shape/dtype and action count, from one env instance (then closed).

    A two-player env (``env.unwrapped.two_player``) is also checked against the contract
    of :mod:`mpper.envs.two_player` (one reset and one step), so that a broken one stops the
    run here, with a message naming it, rather than in a worker later. With training-only
    settings (:func:`training_wrappers`) self-play's env is made once too, so that one the
    env cannot take stops the run here.
    """
    if has_training_settings(config):  # self-play's env must be made too
        make_env_checked(config, training=True).close()
    env = make_env_checked(config)
    try:
        check_spaces(env.observation_space, env.action_space, f"env {config.id!r}")
        space = cast(gym.spaces.Box, env.observation_space)
        continuous = isinstance(env.action_space, gym.spaces.Box)
        if is_two_player(env):
            check_two_player_env(env, config.id)
        dtype = np.dtype(np.float32) if space.dtype.kind == "f" else space.dtype
        if continuous:
            actions = int(np.prod(cast(gym.spaces.Box, env.action_space).shape))
        else:
            actions = int(cast(gym.spaces.Discrete, env.action_space).n)
        return EnvSpec(tuple(space.shape), dtype, actions, is_two_player(env), _move_limit(env, config), continuous)
    finally:
        env.close()


def _move_limit(env: gym.Env, config: EnvConfig) -> int | None:
    """The most moves a stored (self-play) episode of ``env`` lasts: ``env.max_episode_steps``,
    else the limit its gymnasium id registers, and at most ``env.training_max_episode_steps``;
    None when it has none, and under ``"atari"`` preprocessing, whose time limit counts
    emulator frames, not the agent's moves, unless ``env.training_max_episode_steps`` is set."""
    cap = config.training_max_episode_steps
    if config.preprocessing == "atari":
        return cap
    if config.max_episode_steps is not None:
        limit: int | None = config.max_episode_steps
    else:
        registered = env.spec.max_episode_steps if env.spec is not None else None
        limit = int(registered) if registered is not None else None
    return cap if limit is None else limit if cap is None else min(limit, cap)


def config_symmetries(config: Config) -> np.ndarray:
    """The checked ``(G, A)`` board symmetries the env of ``config`` declares (one env
    instance, then closed); ``ValueError`` naming the env when it declares none or
    malformed ones (:mod:`mpper.envs.symmetry`)."""
    env = make_env_checked(config.env)
    try:
        space, actions = cast(gym.spaces.Box, env.observation_space), cast(gym.spaces.Discrete, env.action_space)
        return env_symmetries(env, tuple(space.shape), int(actions.n), f"env {config.env.id!r}")
    finally:
        env.close()
