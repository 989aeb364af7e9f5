"""Faults injected for real, each in a real run: a supervisor SIGKILLed leaves no process
behind and the next start removes the segments it left (and only those); an env that
raises in ``step`` gets its worker restarted and, past ``max_worker_restarts``, stops the
run with the error; a diverging learner stops the run at the step that went non-finite.
(A SIGKILLed worker and learner: tests/e2e/test_train_e2e.py.)"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from children import report_then_wait
from conftest import mapped_semaphores
from test_train_e2e import (
    ROOT,
    alive,
    assert_no_process_left,
    complete_lines,
    run_args,
    segments_of,
    wait_until_training,
)  # fmt: skip

from mpper import ReplayBuffer, shm
from mpper.runtime.procs import StopSignal

pytestmark = pytest.mark.slow

# the run's processes import tests/faulty_env.py as "faulty_env"
FAULTY_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def forkserver_of(pid: int) -> list[int]:
    """Child pids of ``pid`` (the supervisor's forkserver and resource tracker)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split()]


@pytest.mark.timeout(240)
def test_sigkill_of_the_supervisor_stops_every_child_and_the_next_run_cleans_up(tmp_path):
    run_dir = tmp_path / "run"
    segments_before = set(shm.mpper_segments())  # other runs (concurrent test sessions) keep theirs
    left: set[str] = set()
    semaphores: set[Path] = set()
    proc = subprocess.Popen(run_args(run_dir, "--workers", "2", "--max-train-steps", "100000"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until_training(proc, run_dir)
        pids = json.loads((run_dir / "processes.json").read_text())
        helpers = forkserver_of(pids["supervisor"])  # forkserver, resource tracker
        left = {n for n in set(shm.mpper_segments()) - segments_before if n.startswith(f"mpper_{pids['supervisor']}_")}
        assert left, "the run's segments should exist while it runs"
        for name in left:  # second names, which no mpper cleanup touches (see below)
            os.link(Path(shm.SHM_DIR) / name, Path(shm.SHM_DIR) / f".keep-{name}")
        # Kill the supervisor and multiprocessing's resource tracker with it (as `kill -9`
        # of the process group would): nobody is left to unlink the segments.
        tracker = [p for p in helpers if b"resource_tracker" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(tracker) == 1
        semaphores = mapped_semaphores([*pids.values(), *helpers])  # Python's, unlinked below
        os.kill(tracker[0], signal.SIGKILL)
        os.kill(pids["supervisor"], signal.SIGKILL)
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 30  # "within seconds"; generous on a loaded machine
        while [p for p in (*pids.values(), *helpers) if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = {name: p for name, p in pids.items() if alive(p)}
        assert not survivors, f"children outlived their killed supervisor: {survivors}"
        assert not [p for p in helpers if alive(p)], "the forkserver outlived the supervisor"
        # The owner and the tracker are dead: nobody of this run unlinks the segments.
        # Any other mpper process starting on this machine may (every start and every test
        # session's leak guard remove a dead owner's segments), so put back any it took
        # before each next start, and start again if one took them while it started.
        for attempt in range(3):
            for name in left:
                if not (Path(shm.SHM_DIR) / name).exists():
                    os.link(Path(shm.SHM_DIR) / f".keep-{name}", Path(shm.SHM_DIR) / name)
            assert left <= set(shm.stale_segments()), "a dead run's segments are not recognised as stale"
            out = subprocess.run(run_args(tmp_path / f"run2-{attempt}", "--workers", "0", "--max-train-steps", "3"),
                                 cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
            assert out.returncode == 0, out.stderr[-3000:]
            assert not (left & set(shm.mpper_segments())), "the dead run's segments were not removed"
            removed = re.search(r"mpper: removed (\d+) shared-memory segment\(s\) left by dead runs", out.stderr)
            if removed and int(removed.group(1)) >= len(left):
                break
        assert removed and int(removed.group(1)) >= len(left), out.stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for name in left:
            (Path(shm.SHM_DIR) / f".keep-{name}").unlink(missing_ok=True)
        for path in semaphores:  # the killed tracker would have unlinked them
            path.unlink(missing_ok=True)


@pytest.mark.timeout(180)
def test_an_env_that_raises_restarts_its_worker_then_stops_the_run_with_its_error(tmp_path):
    """Env 1 of the worker raises in ``step`` after 30 steps, in every life of the worker:
    each traceback names the worker, the env's index and its id; the worker is restarted
    twice (max_worker_restarts=2); the third failure stops the run: exit code 1, one
    line "run stopped: ..." naming the worker and the env's error, a final snapshot,
    nothing left running, no segment left."""
    run_dir = tmp_path / "run"
    # min_buffer_steps 1000: the learner only waits (less CPU; the three lives store ~240 positions)
    args = run_args(run_dir, "--workers", "1", "--max-train-steps", "100000",
                    "--set", "env.id=faulty_env:raising", "--set", 'env.kwargs={"fail_after": 30, "fail_instance": 1}',
                    "--set", "runtime.max_worker_restarts=2", "--set", "training.min_buffer_steps=1000")  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, env=FAULTY_ENV, capture_output=True, text=True, timeout=150)
    err = proc.stderr
    assert proc.returncode == 1, proc.stdout[-2000:] + err[-4000:]
    env_error = ("mpper.runtime.roles.EnvError: worker-0 env 1 (faulty_env:raising): step raised RuntimeError: "
                 "simulated env failure after 30 steps")  # fmt: skip
    assert err.count("mpper: worker-0 failed:\n") == 3  # each failure's traceback, reported
    assert err.count(env_error) >= 3  # ... ending in the env's error, with where it happened
    assert "RuntimeError: simulated env failure after 30 steps" in err  # the env's own traceback is chained
    assert err.count("restarting worker-0") == 2
    stopped = [line for line in err.splitlines() if "run stopped:" in line]
    assert stopped == [f"mpper: run stopped: worker-0 died 3 times (max_worker_restarts=2); last error: {env_error}"]
    assert "stopped; run directory" in proc.stdout
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:  # the final snapshot, whole
        assert snap.counters["games"] > 0
        assert snap.counters["games"] == len(snap.episodes())  # what the three lives stored, no torn episode
        assert all(ep.rows == 21 for ep in snap.episodes())  # 20 moves each
    assert_no_process_left(run_dir)
    assert not segments_of(json.loads((run_dir / "processes.json").read_text())["supervisor"])


@pytest.mark.timeout(180)
def test_a_diverging_learner_stops_the_run_at_the_non_finite_step(tmp_path):
    """lr 1e30: the first update makes the weights huge and the second loss overflows.
    The learner raises before it changes anything (weights, optimizer, priorities), saves
    its last finite state and stops the run: exit code 1, one line naming the training
    step; the checkpoint holds that step's weights, all finite; the final snapshot loads
    and no NaN or inf reached the sum tree. (Weights are published every 1000 steps, so
    the workers never play with the huge ones.)"""
    run_dir = tmp_path / "run"
    args = run_args(run_dir, "--workers", "1", "--max-train-steps", "100000", "--set", "training.lr_init=1e30",
                    "--set", "training.publish_interval=1000", "--set", "training.samples_per_insert=null")  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    stopped = [line for line in proc.stderr.splitlines() if "run stopped:" in line]
    assert len(stopped) == 1, proc.stderr[-4000:]
    match = re.fullmatch(r"mpper: run stopped: learner failed: FloatingPointError: non-finite loss at training step (\d+)",
                         stopped[0])  # fmt: skip
    assert match, stopped
    step = int(match.group(1))
    assert step >= 1
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["training_step"] == step
    assert all(torch.isfinite(t).all() for t in checkpoint["network"].values())
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:  # load checks the leaves too
        leaves = snap.priorities(np.arange(snap.capacity))
        assert np.isfinite(leaves).all() and (leaves >= 0).all() and leaves.sum() > 0
        c = snap.counters
        # the priorities of the `step` batches trained on came back, those of the failed one did not
        assert c["priority_updates_applied"] + c["priority_updates_dropped"] == step * 32
    records = [json.loads(line) for line in complete_lines(run_dir / "metrics.jsonl")]
    assert records[-1]["event"] == "end"
    assert_no_process_left(run_dir)
    assert not segments_of(json.loads((run_dir / "processes.json").read_text())["supervisor"])


def test_a_child_whose_supervisor_died_exits_though_nobody_reads_its_reports():
    """A child with more reports queued than the report pipe holds, when its supervisor
    dies: at exit multiprocessing would wait for those reports to reach a pipe nobody
    reads any more (every child holds its read end, so writing never fails), for ever.
    The test process plays the supervisor; its death is the close of the pipe end only
    it holds, as the kernel closes it when a process dies."""
    ctx = mp.get_context("spawn")
    stop, reports, queued = StopSignal(ctx), ctx.Queue(), ctx.Event()
    child = ctx.Process(target=report_then_wait, args=(reports, stop, queued, 2000))
    child.start()
    try:
        assert queued.wait(60), "the child did not queue its reports"
        stop._alive_writer.close()  # noqa: SLF001 - the supervisor's death, as the child sees it
        child.join(30)
        assert not child.is_alive(), "the child still waits to deliver its reports"
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()

