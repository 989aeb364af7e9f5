"""Several seeds of one config: ``mpper sweep --config cartpole --seeds 5 --parallel 2``.

Each seed is an ordinary run (``mpper --config ... --seed K --run-dir SWEEP_DIR/seed-K``) in
its own process, started with ``setsid`` so that a Ctrl-C in the terminal reaches the sweep
only, which passes it on to every running seed (see :func:`run_sweep`). Its output goes to
``SWEEP_DIR/seed-K.log``.

When the seeds have ended, the sweep reads each one's ``metrics.jsonl`` and reports over
the seeds, with the interquartile mean (IQM) and its 95 % percentile-bootstrap confidence
interval (Agarwal et al. 2021, "Deep Reinforcement Learning at the Edge of the Statistical
Precipice", the method of their rliable library):

- the final return: the mean greedy return of each run's last evaluation;
- the time to target: wall seconds and training steps to each run's first evaluation whose
  mean return reaches ``runtime.solve_return``. A run that never reaches it counts with
  its whole length (the wall seconds and training steps at its end), so that with any such
  run the IQM is a lower bound; how many runs reached the target is given beside it.

A seed whose run fails (non-zero exit, no metrics) is listed with its exit code and the
last line of its log, and left out of the statistics; the sweep then exits 1.

Writes ``SWEEP_DIR/sweep.json``, ``SWEEP_DIR/sweep.md`` (tables) and, with the plot extra,
``SWEEP_DIR/returns.png`` (every seed's evaluation return against env steps and wall time).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import write_atomic
from ..extras import MissingExtraError, require
from .plot import read_metrics, run_series

__all__ = ["SeedRun", "SweepPlan", "bootstrap_ci", "interquartile_mean", "iqm_summary", "run_sweep",
           "seed_result"]  # fmt: skip

BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95
POLL_S = 0.2
# the command a seed runs: the same mpper as this process (PYTHONPATH is set to its parent)
CHILD_MAIN = "import sys; from mpper.cli import main; sys.exit(main(sys.argv[1:]))"


# ---- statistics -------------------------------------------------------------------------------
def interquartile_mean(values) -> float:
    """Mean of the middle 50 % of ``values`` (1-D): ``floor(n / 4)`` values cut from each end
    of the sorted values, as ``scipy.stats.trim_mean(values, 0.25)``; NaN when empty."""
    x = np.sort(np.asarray(values, dtype=np.float64), axis=-1)
    n = x.shape[-1]
    if n == 0:
        return math.nan
    cut = int(0.25 * n)
    return float(x[..., cut : n - cut].mean(axis=-1))


def bootstrap_ci(values, resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                 seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """Percentile-bootstrap confidence interval of the IQM over runs: ``resamples`` times,
    draw ``n`` runs with replacement (``numpy.random.default_rng(seed).integers(0, n, (resamples, n))``,
    one row per resample) and take their IQM; the interval is the ``(1 - confidence) / 2``
    and ``(1 + confidence) / 2`` percentiles (numpy's linear interpolation) of those IQMs.
    (NaN, NaN) when ``values`` is empty."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    rows = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    samples = np.sort(x[rows], axis=1)
    cut = int(0.25 * n)
    iqms = samples[:, cut : n - cut].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.percentile(iqms, [100.0 * alpha, 100.0 * (1.0 - alpha)])
    return float(low), float(high)


def iqm_summary(values) -> dict:
    """``{"iqm", "ci95": [low, high], "n"}`` of the finite ``values`` (None when none is)."""
    x = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not x:
        return {"iqm": None, "ci95": None, "n": 0}
    return {"iqm": interquartile_mean(x), "ci95": list(bootstrap_ci(x)), "n": len(x)}


# ---- one seed's run ---------------------------------------------------------------------------
def _evaluations(records: list[dict]) -> list[dict]:
    """Each evaluation of a run once, in order: ``time_s``, ``env_steps``, ``training_step``,
    ``mean_return`` (an ``"evaluation"`` event, or a record whose evaluation differs from the
    previous record's: the in-process mode only repeats the latest one)."""
    out, last = [], None
    for r in records:
        ev = r.get("evaluation") or {}
        if isinstance(ev.get("mean_return"), (int, float)) and (r.get("event") == "evaluation" or ev != last):
            out.append({"time_s": float(r["time_s"]), "env_steps": r.get("env_steps"),
                        "training_step": ev.get("training_step"), "mean_return": float(ev["mean_return"])})  # fmt: skip
        last = ev
    return out


def seed_result(run_dir: Path, solve_return: float | None) -> dict:
    """What a finished run's ``metrics.jsonl`` says, for the sweep's statistics: the number of
    evaluations, ``final_return`` (last evaluation's mean return), ``reached_target``,
    ``time_to_target_s`` / ``steps_to_target`` (first evaluation at ``solve_return``; a run
    that never reached it: its ``end_time_s`` / ``end_training_step``, with
    ``reached_target`` false). Raises OSError when the run wrote no metrics."""
    records, _ = read_metrics(run_dir / "metrics.jsonl")
    evaluations = _evaluations(records)
    end_time = max((float(r["time_s"]) for r in records), default=None)
    steps = [(r.get("learner") or {}).get("training_step") for r in records]
    end_step = max((s for s in steps if isinstance(s, int)), default=0)
    out = {"evaluations": len(evaluations), "final_return": evaluations[-1]["mean_return"] if evaluations else None,
           "end_time_s": end_time, "end_training_step": end_step, "reached_target": None,
           "time_to_target_s": None, "steps_to_target": None}  # fmt: skip
    if solve_return is None:
        return out
    first = next((e for e in evaluations if e["mean_return"] >= solve_return), None)
    out["reached_target"] = first is not None
    if first is not None:
        out["time_to_target_s"], out["steps_to_target"] = first["time_s"], first["training_step"]
    else:  # censored at the run's end: the time to target is at least this
        out["time_to_target_s"], out["steps_to_target"] = end_time, end_step
    return out


# ---- the sweep --------------------------------------------------------------------------------
@dataclass
class SweepPlan:
    """What to run: ``config`` (path of the resolved config file), ``seeds``, ``sweep_dir``,
    ``parallel`` (runs at a time), ``run_args`` (flags passed to every run: --workers,
    --set, ...), ``solve_return`` (of the resolved config; None: no time to target) and the
    ``command`` the user typed (recorded in sweep.json)."""

    config: Path
    seeds: list[int]
    sweep_dir: Path
    parallel: int = 1
    run_args: list[str] = field(default_factory=list)
    solve_return: float | None = None
    command: list[str] = field(default_factory=list)


@dataclass
class SeedRun:
    seed: int
    run_dir: Path
    log: Path
    status: str = "not started"  # running, finished, failed, interrupted, not started
    exit_code: int | None = None
    wall_s: float | None = None
    error: str | None = None
    result: dict = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started: float = 0.0
    signalled: bool = False  # running when the sweep was asked to stop

    def record(self) -> dict:
        return {"seed": self.seed, "status": self.status, "exit_code": self.exit_code, "run_dir": str(self.run_dir),
                "log": str(self.log), "wall_s": self.wall_s, "error": self.error, **self.result}  # fmt: skip


class _Signals:
    """Ctrl-C and SIGTERM while the sweep runs: each one is passed on to every running seed,
    whose run answers it as its own (the first stops it cleanly, with its final checkpoint
    and snapshot; the third quits at once, stopping its children), and no new seed starts."""

    def __init__(self, runs: list[SeedRun]) -> None:
        self.runs = runs
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}  # signum -> the handler before (signal.signal's return)

    def __enter__(self) -> _Signals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        running = [r for r in self.runs if r.process is not None and r.process.returncode is None]
        os.write(2, f"mpper sweep: {signal.Signals(signum).name}: passed on to {len(running)} running seed(s); "
                    "no new seed starts\n".encode())  # fmt: skip
        for run in running:
            self.pass_on(run, signum)

    @staticmethod
    def pass_on(run: SeedRun, signum: int) -> None:
        run.signalled = True
        if run.process is None:  # not started: nothing to pass on
            return
        try:
            os.kill(run.process.pid, signum)  # not reaped yet (only the sweep's loop waits for it): still its pid
        except ProcessLookupError:
            pass


def _child_env() -> dict:
    """This process's environment with the directory holding this ``mpper`` first on PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, path]) if path else root}


def _start(run: SeedRun, plan: SweepPlan) -> None:
    argv = [sys.executable, "-c", CHILD_MAIN, "--config", str(plan.config), "--seed", str(run.seed),
            "--run-dir", str(run.run_dir), *plan.run_args]  # fmt: skip
    with open(run.log, "wb") as log:
        run.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=_child_env(), start_new_session=True)  # fmt: skip
    run.status, run.started = "running", time.monotonic()
    print(f"mpper sweep: seed {run.seed} started (pid {run.process.pid}), log {run.log}", flush=True)


def _last_error(log: Path) -> str | None:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    errors = [ln for ln in lines if ln.startswith("error:") or "Error" in ln]
    found = errors or lines
    return found[-1] if found else None


def _finish(run: SeedRun, plan: SweepPlan) -> None:
    assert run.process is not None  # only a started seed finishes
    run.exit_code = run.process.returncode
    run.wall_s = round(time.monotonic() - run.started, 3)
    metrics_problem: str | None
    try:
        run.result = seed_result(run.run_dir, plan.solve_return)
    except OSError as e:
        run.result, metrics_problem = {}, f"no metrics: {e}"
    else:
        metrics_problem = None
    if run.signalled:
        run.status = "interrupted"
    elif run.exit_code != 0 or metrics_problem:
        run.status = "failed"
        run.error = _last_error(run.log) or metrics_problem
    else:
        run.status = "finished"
    summary = f"exit {run.exit_code}"
    if run.result.get("final_return") is not None:
        summary += f", final return {run.result['final_return']:g}"
    if run.result.get("reached_target"):
        summary += f", reached {plan.solve_return:g} at training step {run.result['steps_to_target']}"
    if run.error:
        summary += f": {run.error}"
    print(f"mpper sweep: seed {run.seed} {run.status} in {run.wall_s:.0f} s ({summary})", flush=True)


def run_sweep(plan: SweepPlan) -> int:
    """Run every seed of ``plan``, ``plan.parallel`` at a time, then write sweep.json,
    sweep.md and returns.png into ``plan.sweep_dir``. Returns 0 when every seed finished,
    1 when one failed, 130 / 143 when the sweep was stopped by Ctrl-C / SIGTERM (the seeds
    that ran are then reported as interrupted, those not started as such)."""
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    runs = [SeedRun(k, plan.sweep_dir / f"seed-{k}", plan.sweep_dir / f"seed-{k}.log") for k in plan.seeds]
    print(f"mpper sweep: {len(runs)} seeds of {plan.config}, {plan.parallel} at a time, in {plan.sweep_dir}",
          flush=True)  # fmt: skip
    pending = list(runs)
    with _Signals(runs) as signals:
        while True:
            while pending and not signals.received and sum(r.status == "running" for r in runs) < plan.parallel:
                _start(pending.pop(0), plan)
            running = [r for r in runs if r.status == "running"]
            if not running and (not pending or signals.received):
                break
            for run in running:
                if signals.received and not run.signalled:  # started as the signal came
                    signals.pass_on(run, signals.received[0])
                if run.process is not None and run.process.poll() is not None:
                    _finish(run, plan)
            time.sleep(POLL_S)
    summary = write_report(plan, runs)
    print(summary, flush=True)
    if signals.received:
        return 128 + signals.received[0]
    return 1 if any(r.status == "failed" for r in runs) else 0


# ---- the report -------------------------------------------------------------------------------
METHOD = ("IQM: mean of the middle 50 % of runs (scipy.stats.trim_mean(x, 0.25)); 95 % CI: percentile "
          f"bootstrap over runs, {BOOTSTRAP_RESAMPLES} resamples (Agarwal et al. 2021, rliable). Time to target: "
          "wall seconds (from the run's start, as metrics.jsonl's time_s) and training steps to a run's first "
          "evaluation whose mean greedy return reaches runtime.solve_return; a run that never reaches it counts "
          "with its whole length (a lower bound); failed runs are left out.")  # fmt: skip


def write_report(plan: SweepPlan, runs: list[SeedRun]) -> str:
    """Write sweep.json, sweep.md and the curves' PNG; return the summary to print."""
    counted = [r.result for r in runs if r.status == "finished"]
    summary = {"final_return": iqm_summary(c.get("final_return") for c in counted)}
    if plan.solve_return is not None:
        reached = sum(bool(c.get("reached_target")) for c in counted)
        for key in ("time_to_target_s", "steps_to_target"):
            summary[key] = {**iqm_summary(c.get(key) for c in counted), "reached": reached}
    report = {"config": str(plan.config), "command": plan.command, "seeds": plan.seeds, "parallel": plan.parallel,
              "run_args": plan.run_args, "solve_return": plan.solve_return, "method": METHOD, "summary": summary,
              "failed": [r.seed for r in runs if r.status == "failed"], "runs": [r.record() for r in runs]}  # fmt: skip
    text = json.dumps(report, indent=2) + "\n"
    write_atomic(plan.sweep_dir / "sweep.json", lambda f: f.write(text.encode()))
    md = _markdown(plan, runs, summary)
    write_atomic(plan.sweep_dir / "sweep.md", lambda f: f.write(md.encode()))
    try:
        plot = _plot(plan, runs)
    except MissingExtraError as e:
        plot = f"no plot: {e}"
    lines = [ln for ln in md.splitlines() if ln.startswith("|")][:5]
    return "\n".join(["mpper sweep: " + str(plan.sweep_dir / "sweep.md"), *lines, f"mpper sweep: {plot}"])


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _markdown(plan: SweepPlan, runs: list[SeedRun], summary: dict) -> str:
    finished = sum(r.status == "finished" for r in runs)
    rows = [("Final return", summary["final_return"], 1, "")]
    if plan.solve_return is not None:
        reached = summary["time_to_target_s"]["reached"]
        note = f"{reached} of {finished} reached {plan.solve_return:g}"
        rows += [("Time to target (s)", summary["time_to_target_s"], 0, note),
                 ("Training steps to target", summary["steps_to_target"], 0, note)]  # fmt: skip
    out = [f"# Sweep of {plan.config.name}", "", f"Seeds {', '.join(map(str, plan.seeds))}; {finished} finished, "
           f"{sum(r.status == 'failed' for r in runs)} failed. Run flags: `{' '.join(plan.run_args) or '-'}`.", "",
           "| Measure | IQM | 95 % CI | Runs | Note |", "|---|---|---|---|---|"]  # fmt: skip
    for name, s, digits, note in rows:
        ci = "-" if s["ci95"] is None else f"[{_fmt(s['ci95'][0], digits)}, {_fmt(s['ci95'][1], digits)}]"
        out.append(f"| {name} | {_fmt(s['iqm'], digits)} | {ci} | {s['n']} | {note} |")
    out += ["", METHOD, "", "| Seed | Status | Final return | Reached target | Seconds to target | Steps to target "
            "| Run directory |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        res = r.result
        reached = {True: "yes", False: "no (censored)", None: "-"}[res.get("reached_target")]
        status = r.status + (f" (exit {r.exit_code}: {r.error})" if r.status == "failed" else "")
        out.append(f"| {r.seed} | {status} | {_fmt(res.get('final_return'))} | {reached} | "
                   f"{_fmt(res.get('time_to_target_s'), 0)} | {res.get('steps_to_target', '-')} | {r.run_dir} |")
    return "\n".join(out) + "\n"


def _plot(plan: SweepPlan, runs: list[SeedRun]) -> str:
    """Every seed's evaluation return against env steps and wall time into returns.png."""
    require("matplotlib", "matplotlib", "plot", "the sweep's returns.png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)  # the Agg backend, whatever matplotlib's default: no display needed
    axes = fig.subplots(1, 2, sharey=True)
    for run in runs:
        try:
            records, _ = read_metrics(run.run_dir / "metrics.jsonl")
        except OSError:
            continue
        ev = run_series(records).evaluation
        for ax, xs in zip(axes, (ev.env_steps, ev.wall_s)):
            ax.plot(xs, ev.y, marker=".", label=f"seed {run.seed}")
    for ax, label in zip(axes, ("env steps", "wall seconds")):
        if plan.solve_return is not None:
            ax.axhline(plan.solve_return, color="k", linestyle="--", linewidth=0.8, label="solve_return")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean greedy return")
    axes[1].legend(fontsize="small")
    fig.suptitle(f"{plan.config.name}: {len(runs)} seeds")
    fig.tight_layout()
    path = plan.sweep_dir / "returns.png"
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return f"curves in {path}"
