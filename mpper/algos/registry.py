"""The algorithms mpper trains, by the name ``config.algorithm`` gives.

Adding an algorithm is adding its folder under ``mpper/algos/`` (an
:class:`~mpper.algos.base.Algorithm` named ``ALGORITHM`` in its ``algorithm`` module,
its config sections in its ``config`` module), one line here and one in
:mod:`mpper.algos.configs`; ``docs/architecture.md`` walks through it.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint import checkpoint_budget, load_checkpoint
from ..config import Config, ConfigError
from ..envs import EnvSpec, config_symmetries, env_spec
from .base import Algorithm
from .dqn.algorithm import ALGORITHM as DQN
from .muzero.algorithm import ALGORITHM as MUZERO
from .sampled_muzero.algorithm import ALGORITHM as SAMPLED_MUZERO

__all__ = ["ALGORITHMS", "algorithm_of", "get_algorithm", "load_run_checkpoint", "run_env_spec"]

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (MUZERO, DQN, SAMPLED_MUZERO)}


def get_algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; ConfigError naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"algorithm: expected one of {sorted(ALGORITHMS)}, got {name!r}") from None


def algorithm_of(config: Config) -> Algorithm:
    """The algorithm ``config`` trains."""
    return get_algorithm(config.algorithm)


def run_env_spec(config: Config) -> EnvSpec:
    """:func:`env_spec` of ``config.env``, and whether ``config.algorithm`` can train on
    it: what a run checks before it starts anything (``run.py`` turns the ``ValueError``
    into one line ``error: ...`` and exit code 2).

    Raises ``ValueError`` when the env's action space is not the kind the algorithm trains
    (a Box for ``Algorithm.continuous_actions``, else Discrete); when the env breaks the
    two-player contract; when it is a two-player env and the algorithm cannot train one
    (DQN reads neither ``to_play`` nor
    the legal-action mask: it would learn one Q-function for both players and play
    illegal moves), or the config cannot (``Algorithm.two_player_refusal``: MuZero's value
    prefix); when the algorithm trains through board symmetries (MuZero's
    ``muzero.symmetry_augmentation``) and the env declares
    no valid symmetries (:mod:`mpper.envs.symmetry`).
    """
    spec = env_spec(config.env)
    algorithm = algorithm_of(config)
    if spec.continuous_actions != algorithm.continuous_actions:
        kind = "a continuous (Box)" if spec.continuous_actions else "a Discrete"
        able = " or ".join(f'"algorithm": "{a.name}"' for a in ALGORITHMS.values()
                           if a.continuous_actions == spec.continuous_actions)  # fmt: skip
        raise ValueError(f'algorithm: "{algorithm.name}" cannot train the env {config.env.id!r}, whose action space is '
                         f"{kind} one; {able} trains it")  # fmt: skip
    if spec.two_player and not algorithm.two_player:
        able = " or ".join(f'"{a.name}"' for a in ALGORITHMS.values() if a.two_player)
        raise ValueError(f'algorithm: "{algorithm.name}" cannot train the two-player env {config.env.id!r}: it '
                         f"ignores to_play and the legal-action mask; use {able}")  # fmt: skip
    refusal = algorithm.two_player_refusal(config) if spec.two_player else None
    if refusal is not None:
        raise ValueError(f"the two-player env {config.env.id!r}: {refusal}")
    if algorithm.augments_symmetries(config):
        config_symmetries(config)
    return spec



def load_run_checkpoint(path: str | os.PathLike, config: Config, spec: EnvSpec, follow_links: bool = False) -> dict:
    """``load_checkpoint(path, follow_links=...)``, refused (CheckpointError) before it is
    read when the file holds more than a checkpoint of ``config``'s network can
    (``checkpoint_budget``: the network is sized on the meta device, without allocating
    its weights)."""
    with torch.device("meta"):
        network = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions)
    return load_checkpoint(path, max_bytes=checkpoint_budget(network), follow_links=follow_links)
