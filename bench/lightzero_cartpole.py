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
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
STOP = 200.0


# ---- LightZero (in a child process of its own virtualenv) ---------------------------------


def lz_child(seed: int, out: Path) -> None:
    import tensorboardX
    from lzero.entry import train_muzero
    from zoo.classic_control.cartpole.config.cartpole_muzero_config import create_config, main_config

    main_config.policy.cuda = False
    main_config.exp_name = "lz"  # LightZero writes under "./{exp_name}": the child runs in ``out``
    evals: list[dict] = []
    add_scalar = tensorboardX.SummaryWriter.add_scalar
    t0 = time.monotonic()

    def recording_add_scalar(self, tag, value, global_step=None, *args, **kwargs):
        if tag == "evaluator_step/reward_mean":
            evals.append({"time_s": time.monotonic() - t0, "env_steps": int(global_step), "mean_return": float(value)})
            (out / "evals.json").write_text(json.dumps(evals))
        return add_scalar(self, tag, value, global_step, *args, **kwargs)

    tensorboardX.SummaryWriter.add_scalar = recording_add_scalar
    train_muzero([main_config, create_config], seed=seed, max_env_step=int(1e5))
    (out / "done.json").write_text(json.dumps({"time_s": time.monotonic() - t0}))


def run_lightzero(seed: int, python: str, time_limit: float) -> dict:
    out = RESULTS / f"lightzero-cartpole-seed{seed}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    launched = time.time()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--lz-child", str(seed), "--out", str(out)],
                                cwd=out, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=time_limit)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:  # its env subprocesses share its process group: end them all
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    evals = json.loads((out / "evals.json").read_text()) if (out / "evals.json").exists() else []
    solved = next((e for e in evals if e["mean_return"] >= STOP), None)
    result = {"system": "LightZero 0.2.0", "seed": seed, "solved": solved is not None, "curve": evals,
              "wall_s_total": time.time() - launched}  # fmt: skip
    if solved:
        result |= {"wall_s": solved["time_s"], "env_steps": solved["env_steps"]}
    return result


# ---- mpper ----------------------------------------------------------------------------------


def run_mpper(seed: int, config: str, workers: int, overrides, time_limit: float) -> dict:
    run_dir = RESULTS / f"mpper-cartpole-v0-seed{seed}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = [sys.executable, "run.py", "--config", config, "--workers", str(workers), "--seed", str(seed),
           "--run-dir", str(run_dir), "--time-limit", str(time_limit), "--device", "cpu",
           "--set", "env.id=CartPole-v0", "--set", f"runtime.solve_return={STOP}",
           *(a for o in overrides for a in ("--set", o))]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = [r for r in records if r["event"] == "evaluation" and "mean_return" in r["evaluation"]]  # not stopped early
    solved = next((r for r in evals if r["evaluation"]["mean_return"] >= STOP), None)
    result = {"system": f"mpper --workers {workers}", "seed": seed, "solved": solved is not None,
              "curve": [{"time_s": r["time_s"], "env_steps": r["env_steps"],
                         "mean_return": r["evaluation"]["mean_return"]} for r in evals]}  # fmt: skip
    if solved:
        result |= {"wall_s": solved["time_s"], "env_steps": solved["env_steps"],
                   "training_steps": solved["evaluation"]["training_step"]}  # fmt: skip
    return result


def median_or_inf(values: list[float]) -> float:
    return statistics.median(values) if values else float("inf")


def report(results: list[dict], args) -> None:
    sets = f" --config {args.config}" + "".join(f" --set {o}" for o in args.overrides)
    sets += f" --lz-results {args.lz_results}" if args.lz_results else ""
    seeds = " ".join(str(s) for s in sorted({r["seed"] for r in results}))
    print(f"# CartPole-v0 to a mean of {STOP:g}: `python bench/lightzero_cartpole.py --seeds {seeds} --workers "
          f"{args.workers}{sets}` ({time.strftime('%Y-%m-%d')})\n")
    print("| seed | system | solved | wall s | env steps |")
    print("|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["seed"], r["system"])):
        cells = f"{r['wall_s']:.1f} | {r['env_steps']:,}" if r["solved"] else "- | -"
        print(f"| {r['seed']} | {r['system']} | {'yes' if r['solved'] else 'no'} | {cells} |")
    print("\nMedians (a run that did not solve counts as infinite):\n")
    medians = {}
    for system in dict.fromkeys(r["system"] for r in results):
        rs = [r for r in results if r["system"] == system]
        inf = float("inf")
        wall = median_or_inf([r["wall_s"] if r["solved"] else inf for r in rs])
        steps = median_or_inf([r["env_steps"] if r["solved"] else inf for r in rs])
        medians[system] = (wall, steps)
        print(f"- {system}: {sum(r['solved'] for r in rs)}/{len(rs)} solved, median wall {wall:.1f} s, "
              f"median env steps {steps:,.0f}")
    lz = medians.get("LightZero 0.2.0")
    for system, (wall, steps) in medians.items():
        if lz and system != "LightZero 0.2.0":
            print(f"\n{system} against LightZero: env steps {steps / lz[1]:.2f}x, wall time {wall / lz[0]:.3f}x")


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
    earlier = json.loads(Path(args.lz_results).read_text()) if args.lz_results else []
    results = [r for r in earlier if r["system"] == "LightZero 0.2.0" and r["seed"] in args.seeds]
    missing = sorted(set(args.seeds) - {r["seed"] for r in results})
    if args.lz_results and missing:
        raise SystemExit(f"{args.lz_results}: no LightZero run of seeds {missing}")
    out = RESULTS / f"{args.tag}.json"
    for seed in args.seeds:
        if args.lz_python and not args.lz_results:
            print(f"seed {seed}: LightZero ...", file=sys.stderr, flush=True)
            results.append(run_lightzero(seed, args.lz_python, args.time_limit))
        print(f"seed {seed}: mpper ...", file=sys.stderr, flush=True)
        results.append(run_mpper(seed, args.config, args.workers, args.overrides, args.time_limit))
        out.write_text(json.dumps(results, indent=1))
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
