"""MinAtar Breakout: mpper's DQN beside Stable-Baselines3's, the same wall-clock budget
each; mpper's MuZero alone.

Per seed, one after the other: mpper (``--config``, default
``configs/minatar_breakout_dqn.json``; ``--workers 2``) for ``--minutes`` of wall time,
then (DQN configs) SB3's ``DQN`` with the same network and the same
hyperparameters (the MinAtar paper's: replay of 100,000 transitions, batch 32, one update
per environment step, Adam at 2.5e-4, a target copy every 1,000 updates, 5,000 steps before
the first update, gamma 0.99) for the same budget. The network: the MinAtar paper's one 3x3
convolution of 16 channels and a 128-unit ReLU layer; mpper's config puts its dueling head
on it, SB3's DQN has a plain linear head (it has no dueling option). mpper's config also
uses double 3-step targets and prioritized replay (its defaults), SB3 one-step DQN with
uniform replay (its only kind).

Both are evaluated every ``--eval-interval`` seconds on 10 greedy episodes (mpper: its
evaluator process, which takes CPU from its training on the 2 shared cores; SB3: called
from a callback, its evaluation time taken out of its budget, which favours SB3) and, at
the end, on ``--final-episodes`` greedy episodes with env seeds 10,000, 10,001, ... (mpper:
``run.py --evaluate`` of the final ``checkpoint.pt``; SB3: its final model). A random
policy's mean return over the same episodes is printed beside them.

Usage (SB3 in its own virtualenv with stable-baselines3 and minatar)::

    python bench/minatar_breakout.py --seeds 0 1 2 --minutes 30 --sb3-python /path/to/sb3-venv/bin/python
    python bench/minatar_breakout.py --config configs/minatar_breakout.json --only mpper --seeds 0 1 2 --minutes 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
import proctree  # noqa: E402

from mpper.config_files import read_config_file  # noqa: E402  (a config may extend a base)

RESULTS = ROOT / "bench" / "results"
DQN_CONFIG = "configs/minatar_breakout_dqn.json"
ENV_ID = "MinAtar/Breakout-v1"
FINAL_SEED = 10_000


def make_env():
    """MinAtar Breakout as gymnasium registers it: (10, 10, 4) bool planes, sticky actions."""
    import gymnasium as gym
    import minatar.gym

    minatar.gym.register_envs()
    return gym.make(ENV_ID)


def random_returns(episodes: int) -> list[float]:
    """Returns of a uniform random policy on the final evaluation's env seeds."""
    env, rng, out = make_env(), np.random.default_rng(0), []
    for i in range(episodes):
        env.reset(seed=FINAL_SEED + i)
        total, done = 0.0, False
        while not done:
            _, r, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            total, done = total + float(r), term or trunc
        out.append(total)
    return out


# ---- mpper --------------------------------------------------------------------------------


def run_mpper(config: str, seed: int, workers: int, seconds: float, eval_interval: float, final_episodes: int,
              overrides) -> dict:  # fmt: skip
    run_dir = RESULTS / f"{Path(config).stem}-w{workers}-seed{seed}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = [sys.executable, "run.py", "--config", config, "--workers", str(workers), "--seed", str(seed),
           "--run-dir", str(run_dir), "--time-limit", str(seconds), "--device", "cpu",
           "--set", f"runtime.evaluation_interval_s={eval_interval}", "--set", "runtime.evaluation_episodes=10",
           *(a for o in overrides for a in ("--set", o))]  # fmt: skip
    proc, wall, cpu, _ = proctree.run_measured(cmd, ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    end = records[-1]
    batch = json.loads((run_dir / "config.json").read_text())["training"]["batch_size"]
    evaluate = [sys.executable, "run.py", "--evaluate", str(run_dir), "--episodes", str(final_episodes),
                "--seed", str(FINAL_SEED), "--checkpoint", str(run_dir / "checkpoint.pt")]  # fmt: skip
    ev = subprocess.run(evaluate, cwd=ROOT, capture_output=True, text=True)
    if ev.returncode != 0:
        raise RuntimeError(f"{' '.join(evaluate)} failed:\n{ev.stderr[-3000:]}")
    final = json.loads((run_dir / "evaluation.json").read_text())["return"]
    algorithm = json.loads((run_dir / "config.json").read_text())["algorithm"]
    return {"system": f"mpper {algorithm} --workers {workers}", "seed": seed, "wall_s": wall, "cpu_s": cpu,
            "env_steps": end["env_steps"], "updates": end["counters"]["samples"] // batch,
            "final_mean": float(final["mean"]),
            "curve": [(r["time_s"], r["env_steps"], r["evaluation"]["mean_return"])
                      for r in records if r["event"] == "evaluation"]}  # fmt: skip


# ---- Stable-Baselines3 (in a child process of its own virtualenv) -------------------------


def sb3_child(seed: int, seconds: float, eval_interval: float, final_episodes: int, out_dir: str) -> None:
    """Train SB3 DQN for ``seconds`` of training wall time; write ``result.json``."""
    import gymnasium as gym
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class ChannelsFirst(gym.ObservationWrapper):
        """(10, 10, C) bool -> (C, 10, 10) uint8 in {0, 1} (not an image to SB3: no /255)."""

        def __init__(self, env):
            super().__init__(env)
            h, w, c = env.observation_space.shape
            self.observation_space = gym.spaces.Box(0, 1, (c, h, w), np.uint8)

        def observation(self, obs):
            return np.ascontiguousarray(np.moveaxis(obs, -1, 0), dtype=np.uint8)

    class MinAtarNet(BaseFeaturesExtractor):
        """The MinAtar paper's network up to its 128-unit layer (mpper's ``dqn.torso: "minatar"``,
        ``dqn.hidden: [128]``)."""

        def __init__(self, space):
            super().__init__(space, features_dim=128)
            c, h, w = space.shape
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(c, 16, 3, 1), torch.nn.ReLU(), torch.nn.Flatten(),
                torch.nn.Linear(16 * (h - 2) * (w - 2), 128), torch.nn.ReLU(),
            )  # fmt: skip

        def forward(self, x):
            return self.net(x)

    def greedy(model, episodes: int, base_seed: int) -> list[float]:
        env, out = ChannelsFirst(make_env()), []
        for i in range(episodes):
            obs, _ = env.reset(seed=base_seed + i)
            total, done = 0.0, False
            while not done:
                action, _ = model.predict(obs, deterministic=True)
                obs, r, term, trunc, _ = env.step(int(action))
                total, done = total + float(r), term or trunc
            out.append(total)
        return out

    class Budget(BaseCallback):
        """Stops training after ``seconds`` of wall time and evaluates every
        ``eval_interval`` s, the evaluations' time taken out of the budget."""

        def __init__(self):
            super().__init__()
            self.excluded = 0.0
            self.curve = []
            self.t0 = time.monotonic()

        def _on_step(self) -> bool:
            wall = time.monotonic() - self.t0 - self.excluded
            if wall >= eval_interval * len(self.curve):
                w0 = time.monotonic()
                returns = greedy(self.model, 10, 100_000 + 10 * len(self.curve))
                self.excluded += time.monotonic() - w0
                self.curve.append((wall, self.num_timesteps, float(np.mean(returns))))
            return wall < seconds

    torch.set_num_threads(1)  # as every mpper process (runtime.torch_threads)
    env = ChannelsFirst(make_env())
    model = DQN("CnnPolicy", env, learning_rate=2.5e-4, buffer_size=100_000, learning_starts=5_000, batch_size=32,
                gamma=0.99, train_freq=1, gradient_steps=1, target_update_interval=1_000,
                exploration_initial_eps=1.0, exploration_final_eps=0.01, exploration_fraction=100_000 / 1e8,
                policy_kwargs={"features_extractor_class": MinAtarNet, "net_arch": [], "normalize_images": False},
                seed=seed, device="cpu", verbose=0)  # fmt: skip
    budget = Budget()
    model.learn(total_timesteps=int(1e8), callback=budget)
    wall = time.monotonic() - budget.t0 - budget.excluded
    final = greedy(model, final_episodes, FINAL_SEED)
    result = {"seed": seed, "wall_s": wall, "env_steps": model.num_timesteps, "updates": model._n_updates,
              "final_mean": float(np.mean(final)), "curve": budget.curve}  # fmt: skip
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "result.json").write_text(json.dumps(result))


def run_sb3(seed: int, seconds: float, eval_interval: float, final_episodes: int, python: str) -> dict:
    out_dir = RESULTS / f"minatar-sb3-seed{seed}"
    subprocess.run(["rm", "-rf", str(out_dir)], check=True)
    cmd = [python, __file__, "--sb3-child", str(seed), "--seconds", str(seconds), "--eval-interval",
           str(eval_interval), "--final-episodes", str(final_episodes), "--out", str(out_dir)]  # fmt: skip
    proc, _, cpu, _ = proctree.run_measured(cmd, ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"SB3 run failed:\n{proc.stderr[-3000:]}")
    return json.loads((out_dir / "result.json").read_text()) | {"system": "SB3 DQN", "cpu_s": cpu}


# ---- report -------------------------------------------------------------------------------


def report(results: list[dict], random_mean: float, args) -> None:
    seeds = sorted({r["seed"] for r in results})
    config = "" if args.config == DQN_CONFIG else f" --config {args.config}"
    only = f" --only {args.only}" if args.only else ""
    print(f"# MinAtar Breakout, {args.minutes:g} minutes each: `python bench/minatar_breakout.py{config}{only} --seeds "
          f"{' '.join(map(str, seeds))} --minutes {args.minutes:g}` ({time.strftime('%Y-%m-%d')})\n")
    print(f"Final mean greedy return over {args.final_episodes} episodes (env seeds {FINAL_SEED}...); "
          f"a random policy: {random_mean:.2f}.\n")
    print("| seed | system | final mean return | x random | env steps | env steps/s | updates | updates/s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["seed"], r["system"])):
        print(f"| {r['seed']} | {r['system']} | {r['final_mean']:.2f} | {r['final_mean'] / random_mean:.1f} "
              f"| {r['env_steps']:,} | {r['env_steps'] / r['wall_s']:,.0f} | {r['updates']:,} "
              f"| {r['updates'] / r['wall_s']:,.0f} | {r['cpu_s']:,.0f} |")  # fmt: skip
    by_seed = {}
    for r in results:
        by_seed.setdefault(r["seed"], {})[r["system"].split()[0]] = r["final_mean"]
    pairs = {s: v for s, v in by_seed.items() if len(v) == 2}
    if pairs:
        wins = sum(v["mpper"] > v["SB3"] for v in pairs.values())
        print(f"\nmpper's final mean above SB3's on {wins} of {len(pairs)} seeds; medians "
              f"{statistics.median(v['mpper'] for v in pairs.values()):.2f} vs "
              f"{statistics.median(v['SB3'] for v in pairs.values()):.2f}")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    systems = list(dict.fromkeys(r["system"] for r in results))
    for r in results:
        t, _, ret = zip(*r["curve"])
        ax.plot(np.array(t) / 60, ret, color=f"C{systems.index(r['system'])}", alpha=0.8,
                label=r["system"] if r["seed"] == min(x["seed"] for x in results) else None)  # fmt: skip
    ax.set_xlabel("wall minutes")
    ax.set_ylabel("mean greedy return (10 episodes)")
    ax.set_title("MinAtar Breakout, one line per seed", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=DQN_CONFIG, help="mpper's config (SB3 runs beside a DQN config only)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget of each run")
    ap.add_argument("--eval-interval", type=float, default=60.0, help="seconds between 10-episode evaluations")
    ap.add_argument("--final-episodes", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2, help="mpper: --workers")
    ap.add_argument("--sb3-python", default=sys.executable, help="the Python of SB3's virtualenv")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="mpper: a config override (repeatable)")
    ap.add_argument("--only", choices=("mpper", "sb3"), default=None, help="run one system only")
    ap.add_argument("--plot", default=None, help="write the curves here (PNG)")
    ap.add_argument("--report", default=None, help="print the tables of a saved JSON, run nothing")
    ap.add_argument("--sb3-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sb3_child is not None:
        sb3_child(args.sb3_child, args.seconds, args.eval_interval, args.final_episodes, args.out)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    saved = RESULTS / f"minatar-{Path(args.config).stem}.json"
    if args.report:
        data = json.loads(Path(args.report).read_text())
        report(data["results"], data["random_mean"], args)
        return 0
    if args.only != "mpper" and read_config_file(ROOT / args.config)[0].get("algorithm") != "dqn":
        raise SystemExit(f"{args.config}: SB3 runs beside DQN configs only; add --only mpper")
    random_mean = float(np.mean(random_returns(args.final_episodes)))
    results, seconds = [], args.minutes * 60
    for seed in args.seeds:
        if args.only in (None, "mpper"):
            print(f"seed {seed}: mpper ...", file=sys.stderr, flush=True)
            results.append(run_mpper(args.config, seed, args.workers, seconds, args.eval_interval,
                                     args.final_episodes, args.overrides))  # fmt: skip
        if args.only in (None, "sb3"):
            print(f"seed {seed}: SB3 ...", file=sys.stderr, flush=True)
            results.append(run_sb3(seed, seconds, args.eval_interval, args.final_episodes, args.sb3_python))
        saved.write_text(json.dumps({"random_mean": random_mean, "results": results}, indent=1))
    report(results, random_mean, args)
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
