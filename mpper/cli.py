"""Command line: ``python run.py --config configs/cartpole.json --workers 8``.

``main`` parses the flags and hands a training run to :func:`mpper.launch.launch`, the
path ``mpper.train`` takes too: it validates the config (file, ``--set`` overrides and
flags) and only then imports :mod:`mpper.runtime.supervisor` and trains. Any mistake in the
flags or the config is one line ``error: ...`` on stderr and exit code 2, with nothing
started. So is a run that cannot start on this machine or from this run directory: an env
that cannot be made, sizes that do not fit /dev/shm or the memory (:mod:`mpper.runtime.resources`),
or (``--resume``) a checkpoint or snapshot that does not load or does not fit the config;
those are found before any child process starts and before anything is written. The run
directory is held (:mod:`mpper.runtime.rundir`) from before the run writes there until the
run ends: one that another live run holds, one that holds a finished run (without
``--resume``), or one that cannot be created or written is refused.

Each mode (a training run, ``--resume``, ``--evaluate``, ``--evaluate --on-snapshot``,
``--plot``, ``--inspect``, ``--help-config``, ``sweep``) takes the flags :data:`MODE_FLAGS`
lists; a flag the user typed that its mode does not take is refused in one line that says
where it applies (argparse defaults do not count). ``mpper sweep ...`` (:func:`sweep_main`)
runs several seeds of one config through :mod:`mpper.tools.sweep`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from . import __version__
from .algos.configs import describe_config, load_config
from .config import MAX_SEED, ConfigError, RuntimeConfig, section_specs
from .launch import LaunchError, default_run_dir, launch, resolve_config, shipped_configs

__all__ = ["MODES", "MODE_FLAGS", "build_parser", "build_sweep_parser", "console", "default_run_dir", "main",
           "resolve_config", "shipped_configs", "sweep_main"]

EXIT_USAGE = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so that every mistake
    is reported as the same single line."""

    def error(self, message: str):
        raise _UsageError(message)


def program_name() -> str:
    """``run.py`` when that script was invoked, else ``mpper`` (the installed command)."""
    return "run.py" if Path(sys.argv[0]).name == "run.py" else "mpper"


def build_parser() -> argparse.ArgumentParser:
    devices = section_specs(RuntimeConfig, "runtime")["device"].allowed
    p = _Parser(
        prog=program_name(),
        description=(
            "Train MuZero (or DQN) with N self-play processes, a learner and a reanalyser that "
            "share one replay buffer in shared memory."
        ),
        epilog=(
            f"Several seeds of one config: {program_name()} sweep --help. "
            "Config keys, their defaults and allowed values: --help-config. Mistakes in flags or "
            "in the config are reported as one line on stderr with exit code 2, before anything starts."
        ),
    )
    p.add_argument("--config", metavar="PATH|NAME",
                   help="JSON config file, or the name of a config mpper ships (" + ", ".join(shipped_configs())
                        + "); required, except with --resume, which defaults to RUN_DIR/config.json")
    p.add_argument("--workers", type=int, metavar="N",
                   help="self-play processes (overrides runtime.workers; 0: everything in one process, in turns)")
    p.add_argument("--device", choices=devices,
                   help='learner device (overrides runtime.device): "auto" uses CUDA when available')
    p.add_argument("--seed", type=int, metavar="N", help="random seed (overrides runtime.seed)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where config.json, metrics.jsonl, checkpoint.pt and buffer/ go "
                        "(default: runs/<config-name>/<timestamp>/; with --resume: RUN_DIR)")
    p.add_argument("--max-train-steps", type=int, metavar="N",
                   help="stop after N training steps (overrides training.training_steps)")
    p.add_argument("--env-steps", type=int, metavar="N",
                   help="stop cleanly once N env steps are stored (overrides training.env_steps)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="stop cleanly after this many seconds (overrides runtime.time_limit_s)")
    p.add_argument("--ray", metavar="ADDRESS", dest="ray_address",
                   help='run the self-play workers as Ray actors in the cluster at ADDRESS ("host:port" of its head, '
                        'or "auto"; overrides runtime.ray_address); the buffer, learner, reanalyser and evaluator '
                        "stay on this machine (needs the ray extra: pip install -e .[ray])")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its checkpoint and buffer snapshot")
    p.add_argument("--offline", nargs="+", metavar="SNAPSHOT_DIR",
                   help="learn from buffer snapshots (of one env; several are combined) with no self-play: the "
                        "learner (and MuZero's reanalyser, which searches every stored episode again) trains on "
                        "them; evaluation, checkpoints and best.pt as in any run; RUN_DIR/offline.json names the "
                        "snapshots by checksum")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key, typed and checked like the file; VALUE is parsed as JSON "
                        "when it can be, else taken as a string (repeatable; e.g. --set training.batch_size=64). "
                        "With --evaluate and --resume it applies to the run's config.json, which may name a "
                        "'module:callable' env only when you repeat it here: --set env.id=module:callable")
    p.add_argument("--evaluate", metavar="RUN_DIR",
                   help="play greedy episodes with a run's best weights (best.pt, else checkpoint.pt), say which, "
                        "print return and length statistics, write RUN_DIR/evaluation.json, and exit")
    p.add_argument("--episodes", type=int, default=10, metavar="N", help="with --evaluate: episodes to play (10)")
    p.add_argument("--checkpoint", metavar="FILE",
                   help="with --evaluate: checkpoint to load (default RUN_DIR/best.pt when the run has one, else "
                        "RUN_DIR/checkpoint.pt; with --on-snapshot RUN_DIR/checkpoint.pt)")
    p.add_argument("--render", nargs=2, metavar=("FORMAT", "PATH"),
                   help="with --evaluate: also record the first greedy episode from the env's rgb_array frames "
                        "and write it to PATH; FORMAT: gif (needs the render extra: pip install -e .[render]) or mp4 "
                        "(also the video extra: pip install -e .[video])")
    p.add_argument("--on-snapshot", metavar="SNAPSHOT_DIR",
                   help="with --evaluate: instead of playing, run the checkpoint over every stored position of a "
                        "buffer snapshot, print its errors against the stored targets and write "
                        "RUN_DIR/snapshot_evaluation.json")
    p.add_argument("--plot", metavar="RUN_DIR",
                   help="plot a run's metrics.jsonl (return, losses, throughput against env steps and wall time) "
                        "into RUN_DIR/plots/*.png and exit (needs the plot extra: pip install -e .[plot])")
    p.add_argument("--inspect", metavar="SNAPSHOT_DIR",
                   help="report what a buffer snapshot holds (opened memory-mapped, read-only) and exit")
    p.add_argument("--json", action="store_true", help="with --inspect: print the statistics as JSON")
    p.add_argument("--collect", metavar="RUN_DIR",
                   help="make a dataset: play a run's weights (best.pt, else checkpoint.pt; --checkpoint FILE) for "
                        "--env-steps N env steps, each greedy action replaced by a random one with probability "
                        "--epsilon, and write the transitions as a buffer snapshot at --out DIR (for --offline); "
                        "prints the behaviour's mean return")
    p.add_argument("--epsilon", type=float, default=0.0, metavar="E",
                   help="with --collect: the probability of a random action instead of the greedy one (0)")
    p.add_argument("--out", metavar="DIR", help="with --collect: the new snapshot directory")
    p.add_argument("--help-config", action="store_true",
                   help="print every config key with its type, default, allowed values and meaning, and exit")
    p.add_argument("--version", action="version", version=f"mpper {__version__}")
    return p


def _fail(message: str) -> int:
    print("error: " + " ".join(str(message).splitlines()), file=sys.stderr)
    return EXIT_USAGE


# The flags (argparse dests) each mode takes; any other flag the user gave is refused.
TRAINING_FLAGS = frozenset({"config", "workers", "device", "seed", "run_dir", "max_train_steps", "env_steps",
                            "time_limit", "ray_address", "overrides"})  # fmt: skip
MODE_FLAGS = {
    "training runs": TRAINING_FLAGS,
    "--resume": TRAINING_FLAGS | {"resume"},
    "--offline": (TRAINING_FLAGS - {"env_steps", "ray_address"}) | {"offline"},
    "--evaluate": frozenset({"evaluate", "episodes", "checkpoint", "render", "seed", "overrides"}),
    "--evaluate --on-snapshot": frozenset({"evaluate", "on_snapshot", "checkpoint", "overrides"}),
    "--plot": frozenset({"plot"}),
    "--inspect": frozenset({"inspect", "json"}),
    "--collect": frozenset({"collect", "checkpoint", "env_steps", "epsilon", "out", "seed", "overrides"}),
    "--help-config": frozenset({"help_config"}),
    # its own flags (--seeds, --parallel, ...) are the sweep parser's: mpper.tools.sweep
    "sweep": TRAINING_FLAGS - {"seed", "run_dir"},
}


SWEEP_INSTEAD = {"seed": "; a sweep takes --seeds N and --first-seed S", "run_dir": "; a sweep takes --sweep-dir"}


def mode_of(given: set[str]) -> str:
    """The mode the given flags (argparse dests) select, a key of :data:`MODE_FLAGS`."""
    for dest, mode in (("help_config", "--help-config"), ("evaluate", "--evaluate"), ("plot", "--plot"),
                       ("inspect", "--inspect"), ("collect", "--collect"), ("resume", "--resume"),
                       ("offline", "--offline")):  # fmt: skip
        if dest in given:
            return "--evaluate --on-snapshot" if mode == "--evaluate" and "on_snapshot" in given else mode
    return "training runs"


def foreign_flag(parser: argparse.ArgumentParser, given: list[str], mode: str) -> str | None:
    """The refusal of the first of ``given`` (dests, in command-line order) that ``mode``
    does not take, naming the modes that do take it; None when every one applies."""
    options = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    for dest in given:
        if dest not in MODE_FLAGS[mode]:
            modes = [m for m, flags in MODE_FLAGS.items() if dest in flags and m != mode]
            for kind in ("--resume", "--offline"):  # a resumed run and an offline run are training runs
                if "training runs" in modes and kind in modes:
                    modes.remove(kind)
            names = [f"{program_name()} sweep" if m == "sweep" else m for m in modes]
            where = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            instead = SWEEP_INSTEAD.get(dest, "") if mode == "sweep" else ""
            shown = f"{program_name()} sweep" if mode == "sweep" else mode
            return f"{options[dest]} does not apply to {shown} (it applies to {where}){instead}"
    return None


def given_flags(argv: list[str]) -> list[str]:
    """The dests of the flags ``argv`` names, in order: argparse defaults (``--episodes``
    10, ...) do not count, a flag the user typed does, even when it repeats the default."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    order: dict[str, int] = {}
    for arg in argv:
        for action in probe._actions:
            if arg.split("=", 1)[0] in action.option_strings:
                order.setdefault(action.dest, len(order))
    given = vars(probe.parse_args(argv))
    return sorted(given, key=lambda dest: order.get(dest, len(order)))


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, refuse one its mode does not take, and hand the mode its arguments
    (:data:`MODES`); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:
        return sweep_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        given = given_flags(argv)
    except _UsageError as e:
        return _fail(f"{e} (see --help)")
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    mode = mode_of(set(given))
    refusal = foreign_flag(parser, given, mode)
    if refusal:
        return _fail(refusal)
    return MODES[mode](args)


def _help_config(args: argparse.Namespace) -> int:
    print(describe_config())
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    """``--evaluate``: greedy episodes (:mod:`mpper.tools.evaluate`), or with
    ``--on-snapshot`` the checkpoint over a stored buffer (:mod:`mpper.tools.evaluate_snapshot`)."""
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        return _fail(f"--seed: expected an integer in [0, {MAX_SEED}], got {args.seed}")
    if args.episodes < 1:
        return _fail(f"--episodes: expected an integer >= 1, got {args.episodes}")
    if args.on_snapshot is not None:
        from .tools.evaluate_snapshot import evaluate_snapshot_main

        return evaluate_snapshot_main(args.evaluate, args.on_snapshot, args.checkpoint, args.overrides)
    render, render_format = None, "gif"
    if args.render is not None:
        render_format, render = args.render
        if render_format not in ("gif", "mp4"):
            return _fail(f"--render {render_format} {render}: unknown format {render_format!r}; expected: gif or mp4")
    from .tools.evaluate import evaluate_main

    return evaluate_main(args.evaluate, args.episodes, args.checkpoint, args.seed or 0, render, args.overrides,
                         render_format)  # fmt: skip


def _plot(args: argparse.Namespace) -> int:
    from .tools.plot import plot_main

    return plot_main(args.plot)


def _inspect(args: argparse.Namespace) -> int:
    from .tools.inspect_snapshot import inspect_main

    return inspect_main(args.inspect, args.json)


def _collect(args: argparse.Namespace) -> int:
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        return _fail(f"--seed: expected an integer in [0, {MAX_SEED}], got {args.seed}")
    from .tools.collect import collect_main

    return collect_main(args.collect, args.env_steps, args.epsilon, args.out, args.checkpoint, args.seed or 0,
                        args.overrides)  # fmt: skip


def _train(args: argparse.Namespace) -> int:
    """A training run, or ``--resume``: :func:`mpper.launch.launch` checks everything
    (the seed's range included) before it starts anything."""
    try:
        code, _ = launch(args.config, args.overrides, run_dir=args.run_dir, resume=args.resume, workers=args.workers,
                         device=args.device, seed=args.seed, training_steps=args.max_train_steps,
                         env_steps=args.env_steps, time_limit_s=args.time_limit,
                         ray_address=args.ray_address, offline=args.offline)  # fmt: skip
    except (ConfigError, LaunchError) as e:
        return _fail(str(e))
    return code


# What each mode (a key of MODE_FLAGS but sweep, which main hands its own argv) runs.
MODES: dict[str, Callable[[argparse.Namespace], int]] = {
    "training runs": _train,
    "--resume": _train,
    "--offline": _train,
    "--evaluate": _evaluate,
    "--evaluate --on-snapshot": _evaluate,
    "--plot": _plot,
    "--inspect": _inspect,
    "--collect": _collect,
    "--help-config": _help_config,
}


def build_sweep_parser() -> argparse.ArgumentParser:
    devices = section_specs(RuntimeConfig, "runtime")["device"].allowed
    p = _Parser(
        prog=f"{program_name()} sweep",
        allow_abbrev=False,  # --seed must not pass for --seeds
        description="Run several seeds of one config, each an ordinary run in its own process, and report the "
                    "interquartile mean and its 95 % bootstrap interval over the seeds of the final return and "
                    "of the time to runtime.solve_return; writes sweep.json, sweep.md and returns.png.",
    )  # fmt: skip
    p.add_argument("--config", metavar="PATH|NAME", required=True, help="JSON config file or shipped config name")
    p.add_argument("--seeds", type=int, default=5, metavar="N", help="how many seeds (5)")
    p.add_argument("--first-seed", type=int, default=0, metavar="S", help="the seeds are S, S+1, ... (0)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at a time (1: one after another)")
    p.add_argument("--sweep-dir", metavar="DIR", help="where seed-K/ and the report go "
                   "(default: runs/sweep/<config-name>/<timestamp>/)")  # fmt: skip
    p.add_argument("--workers", type=int, metavar="N", help="self-play processes of each run")
    p.add_argument("--device", choices=devices, help="learner device of each run")
    p.add_argument("--max-train-steps", type=int, metavar="N", help="stop each run after N training steps")
    p.add_argument("--env-steps", type=int, metavar="N", help="stop each run once N env steps are stored")
    p.add_argument("--time-limit", type=float, metavar="SECONDS", help="stop each run after this many seconds")
    p.add_argument("--ray", metavar="ADDRESS", dest="ray_address", help="each run's workers as Ray actors")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override one config key of every run (repeatable)")
    return p


def sweep_main(argv: list[str]) -> int:
    """``mpper sweep``: checks the flags and the config as a training run would (one line,
    exit 2, nothing started), then :func:`mpper.tools.sweep.run_sweep`."""
    parser = build_sweep_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except _UsageError as e:
        return _fail(f"sweep: {e} (see {program_name()} sweep --help)")
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    if unknown:
        main_parser = build_parser()
        dests = {o: a.dest for a in main_parser._actions for o in a.option_strings}
        dest = dests.get(unknown[0].split("=", 1)[0])
        unrecognized = f"sweep: unrecognized arguments: {' '.join(unknown)} (see {program_name()} sweep --help)"
        if dest is None or dest in ("help", "version"):
            return _fail(unrecognized)
        return _fail(foreign_flag(main_parser, [dest], "sweep") or unrecognized)
    if args.seeds < 1 or args.parallel < 1:
        flag, value = ("--seeds", args.seeds) if args.seeds < 1 else ("--parallel", args.parallel)
        return _fail(f"{flag}: expected an integer >= 1, got {value}")
    if not 0 <= args.first_seed <= MAX_SEED - args.seeds + 1:
        return _fail(f"--first-seed: the seeds must lie in [0, {MAX_SEED}], got {args.first_seed} "
                     f"to {args.first_seed + args.seeds - 1}")  # fmt: skip
    try:
        config_path = resolve_config(args.config)
        config = load_config(config_path, args.overrides, workers=args.workers, device=args.device,
                             training_steps=args.max_train_steps, env_steps=args.env_steps,
                             time_limit_s=args.time_limit, ray_address=args.ray_address)  # fmt: skip
    except (FileNotFoundError, ConfigError) as e:
        return _fail(str(e))
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.sweep_dir is None:
        sweep_dir = default_run_dir(config_path, root=Path("runs") / "sweep")
    else:
        sweep_dir = Path(args.sweep_dir)
        taken = [p.name for p in [sweep_dir / "sweep.json", *(sweep_dir / f"seed-{k}" for k in seeds)] if p.exists()]
        if sweep_dir.exists() and not sweep_dir.is_dir():
            return _fail(f"--sweep-dir {sweep_dir}: not a directory")
        if taken:
            return _fail(f"--sweep-dir {sweep_dir}: holds {taken[0]} from an earlier sweep; choose another directory")
    run_args = []
    passed = {"--workers": args.workers, "--device": args.device, "--max-train-steps": args.max_train_steps,
              "--env-steps": args.env_steps, "--time-limit": args.time_limit, "--ray": args.ray_address}  # fmt: skip
    for flag, value in passed.items():
        if value is not None:
            run_args += [flag, str(value)]
    for override in args.overrides:
        run_args += ["--set", override]
    from .tools.sweep import SweepPlan, run_sweep

    plan = SweepPlan(config=Path(config_path).resolve(), seeds=seeds, sweep_dir=sweep_dir, parallel=args.parallel,
                     run_args=run_args, solve_return=config.runtime.solve_return,
                     command=[program_name(), "sweep", *argv])  # fmt: skip
    return run_sweep(plan)


def console() -> None:
    """The ``mpper`` command (installed with the package): ``mpper --config cartpole
    --workers 8`` is ``python run.py --config configs/cartpole.json --workers 8``."""
    sys.exit(main())
