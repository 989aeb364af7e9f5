"""Why a CartPole solve does not hold: what the value head says of failing states, and
what the replay buffer holds of them, against training steps, beside the greedy return.

Reads the run directories ``bench/holds.py --tag TAG`` wrote, run with
``--set runtime.weights_history_interval_steps=N`` so that each holds its weights history
(``weights/step-<step>.pt``). For every kept set of weights:

- **value error on held-out failing states**: states from the last moves of CartPole
  episodes played with random actions (env seeds ``--states-seed + k``, never seen by a
  run), kept when *no* action sequence survives ``--horizon`` more steps, checked by
  exhausting all ``2^horizon`` sequences with CartPole's own equations. From such a state
  every policy's value is the same, ``sum_{j < m} gamma^j`` with ``m`` the most steps any
  sequence survives (the failing step still pays 1), so the network's value there has one
  right answer whatever its policy. The figure is the mean of (predicted - true).
- **failing states in the buffer**: from ``episodes.jsonl``, the terminated episodes
  (shorter than the time limit) among the newest ``replay.capacity`` stored steps, at
  each progress record's training step.
- the greedy return of the evaluations and the learning rate, from ``metrics.jsonl``.

It prints, per seed and pooled, the value error and the buffer's failing episodes at the
evaluations after the first solve that reached the target and at those that did not, and
draws them against training steps (``--figure``).

Usage::

    python bench/holds.py --tag base --set runtime.weights_history_interval_steps=250
    python bench/holds_cause.py --tag base --figure docs/experiments/holds_cause.png
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpper.algos.configs import load_config  # noqa: E402
from mpper.algos.muzero.networks import support_to_scalar  # noqa: E402
from mpper.api import Agent  # noqa: E402

RESULTS = ROOT / "bench" / "results"

# CartPole-v1's equations (gymnasium's classic_control/cartpole.py, Euler integration)
GRAVITY, MASS_CART, MASS_POLE, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
THETA_LIMIT, X_LIMIT = 12 * 2 * math.pi / 360, 2.4


def cartpole_step(state: np.ndarray, action: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """States (N, 4) float64 and actions (N,) in {0, 1} -> next states, terminated (N,)."""
    x, x_dot, theta, theta_dot = state.T
    force = np.where(action == 1, FORCE, -FORCE)
    cos, sin = np.cos(theta), np.sin(theta)
    total_mass, pole_mass_length = MASS_CART + MASS_POLE, MASS_POLE * HALF_LENGTH
    temp = (force + pole_mass_length * theta_dot**2 * sin) / total_mass
    theta_acc = (GRAVITY * sin - cos * temp) / (HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos**2 / total_mass))
    x_acc = temp - pole_mass_length * theta_acc * cos / total_mass
    x, x_dot = x + TAU * x_dot, x_dot + TAU * x_acc
    theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * theta_acc
    nxt = np.stack([x, x_dot, theta, theta_dot], axis=1)
    return nxt, (np.abs(x) > X_LIMIT) | (np.abs(theta) > THETA_LIMIT)


def most_steps_survived(state: np.ndarray, horizon: int) -> int:
    """The most steps any action sequence of length ``horizon`` takes from ``state`` (4,)
    before its failing step, counting that step: ``horizon + 1`` when one survives all."""
    states = state[None, :].astype(np.float64)
    alive = np.ones(1, bool)
    for depth in range(horizon):
        states = np.repeat(states, 2, axis=0)
        alive = np.repeat(alive, 2)
        actions = np.tile([0, 1], len(states) // 2)
        states, failed = cartpole_step(states, actions)
        failing_now = alive & failed
        alive = alive & ~failed
        if not alive.any():
            return depth + 1 if failing_now.any() else depth
    return horizon + 1


def failing_states(count: int, seed: int, horizon: int, gamma: float, last_moves: int = 12):
    """Held-out doomed states: observations (N, 4) float32, true values (N,) float64."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    obs_out, values = [], []
    k = 0
    while len(obs_out) < count:
        obs, _ = env.reset(seed=seed + k)
        k += 1
        trajectory, done = [], False
        while not done:
            trajectory.append(np.array(env.unwrapped.state, np.float64))
            obs, _, terminated, truncated, _ = env.step(int(rng.integers(2)))
            done = terminated or truncated
        if not terminated:
            continue
        for state in trajectory[-last_moves:]:
            m = most_steps_survived(state, horizon)
            if m <= horizon:
                obs_out.append(state.astype(np.float32))
                values.append(sum(gamma**j for j in range(m)))
    env.close()
    return np.stack(obs_out[:count]), np.array(values[:count])


def value_error(weights: Path, config, observations: np.ndarray, truth: np.ndarray) -> float:
    agent = Agent(config, weights)
    with torch.no_grad():
        out = agent.network.initial_inference(torch.as_tensor(observations))
        predicted = support_to_scalar(out.value_logits, config.network.support_size).reshape(-1).numpy()
    return float(np.mean(predicted - truth))


def support_max(config) -> float:
    """The largest value the value head can say: the top of its support, back through h^-1."""
    from mpper.algos.muzero.networks import h_inv

    return float(h_inv(torch.tensor(float(config.network.support_size))))


def failing_play(config, weights: Path, episodes: int, seed: int) -> list[dict]:
    """Greedy episodes of ``weights`` (env seeds ``seed + k``), as the evaluator plays them;
    for each one that failed before the time limit: how (``"x"``: the cart left the track,
    ``"theta"``: the pole fell), when, and per visited state the moves left to the failure
    and the network's value there."""
    import gymnasium as gym

    agent = Agent(config, weights)
    env = gym.make(config.env.id)
    out = []
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        agent.reset()
        seen, done, terminated = [], False, False
        while not done:
            seen.append(np.asarray(obs, np.float32))
            obs, _, terminated, truncated, _ = env.step(int(agent.act(obs)))
            done = terminated or truncated
        if not terminated:
            continue
        with torch.no_grad():
            logits = agent.network.initial_inference(torch.as_tensor(np.stack(seen))).value_logits
            values = support_to_scalar(logits, config.network.support_size).reshape(-1).numpy()
        state = env.unwrapped.state
        out.append({"length": len(seen), "how": "x" if abs(state[0]) > X_LIMIT else "theta",
                    "moves_left": list(range(len(seen), 0, -1)), "value": values.tolist()})  # fmt: skip
    env.close()
    return out


def records(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def buffer_failures(run_dir: Path, config, recs: list[dict]) -> tuple[list[int], list[int]]:
    """(training steps, terminated episodes among the newest replay.capacity steps) at
    each record that has a training step."""
    limit = config.env.max_episode_steps or 500
    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines() if line.strip()]
    times = [e["time_s"] for e in episodes]
    steps_at, failures = [], []
    for r in recs:
        step = (r.get("learner") or {}).get("training_step")
        if step is None:
            continue
        stored = episodes[: bisect.bisect_right(times, r["time_s"])]
        total, failed = 0, 0
        for e in reversed(stored):
            if total + e["length"] > config.replay.capacity:
                break
            total += e["length"]
            failed += e["length"] < limit
        steps_at.append(step)
        failures.append(failed)
    return steps_at, failures


def at(xs: list[int], ys: list, x: int):
    """ys at the last xs <= x (the first one if none)."""
    i = max(0, bisect.bisect_right(xs, x) - 1)
    return ys[i]


def analyse(run_dir: Path, args, observations, truth) -> dict:
    config = load_config(run_dir / "config.json")
    recs = records(run_dir)
    evals = [(r["evaluation"]["training_step"], r["evaluation"]["mean_return"]) for r in recs
             if r.get("event") == "evaluation" and "mean_return" in (r.get("evaluation") or {})]  # fmt: skip
    history = sorted((run_dir / "weights").glob("step-*.pt"))
    weight_steps = [int(p.stem.split("-")[1]) for p in history]
    errors = [value_error(p, config, observations, truth) for p in history]
    buf_steps, buf_failures = buffer_failures(run_dir, config, recs)
    lr = [(r["learner"]["training_step"], r["learner"]["lr"]) for r in recs if "lr" in (r.get("learner") or {})]
    solve = next((s for s, m in evals if m >= args.target), None)
    out = {"run": run_dir.name, "evaluations": evals, "weights_steps": weight_steps, "value_error": errors,
           "buffer_steps": buf_steps, "buffer_failed_episodes": buf_failures, "lr": lr, "solve_step": solve}  # fmt: skip
    if solve is None or not history:
        return out
    after = [(s, m) for s, m in evals if s > solve]
    fell_at = [s for s, m in after if m < args.target][: args.failing_weights]
    out["failures"] = [f for s in fell_at for f in failing_play(config, history[max(0, bisect.bisect_right(
        weight_steps, s) - 1)], args.failing_episodes, args.states_seed)]  # fmt: skip
    for name, group in (("held", [e for e in after if e[1] >= args.target]),
                        ("fell", [e for e in after if e[1] < args.target])):  # fmt: skip
        out[name] = {"count": len(group),
                     "value_error": [at(weight_steps, errors, s) for s, _ in group],
                     "buffer_failed_episodes": [at(buf_steps, buf_failures, s) for s, _ in group],
                     "lr": [at([a for a, _ in lr], [b for _, b in lr], s) for s, _ in group]}  # fmt: skip
    return out


def mean(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", required=True, help="bench/holds.py --tag of the runs")
    ap.add_argument("--target", type=float, default=475.0)
    ap.add_argument("--states", type=int, default=400, help="held-out failing states")
    ap.add_argument("--states-seed", type=int, default=70_000_000)
    ap.add_argument("--horizon", type=int, default=10, help="a state is failing when no sequence survives this long")
    ap.add_argument(
        "--failing-weights",
        type=int,
        default=3,
        metavar="N",
        help="per seed, the weights of its first N evaluations below the target after the first solve "
        "play --failing-episodes greedy episodes each",
    )
    ap.add_argument("--failing-episodes", type=int, default=2)
    ap.add_argument("--figure", type=Path, help="draw value error, buffer failures and returns per seed")
    args = ap.parse_args()
    runs = sorted(RESULTS.glob(f"holds-{args.tag}-seed*"), key=lambda p: int(p.name.rsplit("seed", 1)[1]))
    if not runs:
        print(f"error: no run directories bench/results/holds-{args.tag}-seed*", file=sys.stderr)
        return 2
    gamma = load_config(runs[0] / "config.json").mcts.discount
    observations, truth = failing_states(args.states, args.states_seed, args.horizon, gamma)
    print(f"{len(truth)} held-out failing states; true value mean {truth.mean():.2f} (max {truth.max():.2f})")
    results = [analyse(run, args, observations, truth) for run in runs]
    print(
        "| run | first solve step | evaluations after: held / fell | value error: held / fell "
        "| failed episodes in buffer: held / fell | lr: held / fell |"
    )
    print("|---|---|---|---|---|---|")
    pooled: dict[str, dict[str, list]] = {"held": {}, "fell": {}}
    for r in results:
        if "held" not in r:
            print(f"| {r['run']} | {r['solve_step']} | - | - | - | - |")
            continue
        h, f = r["held"], r["fell"]
        for name, group in (("held", h), ("fell", f)):
            for key in ("value_error", "buffer_failed_episodes", "lr"):
                pooled[name].setdefault(key, []).extend(group[key])
        print(f"| {r['run']} | {r['solve_step']:,} | {h['count']} / {f['count']} "
              f"| {mean(h['value_error']):.1f} / {mean(f['value_error']):.1f} "
              f"| {mean(h['buffer_failed_episodes']):.1f} / {mean(f['buffer_failed_episodes']):.1f} "
              f"| {mean(h['lr']):.4f} / {mean(f['lr']):.4f} |")  # fmt: skip
    h, f = pooled["held"], pooled["fell"]
    print(f"| pooled | | {len(h.get('lr', []))} / {len(f.get('lr', []))} "
          f"| {mean(h.get('value_error', [])):.1f} / {mean(f.get('value_error', [])):.1f} "
          f"| {mean(h.get('buffer_failed_episodes', [])):.1f} / {mean(f.get('buffer_failed_episodes', [])):.1f} "
          f"| {mean(h.get('lr', [])):.4f} / {mean(f.get('lr', [])):.4f} |")  # fmt: skip
    failures = [f for r in results for f in r.get("failures", [])]
    config = load_config(runs[0] / "config.json")
    top = support_max(config)
    print(
        f"\ngreedy episodes of the weights of failing evaluations: {len(failures)} failed, "
        f"{sum(f['how'] == 'x' for f in failures)} of them by the cart leaving the track; median length "
        f"{np.median([f['length'] for f in failures]) if failures else math.nan:.0f} moves"
    )
    print(
        f"value head's largest value (support_size {config.network.support_size}): {top:.1f}; "
        f"never failing is worth 1 / (1 - gamma) = {1 / (1 - gamma):.1f}"
    )
    print(
        "| moves left to the failure | states | value the network says: mean | its share at >= 95% of the top "
        "| return that followed |"
    )
    print("|---|---|---|---|---|")
    left = np.array([m for f in failures for m in f["moves_left"]])
    said = np.array([v for f in failures for v in f["value"]])
    for lo, hi in ((1, 25), (26, 50), (51, 100), (101, 150), (151, 200), (201, 300), (301, 500)):
        sel = (left >= lo) & (left <= hi)
        if sel.any():
            followed = (1 - gamma ** left[sel]) / (1 - gamma)
            print(f"| {lo}-{hi} | {sel.sum()} | {said[sel].mean():.1f} | {np.mean(said[sel] >= 0.95 * top):.0%} "
                  f"| {followed.mean():.1f} |")  # fmt: skip
    (RESULTS / f"holds_cause_{args.tag}.json").write_text(json.dumps(results))
    if args.figure:
        args.gamma, args.top = gamma, top
        draw(results, args)
    return 0


def draw(results: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(9, 11))
    grid = fig.add_gridspec(4, 1, height_ratios=[1, 1, 1, 1.3])
    axes = [fig.add_subplot(grid[0])]
    axes += [fig.add_subplot(grid[i], sharex=axes[0]) for i in (1, 2)]
    for r in results:
        line = axes[0].plot(*zip(*r["evaluations"], strict=True), lw=1)[0]
        color = line.get_color()
        if r["weights_steps"]:
            axes[1].plot(r["weights_steps"], r["value_error"], lw=1, color=color)
        axes[2].plot(r["buffer_steps"], r["buffer_failed_episodes"], lw=1, color=color)
        if r["solve_step"] is not None:
            for ax in axes:
                ax.axvline(r["solve_step"], color=color, lw=0.5, ls=":")
    axes[0].axhline(args.target, color="k", lw=0.5)
    axes[0].set_ylabel("greedy mean return")
    axes[1].axhline(0, color="k", lw=0.5)
    axes[1].set_ylabel("value error on\nfailing states")
    axes[2].set_ylabel("failed episodes\nin the buffer")
    axes[2].set_xlabel("training step (dotted: each seed's first solve)")
    failures = [f for r in results for f in r.get("failures", [])]
    ax = fig.add_subplot(grid[3])
    for f in failures:
        ax.plot(f["moves_left"], f["value"], lw=0.6, alpha=0.6, color="tab:blue" if f["how"] == "x" else "tab:red")
    moves = np.arange(1, 501)
    ax.plot(moves, (1 - args.gamma**moves) / (1 - args.gamma), color="k", lw=1.5, label="return that followed")
    ax.axhline(args.top, color="k", ls="--", lw=1, label=f"value head's largest value ({args.top:.0f})")
    ax.invert_xaxis()
    ax.set_xlabel("moves left to the failure (blue: the cart left the track; red: the pole fell)")
    ax.set_ylabel("value the network says,\ngreedy episodes that failed")
    ax.legend(loc="lower left", fontsize=8)
    fig.suptitle(f"bench/holds_cause.py --tag {args.tag}")
    fig.tight_layout()
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.figure, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
