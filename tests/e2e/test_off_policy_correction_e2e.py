"""``--set muzero.off_policy_correction=true`` end to end on CartPole (the small e2e
settings, ``--workers 0``), and ``--resume`` of such a run whose snapshot was written
before rows stored their weights step."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from test_train_e2e import ROOT, run_args

from mpper import ReplayBuffer
from mpper.algos.muzero.targets import WEIGHTS_STEP

FIRST, SECOND = 20, 30  # training steps before and after the resume


def weights_steps(snapshot) -> dict[int, np.ndarray]:
    with ReplayBuffer.load(snapshot, mmap=True) as buf:
        return {ref.episode_id: buf.read_episode(ref, [WEIGHTS_STEP])[WEIGHTS_STEP] for ref in buf.episodes()}


def drop_field(snapshot, name: str) -> None:
    """The snapshot as mpper wrote it before it stored ``name``: no file, no manifest entry."""
    manifest = json.loads((snapshot / "manifest.json").read_text())
    (snapshot / f"field.{name}.npy").unlink()
    del manifest["files"][f"field.{name}.npy"]
    manifest["schema"] = [entry for entry in manifest["schema"] if entry["name"] != name]
    (snapshot / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_corrected_run_trains_and_resumes_from_a_snapshot_without_weights_steps(tmp_path):
    run_dir = tmp_path / "run"
    # tau * T_total = 0.05 * 20 = 1 training step: the horizon of most data is 1 to 4 moves;
    # one sample per stored step, so that games go on being played while the learner trains
    proc = subprocess.run(run_args(run_dir, "--workers", "0", "--max-train-steps", str(FIRST), "--seed", "3",
                                   "--set", "training.samples_per_insert=1",
                                   "--set", "muzero.off_policy_correction=true",
                                   "--set", "muzero.auto_td_steps_ratio=0.05"),
                          cwd=ROOT, capture_output=True, text=True, timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"training finished ({FIRST} steps)" in proc.stdout
    config = json.loads((run_dir / "config.json").read_text())
    assert config["muzero"]["off_policy_correction"] is True and config["muzero"]["auto_td_steps_ratio"] == 0.05
    first = weights_steps(run_dir / "buffer")
    assert first and all((np.diff(s) >= 0).all() and 0 <= s.min() and s.max() <= FIRST for s in first.values())
    assert max(s.max() for s in first.values()) > 0  # self-play went on with weights trained since

    drop_field(run_dir / "buffer", WEIGHTS_STEP)
    proc = subprocess.run([sys.executable, "run.py", "--device", "cpu", "--resume", str(run_dir),
                           "--max-train-steps", str(SECOND)],
                          cwd=ROOT, capture_output=True, text=True, timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"training finished ({SECOND} steps)" in proc.stdout
    second = weights_steps(run_dir / "buffer")
    old, new = set(first) & set(second), set(second) - set(first)
    assert old and new and min(new) > max(first)
    assert all((second[i] == 0).all() for i in old)  # stored before the field: 0, the oldest data
    assert all(FIRST <= second[i].min() and second[i].max() <= SECOND for i in new)
