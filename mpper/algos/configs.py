"""Every algorithm's config sections, by the name ``config.algorithm`` gives, and the
config loaders of :mod:`mpper.config` bound to them.

Light on purpose: it imports each algorithm's ``config`` module only (no torch), so the
command line reads and checks a config before anything heavy is imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import config
from ..config import AlgorithmConfig, Config, FieldSpec
from .dqn.config import CONFIG as DQN
from .muzero.config import CONFIG as MUZERO
from .sampled_muzero.config import CONFIG as SAMPLED_MUZERO

__all__ = [
    "ALGORITHM_CONFIGS",
    "config_from_dict",
    "default_config",
    "describe_config",
    "field_specs",
    "load_config",
    "load_run_config",
    "offline_overrides",
]

ALGORITHM_CONFIGS: dict[str, AlgorithmConfig] = {"muzero": MUZERO, "dqn": DQN, "sampled_muzero": SAMPLED_MUZERO}


def load_config(path: str | Path, overrides: Iterable[str] = (), workers: int | None = None, **kwargs) -> Config:
    """:func:`mpper.config.load_config` with the sections of every algorithm listed here."""
    return config.load_config(path, overrides, workers, algorithms=ALGORITHM_CONFIGS, **kwargs)


def load_run_config(run_dir: str | Path, overrides: Iterable[str] = (), **flags) -> Config:
    """:func:`mpper.config.load_run_config` with the sections of every algorithm listed here."""
    return config.load_run_config(run_dir, overrides, algorithms=ALGORITHM_CONFIGS, **flags)


def config_from_dict(data: Any, source: str = "<config>", overrides: Iterable[str] = (), **kwargs) -> Config:
    """:func:`mpper.config.config_from_dict` with the sections of every algorithm listed here."""
    return config.config_from_dict(data, source, overrides, algorithms=ALGORITHM_CONFIGS, **kwargs)


def default_config(algorithm: str = "muzero") -> Config:
    """Every key of ``algorithm``'s config at its default."""
    return config.default_config(algorithm, ALGORITHM_CONFIGS)


def field_specs() -> list[FieldSpec]:
    """Every key of every algorithm's config (:func:`mpper.config.field_specs`)."""
    return config.field_specs(ALGORITHM_CONFIGS)


def describe_config(markdown: bool = False) -> str:
    """:func:`mpper.config.describe_config` of every algorithm listed here (``--help-config``)."""
    return config.describe_config(ALGORITHM_CONFIGS, markdown)


# What every offline run sets: no self-play inserts to pace, no env-step budget to reach
OFFLINE_OVERRIDES = ("training.samples_per_insert=null", "training.env_steps=null")


def offline_overrides(algorithm: str) -> tuple[str, ...]:
    """The ``--set`` overrides an offline run of ``algorithm`` applies before the user's:
    :data:`OFFLINE_OVERRIDES` and the algorithm's own (``AlgorithmConfig.offline``)."""
    known = ALGORITHM_CONFIGS.get(algorithm)
    return OFFLINE_OVERRIDES + (known.offline if known is not None else ())
