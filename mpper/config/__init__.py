"""Run configuration: JSON files checked into typed dataclasses, with one-line errors.

- :mod:`~mpper.config.fields`: how a section declares a key (``opt(default, allowed,
  doc)``) and how one value is checked;
- :mod:`~mpper.config.engine`: a file, ``--set`` overrides and flags -> a checked config
  of the algorithm the file names (did-you-mean, rules between keys); it knows no section;
- :mod:`~mpper.config.help`: ``--help-config``;
- :mod:`~mpper.config.schema`: the shared sections (``env``, ``replay``, ``training``,
  ``runtime``), the root :class:`Config`, the rules between their keys and the loaders;
  :mod:`~mpper.config.checks` and :mod:`~mpper.config.names` hold its custom checks and
  the old and foreign names of its keys.

Each algorithm's sections are a subclass of :class:`Config` in its folder
(``mpper/algos/<name>/config.py``), which ``mpper.algos.configs`` binds to the loaders.
"""

from ..config_files import ConfigError
from .checks import SCHEDULE, WIDTHS
from .engine import AlgorithmConfig, ConfigSchema, Rule
from .fields import Check, FieldSpec, opt, section_specs
from .schema import (
    CROSS_RULES,
    FLAG_KEYS,
    MAX_SEED,
    RULES,
    SHARED_SECTIONS,
    Config,
    EnvConfig,
    ReplayConfig,
    RuntimeConfig,
    TrainingConfig,
    config_from_dict,
    config_schema,
    config_to_dict,
    default_config,
    describe_config,
    field_specs,
    flag_overrides,
    is_env_factory,
    load_config,
    load_run_config,
)

__all__ = [
    "CROSS_RULES",
    "FLAG_KEYS",
    "MAX_SEED",
    "RULES",
    "SCHEDULE",
    "SHARED_SECTIONS",
    "WIDTHS",
    "AlgorithmConfig",
    "Check",
    "Config",
    "ConfigError",
    "ConfigSchema",
    "EnvConfig",
    "FieldSpec",
    "ReplayConfig",
    "Rule",
    "RuntimeConfig",
    "TrainingConfig",
    "config_from_dict",
    "config_schema",
    "config_to_dict",
    "default_config",
    "describe_config",
    "field_specs",
    "flag_overrides",
    "is_env_factory",
    "load_config",
    "load_run_config",
    "opt",
    "section_specs",
]
