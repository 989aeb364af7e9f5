"""An older revision of mpper against this checkout, side by side in one run.

The older revision is checked out into a temporary git worktree; every benchmark then
runs in both trees in turn (the order alternating from one repetition or seed to the
next), so that whatever else the machine does weighs on both alike:

* ``bench/solve_cartpole.py``, one seed at a time: the time to solve CartPole-v1 with
  ``run.py --workers W``, for the old tree, this tree, and this tree with
  ``runtime.lockstep`` (``--lockstep``);
* ``bench/replay.py --quick --skip-mp``, ``bench/mcts_speed.py`` and ``bench/learner.py``
  (``--micro``): the buffer's and the search's per-call times and the learner process's
  training steps per second, each tree's own benchmark on its own code.

Prints the per-seed table and, for the micro benchmarks, each tree's own output.

Usage::

    python bench/before_after.py --before 42a8809 --seeds 0 1 2 3 4 5 6 7 8 9 --lockstep --micro
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCKSTEP = ["runtime.lockstep=true"]


def solve(root: Path, seed: int, tag: str, args, sets: list[str]) -> dict:
    cmd = [sys.executable, "bench/solve_cartpole.py", "--seeds", str(seed), "--workers", str(args.workers),
           "--time-limit", str(args.time_limit), "--verify-episodes", "0", "--tag", tag]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True)
    return json.loads((root / "bench" / "results" / f"{tag}_solve.json").read_text())["results"][0]


def median_or_inf(values: list[float]) -> float:
    return statistics.median(values) if values else math.inf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the older revision (a commit, tag or branch)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--lockstep", action="store_true", help="also this tree with runtime.lockstep")
    ap.add_argument("--micro", action="store_true", help="also bench/replay.py, bench/mcts_speed.py, bench/learner.py")
    args = ap.parse_args()
    command = "python bench/before_after.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="mpper-before-") as tmp:
        before = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        try:
            return run(args, command, before)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)


def run(args, command: str, before: Path) -> int:
    variants = [("before", before, []), ("after", ROOT, [])]
    if args.lockstep:
        variants.append(("after, lockstep", ROOT, LOCKSTEP))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for i, seed in enumerate(args.seeds):
        turn = variants[i % len(variants):] + variants[: i % len(variants)]
        for name, root, sets in turn:
            print(f"seed {seed}: {name} ...", file=sys.stderr, flush=True)
            tag = "ba-" + name.replace(", ", "-")
            results[name].append(solve(root, seed, tag, args, sets))
    print(f"# Before and after: `{command}`", "", f"before: {args.before}; after: this checkout", "",
          "| seed | " + " | ".join(f"{n}: wall s (training steps)" for n, _, _ in variants) + " |",
          "|---|" + "---|" * len(variants), sep="\n")  # fmt: skip
    for k, seed in enumerate(args.seeds):
        cells = []
        for name, _, _ in variants:
            r = results[name][k]
            cells.append(f"{r['wall_s']:.1f} ({r['training_step']:,})" if r["solved"] else "unsolved")
        print(f"| {seed} | " + " | ".join(cells) + " |")
    summary = []
    for name, _, _ in variants:
        rs = results[name]
        solved = [r for r in rs if r["solved"]]
        walls = sorted([r["wall_s"] for r in solved] + [math.inf] * (len(rs) - len(solved)))
        summary.append(f"{name}: solved {len(solved)}/{len(rs)}, median wall {median_or_inf(walls):.1f} s, "
                       f"median training steps {median_or_inf([r['training_step'] for r in solved]):,.0f}, "
                       f"median CPU s {statistics.median(r['cpu_s'] for r in rs):.0f}")  # fmt: skip
    print("", *summary, sep="\n")
    if args.micro:
        micro = [("bench/replay.py", ["--quick", "--skip-mp", "--capacities", "100000", "--out", "/dev/null"]),
                 ("bench/mcts_speed.py", ["--ks", "8", "64", "--searches", "puct:25", "gumbel:8", "--seconds", "2"]),
                 ("bench/learner.py", ["--seconds", "6", "--batch-size", "128"])]
        for script, extra in micro:
            for rep in range(2):
                for name, root in ((("before", before), ("after", ROOT)) if rep == 0 else
                                   (("after", ROOT), ("before", before))):  # fmt: skip
                    out = subprocess.run([sys.executable, script, *extra], cwd=root, check=True, capture_output=True,
                                         text=True).stdout  # fmt: skip
                    print(f"\n## {script} {' '.join(extra)}: {name}, repetition {rep + 1}\n\n{out.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
