"""Sampled MuZero beside Stable-Baselines3's SAC on a MuJoCo env for the same wall time, seed by seed.

SAC (``stable_baselines3`` in its own virtualenv named by ``--sac-python``, with gymnasium's
MuJoCo v5 envs) trains with SB3's default hyperparameters (MlpPolicy of 256x256, Adam at
3e-4, batch 256, buffer 1e6, one update per env step, automatic entropy), except
``learning_starts``: 10,000 on HalfCheetah and Hopper as the rl-zoo sets it, SB3's default
of 100 elsewhere (``--sac-learning-starts`` to change it). It runs on the CPU
(``device="cpu"``) with ``--sac-threads`` torch threads, default 1, as each of mpper's
processes has (``runtime.torch_threads``): SAC is one process whose updates of a small MLP
gain little from a second thread, and on a 2-core machine whose other core is busy two
threads stall each other. Every ``--eval-interval`` seconds of its training
clock it plays 10 deterministic episodes on an env of its own (new seeds each round); the
clock stops during evaluations, so SAC's budget is spent on collecting and updating only.
It stops when its training clock reaches the budget (``--minutes``), or, with a solve return
(``--solve-return``, default 950 on InvertedPendulum-v5), at its first evaluation whose mean
reaches it; then the final weights play 10 more deterministic episodes (the final evaluation).

mpper runs ``python run.py --config CONFIG --time-limit SECONDS --seed S --device cpu`` with
its config for the env (``configs/halfcheetah_sampled.json``,
``configs/inverted_pendulum_sampled.json``, ``configs/hopper_sampled.json``; ``--config`` to
change it) and ``runtime.final_evaluation_episodes=10``: the time limit counts from the
supervisor's start, its evaluator plays alongside the training (its config's
``runtime.evaluation_episodes`` greedy episodes every ``runtime.evaluation_interval_s``), its
config's ``runtime.solve_return`` (950 on InvertedPendulum-v5) ends the run at the first
evaluation whose mean reaches it, and the final evaluation plays the last weights' 10 greedy
episodes after the run.

Reported per seed: the final evaluation's mean return, env steps, updates (training steps),
the best evaluation (mean, and when), and, with a solve return, the wall time and env steps
to it. The results (every evaluation) go to ``bench/results/<tag>.json``, a Markdown table to
stdout.

Usage::

    python bench/sac_mujoco.py --sac-python /work/peers/sb3-venv/bin/python --env HalfCheetah-v5 --minutes 30 \\
        --seeds 0 [--workers 2] [--set KEY=VALUE ...] [--eval-interval 120] [--tag NAME]
    python bench/sac_mujoco.py --sac-python /work/peers/sb3-venv/bin/python --env InvertedPendulum-v5 --minutes 15 \\
        --seeds 0 1 2
    python bench/sac_mujoco.py --sac-results bench/results/sac_halfcheetah.json --env HalfCheetah-v5 --minutes 30 \\
        --seeds 0 --set training.batch_size=256 --tag bigger_batch   # an mpper variant beside the same SAC runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from peer_runs import RESULTS, earlier_runs, fresh_dir, read_json, run_child, run_mpper

SAC = "SB3 SAC"
EVALUATION_EPISODES = 10
# env: (mpper's config, seconds between SAC's evaluations, SAC's learning_starts, solve return)
ENVS = {
    "HalfCheetah-v5": ("configs/halfcheetah_sampled.json", 120.0, 10_000, None),
    "Hopper-v5": ("configs/hopper_sampled.json", 120.0, 10_000, None),
    "InvertedPendulum-v5": ("configs/inverted_pendulum_sampled.json", 30.0, 100, 950.0),
}


# ---- SAC (in a child process of its own virtualenv) ----------------------------------------


def play(model, env, seeds: list[int]) -> list[float]:
    """The returns of one deterministic episode of ``model`` per seed."""
    returns = []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    return returns


def sac_child(args, out: Path) -> None:
    """In SB3's venv: train SAC as the module's docstring says, writing each evaluation to
    ``out/evals.json`` as it comes and the final one to ``out/final.json``."""
    import gymnasium as gym
    import torch
    from stable_baselines3 import SAC as SoftActorCritic
    from stable_baselines3.common.callbacks import BaseCallback

    torch.set_num_threads(args.sac_threads)
    budget_s = args.minutes * 60.0
    eval_env = gym.make(args.env)
    model = SoftActorCritic("MlpPolicy", gym.make(args.env), learning_starts=args.sac_learning_starts, device="cpu",
                            seed=args.sac_child)  # fmt: skip
    evals: list[dict] = []
    seeds = iter(range(10**6 + 1000 * args.sac_child, 10**9))  # evaluation seeds, apart from the training env's

    class WallClock(BaseCallback):
        """Evaluates every ``--eval-interval`` seconds of training clock; ends training at the
        budget or at the solve return."""

        def _on_training_start(self) -> None:
            self.started = time.monotonic()
            self.evaluating_s = 0.0  # the clock stops while evaluating
            self.next_eval = args.eval_interval

        def training_s(self) -> float:
            return time.monotonic() - self.started - self.evaluating_s

        def _on_step(self) -> bool:
            if self.training_s() >= budget_s:
                return False  # the final evaluation follows
            if self.training_s() < self.next_eval:
                return True
            began = time.monotonic()
            returns = play(self.model, eval_env, [next(seeds) for _ in range(EVALUATION_EPISODES)])
            evals.append({"time_s": self.training_s(), "env_steps": self.model.num_timesteps,
                          "training_steps": self.model._n_updates, "mean_return": sum(returns) / len(returns),
                          "returns": returns})  # fmt: skip
            (out / "evals.json").write_text(json.dumps(evals))
            self.evaluating_s += time.monotonic() - began
            self.next_eval += args.eval_interval
            return args.solve_return is None or evals[-1]["mean_return"] < args.solve_return

    clock = WallClock()
    model.learn(total_timesteps=10**9, callback=clock)
    returns = play(model, eval_env, [next(seeds) for _ in range(EVALUATION_EPISODES)])
    final = {"time_s": clock.training_s(), "env_steps": model.num_timesteps, "training_steps": model._n_updates,
             "episodes": len(returns), "mean_return": sum(returns) / len(returns), "returns": returns}  # fmt: skip
    (out / "final.json").write_text(json.dumps(final))


def sac_settings(args) -> dict:
    """What SAC's run was given, kept with its results (a later ``--sac-results`` reports them)."""
    return {"env": args.env, "minutes": args.minutes, "learning_starts": args.sac_learning_starts,
            "torch_threads": args.sac_threads, "eval_interval_s": args.eval_interval}  # fmt: skip


def run_sac(seed: int, args) -> dict:
    out = fresh_dir(RESULTS / f"sac-{args.env}-seed{seed}")
    child = ["--sac-child", str(seed), "--out", str(out), "--env", args.env, "--minutes", str(args.minutes),
             "--eval-interval", str(args.eval_interval), "--sac-learning-starts", str(args.sac_learning_starts),
             "--sac-threads", str(args.sac_threads),
             *(["--solve-return", str(args.solve_return)] if args.solve_return is not None else [])]  # fmt: skip
    # room past the budget for evaluations (the clock stops for them) and the final one
    wall = run_child(args.sac_python, str(Path(__file__).resolve()), child, out, args.minutes * 60 * 1.5 + 600)
    final = read_json(out / "final.json", None)
    return summary({"system": SAC, "seed": seed, "curve": read_json(out / "evals.json", []), "final": final,
                    "end": final and {k: final[k] for k in ("time_s", "env_steps", "training_steps")},
                    "wall_s_total": wall, "settings": sac_settings(args)}, args.solve_return)  # fmt: skip


def run_mpper_side(seed: int, args) -> dict:
    sets = [f"runtime.final_evaluation_episodes={EVALUATION_EPISODES}", *args.overrides]
    run = run_mpper(RESULTS / f"mpper-{args.env}-seed{seed}", args.config, seed, args.minutes * 60, args.workers, sets)
    system = "mpper Sampled MuZero" + (f" --workers {args.workers}" if args.workers else "")
    return summary({"system": system, "seed": seed, **run}, args.solve_return)


def summary(result: dict, solve_return: float | None) -> dict:
    """``result`` (its ``curve`` of evaluations, ``final`` evaluation or None, ``end``) with the
    best evaluation (``"best"``: its mean, time and env steps; None without evaluations) and,
    with a ``solve_return``, the first evaluation that reached it (``"solved"``, and then
    ``"solve_wall_s"``, ``"solve_env_steps"``)."""
    curve = result["curve"]
    best = max(curve, key=lambda e: e["mean_return"], default=None)
    out = dict(result, best=best and {k: best[k] for k in ("mean_return", "time_s", "env_steps")})
    if solve_return is not None:
        first = next((e for e in curve if e["mean_return"] >= solve_return), None)
        out["solved"] = first is not None
        if first:
            out |= {"solve_wall_s": first["time_s"], "solve_env_steps": first["env_steps"]}
    return out


def table(results: list[dict], solve_return: float | None) -> list[str]:
    """Markdown lines: one row per run (results of :func:`summary`, with ``"seed"`` and ``"system"``)."""
    head = "| seed | system | final mean return | env steps | updates | best evaluation (mean @ s, env steps) |"
    rule = "|---|---|---|---|---|---|"
    if solve_return is not None:
        head, rule = head + f" time to {solve_return:g} (s, env steps) |", rule + "---|"
    lines = [head, rule]
    for r in sorted(results, key=lambda r: (r["seed"], r["system"])):
        final, end, best = r.get("final"), r.get("end"), r.get("best")
        cells = [
            str(r["seed"]),
            r["system"],
            "-" if final is None else f"{final['mean_return']:.1f} ({final['episodes']} episodes)",
            "-" if end is None else f"{end['env_steps']:,}",
            "-" if end is None or end["training_steps"] is None else f"{end['training_steps']:,}",
            "-" if best is None else f"{best['mean_return']:.1f} @ {best['time_s']:.0f} s, {best['env_steps']:,}",
        ]
        if solve_return is not None:
            cells.append(f"{r['solve_wall_s']:.0f}, {r['solve_env_steps']:,}" if r["solved"] else "not reached")
        lines.append("| " + " | ".join(cells) + " |")
    if solve_return is not None:
        lines.append("")
        for system in dict.fromkeys(r["system"] for r in results):
            rs = [r for r in results if r["system"] == system]
            lines.append(f"- {system}: {sum(r['solved'] for r in rs)}/{len(rs)} seeds reached {solve_return:g}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="HalfCheetah-v5", choices=sorted(ENVS))
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-time budget per run, each side")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--sac-python", default=None, help="the Python of SB3's virtualenv (none: mpper only)")
    ap.add_argument(
        "--sac-results",
        default=None,
        metavar="JSON",
        help="instead of running SAC, take its runs of these seeds from an earlier results JSON",
    )
    ap.add_argument("--no-mpper", action="store_true", help="run SAC only")
    ap.add_argument(
        "--eval-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="SAC: seconds of training clock between evaluations (default: mpper's config's, per env)",
    )
    ap.add_argument("--sac-learning-starts", type=int, default=None, help="SAC: random steps before updates")
    ap.add_argument("--sac-threads", type=int, default=1, help="SAC: torch threads")
    ap.add_argument("--solve-return", type=float, default=None, help="SAC: stop at an evaluation reaching it")
    ap.add_argument("--tag", default=None, help="name of the results JSON under bench/results (default: sac_ENV)")
    ap.add_argument("--config", default=None, help="mpper's config (default: the env's)")
    ap.add_argument("--workers", type=int, default=None, help="mpper's self-play processes (default: the config's)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="mpper: a config override (repeatable)",
    )
    ap.add_argument("--sac-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    config, eval_interval, learning_starts, solve_return = ENVS[args.env]
    args.config = args.config or config
    args.eval_interval = args.eval_interval or eval_interval
    args.sac_learning_starts = args.sac_learning_starts if args.sac_learning_starts is not None else learning_starts
    args.solve_return = args.solve_return if args.solve_return is not None else solve_return
    if args.sac_child is not None:
        sac_child(args, Path(args.out))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = earlier_runs(args.sac_results, SAC, args.seeds)
    out = RESULTS / f"{args.tag or 'sac_' + args.env.split('-')[0].lower()}.json"
    for seed in args.seeds:
        if args.sac_python and not args.sac_results:
            print(f"seed {seed}: SAC ...", file=sys.stderr, flush=True)
            results.append(run_sac(seed, args))
            out.write_text(json.dumps(results, indent=1))
        if not args.no_mpper:
            print(f"seed {seed}: mpper ...", file=sys.stderr, flush=True)
            results.append(run_mpper_side(seed, args))
            out.write_text(json.dumps(results, indent=1))
    seeds = " ".join(str(s) for s in args.seeds)
    sets = "".join(f" --set {o}" for o in args.overrides) + (f" --workers {args.workers}" if args.workers else "")
    print(f"# {args.env}, {args.minutes:g} min a run: `python bench/sac_mujoco.py --env {args.env} --minutes "
          f"{args.minutes:g} --seeds {seeds} --config {args.config}{sets}` ({time.strftime('%Y-%m-%d')})\n")  # fmt: skip
    print("\n".join(table(results, args.solve_return)))
    for settings in dict.fromkeys(json.dumps(r["settings"]) for r in results if "settings" in r):
        sac = json.loads(settings)
        print(f"\nSAC: SB3's defaults with learning_starts {sac['learning_starts']:,}, torch threads "
              f"{sac['torch_threads']}, {sac['minutes']:g} min of training clock, evaluated every "
              f"{sac['eval_interval_s']:g} s of it (the clock stops while it evaluates)")  # fmt: skip
    print(f"\n(every evaluation of every run: {out.relative_to(RESULTS.parents[1])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
