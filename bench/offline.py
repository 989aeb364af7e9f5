"""Offline CartPole-v1 from one dataset, side by side: offline MuZero (MuZero Unplugged's
reanalyse), mpper's discrete CQL, and d3rlpy 2.8's DiscreteCQL on the same transitions
(docs/offline.md). Reports each one's wall time to a greedy mean return >= 475.

1. The behaviour: a DQN run's best weights (``--behaviour-run RUN_DIR``, or a short
   ``cartpole_dqn`` run of ``--behaviour-steps`` training steps made here), with the
   epsilon (of ``--epsilons``, first fit) whose probe of ``--probe-steps`` env steps has a
   mean return in [100, 200]; then ``--steps`` env steps of it with ``--collect``.
2. Per seed: ``--offline`` runs of ``cartpole`` (MuZero) and ``cartpole_dqn`` with
   ``dqn.cql_alpha`` (``--cql-alpha``), each stopped by ``runtime.solve_return`` 475 or
   ``--time-limit``; the time is the solving evaluation's ``time_s`` in ``metrics.jsonl``
   (from the run's start; evaluation included).
3. Per seed: ``bench/offline_d3rlpy.py`` in d3rlpy's venv (``--d3rlpy-python``) on the
   exported snapshot.

Writes ``OUT/offline.json`` and ``OUT/offline.md``. The full benchmark:

    python bench/offline.py --out runs/bench-offline --seeds 3 --steps 50000 --time-limit 600 \
        --d3rlpy-python <d3rlpy-venv>/bin/python

A smoke of a few minutes: ``--steps 3000 --seeds 1 --time-limit 60 --behaviour-steps 300``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def mpper(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = run([sys.executable, "run.py", *args], timeout)
    if proc.returncode != 0:
        raise SystemExit(f"run.py {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def behaviour_run(out: Path, steps: int, workers: int) -> Path:
    run_dir = out / "behaviour-run"
    if not run_dir.exists():
        mpper(
            [
                "--config",
                "cartpole_dqn",
                "--workers",
                str(workers),
                "--device",
                "cpu",
                "--run-dir",
                str(run_dir),
                "--max-train-steps",
                str(steps),
                "--set",
                "runtime.solve_return=null",
            ],
            3600,
        )
    return run_dir


def collect(run_dir: Path, steps: int, epsilon: float, out: Path, seed: int) -> dict:
    if not out.exists():
        mpper(
            [
                "--collect",
                str(run_dir),
                "--env-steps",
                str(steps),
                "--epsilon",
                str(epsilon),
                "--out",
                str(out),
                "--seed",
                str(seed),
            ],
            3600,
        )
    manifest = json.loads((out / "manifest.json").read_text())
    return manifest["extra"]["collected"]


def solve_time(run_dir: Path) -> dict:
    """The first evaluation at 475 or more (its time_s and training step), or the best."""
    best = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        ev = record.get("evaluation") or {}
        if record["event"] != "evaluation" or "mean_return" not in ev:
            continue
        if ev["mean_return"] >= 475:
            return {"solved": True, "wall_s": record["time_s"], "training_step": ev["training_step"],
                    "mean_return": ev["mean_return"]}  # fmt: skip
        if best is None or ev["mean_return"] > best["best_mean_return"]:
            best = {"best_mean_return": ev["mean_return"], "at_s": record["time_s"]}
    return {"solved": False, **(best or {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=50_000)
    p.add_argument("--time-limit", type=float, default=600.0)
    p.add_argument("--workers", type=int, default=1, help="processes of each mpper run (0: in turns)")
    p.add_argument("--behaviour-run", type=Path)
    p.add_argument("--behaviour-steps", type=int, default=3000)
    p.add_argument("--epsilons", default="0.0,0.1,0.2,0.3,0.4,0.5,0.7")
    p.add_argument("--probe-steps", type=int, default=3000)
    p.add_argument("--cql-alpha", type=float, default=1.0)
    p.add_argument("--d3rlpy-python", required=True, help="the Python of a virtualenv with d3rlpy 2.8 (docs/offline.md)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.behaviour_run or behaviour_run(args.out, args.behaviour_steps, args.workers)
    chosen, probes = None, []
    for epsilon in (float(e) for e in args.epsilons.split(",")):
        probe = collect(run_dir, args.probe_steps, epsilon, args.out / f"probe-eps{epsilon:g}", 1)
        probes.append({"epsilon": epsilon, "mean_return": probe["mean_return"]})
        if probe["mean_return"] is not None and 100 <= probe["mean_return"] <= 200:
            chosen = epsilon
            break
    if chosen is None:  # none in range: the closest to 150, said in the report
        chosen = min(probes, key=lambda r: abs((r["mean_return"] or 0) - 150))["epsilon"]
    data = args.out / f"data-eps{chosen:g}-{args.steps}"
    behaviour = collect(run_dir, args.steps, chosen, data, 0)
    results: dict = {"behaviour": {k: behaviour[k] for k in ("checkpoint", "training_step", "epsilon", "env_steps",
                                                              "complete_episodes", "mean_return")},
                     "probes": probes, "runs": []}  # fmt: skip
    common = ["--offline", str(data), "--device", "cpu", "--workers", str(args.workers),
              "--time-limit", str(args.time_limit), "--set", "runtime.solve_return=475"]  # fmt: skip
    for seed in range(args.seeds):
        for name, config, extra in (
            ("mpper MuZero (offline, reanalyse)", "cartpole", []),
            ("mpper CQL", "cartpole_dqn", ["--set", f"dqn.cql_alpha={args.cql_alpha}"]),
        ):
            target = args.out / f"{config}-seed{seed}"
            started = time.monotonic()
            mpper(["--config", config, "--seed", str(seed), "--run-dir", str(target), *common, *extra],
                  args.time_limit + 600)  # fmt: skip
            results["runs"].append({"name": name, "seed": seed, "process_s": round(time.monotonic() - started, 1),
                                    **solve_time(target)})  # fmt: skip
        proc = run([args.d3rlpy_python, "-W", "ignore", "bench/offline_d3rlpy.py", str(data), "--seed", str(seed),
                    "--time-limit", str(args.time_limit), "--alpha", str(args.cql_alpha)], args.time_limit + 600)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"d3rlpy failed:\n{proc.stderr[-3000:]}")
        d3 = json.loads(proc.stdout.strip().splitlines()[-1])
        results["runs"].append({"name": "d3rlpy 2.8 DiscreteCQL", "seed": seed, "solved": d3["solved"],
                                "wall_s": d3.get("wall_s"), "training_s": d3.get("training_s"),
                                "best_mean_return": max(e["mean_return"] for e in d3["evaluations"])})  # fmt: skip
    (args.out / "offline.json").write_text(json.dumps(results, indent=1))
    b = results["behaviour"]
    lines = [
        f"Behaviour: {b['checkpoint']} (training step {b['training_step']}), epsilon {b['epsilon']:g}, "
        f"{b['env_steps']} env steps, mean return {b['mean_return']:.1f} over {b['complete_episodes']} episodes",
        "",
        "| learner | seed | greedy mean >= 475 | wall s to it | best mean (if not) |",
        "|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['name']} | {r['seed']} | {'yes' if r['solved'] else 'no'} | "
            f"{r.get('wall_s') if r['solved'] else '-'} | {'' if r['solved'] else r.get('best_mean_return')} |"
        )
    if not 100 <= (b["mean_return"] or 0) <= 200:
        lines.insert(1, "(not the 100-200 the benchmark asks for: none of --epsilons gave it with this behaviour run)")
    (args.out / "offline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
