"""Atari 100k on one GPU: each game's seeds run at once, each run under one wall-clock limit.

Per game (``configs/atari100k_<game>.json``: 100k agent steps, then the learner's remaining
updates, then a final evaluation of 32 greedy episodes), the seeds start together, each
``run.py --config configs/atari100k_<game>.json --seed S --workers W --device D
--time-limit T`` with the cores split between them. A run that reaches the time limit
before its budget ends there, and its final evaluation (played after the limit, its time
reported apart) says at how many agent steps. Per run it reports:

- the final evaluation's mean return, at its agent steps and training steps;
- the curve: each evaluation's mean return against agent steps and wall time;
- agent steps/s and training steps/s (``bench/gpu.py``'s figures from ``metrics.jsonl``);
- the wall time of the training and of the whole command.

Writes ``atari100k.json``, ``atari100k.md`` and ``atari100k_<game>.png`` to ``--out``.
The cp312 wheels in ``.whl/`` (gymnasium, ale-py) are installed first where gymnasium does
not import, as ``bench/gpu.py`` does.

Usage::

    python bench/atari100k.py --games pong --seeds 0 1 --time-limit 480 --workers 7 --out $OUT/atari100k
    python bench/atari100k.py --quick --out /tmp/atari100k-quick     # the CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (install_wheels, child_env, read_records, run_figures)

GAMES = ("pong", "breakout", "boxing")
# --quick: a few hundred agent steps of each run, at sizes the CPU plays in seconds
QUICK = ["training.env_steps=300", "training.training_steps=40", "training.min_buffer_steps=128",
         "training.batch_size=16", "training.lr_warmup_steps=2", "mcts.num_simulations=2",
         "reanalyse.num_simulations=2", "network.encoding_size=8", "network.hidden=[8]",
         "network.reduced_channels=2", "network.projection_size=16", "network.support_size=10",
         "runtime.envs_per_worker=2", "runtime.final_evaluation_episodes=2", "env.max_episode_steps=200",
         "env.training_max_episode_steps=200", "replay.capacity=5000", "runtime.evaluation_interval_s=5"]  # fmt: skip


def launch(game: str, seed: int, args) -> tuple[subprocess.Popen, Path, list[str], float]:
    run_dir = args.out / f"{game}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [*(QUICK if args.quick else []), *args.set]
    command = ["run.py", "--config", f"configs/atari100k_{game}.json", "--seed", str(seed), "--workers",
               str(args.workers), "--device", args.device, "--time-limit", f"{args.time_limit:g}",
               "--run-dir", str(run_dir), *(a for o in overrides for a in ("--set", o))]  # fmt: skip
    log = open(args.out / f"{game}-seed{seed}.log", "w")  # noqa: SIM115  (closed by the child's exit)
    proc = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=gpu.child_env(), stdout=log,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    return proc, run_dir, ["python", *command], time.monotonic()


def run_row(game: str, seed: int, run_dir: Path, command: list[str], code: int | None, wall_s: float) -> dict:
    """One run's figures from its directory (a ``note`` says what is missing)."""
    row: dict = {"game": game, "seed": seed, "command": " ".join(command), "exit": code, "wall_s": round(wall_s, 1)}
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return {**row, "note": "no metrics.jsonl"}
    records = gpu.read_records(metrics)
    row.update(gpu.run_figures(metrics))
    row["curve"] = [(r["env_steps"], r["time_s"], r["evaluation"]["mean_return"]) for r in records
                    if r.get("event") == "evaluation" and "mean_return" in r.get("evaluation", {})]  # fmt: skip
    final_record = next((r for r in records if r.get("event") == "final_evaluation"), None)
    before = [r for r in records if r.get("event") != "final_evaluation" and "time_s" in r]
    if before:
        row["training_wall_s"] = before[-1]["time_s"] if final_record is None else final_record["time_s"]
    path = run_dir / "final_evaluation.json"
    if path.is_file():
        final = json.loads(path.read_text())
        row.update(final_mean=final["mean_return"], final_returns=final["returns"], agent_steps=final["env_steps"],
                   training_steps=final["training_step"])  # fmt: skip
    else:
        row["note"] = "no final evaluation (the run did not end on its own)"
    return row


def markdown(rows: list[dict], args) -> str:
    lines = [f"Atari 100k, {args.device}, {len(args.seeds)} seeds at once per game, --workers {args.workers} each, "
             f"--time-limit {args.time_limit:g} s", "",
             "| game | seed | final mean (episodes) | agent steps | training steps | agent steps/s | training steps/s | "
             "training wall s | command wall s | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        final = f"{r['final_mean']:.2f} ({len(r['final_returns'])})" if "final_mean" in r else "-"
        cells = [r["game"], r["seed"], final, f"{r.get('agent_steps', 0):,}", f"{r.get('training_steps', 0):,}",
                 gpu.show(r.get("env_steps_per_s")), gpu.show(r.get("training_steps_per_s")),
                 gpu.show(r.get("training_wall_s")), gpu.show(r["wall_s"]), r.get("note", "")]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for game in args.games:
        finals = [r["final_mean"] for r in rows if r["game"] == game and "final_mean" in r]
        if finals:
            lines.append(f"\n{game}: median final mean {statistics.median(finals):.2f} over {len(finals)} seeds; "
                         f"seeds at >= 0: {sum(f >= 0 for f in finals)}/{len(finals)}")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], game: str, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for r in (r for r in rows if r["game"] == game and r.get("curve")):
        steps, seconds, returns = zip(*r["curve"])
        axes[0].plot(steps, returns, label=f"seed {r['seed']}")
        axes[1].plot([s / 60 for s in seconds], returns)
    axes[0].set_xlabel("agent steps")
    axes[1].set_xlabel("wall minutes")
    axes[0].set_ylabel("mean greedy return")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Atari 100k {game}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", nargs="+", default=["pong"], choices=GAMES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--time-limit", type=float, default=480.0, help="each run's --time-limit (its training)")
    ap.add_argument("--workers", type=int, default=None, help="self-play workers per run; default: the cores "
                    "split between the seeds, less two each for the learner and the rest")  # fmt: skip
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    ap.add_argument("--quick", action="store_true", help="the CPU smoke test: a few hundred agent steps per run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "atari100k")
    args = ap.parse_args(argv)
    if args.quick:
        args.device, args.time_limit = "cpu", min(args.time_limit, 120.0)
    if args.workers is None:
        args.workers = max(1, (os.cpu_count() or 2) // len(args.seeds) - 2)
    args.out.mkdir(parents=True, exist_ok=True)
    wheels = gpu.install_wheels()
    print(f"wheels: {wheels}", flush=True)
    data: dict = {"argv": sys.argv[1:] if argv is None else argv, "date": time.strftime("%Y-%m-%d"), "wheels": wheels,
                  "cpus": os.cpu_count(), "rows": []}  # fmt: skip
    for game in args.games:
        running = [(seed, *launch(game, seed, args)) for seed in args.seeds]
        for seed, proc, run_dir, command, started in running:
            try:  # the time limit, then the final evaluation and the files; a hang is killed
                code = proc.wait(timeout=args.time_limit + 600)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            row = run_row(game, seed, run_dir, command, code, time.monotonic() - started)
            data["rows"].append(row)
            shown = {k: v for k, v in row.items() if k not in ("curve", "final_returns")}
            print(json.dumps(shown), flush=True)
        (args.out / "atari100k.json").write_text(json.dumps(data, indent=1))
        plot(data["rows"], game, args.out / f"atari100k_{game}.png")
    text = markdown(data["rows"], args)
    (args.out / "atari100k.md").write_text(text)
    print("\n" + text)
    return 0 if all(r["exit"] == 0 for r in data["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
