"""Sampled MuZero on Pendulum-v1 to a mean greedy return of -200: mpper beside LightZero, seed by seed.

LightZero (``lightzero==0.2.0`` from PyPI, in its own virtualenv named by ``--lz-python``)
runs its shipped Sampled EfficientZero config for continuous Pendulum,
``zoo/classic_control/pendulum/config/pendulum_cont_sampled_efficientzero_config.py``
(K = 20 sampled actions, 50 simulations, 8 collector envs and 8 episodes per collect,
replay ratio 0.25, i.e. one update of batch 256 per 4 collected transitions, AdamW at 1e-4
with a cosine schedule, an evaluation every 2,000 updates, an env-step budget of 1e6),
changed only to run on the CPU (``policy.cuda = False``), to write under this benchmark's
results, and to stop at -200: the config sets no ``env.stop_value`` (DI-engine's default is
1e10, never reached), and LightZero's evaluator stops training at its first evaluation
after the first update whose mean reaches ``stop_value``. It is trained through
``lzero.entry.train_muzero`` with the config's own create-config: its ``pendulum_lightzero``
env (gymnasium's Pendulum-v1, 200-step episodes, the policy's tanh-squashed actions in
[-1, 1] scaled to the env's [-2, 2]) in subprocess env managers. (The config's ``__main__``
calls ``train_muzero_with_gym_env`` instead, which ignores that env and wraps old gym's
Pendulum-v1 without scaling the actions: at most half the torque.) ``train_muzero(seed=S)``
runs in a child process whose every evaluation (the ``evaluator_step/reward_mean`` scalar
it logs, with the collector's env steps) is recorded with the time since ``train_muzero``
was called (its env subprocesses' start-up in, its imports not). Its main process, where
the search and the updates run, has ``--lz-threads`` torch threads (default 1, as each of
mpper's processes has, ``runtime.torch_threads``; 0 leaves torch's default of one per core):
on a 2-core machine whose other core is busy, two threads stall each other and
LightZero runs many times slower than on one.

How each side's return is measured:

- LightZero: the mean return of ``evaluator_env_num`` = 3 greedy episodes (its eval mode,
  argmax of the root's visits), one per evaluator env, seeded ``S``, ``S+1`` and ``S+2``
  without dynamic seeds: every evaluation of a run plays the same three start states.
- mpper: the mean return of ``runtime.evaluation_episodes`` (10 in
  ``configs/pendulum_sampled.json``) greedy episodes, each evaluation round on new seeds;
  ``runtime.solve_return=-200`` stops the run at its first evaluation whose mean reaches it.
  Its time is counted from the supervisor's start (its child processes' start-up in).

A run that does not reach -200 within ``--time-limit`` seconds is reported as not reaching
it, with its best evaluation. The results (every evaluation of every run) go to
``bench/results/<tag>.json``, a Markdown table with the ratios mpper / LightZero to stdout.

Usage::

    python bench/lightzero_pendulum.py --lz-python /work/peers/lz-venv/bin/python --seeds 0 1 2 3 4 \\
        [--workers 2] [--config configs/pendulum_sampled.json] [--set KEY=VALUE ...] [--time-limit 3600]
    python bench/lightzero_pendulum.py --lz-results bench/results/lightzero_pendulum.json --seeds 0 1 2 3 4 \\
        --set sampled_mcts.num_simulations=16 --tag fewer_sims     # an mpper variant beside the same LightZero runs
    python bench/lightzero_pendulum.py --lz-python /work/peers/lz-venv/bin/python --seeds 0 --time-limit 90 \\
        --lz-eval-freq 100 --tag smoke                            # a smoke run: LightZero evaluates every 100 updates
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from peer_runs import (
    LIGHTZERO,
    RESULTS,
    earlier_runs,
    fresh_dir,
    read_json,
    record_lightzero_evaluations,
    run_child,
    run_mpper,
    solve_report,
    to_return,
)

STOP = -200.0


def lz_child(seed: int, out: Path, eval_freq: int | None, threads: int) -> None:
    """In LightZero's venv: train its shipped config, changed as the module's docstring says."""
    import torch
    from lzero.entry import train_muzero
    from zoo.classic_control.pendulum.config import pendulum_cont_sampled_efficientzero_config as shipped

    main_config, create_config = shipped.main_config, shipped.create_config
    main_config.policy.cuda = False
    main_config.exp_name = "lz"  # LightZero writes under "./{exp_name}": the child runs in ``out``
    main_config.env.stop_value = STOP
    if eval_freq is not None:
        main_config.policy.eval_freq = eval_freq
    if threads:
        torch.set_num_threads(threads)
    record_lightzero_evaluations(out)
    t0 = time.monotonic()
    train_muzero([main_config, create_config], seed=seed, model_path=main_config.policy.model_path,
                 max_env_step=shipped.max_env_step)  # fmt: skip
    (out / "done.json").write_text(json.dumps({"time_s": time.monotonic() - t0}))


def run_lightzero(seed: int, python: str, time_limit: float, eval_freq: int | None, threads: int) -> dict:
    out = fresh_dir(RESULTS / f"lightzero-pendulum-seed{seed}")
    args = ["--lz-child", str(seed), "--out", str(out), *(["--lz-eval-freq", str(eval_freq)] if eval_freq else []),
            "--lz-threads", str(threads)]  # fmt: skip
    wall = run_child(python, str(Path(__file__).resolve()), args, out, time_limit)
    evals = read_json(out / "evals.json", [])
    ended = "stop value or env-step budget" if (out / "done.json").exists() else "time limit (or crash: its log.txt)"
    # LightZero's stop needs an update first: its evaluation of the untrained network does not count
    untrained = next((e for e in evals if e["training_steps"] == 0), None)
    return to_return({"system": LIGHTZERO, "seed": seed, "curve": [e for e in evals if e["training_steps"] != 0],
                      "untrained_evaluation": untrained, "wall_s_total": wall, "ended": ended}, STOP)  # fmt: skip


def run_mpper_side(seed: int, args) -> dict:
    sets = [f"runtime.solve_return={STOP}", *args.overrides]
    run = run_mpper(RESULTS / f"mpper-pendulum-seed{seed}", args.config, seed, args.time_limit, args.workers, sets)
    return to_return({"system": "mpper" + (f" --workers {args.workers}" if args.workers else ""), "seed": seed,
                      "wall_s_total": run["end"]["time_s"], **run}, STOP)  # fmt: skip


def report(results: list[dict], args) -> None:
    sets = f" --config {args.config}" + "".join(f" --set {o}" for o in args.overrides)
    sets += f" --workers {args.workers}" if args.workers else ""
    sets += f" --lz-results {args.lz_results}" if args.lz_results else ""
    if args.lz_python and not args.lz_results:
        sets += f" --lz-threads {args.lz_threads}" + (
            f" --lz-eval-freq {args.lz_eval_freq}" if args.lz_eval_freq else ""
        )
    seeds = " ".join(str(s) for s in sorted({r["seed"] for r in results}))
    print(f"# Pendulum-v1 to a mean greedy return of {STOP:g}: `python bench/lightzero_pendulum.py --seeds {seeds}"
          f"{sets} --time-limit {args.time_limit:g}` ({time.strftime('%Y-%m-%d')})\n")  # fmt: skip
    print("\n".join(solve_report(results, STOP)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--lz-python", default=None, help="the Python of LightZero's virtualenv (none: mpper only)")
    ap.add_argument(
        "--lz-results",
        default=None,
        metavar="JSON",
        help="instead of running LightZero, take its runs of these seeds from an earlier results JSON",
    )
    ap.add_argument(
        "--lz-eval-freq",
        type=int,
        default=None,
        metavar="UPDATES",
        help="LightZero: evaluate every UPDATES updates instead of its config's 2,000 (for a smoke run)",
    )
    ap.add_argument(
        "--lz-threads",
        type=int,
        default=1,
        help="LightZero: torch threads of its main process (0: torch's default, the machine's cores)",
    )
    ap.add_argument("--no-mpper", action="store_true", help="run LightZero only")
    ap.add_argument("--tag", default="lightzero_pendulum", help="name of the results JSON under bench/results")
    ap.add_argument("--config", default="configs/pendulum_sampled.json")
    ap.add_argument("--workers", type=int, default=None, help="mpper's self-play processes (default: the config's)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="mpper: a config override (repeatable)",
    )
    ap.add_argument("--time-limit", type=float, default=3600.0, help="seconds per run, each side")
    ap.add_argument("--lz-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lz_child is not None:
        lz_child(args.lz_child, Path(args.out), args.lz_eval_freq, args.lz_threads)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = earlier_runs(args.lz_results, LIGHTZERO, args.seeds)
    out = RESULTS / f"{args.tag}.json"
    for seed in args.seeds:
        if args.lz_python and not args.lz_results:
            print(f"seed {seed}: LightZero ...", file=sys.stderr, flush=True)
            results.append(run_lightzero(seed, args.lz_python, args.time_limit, args.lz_eval_freq, args.lz_threads))
            out.write_text(json.dumps(results, indent=1))
        if not args.no_mpper:
            print(f"seed {seed}: mpper ...", file=sys.stderr, flush=True)
            results.append(run_mpper_side(seed, args))
            out.write_text(json.dumps(results, indent=1))
    report(results, args)
    print(f"\n(every evaluation of every run: {out.relative_to(RESULTS.parents[1])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
