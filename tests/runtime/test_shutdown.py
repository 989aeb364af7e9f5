"""The edges of a run's shutdown, on real runs: more Ctrl-Cs while it stops (the second
acknowledged, the third quits at once saying what is lost), a learner that never
delivers its final checkpoint, and the forkserver killed under a live run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_faults import forkserver_of
from test_train_e2e import ROOT, assert_no_process_left, complete_lines, run_args, segments_of, wait_until_training

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


class Lines:
    """The lines a child process writes to one pipe, read in a thread as they come."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, fragment: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [line for line in self.lines if fragment in line]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                assert left > 0, f"no line with {fragment!r} in {timeout} s; got:\n" + "\n".join(self.lines[-30:])
                self._changed.wait(min(left, 1.0))

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "\n".join(self.lines)


def start(run_dir: Path, *extra: str, argv: list[str] | None = None) -> tuple[subprocess.Popen, Lines, Lines]:
    args = argv or run_args(run_dir, "--workers", "2", "--max-train-steps", "100000", *extra)
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, Lines(proc.stdout), Lines(proc.stderr)


def stop_learner(run_dir: Path) -> int:
    """SIGSTOP the run's learner (so its final checkpoint waits); returns its pid."""
    learner = json.loads((run_dir / "processes.json").read_text())["learner"]
    os.kill(learner, signal.SIGSTOP)
    return learner


def file_clock(path: Path) -> float:
    """Now, as the file system stamps a file's mtime: a file written after this has an
    mtime at least this (``time.time()`` runs ahead of the kernel's coarse file stamps)."""
    path.write_text("")
    return path.stat().st_mtime


def snapshot_time(run_dir: Path) -> float:
    return json.loads((run_dir / "buffer" / "manifest.json").read_text())["created_unix"]


def finish(proc: subprocess.Popen, out: Lines, err: Lines) -> tuple[int, str, str]:
    try:
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out.text(), err.text()


def assert_quit_at_once(proc: subprocess.Popen, out: Lines, err: Lines, run_dir: Path) -> str:
    """The run said it quits at once, did so with exit code 130 and no traceback, and left
    no process and no segment; returns its stdout."""
    err.wait_for("mpper: Ctrl-C: quitting at once; the final checkpoint and buffer snapshot are lost")
    code, stdout, stderr = finish(proc, out, err)
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "quit at once (Ctrl-C): final checkpoint and snapshot not written" in stdout
    assert_no_process_left(run_dir)
    assert not segments_of(proc.pid)
    return stdout


def test_a_second_ctrl_c_is_acknowledged_and_the_run_still_stops_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc, out, err = start(run_dir, "--set", "replay.snapshot_interval_s=0")
    wait_until_training(proc, run_dir)
    learner = stop_learner(run_dir)  # the shutdown will wait for it: the second Ctrl-C lands there
    asked, asked_on_disk = time.time(), file_clock(tmp_path / "asked")
    proc.send_signal(signal.SIGINT)
    err.wait_for("mpper: Ctrl-C: stopping")
    proc.send_signal(signal.SIGINT)
    err.wait_for("mpper: Ctrl-C: still stopping")
    os.kill(learner, signal.SIGCONT)
    code, stdout, stderr = finish(proc, out, err)
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "interrupted (Ctrl-C); run directory" in stdout and "missing" not in stdout
    assert snapshot_time(run_dir) >= asked  # the final snapshot
    records = [json.loads(x) for x in complete_lines(run_dir / "metrics.jsonl")]
    assert records[-1]["event"] == "end"
    assert (run_dir / "checkpoint.pt").stat().st_mtime >= asked_on_disk  # the learner's final checkpoint
    assert_no_process_left(run_dir)
    assert not segments_of(proc.pid)


def test_a_third_ctrl_c_quits_at_once_and_says_what_is_lost(tmp_path):
    run_dir = tmp_path / "run"
    proc, out, err = start(run_dir, "--set", "replay.snapshot_interval_s=0")
    wait_until_training(proc, run_dir)
    stop_learner(run_dir)  # stopped for good: only the third Ctrl-C can end the wait for it
    proc.send_signal(signal.SIGINT)
    err.wait_for("mpper: Ctrl-C: stopping")
    proc.send_signal(signal.SIGINT)
    err.wait_for("mpper: Ctrl-C: still stopping")
    proc.send_signal(signal.SIGINT)
    stdout = assert_quit_at_once(proc, out, err, run_dir)  # the stopped learner was killed
    assert "the final checkpoint is missing" in stdout
    assert not (run_dir / "buffer").exists()  # snapshot_interval_s=0: only the final one, which was skipped


def test_a_learner_that_never_delivers_its_final_checkpoint_fails_the_run(tmp_path):
    """The learner is stopped (SIGSTOP) from its start, so at the time limit it cannot
    write its final checkpoint and is stopped by force: exit code 1, not 0, and the
    message says the checkpoint is missing. (The learner's join timeout is lowered to
    2 s so that the test does not wait the real 60.)"""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-c", "import sys, mpper.runtime.supervisor as r, mpper.cli as c; r._LEARNER_JOIN_TIMEOUT_S = 2.0; "
            "sys.argv[0] = 'run.py'; sys.exit(c.main(sys.argv[1:]))",
            *run_args(run_dir, "--workers", "2", "--time-limit", "3")[2:]]  # fmt: skip
    proc, out, err = start(run_dir, argv=argv)
    deadline = time.monotonic() + 60
    while not (run_dir / "processes.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, err.text()
        time.sleep(0.02)
    stop_learner(run_dir)
    code, stdout, stderr = finish(proc, out, err)
    assert code == 1, stdout[-2000:] + stderr[-3000:]
    assert ("time limit of 3 s reached, but the final checkpoint is missing: the learner did not stop within 2 s "
            "and was stopped by force; there is no checkpoint.pt") in stdout  # fmt: skip
    assert_no_process_left(run_dir)
    assert not segments_of(proc.pid)


def test_a_killed_forkserver_is_reported_as_such_and_its_children_stopped(tmp_path):
    run_dir = tmp_path / "run"
    proc, out, err = start(run_dir)
    wait_until_training(proc, run_dir)
    servers = [p for p in forkserver_of(proc.pid) if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(servers) == 1
    os.kill(servers[0], signal.SIGKILL)
    code, stdout, stderr = finish(proc, out, err)
    assert code == 1, stderr[-3000:]
    assert f"mpper: run stopped: the forkserver (pid {servers[0]}) that starts and watches mpper's processes died; " \
           "still running, now stopped: learner (pid" in stderr  # fmt: skip
    assert "exit code 255" not in stderr
    assert_no_process_left(run_dir, within=30)  # the orphaned children saw the stop signal and exited
    assert not segments_of(proc.pid)


def test_ctrl_cs_that_land_as_the_shutdown_begins_still_quit_at_once(tmp_path):
    """The second and third Ctrl-C land at the first line of the shutdown, before any
    code that could catch an exception (they are raised there, in the run's own
    process, by a patched ``begin_shutdown``): the run must still kill its children,
    unlink its segments and exit, not wait at exit for children nobody stopped."""
    run_dir = tmp_path / "run"
    patch = ("import signal, sys, mpper.cli as c, mpper.runtime.procs as p\n"
             "begin = p.StopRequests.begin_shutdown\n"
             "def begin_with_two_more_ctrl_cs(self):\n"
             "    signal.raise_signal(signal.SIGINT)\n"
             "    signal.raise_signal(signal.SIGINT)\n"
             "    begin(self)\n"
             "p.StopRequests.begin_shutdown = begin_with_two_more_ctrl_cs\n"
             "sys.argv[0] = 'run.py'\n"
             "sys.exit(c.main(sys.argv[1:]))\n")  # fmt: skip
    argv = [sys.executable, "-c", patch, *run_args(run_dir, "--workers", "2", "--max-train-steps", "100000")[2:]]
    proc, out, err = start(run_dir, argv=argv)
    wait_until_training(proc, run_dir)
    proc.send_signal(signal.SIGINT)
    assert_quit_at_once(proc, out, err, run_dir)


def test_ctrl_c_stops_an_in_process_run_with_its_checkpoint_and_snapshot(tmp_path):
    """``--workers 0``: the Ctrl-C is raised at the loop's next turn (never inside a
    buffer write, whose lock the final snapshot needs), and the run stops with its
    final checkpoint and snapshot."""
    run_dir = tmp_path / "run"
    proc, out, err = start(run_dir, argv=run_args(run_dir, "--workers", "0", "--max-train-steps", "100000"))
    wait_until_training(proc, run_dir)
    asked, asked_on_disk = time.time(), file_clock(tmp_path / "asked")
    proc.send_signal(signal.SIGINT)
    code, stdout, stderr = finish(proc, out, err)
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "interrupted (Ctrl-C); run directory" in stdout
    assert snapshot_time(run_dir) >= asked
    assert (run_dir / "checkpoint.pt").stat().st_mtime >= asked_on_disk
    records = [json.loads(x) for x in complete_lines(run_dir / "metrics.jsonl")]
    assert records[-1]["event"] == "end"
