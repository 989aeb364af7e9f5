"""A full disk, for real (a small tmpfs): a checkpoint or snapshot that does not fit keeps
the previous one and says so; a periodic one lets training go on, a final one makes the
run's exit code 1 with the reason on its last line."""

from __future__ import annotations

import os
import queue
import subprocess
import threading

import numpy as np
import pytest
from conftest import make_episode
from test_learner import ACTIONS, OBS, _store_for, small_config
from test_train_e2e import ROOT, run_args

from mpper import ReplayBuffer
from mpper.algos.muzero.targets import muzero_schema
from mpper.runtime.children import run_learner
from mpper.runtime.setup import RunSetup


@pytest.fixture
def tiny_disk(tmp_path):
    """A tmpfs of ``size`` at tmp_path/disk-<size>; mounting needs root (as CI runs)."""
    mounted = []

    def mount(size: str):
        disk = tmp_path / f"disk-{size}"
        disk.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                                capture_output=True, text=True, check=False)  # fmt: skip
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}): a full disk needs one")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _learn_on(disk, config) -> OSError:
    """The learner process's main on ``disk`` in this process, over a buffer of 8 stored
    episodes; the OSError it ends with (its final checkpoint, which the run needs)."""
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=512, alpha=0.6)
    store = _store_for(config)
    try:
        rng = np.random.default_rng(0)
        for _ in range(8):
            buf.add_episode(make_episode(rng, 10, OBS, ACTIONS))
        with pytest.raises(OSError) as info:
            run_learner(RunSetup.create(config, disk), buf.handle, store.handle, threading.Event(), queue.Queue())
    finally:
        store.close()
        buf.close()
    return info.value


def test_a_periodic_checkpoint_that_does_not_fit_lets_training_go_on(tiny_disk, capfd):
    """The learner checkpoints after every step onto a disk with room for none: each
    failed write is one line, training reaches its last step, and only the final
    checkpoint, which the run needs, stops the learner with the disk's error."""
    disk = tiny_disk("8k")
    config = small_config(training_steps=6, batch_size=16, min_buffer_steps=8)
    config.runtime.checkpoint_interval_s = 0.0
    assert _learn_on(disk, config).errno == 28  # ENOSPC, from the final checkpoint
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "checkpoint not written" in line]
    # one per step: training went on to its sixth step, each step trying again
    assert len(lines) == 6 and all("training goes on" in line for line in lines), err
    assert not [p for p in disk.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_weights_history_file_that_does_not_fit_lets_training_go_on(tiny_disk, capfd):
    """runtime.weights_history_interval_steps=1 on a disk with room for none: each lost
    file is one line and training reaches its last step (where the final checkpoint, which
    the run needs, stops the learner with the disk's error)."""
    disk = tiny_disk("8k")
    config = small_config(training_steps=6, batch_size=16, min_buffer_steps=8)
    config.runtime.checkpoint_interval_s = 3600.0
    config.runtime.weights_history_interval_steps = 1
    assert _learn_on(disk, config).errno == 28  # ENOSPC, from the final checkpoint
    lines = [line for line in capfd.readouterr().err.splitlines() if "weights/step-" in line]
    assert len(lines) == 6 and all("not written" in line and "training goes on" in line for line in lines), lines


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_final_snapshot_that_does_not_fit_makes_the_run_exit_1_and_says_why(tiny_disk, workers):
    """Room for the run's files and its checkpoint, not for its buffer: the run trains to
    its end, keeps its checkpoint, and exits 1 with the lost snapshot on its last line."""
    disk = tiny_disk("600k")
    run_dir = disk / "run"
    args = run_args(run_dir, "--workers", workers, "--max-train-steps", "20")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "training finished (20 steps)" in last and "but the final buffer snapshot" in last, last
    assert "not written" in last and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (run_dir / "checkpoint.pt").is_file() and not (run_dir / "buffer").exists()
