"""Whether a peer's solve holds: Stable-Baselines3's DQN and muzero-general on CartPole-v1,
judged by ``bench/holds.py``'s rule, with its report table.

The rule: the training weights are evaluated at regular training-step intervals by the
mean return of 10 greedy episodes; the first evaluation whose mean reaches ``--target``
(475) is the first solve; training goes on until weights at least ``--past-solve`` (5,000)
training steps past the solving weights are evaluated, and those are the final weights.
Per seed: the share of the evaluations after the first solve whose mean reached the target,
the worst of them, and the final weights played on ``--final-episodes`` (100) new greedy
episodes (episode ``k`` first reset with ``--final-seed + k``). A seed holds when that
share is at least ``--hold-share`` (0.9) and the final weights' mean reached the target.

``--peer sb3``: SB3's DQN with the RL Zoo CartPole-v1 hyperparameters
(``solve_dqn.RL_ZOO_CARTPOLE_DQN``), one torch thread, in SB3's own virtualenv
(``--sb3-python``). A training step is one gradient step (SB3's ``_n_updates``: 128 of them
after every 256 env steps). The weights are evaluated whenever ``--eval-every`` (500)
gradient steps have passed since the last evaluation, that is every 512; evaluation ``i``
plays episodes seeded ``1,000,000 * (seed + 1) + 10 * i + k``. Training stops right after the
evaluation of the final weights, so the final weights are exactly the weights evaluated
then. The RL Zoo trains for 5e4 env steps with epsilon decaying over the first 16 % of
them (8,000 env steps); here training may go on to ``--sb3-max-env-steps``, with
``exploration_fraction`` scaled so that epsilon still reaches its floor at env step 8,000.
Wall seconds exclude the evaluations.

``--peer muzero-general``: muzero-general, unmodified, with its shipped
``games/cartpole.py``, run by ``bench/muzero_general_cartpole.py`` in its own virtualenv
(``--mzg-python``, ``--mzg-dir``): it trains for ``--time-limit`` seconds saving the
shared storage's weights every ``--mzg-weights-every`` (250) training steps, then plays the
saved sets with muzero-general's own MCTS (no root noise, the most visited action), sets at
least ``--eval-every`` training steps apart, from the first solve on to the first set at least
``--past-solve`` steps past it, whose weights are the final weights. ``--seeds`` are that
script's run numbers (muzero-general's seed is ten times the run number). Times are from the
start of the run (before ``ray.init``) to when the solving set was saved.

A seed that did not solve, or whose training did not get ``--past-solve`` steps past its
first solve within the time limit, is reported as such and does not hold.

Usage::

    python bench/holds_peers.py --peer sb3 --sb3-python /path/to/sb3-venv/bin/python --seeds 0 1 2
    python bench/holds_peers.py --peer muzero-general --mzg-python /path/to/mzg-venv/bin/python \\
        --mzg-dir /path/to/muzero-general --seeds 0 1 --time-limit 1500

Writes ``bench/results/holds_<tag>.json`` and ``.md`` (tags ``sb3`` and ``muzero_general``
unless ``--tag``). ``--report A.json B.json`` prints one table of the seeds of saved runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import holds  # noqa: E402

ROOT = BENCH.parent
RESULTS = ROOT / "bench" / "results"
RL_ZOO_EPSILON_DECAY_ENV_STEPS = 8_000  # exploration_fraction 0.16 of the RL Zoo's 5e4 env steps


def judge(seed: int, evals: list[dict], final: dict | None, args, **extra) -> dict:
    """One seed's row for ``holds.report`` from its evaluations (dicts with ``time_s``,
    ``training_step``, ``mean_return``, in training-step order) and the final weights'
    episodes (``training_step``, ``returns``; None when training did not get
    ``--past-solve`` steps past the first solve). Evaluations after the final weights'
    training step are not judged."""
    solve = next((e for e in evals if e["mean_return"] >= args.target), None)
    out = {"seed": seed, "solved": solve is not None, "exit_code": extra.pop("exit_code", 0), **extra,
           "curve": [(e["time_s"], e["training_step"], e["mean_return"]) for e in evals]}  # fmt: skip
    if solve is None:
        return out
    last_judged = final["training_step"] if final else evals[-1]["training_step"]
    after = [e["mean_return"] for e in evals if solve["training_step"] < e["training_step"] <= last_judged]
    out |= {"solve_time_s": solve["time_s"], "solve_training_step": solve["training_step"],
            "past_solve_reached": final is not None, "evaluations_after": len(after),
            "share_after_at_target": sum(m >= args.target for m in after) / len(after) if after else None,
            "worst_after": min(after, default=None), "last_training_step_evaluated": last_judged}  # fmt: skip
    if final is not None:
        returns = final["returns"]
        out["final"] = {"training_step": final["training_step"], "mean_return": sum(returns) / len(returns),
                        "min_return": min(returns), "episodes": len(returns)}  # fmt: skip
    return out


# ---- Stable-Baselines3 (in a child process of its own virtualenv) -------------------------


def sb3_child(seed: int, out_path: str, args) -> None:
    """Train SB3 DQN by the rule; write the evaluations and the final weights' returns as JSON."""
    import torch
    from solve_dqn import RL_ZOO_CARTPOLE_DQN, sb3_greedy_returns
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback

    class Judge(BaseCallback):
        """Evaluates the weights every ``--eval-every`` gradient steps, and ends training
        once weights ``--past-solve`` steps past the first solve are evaluated or the time
        limit is spent."""

        def __init__(self):
            super().__init__()
            self.evals, self.final, self.next_eval, self.solve_step = [], None, args.eval_every, None
            self.t0, self.excluded = time.monotonic(), 0.0

        def _on_step(self) -> bool:
            step = self.model._n_updates
            if step < self.next_eval:
                return time.monotonic() - self.t0 < args.time_limit
            w0 = time.monotonic()
            base = 1_000_000 * (seed + 1) + 10 * len(self.evals)
            mean = sum(sb3_greedy_returns(self.model, args.eval_episodes, base)) / args.eval_episodes
            self.evals.append({"time_s": w0 - self.t0 - self.excluded, "training_step": step, "mean_return": mean})
            self.excluded += time.monotonic() - w0
            self.next_eval = step + args.eval_every
            if self.solve_step is None and mean >= args.target:
                self.solve_step = step
            if self.solve_step is not None and step >= self.solve_step + args.past_solve:
                self.final = {"training_step": step,
                              "returns": sb3_greedy_returns(self.model, args.final_episodes, args.final_seed)}  # fmt: skip
                return False
            return time.monotonic() - self.t0 < args.time_limit

    torch.set_num_threads(1)  # as every mpper process (runtime.torch_threads)
    hyper = dict(RL_ZOO_CARTPOLE_DQN, exploration_fraction=RL_ZOO_EPSILON_DECAY_ENV_STEPS / args.sb3_max_env_steps)
    model = DQN("MlpPolicy", "CartPole-v1", **hyper, seed=seed, device="cpu", verbose=0)
    judge_cb = Judge()
    model.learn(total_timesteps=args.sb3_max_env_steps, callback=judge_cb)
    Path(out_path).write_text(json.dumps({"evals": judge_cb.evals, "final": judge_cb.final,
                                          "env_steps": model.num_timesteps, "gradient_steps": model._n_updates,
                                          "hyperparameters": hyper}))  # fmt: skip


def run_sb3(seed: int, args) -> dict:
    out_path = RESULTS / f"holds-{args.tag}-seed{seed}.json"
    out_path.unlink(missing_ok=True)
    cmd = [args.sb3_python, __file__, "--sb3-child", str(seed), "--sb3-out", str(out_path), *child_args(args)]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0 or not out_path.exists():
        return {"seed": seed, "solved": False, "exit_code": proc.returncode, "wall_s": wall,
                "stderr_tail": proc.stderr[-2000:], "curve": []}  # fmt: skip
    got = json.loads(out_path.read_text())
    return judge(seed, got["evals"], got["final"], args, wall_s=wall, env_steps=got["env_steps"],
                 gradient_steps=got["gradient_steps"])  # fmt: skip


def child_args(args) -> list[str]:
    """The options the SB3 child needs, as given to the parent."""
    return ["--target", str(args.target), "--past-solve", str(args.past_solve), "--eval-every", str(args.eval_every),
            "--eval-episodes", str(args.eval_episodes), "--final-episodes", str(args.final_episodes),
            "--final-seed", str(args.final_seed), "--time-limit", str(args.time_limit),
            "--sb3-max-env-steps", str(args.sb3_max_env_steps)]  # fmt: skip


# ---- muzero-general ----------------------------------------------------------------------


def run_muzero_general(run: int, args) -> dict:
    out = RESULTS / f"holds-{args.tag}-run{run}"
    cmd = [args.mzg_python, str(BENCH / "muzero_general_cartpole.py"), "--mzg-dir", args.mzg_dir, "--runs", str(run),
           "--out", str(out), "--time-limit", str(args.time_limit), "--hold", str(args.time_limit),
           "--threshold", str(args.target), "--weights-every", str(args.mzg_weights_every),
           "--eval-episodes", str(args.eval_episodes), "--eval-spacing", str(args.eval_every),
           "--past-solve", str(args.past_solve), "--final-episodes", str(args.final_episodes),
           "--final-seed", str(args.final_seed), "--eval-time-limit", str(args.mzg_eval_time_limit)]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    try:
        res = json.loads((out / f"run_{run}" / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {"seed": run * 10, "solved": False, "exit_code": proc.returncode, "wall_s": wall,
                "stderr_tail": (proc.stdout + proc.stderr)[-2000:], "curve": []}  # fmt: skip
    evals = [{"time_s": e["t_run_s"], "training_step": e["training_step"], "mean_return": sum(e["returns"]) / len(e["returns"])}
             for e in res.get("evaluations", [])]  # fmt: skip
    final_sb = res.get("final_weights")  # None when not reached or cut by the time limit
    final = {"training_step": final_sb["training_step"], "returns": final_sb["returns"]} if final_sb else None
    last = res.get("final") or {}
    return judge(res["seed"], evals, final, args, exit_code=res.get("child_rc"), wall_s=wall,
                 training_steps_trained=last.get("training_step"), stop_reason=res.get("stop_reason"),
                 evaluation_cut_by_time_limit=res.get("evaluation_cut_by_time_limit", False),
                 final_weights_partial=res.get("final_weights_partial"),
                 versions=res.get("versions"))  # fmt: skip


def notes(results: list[dict], args) -> list[str]:
    """A line per seed that did not get as far as the rule asks, saying how far it got."""
    out = []
    for r in results:
        trained = r.get("training_steps_trained")
        trained_text = f", trained to training step {trained:,}" if trained is not None else ""
        if not r["solved"]:
            out.append(f"- seed {r['seed']}: no evaluation reached {args.target:g}{trained_text}")
        elif not r.get("past_solve_reached"):
            out.append(f"- seed {r['seed']}: no final weights {args.past_solve:,} training steps past the solve "
                       f"(last judged evaluation at training step {r['last_training_step_evaluated']:,}{trained_text})")  # fmt: skip
        if r.get("evaluation_cut_by_time_limit"):
            out.append(f"- seed {r['seed']}: playing the saved weights was cut by the time limit")
        partial = r.get("final_weights_partial")
        if partial:
            returns = partial["returns"]
            mean = f", mean {sum(returns) / len(returns):.1f}" if returns else ""
            out.append(f"- seed {r['seed']}: final weights (training step {partial['training_step']:,}) played "
                       f"{len(returns)} of {args.final_episodes} episodes before the time limit{mean}")  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", choices=("sb3", "muzero-general"), default="sb3")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--target", type=float, default=475.0, help="the mean greedy return that counts as solved")
    ap.add_argument("--past-solve", type=int, default=5000, metavar="STEPS",
                    help="training steps to train on after the first solve")  # fmt: skip
    ap.add_argument("--eval-every", type=int, default=500, metavar="STEPS", help="training steps between evaluations")
    ap.add_argument("--eval-episodes", type=int, default=10)
    ap.add_argument("--final-episodes", type=int, default=100, metavar="N")
    ap.add_argument("--final-seed", type=int, default=60_000_000, metavar="S")
    ap.add_argument("--hold-share", type=float, default=0.9)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds of training per seed")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at the same time")
    ap.add_argument("--tag", default=None, help="name of the result files (default: the peer's name)")
    ap.add_argument("--sb3-python", default=sys.executable, help="the Python of SB3's virtualenv")
    ap.add_argument("--sb3-max-env-steps", type=int, default=300_000, help="SB3: total_timesteps, an upper bound")
    ap.add_argument("--mzg-python", default=sys.executable, help="the Python of muzero-general's virtualenv")
    ap.add_argument("--mzg-dir", default=None, help="a checkout of muzero-general")
    ap.add_argument("--mzg-weights-every", type=int, default=250, metavar="STEPS")
    ap.add_argument(
        "--mzg-eval-time-limit", type=float, default=7200.0, help="seconds of playing saved weights per seed"
    )
    ap.add_argument("--sb3-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sb3-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print one table of the seeds of these saved result files, run nothing")  # fmt: skip
    args = ap.parse_args()
    if args.report:
        saved = [json.loads(Path(path).read_text()) for path in args.report]
        commands = "`; `".join(s["command"] for s in saved)
        results = [r for s in saved for r in s["results"]]
        print("\n".join([holds.report(results, args, commands), "", *notes(results, args)]))
        return 0
    if args.sb3_child is not None:
        sb3_child(args.sb3_child, args.sb3_out, args)
        return 0
    if args.peer == "muzero-general" and not args.mzg_dir:
        print("error: --peer muzero-general needs --mzg-dir (a checkout of muzero-general)", file=sys.stderr)
        return 2
    args.tag = args.tag or args.peer.replace("-", "_")
    command = "python bench/holds_peers.py " + " ".join(sys.argv[1:])
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = []

    def run_seed(seed: int) -> dict:
        print(f"{args.peer} seed {seed} ...", file=sys.stderr, flush=True)
        return run_sb3(seed, args) if args.peer == "sb3" else run_muzero_general(seed, args)

    with ThreadPoolExecutor(args.jobs) as pool:  # each seed is a child process; threads only wait
        for result in pool.map(run_seed, args.seeds):
            results.append(result)
            print(holds.report(results[-1:], args, command).splitlines()[6], file=sys.stderr, flush=True)
            (RESULTS / f"holds_{args.tag}.json").write_text(
                json.dumps({"command": command, "results": results}, indent=1)
            )
    text = "\n".join([holds.report(results, args, command), "", *notes(results, args)])
    print(text)
    (RESULTS / f"holds_{args.tag}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
