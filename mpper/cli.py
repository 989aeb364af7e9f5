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
``--resume``), or one that cannot be created or written is refused. (The forkserver that
children are forked from boots as soon as the config is checked, beside the supervisor's
own imports; it does nothing until a child is asked for and exits with this process.)
"""

from __future__ import annotations

import argparse
import sys

from .algos.configs import describe_config
from .config import MAX_SEED, ConfigError, RuntimeConfig, section_specs
from .launch import LaunchError, default_run_dir, launch, resolve_config, shipped_configs

__all__ = ["build_parser", "console", "default_run_dir", "main", "resolve_config", "shipped_configs"]

EXIT_USAGE = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so that every mistake
    is reported as the same single line."""

    def error(self, message: str):
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    devices = section_specs(RuntimeConfig, "runtime")["device"].allowed
    p = _Parser(
        prog="run.py",
        description=(
            "Train MuZero (or DQN) with N self-play processes, a learner and a reanalyser that "
            "share one replay buffer in shared memory."
        ),
        epilog=(
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
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="stop cleanly after this many seconds (overrides runtime.time_limit_s)")
    p.add_argument("--ray", metavar="ADDRESS", dest="ray_address",
                   help='run the self-play workers as Ray actors in the cluster at ADDRESS ("host:port" of its head, '
                        'or "auto"; overrides runtime.ray_address); the buffer, learner, reanalyser and evaluator '
                        "stay on this machine (needs the ray extra: pip install -e .[ray])")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its checkpoint and buffer snapshot")
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
                        "and write it to PATH; FORMAT: gif (needs the render extra: pip install -e .[render])")
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
    p.add_argument("--help-config", action="store_true",
                   help="print every config key with its type, default, allowed values and meaning, and exit")
    return p


def _fail(message: str) -> int:
    print("error: " + " ".join(str(message).splitlines()), file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        return _fail(f"{e} (see --help)")
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    if args.help_config:
        print(describe_config())
        return 0
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        return _fail(f"--seed: expected an integer in [0, {MAX_SEED}], got {args.seed}")
    if args.evaluate is None:
        for flag, value in (("--render", args.render), ("--on-snapshot", args.on_snapshot)):
            if value is not None:
                return _fail(f"{flag} needs --evaluate RUN_DIR (see --help)")
    if args.evaluate is not None:
        if args.episodes < 1:
            return _fail(f"--episodes: expected an integer >= 1, got {args.episodes}")
        if args.on_snapshot is not None:
            if args.render is not None:
                return _fail("--render and --on-snapshot: choose one (--on-snapshot plays no episode to render)")
            from .tools.evaluate_snapshot import evaluate_snapshot_main

            return evaluate_snapshot_main(args.evaluate, args.on_snapshot, args.checkpoint, args.overrides)
        render = None
        if args.render is not None:
            fmt, render = args.render
            if fmt != "gif":
                return _fail(f"--render {fmt} {render}: unknown format {fmt!r}; expected: gif")
        from .tools.evaluate import evaluate_main

        return evaluate_main(args.evaluate, args.episodes, args.checkpoint, args.seed or 0, render, args.overrides)
    if args.plot is not None:
        from .tools.plot import plot_main

        return plot_main(args.plot)
    if args.inspect is not None:
        from .tools.inspect_snapshot import inspect_main

        return inspect_main(args.inspect, args.json)

    try:
        code, _ = launch(args.config, args.overrides, run_dir=args.run_dir, resume=args.resume, workers=args.workers,
                         device=args.device, seed=args.seed, training_steps=args.max_train_steps,
                         time_limit_s=args.time_limit, ray_address=args.ray_address)  # fmt: skip
    except (ConfigError, LaunchError) as e:
        return _fail(str(e))
    return code


def console() -> None:
    """The ``mpper`` command (installed with the package): ``mpper --config cartpole
    --workers 8`` is ``python run.py --config configs/cartpole.json --workers 8``."""
    sys.exit(main())
