"""Whether a solve holds: train past the first solve and judge every later evaluation and
the final weights.

For each seed, runs ``python run.py`` as a user would, but with ``runtime.solve_return``
off so that the run does not stop at its first solve. The solve rule is applied here, to
the run's own ``metrics.jsonl``: the first evaluation whose mean greedy return reached
``--target`` (475 for CartPole-v1) is the first solve. The run is then stopped (SIGINT:
a clean stop, with its final checkpoint) once an evaluation of weights at least
``--past-solve`` training steps after the solving weights is recorded. Per seed:

- the share of the evaluations after the first solve whose mean reached the target;
- the worst such evaluation;
- the final weights (``checkpoint.pt``, the learner's state at the stop) played on
  ``--final-episodes`` (100) new greedy episodes (env ``k`` first reset with
  ``--final-seed + k``), and the training step they hold.

A seed "holds" when at least ``--hold-share`` (0.9) of its later evaluations reached the
target and its final weights' mean over the new episodes did too.

Usage::

    python bench/holds.py --seeds 0 1 2 3 4 5 6 7 8 9                  # configs/cartpole.json, pUCT
    python bench/holds.py --config configs/cartpole_gumbel.json --tag gumbel
    python bench/holds.py --config configs/cartpole_dqn.json --workers 2 --tag dqn
    python bench/holds.py --set runtime.lockstep=true --tag lockstep   # the seed decides the run:
        # an evaluation every runtime.evaluation_interval_steps, whatever the machine's speed
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def evaluations(metrics: Path) -> list[dict]:
    """The evaluation records written so far that played every episode: (time_s,
    training_step, mean_return), in order. A partly written last line is left for later."""
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        if '"evaluation"' not in line:  # a lockstep run writes a line per training step too
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        ev = record.get("evaluation") or {}
        if record.get("event") == "evaluation" and "mean_return" in ev:
            out.append({"time_s": record["time_s"], "training_step": ev["training_step"],
                        "mean_return": ev["mean_return"]})  # fmt: skip
    return out


def run_seed(seed: int, args) -> dict:
    run_dir = RESULTS / f"holds-{args.tag}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "run.py", "--config", args.config, "--workers", str(args.workers), "--seed", str(seed),
           "--run-dir", str(run_dir), "--time-limit", str(args.time_limit), "--device", "cpu",
           "--set", "runtime.solve_return=null", "--max-train-steps", str(args.max_train_steps)]  # fmt: skip
    for override in args.set:
        cmd += ["--set", override]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    solve, stopped_by_bench = None, False
    while proc.poll() is None:
        time.sleep(0.5)
        evals = evaluations(run_dir / "metrics.jsonl")
        solve = solve or next((e for e in evals if e["mean_return"] >= args.target), None)
        if solve and evals[-1]["training_step"] >= solve["training_step"] + args.past_solve and not stopped_by_bench:
            proc.send_signal(signal.SIGINT)  # a clean stop: final checkpoint and snapshot
            stopped_by_bench = True
    stderr = proc.stderr.read()
    evals = evaluations(run_dir / "metrics.jsonl")
    solve = next((e for e in evals if e["mean_return"] >= args.target), None)
    out = {"seed": seed, "exit_code": proc.returncode, "wall_s": time.monotonic() - started,
           "solved": solve is not None, "curve": [(e["time_s"], e["training_step"], e["mean_return"]) for e in evals]}
    if solve is None:
        out["stderr_tail"] = stderr[-2000:]
        return out
    after = [e for e in evals if e["training_step"] > solve["training_step"]]
    out |= {
        "solve_time_s": solve["time_s"], "solve_training_step": solve["training_step"],
        "past_solve_reached": stopped_by_bench,
        "evaluations_after": len(after),
        "share_after_at_target": sum(e["mean_return"] >= args.target for e in after) / len(after) if after else None,
        "worst_after": min((e["mean_return"] for e in after), default=None),
        "last_training_step_evaluated": evals[-1]["training_step"],
    }  # fmt: skip
    if args.final_episodes and (run_dir / "checkpoint.pt").exists():
        out["final"] = final_weights(run_dir, args)
    return out


def final_weights(run_dir: Path, args) -> dict:
    """``checkpoint.pt`` (the learner's weights at the stop) on new greedy episodes."""
    cmd = [sys.executable, "run.py", "--evaluate", str(run_dir), "--checkpoint", str(run_dir / "checkpoint.pt"),
           "--episodes", str(args.final_episodes), "--seed", str(args.final_seed)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    stats = json.loads((run_dir / "evaluation.json").read_text())
    return {"training_step": stats["training_step"], "mean_return": stats["return"]["mean"],
            "min_return": stats["return"]["min"], "episodes": stats["episodes"]}  # fmt: skip


def holds(r: dict, args) -> bool:
    return bool(r["solved"] and r.get("past_solve_reached") and r["share_after_at_target"] is not None
                and r["share_after_at_target"] >= args.hold_share
                and r.get("final", {}).get("mean_return", -math.inf) >= args.target)  # fmt: skip


def median(values: list[float]) -> float:
    v = sorted(values)
    if not v:
        return math.nan
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def report(results: list[dict], args, command: str) -> str:
    lines = [f"# Does the solve hold? `{command}` ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"target {args.target:g}; judged over the evaluations of weights up to {args.past_solve:,} training steps "
             f"past the first solve, and the final weights on {args.final_episodes} new episodes", "",
             "| seed | first solve: s, training step | evaluations after | share at target | worst after "
             "| final weights: step, mean (min) | holds |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if not r["solved"]:
            lines.append(f"| {r['seed']} | not solved (exit {r['exit_code']}) | - | - | - | - | no |")
            continue
        final = r.get("final")
        final_text = f"{final['training_step']:,}, {final['mean_return']:.1f} ({final['min_return']:.0f})" if final else "-"
        share = "-" if r["share_after_at_target"] is None else f"{r['share_after_at_target']:.0%}"
        worst = "-" if r["worst_after"] is None else f"{r['worst_after']:.1f}"
        lines.append(f"| {r['seed']} | {r['solve_time_s']:.1f}, {r['solve_training_step']:,} | {r['evaluations_after']} "
                     f"| {share} | {worst} | {final_text} | {'yes' if holds(r, args) else 'no'} |")  # fmt: skip
    solved = [r for r in results if r["solved"]]
    shares = [r["share_after_at_target"] for r in solved if r["share_after_at_target"] is not None]
    finals = [r["final"]["mean_return"] for r in solved if "final" in r]
    lines += ["",
              f"solved {len(solved)}/{len(results)}; held {sum(holds(r, args) for r in results)}/{len(results)}; "
              f"every evaluation share >= {args.hold_share:.0%}: {sum(s >= args.hold_share for s in shares)}/"
              f"{len(results)}; final weights >= {args.target:g}: {sum(f >= args.target for f in finals)}/{len(results)}",
              f"medians over the solved seeds: first solve {median([r['solve_time_s'] for r in solved]):.1f} s and "
              f"{median([r['solve_training_step'] for r in solved]):,.0f} training steps; share at target "
              f"{median(shares):.0%}; final weights' mean {median(finals):.1f}"]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cartpole.json")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--target", type=float, default=475.0, help="the mean greedy return that counts as solved")
    ap.add_argument("--past-solve", type=int, default=5000, metavar="STEPS",
                    help="training steps to train on after the first solve")
    ap.add_argument("--max-train-steps", type=int, default=100_000, help="run.py --max-train-steps (an upper bound)")
    ap.add_argument("--time-limit", type=float, default=900.0, help="run.py --time-limit of each seed")
    ap.add_argument("--final-episodes", type=int, default=100, metavar="N")
    ap.add_argument("--final-seed", type=int, default=60_000_000, metavar="S")
    ap.add_argument("--hold-share", type=float, default=0.9)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed on to run.py")
    ap.add_argument("--tag", default="cartpole", help="name of the run directories and result files")
    args = ap.parse_args()
    command = "python bench/holds.py " + " ".join(sys.argv[1:])
    results = []
    for seed in args.seeds:
        print(f"seed {seed} ...", file=sys.stderr, flush=True)
        results.append(run_seed(seed, args))
        print(report(results[-1:], args, command).splitlines()[6], file=sys.stderr, flush=True)
    text = report(results, args, command)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"holds_{args.tag}.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    (RESULTS / f"holds_{args.tag}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
