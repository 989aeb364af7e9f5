"""DQN on CartPole-v1: mpper beside Stable-Baselines3, and the settings of easy-rl's PER-DQN notebook.

Two experiments, each printing Markdown tables of what it measured:

``solve`` (default): time to solve CartPole-v1, per seed, mpper
(``configs/cartpole_dqn.json``, ``--workers 2``) and SB3's DQN with the RL Zoo CartPole
hyperparameters, interleaved seed by seed in one run. Both are evaluated the same way: 10
greedy episodes every second of training wall time (``--eval-interval``; mpper's
evaluator process at ``runtime.evaluation_interval_s``, SB3 by its own ``EvalCallback``
called from a timer, its evaluation time taken out of its wall and CPU seconds, so the
comparison favours SB3 slightly). Two rules are reported side by side:

- *first crossing*: the first evaluation with a mean return >= 475 (mpper's config confirms
  a crossing before it stops: its evaluation that reaches 475 plays 20 more episodes with
  the same weights and counts only if the mean of all 30 is still >= 475,
  ``runtime.solve_confirm_episodes``; SB3's crossing is its 10-episode mean);
- *solve that holds*: that first crossing, counted only when the agent the user keeps
  still averages >= 475 over 20 fresh greedy episodes (seeds 10,000-10,019) at the end;
  otherwise the run is unsolved (infinite time in the medians).

The agent kept: mpper's ``best.pt`` (it stops at its first crossing; ``best.pt`` holds the
weights of its best evaluation); SB3's model at the end of its 5e4 steps, and, as a third
row, the ``best_model.zip`` its ``EvalCallback(best_model_save_path=...)`` wrote.

SB3 runs are repeatable per seed: ``DQN(seed=...)`` seeds its env, its action space,
numpy, random and torch; one torch thread; its greedy evaluations draw no random numbers
from the training RNGs, so the final model does not depend on when they ran (each run
prints a hash of its final parameters to check). mpper's runs with several processes are
not repeatable (process scheduling decides which episode lands first).

``easyrl``: ``configs/cartpole_dqn_easyrl.json`` (the notebook's hyperparameters, one
worker, 100 episodes of at most 200 steps) over 5 seeds: the first training episode
that reached 200, whether that was by episode 70 (the notebook's printed run), the mean
of the last 10 training episodes, and 20 greedy test episodes at the end.

Usage (SB3 in its own virtualenv, named by ``--sb3-python``)::

    python bench/solve_dqn.py --seeds 0 1 2 3 4 5 6 7 8 9 --sb3-python /path/to/sb3-venv/bin/python
    python bench/solve_dqn.py --experiment easyrl --seeds 0 1 2 3 4

Wall seconds are counted from the start of training (mpper: its supervisor's start, so
its child processes' start-up is in; SB3: the creation of its model); the summary also
gives them from the launch of each process (interpreter and imports in, for both).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proctree  # noqa: E402

RESULTS = ROOT / "bench" / "results"
THRESHOLD = 475.0


def run_measured(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, float, float]:
    """``proctree.run_measured`` in the repository root."""
    return proctree.run_measured(cmd, ROOT)


def greedy_eval(run_dir: Path, checkpoint: str, episodes: int = 20, seed: int = 10_000) -> float:
    """Mean return of ``episodes`` greedy episodes with ``run.py --evaluate``."""
    cmd = [sys.executable, "run.py", "--evaluate", str(run_dir), "--episodes", str(episodes), "--seed", str(seed),
           "--checkpoint", str(run_dir / checkpoint)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return float(json.loads((run_dir / "evaluation.json").read_text())["return"]["mean"])


# ---- mpper --------------------------------------------------------------------------------


def run_mpper(config: str, seed: int, workers: int, time_limit: float, eval_interval: float, overrides=()) -> dict:
    run_dir = RESULTS / f"dqn-w{workers}-seed{seed}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = [sys.executable, "run.py", "--config", config, "--workers", str(workers), "--seed", str(seed),
           "--run-dir", str(run_dir), "--time-limit", str(time_limit), "--device", "cpu",
           "--set", f"runtime.evaluation_interval_s={eval_interval}", "--set", "runtime.evaluation_episodes=10",
           "--set", f"runtime.solve_return={THRESHOLD}", *(a for o in overrides for a in ("--set", o))]  # fmt: skip
    proc, wall, cpu, launched = run_measured(cmd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = [r for r in records if r["event"] == "evaluation" and "mean_return" in r["evaluation"]]  # not stopped early
    crossed = next((r for r in evals if r["evaluation"]["mean_return"] >= THRESHOLD), None)
    out = {"system": f"mpper --workers {workers}", "keeps": "best.pt", "seed": seed, "wall_s_total": wall,
           "cpu_s_total": cpu, "crossed": crossed is not None, "run_dir": str(run_dir),
           "curve": [(r["time_s"], r["env_steps"], r["evaluation"]["mean_return"]) for r in evals]}  # fmt: skip
    if crossed is not None:  # the run stops at its first crossing: its CPU is the CPU to threshold
        out |= {"wall_s": crossed["time_s"], "env_steps": crossed["env_steps"], "cpu_s": cpu,
                "launch_s": crossed["unix_time"] - launched}  # fmt: skip
    out["kept_return"] = greedy_eval(run_dir, "best.pt") if (run_dir / "best.pt").exists() else float("nan")
    return out


# ---- Stable-Baselines3 (in a child process of its own virtualenv) -------------------------

# The RL Zoo's CartPole-v1 DQN hyperparameters (rl-baselines3-zoo hyperparams/dqn.yml), run
# for its n_timesteps; exploration_fraction is a share of those env steps.
RL_ZOO_CARTPOLE_DQN = {"learning_rate": 2.3e-3, "batch_size": 64, "buffer_size": 100_000, "learning_starts": 1000,
                       "gamma": 0.99, "target_update_interval": 10, "train_freq": 256, "gradient_steps": 128,
                       "exploration_fraction": 0.16, "exploration_final_eps": 0.04,
                       "policy_kwargs": {"net_arch": [256, 256]}}  # fmt: skip
RL_ZOO_CARTPOLE_TIMESTEPS = 50_000


def sb3_greedy_returns(model, episodes: int, base_seed: int) -> list[float]:
    """Returns of ``episodes`` greedy (deterministic) CartPole-v1 episodes of an SB3 model,
    episode ``i`` first reset with seed ``base_seed + i``."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=base_seed + i)
        total, done = 0.0, False
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, r, term, trunc, _ = env.step(int(action))
            total += r
            done = term or trunc
        returns.append(total)
    return returns


def sb3_child(seed: int, eval_interval: float, out_dir: str) -> None:
    """Train SB3 DQN with the RL Zoo CartPole-v1 hyperparameters for its 5e4 steps, with
    SB3's ``EvalCallback`` (10 greedy episodes, best model saved) called every
    ``eval_interval`` seconds of training; write ``result.json`` to ``out_dir``."""
    import hashlib

    import gymnasium as gym
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    def final_return(model, episodes: int = 20, base_seed: int = 10_000) -> float:
        return float(np.mean(sb3_greedy_returns(model, episodes, base_seed)))

    class TimedEval(BaseCallback):
        """Calls SB3's own EvalCallback every ``eval_interval`` s of training wall time,
        and takes the time it spends out of the run's wall and CPU seconds."""

        def __init__(self, evaluation: EvalCallback):
            super().__init__()
            self.evaluation = evaluation
            self.excluded_wall = self.excluded_cpu = 0.0
            self.curve, self.crossed = [], None
            self.t0, self.c0 = time.monotonic(), time.process_time()

        def _init_callback(self) -> None:
            self.evaluation.init_callback(self.model)

        def _on_step(self) -> bool:
            wall = time.monotonic() - self.t0 - self.excluded_wall
            if wall < eval_interval * (len(self.curve) + 1):
                return True
            w0, c0 = time.monotonic(), time.process_time()
            self.evaluation.on_step()  # EvalCallback(eval_freq=1): evaluates at every call
            self.excluded_wall += time.monotonic() - w0
            self.excluded_cpu += time.process_time() - c0
            mean = self.evaluation.last_mean_reward
            cpu = time.process_time() - self.c0 - self.excluded_cpu
            self.curve.append((wall, self.num_timesteps, mean))
            if self.crossed is None and mean >= THRESHOLD:
                self.crossed = {"wall_s": wall, "cpu_s": cpu, "env_steps": self.num_timesteps,
                                "crossed_unix": time.time() - self.excluded_wall}  # fmt: skip
            return True

    # One torch thread, as every mpper process (runtime.torch_threads): on this 2-core
    # machine it is also SB3's faster setting.
    torch.set_num_threads(1)
    out = Path(out_dir)
    eval_env = DummyVecEnv([lambda: Monitor(gym.make("CartPole-v1"))])
    eval_env.seed(100_000 + seed)
    evaluation = EvalCallback(eval_env, n_eval_episodes=10, eval_freq=1, deterministic=True,
                              best_model_save_path=str(out), verbose=0)  # fmt: skip
    model = DQN("MlpPolicy", "CartPole-v1", **RL_ZOO_CARTPOLE_DQN, seed=seed, device="cpu", verbose=0)
    timer = TimedEval(evaluation)
    model.learn(total_timesteps=RL_ZOO_CARTPOLE_TIMESTEPS, callback=timer)
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.policy.parameters())).hexdigest()
    result = {"seed": seed, "crossed": timer.crossed is not None, "curve": timer.curve,
              "wall_s_total": time.monotonic() - timer.t0 - timer.excluded_wall,
              "torch_threads": torch.get_num_threads(), "final_params_sha256": params[:16],
              "final_return": final_return(model),
              "best_model_return": final_return(DQN.load(out / "best_model.zip", device="cpu")),
              "best_model_eval_mean": evaluation.best_mean_reward}  # fmt: skip
    if timer.crossed:
        result |= timer.crossed
    (out / "result.json").write_text(json.dumps(result))


def run_sb3(seed: int, eval_interval: float, python: str) -> list[dict]:
    """One SB3 run, as two rows: its final model, and its EvalCallback's best model."""
    out_dir = RESULTS / f"sb3-seed{seed}"
    subprocess.run(["rm", "-rf", str(out_dir)], check=True)
    cmd = [python, __file__, "--sb3-child", str(seed), "--eval-interval", str(eval_interval), "--out", str(out_dir)]
    launched = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"SB3 run failed:\n{proc.stderr[-3000:]}")
    res = json.loads((out_dir / "result.json").read_text())
    common = {k: res[k] for k in ("seed", "crossed", "curve", "wall_s_total", "final_params_sha256")}
    if res["crossed"]:  # from the launch of its process: imports and model construction included
        common |= {k: res[k] for k in ("wall_s", "cpu_s", "env_steps")}
        common["launch_s"] = res["crossed_unix"] - launched
    return [common | {"system": "SB3 DQN (RL Zoo)", "keeps": "final model", "kept_return": res["final_return"]},
            common | {"system": "SB3 DQN (RL Zoo)", "keeps": "EvalCallback best model",
                      "kept_return": res["best_model_return"]}]  # fmt: skip


# ---- reports --------------------------------------------------------------------------------


def solve_experiment(args) -> list[dict]:
    results = []
    for seed in args.seeds:
        for workers in args.workers:
            print(f"seed {seed}: mpper --workers {workers} ...", file=sys.stderr, flush=True)
            results.append(run_mpper(args.config, seed, workers, args.time_limit, args.eval_interval, args.overrides))
        if not args.skip_sb3:
            print(f"seed {seed}: SB3 ...", file=sys.stderr, flush=True)
            results.extend(run_sb3(seed, args.eval_interval, args.sb3_python))
        RESULTS.joinpath("dqn_solve_partial.json").write_text(json.dumps(results, indent=1))
    print_solve_report(results, args)
    return results


def holds(r: dict) -> bool:
    """A solve that holds: crossed, and the kept agent averages >= 475 over 20 fresh episodes."""
    return r["crossed"] and r["kept_return"] >= THRESHOLD


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median and quartiles (the mean of the two nearest observations where the rank falls
    between two, numpy's "midpoint"); unsolved runs enter as infinity, so a quartile next to
    an infinite observation is infinite (numpy's own interpolation makes that nan)."""
    v = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(v) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return v[lo] if lo == hi else (v[lo] + v[hi]) / 2

    return at(0.5), at(0.25), at(0.75)


def _fmt(x: float, digits: int = 1) -> str:
    return "inf" if math.isinf(x) else f"{x:,.{digits}f}"


def row_label(r: dict) -> str:
    return f"{r['system']}, {r['keeps']}"


def summarise(results: list[dict]) -> dict[str, dict]:
    """Per row label: counts and (median, q1, q3) under both rules."""
    out = {}
    for label in dict.fromkeys(row_label(r) for r in results):
        rs = [r for r in results if row_label(r) == label]
        row = {"n": len(rs), "crossed": sum(r["crossed"] for r in rs), "held": sum(holds(r) for r in rs),
               "kept_returns": [r["kept_return"] for r in rs]}  # fmt: skip
        for rule, ok in (("first", lambda r: r["crossed"]), ("holds", holds)):
            for key in ("wall_s", "cpu_s", "env_steps", "launch_s"):
                row[rule, key] = _quartiles([r[key] if ok(r) else math.inf for r in rs])
        out[label] = row
    return out


def print_solve_report(results: list[dict], args) -> None:
    """The Markdown tables of a ``solve`` run (``results``: what ``solve_experiment``
    returned, or the JSON it saved)."""
    seeds = sorted({r["seed"] for r in results})
    sets = "".join(f" --set {o}" for o in getattr(args, "overrides", []))
    print(f"# CartPole-v1 DQN, time to a mean greedy return >= {THRESHOLD:g} (10 episodes, every "
          f"{args.eval_interval:g} s): `python bench/solve_dqn.py --seeds {' '.join(map(str, seeds))}{sets}`\n")  # fmt: skip
    print("| system | agent kept | seed | first crossing: wall s | CPU s | env steps | kept agent, 20 fresh episodes "
          "| holds |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["seed"], row_label(r))):
        cells = [_fmt(r["wall_s"]), _fmt(r["cpu_s"]), f"{r['env_steps']:,}"] if r["crossed"] else ["-", "-", "-"]
        print(f"| {r['system']} | {r['keeps']} | {r['seed']} | {' | '.join(cells)} | {r['kept_return']:.1f} "
              f"| {'yes' if holds(r) else 'no'} |")  # fmt: skip
    summary = summarise(results)
    print("\nMedian [quartiles]; a run that did not solve under a rule counts as infinite time.\n")
    print("| system | agent kept | first crossing | median wall s | median CPU s | median env steps "
          "| solve that holds | median wall s | median CPU s | median env steps | kept agent's return (min-max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def mqq(q: tuple, digits: int = 1) -> str:
        return f"{_fmt(q[0], digits)} [{_fmt(q[1], digits)}, {_fmt(q[2], digits)}]"

    for label, s in summary.items():
        system, keeps = label.split(", ", 1)
        kept = s["kept_returns"]
        print(f"| {system} | {keeps} | {s['crossed']}/{s['n']} | {mqq(s['first', 'wall_s'])} "
              f"| {mqq(s['first', 'cpu_s'])} | {mqq(s['first', 'env_steps'], 0)} | {s['held']}/{s['n']} "
              f"| {mqq(s['holds', 'wall_s'])} | {mqq(s['holds', 'cpu_s'])} | {mqq(s['holds', 'env_steps'], 0)} "
              f"| {statistics.median(kept):.1f} ({min(kept):.1f}-{max(kept):.1f}) |")  # fmt: skip
    sb3 = {label: s for label, s in summary.items() if label.startswith("SB3")}
    for label, s in summary.items():
        if label.startswith("SB3"):
            continue
        for sb3_label, t in sb3.items():
            for rule, name in (("first", "first crossing"), ("holds", "solve that holds")):
                mine, theirs = s[rule, "wall_s"][0], t[rule, "wall_s"][0]
                ratio = mine / theirs if math.isfinite(theirs) else 0.0
                launch = s[rule, "launch_s"][0] / t[rule, "launch_s"][0] if math.isfinite(t[rule, "launch_s"][0]) else 0.0
                print(f"\n{label} vs {sb3_label}, {name}: median wall time {_fmt(mine)} s vs {_fmt(theirs)} s = "
                      f"{_fmt(ratio, 2)}x ({_fmt(launch, 2)}x counted from the launch of each process)")  # fmt: skip
    shas = {}
    for r in results:
        if r["system"].startswith("SB3"):
            shas.setdefault(r["seed"], set()).add(r["final_params_sha256"])
    if shas:
        print("\nSB3 final parameters (sha256, first 16 hex digits) by seed: "
              + ", ".join(f"{k}: {'/'.join(sorted(v))}" for k, v in sorted(shas.items())))


def plot_solve_times(results: list[dict], path: Path) -> None:
    """Per-seed wall seconds to the first crossing: dots where the solve held, crosses
    where the kept agent fell below 475 (unsolved under that rule), a bar at the median of
    the solves that hold (unsolved counted as infinite; no bar when that median is)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(row_label(r) for r in results))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, label in enumerate(labels):
        rs = [r for r in results if row_label(r) == label]
        jitter = np.linspace(-0.15, 0.15, len(rs))
        held = [(i + j, r["wall_s"]) for j, r in zip(jitter, rs) if holds(r)]
        fell = [(i + j, r["wall_s"]) for j, r in zip(jitter, rs) if r["crossed"] and not holds(r)]
        if held:
            ax.scatter(*zip(*held), color=f"C{i}", s=22)
        if fell:
            ax.scatter(*zip(*fell), color=f"C{i}", marker="x", s=34)
        median = _quartiles([r["wall_s"] if holds(r) else math.inf for r in rs])[0]
        if math.isfinite(median):
            ax.hlines(median, i - 0.25, i + 0.25, color=f"C{i}")
    ax.set_xticks(range(len(labels)), [label.replace(", ", "\n") for label in labels], fontsize=8)
    ax.set_ylabel("wall s to the first crossing")
    ax.set_ylim(bottom=0)
    ax.set_title(f"CartPole-v1 DQN, {len({r['seed'] for r in results})} seeds; x: the kept agent did not hold, "
                 "bar: median of the solves that hold", fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def easyrl_experiment(args) -> list[dict]:
    results = []
    for seed in args.seeds:
        print(f"seed {seed}: configs/cartpole_dqn_easyrl.json ...", file=sys.stderr, flush=True)
        run_dir = RESULTS / f"dqn-seedcfg-seed{seed}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        t0 = time.monotonic()
        cmd = [sys.executable, "run.py", "--config", "configs/cartpole_dqn_easyrl.json", "--seed", str(seed),
               "--run-dir", str(run_dir), "--device", "cpu"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - t0
        returns = [json.loads(line)["return"] for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
        first = next((i + 1 for i, r in enumerate(returns) if r >= 200), None)
        results.append({"seed": seed, "exit_code": proc.returncode, "wall_s": wall, "episodes": len(returns),
                        "first_200": first, "last10": float(np.mean(returns[-10:])),
                        "test_return": greedy_eval(run_dir, "checkpoint.pt", 20), "returns": returns})  # fmt: skip
    print("# easy-rl PER-DQN hyperparameters (configs/cartpole_dqn_easyrl.json): "
          f"`python bench/solve_dqn.py --experiment easyrl --seeds {' '.join(map(str, args.seeds))}`\n")
    print("| seed | episodes | first episode with return 200 | by episode 70 | mean of last 10 | 20 greedy test episodes | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['seed']} | {r['episodes']} | {r['first_200'] or 'never'} | "
              f"{'yes' if r['first_200'] and r['first_200'] <= 70 else 'no'} | {r['last10']:.1f} | "
              f"{r['test_return']:.1f} | {r['wall_s']:.0f} |")  # fmt: skip
    hits = sum(1 for r in results if r["first_200"] and r["first_200"] <= 70)
    print(f"\nreached 200 by episode 70 in {hits}/{len(results)} seeds")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", choices=("solve", "easyrl"), default="solve")
    ap.add_argument("--config", default="configs/cartpole_dqn.json")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--time-limit", type=float, default=300.0, help="mpper: seconds per run")
    ap.add_argument("--eval-interval", type=float, default=1.0, help="seconds of training between evaluations")
    ap.add_argument("--workers", type=int, nargs="+", default=[2], help="mpper: --workers values to run")
    ap.add_argument("--sb3-python", default=sys.executable, help="the Python of SB3's virtualenv")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="mpper: a config override (repeatable), e.g. --set training.batch_size=128")
    ap.add_argument("--skip-sb3", action="store_true")
    ap.add_argument("--plot", default=None, help="solve: write the per-seed plot here (PNG)")
    ap.add_argument("--report", default=None, help="solve: print the tables of a saved JSON, run nothing")
    ap.add_argument("--sb3-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.sb3_child is not None:
        sb3_child(args.sb3_child, args.eval_interval, args.out)
        return 0
    if args.report:
        results = json.loads(Path(args.report).read_text())
        print_solve_report(results, args)
        if args.plot:
            plot_solve_times(results, Path(args.plot))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = solve_experiment(args) if args.experiment == "solve" else easyrl_experiment(args)
    out = Path(args.out or RESULTS / f"dqn_{args.experiment}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    if args.experiment == "solve" and args.plot:
        plot_solve_times(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
