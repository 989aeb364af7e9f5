"""`python run.py --resume RUN_DIR` end to end, in-process (--workers 0) and with worker
processes (--workers 2): train 20 steps and stop; what resuming loads equals what was
saved, array by array (every buffer array, the optimizer's every tensor, the training
step and learning rate); the resumed run goes on from there to 40 steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_e2e import ROOT, SMALL, complete_lines

from mpper import COUNTERS, ReplayBuffer
from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of
from mpper.checkpoint import load_checkpoint
from mpper.envs import env_spec

FIRST, SECOND, BATCH = 20, 40, 32  # training steps before and after the resume; SMALL's batch size
INTERNAL = ("generation", "info", "episodes", "ring", "counters", "max_priority")  # snapshot files besides fields


def run(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "run.py", "--device", "cpu", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=150, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def saved_snapshot(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The manifest and every array of a snapshot, read with plain numpy (not mpper's loader)."""
    manifest = json.loads((path / "manifest.json").read_text())
    arrays = {name: np.load(path / name, allow_pickle=False) for name in manifest["files"]}
    assert len(arrays) == len(manifest["schema"]) + 1 + len(INTERNAL)  # fields, tree_leaves, internal
    return manifest, arrays


def assert_buffer_is_the_snapshot(buf: ReplayBuffer, manifest: dict, saved: dict[str, np.ndarray]) -> None:
    """Every field, the priorities (leaves and the whole sum tree), generations, packed
    slot info, the episode table, the ring state, the counters and the max priority."""
    assert [f.name for f in buf.schema] == [f["name"] for f in manifest["schema"]]
    for f in buf.schema:  # NaN (not reanalysed) equals NaN here
        np.testing.assert_array_equal(buf.fields[f.name], saved[f"field.{f.name}.npy"], err_msg=f.name)
        assert buf.fields[f.name].dtype == saved[f"field.{f.name}.npy"].dtype
    for name in INTERNAL:
        np.testing.assert_array_equal(buf._arrays["_" + name], saved[f"{name}.npy"], err_msg=name)
    leaves = saved["tree_leaves.npy"]
    np.testing.assert_array_equal(buf.priorities(np.arange(buf.capacity)), leaves)
    # the internal nodes: each is exactly left + right, level by level up to the root, as
    # the live tree keeps them (a snapshot stores only the leaves)
    tree, base = buf._tree.tree, buf._tree._leaf_base
    level = np.zeros(base)
    level[: leaves.size] = leaves
    while level.size > 1:
        level = level[0::2] + level[1::2]
        np.testing.assert_array_equal(tree[level.size : 2 * level.size], level)
    assert buf.counters == {**manifest["counters"], "positions": manifest["positions"]} and len(buf) > 0
    assert (buf.capacity, buf.alpha, buf.priority_eps) == (manifest["capacity"], manifest["alpha"],
                                                           manifest["priority_eps"])  # fmt: skip


def assert_trainer_is_the_checkpoint(run_dir: Path, step: int) -> dict:
    """The learner's state after ``load_state_dict(load_checkpoint(...))`` (what both
    resume paths run) against the file read back with plain ``torch.load``."""
    config = load_config(run_dir / "config.json")
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    spec = env_spec(config.env)
    algorithm = algorithm_of(config)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions)
    trainer = algorithm.make_trainer(config, network, torch.device("cpu"))
    trainer.load_state_dict(load_checkpoint(run_dir / "checkpoint.pt"))
    assert saved["training_step"] == trainer.training_step == step
    network = trainer.network.state_dict()
    assert network.keys() == saved["network"].keys()
    for key, tensor in network.items():
        assert torch.equal(tensor, saved["network"][key]), key
    optimizer = trainer.optimizer.state_dict()
    assert optimizer["state"].keys() == saved["optimizer"]["state"].keys()
    assert len(optimizer["state"]) == len(network) and optimizer["param_groups"] == saved["optimizer"]["param_groups"]
    for pid, state in optimizer["state"].items():
        assert state.keys() == saved["optimizer"]["state"][pid].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for name, tensor in state.items():
            assert torch.equal(tensor, saved["optimizer"]["state"][pid][name]), (pid, name)
        assert float(state["step"]) == step  # Adam counted every update (bias correction goes on from here)
    t = config.training
    assert trainer.learning_rate() == pytest.approx(t.lr_init * t.lr_decay_rate ** (step / t.lr_decay_steps))
    # the lr the last update used, kept in the optimizer; the next update uses learning_rate()
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(trainer.learning_rate(step - 1))
    return saved


def episode_rows(buf: ReplayBuffer) -> dict[int, dict[str, np.ndarray]]:
    """{episode id: its rows} of the fields self-play wrote (not the reanalysed values)."""
    names = ["observation", "action", "reward", "to_play", "root_value", "child_visits"]
    return {ref.episode_id: buf.read_episode(ref, names) for ref in buf.episodes()}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_loads_what_was_saved_and_training_goes_on_from_there(tmp_path, workers):
    run_dir = tmp_path / "run"
    run(["--config", "configs/cartpole.json", "--run-dir", str(run_dir), *SMALL, "--workers", str(workers),
         "--seed", "3", "--max-train-steps", str(FIRST), "--set", "training.samples_per_insert=4"])  # fmt: skip

    # 1. What a resume loads is what the first run saved, array by array.
    manifest, saved = saved_snapshot(run_dir / "buffer")
    with ReplayBuffer.load(run_dir / "buffer") as buf:  # into shared memory, as --resume does
        assert_buffer_is_the_snapshot(buf, manifest, saved)
        before = episode_rows(buf)
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as buf:  # and read-only, as the tools do
        assert_buffer_is_the_snapshot(buf, manifest, saved)
    assert_trainer_is_the_checkpoint(run_dir, FIRST)
    c0 = manifest["counters"]
    assert c0["games"] > 0 and c0["samples"] >= FIRST * BATCH and c0["priority_updates_applied"] > 0
    records_before = len(complete_lines(run_dir / "metrics.jsonl"))

    # 2. Resume (config.json of the run, with a new step limit) and train to SECOND.
    proc = run(["--resume", str(run_dir), "--max-train-steps", str(SECOND)])
    assert f"training finished ({SECOND} steps)" in proc.stdout
    resumed = [json.loads(line) for line in complete_lines(run_dir / "metrics.jsonl")[records_before:]]
    assert resumed and resumed[-1]["event"] == "end"
    for r in resumed:  # counters and training step grow from the saved values, never from 0
        assert all(r["counters"][k] >= c0[k] for k in COUNTERS), r["counters"]
        step = r["learner"].get("training_step")
        assert step is None or FIRST <= step <= SECOND
    assert resumed[-1]["learner"]["training_step"] == SECOND

    manifest2, _ = saved_snapshot(run_dir / "buffer")
    c1 = manifest2["counters"]
    assert c1["games"] > c0["games"] and c1["steps"] > c0["steps"]
    assert c1["priority_updates_applied"] >= c0["priority_updates_applied"] + (SECOND - FIRST) * BATCH
    if workers == 0:  # one process, no batch drawn ahead: exactly one batch per step
        assert c1["samples"] == SECOND * BATCH
    else:  # the learner process may have drawn one batch ahead in each run
        assert SECOND * BATCH <= c1["samples"] <= (SECOND + 2) * BATCH
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as buf:
        after = episode_rows(buf)
    # the first run's episodes are still there, unchanged, and new ones follow their ids
    assert set(before) < set(after) and min(set(after) - set(before)) > max(before)
    for episode_id, rows in before.items():
        for name, values in rows.items():
            np.testing.assert_array_equal(after[episode_id][name], values, err_msg=f"{episode_id} {name}")
    # the optimizer went on counting (Adam's step 40, not 20 from a fresh one) at the decayed lr
    assert_trainer_is_the_checkpoint(run_dir, SECOND)


def test_resume_refuses_a_live_run_and_a_run_without_checkpoint(trained_run, tmp_path, capsys):
    import shutil

    from mpper.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    # a live run still writing there (a Python process holding the directory as a run
    # does stands in for it)
    hold = ("import sys; from pathlib import Path; from mpper.runtime.rundir import claim_run_dir; "
            "lock = claim_run_dir(Path(sys.argv[1]), '--resume', True); print('held', flush=True); sys.stdin.read()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    live = subprocess.Popen([sys.executable, "-c", hold, str(run_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert live.stdout.readline() == "held\n"
        assert main(["--resume", str(run_dir)]) == 2
    finally:
        live.kill()
        live.communicate()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "still writing there" in err[0] and str(live.pid) in err[0]
    # a dead one is fine to resume from; but not without a checkpoint
    (run_dir / "checkpoint.pt").unlink()
    assert main(["--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint.pt to resume from" in err[0]


@pytest.mark.slow
def test_a_resumed_run_keeps_its_best_checkpoint_unless_beaten(trained_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    best = torch.load(run_dir / "best.pt", weights_only=True)
    best["extra"]["mean_return"] = 1e9  # no evaluation of the resumed run can beat it
    torch.save(best, run_dir / "best.pt")
    before = len(complete_lines(run_dir / "metrics.jsonl"))
    run(["--resume", str(run_dir), "--max-train-steps", "50", "--set", "runtime.evaluation_interval_s=0.1"])
    resumed = [json.loads(x) for x in complete_lines(run_dir / "metrics.jsonl")][before:]
    assert [r for r in resumed if r["event"] == "evaluation"]  # the resumed run evaluated (first after one round)
    assert resumed[-1]["event"] == "end" and resumed[-1]["learner"]["training_step"] == 50
    kept = torch.load(run_dir / "best.pt", weights_only=True)
    assert kept["extra"]["mean_return"] == 1e9 and kept["training_step"] == best["training_step"]


@pytest.mark.parametrize("break_it", ["moment-shape", "no-param-groups", "group-count"])
def test_a_checkpoint_whose_optimizer_state_is_broken_is_refused_in_one_line(trained_run, tmp_path, capsys,
                                                                             break_it):  # fmt: skip
    """The learner would load it and fail at its first step (a moment of the wrong shape),
    or at once with a traceback; --resume refuses it before anything starts."""
    import shutil

    from mpper.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    optimizer = state["optimizer"]
    if break_it == "moment-shape":
        moments = next(iter(optimizer["state"].values()))
        moments["exp_avg"] = torch.zeros(3, 3, 3)
    elif break_it == "no-param-groups":
        del optimizer["param_groups"]
    else:
        optimizer["param_groups"].append(dict(optimizer["param_groups"][0]))
    torch.save(state, run_dir / "checkpoint.pt")
    assert main(["--resume", str(run_dir), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --resume {run_dir}: ") and "the trainer's state does not " \
        "load" in err[0], err  # fmt: skip
