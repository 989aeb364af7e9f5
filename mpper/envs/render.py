"""Frames of an env as it draws them: the env made with ``render_mode="rgb_array"`` and
checked (:func:`open_render_env`), for ``--evaluate --render`` and the run's videos."""

from __future__ import annotations

import dataclasses
import os
import warnings

import gymnasium as gym
import numpy as np

from ..config import EnvConfig
from ..extras import MissingExtraError
from .spec import make_env

__all__ = ["RenderError", "is_rgb_frame", "open_render_env"]


class RenderError(ValueError):
    """The run's env cannot produce ``rgb_array`` frames, or the file cannot go where asked."""


def open_render_env(config: EnvConfig) -> gym.Env:
    """The run's env made with ``render_mode="rgb_array"``, checked by one reset and one
    render; raises RenderError (cannot render rgb_array) or MissingExtraError (a
    renderer's package, such as pygame, is not installed)."""
    # pygame (gymnasium's classic-control renderer) greets on stdout and SDL complains
    # on stderr about a missing display; off-screen frames need neither
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    name = repr(config.id)
    # render_mode goes through the kwargs that make_env hands to gym.make or the factory
    with_mode = dataclasses.replace(config, kwargs={**config.kwargs, "render_mode": "rgb_array"})
    try:
        with warnings.catch_warnings():  # gymnasium warns about an unknown mode; we say it ourselves
            warnings.simplefilter("ignore")
            env = make_env(with_mode)
    except TypeError as exc:  # a factory without a render_mode parameter
        raise RenderError(f"--render: env {name} cannot be made with render_mode='rgb_array' ({exc})") from None
    try:
        modes = list(env.metadata.get("render_modes") or [])
        if "rgb_array" not in modes or env.render_mode != "rgb_array":
            raise RenderError(f"--render: env {name} cannot render rgb_array frames (its render_modes: {modes})")
        env.reset(seed=0)
        frame = env.render()
    except gym.error.DependencyNotInstalled as exc:
        env.close()
        detail = " ".join(str(exc).split())
        raise MissingExtraError(f"--render: env {name} needs a package that is not installed to draw frames "
                                f"({detail}); install it with: pip install -e .[render]") from None  # fmt: skip
    except NotImplementedError:
        env.close()
        raise RenderError(f"--render: env {name} cannot render rgb_array frames (no render())") from None
    except BaseException:
        env.close()
        raise
    if not is_rgb_frame(frame):
        env.close()
        what = f"{type(frame).__name__} {getattr(frame, 'shape', '')} {getattr(frame, 'dtype', '')}".strip()
        raise RenderError(f"--render: env {name} returned {what} from render(), not an rgb_array frame (H, W, 3) uint8")
    return env


def is_rgb_frame(frame) -> bool:
    return isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[2] in (3, 4) and frame.dtype == np.uint8
