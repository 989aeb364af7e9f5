"""TicTacToe benchmark: how fast does
``python run.py --config configs/tictactoe.json --workers 8`` learn to beat the random
player and to hold the perfect player to a draw?

For each seed, trains for at most ``--minutes`` minutes. The run's own evaluator measures
the agent against training time: every ``--eval-interval`` seconds, ``--games`` games
against the random player and ``--games`` against the perfect player (each half as the
first player, half as the second; greedy search, no noise), with the latest weights; the
numbers land in the run's ``metrics.jsonl`` (``evaluation.opponents``). After the run, a
final evaluation of the saved ``checkpoint.pt`` (same number of games, batched arena), and
the checkpoint's move in each of the 4,520 unfinished positions of the game checked
against the solver (how many keep the position's game-theoretic value).

Targets: 0 losses against random; >= 90 % draws against perfect (nobody beats it). The
report gives, per seed, the first training time each target was met and both were met
together, how many evaluations from then on met both, the final numbers, Markdown tables
and a PNG of both curves against training time (matplotlib, optional).

The long check (``--check-games N``, default 500): the saved checkpoint then plays N games
against random as the first player, N as the second, and N / 5 against perfect as the
second player (the side where a weak agent loses), and the report counts its losses.

Resumable: each seed's result is written to ``OUT/seed<N>.json`` as soon as that seed
is done, and the tables and the PNG are rebuilt from every ``seed*.json`` present; a
rerun skips the seeds whose JSON exists (``--force`` reruns them). A seed whose run was
cut short is started again from scratch.

Usage::

    python bench/tictactoe.py                                 # seeds 0 1 2, --workers 8, 30 min each
    python bench/tictactoe.py --minutes 2 --seeds 0 --workers 2 --eval-interval 30   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the final evaluation imports mpper
CONFIG = "configs/tictactoe.json"
PERFECT_DRAW_TARGET = 0.9


def totals(side_counts: dict) -> dict[str, int]:
    """wins/draws/losses over first and second player, and the games."""
    out = {k: side_counts["first"][k] + side_counts["second"][k] for k in ("wins", "draws", "losses")}
    out["games"] = sum(out.values())
    return out


def met_random(opponents: dict) -> bool:
    return totals(opponents["random"])["losses"] == 0


def met_perfect(opponents: dict) -> bool:
    t = totals(opponents["perfect"])
    return t["games"] > 0 and t["draws"] >= PERFECT_DRAW_TARGET * t["games"]


def run_seed(seed: int, args, out_dir: Path) -> dict:
    run_dir = out_dir / f"seed{seed}-run"
    if run_dir.exists():  # a run cut short: start this seed's run again
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "run.py", "--config", args.config, "--workers", str(args.workers), "--seed", str(seed),
           "--device", args.device, "--run-dir", str(run_dir), "--time-limit", str(args.minutes * 60),
           "--set", f"runtime.evaluation_episodes={args.games}",
           "--set", f"runtime.evaluation_interval_s={args.eval_interval}",
           "--set", "runtime.solve_return=null", "--set", "runtime.log_interval_s=30"]  # fmt: skip
    print(f"seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(out_dir / f"seed{seed}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            continue
    curve = []
    for r in records:
        ev = r.get("evaluation") or {}
        if r.get("event") != "evaluation" or "opponents" not in ev:
            continue
        point = {"time_s": r["time_s"], "env_steps": r["env_steps"], "training_step": ev["training_step"],
                 "random": totals(ev["opponents"]["random"]), "perfect": totals(ev["opponents"]["perfect"]),
                 "met_random": met_random(ev["opponents"]), "met_perfect": met_perfect(ev["opponents"])}  # fmt: skip
        curve.append(point)
    end = records[-1] if records else {}
    result = {
        "seed": seed, "exit_code": proc.returncode, "wall_s": round(wall, 1), "minutes": args.minutes,
        "workers": args.workers, "games": args.games, "config": args.config, "curve": curve,
        "training_steps": (end.get("learner") or {}).get("training_step"), "env_steps": end.get("env_steps"),
        "first_met_random_s": next((p["time_s"] for p in curve if p["met_random"]), None),
        "first_met_perfect_s": next((p["time_s"] for p in curve if p["met_perfect"]), None),
    }  # fmt: skip
    result["final"] = final_evaluation(run_dir, args.games, seed)
    result["check"] = long_check(run_dir, args.check_games, seed)
    return result


def long_check(run_dir: Path, games: int, seed: int) -> dict:
    """The saved checkpoint's games per (opponent, side) for the long check:
    ``games`` against random as first and as second player, ``games // 5`` against
    perfect as second player; {} without a checkpoint or with ``games`` 0."""
    import torch

    from mpper.algos.muzero.arena import load_mcts_agent, play_match
    from mpper.envs.tictactoe import TicTacToeEnv, perfect_agent, random_agent

    torch.set_num_threads(1)
    if games <= 0 or not (run_dir / "checkpoint.pt").exists():
        return {}
    agent, _ = load_mcts_agent(run_dir, seed=seed)
    plan = (("random", random_agent, True, games), ("random", random_agent, False, games),
            ("perfect", perfect_agent, False, games // 5))  # fmt: skip
    out = {}
    for name, make, first, n in plan:
        side = "first" if first else "second"
        out[f"{name} as {side}"] = play_match(TicTacToeEnv, agent, make(20_000 + seed), agent_first=first, games=n,
                                              seed=seed + 1)  # fmt: skip
    return out


def final_evaluation(run_dir: Path, games: int, seed: int) -> dict:
    """``games`` games of the saved checkpoint against each opponent, half first, half
    second (the batched arena), per side."""
    import torch

    from mpper.algos.muzero.arena import load_mcts_agent, play_match
    from mpper.envs.tictactoe import TicTacToeEnv, perfect_agent, random_agent

    torch.set_num_threads(1)
    if not (run_dir / "checkpoint.pt").exists():
        return {}
    agent, _ = load_mcts_agent(run_dir, seed=seed)
    out = {}
    for name, make in (("random", random_agent), ("perfect", perfect_agent)):
        sides = {}
        for side, first in (("first", True), ("second", False)):
            n = (games + 1) // 2 if first else games // 2
            sides[side] = play_match(TicTacToeEnv, agent, make(10_000 + seed), agent_first=first, games=n, seed=seed)
        out[name] = {**sides, **{f"total_{k}": v for k, v in totals(sides).items()}}
    out["moves"] = move_quality(agent)
    out["met_random"] = out["random"]["total_losses"] == 0
    out["met_perfect"] = out["perfect"]["total_draws"] >= PERFECT_DRAW_TARGET * out["perfect"]["total_games"]
    return out


def move_quality(agent) -> dict:
    """The agent's move (one greedy search, as in its games) in each of the 4,520
    unfinished positions of TicTacToe, against the solver: how many keep the position's
    game-theoretic value (a won position stays won, a drawn one drawn), per number of
    stones on the board. A finer view than games: it covers the positions a random
    opponent leads to, not only those the agent's own play reaches."""
    import numpy as np

    from mpper.envs.tictactoe import position_scores, reachable_positions

    positions = reachable_positions()
    masks = positions[:, :2].sum(axis=1).reshape(-1, 9) == 0
    to_play = np.where(positions[:, 2, 0, 0] == 1.0, 0, 1)
    actions = np.concatenate([agent.act_batch(positions[i:i + 500], masks[i:i + 500], to_play[i:i + 500])
                              for i in range(0, len(positions), 500)])  # fmt: skip
    scores = np.stack([position_scores(p) for p in positions])
    kept = np.sign(scores[np.arange(len(positions)), actions]) == np.sign(scores.max(axis=1))
    stones = 9 - masks.sum(axis=1)
    return {"positions": int(len(positions)), "value_kept": int(kept.sum()),
            "value_kept_by_stones": {int(n): [int(kept[stones == n].sum()), int((stones == n).sum())]
                                     for n in np.unique(stones)}}  # fmt: skip


def _time(s) -> str:
    return "not met" if s is None else f"{s / 60:.1f} min ({s:.0f} s)"


def _wdl(c: dict) -> str:
    return f"{c['wins']}/{c['draws']}/{c['losses']}"


def report(results: list[dict]) -> str:
    lines = [
        "# TicTacToe: `python bench/tictactoe.py`",
        "",
        f"`{results[0].get('config', CONFIG)}`, --workers {results[0]['workers']}, "
        f"at most {results[0]['minutes']:g} min per seed; "
        f"{results[0]['games']} games per opponent per evaluation (half first, half second). Targets: 0 losses vs "
        f"random; >= {PERFECT_DRAW_TARGET:.0%} draws vs perfect. Times are training time (since the run started).",
        "",
        "| seed | 0 losses vs random first at | >= 90 % draws vs perfect first at | both first met at "
        "| evaluations from then on meeting both | evaluations | training steps | env steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        both = [p["met_random"] and p["met_perfect"] for p in r["curve"]]
        first = both.index(True) if True in both else None
        first_s = None if first is None else r["curve"][first]["time_s"]
        kept = "-" if first is None else f"{sum(both[first:])} of {len(both) - first}"
        lines.append(f"| {r['seed']} | {_time(r['first_met_random_s'])} | {_time(r['first_met_perfect_s'])} | "
                     f"{_time(first_s)} | {kept} | {len(r['curve'])} | {r['training_steps']} | {r['env_steps']} |")  # fmt: skip
    lines += [
        "",
        "Final checkpoint (W/D/L from the agent's side, as first player | as second player):",
        "",
        "| seed | vs random first | vs random second | vs perfect first | vs perfect second | targets met "
        "| moves keeping the game value (of 4,520 positions) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f = r.get("final") or {}
        if not f:
            lines.append(f"| {r['seed']} | - | - | - | - | no checkpoint (exit {r['exit_code']}) | - |")
            continue
        met = ", ".join(n for n, ok in (("random", f["met_random"]), ("perfect", f["met_perfect"])) if ok) or "none"
        m = f.get("moves")
        kept = f"{m['value_kept']:,} ({m['value_kept'] / m['positions']:.1%})" if m else "-"
        lines.append(f"| {r['seed']} | {_wdl(f['random']['first'])} | {_wdl(f['random']['second'])} | "
                     f"{_wdl(f['perfect']['first'])} | {_wdl(f['perfect']['second'])} | {met} | {kept} |")  # fmt: skip
    checks = [r for r in results if r.get("check")]
    if checks:
        games = sum(c["wins"] + c["draws"] + c["losses"] for r in checks for c in r["check"].values())
        losses = sum(c["losses"] for r in checks for c in r["check"].values())
        lines += ["", f"Long check of the final checkpoints (`--check-games`): {losses} losses in {games:,} games", "",
                  "| seed | " + " | ".join(f"{k} (W/D/L)" for k in checks[0]["check"]) + " |",
                  "|---|" + "---|" * len(checks[0]["check"])]  # fmt: skip
        for r in checks:
            lines.append(f"| {r['seed']} | " + " | ".join(_wdl(c) for c in r["check"].values()) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        t = [p["time_s"] / 60 for p in r["curve"]]
        left.plot(t, [100 * p["random"]["losses"] / max(1, p["random"]["games"]) for p in r["curve"]],
                  marker="o", ms=3, label=f"seed {r['seed']}")  # fmt: skip
        right.plot(t, [100 * p["perfect"]["draws"] / max(1, p["perfect"]["games"]) for p in r["curve"]],
                   marker="o", ms=3, label=f"seed {r['seed']}")  # fmt: skip
    left.axhline(0, color="grey", ls="--", lw=1, label="target: 0 losses")
    right.axhline(100 * PERFECT_DRAW_TARGET, color="grey", ls="--", lw=1, label="target: 90 % draws")
    left.set_title("losses against the random player (%)")
    right.set_title("draws against the perfect player (%)")
    for ax in (left, right):
        ax.set_xlabel("training time (min)")
        ax.set_ylim(-3, 103)
        ax.legend()
    fig.suptitle(f"mpper MuZero on TicTacToe, {results[0].get('config', CONFIG)}, --workers {results[0]['workers']}, "
                 f"{os.cpu_count()} cores")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--minutes", type=float, default=30.0, help="training time limit per seed")
    ap.add_argument("--eval-interval", type=float, default=60.0, metavar="SECONDS",
                    help="seconds between the run's evaluations (default 60)")
    ap.add_argument("--games", type=int, default=100, help="games per opponent per evaluation (half first)")
    ap.add_argument("--check-games", type=int, default=500,
                    help="long check of the final checkpoint: games vs random per side (and a fifth of it vs "
                         "perfect as second player); 0: none")  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tictactoe"), metavar="DIR")
    ap.add_argument("--force", action="store_true", help="rerun seeds whose result JSON exists")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        path = out_dir / f"seed{seed}.json"
        if path.exists() and not args.force:
            print(f"seed {seed}: {path} exists, skipped (--force reruns it)", file=sys.stderr)
            continue
        result = run_seed(seed, args, out_dir)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
        print(f"seed {seed}: done in {result['wall_s']:.0f} s (exit {result['exit_code']}), {path}", file=sys.stderr)
    results = [json.loads((out_dir / f"seed{s}.json").read_text()) for s in args.seeds
               if (out_dir / f"seed{s}.json").exists()]  # fmt: skip
    if not results:
        return 1
    text = report(results)
    (out_dir / "report.md").write_text(text)
    print(text)
    try:
        plot(results, out_dir / "tictactoe.png")
        print(f"curves: {out_dir / 'tictactoe.png'}")
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e '.[plot]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
