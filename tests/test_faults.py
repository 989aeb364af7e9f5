"""Faults injected for real: a run whose supervisor is SIGKILLed leaves no process behind,
and the next start removes the segments it left (and only those)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_train_e2e import ROOT, alive, run_args, wait_until_training

from mpper import shm


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
    proc = subprocess.Popen(run_args(run_dir, "--workers", "2", "--max-train-steps", "100000"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until_training(proc, run_dir)
        pids = json.loads((run_dir / "processes.json").read_text())
        helpers = forkserver_of(pids["supervisor"])  # forkserver, resource tracker
        left = {n for n in set(shm.mpper_segments()) - segments_before if n.startswith(f"mpper_{pids['supervisor']}_")}
        assert left, "the run's segments should exist while it runs"
        # Kill the supervisor and multiprocessing's resource tracker with it (as `kill -9`
        # of the process group would): nobody is left to unlink the segments.
        tracker = [p for p in helpers if b"resource_tracker" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(tracker) == 1
        os.kill(tracker[0], signal.SIGKILL)
        os.kill(pids["supervisor"], signal.SIGKILL)
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 10  # "within a few seconds"
        while [p for p in (*pids.values(), *helpers) if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = {name: p for name, p in pids.items() if alive(p)}
        assert not survivors, f"children outlived their killed supervisor: {survivors}"
        assert not [p for p in helpers if alive(p)], "the forkserver outlived the supervisor"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # Nobody may have unlinked them yet (the owner and the tracker are dead): whatever
    # is left must be recognised as a dead run's, and the next start removes it.
    remaining = left & set(shm.mpper_segments())
    assert remaining <= set(shm.stale_segments())
    run2 = tmp_path / "run2"
    out = subprocess.run(run_args(run2, "--workers", "0", "--max-train-steps", "3"), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (left & set(shm.mpper_segments())), "the dead run's segments were not removed"
    if remaining:
        assert "shared-memory segment(s) left by dead runs" in out.stderr
