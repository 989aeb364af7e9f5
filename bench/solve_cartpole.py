"""Time to solve CartPole-v1 with `python run.py`, over seeds.

For each seed, runs the main job as a user would, until the mean return of the
evaluator's greedy episodes reaches the threshold (the config's ``solve_return``; the run
stops there), and reports, at the first evaluation that reached it, from the run's own
``metrics.jsonl``: wall seconds since the supervisor started (and since the launch of
``run.py``), the training step of the evaluated weights, env steps stored, and the CPU
seconds of the whole run (every process of its tree, sampled from /proc). Then the
median and quartiles over the seeds; a seed that did not solve counts as infinitely slow
in them.

The weights that passed are then played again, on ``--verify-episodes`` (100) new
greedy episodes (``run.py --evaluate RUN_DIR --checkpoint RUN_DIR/best.pt``; env ``k``
first reset with ``--verify-seed + k``, far from the seeds the runs' workers and
evaluator start from): a run evaluated often gets more chances to pass by luck, and this
says whether the policy it stopped at holds. Not counted in the run's time.

Usage::

    python bench/solve_cartpole.py                       # seeds 0-9, --workers 8
    python bench/solve_cartpole.py --seeds 0 1 2 --workers 8 --time-limit 300 --set muzero.priority_update=unrolled
    python bench/solve_cartpole.py --seeds 0 --verify-episodes 0   # no replay of the passing weights
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proctree  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def run_seed(seed: int, args) -> dict:
    run_dir = RESULTS / f"{args.tag}-seed{seed}"
    cmd = [sys.executable, "run.py", "--config", args.config, "--workers", str(args.workers), "--seed", str(seed),
           "--run-dir", str(run_dir), "--time-limit", str(args.time_limit), "--device", args.device]  # fmt: skip
    for override in args.set:
        cmd += ["--set", override]
    shutil.rmtree(run_dir, ignore_errors=True)
    proc, wall, cpu, launched = proctree.run_measured(cmd, ROOT)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    every = [r for r in records if r["event"] == "evaluation"]
    evals = [r for r in every if "mean_return" in r["evaluation"]]  # not those stopped early
    threshold = json.loads((run_dir / "config.json").read_text())["runtime"]["solve_return"]
    solved = next((r for r in evals if r["evaluation"]["mean_return"] >= threshold), None)
    out = {
        "seed": seed, "exit_code": proc.returncode, "wall_s_total": wall, "cpu_s": cpu,
        "solved": solved is not None, "threshold": threshold,
        "evaluations": len(every), "evaluations_stopped_early": len(every) - len(evals),
        "curve": [(r["time_s"], r["env_steps"], r["evaluation"]["training_step"], r["evaluation"]["mean_return"])
                  for r in evals],
    }  # fmt: skip
    if solved is None:  # keep what it said: a run that fails early says why on stderr
        out["stderr_tail"] = proc.stderr[-3000:]
        print(out["stderr_tail"], file=sys.stderr, flush=True)
    else:
        # The run stops at its first solving evaluation: the CPU of the whole run is the
        # CPU to the threshold plus start-up, the final checkpoint and snapshot.
        out |= {"wall_s": solved["time_s"], "launch_s": solved["unix_time"] - launched,
                "env_steps": solved["env_steps"], "training_step": solved["evaluation"]["training_step"]}  # fmt: skip
        if args.verify_episodes:
            out["verify"] = verify(run_dir, args)
            if out["verify"]["training_step"] != out["training_step"]:
                raise RuntimeError(f"{run_dir}/best.pt holds training step {out['verify']['training_step']}, "
                                   f"the passing evaluation {out['training_step']}")  # fmt: skip
    return out


def verify(run_dir: Path, args) -> dict:
    """The run's passing weights (``best.pt``: the run stops at its first evaluation at
    the threshold, so the best is that one) played on ``args.verify_episodes`` new greedy
    episodes: ``{"episodes", "seed", "training_step", "mean_return", "min_return"}``."""
    cmd = [sys.executable, "run.py", "--evaluate", str(run_dir), "--checkpoint", str(run_dir / "best.pt"),
           "--episodes", str(args.verify_episodes), "--seed", str(args.verify_seed)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    stats = json.loads((run_dir / "evaluation.json").read_text())
    return {"episodes": stats["episodes"], "seed": stats["seed"], "training_step": stats["training_step"],
            "mean_return": stats["return"]["mean"], "min_return": stats["return"]["min"]}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) in which an unsolved run
    (inf) sorts last and any interpolation towards it is inf."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi, frac = min(lo + 1, len(v) - 1), pos - lo
    if frac == 0 or math.isinf(v[lo]):
        return v[lo]
    return math.inf if math.isinf(v[hi]) else v[lo] + (v[hi] - v[lo]) * frac


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(25th, 50th, 75th percentile)."""
    return percentile(values, 0.25), percentile(values, 0.5), percentile(values, 0.75)


def fmt(x: float, digits: int = 0) -> str:
    return "unsolved" if math.isinf(x) else f"{x:,.{digits}f}"


def report(results: list[dict], command: str) -> str:
    verified = [r["verify"] for r in results if "verify" in r]
    replay = f"passing weights, {verified[0]['episodes']} new episodes: mean (min)" if verified else None
    lines = [f"# CartPole-v1 time to solve: `{command}` ({time.strftime('%Y-%m-%d')})", "",
             "| seed | solved | wall s | from launch s | training step | env steps | CPU s (whole run) |"
             + (f" {replay} |" if replay else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if replay else "")]  # fmt: skip
    for r in results:
        if r["solved"]:
            line = (f"| {r['seed']} | yes | {r['wall_s']:.1f} | {r['launch_s']:.1f} | {r['training_step']:,} "
                    f"| {r['env_steps']:,} | {r['cpu_s']:.0f} |")  # fmt: skip
            if "verify" in r:
                line += f" {r['verify']['mean_return']:.1f} ({r['verify']['min_return']:.0f}) |"
        else:
            line = (f"| {r['seed']} | no (exit {r['exit_code']}, {r['wall_s_total']:.0f} s) | - | - | - | - "
                    f"| {r['cpu_s']:.0f} |" + (" - |" if replay else ""))  # fmt: skip
        lines.append(line)
    solved = sum(r["solved"] for r in results)
    lines += [""]
    if verified:
        held = sum(r["verify"]["mean_return"] >= r["threshold"] for r in results if "verify" in r)
        lines += [f"the passing weights kept a mean >= the threshold on {verified[0]['episodes']} new episodes "
                  f"in {held} of {len(verified)} solved runs", ""]  # fmt: skip
    lines += [f"solved {solved}/{len(results)}; quartiles over all seeds (unsolved = infinite):", "",
              "| measure | 25 % | median | 75 % | slowest |", "|---|---|---|---|---|"]  # fmt: skip
    for key, label in (("wall_s", "wall s"), ("launch_s", "from launch s"), ("training_step", "training steps"),
                       ("env_steps", "env steps")):  # fmt: skip
        values = [r[key] if r["solved"] else math.inf for r in results]
        q1, q2, q3 = quartiles(values)
        lines.append(f"| {label} | {fmt(q1, 1)} | {fmt(q2, 1)} | {fmt(q3, 1)} | {fmt(max(values), 1)} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        if not r["curve"]:
            continue
        t, _, steps, ret = zip(*r["curve"])
        axes[0].plot(t, ret, marker="o", ms=2, lw=1, label=f"seed {r['seed']}")
        axes[1].plot(steps, ret, marker="o", ms=2, lw=1)
    for ax, xlabel in zip(axes, ("wall time (s)", "training step")):
        ax.axhline(results[0]["threshold"], color="grey", ls="--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean greedy return (10 episodes)")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cartpole.json")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"], help="run.py --device")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed on to run.py")
    ap.add_argument("--tag", default="cartpole", help="name of the run directories and result files")
    ap.add_argument(
        "--verify-episodes",
        type=int,
        default=100,
        metavar="N",
        help="play the passing weights on N new greedy episodes after a solved run (0: skip)",
    )
    ap.add_argument(
        "--verify-seed", type=int, default=50_000_000, metavar="S", help="env reset seeds S, S+1, ... of those episodes"
    )
    args = ap.parse_args()
    command = "python bench/solve_cartpole.py " + " ".join(sys.argv[1:])
    results = []
    for seed in args.seeds:
        print(f"seed {seed} ...", file=sys.stderr, flush=True)
        results.append(run_seed(seed, args))
    text = report(results, command)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.tag}_solve.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    (RESULTS / f"{args.tag}_solve.md").write_text(text + "\n")
    png = RESULTS / f"{args.tag}_solve.png"
    try:
        plot(results, png, f"mpper MuZero on CartPole-v1, --workers {args.workers}, {args.config}")
        print(f"\nreturn curves: {png}")
    except ImportError:
        print("\nmatplotlib is not installed: no PNG (pip install -e '.[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
