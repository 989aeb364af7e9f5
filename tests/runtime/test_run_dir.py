"""Who writes into a run directory: one live run at a time (a lock the kernel drops when
its holder exits, however it exits), never over a finished run without ``--resume``,
and a directory that cannot be written is one line before anything starts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
from test_bad_input import fails_cleanly
from test_train_e2e import ROOT, run_args, wait_until_training

from mpper.cli import main

pytestmark = pytest.mark.timeout(240)

CONFIG = str(ROOT / "configs" / "cartpole.json")


@pytest.mark.slow
def test_a_second_run_into_a_live_runs_directory_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(run_args(run_dir, "--workers", "0", "--max-train-steps", "100000"), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until_training(first, run_dir)
        config = (run_dir / "config.json").read_bytes()
        for argv in (["--config", CONFIG, "--run-dir", str(run_dir), "--max-train-steps", "5"],
                     ["--resume", str(run_dir), "--max-train-steps", "5"]):  # fmt: skip
            assert main([*argv, "--device", "cpu", "--workers", "0"]) == 2
            out, err = capsys.readouterr()
            assert out == "" and len(err.splitlines()) == 1, err
            assert f"{run_dir}: a run is still writing there (pid {first.pid} holds {run_dir / '.lock'})" in err
        assert (run_dir / "config.json").read_bytes() == config  # the live run's, untouched
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130


def test_a_finished_run_is_continued_only_with_resume(trained_run, tmp_path, capsys):
    run = shutil.copytree(trained_run, tmp_path / "run")
    fails_cleanly(["--config", CONFIG, "--run-dir", str(run), "--device", "cpu"], capsys, run,
                  [f"--run-dir {run}: holds a run already (config.json, metrics.jsonl, checkpoint.pt, buffer); "
                   f"continue it with --resume {run}"])  # fmt: skip


@pytest.mark.slow
def test_the_lock_of_a_killed_run_does_not_outlive_it(trained_run, tmp_path, capsys):
    """A process holding the run directory (as a run does) is SIGKILLed: its lock goes
    with it, though the lock file still names its pid, and --resume proceeds."""
    run = shutil.copytree(trained_run, tmp_path / "run")
    hold = ("import sys; from pathlib import Path; from mpper.runtime.rundir import claim_run_dir; "
            "lock = claim_run_dir(Path(sys.argv[1]), '--resume', True); print('held', flush=True); sys.stdin.read()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        assert main(["--resume", str(run), "--device", "cpu", "--max-train-steps", "45"]) == 2
        assert f"a run is still writing there (pid {holder.pid} holds" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.communicate()
    assert (run / ".lock").read_text().strip() == str(holder.pid)
    assert main(["--resume", str(run), "--device", "cpu", "--max-train-steps", "45"]) == 0


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write into: a read-only tmpfs where mounting is allowed
    (root ignores permission bits), else mode 0555 for a user who is not root."""
    path = tmp_path / "ro"
    path.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(path)], capture_output=True,
                           text=True, check=False)  # fmt: skip
    if mount.returncode != 0:
        if os.geteuid() == 0:
            pytest.skip(f"root, and cannot mount a read-only tmpfs: {mount.stderr.strip()}")
        path.chmod(0o555)
    try:
        yield path
    finally:
        if mount.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=False)
        else:
            path.chmod(0o755)


def test_a_run_directory_that_cannot_be_written_is_one_line(read_only_dir, tmp_path, capsys):
    for run in (read_only_dir, read_only_dir / "run"):
        fails_cleanly(["--config", CONFIG, "--run-dir", str(run), "--device", "cpu"], capsys, tmp_path,
                      [f"--run-dir {run}: cannot write there ({read_only_dir}: "])  # fmt: skip


def test_a_run_directory_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    run = tmp_path / "file" / "run"
    fails_cleanly(["--config", CONFIG, "--run-dir", str(run), "--device", "cpu"], capsys, tmp_path,
                  [f"--run-dir {run}: cannot be created ({tmp_path / 'file'} is a file, not a directory)"])  # fmt: skip
