"""Two wrappers that only self-play's envs carry (``env.episodic_life``, ``env.clip_rewards``;
:func:`mpper.envs.spec.make_env` with ``training=True``): DeepMind's training conventions
for Atari, which the Atari 100k protocol (EfficientZero's ``core/utils.py``) keeps.
Evaluation plays the game as it is.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

__all__ = ["EpisodicLife", "SignReward"]

# The action an EpisodicLife reset takes to step past a lost life; the Arcade Learning
# Environment numbers NOOP 0 in every game's minimal and full action sets.
NOOP = 0


class EpisodicLife(gym.Wrapper):
    """A lost life ends the episode (``terminated``), the game goes on: DeepMind's
    ``EpisodicLifeEnv`` (baselines, EfficientZero) in gymnasium's API.

    After a life is lost, :meth:`reset` does not restart the emulator: it steps one no-op
    (one agent step, frame skip included) and hands back that observation, so the next
    episode continues the same game with one life fewer. Only a real game over (the
    inner env's ``terminated`` or ``truncated``: the last life, or the frame limit) or a
    ``reset`` with a ``seed`` (a caller asking for a reproducible new game) restarts the
    game, with the inner env's no-op starts. Lives are read from ``env.unwrapped.ale``; a
    drop to 0 is left to the game's own terminal (some games sit at 0 lives for a few
    frames before it), as DeepMind's wrapper does.

    ``info["game_over"]`` says, on a step that ends an episode, whether the game ended
    too (False: only a life was lost). gymnasium's ``AtariPreprocessing(terminal_on_life_loss=True)``
    is not this: it resets the whole game after every lost life.
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)
        ale = getattr(env.unwrapped, "ale", None)
        if ale is None or not callable(getattr(ale, "lives", None)):
            raise ValueError(f"env.episodic_life needs an Arcade Learning Environment game (env.unwrapped.ale with "
                             f"lives()); {type(env.unwrapped).__name__} has none")  # fmt: skip
        self.ale = ale
        self.lives = 0  # the lives the game had after the last step or reset
        self.game_over = True  # whether the next reset restarts the emulator

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = bool(terminated or truncated)
        lives = int(self.ale.lives())
        if 0 < lives < self.lives:
            terminated = True
        self.lives = lives
        return obs, reward, terminated, truncated, {**info, "game_over": self.game_over}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if self.game_over or seed is not None:
            obs, info = self.env.reset(seed=seed, options=options)
        else:
            obs, _, terminated, truncated, info = self.env.step(NOOP)
            if terminated or truncated:  # the no-op itself ended the game
                obs, info = self.env.reset(options=options)
        self.game_over = False
        self.lives = int(self.ale.lives())
        return obs, info


class SignReward(gym.RewardWrapper):
    """Rewards clipped to their sign, -1, 0 or +1 (DQN's and EfficientZero's reward
    clipping in training), as floats."""

    def reward(self, reward):
        return float(np.sign(reward))
