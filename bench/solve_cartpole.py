"""Time to solve CartPole-v1 with `python run.py` (issue 3, section 6).

For each seed, runs the main job as a user would, until the mean return of the
evaluator's greedy episodes reaches the threshold (the config's ``solve_return``), and
reports wall seconds, CPU seconds (the run's processes, all of them) and env steps at
the first evaluation that reached it, from the run's own ``metrics.jsonl``.

Usage::

    python bench/solve_cartpole.py                       # 3 seeds, --workers 8
    python bench/solve_cartpole.py --seeds 0 1 2 --workers 8 --time-limit 300 --png bench/results/cartpole.png
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_seed(seed: int, args) -> dict:
    run_dir = ROOT / "bench" / "results" / f"cartpole-seed{seed}"
    cmd = [sys.executable, "run.py", "--config", args.config, "--workers", str(args.workers), "--seed", str(seed),
           "--run-dir", str(run_dir), "--time-limit", str(args.time_limit), "--device", "cpu"]  # fmt: skip
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cpu_before = cpu_seconds_of_children()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    cpu = cpu_seconds_of_children() - cpu_before
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = [r for r in records if r["event"] == "evaluation"]
    threshold = json.loads((run_dir / "config.json").read_text())["runtime"]["solve_return"]
    solved = next((r for r in evals if r["evaluation"]["mean_return"] >= threshold), None)
    out = {
        "seed": seed, "exit_code": proc.returncode, "wall_s_total": wall, "cpu_s_total": cpu,
        "solved": solved is not None, "threshold": threshold,
        "curve": [(r["time_s"], r["env_steps"], r["evaluation"]["mean_return"]) for r in evals],
    }  # fmt: skip
    if solved is not None:
        # CPU to threshold: the run stops at the first solving evaluation, so the whole
        # run's CPU is the CPU to threshold (plus start-up and the final snapshot)
        out |= {"wall_s": solved["time_s"], "env_steps": solved["env_steps"],
                "training_step": solved["evaluation"]["training_step"], "cpu_s": cpu}  # fmt: skip
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        t, _, ret = zip(*r["curve"]) if r["curve"] else ((), (), ())
        ax.plot(t, ret, marker="o", ms=3, label=f"seed {r['seed']}")
    ax.axhline(results[0]["threshold"], color="grey", ls="--", lw=1, label="solve threshold")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("mean greedy return (10 episodes)")
    ax.set_title("mpper MuZero on CartPole-v1, --workers 8, 2 cores")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cartpole.json")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--png", default=str(ROOT / "bench" / "results" / "cartpole_solve.png"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cartpole_solve.json"))
    args = ap.parse_args()
    results = []
    for seed in args.seeds:
        print(f"seed {seed} ...", file=sys.stderr, flush=True)
        results.append(run_seed(seed, args))
    print(f"# CartPole-v1 time to solve: `python bench/solve_cartpole.py --seeds {' '.join(map(str, args.seeds))} "
          f"--workers {args.workers}`\n")
    print("| seed | solved | wall s to threshold | CPU s (whole run) | env steps | training step |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r["solved"]:
            print(f"| {r['seed']} | yes | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['env_steps']:,} | {r['training_step']:,} |")
        else:
            print(f"| {r['seed']} | no (exit {r['exit_code']}, {r['wall_s_total']:.0f} s) | - | {r['cpu_s_total']:.0f} | - | - |")
    solved = [r["wall_s"] for r in results if r["solved"]]
    if solved:
        print(f"\nsolved {len(solved)}/{len(results)}; median wall time to threshold {statistics.median(solved):.0f} s")
    Path(args.out).write_text(json.dumps(results, indent=1))
    try:
        plot(results, Path(args.png))
        print(f"return curve: {args.png}")
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
