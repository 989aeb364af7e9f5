"""What the benchmarks that run a peer beside mpper share: a peer in a child process of its own
virtualenv, LightZero's evaluations as it logs them, an mpper run and its evaluations, and the
Markdown of runs to a return.

Standard library only: the children in the peers' virtualenvs import it too.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LIGHTZERO = "LightZero 0.2.0"


def fresh_dir(path: Path) -> Path:
    subprocess.run(["rm", "-rf", str(path)], check=True)
    path.mkdir(parents=True)
    return path


def run_child(python: str, script: str, args: list[str], out: Path, time_limit: float) -> float:
    """Run ``python script *args`` in ``out`` (stdout and stderr to ``out/log.txt``), in a
    process group of its own (``start_new_session``), for at most ``time_limit`` seconds; then end that group
    (a peer's env subprocesses, left running by a child that returned or was cut). Returns
    the wall seconds it ran."""
    launched = time.time()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen([python, script, *args], cwd=out, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=time_limit)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return time.time() - launched


def read_json(path: Path, default):
    return json.loads(path.read_text()) if path.exists() else default


def record_lightzero_evaluations(out: Path) -> None:
    """From this call on, each evaluation LightZero logs (its evaluator's ``reward_mean``
    scalars through tensorboardX) is appended to ``out/evals.json`` as ``{"time_s": seconds
    since this call, "env_steps": the collector's env steps, "training_steps": the learner's
    iterations, "mean_return"}``. Call it just before LightZero's train entry, in its venv."""
    import tensorboardX

    add_scalar = tensorboardX.SummaryWriter.add_scalar
    evals: list[dict] = []
    train_iter: list[int | None] = [None]  # the evaluator logs each scalar by iteration, then by env step
    t0 = time.monotonic()

    def recording_add_scalar(self, tag, value, global_step=None, *args, **kwargs):
        if tag == "evaluator_iter/reward_mean":
            train_iter[0] = int(global_step)
        elif tag == "evaluator_step/reward_mean":
            evals.append({"time_s": time.monotonic() - t0, "env_steps": int(global_step),
                          "training_steps": train_iter[0], "mean_return": float(value)})  # fmt: skip
            (out / "evals.json").write_text(json.dumps(evals))
        return add_scalar(self, tag, value, global_step, *args, **kwargs)

    tensorboardX.SummaryWriter.add_scalar = recording_add_scalar


def run_mpper(run_dir: Path, config: str, seed: int, time_limit: float, workers: int | None,
              sets: list[str]) -> dict:  # fmt: skip
    """``python run.py --config config --seed seed --time-limit time_limit`` on the CPU into a
    fresh ``run_dir``, with each of ``sets`` as a ``--set``. Returns ``{"curve": its
    evaluations [{"time_s" since the supervisor's start, "env_steps", "training_steps",
    "mean_return"}], "end": the last record's {"time_s", "env_steps", "training_steps"},
    "final": final_evaluation.json or None}``; an evaluation stopped early (no mean) is left out."""
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = [sys.executable, "run.py", "--config", config, "--seed", str(seed), "--run-dir", str(run_dir),
           "--time-limit", str(time_limit), "--device", "cpu", *(["--workers", str(workers)] if workers else []),
           *(a for s in sets for a in ("--set", s))]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    curve = [{"time_s": r["time_s"], "env_steps": r["env_steps"], "training_steps": r["evaluation"]["training_step"],
              "mean_return": r["evaluation"]["mean_return"]}
             for r in records if r["event"] == "evaluation" and "mean_return" in r["evaluation"]]  # fmt: skip
    last = records[-1]
    end = {
        "time_s": last["time_s"],
        "env_steps": last["env_steps"],
        "training_steps": last["learner"].get("training_step"),
    }
    return {"curve": curve, "end": end, "final": read_json(run_dir / "final_evaluation.json", None)}


def to_return(result: dict, stop: float) -> dict:
    """``result`` (with its ``curve`` of evaluations) with whether one reached ``stop``
    (``"solved"``), the first that did (``"wall_s"``, ``"env_steps"``, ``"training_steps"``)
    and the best mean return of all (``"best_return"``, None without evaluations)."""
    curve = result["curve"]
    first = next((e for e in curve if e["mean_return"] >= stop), None)
    out = dict(result, solved=first is not None, best_return=max((e["mean_return"] for e in curve), default=None))
    if first:
        out |= {
            "wall_s": first["time_s"],
            "env_steps": first["env_steps"],
            "training_steps": first.get("training_steps"),
        }
    return out


def reached(result: dict) -> tuple[float, float]:
    """(wall seconds, env steps) to the return, both infinite for a run that did not reach it."""
    return (result["wall_s"], result["env_steps"]) if result["solved"] else (float("inf"), float("inf"))


def median_or_inf(values: list[float]) -> float:
    return statistics.median(values) if values else float("inf")


def ratio(a: float, b: float, unit: str = "") -> str:
    """``a / b`` to three places and ``unit``, or "-" where either is infinite (a run that did
    not reach the return)."""
    return f"{a / b:.3f}{unit}" if a != float("inf") and b != float("inf") and b else "-"


def solve_report(results: list[dict], stop: float, peer: str = LIGHTZERO) -> list[str]:
    """Markdown lines: each run to a mean return of ``stop`` (results of :func:`to_return`,
    with ``"seed"`` and ``"system"``), each other system's ratios to ``peer`` seed by seed,
    and each system's medians with the median's ratios (a run that did not reach the return
    counts as infinite)."""
    lines = ["| seed | system | reached | wall s | env steps | best return |", "|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["seed"], r["system"])):
        cells = f"{r['wall_s']:.1f} | {r['env_steps']:,}" if r["solved"] else "- | -"
        best = "-" if r.get("best_return") is None else f"{r['best_return']:.1f}"
        lines.append(f"| {r['seed']} | {r['system']} | {'yes' if r['solved'] else 'no'} | {cells} | {best} |")
    systems = list(dict.fromkeys(r["system"] for r in results))
    by_seed = {(r["system"], r["seed"]): r for r in results}
    others = [s for s in systems if s != peer]
    if peer in systems and others:
        lines += ["", f"Seed by seed, against {peer} (wall time ratio, env steps ratio):", "",
                  "| seed | system | wall / peer's | env steps / peer's |", "|---|---|---|---|"]  # fmt: skip
        for system in others:
            for seed in sorted({r["seed"] for r in results}):
                mine, theirs = by_seed.get((system, seed)), by_seed.get((peer, seed))
                if mine and theirs:
                    (wall, steps), (peer_wall, peer_steps) = reached(mine), reached(theirs)
                    lines.append(f"| {seed} | {system} | {ratio(wall, peer_wall)} | {ratio(steps, peer_steps)} |")
    lines += ["", "Medians (a run that did not reach the return counts as infinite):", ""]
    medians = {}
    for system in systems:
        rs = [r for r in results if r["system"] == system]
        wall = median_or_inf([reached(r)[0] for r in rs])
        steps = median_or_inf([reached(r)[1] for r in rs])
        medians[system] = (wall, steps)
        lines.append(f"- {system}: {sum(r['solved'] for r in rs)}/{len(rs)} reached {stop:g}, median wall "
                     f"{wall:.1f} s, median env steps {steps:,.0f}")  # fmt: skip
    if peer in medians:
        for system in others:
            (wall, steps), (peer_wall, peer_steps) = medians[system], medians[peer]
            lines.append(f"\n{system} against {peer}, medians: wall time {ratio(wall, peer_wall, 'x')}, "
                         f"env steps {ratio(steps, peer_steps, 'x')}")  # fmt: skip
    return lines


def earlier_runs(path: str | None, system: str, seeds: list[int]) -> list[dict]:
    """The runs of ``system`` of these ``seeds`` in an earlier results JSON (none without a
    path); exits with one line when a seed is missing."""
    if not path:
        return []
    runs = [r for r in json.loads(Path(path).read_text()) if r["system"] == system and r["seed"] in seeds]
    missing = sorted(set(seeds) - {r["seed"] for r in runs})
    if missing:
        raise SystemExit(f"error: {path}: no {system} run of seeds {missing}")
    return runs
