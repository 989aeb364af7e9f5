"""MinAtar at an env-step budget: mpper's MuZero beside mpper's DQN, the same env steps each.

Per seed, game and algorithm, one run after the other (never two at once)::

    python run.py --config configs/minatar_<game>[_dqn].json --workers W --seed S --env-steps N --device cpu \\
        --set runtime.final_evaluation_episodes=F --set runtime.evaluation_interval_s=E

The curve is the run's evaluation records (10 greedy episodes each) against the env steps
stored when they arrived, and against wall time; the result is the final evaluation: F
greedy episodes of the final weights once the budget is spent (``final_evaluation.json``).
A run that reaches ``--time-limit`` first ends there and says so (its env steps are then
below the budget). ``--variant LABEL:KEY=VALUE,...`` adds MuZero runs with those overrides
(an ablation: each variant's median beside plain MuZero's). Prints a table per game and the
ratios of the median final returns (MuZero / DQN, variant / MuZero); writes
``env_steps.json`` and ``env_steps_<game>.png``.

Usage::

    python bench/env_steps.py --games breakout space_invaders --env-steps 100000 --seeds 0 1 2
    python bench/env_steps.py --games breakout --env-steps 25000 --seeds 0 --set muzero:training.samples_per_insert=8
    python bench/env_steps.py --games breakout --env-steps 20000 --systems muzero \
        --variant vp:muzero.value_prefix=true --variant opc:muzero.off_policy_correction=true
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proctree  # noqa: E402

GAMES = ("breakout", "space_invaders")
SYSTEMS = {"muzero": "configs/minatar_{game}.json", "dqn": "configs/minatar_{game}_dqn.json"}


def run_one(out: Path, game: str, system: str, seed: int, args) -> dict:
    """One run of ``system`` (a key of SYSTEMS, or a variant's label: MuZero with its
    overrides); its figures, curve and final evaluation."""
    run_dir = out / f"{system}-{game}-seed{seed}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    base = system if system in SYSTEMS else "muzero"
    overrides = [o.split(":", 1)[1] for o in args.set if o.split(":", 1)[0] == base]
    overrides += args.variants.get(system, [])
    command = [sys.executable, "run.py", "--config", SYSTEMS[base].format(game=game), "--workers", str(args.workers),
               "--seed", str(seed), "--env-steps", str(args.env_steps), "--device", "cpu", "--run-dir", str(run_dir),
               "--time-limit", f"{args.time_limit:g}",
               "--set", f"runtime.final_evaluation_episodes={args.final_episodes}",
               "--set", f"runtime.evaluation_interval_s={args.eval_interval_s:g}",
               *(a for o in overrides for a in ("--set", o))]  # fmt: skip
    print(" ".join(command[1:]), flush=True)
    proc, wall, cpu, _ = proctree.run_measured(command, ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    row = {"game": game, "system": system, "seed": seed, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
           "overrides": overrides, "end": proc.stdout.strip().splitlines()[-1]}  # fmt: skip
    row.update(run_figures(run_dir))
    return row


def run_figures(run_dir: Path) -> dict:
    """From a run directory: env steps and training steps at the end, the evaluation curve
    ``[(env_steps, time_s, mean_return)]`` and the final evaluation's mean and returns."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    end = records[-1]
    curve = [(r["env_steps"], r["time_s"], r["evaluation"]["mean_return"]) for r in records
             if r["event"] == "evaluation" and "mean_return" in r["evaluation"]]  # fmt: skip
    final = json.loads((run_dir / "final_evaluation.json").read_text())
    return {"env_steps": end["env_steps"], "training_steps": final["training_step"], "curve": curve,
            "final_mean": final["mean_return"], "final_returns": final["returns"]}  # fmt: skip


def _ratio(medians: dict, top: str, bottom: str) -> float | None:
    if top not in medians or bottom not in medians or medians[bottom]["median"] == 0:
        return None
    return medians[top]["median"] / medians[bottom]["median"]


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per game: each system's (and variant's) median final return and seeds, MuZero /
    DQN's ratio of the medians, and each variant's ratio to plain MuZero (None without
    both, or with a denominator of 0)."""
    out: dict[str, dict] = {}
    for game in dict.fromkeys(r["game"] for r in rows):
        medians = {}
        for system in dict.fromkeys(r["system"] for r in rows):
            finals = [r["final_mean"] for r in rows if r["game"] == game and r["system"] == system]
            if finals:
                medians[system] = {"median": statistics.median(finals), "seeds": len(finals)}
        variants = {v: _ratio(medians, v, "muzero") for v in medians if v not in SYSTEMS}
        out[game] = {"medians": medians, "ratio": _ratio(medians, "muzero", "dqn"), "variants": variants}
    return out


def markdown(rows: list[dict], args) -> str:
    lines = [f"env-step budget {args.env_steps:,}, --workers {args.workers}, final evaluation over "
             f"{args.final_episodes} greedy episodes", "",
             "| game | system | seed | env steps | training steps | final mean | wall s |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['game']} | {r['system']} | {r['seed']} | {r['env_steps']:,} | {r['training_steps']:,} | "
                     f"{r['final_mean']:.2f} | {r['wall_s']:.0f} |")  # fmt: skip
    for game, s in summary(rows).items():
        medians = ", ".join(f"{k} {v['median']:.2f} ({v['seeds']} seeds)" for k, v in s["medians"].items())
        ratio = f"; MuZero / DQN {s['ratio']:.2f}x" if s["ratio"] is not None else ""
        ratio += "".join(f"; {v} / MuZero {x:.2f}x" for v, x in s["variants"].items() if x is not None)
        lines.append(f"\n{game}: median final {medians}{ratio}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], game: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    systems = list(dict.fromkeys([*SYSTEMS, *(r["system"] for r in rows)]))
    for r in (r for r in rows if r["game"] == game and r["curve"]):
        steps, seconds, returns = zip(*r["curve"])
        color = f"C{systems.index(r['system'])}"
        label = r["system"] if r["seed"] == min(x["seed"] for x in rows if x["system"] == r["system"]) else None
        axes[0].plot(steps, returns, color=color, alpha=0.8, label=label)
        axes[1].plot([s / 60 for s in seconds], returns, color=color, alpha=0.8)
    axes[0].set_xlabel("env steps")
    axes[1].set_xlabel("wall minutes (2 cores)")
    axes[0].set_ylabel("mean greedy return (10 episodes)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"MinAtar {game}, one line per seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", nargs="+", default=list(GAMES), choices=GAMES)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--env-steps", type=int, default=100_000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--eval-interval-s", type=float, default=60.0)
    ap.add_argument("--final-episodes", type=int, default=30)
    ap.add_argument("--time-limit", type=float, default=7200.0, help="each run's --time-limit, a safety net")
    ap.add_argument("--set", action="append", default=[], metavar="SYSTEM:KEY=VALUE",
                    help="an override for one system's runs, e.g. muzero:training.samples_per_insert=8")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                    help="MuZero runs with these overrides as well, labelled, e.g. vp:muzero.value_prefix=true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "env_steps")
    args = ap.parse_args(argv)
    for o in args.set:
        if o.split(":", 1)[0] not in SYSTEMS or ":" not in o:
            print(f"error: --set {o}: expected SYSTEM:KEY=VALUE with SYSTEM one of {', '.join(SYSTEMS)}",
                  file=sys.stderr)  # fmt: skip
            return 2
    args.variants = {}
    for v in args.variant:
        label, _, sets = v.partition(":")
        if not label or label in SYSTEMS or label in args.variants or "=" not in sets:
            print(f"error: --variant {v}: expected LABEL:KEY=VALUE[,KEY=VALUE] with a new label other than "
                  f"{', '.join(SYSTEMS)}", file=sys.stderr)  # fmt: skip
            return 2
        args.variants[label] = sets.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.strftime("%Y-%m-%d %H:%M")
    for seed in args.seeds:
        for game in args.games:
            for system in [*args.systems, *args.variants]:
                rows.append(run_one(args.out, game, system, seed, args))
                r = rows[-1]
                print(f"{game} {system} seed {seed}: final mean {r['final_mean']:.2f} at {r['env_steps']:,} env steps, "
                      f"{r['training_steps']:,} training steps, {r['wall_s']:.0f} s", flush=True)  # fmt: skip
                data = {"argv": sys.argv[1:] if argv is None else argv, "started": started, "rows": rows,
                        "summary": summary(rows)}  # fmt: skip
                (args.out / "env_steps.json").write_text(json.dumps(data, indent=1))
    text = markdown(rows, args)
    (args.out / "env_steps.md").write_text(text)
    print("\n" + text)
    for game in args.games:
        plot(rows, game, args.out / f"env_steps_{game}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
