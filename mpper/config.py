"""Run configuration: JSON files validated into dataclasses.

A config is the ``algorithm`` key, the shared sections defined here (``env``, ``replay``,
``training``, ``runtime``) and the sections the algorithm owns, which its folder defines
(``mpper/algos/<name>/config.py``: an :class:`AlgorithmConfig`); a key of another
algorithm's section is an error. The engine below is given the algorithms' sections by
its caller (``mpper.algos.registry`` binds them: ``load_config``, ``describe_config``),
so this module knows no algorithm.

Every key of every section is a dataclass field. Its default, its allowed values and its
one-line description live together in the field (``opt(default, allowed, doc)``), so the
checks and ``python run.py --help-config`` (plain or as a Markdown table) come from the
same place. Names follow muzero-general (and the MuZero paper) where a counterpart exists.

``allowed`` is one of:

- a range string: ``">= 1"``, ``"> 0"``, ``"[0, 1]"``, ``"(0, 1]"`` (for int and float fields);
- a tuple of the allowed strings (enums);
- a :class:`Check`: a description and a function, for lists and special strings;
- ``None``: any value of the field's type (finite, for numbers).

Rules that tie two keys together are ``CROSS_RULES`` (shared keys) and an algorithm's
``rules``. :func:`load_config` reads a JSON file, applies ``--set section.key=value`` overrides and command-line flags, and returns a
:class:`Config` or raises :class:`ConfigError`, whose message is one line:
``<file or flag>: <section.key>: <what is wrong and what is allowed>``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import re
import textwrap
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from .config_files import ConfigError, read_config_file
from .env_ids import env_id_form, module_not_found_text, search_current_directory
from .extras import MissingExtraError, register_env_family
from .replay.episode_ring import MAX_CAPACITY

__all__ = [
    "CROSS_RULES",
    "SCHEDULE",
    "WIDTHS",
    "AlgorithmConfig",
    "Check",
    "Config",
    "ConfigError",
    "EnvConfig",
    "MAX_SEED",
    "ReplayConfig",
    "Rule",
    "RuntimeConfig",
    "TrainingConfig",
    "config_from_dict",
    "config_to_dict",
    "default_config",
    "describe_config",
    "field_specs",
    "is_env_factory",
    "load_config",
    "load_run_config",
    "opt",
    "section_specs",
]


class _Invalid(Exception):
    """Raised by a :class:`Check` function: ``key_suffix`` (e.g. ``"[1]"``) and detail."""

    def __init__(self, detail: str, key_suffix: str = ""):
        super().__init__(detail)
        self.detail = detail
        self.key_suffix = key_suffix


@dataclass(frozen=True)
class Check:
    """A custom validation: ``describe`` is the allowed-values text for the help and the
    messages; ``fn(value)`` returns the normalised value or raises :class:`_Invalid`."""

    describe: str
    fn: Callable[[Any], Any]
    late: bool = False  # run only after every other check passed (slow or needs imports)


def opt(default, allowed, doc: str):
    """A dataclass field with its allowed values and description as metadata."""
    md = {"allowed": allowed, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata=md)
    return field(default=default, metadata=md)


# ---- custom checks ------------------------------------------------------------------------


def _show(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


MAX_WIDTH, MAX_LAYERS = 65536, 64


def _check_widths(value: list) -> list:
    if len(value) > MAX_LAYERS:
        raise _Invalid(f"expected at most {MAX_LAYERS} widths, got {len(value)}")
    for i, w in enumerate(value):
        if not (isinstance(w, int) and not isinstance(w, bool)) or not 1 <= w <= MAX_WIDTH:
            raise _Invalid(f"expected an integer in [1, {MAX_WIDTH}], got {_show(w)}", f"[{i}]")
    return list(value)


def _check_schedule(value: list) -> list:
    if not value:
        raise _Invalid("expected at least one [fraction, temperature] pair, got []")
    out = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _Invalid(f"expected a [fraction, temperature] pair, got {_show(pair)}", f"[{i}]")
        frac, temp = pair
        if not _is_number(frac) or not math.isfinite(frac) or not 0 <= frac <= 1:
            raise _Invalid(f"expected a fraction of training in [0, 1], got {_show(frac)}", f"[{i}][0]")
        if not _is_number(temp) or not math.isfinite(temp) or temp < 0:
            raise _Invalid(f"expected a temperature >= 0, got {_show(temp)}", f"[{i}][1]")
        if i == 0 and frac != 0:
            raise _Invalid(f"the first fraction must be 0 (the schedule starts at step 0), got {_show(frac)}", "[0][0]")
        if out and frac <= out[-1][0]:
            raise _Invalid(
                f"fractions must increase (sorted, no repeats), got {_show(frac)} after {_show(out[-1][0])}",
                f"[{i}][0]",
            )
        out.append([float(frac), float(temp)])
    return out


def _check_initial_priority(value):
    if isinstance(value, str):
        if value not in ("actor", "max"):
            raise _Invalid(f'expected "actor", "max" or a number >= 0, got {_show(value)}')
        return value
    if not math.isfinite(value) or value < 0:
        raise _Invalid(f'expected "actor", "max" or a number >= 0, got {_show(value)}')
    return float(value)


# Seeds are 32-bit (numpy's legacy range); each process derives its own as seed * 1_000_003
# + a few small terms, which then stays within what torch.manual_seed accepts.
MAX_SEED = 2**32 - 1

def _check_env_id(value: str) -> str:
    """A registered gymnasium id, ``module:callable`` or gymnasium's ``module:EnvId``
    (:mod:`mpper.env_ids`) whose module can be found (located, not run; no env is
    created), the current directory included."""
    import gymnasium

    try:
        register_env_family(value)  # MinAtar/..., ALE/...: ids their packages register on request
    except MissingExtraError as exc:
        raise _Invalid(str(exc)) from None
    form = env_id_form(value)
    if form.imports:
        import importlib.util

        search_current_directory()
        try:
            found = importlib.util.find_spec(form.module) is not None
        except (ImportError, ValueError):  # a parent package that is missing
            found = False
        if not found:
            raise _Invalid(module_not_found_text(form.module, value))
        return value
    registry = gymnasium.envs.registry
    if value in registry:
        return value
    close = difflib.get_close_matches(value, list(registry), n=1, cutoff=0.6)
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    raise _Invalid(
        f'{_show(value)} is not a registered gymnasium id{hint}; expected a registered id such as "CartPole-v1", '
        '"module:callable" returning a gymnasium.Env, or "module:EnvId-v0" (importing module registers EnvId-v0)'
    )


_RAY_ADDRESS_RE = re.compile(r"^[A-Za-z0-9._-]+:[0-9]{1,5}$")


def _check_ray_address(value: str) -> str:
    if value == "auto" or (_RAY_ADDRESS_RE.match(value) and 0 < int(value.rsplit(":", 1)[1]) < 65536):
        return value
    if value.startswith("ray://"):
        raise _Invalid(f"{_show(value)} is a Ray Client address; mpper joins the cluster as a node's driver (the "
                       'buffer\'s machine must be a node: ray start there), expected "auto" or the head\'s "host:port"')
    raise _Invalid(f'expected "auto" or the head\'s "host:port" (such as "10.0.0.5:6379"), got {_show(value)}')


def _check_resources(value: dict) -> dict:
    for name, amount in value.items():
        if not name or not _is_number(amount) or not math.isfinite(amount) or amount <= 0:
            raise _Invalid(f"expected a number > 0 per resource name, got {_show(amount)}", f".{name}")
    return {str(k): float(v) for k, v in value.items()}


WIDTHS = Check(f"a list of at most {MAX_LAYERS} integers in [1, {MAX_WIDTH}]", _check_widths)
SCHEDULE = Check("a list of [fraction, T] pairs: fractions in [0, 1] increasing from 0, T >= 0", _check_schedule)
_INITIAL_PRIORITY = Check('"actor", "max" or a number >= 0', _check_initial_priority)
_ENV_ID = Check('a registered gymnasium id, "module:callable" or "module:EnvId-v0"', _check_env_id, late=True)
_RAY_ADDRESS = Check('"auto" or "host:port"', _check_ray_address)
_RESOURCES = Check("an object of resource name -> amount > 0", _check_resources)


# ---- the sections ---------------------------------------------------------------------------


@dataclass
class EnvConfig:
    """The environment each self-play worker steps."""

    id: str = opt("CartPole-v1", _ENV_ID, 'a registered gymnasium id; "module:callable" (a Python name after the '
                  'colon) returning a gymnasium.Env; or gymnasium\'s "module:EnvId-v0" (importing module registers '
                  "EnvId-v0); modules are found in the current directory too (docs/custom_envs.md)")
    kwargs: dict = opt({}, None, "passed to gymnasium.make / the factory")
    max_episode_steps: int | None = opt(None, "[1, 1e15]", "time limit (truncation); null: the env's own")
    preprocessing: str = opt("none", ("none", "channels_first", "atari"), '"channels_first": image observations '
                             '(H, W, C) -> (C, H, W) (MinAtar); "atari": gymnasium\'s AtariPreprocessing (no-op reset, '
                             "frame skip 4 with max-pooling, grayscale, 84 x 84) on an env made with frameskip 1, "
                             "then (1, H, W); none: the env as made")
    preprocessing_kwargs: dict = opt({}, None, "atari: keyword arguments of AtariPreprocessing (screen_size, "
                                     "terminal_on_life_loss, noop_max, frame_skip, ...)")


@dataclass
class ReplayConfig:
    """The shared-memory prioritized replay buffer."""

    capacity: int = opt(100_000, f"[2, {MAX_CAPACITY}]", "steps (rows) in the shared ring")
    alpha: float = opt(0.5, ">= 0", "priority exponent (PER_alpha); 0: uniform")
    beta: float = opt(1.0, "[0, 1]", "initial importance-sampling exponent, annealed to 1")
    priority_eps: float = opt(1e-6, ">= 0", "added to raw priorities so that no step is starved")
    initial_priority: str | float = opt("actor", _INITIAL_PRIORITY, 'raw priority of new steps: "actor" (the actor\'s '
                                        "own error estimate: MuZero |root value - n-step target| as muzero-general, "
                                        'DQN |TD| as Ape-X), "max" (largest so far) or a number')
    beta_anneal_steps: int | None = opt(None, "[1, 1e15]", "training steps over which beta reaches 1; null: training_steps")
    snapshot_interval_s: float = opt(300.0, ">= 0", "periodic buffer snapshot; 0: only at the end")

    @property
    def buffer_initial_priority(self) -> str | float:
        """What the buffer gives steps stored without priorities: ``initial_priority``,
        with "actor" (every actor hands its own) falling back to "max"."""
        return "max" if self.initial_priority == "actor" else self.initial_priority


@dataclass
class TrainingConfig:
    """The learner."""

    # Step and episode counts are at most 1e15: far beyond any run, and far below the
    # counters' int64 (snapshots refuse 2^62), so that no sum of a count and a step overflows.
    training_steps: int = opt(10_000, "[1, 1e15]", "total learner steps (batches); the run ends there")
    env_steps: int | None = opt(None, "[1, 1e15]", "env (agent) steps stored, over the run's life as training_steps: "
                                "the run stops cleanly once the buffer has counted this many (SB3's "
                                "total_timesteps); null: no limit")
    batch_size: int = opt(128, "[1, 65536]", "positions per training batch")
    optimizer: str = opt("adam", ("adam", "sgd"), '"adam" or "sgd"')
    momentum: float = opt(0.9, "[0, 1]", "sgd only")
    lr_init: float = opt(0.02, "> 0", "initial learning rate")
    lr_decay_rate: float = opt(0.8, "(0, 1]", "exponential: lr = lr_init * rate ** (step / lr_decay_steps); 1: constant")
    lr_decay_steps: int = opt(1000, "[1, 1e15]", "training steps per factor lr_decay_rate")
    weight_decay: float = opt(1e-4, ">= 0", "L2 weight regularisation")
    grad_clip: float | None = opt(None, "> 0", "max global gradient norm; null: off")
    publish_interval: int = opt(10, "[1, 1e15]", "publish the weights to self-play, the evaluator and the reanalyser "
                                 "every N training steps (checkpoint.pt: runtime.checkpoint_interval_s)")
    samples_per_insert: float | None = opt(None, "> 0", "training samples per stored step; null: off")
    samples_per_insert_tolerance: float = opt(0.2, ">= 0", "relative slack before a side waits")
    min_buffer_steps: int = opt(500, "[1, 1e15]", "env steps stored (since the run began) before learning starts")
    ema_decay: float | None = opt(None, "(0, 1)", "act, evaluate and checkpoint with an exponential moving average "
                                   "of the trained weights, this decay per training step; null: the weights as trained")


@dataclass
class RuntimeConfig:
    """Processes, devices, evaluation and stopping."""

    workers: int = opt(8, "[0, 4096]", "self-play processes; 0: everything in one process, in turns")
    envs_per_worker: int = opt(8, "[1, 65536]", "K environments searched together by each worker")
    device: str = opt("auto", ("auto", "cpu", "cuda"), 'learner device: "auto" (cuda when available), "cpu", "cuda"')
    seed: int = opt(0, f"[0, {MAX_SEED}]", "seed for numpy, torch and the envs; each process derives its own")
    evaluation_interval_s: float = opt(10.0, "> 0", "seconds between greedy evaluations")
    evaluation_interval_steps: int = opt(500, "[1, 1e15]", "lockstep runs: training steps between greedy "
                                          "evaluations (free-running runs evaluate every evaluation_interval_s)")
    lockstep: bool = opt(False, None, "self-play, learning, reanalyse and evaluation take turns on a schedule the "
                         "config fixes, not the machine's speed: the same seed gives the same run at any worker "
                         "count (workers then host the self-play streams); slower than free-running")
    lockstep_streams: int = opt(8, "[1, 4096]", "lockstep runs: self-play streams of envs_per_worker envs, "
                                "each with its own seed, spread over the workers")
    lockstep_moves: int = opt(1, "[1, 1000000]", "lockstep runs: moves each stream plays per round, between two "
                              "turns of learning")
    evaluation_episodes: int = opt(10, "[1, 1000000]", "greedy episodes whose mean return is reported; two-player envs: "
                                    "games against each opponent of the env, half as first player, half as second")
    solve_return: float | None = opt(None, None, "stop when the mean greedy return reaches this (two-player envs: "
                                      "the mean score against the last, strongest opponent, win +1 / draw 0 / "
                                      "loss -1); null: never")
    solve_confirm_episodes: int = opt(0, "[0, 1000000]", "one-player envs: when an evaluation reaches solve_return, play "
                                       "this many more greedy episodes with the same weights; the evaluation's mean "
                                       "is then over all its episodes, so a lucky few do not stop the run; 0: off")
    max_episode_return: float | None = opt(None, None, "one-player envs: the most one episode can return "
                                           "(CartPole-v1: 500); with it an evaluation stops as soon as its mean "
                                           "can no longer reach solve_return nor the best evaluation so far, so "
                                           "that failing weights cost less evaluation time; null: every "
                                           "evaluation plays all its episodes to the end")
    checkpoint_interval_s: float = opt(60.0, "> 0", "seconds between checkpoint.pt writes")
    max_worker_restarts: int = opt(3, "[0, 1000000]", "restarts of a failing worker before the run stops")
    time_limit_s: float | None = opt(None, "> 0", "stop cleanly after this many seconds; null: no limit")
    max_episodes: int | None = opt(None, "[1, 1e15]", "stop cleanly once this many self-play games have ended in this run "
                                   "(counted from its start, as time_limit_s); null: no limit")
    log_interval_s: float = opt(5.0, "> 0", "seconds between metrics.jsonl / metrics.csv progress records, and "
                                "between progress lines when stderr is not a terminal")
    wandb_project: str | None = opt(None, None, "also log the metrics and the config to this Weights & Biases "
                                    "project (pip install -e .[wandb]; WANDB_MODE=offline keeps the run local); "
                                    "null: off")
    video_every_evaluations: int | None = opt(None, "[1, 1000000]", "one-player envs: every Nth evaluation also records "
                                              "its first greedy episode to run_dir/videos/<training step>.mp4 "
                                              "(pip install -e .[video]); null: off")
    torch_threads: int = opt(1, "[1, 1024]", "torch threads per child process")
    selfplay_niceness: int = opt(0, "[0, 19]", "local self-play workers raise their niceness by this much, so "
                                 "that where processes outnumber cores the learner, the reanalyser and the "
                                 "evaluator get the CPU first (samples_per_insert still paces self-play); 0: off")
    ray_address: str | None = opt(None, _RAY_ADDRESS, 'run the self-play workers as Ray actors anywhere in this '
                                  'cluster (pip install -e .[ray]): "host:port" of its head, or "auto" (the cluster '
                                  "this machine belongs to); the buffer, learner, reanalyser and evaluator stay local "
                                  "processes; null: local processes only (Ray is never imported)")
    ray_actor_cpus: float = opt(1.0, "> 0", "with ray_address: CPUs each self-play actor reserves")
    ray_actor_resources: dict = opt({}, _RESOURCES, 'with ray_address: custom Ray resources each self-play actor '
                                    'reserves, such as {"selfplay": 1} to place them on the nodes started with '
                                    "ray start --resources='{\"selfplay\": 8}'")


@dataclass(frozen=True)
class Rule:
    """A rule between keys of an algorithm's sections: ``check(config)`` returns None when
    it holds, else what is wrong (``ConfigError`` names ``keys[0]`` and where the first of
    ``keys`` that a flag or ``--set`` changed came from)."""

    keys: tuple[str, ...]
    check: Callable[[Any], str | None]


@dataclass(frozen=True)
class AlgorithmConfig:
    """The config sections an algorithm owns (section name -> dataclass built like the
    shared ones, with :func:`opt` fields) and the rules between their keys."""

    sections: Mapping[str, type]
    rules: tuple[Rule, ...] = ()


@dataclass
class Config:
    """A whole run: the algorithm, one object per shared section and, in ``sections``, the
    algorithm's own sections by name; ``config.mcts`` reads ``config.sections["mcts"]``."""

    algorithm: str = opt("muzero", None, "the algorithm to train; its own sections are the other keys of the file")
    env: EnvConfig = field(default_factory=EnvConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sections: dict = field(default_factory=dict, metadata={"algorithm_sections": True})

    def __getattr__(self, name: str):
        # Called only for names that are not attributes: an algorithm's section.
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__} of algorithm {self.__dict__.get('algorithm')!r} "
                             f"has no section {name!r}")  # fmt: skip


# (key, "<=", other key): checked after every field is valid; also listed by describe_config.
CROSS_RULES: tuple[tuple[str, str, str], ...] = (
    ("training.batch_size", "<=", "training.min_buffer_steps"),
    ("training.min_buffer_steps", "<=", "replay.capacity"),
)


# ---- field specs ------------------------------------------------------------------------------

_NONE = type(None)
_TYPE_PHRASE = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "an object", list: "a list"}
_TYPE_NAME = {int: "int", float: "float", str: "str", bool: "bool", dict: "object", list: "list"}


@dataclass(frozen=True)
class _Range:
    text: str
    lo: float | None
    hi: float | None
    lo_open: bool
    hi_open: bool

    def __contains__(self, v) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return False
        return True


_NUM = r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"


@functools.cache
def _parse_range(text: str) -> _Range:
    m = re.fullmatch(rf"\s*(>=|>|<=|<)\s*({_NUM})\s*", text)
    if m:
        op, x = m.group(1), float(m.group(2))
        if op[0] == ">":
            return _Range(text, x, None, op == ">", False)
        return _Range(text, None, x, False, op == "<")
    m = re.fullmatch(rf"\s*([\[(])\s*({_NUM})\s*,\s*({_NUM})\s*([\])])\s*", text)
    if m:
        return _Range(f"in {text}", float(m.group(2)), float(m.group(3)), m.group(1) == "(", m.group(4) == ")")
    raise ValueError(f"bad range spec {text!r}")


@dataclass(frozen=True)
class FieldSpec:
    """One key: dotted name, types, default, allowed values and description."""

    key: str
    types: tuple  # base types (int, float, str, bool, dict, list), without NoneType
    nullable: bool
    default: Any
    allowed: Any  # None, _Range, tuple of strings, Check
    doc: str

    @property
    def type_name(self) -> str:
        name = " | ".join(_TYPE_NAME[t] for t in self.types)
        return name + " | null" if self.nullable else name

    @property
    def allowed_text(self) -> str:
        if isinstance(self.allowed, _Range):
            return self.allowed.text
        if isinstance(self.allowed, tuple):
            return "one of " + ", ".join(f'"{c}"' for c in self.allowed)
        if isinstance(self.allowed, Check):
            return self.allowed.describe
        if self.types == (bool,):
            return "true or false"
        if self.types == (float,):
            return "a finite number"
        if self.types == (dict,):
            return "an object"
        return "any"

    def expected(self) -> str:
        """``"an integer >= 1"``, ``"a number in [0, 1] or null"``, ``'one of "a", "b"'``."""
        if isinstance(self.allowed, tuple):
            text = self.allowed_text
        elif isinstance(self.allowed, Check):
            text = self.allowed.describe
        else:
            text = " or ".join(_TYPE_PHRASE[t] for t in self.types)
            if isinstance(self.allowed, _Range):
                text += " " + self.allowed.text
        return text + " or null" if self.nullable else text


def _split_hint(hint) -> tuple[tuple, bool]:
    if get_origin(hint) in (Union, types.UnionType):
        args = get_args(hint)
        return tuple(a for a in args if a is not _NONE), _NONE in args
    return (hint,), False


def _default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


@functools.cache
def section_specs(cls, name: str | None = None) -> dict[str, FieldSpec]:
    """The keys of one section (``cls``, called ``name`` in the file), or of the top
    level (``cls`` is :class:`Config`, ``name`` None)."""
    hints = get_type_hints(cls)
    prefix = "" if name is None else name + "."
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) or f.metadata.get("algorithm_sections"):
            continue
        allowed = f.metadata["allowed"]
        if isinstance(allowed, str):
            allowed = _parse_range(allowed)
        types_, nullable = _split_hint(hints[f.name])
        out[f.name] = FieldSpec(prefix + f.name, types_, nullable, _default_of(f), allowed, f.metadata["doc"])
    return out


def _shared_sections() -> dict[str, type]:
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name])}


SHARED_SECTIONS: dict[str, type] = _shared_sections()


class _Schema:
    """What a file may hold: the top-level keys, the shared sections and the sections of
    ``algorithm`` (one of ``algorithms``); ``owner`` names the algorithm of every other
    algorithm's section, for the error that says whose it is."""

    def __init__(self, algorithms: Mapping[str, AlgorithmConfig], algorithm: str):
        self.algorithms, self.algorithm = algorithms, algorithm
        own = algorithms[algorithm].sections
        clash = set(own) & (set(SHARED_SECTIONS) | set(section_specs(Config)))
        if clash:
            raise ValueError(f"algorithm {algorithm!r} defines sections that exist already: {sorted(clash)}")
        self.sections: dict[str, type] = {**SHARED_SECTIONS, **own}
        self.owner = {sec: name for name, a in algorithms.items() for sec in a.sections if sec not in own}
        self.top = _top_specs(algorithms)

    def specs(self, section: str) -> dict[str, FieldSpec]:
        return section_specs(self.sections[section], section)

    def all_keys(self) -> list[str]:
        """Every key of every algorithm (for "did you mean" across sections)."""
        return [spec.key for spec in field_specs(self.algorithms)]


def _top_specs(algorithms: Mapping[str, AlgorithmConfig]) -> dict[str, FieldSpec]:
    """The top-level keys; ``algorithm`` allows the names of ``algorithms``."""
    top = dict(section_specs(Config))
    top["algorithm"] = dataclasses.replace(top["algorithm"], allowed=tuple(algorithms))
    return top


def field_specs(algorithms: Mapping[str, AlgorithmConfig]) -> list[FieldSpec]:
    """Every key of a config, in declaration order: top-level keys, the shared sections,
    then each algorithm's sections."""
    out = list(_top_specs(algorithms).values())
    for name, cls in SHARED_SECTIONS.items():
        out.extend(section_specs(cls, name).values())
    for a in algorithms.values():
        for name, cls in a.sections.items():
            out.extend(section_specs(cls, name).values())
    return out


# ---- validation -------------------------------------------------------------------------------


# Keys that had another name or moved to an algorithm's section: an old name is an error
# that names the new one.
RENAMED = {
    "training.checkpoint_interval": ("training.publish_interval", "same meaning"),
    **{f"training.{k}": (f"muzero.{k}", "same meaning") for k in (
        "num_unroll_steps", "td_steps", "stacked_observations", "value_loss_weight", "symmetry_augmentation",
        "priority_update")},
    "runtime.reanalyse": ("reanalyse.enabled", "same meaning"),
    "runtime.reanalyse_batch_episodes": ("reanalyse.batch_episodes", "same meaning"),
    "dqn.initial_priority": ("replay.initial_priority", '"td" is now "actor"'),
}  # fmt: skip


# Names other libraries give a setting (Stable-Baselines3, CleanRL, LightZero, ...), in any
# section or at the top level: the mpper keys that mean it (the first one the config's
# algorithm has is suggested) and what it is in mpper's terms.
_LR = (("training.lr_init",), "the initial learning rate; training.lr_decay_rate decays it")
_BUDGET = (("training.env_steps",), "a budget in env steps; training.training_steps counts learner batches")
_GAMMA = (("dqn.gamma", "mcts.discount"), "the reward discount")
_CAPACITY = (("replay.capacity",), "steps in the replay buffer")
_ENVS = (("runtime.envs_per_worker",), "envs each self-play process steps; runtime.workers is the processes")
_WORKERS = (("runtime.workers",), "self-play processes")
_WARMUP = (("training.min_buffer_steps",), "env steps stored before learning starts")
_RATIO = (("training.samples_per_insert",), "training samples per stored env step")
_TARGET = (("dqn.target_update_interval",), "training steps between target-network updates")
_CLIP = (("training.grad_clip",), "the largest global gradient norm")
_EPS_START = (("dqn.epsilon_start",), "the first exploration epsilon")
_EPS_END = (("dqn.epsilon_end",), "the exploration epsilon it decays to")
_EPS_DECAY = (("dqn.epsilon_decay",), "the epsilon decay, in each worker's env steps")
_NSTEP = (("dqn.n_step", "muzero.td_steps"), "the steps of the bootstrapped return")
_ENV_ID = (("env.id",), "the gymnasium id or module:callable")
FOREIGN_NAMES: dict[str, tuple[tuple[str, ...], str]] = {
    **dict.fromkeys(("learning_rate", "lr", "lr_start", "initial_lr"), _LR),
    **dict.fromkeys(("total_timesteps", "total_steps", "num_timesteps", "max_env_steps", "total_env_steps"), _BUDGET),
    **dict.fromkeys(("gamma", "discount", "discount_factor"), _GAMMA),
    **dict.fromkeys(("buffer_size", "replay_size", "replay_buffer_size", "memory_size", "buffer_capacity"), _CAPACITY),
    **dict.fromkeys(("n_envs", "num_envs", "env_num", "collector_env_num"), _ENVS),
    **dict.fromkeys(("num_workers", "n_workers", "num_actors", "n_actors"), _WORKERS),
    **dict.fromkeys(("learning_starts", "warmup_steps", "replay_start_size", "start_steps"), _WARMUP),
    **dict.fromkeys(("train_freq", "gradient_steps", "replay_ratio", "update_per_collect"), _RATIO),
    **dict.fromkeys(("target_network_frequency", "target_update_freq", "target_update_frequency"), _TARGET),
    **dict.fromkeys(("max_grad_norm", "clip_grad_norm", "grad_norm_clip", "max_norm"), _CLIP),
    **dict.fromkeys(("exploration_initial_eps", "start_e", "eps_start", "epsilon"), _EPS_START),
    **dict.fromkeys(("exploration_final_eps", "end_e", "eps_end", "final_epsilon"), _EPS_END),
    **dict.fromkeys(("exploration_fraction", "eps_decay"), _EPS_DECAY),
    **dict.fromkeys(("n_steps", "multi_step", "n_step", "nstep"), _NSTEP),
    **dict.fromkeys(("env_id", "env_name", "gym_id"), _ENV_ID),
    "seed": (("runtime.seed",), "the random seed"),
    "device": (("runtime.device",), "the learner's device"),
    "eval_freq": (("runtime.evaluation_interval_s",), "seconds between greedy evaluations"),
    "n_eval_episodes": (("runtime.evaluation_episodes",), "greedy episodes per evaluation"),
    "prioritized_replay_alpha": (("replay.alpha",), "the priority exponent"),
    "prioritized_replay_beta0": (("replay.beta",), "the initial importance-sampling exponent"),
    "net_arch": (("network.hidden", "dqn.hidden"), "the hidden layer widths"),
}  # fmt: skip


def _foreign_hint(key: str, schema: _Schema) -> str | None:
    """``did you mean training.lr_init? mpper's name for the initial learning rate ...`` for
    a name another library uses, or None (also when the config's algorithm has no such key)."""
    found = FOREIGN_NAMES.get(key.lower())
    if found is None:
        return None
    candidates, meaning = found
    own = [k for k in candidates if k.split(".")[0] in schema.sections]
    return f"did you mean {own[0]}? mpper's name for {meaning}" if own else None


def _unknown_key(source: str, key: str, section: str | None, known: Iterable[str], schema: _Schema) -> ConfigError:
    """``unknown key`` with a did-you-mean: a renamed key; another library's name for a
    key (``learning_rate``: ``training.lr_init``); a close match in the same section,
    else in any section; a section of another algorithm says whose it is."""
    dotted = f"{section}.{key}" if section else key
    if dotted in RENAMED:
        new, note = RENAMED[dotted]
        return ConfigError(f"{source}: {dotted}: renamed to {new} ({note})")
    foreign = _foreign_hint(key, schema)
    if foreign is not None:
        return ConfigError(f"{source}: {dotted}: unknown key ({foreign})")
    if section is None and key in schema.owner:
        return ConfigError(f'{source}: {key}: a section of algorithm "{schema.owner[key]}", not of '
                           f'"{schema.algorithm}" (whose sections are '
                           f'{", ".join(schema.sections)})')  # fmt: skip
    known = list(known)
    all_keys = schema.all_keys()
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {section + '.' if section else ''}{close[0]}?"
    else:
        elsewhere = [k for k in all_keys if k.rsplit(".", 1)[-1] == key]
        if not elsewhere:
            elsewhere = difflib.get_close_matches(key, [k.rsplit(".", 1)[-1] for k in all_keys], n=1, cutoff=0.75)
            elsewhere = [k for k in all_keys if elsewhere and k.rsplit(".", 1)[-1] == elsewhere[0]]
        own = [k for k in elsewhere if k.split(".")[0] in schema.sections or "." not in k]
        if own or elsewhere:
            hint = f"did you mean {(own or elsewhere)[0]}?"
        else:
            hint = f"allowed in {section}: " if section else "allowed at the top level: "
            hint += ", ".join(known)
    what = "unknown section" if section is None and close and close[0] in schema.sections else "unknown key"
    return ConfigError(f"{source}: {dotted}: {what} ({hint})")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _check_value(spec: FieldSpec, value: Any, source: str, late: bool = False) -> Any:
    """Type, range, enum and custom checks of one value; returns it normalised (ints of
    float keys become floats). ``late``: also run checks marked ``late``."""
    def bad(detail: str | None = None, suffix: str = "") -> ConfigError:
        return ConfigError(f"{source}: {spec.key}{suffix}: {detail or f'expected {spec.expected()}, got {_show(value)}'}")

    if value is None:
        if spec.nullable:
            return None
        raise bad()
    # type
    if isinstance(value, bool):
        ok = bool in spec.types
    elif isinstance(value, int):
        ok = int in spec.types or float in spec.types
    elif isinstance(value, float):
        ok = float in spec.types
    else:
        ok = isinstance(value, tuple(t for t in spec.types if t not in (int, float, bool)))
    if not ok:
        raise bad()
    if _is_number(value) and (int not in spec.types or isinstance(value, float)):
        value = float(value)
        if not math.isfinite(value):
            raise bad()
    # allowed values
    allowed = spec.allowed
    if isinstance(allowed, _Range):
        if value not in allowed:
            raise bad()
    elif isinstance(allowed, tuple):
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            raise bad(f"expected {spec.expected()}, got {_show(value)}{hint}")
    elif isinstance(allowed, Check) and (late or not allowed.late):
        try:
            value = allowed.fn(value)
        except _Invalid as e:
            raise bad(e.detail, e.key_suffix) from None
    return _plain(value)


class _Sources:
    """Where each key's value came from: the file unless an override or flag set it."""

    def __init__(self, file_label: str):
        self.file = file_label
        self.by_key: dict[str, str] = {}

    def __call__(self, *keys: str) -> str:
        for k in keys:
            if k in self.by_key:
                return self.by_key[k]
        return self.file


def _check_structure(data: Any, source: str, schema: _Schema) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level, got {_json_kind(data)}")
    if getattr(data, "duplicates", None):
        raise ConfigError(f"{source}: {data.duplicates[0]}: duplicate key")
    known = list(schema.top) + list(schema.sections)
    for key, value in data.items():
        if key in schema.sections:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {key}: expected an object (a section of keys), got {_show(value)}")
            if getattr(value, "duplicates", None):
                raise ConfigError(f"{source}: {key}.{value.duplicates[0]}: duplicate key")
        elif key not in schema.top:
            raise _unknown_key(source, key, None, known, schema)


def _json_kind(v: Any) -> str:
    if isinstance(v, list):
        return "a list"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "true/false"
    if v is None:
        return "null"
    return "a number"


def _show_set(text: str, limit: int = 80) -> str:
    """An override as an error names it: cut to ``limit`` characters, so that one line
    stays readable whatever was given."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _parse_set(text: str) -> tuple[str, Any]:
    """``section.key=value`` -> (dotted key, value): the value is JSON when it parses, else a
    plain string (so ``env.id=CartPole-v1`` and ``runtime.device=cpu`` need no quotes)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {_show_set(text)}: expected section.key=value, e.g. --set training.batch_size=64")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, too many digits, nested too deeply: a plain string
        value = raw
    return key, value


def _apply_override(data: dict, key: str, value: Any, label: str, sources: _Sources, schema: _Schema) -> None:
    parts = key.split(".")
    top = schema.top
    if any(not p for p in parts):
        raise ConfigError(f"{label}: {key}: expected section.key=value, e.g. --set training.batch_size=64")
    head = parts[0]
    if len(parts) == 1:
        if head in schema.sections:
            first = next(iter(schema.specs(head)))
            raise ConfigError(f"{label}: {key}: is a section; set one of its keys, e.g. --set {key}.{first}=...")
        if head not in top:
            raise _unknown_key(label, head, None, list(top) + list(schema.sections), schema)
        data[head] = value
        sources.by_key[head] = label
        return
    if head not in schema.sections:
        if head in top:
            raise ConfigError(f"{label}: {key}: {head} is not a section")
        if head in schema.owner:
            raise _unknown_key(label, head, None, schema.sections, schema)
        close = difflib.get_close_matches(head, list(schema.sections), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "sections: " + ", ".join(schema.sections)
        raise ConfigError(f"{label}: {head}: unknown section ({hint})")
    specs = schema.specs(head)
    name = parts[1]
    if name not in specs:
        raise _unknown_key(label, name, head, specs, schema)
    section = data.setdefault(head, {})
    dotted = f"{head}.{name}"
    if len(parts) > 2:  # into an object-valued key, e.g. env.kwargs.render_mode=rgb_array
        if dict not in specs[name].types:
            raise ConfigError(f"{label}: {key}: {dotted} is not an object ({specs[name].type_name})")
        target = section.get(name)
        if target is None:
            target = section[name] = {}
        if not isinstance(target, dict):
            raise ConfigError(f"{sources(dotted)}: {dotted}: expected {specs[name].expected()}, got {_show(target)}")
        for p in parts[2:-1]:
            nxt = target.get(p)
            if not isinstance(nxt, dict):
                nxt = target[p] = {}
            target = nxt
        target[parts[-1]] = value
    else:
        section[name] = value
    sources.by_key[dotted] = label


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _build_section(cls, name: str, raw: Mapping, sources: _Sources, schema: _Schema):
    specs = section_specs(cls, name)
    kwargs = {}
    for key, value in raw.items():
        if key not in specs:
            raise _unknown_key(sources(f"{name}.{key}"), key, name, specs, schema)
        kwargs[key] = _check_value(specs[key], value, sources(specs[key].key))
    return cls(**kwargs)


def _build(raw: Mapping, sources: _Sources, schema: _Schema) -> Config:
    kwargs = {}
    for key, value in raw.items():
        if key in SHARED_SECTIONS:
            kwargs[key] = _build_section(SHARED_SECTIONS[key], key, value, sources, schema)
        elif key in schema.top:
            kwargs[key] = _check_value(schema.top[key], value, sources(key))
    own = schema.algorithms[schema.algorithm].sections
    kwargs["sections"] = {name: _build_section(cls, name, raw.get(name, {}), sources, schema)
                          for name, cls in own.items()}  # fmt: skip
    return Config(**kwargs)


def _get(config: Config, dotted: str):
    obj = config
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_cross(config: Config, sources: _Sources, schema: _Schema) -> None:
    if config.runtime.ray_address is not None and config.runtime.workers == 0:
        raise ConfigError(f"{sources('runtime.ray_address', 'runtime.workers')}: runtime.ray_address: Ray actors "
                          "need runtime.workers >= 1 (one actor per worker); got runtime.workers 0")  # fmt: skip
    budget = config.training.env_steps
    if budget is not None and budget < config.training.min_buffer_steps:
        raise ConfigError(f"{sources('training.env_steps', 'training.min_buffer_steps')}: training.env_steps: "
                          f"must be >= training.min_buffer_steps ({config.training.min_buffer_steps}), got {budget}: "
                          "the run would stop before learning starts")  # fmt: skip
    for a, op, b in CROSS_RULES:
        va, vb = _get(config, a), _get(config, b)
        assert op == "<="
        if va > vb:
            raise ConfigError(f"{sources(a, b)}: {a}: must be <= {b} ({_show(vb)}), got {_show(va)}")
    for rule in schema.algorithms[config.algorithm].rules:
        problem = rule.check(config)
        if problem:
            raise ConfigError(f"{sources(*rule.keys)}: {rule.keys[0]}: {problem}")


def _algorithm_of(data: Mapping, overrides: list[tuple[str, Any, str]], source: str,
                  algorithms: Mapping[str, AlgorithmConfig]) -> str:  # fmt: skip
    """The algorithm the file (or the last override or flag that sets it) names, checked:
    it decides which sections the rest of the file may hold."""
    label, value = source, data.get("algorithm", section_specs(Config)["algorithm"].default)
    for key, v, lab in overrides:
        if key == "algorithm":
            label, value = lab, v
    return _check_value(_top_specs(algorithms)["algorithm"], value, label)


def config_from_dict(
    data: Any,
    source: str = "<config>",
    overrides: Iterable[str] = (),
    *,
    algorithms: Mapping[str, AlgorithmConfig],
    flags: Iterable[tuple[str, str, Any]] = (),
    check_env: bool = True,
    check_device: bool = True,
    env_factory_from_file: bool = True,
    origins: Mapping[str, str] | None = None,
) -> Config:
    """Validate a parsed JSON object into a :class:`Config`.

    ``algorithms``: each algorithm's :class:`AlgorithmConfig` by name (what
    ``mpper.algos.registry`` binds). ``overrides`` are ``"section.key=value"`` strings
    (``--set``); ``flags`` are ``(label, dotted key, value)`` triples for command-line
    flags (applied last, so a flag wins over ``--set`` and the file). Missing keys take
    their defaults. Raises :class:`ConfigError` naming ``source`` (or the override/flag
    that set the bad value).

    ``env_factory_from_file=False``: ``data`` did not come from the user (a run
    directory's ``config.json``), so an ``env.id`` of the form ``module:callable`` is
    refused unless an override or flag set it; see :func:`load_run_config`. ``origins``:
    ``{dotted key: label}`` of the keys a base file set (:func:`mpper.config_files.read_config_file`).
    """
    sources = _Sources(source)
    sources.by_key.update(origins or {})
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level, got {_json_kind(data)}")
    changes = [(*_parse_set(text), f"--set {_show_set(text)}") for text in overrides]
    changes += [(key, value, label) for label, key, value in flags]
    schema = _Schema(algorithms, _algorithm_of(data, changes, source, algorithms))
    _check_structure(data, source, schema)
    data = copy.deepcopy(data)
    for key, value, label in changes:
        _apply_override(data, key, value, label, sources, schema)
    # top-level and section duplicates were checked above; build checks every key
    config = _build(data, sources, schema)
    _check_cross(config, sources, schema)
    if check_device and config.runtime.device == "cuda" and not _cuda_available():
        raise ConfigError(
            f'{sources("runtime.device")}: runtime.device: "cuda" but torch.cuda.is_available() is false on this '
            'machine; use "auto" or "cpu"'
        )
    if check_env:
        _check_env_late(config, sources, env_factory_from_file)
    return config


def default_config(algorithm: str, algorithms: Mapping[str, AlgorithmConfig]) -> Config:
    """Every key at its default, for ``algorithm``."""
    return config_from_dict({"algorithm": algorithm}, algorithms=algorithms, check_env=False, check_device=False)


def is_env_factory(env_id: str) -> bool:
    """Whether ``env_id`` names a ``module:callable`` factory (code to import and call)
    rather than an id in gymnasium's registry (:mod:`mpper.env_ids`)."""
    return env_id_form(env_id).kind == "factory"


def _check_env_late(config: Config, sources: _Sources, env_factory_from_file: bool) -> None:
    # env.id is checked here, not in _build, so that a default id is checked too and the
    # gymnasium import happens only for configs that are otherwise valid
    source = sources("env.id")
    if not env_factory_from_file and source == sources.file and env_id_form(config.env.id).imports:
        # Checked before the module is even looked up: finding a submodule imports its package.
        # "pkg:Env-v0" runs pkg's code as surely as "module:callable" does.
        raise ConfigError(
            f"{source}: env.id: {_show(config.env.id)} names Python code to import; a run directory's "
            f"config.json may only name a registered gymnasium id. If that code is yours and you trust it, "
            f"name it yourself: --set env.id={config.env.id}"
        )
    spec = section_specs(EnvConfig, "env")["id"]
    _check_value(spec, config.env.id, source, late=True)


def load_config(
    path: str | Path,
    overrides: Iterable[str] = (),
    workers: int | None = None,
    *,
    device: str | None = None,
    seed: int | None = None,
    training_steps: int | None = None,
    env_steps: int | None = None,
    time_limit_s: float | None = None,
    ray_address: str | None = None,
    algorithms: Mapping[str, AlgorithmConfig],
    check_env: bool = True,
    check_device: bool = True,
    env_factory_from_file: bool = True,
) -> Config:
    """Read a JSON config file and validate it (see :func:`config_from_dict`).

    ``overrides``: ``--set section.key=value`` strings. ``workers``, ``device``, ``seed``,
    ``training_steps``, ``env_steps``, ``time_limit_s`` and ``ray_address`` (the ``--workers``,
    ``--device``, ``--seed``, ``--max-train-steps``, ``--env-steps``, ``--time-limit`` and ``--ray``
    flags) override their keys when not None. The file may extend another (``"base"``:
    :mod:`mpper.config_files`); an error names the file that set the bad value.
    """
    label = str(path)
    # a run directory's config.json (env_factory_from_file=False) is a whole config: it names no other file
    data, origins = read_config_file(path, label, allow_base=env_factory_from_file)
    flags = [
        (flag, key, value)
        for flag, key, value in (
            ("--workers", "runtime.workers", workers),
            ("--device", "runtime.device", device),
            ("--seed", "runtime.seed", seed),
            ("--max-train-steps", "training.training_steps", training_steps),
            ("--env-steps", "training.env_steps", env_steps),
            ("--time-limit", "runtime.time_limit_s", time_limit_s),
            ("--ray", "runtime.ray_address", ray_address),
        )
        if value is not None
    ]
    return config_from_dict(data, label, overrides, algorithms=algorithms, flags=flags, check_env=check_env,
                            check_device=check_device, env_factory_from_file=env_factory_from_file,
                            origins=origins)  # fmt: skip


def load_run_config(run_dir: str | Path, overrides: Iterable[str] = (), **flags) -> Config:
    """The config of a run directory, ``RUN_DIR/config.json``, which may have come from
    someone else: its ``env.id`` may only be a registered gymnasium id (gymnasium's own,
    ``mpper/TicTacToe-v0``, or one an installed package registers). A ``module:callable``
    factory there is a ConfigError, checked before anything is imported, unless the
    user names it in ``overrides`` (``--set env.id=module:callable``). Its
    ``runtime.device`` is not checked unless ``check_device`` is given: evaluating a run
    whose learner trained on a GPU needs none. ``flags``: as :func:`load_config`'s
    keyword arguments."""
    flags.setdefault("check_device", False)
    return load_config(Path(run_dir) / "config.json", overrides, env_factory_from_file=False, **flags)


def config_to_dict(config: Config) -> dict:
    """Plain JSON-ready dict of every key (the resolved ``config.json`` of a run): the
    top-level keys, ``env``, the algorithm's sections, then the other shared sections."""
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)
           if not dataclasses.is_dataclass(getattr(config, f.name)) and not f.metadata.get("algorithm_sections")}
    out["env"] = dataclasses.asdict(config.env)
    for name, section in config.sections.items():
        out[name] = dataclasses.asdict(section)
    for name in SHARED_SECTIONS:
        if name != "env":
            out[name] = dataclasses.asdict(getattr(config, name))
    return copy.deepcopy(out)


# ---- documentation ----------------------------------------------------------------------------

HELP_WIDTH = 100  # --help-config's columns at most: a common terminal


def _default_text(v: Any) -> str:
    return json.dumps(v)


def describe_config(algorithms: Mapping[str, AlgorithmConfig], markdown: bool = False) -> str:
    """Every key with its type, default, allowed values and description: plain text for
    ``--help-config``, or a Markdown table (``markdown=True``). The sections of an
    algorithm are marked with its name."""
    specs = field_specs(algorithms)
    owner = {sec: name for name, a in algorithms.items() for sec in a.sections}
    docs = {**SHARED_SECTIONS, **{sec: cls for a in algorithms.values() for sec, cls in a.sections.items()}}
    rows = [(s.key, s.type_name, _default_text(s.default), s.allowed_text, s.doc) for s in specs]
    rules = [f"{a} {op} {b}" for a, op, b in CROSS_RULES]
    if markdown:
        lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for spec, row in zip(specs, rows):
            sec = spec.key.split(".")[0]
            doc = f"({owner[sec]} only) {row[4]}" if sec in owner and "." in spec.key else row[4]
            cells = (f"`{row[0]}`", row[1], row[2], row[3], doc)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
        lines.append("Rules between keys: " + "; ".join(f"`{r}`" for r in rules) + ".")
        return "\n".join(lines)
    def wrapped(text: str, indent: str = "") -> list[str]:
        return textwrap.wrap(text, HELP_WIDTH, initial_indent=indent, subsequent_indent=indent or "    ",
                             break_on_hyphens=False)  # fmt: skip

    lines = [
        "Config keys (JSON: top-level keys, then one object per section). Missing keys take the default.",
        "env, replay, training and runtime are shared; the other sections belong to one algorithm each.",
        "Override any key with --set section.key=value (value parsed as JSON, else as a string).",
        'A config may extend another: "base": "cartpole" (a shipped name) or "base": "./other.json".',
        "Each key: its name, type, default and allowed values, then what it means.",
        "",
    ]
    section = None
    for spec, row in zip(specs, rows):
        sec = spec.key.split(".")[0] if "." in spec.key else None
        if sec != section:
            section = sec
            lines.append("")
            whose = f" (algorithm {owner[sec]})" if sec in owner else ""
            lines.extend(wrapped(f"[{sec}]{whose} {docs[sec].__doc__.strip()}"))
        key, type_name, default, allowed, doc = row
        lines.extend(wrapped(f"{key}  {type_name}  default {default}  allowed {allowed}"))
        lines.extend(wrapped(doc, "      "))
    lines.append("")
    lines.extend(wrapped("Rules between keys: " + "; ".join(rules) + "."))
    return "\n".join(lines)
