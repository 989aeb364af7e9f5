"""The shared config sections (``env``, ``replay``, ``training``, ``runtime``), the rules
between their keys, the root :class:`Config`, and the loaders that bind them to the
engine (:mod:`mpper.config.engine`).

A config is the ``algorithm`` key, the shared sections defined here and the sections the
algorithm owns, which its folder defines (``mpper/algos/<name>/config.py``: a subclass of
:class:`Config` whose own fields are its sections, in an :class:`AlgorithmConfig`); a key
of another algorithm's section is an error. The loaders are given the algorithms by
their caller (``mpper.algos.configs`` binds them), so this module knows no algorithm.
Names follow muzero-general (and the MuZero paper) where a counterpart exists.

:func:`load_config` reads a JSON file, applies ``--set section.key=value`` overrides and
command-line flags, and returns the algorithm's config class or raises
:class:`ConfigError`, whose message is one line:
``<file or flag>: <section.key>: <what is wrong and what is allowed>``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config_files import ConfigError, read_config_file
from ..env_ids import env_id_form
from ..replay.episode_ring import MAX_CAPACITY
from .checks import ENV_ID, INITIAL_PRIORITY, RAY_ADDRESS, RESOURCES
from .engine import AlgorithmConfig, ConfigSchema, Rule, Sources, parse_config, value_at
from .fields import FieldSpec, check_value, opt, section_specs, show
from .help import describe_schema
from .names import FOREIGN_NAMES, RENAMED

__all__ = [
    "CROSS_RULES",
    "FLAG_KEYS",
    "MAX_SEED",
    "RULES",
    "SHARED_SECTIONS",
    "Config",
    "EnvConfig",
    "ReplayConfig",
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
]

# Seeds are 32-bit (numpy's legacy range); each process derives its own as seed * 1_000_003
# + a few small terms, which then stays within what torch.manual_seed accepts.
MAX_SEED = 2**32 - 1


# ---- the sections ---------------------------------------------------------------------------


@dataclass
class EnvConfig:
    """The environment each self-play worker steps."""

    id: str = opt("CartPole-v1", ENV_ID, 'a registered gymnasium id; "module:callable" (a Python name after the '
                  'colon) returning a gymnasium.Env; or gymnasium\'s "module:EnvId-v0" (importing module registers '
                  "EnvId-v0); modules are found in the current directory too (docs/custom_envs.md)")
    kwargs: dict = opt({}, None, "passed to gymnasium.make / the factory")
    max_episode_steps: int | None = opt(None, "[1, 1e15]", "time limit (truncation); null: the env's own")
    preprocessing: str = opt("none", ("none", "channels_first", "atari"), '"channels_first": image observations '
                             '(H, W, C) -> (C, H, W) (MinAtar); "atari": gymnasium\'s AtariPreprocessing (no-op reset, '
                             "frame skip 4 with max-pooling, grayscale, 84 x 84) on an env made with frameskip 1, "
                             "then (1, H, W); none: the env as made")
    preprocessing_kwargs: dict = opt({}, None, "atari: keyword arguments of AtariPreprocessing (screen_size, "
                                     "grayscale_obs, noop_max, frame_skip, ...)")
    # Training-only settings: self-play's envs carry them, evaluation's never do
    # (mpper.envs.spec.make_env(config, training=True); docs/atari.md).
    episodic_life: bool = opt(False, None, "self-play only: a lost life ends the episode as terminal while the game "
                              "goes on (DeepMind's EpisodicLifeEnv; the emulator restarts only at game over); "
                              "evaluation plays whole games; self-play's episodes (episodes.jsonl, "
                              "runtime.max_episodes) are then lives. Needs an Arcade Learning Environment game")
    clip_rewards: bool = opt(False, None, "self-play only: rewards clipped to their sign (-1, 0, +1) as DQN and "
                             "EfficientZero train on Atari; evaluation reports the game's own score")
    training_max_episode_steps: int | None = opt(None, "[1, 1e15]", "self-play only: a game is cut (truncated) "
                                                 "after this many agent steps (moves, after any frame skip), "
                                                 "counted over the whole game when env.episodic_life splits it "
                                                 "into lives (EfficientZero: 3,000, 12,000 frames); null: no cut "
                                                 "beyond the env's own")


@dataclass
class ReplayConfig:
    """The shared-memory prioritized replay buffer."""

    capacity: int = opt(100_000, f"[2, {MAX_CAPACITY}]", "steps (rows) in the shared ring")
    alpha: float = opt(0.5, ">= 0", "priority exponent (PER_alpha); 0: uniform")
    beta: float = opt(1.0, "[0, 1]", "initial importance-sampling exponent, annealed to 1")
    priority_eps: float = opt(1e-6, ">= 0", "added to raw priorities so that no step is starved")
    initial_priority: str | float = opt("actor", INITIAL_PRIORITY, 'raw priority of new steps: "actor" (the actor\'s '
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
    after_env_steps: str = opt("stop", ("stop", "train"), "what env_steps ends: \"stop\": the whole run; \"train\": "
                               "self-play only, and the learner goes on until training_steps (the Atari 100k "
                               "protocol: 100k agent steps, then the remaining updates)")
    batch_size: int = opt(128, "[1, 65536]", "positions per training batch")
    optimizer: str = opt("adam", ("adam", "sgd"), '"adam" or "sgd"')
    momentum: float = opt(0.9, "[0, 1]", "sgd only")
    lr_init: float = opt(0.02, "> 0", "initial learning rate")
    lr_decay_rate: float = opt(0.8, "(0, 1]", "exponential: lr = lr_init * rate ** (step / lr_decay_steps); 1: constant")
    lr_decay_steps: int = opt(1000, "[1, 1e15]", "training steps per factor lr_decay_rate")
    lr_decay_staircase: bool = opt(False, None, "decay in whole steps: lr_init * rate ** floor(step / "
                                   "lr_decay_steps), as EfficientZero; false: smoothly (muzero-general)")
    lr_warmup_steps: int = opt(0, "[0, 1e15]", "the first N updates raise the learning rate linearly from "
                               "lr_init / N to lr_init (EfficientZero's lr_warm_up), the decay counting from N on; "
                               "0: off")
    lr_drop_return: float | None = opt(None, None, "once an evaluation's mean greedy return reaches this, the "
                                       "learning rate is multiplied by lr_drop_factor for the rest of the run (kept in "
                                       "checkpoint.pt), so that weights that solve the env settle there instead of "
                                       "wandering off; null: off")
    lr_drop_factor: float = opt(0.1, "(0, 1]", "see lr_drop_return")
    weight_decay: float = opt(1e-4, ">= 0", "L2 weight regularisation")
    grad_clip: float | None = opt(None, "> 0", "max global gradient norm; null: off")
    publish_interval: int = opt(10, "[1, 1e15]", "publish the weights to self-play, the evaluator and the reanalyser "
                                 "every N training steps (checkpoint.pt: runtime.checkpoint_interval_s)")
    samples_per_insert: float | None = opt(None, "> 0", "training samples per stored step; null: off")
    replay_ratio: float | None = opt(None, "> 0", "learner updates per stored env step (EfficientZero's and SPR's "
                                     "replay ratio): the same pacing as samples_per_insert = replay_ratio * batch_size; "
                                     "set this or samples_per_insert, not both; null: off")
    samples_per_insert_tolerance: float = opt(0.2, ">= 0", "relative slack before a side waits")
    min_buffer_steps: int = opt(500, "[1, 1e15]", "env steps stored (since the run began) before learning starts")
    ema_decay: float | None = opt(None, "(0, 1)", "act, evaluate and checkpoint with an exponential moving average "
                                   "of the trained weights, this decay per training step; null: the weights as trained")
    capture: str = opt("auto", ("auto", "off", "static", "cuda_graph", "compile"), "MuZero's training step on "
                       'a GPU (docs/gpu.md): "cuda_graph" captures the whole step once and replays it as a CUDA graph, '
                       '"compile" runs it through torch.compile(mode="reduce-overhead"), "static" runs the same '
                       "static-shape step eagerly; these three read the losses and priorities back one step late, "
                       'without a synchronisation per step; "off": the plain eager step; "auto": "cuda_graph" on '
                       'CUDA, "off" on the CPU. DQN: "auto" or "off"')
    precision: str = opt("fp32", ("fp32", "bf16"), '"bf16": MuZero\'s network runs under bfloat16 autocast on CUDA '
                         "(the value and reward supports and the losses stay float32); needs a captured or static "
                         'step (training.capture not "off") and a CUDA device')

    @property
    def paced_samples_per_insert(self) -> float | None:
        """The samples-per-insert ratio the rate limiter keeps: ``samples_per_insert``, or
        ``replay_ratio * batch_size`` (the same pacing in updates per env step); None: off."""
        if self.replay_ratio is not None:
            return self.replay_ratio * self.batch_size
        return self.samples_per_insert


@dataclass
class RuntimeConfig:
    """Processes, devices, evaluation and stopping."""

    workers: int = opt(8, "[0, 4096]", "self-play processes; 0: everything in one process, in turns")
    envs_per_worker: int = opt(8, "[1, 65536]", "K environments searched together by each worker")
    device: str = opt("auto", ("auto", "cpu", "cuda"), 'the learner\'s and the reanalyser\'s device: "auto" (cuda '
                      'when available), "cpu", "cuda"')
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
    final_evaluation_episodes: int | None = opt(None, "[1, 1000000]", "one-player envs: once the run has ended on "
                                                "its own (a budget, the time limit, a solve), play this many greedy "
                                                "episodes with its final weights: the run's result, in "
                                                "final_evaluation.json, metrics.jsonl and its last line; null: off")
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
    weights_history_interval_steps: int | None = opt(None, "[1, 1e15]", "every N training steps also keep the "
                                                     "published weights as run_dir/weights/step-<step>.pt (a network "
                                                     "checkpoint that --evaluate --checkpoint reads), to study how "
                                                     "the policy changes; null: off")
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
    selfplay_inference: str = opt("auto", ("auto", "worker", "server"), "where self-play workers run their "
                                  'network: "worker": each in its own process, on the CPU; "server": one inference '
                                  "process serves every worker's search, its leaves batched across the workers, on "
                                  'the learner\'s device (runtime.device); "auto": the server when that device is '
                                  "CUDA, else the workers. MuZero only (DQN's workers always run their own network); "
                                  "free-running runs with --workers >= 1 (lockstep, --workers 0 and Ray actors run "
                                  "their own)")
    selfplay_niceness: int = opt(0, "[0, 19]", "local self-play workers raise their niceness by this much, so "
                                 "that where processes outnumber cores the learner, the reanalyser and the "
                                 "evaluator get the CPU first (samples_per_insert still paces self-play); 0: off")
    ray_address: str | None = opt(None, RAY_ADDRESS, 'run the self-play workers as Ray actors anywhere in this '
                                  'cluster (pip install -e .[ray]): "host:port" of its head, or "auto" (the cluster '
                                  "this machine belongs to); the buffer, learner, reanalyser and evaluator stay local "
                                  "processes; null: local processes only (Ray is never imported)")
    ray_actor_cpus: float = opt(1.0, "> 0", "with ray_address: CPUs each self-play actor reserves")
    ray_actor_resources: dict = opt({}, RESOURCES, 'with ray_address: custom Ray resources each self-play actor '
                                    'reserves, such as {"selfplay": 1} to place them on the nodes started with '
                                    "ray start --resources='{\"selfplay\": 8}'")


@dataclass
class Config:
    """A whole run: the algorithm and one object per shared section. Each algorithm's
    config class extends it with its own sections as typed fields (``config.mcts`` of a
    MuZero run is a field of :class:`mpper.algos.muzero.config.MuZeroRunConfig`); the
    loaders build the class of the algorithm the file names."""

    algorithm: str = opt("muzero", None, "the algorithm to train; its own sections are the other keys of the file")
    env: EnvConfig = field(default_factory=EnvConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def sections(self) -> dict[str, Any]:
        """The algorithm's own sections by name: the fields this config has beyond
        :class:`Config`'s (``{"mcts": MCTSConfig(...), ...}``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _ROOT_FIELDS}


_ROOT_FIELDS = frozenset(f.name for f in dataclasses.fields(Config))


# ---- rules between keys -------------------------------------------------------------------------

# (key, "<=", other key): checked after every field is valid; also listed by describe_config.
CROSS_RULES: tuple[tuple[str, str, str], ...] = (
    ("training.batch_size", "<=", "training.min_buffer_steps"),
    ("training.min_buffer_steps", "<=", "replay.capacity"),
)


def _ray_needs_workers(config: Config) -> str | None:
    if config.runtime.ray_address is not None and config.runtime.workers == 0:
        return "Ray actors need runtime.workers >= 1 (one actor per worker); got runtime.workers 0"
    return None


def _server_needs_workers(config: Config) -> str | None:
    rt = config.runtime
    if rt.selfplay_inference != "server":
        return None
    if rt.workers == 0 or rt.lockstep or rt.ray_address is not None:
        how = "runtime.workers 0" if rt.workers == 0 else "lockstep" if rt.lockstep else "Ray actors"
        return f'"server" serves local self-play worker processes (--workers >= 1, not lockstep, no Ray); got {how}'
    return None


def _budget_allows_learning(config: Config) -> str | None:
    budget, start = config.training.env_steps, config.training.min_buffer_steps
    if budget is not None and budget < start:
        return (f"must be >= training.min_buffer_steps ({start}), got {budget}: the run would stop before learning "
                "starts")
    return None


def _one_pacing(config: Config) -> str | None:
    t = config.training
    if t.replay_ratio is not None and t.samples_per_insert is not None:
        return (f"and training.samples_per_insert say the same pacing two ways (replay_ratio * batch_size = "
                f"samples_per_insert); set one, got {t.replay_ratio:g} and {t.samples_per_insert:g}")
    return None


def _train_on_needs_a_budget(config: Config) -> str | None:
    if config.training.after_env_steps == "train" and config.training.env_steps is None:
        return '"train" needs training.env_steps, the budget after which self-play ends; got null'
    return None


def _at_most(a: str, b: str) -> Rule:
    def check(config: Config) -> str | None:
        va, vb = value_at(config, a), value_at(config, b)
        return f"must be <= {b} ({show(vb)}), got {show(va)}" if va > vb else None

    return Rule((a, b), check, doc=f"{a} <= {b}")


def _capture_needs_cuda(config: Config) -> str | None:
    capture, device = config.training.capture, config.runtime.device
    if capture in ("cuda_graph", "compile") and device == "cpu":
        return f'"{capture}" runs on CUDA: needs runtime.device "cuda" or "auto", got "cpu" ("static" runs on the CPU)'
    return None


def _bf16_needs_cuda_and_a_static_step(config: Config) -> str | None:
    t = config.training
    if t.precision == "bf16" and config.runtime.device == "cpu":
        return 'bfloat16 autocast runs on CUDA: needs runtime.device "cuda" or "auto", got "cpu"'
    if t.precision == "bf16" and t.capture == "off":
        return 'needs the static-shape step: training.capture "auto", "static", "cuda_graph" or "compile", got "off"'
    return None


# The shared rules, in the order they are checked (before the algorithm's own).
RULES: tuple[Rule, ...] = (
    Rule(("training.capture", "runtime.device"), _capture_needs_cuda),
    Rule(("training.precision", "training.capture", "runtime.device"), _bf16_needs_cuda_and_a_static_step),
    Rule(("runtime.ray_address", "runtime.workers"), _ray_needs_workers),
    Rule(("runtime.selfplay_inference", "runtime.workers", "runtime.lockstep", "runtime.ray_address"),
         _server_needs_workers),
    Rule(("training.env_steps", "training.min_buffer_steps"), _budget_allows_learning),
    Rule(("training.replay_ratio", "training.samples_per_insert"), _one_pacing),
    Rule(("training.after_env_steps", "training.env_steps"), _train_on_needs_a_budget),
    *(_at_most(a, b) for a, op, b in CROSS_RULES if op == "<="),
)


def config_schema(algorithms: Mapping[str, AlgorithmConfig]) -> ConfigSchema:
    """The engine's schema: :class:`Config`, ``algorithms``, the shared rules and the
    names of "did you mean"."""
    return ConfigSchema(Config, algorithms, RULES, RENAMED, FOREIGN_NAMES)


SHARED_SECTIONS: dict[str, type] = ConfigSchema(Config, {}).shared_sections


# ---- loading ----------------------------------------------------------------------------------


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


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
    """Validate a parsed JSON object into the config class of the algorithm it names.

    ``algorithms``: each algorithm's :class:`AlgorithmConfig` by name (what
    ``mpper.algos.configs`` binds). ``overrides`` are ``"section.key=value"`` strings
    (``--set``); ``flags`` are ``(label, dotted key, value)`` triples for command-line
    flags (applied last, so a flag wins over ``--set`` and the file). Missing keys take
    their defaults. Raises :class:`ConfigError` naming ``source`` (or the override/flag
    that set the bad value).

    ``env_factory_from_file=False``: ``data`` did not come from the user (a run
    directory's ``config.json``), so an ``env.id`` of the form ``module:callable`` is
    refused unless an override or flag set it; see :func:`load_run_config`. ``origins``:
    ``{dotted key: label}`` of the keys a base file set (:func:`mpper.config_files.read_config_file`).
    """
    config, sources = parse_config(config_schema(algorithms), data, source, overrides, flags, origins)
    if check_device and config.runtime.device == "cuda" and not _cuda_available():
        raise ConfigError(
            f'{sources("runtime.device")}: runtime.device: "cuda" but torch.cuda.is_available() is false on this '
            'machine; use "auto" or "cpu"'
        )
    if check_env:
        _check_env_late(config, sources, env_factory_from_file)
    return config


def _check_env_late(config: Config, sources: Sources, env_factory_from_file: bool) -> None:
    # env.id is checked here, not while the sections are built, so that a default id is
    # checked too and the gymnasium import happens only for configs that are otherwise valid
    source = sources("env.id")
    if not env_factory_from_file and source == sources.file and env_id_form(config.env.id).imports:
        # Checked before the module is even looked up: finding a submodule imports its package.
        # "pkg:Env-v0" runs pkg's code as surely as "module:callable" does.
        raise ConfigError(
            f"{source}: env.id: {show(config.env.id)} names Python code to import; a run directory's "
            f"config.json may only name a registered gymnasium id. If that code is yours and you trust it, "
            f"name it yourself: --set env.id={config.env.id}"
        )
    spec = section_specs(EnvConfig, "env")["id"]
    check_value(spec, config.env.id, source, late=True)


def default_config(algorithm: str, algorithms: Mapping[str, AlgorithmConfig]) -> Config:
    """Every key at its default, for ``algorithm``."""
    return config_from_dict({"algorithm": algorithm}, algorithms=algorithms, check_env=False, check_device=False)


def is_env_factory(env_id: str) -> bool:
    """Whether ``env_id`` names a ``module:callable`` factory (code to import and call)
    rather than an id in gymnasium's registry (:mod:`mpper.env_ids`)."""
    return env_id_form(env_id).kind == "factory"


# The command line's flags that set a key: (flag, dotted key, keyword argument of load_config).
FLAG_KEYS: tuple[tuple[str, str, str], ...] = (
    ("--workers", "runtime.workers", "workers"),
    ("--device", "runtime.device", "device"),
    ("--seed", "runtime.seed", "seed"),
    ("--max-train-steps", "training.training_steps", "training_steps"),
    ("--env-steps", "training.env_steps", "env_steps"),
    ("--time-limit", "runtime.time_limit_s", "time_limit_s"),
    ("--ray", "runtime.ray_address", "ray_address"),
)


def flag_overrides(**values: Any) -> list[tuple[str, str, Any]]:
    """``(flag, dotted key, value)`` of each flag in ``values`` (by the names of
    :data:`FLAG_KEYS`) that is not None: :func:`config_from_dict`'s ``flags``."""
    return [(flag, key, values[name]) for flag, key, name in FLAG_KEYS if values.get(name) is not None]


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
    flags = flag_overrides(workers=workers, device=device, seed=seed, training_steps=training_steps,
                           env_steps=env_steps, time_limit_s=time_limit_s, ray_address=ray_address)  # fmt: skip
    return config_from_dict(data, label, overrides, algorithms=algorithms, flags=flags, check_env=check_env,
                            check_device=check_device, env_factory_from_file=env_factory_from_file,
                            origins=origins)  # fmt: skip


def load_run_config(run_dir: str | Path, overrides: Iterable[str] = (), **flags: Any) -> Config:
    """The config of a run directory, ``RUN_DIR/config.json``, which may have come from
    someone else: its ``env.id`` may only be a registered gymnasium id (gymnasium's own,
    ``mpper/TicTacToe-v0``, or one an installed package registers). A ``module:callable``
    factory there is a ConfigError, checked before anything is imported, unless the
    user names it in ``overrides`` (``--set env.id=module:callable``). Its
    ``runtime.device`` is not checked unless ``check_device`` is given: evaluating a run
    whose learner trained on a GPU needs none. ``flags``: as :func:`load_config`'s
    keyword arguments (``algorithms`` among them)."""
    flags.setdefault("check_device", False)
    return load_config(Path(run_dir) / "config.json", overrides, env_factory_from_file=False, **flags)


def config_to_dict(config: Config) -> dict:
    """Plain JSON-ready dict of every key (the resolved ``config.json`` of a run): the
    top-level keys, ``env``, the algorithm's sections, then the other shared sections."""
    out: dict[str, Any] = {name: getattr(config, name) for name in section_specs(Config)}
    out["env"] = dataclasses.asdict(config.env)
    for name, section in config.sections.items():
        out[name] = dataclasses.asdict(section)
    for name in SHARED_SECTIONS:
        if name != "env":
            out[name] = dataclasses.asdict(getattr(config, name))
    return copy.deepcopy(out)


def field_specs(algorithms: Mapping[str, AlgorithmConfig]) -> list[FieldSpec]:
    """Every key of a config, in declaration order: top-level keys, the shared sections,
    then each algorithm's sections."""
    return config_schema(algorithms).field_specs()


def describe_config(algorithms: Mapping[str, AlgorithmConfig], markdown: bool = False) -> str:
    """Every key with its type, default, allowed values and description: plain text for
    ``--help-config``, or a Markdown table (``markdown=True``) (:mod:`mpper.config.help`)."""
    return describe_schema(config_schema(algorithms), markdown)
