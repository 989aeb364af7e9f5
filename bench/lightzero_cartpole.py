"""MuZero on CartPole-v0 to a mean return of 200: mpper beside LightZero, seed by seed.

LightZero (``lightzero==0.2.0`` from PyPI, in its own virtualenv named by
``--lz-python``) runs unmodified with its shipped
``zoo/classic_control/cartpole/config/cartpole_muzero_config.py`` (8 collector envs,
8 episodes per collect, 100 updates of batch 256 per collect, 25 simulations, Adam at 0.003,
the self-supervised consistency loss at weight 2, an evaluation of 3 episodes every 100
updates; it stops at its first evaluation with a mean >= 200), changed only to run on the
CPU (``policy.cuda = False``) and to write under this benchmark's results. Its
``train_muzero(seed=S)`` is called in a child process whose every evaluation (the
``evaluator_step/reward_mean`` scalar it logs, with the collector's env steps) is recorded
with the time since ``train_muzero`` was called.

mpper runs ``--config`` (default ``configs/cartpole_v0.json``: ``configs/cartpole.json`` on
``CartPole-v0`` with LightZero's stopping rule, a mean of 200 over 3 greedy episodes, evaluated
every 5 s, and 192 samples per inserted position instead of 64, muzero-general's 1.5 training
steps of batch 128 per move) with ``env.id=CartPole-v0`` and ``runtime.solve_return=200``:
it stops at its first evaluation with a mean of 200 over its ``runtime.evaluation_episodes``
greedy episodes. Its time is counted from the supervisor's start (its own child
processes' start-up in); LightZero's from the call of ``train_muzero`` (its env
subprocesses' start-up in, its imports not).

Usage::

    python bench/lightzero_cartpole.py --lz-python /path/to/lz-venv/bin/python --seeds 0 1 2 3 4 \\
        [--workers 8] [--set KEY=VALUE ...] [--time-limit 900] [--tag NAME]
    python bench/lightzero_cartpole.py --lz-results bench/results/lightzero_cartpole.json --seeds 0 1 2 3 4 \\
        --config configs/cartpole.json --tag own_rule     # an mpper variant beside the same LightZero runs
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

STOP = 200.0


# ---- LightZero (in a child process of its own virtualenv) ---------------------------------


def lz_child(seed: int, out: Path) -> None:
    from lzero.entry import train_muzero
    from zoo.classic_control.cartpole.config.cartpole_muzero_config import create_config, main_config

    main_config.policy.cuda = False
    main_config.exp_name = "lz"  # LightZero writes under "./{exp_name}": the child runs in ``out``
    record_lightzero_evaluations(out)
    t0 = time.monotonic()
    train_muzero([main_config, create_config], seed=seed, max_env_step=int(1e5))
    (out / "done.json").write_text(json.dumps({"time_s": time.monotonic() - t0}))


def run_lightzero(seed: int, python: str, time_limit: float) -> dict:
    out = fresh_dir(RESULTS / f"lightzero-cartpole-seed{seed}")
    wall = run_child(python, str(Path(__file__).resolve()), ["--lz-child", str(seed), "--out", str(out)], out,
                     time_limit)  # fmt: skip
    result = {"system": LIGHTZERO, "seed": seed, "curve": read_json(out / "evals.json", []), "wall_s_total": wall}
    return to_return(result, STOP)


# ---- mpper ----------------------------------------------------------------------------------


def run_mpper_side(seed: int, config: str, workers: int, overrides, time_limit: float) -> dict:
    sets = ["env.id=CartPole-v0", f"runtime.solve_return={STOP}", *overrides]
    run = run_mpper(RESULTS / f"mpper-cartpole-v0-seed{seed}", config, seed, time_limit, workers, sets)
    return to_return({"system": f"mpper --workers {workers}", "seed": seed, **run}, STOP)


def report(results: list[dict], args) -> None:
    sets = f" --config {args.config}" + "".join(f" --set {o}" for o in args.overrides)
    sets += f" --lz-results {args.lz_results}" if args.lz_results else ""
    seeds = " ".join(str(s) for s in sorted({r["seed"] for r in results}))
    print(f"# CartPole-v0 to a mean of {STOP:g}: `python bench/lightzero_cartpole.py --seeds {seeds} --workers "
          f"{args.workers}{sets}` ({time.strftime('%Y-%m-%d')})\n")  # fmt: skip
    print("\n".join(solve_report(results, STOP)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--lz-python", default=None, help="the Python of LightZero's virtualenv (none: mpper only)")
    ap.add_argument("--lz-results", default=None, metavar="JSON",
                    help="instead of running LightZero, take its runs of these seeds from an earlier results JSON "
                         "(to run an mpper variant beside the same LightZero runs)")  # fmt: skip
    ap.add_argument("--tag", default="lightzero_cartpole", help="name of the results JSON under bench/results")
    ap.add_argument("--config", default="configs/cartpole_v0.json")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="mpper: a config override (repeatable)")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--lz-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lz_child is not None:
        lz_child(args.lz_child, Path(args.out))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = earlier_runs(args.lz_results, LIGHTZERO, args.seeds)
    out = RESULTS / f"{args.tag}.json"
    for seed in args.seeds:
        if args.lz_python and not args.lz_results:
            print(f"seed {seed}: LightZero ...", file=sys.stderr, flush=True)
            results.append(run_lightzero(seed, args.lz_python, args.time_limit))
        print(f"seed {seed}: mpper ...", file=sys.stderr, flush=True)
        results.append(run_mpper_side(seed, args.config, args.workers, args.overrides, args.time_limit))
        out.write_text(json.dumps(results, indent=1))
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
