"""``mpper sweep``: the IQM and its bootstrap interval against independent references
(scipy.stats.trim_mean, a plain-loop bootstrap, scipy.stats.bootstrap); real sweeps of
CartPole with tiny budgets whose sweep.json agrees with the seeds' own metrics.jsonl; a
seed whose run fails is reported; Ctrl-C and SIGTERM of the sweep stop its seeds' runs and
every process they started."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from mpper.tools.sweep import BOOTSTRAP_RESAMPLES, bootstrap_ci, interquartile_mean, iqm_summary, seed_result

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
TINY = ["--workers", "0", "--max-train-steps", "30", "--set", "training.min_buffer_steps=64",
        "--set", "training.batch_size=32", "--set", "runtime.evaluation_interval_s=0.3"]  # fmt: skip

SAMPLES = [
    [7.0],
    [3.0, 1.0],
    [1.0, 2.0, 3.0],
    [5.0, 5.0, 5.0, 5.0],
    [1.0, 1.0, 2.0, 2.0, 100.0],
    [0.0, 500.0, 500.0, 500.0, 9.0, 500.0],
    [12.0, -4.0, 3.5, 3.5, 3.5, 8.0, 1e6],
    [float(v) for v in np.random.default_rng(3).integers(0, 5, size=11)],  # many ties
    list(np.random.default_rng(4).normal(200.0, 80.0, size=20)),
]


@pytest.mark.parametrize("values", SAMPLES, ids=[f"n{len(v)}" for v in SAMPLES])
def test_interquartile_mean_is_scipy_trim_mean_quarter(values):
    assert interquartile_mean(values) == pytest.approx(scipy.stats.trim_mean(values, 0.25), rel=1e-12)
    assert interquartile_mean(values[::-1]) == pytest.approx(interquartile_mean(values), rel=1e-12)


def test_interquartile_mean_drops_a_quarter_from_each_end():
    assert interquartile_mean([1, 2, 3, 1000]) == 2.5  # one cut at each end of four
    assert interquartile_mean([1, 2, 3, 4, 5, 6, 7, 1000]) == 4.5  # two cut at each end of eight
    assert interquartile_mean([1, 1000]) == 500.5  # n < 4: nothing cut
    assert math.isnan(interquartile_mean([]))


def plain_loop_bootstrap(values, resamples, seed=0):
    """The reference: one resample at a time, each n draws with replacement from the same
    generator, scipy's trim_mean, the 2.5 and 97.5 percentiles."""
    rng = np.random.default_rng(seed)
    x = np.asarray(values, dtype=float)
    stats = []
    for _ in range(resamples):
        idx = rng.integers(0, len(x), size=len(x))
        stats.append(scipy.stats.trim_mean(x[idx], 0.25))
    return float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))


@pytest.mark.parametrize("values", SAMPLES, ids=[f"n{len(v)}" for v in SAMPLES])
def test_bootstrap_ci_matches_a_plain_loop_and_scipy_bootstrap(values):
    low, high = bootstrap_ci(values, resamples=2000, seed=5)
    assert (low, high) == pytest.approx(plain_loop_bootstrap(values, 2000, seed=5), rel=1e-12, abs=1e-12)
    if len(values) > 1:  # scipy refuses one observation
        ref = scipy.stats.bootstrap((np.asarray(values),), lambda s, axis=-1: scipy.stats.trim_mean(s, 0.25, axis=axis),
                                    n_resamples=2000, method="percentile", confidence_level=0.95,
                                    random_state=np.random.default_rng(5), vectorized=True)  # fmt: skip
        assert (low, high) == pytest.approx(tuple(ref.confidence_interval), rel=1e-12, abs=1e-12)
    assert min(values) <= low <= interquartile_mean(values) + 1e-9 and high <= max(values)


def test_bootstrap_of_one_run_or_equal_runs_is_a_point_and_of_none_is_nan():
    assert bootstrap_ci([4.0]) == (4.0, 4.0)
    assert bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)
    assert all(math.isnan(v) for v in bootstrap_ci([]))
    assert iqm_summary([None, 3.0, float("nan")]) == {"iqm": 3.0, "ci95": [3.0, 3.0], "n": 1}
    assert iqm_summary([]) == {"iqm": None, "ci95": None, "n": 0}


def _record(event, time_s, step, evaluation=None):
    """A metrics line; ``evaluation``: (training step, mean return) of the latest evaluation."""
    r = {"event": event, "time_s": time_s, "env_steps": 0, "learner": {"training_step": step}}
    if evaluation is not None:
        r["evaluation"] = {"training_step": evaluation[0], "mean_return": evaluation[1]}
    return json.dumps(r) + "\n"


def test_seed_result_first_evaluation_at_target_and_censoring(tmp_path):
    reached, missed = tmp_path / "a", tmp_path / "b"
    reached.mkdir()
    missed.mkdir()
    (reached / "metrics.jsonl").write_text(
        _record("progress", 1.0, 10, (10, 20.0)) + _record("progress", 1.5, 20, (10, 20.0))
        + _record("evaluation", 2.5, 40, (40, 480.0)) + _record("evaluation", 3.5, 60, (60, 490.0))
        + _record("end", 4.0, 70, (60, 490.0)) + '{"cut'  # fmt: skip
    )
    (missed / "metrics.jsonl").write_text(_record("evaluation", 2.0, 40, (40, 100.0))
                                          + _record("end", 9.0, 90, (40, 100.0)))  # fmt: skip
    a = seed_result(reached, 475.0)
    assert a["reached_target"] and (a["time_to_target_s"], a["steps_to_target"]) == (2.5, 40)
    assert a["final_return"] == 490.0 and a["evaluations"] == 3
    b = seed_result(missed, 475.0)  # never reached: counted with the run's whole length
    assert b["reached_target"] is False and (b["time_to_target_s"], b["steps_to_target"]) == (9.0, 90)
    c = seed_result(missed, None)
    assert c["reached_target"] is None and c["time_to_target_s"] is None and c["final_return"] == 100.0
    with pytest.raises(OSError):
        seed_result(tmp_path / "none", 475.0)


# ---- real sweeps ------------------------------------------------------------------------------
def sweep_command(sweep_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "run.py"), "sweep", "--config", "cartpole", "--sweep-dir", str(sweep_dir),
            *extra]  # fmt: skip


def child_env() -> dict:
    path = os.pathsep.join([str(ROOT), str(TESTS)])  # tests/: faulty_env for the failing seed
    return {**os.environ, "PYTHONPATH": path}


def read_evaluations(run_dir: Path) -> list[dict]:
    """The run's evaluations, read here independently of mpper's reader."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "evaluation":
            out.append({"time_s": r["time_s"], **r["evaluation"]})
    return out


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two seeds of CartPole, 30 training steps each, both at once, with a target of 30 (which
    an untrained CartPole policy may or may not reach: both cases are checked against the files)."""
    sweep_dir = tmp_path_factory.mktemp("sweep") / "s"
    proc = subprocess.run(sweep_command(sweep_dir, "--seeds", "2", "--first-seed", "3", "--parallel", "2", *TINY,
                                        "--set", "runtime.solve_return=30"),
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600,
                          check=False)  # fmt: skip
    return sweep_dir, proc


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_sweep_json_agrees_with_the_seeds_metrics(sweep):
    sweep_dir, proc = sweep
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((sweep_dir / "sweep.json").read_text())
    assert report["seeds"] == [3, 4] and report["failed"] == [] and report["solve_return"] == 30
    finals, times, steps, reached = [], [], [], 0
    for run, seed in zip(report["runs"], (3, 4)):
        run_dir = sweep_dir / f"seed-{seed}"
        assert run["seed"] == seed and run["status"] == "finished" and run["exit_code"] == 0
        assert Path(run["run_dir"]) == run_dir
        assert json.loads((run_dir / "config.json").read_text())["runtime"]["seed"] == seed
        evaluations = read_evaluations(run_dir)
        assert evaluations, f"seed {seed} made no evaluation"
        assert run["final_return"] == evaluations[-1]["mean_return"] and run["evaluations"] == len(evaluations)
        first = next((e for e in evaluations if e["mean_return"] >= 30), None)
        if first is None:  # counted with the whole run
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert run["reached_target"] is False and run["time_to_target_s"] == records[-1]["time_s"]
            assert run["steps_to_target"] == 30
        else:
            reached += 1
            assert run["reached_target"] is True
            assert (run["time_to_target_s"], run["steps_to_target"]) == (first["time_s"], first["training_step"])
        finals.append(run["final_return"])
        times.append(run["time_to_target_s"])
        steps.append(run["steps_to_target"])
    summary = report["summary"]
    assert summary["final_return"]["iqm"] == pytest.approx(scipy.stats.trim_mean(finals, 0.25))
    assert summary["final_return"]["ci95"] == pytest.approx(list(plain_loop_bootstrap(finals, BOOTSTRAP_RESAMPLES)))
    assert summary["time_to_target_s"]["iqm"] == pytest.approx(np.mean(times))  # n = 2: nothing trimmed
    assert summary["steps_to_target"]["iqm"] == pytest.approx(np.mean(steps))
    assert summary["time_to_target_s"]["reached"] == reached and summary["final_return"]["n"] == 2
    md = (sweep_dir / "sweep.md").read_text()
    assert f"{reached} of 2 reached 30" in md and "| Final return |" in md and "Agarwal et al. 2021" in md
    assert (sweep_dir / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (sweep_dir / "seed-3.log").exists() and "| Final return |" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_failing_seed_is_reported_not_hidden(tmp_path):
    sweep_dir = tmp_path / "s"
    env_set = ["--set", "env.id=faulty_env:failing_seed", "--set", 'env.kwargs={"seed": 1, "fail_after": 5}']
    proc = subprocess.run(sweep_command(sweep_dir, "--seeds", "2", *TINY, *env_set), cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((sweep_dir / "sweep.json").read_text())
    ok, bad = report["runs"]
    assert ok["status"] == "finished" and bad["status"] == "failed" and bad["exit_code"] not in (0, None)
    assert "simulated env failure" in bad["error"] and report["failed"] == [1]
    assert report["summary"]["final_return"]["n"] == 1  # left out of the statistics, and said so
    assert "seed 1 failed" in proc.stdout and "1 failed" in (sweep_dir / "sweep.md").read_text()


def _session_members(session_ids: set[int]) -> list[int]:
    """Live processes (not zombies) whose session is one of ``session_ids``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...
        if fields[0] != "Z" and int(fields[3]) in session_ids:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("signum,workers,parallel", [(signal.SIGTERM, "1", "1"), (signal.SIGINT, "0", "2")],
                         ids=["sigterm", "ctrl-c"])  # fmt: skip
def test_stopping_the_sweep_stops_its_runs(tmp_path, signum, workers, parallel):
    sweep_dir = tmp_path / "s"
    proc = subprocess.Popen(sweep_command(sweep_dir, "--seeds", "3", "--parallel", parallel, "--workers", workers,
                                          "--time-limit", "300"),
                            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        started = int(parallel)
        while not all((sweep_dir / f"seed-{k}" / "metrics.jsonl").exists() for k in range(started)):
            assert proc.poll() is None and time.monotonic() < deadline, "the seeds' runs did not start"
            time.sleep(0.5)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, out[-2000:] + err[-3000:]
    pids = {int(p) for p in re.findall(r"started \(pid (\d+)\)", out)}
    assert len(pids) == started  # no new seed started after the signal
    # each run's process and all it started end (its forkserver a moment after the run: it sees its socket close)
    deadline = time.monotonic() + 60
    while _session_members(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session_members(pids) == [], "processes of the stopped runs are still alive"
    report = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["interrupted"] * started + ["not started"] * (3 - started)
    assert "passed on to" in err
