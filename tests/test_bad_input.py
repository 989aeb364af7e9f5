"""Bad input through the command line a user types, on a real run directory: corrupt
snapshots (``--inspect``, ``--resume``) and checkpoints (``--evaluate``, ``--resume``),
and a buffer larger than /dev/shm. Each is one line ``error: ...`` on stderr naming the
file and what is wrong, exit code 2, nothing started, nothing in the run changed, and a
pickled object is never unpickled. (Config mistakes: the table in tests/test_cli.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_e2e import ROOT, run_args

from mpper import shm
from mpper.algos.registry import get_algorithm
from mpper.cli import main
from mpper.replay.buffer import segment_bytes

pytestmark = pytest.mark.timeout(120)


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def error_lines(err: str) -> list[str]:
    # a start may also say that it removed what a dead run (another test session's) left
    return [line for line in err.splitlines() if "left by dead runs" not in line]


def fails_cleanly(argv: list[str], capsys, watched: Path, fragments: list[str]) -> str:
    before = listing(watched)
    assert main(argv) == 2, argv
    out, err = capsys.readouterr()
    lines = error_lines(err)
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert listing(watched) == before, "the command changed the run directory"
    return lines[0]


@pytest.fixture
def run(trained_run, tmp_path) -> Path:
    return shutil.copytree(trained_run, tmp_path / "run")


# ---- snapshots ---------------------------------------------------------------------------
def _manifest(snap: Path) -> dict:
    return json.loads((snap / "manifest.json").read_text())


def _write_manifest(snap: Path, manifest: dict) -> None:
    (snap / "manifest.json").write_text(json.dumps(manifest))


def _data_offset(path: Path) -> int:
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def truncated_array(snap: Path, marker: Path) -> list[str]:
    p = snap / "field.observation.npy"
    p.write_bytes(p.read_bytes()[:-7])
    return [str(p), "truncated"]


def manifest_dtype(snap: Path, marker: Path) -> list[str]:
    m = _manifest(snap)
    m["files"]["field.reward.npy"]["dtype"] = "<f8"
    _write_manifest(snap, m)
    return ["field.reward.npy is listed as <f8", "the schema needs <f4"]


def manifest_shape(snap: Path, marker: Path) -> list[str]:
    m = _manifest(snap)
    m["files"]["field.child_visits.npy"]["shape"][1] = 3
    _write_manifest(snap, m)
    return ["field.child_visits.npy is listed as", ", 3]"]


def checksum_mismatch(snap: Path, marker: Path) -> list[str]:
    p = snap / "field.root_value.npy"
    raw = bytearray(p.read_bytes())
    raw[_data_offset(p) + 9] ^= 0x01  # one bit: still a valid .npy of the right size
    p.write_bytes(bytes(raw))
    return [str(p), "sha256 checksum mismatch"]


def missing_array(snap: Path, marker: Path) -> list[str]:
    (snap / "tree_leaves.npy").unlink()
    return [f"{snap / 'tree_leaves.npy'}: missing"]


def future_format_version(snap: Path, marker: Path) -> list[str]:
    m = _manifest(snap)
    m["format_version"] = 2
    _write_manifest(snap, m)
    return [str(snap / "manifest.json"), "unknown format_version 2; this mpper reads version 1"]


def manifest_not_json(snap: Path, marker: Path) -> list[str]:
    (snap / "manifest.json").write_text('{"format": "mpper-replay-snapshot", "files": {')
    return [str(snap / "manifest.json"), "not valid JSON"]


class _Marker:
    """Unpickling this creates the file ``path``: proof that the loader ran pickle."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickled_object_array(snap: Path, marker: Path) -> list[str]:
    p = snap / "field.observation.npy"
    evil = np.empty(tuple(_manifest(snap)["files"][p.name]["shape"]), dtype=object)
    evil[0, 0] = _Marker(marker)
    np.save(p, evil, allow_pickle=True)
    return [str(p), "holds Python objects; refused"]


# ---- crafted snapshots: every checksum matches, the contents make no sense ------------------
def _rewrite_array(snap: Path, name: str, array: np.ndarray) -> None:
    """Replace ``name`` with ``array`` and list its new checksum, as a crafted file would."""
    np.save(snap / name, array)
    m = _manifest(snap)
    m["files"][name]["sha256"] = hashlib.sha256((snap / name).read_bytes()).hexdigest()
    _write_manifest(snap, m)


def _edit_array(snap: Path, name: str, edit) -> None:
    array = np.load(snap / name)
    edit(array)
    _rewrite_array(snap, name, array)


def ring_counters_far_beyond_capacity(snap: Path, marker: Path) -> list[str]:
    capacity = _manifest(snap)["capacity"]
    _rewrite_array(snap, "ring.npy", np.array([capacity + 10**9, 10**15, 0, -7], np.int64))
    return [str(snap / "ring.npy"), f"WRITE_POS {capacity + 10**9} outside [0, {capacity}]"]


def next_episode_id_far_ahead(snap: Path, marker: Path) -> list[str]:
    def edit(ring):
        ring[1] = 2 * 10**8  # NEXT_ID: 2e8 resident episodes in a table of a few hundred rows

    _edit_array(snap, "ring.npy", edit)
    return [str(snap / "ring.npy"), "resident episodes (NEXT_ID 200000000"]


def episode_past_the_ring(snap: Path, marker: Path) -> list[str]:
    ring = np.load(snap / "ring.npy")
    table = np.load(snap / "episodes.npy")
    row = int(ring[2] % table.shape[0])  # the oldest resident episode

    def edit(t):
        t[row, 1] = _manifest(snap)["capacity"] - 1  # START: its rows run past the last slot

    _edit_array(snap, "episodes.npy", edit)
    return [str(snap / "episodes.npy"), f"episode {table[row, 0]} has start", "must lie within the ring"]


def episode_with_negative_start(snap: Path, marker: Path) -> list[str]:
    ring = np.load(snap / "ring.npy")
    row = int(ring[2] % np.load(snap / "episodes.npy").shape[0])

    def edit(t):
        t[row, 1] = -5

    _edit_array(snap, "episodes.npy", edit)
    return [str(snap / "episodes.npy"), "has start -5"]


def slot_info_claims_a_huge_episode(snap: Path, marker: Path) -> list[str]:
    table, ring = np.load(snap / "episodes.npy"), np.load(snap / "ring.npy")
    newest = table[int((ring[1] - 1) % table.shape[0])]
    slot = int(newest[1])

    def edit(info):
        info[slot] = (1 << 30) - 1 << 2  # position 0 of an episode of 2^30 - 1 moves

    _edit_array(snap, "info.npy", edit)
    return [str(snap / "info.npy"), f"slot {slot} holds"]


def manifest_alpha_nan(snap: Path, marker: Path) -> list[str]:
    m = _manifest(snap)
    m["alpha"] = float("nan")
    _write_manifest(snap, m)
    return [str(snap / "manifest.json"), "alpha must be a finite number >= 0, got nan"]


def manifest_alpha_negative(snap: Path, marker: Path) -> list[str]:
    m = _manifest(snap)
    m["alpha"] = -0.5
    _write_manifest(snap, m)
    return [str(snap / "manifest.json"), "alpha must be a finite number >= 0, got -0.5"]


def manifest_initial_priority_wrong_type(snap: Path, marker: Path) -> list[str]:
    m = _manifest(snap)
    m["initial_priority"] = [1]
    _write_manifest(snap, m)
    return [str(snap / "manifest.json"), 'initial_priority must be "max" or a finite number >= 0, got [1]']


def fifo_in_place_of_an_array(snap: Path, marker: Path) -> list[str]:
    (snap / "ring.npy").unlink()
    os.mkfifo(snap / "ring.npy")  # a reader that opens it waits for a writer for ever
    return [str(snap / "ring.npy"), "is a FIFO, not a regular file (refused)"]


def fifo_in_place_of_the_manifest(snap: Path, marker: Path) -> list[str]:
    (snap / "manifest.json").unlink()
    os.mkfifo(snap / "manifest.json")
    return [str(snap / "manifest.json"), "is a FIFO, not a regular file (refused)"]


def symlink_out_of_the_snapshot(snap: Path, marker: Path) -> list[str]:
    outside = snap.parent.parent / "elsewhere.npy"  # a file beside the run directory
    shutil.copyfile(snap / "counters.npy", outside)
    (snap / "counters.npy").unlink()
    (snap / "counters.npy").symlink_to(outside)
    return [str(snap / "counters.npy"), "is a symbolic link"]


SNAPSHOT_CASES = [truncated_array, manifest_dtype, manifest_shape, checksum_mismatch, missing_array,
                  future_format_version, manifest_not_json, pickled_object_array,
                  ring_counters_far_beyond_capacity, next_episode_id_far_ahead, episode_past_the_ring,
                  episode_with_negative_start, slot_info_claims_a_huge_episode, manifest_alpha_nan,
                  manifest_alpha_negative, manifest_initial_priority_wrong_type, fifo_in_place_of_an_array,
                  fifo_in_place_of_the_manifest, symlink_out_of_the_snapshot]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "resume"])
@pytest.mark.parametrize("corrupt", SNAPSHOT_CASES, ids=lambda f: f.__name__)
def test_corrupt_snapshot(run, tmp_path, capsys, corrupt, command):
    marker = tmp_path / "unpickled"
    fragments = corrupt(run / "buffer", marker)
    if command == "inspect":
        fails_cleanly(["--inspect", str(run / "buffer")], capsys, run, fragments)
    elif corrupt is checksum_mismatch:
        # --resume reads headers and sizes up front and leaves the checksums to the
        # run's own load, which finds the mismatch before any child starts (having
        # rewritten config.json and processes.json); the data is left as it was
        watched = run / "buffer"
        fails_cleanly(["--resume", str(run), "--device", "cpu"], capsys, watched, fragments)
    else:
        fails_cleanly(["--resume", str(run), "--device", "cpu"], capsys, run, [f"--resume {run}: ", *fragments])
    assert not marker.exists(), "the snapshot's pickled object was unpickled"
    if corrupt is pickled_object_array:  # the file really would have run code
        np.load(run / "buffer" / "field.observation.npy", allow_pickle=True)
        assert marker.exists()


def test_resume_with_workers_finds_a_checksum_mismatch_before_any_child_starts(run, tmp_path, capsys):
    fragments = checksum_mismatch(run / "buffer", tmp_path / "unused")
    os.remove(run / "processes.json")
    fails_cleanly(["--resume", str(run), "--device", "cpu", "--workers", "2"], capsys, run / "buffer", fragments)
    assert not (run / "processes.json").exists()  # written as the first child starts: none did


# ---- checkpoints -------------------------------------------------------------------------
def pickled_object(ckpt: Path, marker: Path) -> list[str]:
    torch.save({"network": {}, "training_step": 1, "x": _Marker(marker)}, ckpt)
    return [str(ckpt), "cannot be loaded with torch.load(weights_only=True)"]


def truncated_checkpoint(ckpt: Path, marker: Path) -> list[str]:
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    return [str(ckpt), "cannot be loaded with torch.load(weights_only=True)"]


def not_a_checkpoint(ckpt: Path, marker: Path) -> list[str]:
    torch.save({"weights": torch.zeros(3)}, ckpt)
    return [str(ckpt), "not an mpper checkpoint (no 'network' entry)"]


def empty_checkpoint(ckpt: Path, marker: Path) -> list[str]:
    ckpt.write_bytes(b"")
    return [str(ckpt), "cannot be loaded"]


CHECKPOINT_CASES = [pickled_object, truncated_checkpoint, not_a_checkpoint, empty_checkpoint]


@pytest.mark.parametrize("command", ["evaluate", "resume"])
@pytest.mark.parametrize("corrupt", CHECKPOINT_CASES, ids=lambda f: f.__name__)
def test_corrupt_checkpoint(run, tmp_path, capsys, corrupt, command):
    marker = tmp_path / "unpickled"
    # --evaluate judges a run by its best weights, --resume continues from the latest
    ckpt = run / ("best.pt" if command == "evaluate" else "checkpoint.pt")
    assert ckpt.is_file()
    fragments = corrupt(ckpt, marker)
    argv = ["--evaluate", str(run), "--episodes", "1"] if command == "evaluate" else ["--resume", str(run)]
    fails_cleanly(argv, capsys, run, fragments)
    assert not marker.exists(), "the checkpoint's pickled object was unpickled"
    if corrupt is pickled_object:  # the file really would have run code
        torch.load(ckpt, weights_only=False)
        assert marker.exists()


# ---- the machine ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_buffer_larger_than_dev_shm_is_one_line_before_anything_starts(tmp_path):
    """The largest capacity mpper allows (2^30 steps) of a CartPole MuZero buffer needs
    about 86 GiB of shared memory: `python run.py` says so in one line, exit code 2,
    before any child process or segment exists."""
    capacity = 1 << 30
    schema = get_algorithm("muzero").schema((4,), 2, np.dtype(np.float32))
    needed = segment_bytes(schema, capacity)
    free = shm.free_bytes()
    if needed + shm._ROOM_MARGIN <= free:
        pytest.skip(f"/dev/shm has {shm.human_bytes(free)} free, room for the largest buffer ({shm.human_bytes(needed)})")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(run_args(run_dir, "--workers", "2", "--set", f"replay.capacity={capacity}"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = error_lines(err)
    assert proc.returncode == 2, err[-3000:]
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"error: a replay buffer of {capacity} steps needs {shm.human_bytes(needed)} of shared "
                               f"memory but /dev/shm has only ")  # fmt: skip
    assert "Lower the capacity" in lines[0]
    assert not (run_dir / "processes.json").exists()  # written when the first child starts: none did
    assert not [n for n in shm.mpper_segments() if shm.owner_pid(n) == proc.pid]


# ---- a run directory from someone else names code to run ------------------------------------
def _config_names_factory(run: Path, env_id: str, kwargs: dict) -> None:
    config = json.loads((run / "config.json").read_text())
    config["env"]["id"], config["env"]["kwargs"] = env_id, kwargs
    (run / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("command", ["evaluate", "on-snapshot", "resume", "resume-workers"])
def test_a_run_directory_config_never_imports_or_calls_code(run, tmp_path, capsys, command):
    """config.json says env.id "subprocess:run" with kwargs that would run a shell
    command: refused before anything is imported, the command never runs."""
    marker = tmp_path / "ran"
    _config_names_factory(run, "subprocess:run", {"args": f"touch {marker}", "shell": True})
    argv = {
        "evaluate": ["--evaluate", str(run), "--episodes", "1"],
        "on-snapshot": ["--evaluate", str(run), "--on-snapshot", str(run / "buffer")],
        "resume": ["--resume", str(run), "--device", "cpu"],
        "resume-workers": ["--resume", str(run), "--device", "cpu", "--workers", "2"],
    }[command]
    fails_cleanly(argv, capsys, run, [f"{run / 'config.json'}: env.id: \"subprocess:run\" names Python code",
                                      "--set env.id=subprocess:run"])  # fmt: skip
    assert not marker.exists(), "the run directory's config ran a command"


def test_a_run_directory_env_factory_is_used_when_the_user_names_it(run, capsys):
    """The same refusal for a harmless factory, which the user then names on the command
    line: --evaluate plays with it."""
    _config_names_factory(run, "faulty_env:raising", {})
    fails_cleanly(["--evaluate", str(run), "--episodes", "1"], capsys, run, ['"faulty_env:raising" names Python code'])
    assert main(["--evaluate", str(run), "--episodes", "1", "--set", "env.id=faulty_env:raising"]) == 0
    assert "1 greedy episodes" in capsys.readouterr().out


# ---- a checkpoint written for another config ---------------------------------------------------
@pytest.mark.parametrize("command", ["evaluate", "on-snapshot", "resume"])
def test_a_checkpoint_of_another_config_names_the_tensor_and_both_shapes(run, capsys, command):
    """The run trained network.hidden [16] (configs/cartpole.json); asked to load it
    into [32], each command names the first tensor that does not fit and both shapes,
    in one line."""
    argv = {
        "evaluate": ["--evaluate", str(run), "--episodes", "1"],
        "on-snapshot": ["--evaluate", str(run), "--on-snapshot", str(run / "buffer")],
        "resume": ["--resume", str(run), "--device", "cpu"],
    }[command]
    loaded = run / ("best.pt" if command == "evaluate" else "checkpoint.pt")  # --evaluate: the best weights
    fails_cleanly([*argv, "--set", "network.hidden=[32]"], capsys, run,
                  [f"checkpoint {loaded}: 'network': tensor 'representation_network.0.weight' has "
                   "shape (16, 4), the network of this config has (32, 4): written for another config"])  # fmt: skip


# ---- --resume keeps its buffer's replay settings -------------------------------------------------
@pytest.mark.parametrize("override, stored", [("replay.capacity=5000", "20000"), ("replay.alpha=0.25", "0.5"),
                                              ("replay.priority_eps=0.01", "1e-06"),
                                              ("replay.initial_priority=2.0", '"max"')])  # fmt: skip
def test_resume_refuses_replay_settings_its_buffer_cannot_take(run, capsys, override, stored):
    key, value = override.split("=")
    fails_cleanly(["--resume", str(run), "--device", "cpu", "--max-train-steps", "41", "--set", override], capsys, run,
                  [f"--resume {run}: {key} is {value} but the buffer snapshot holds {stored} ({run / 'buffer'})",
                   "drop that override, or start a new run in another --run-dir"])  # fmt: skip


# ---- a run that cannot start: one line before anything is written ----------------------------
CARTPOLE = str(ROOT / "configs" / "cartpole.json")


@pytest.mark.parametrize("argv, fragments", [
    (["--set", 'env.kwargs={"nope": 1}'],
     ["env.id 'CartPole-v1' with env.kwargs {\"nope\": 1}: the env cannot be made (TypeError: ",
      "unexpected keyword argument 'nope'"]),
    (["--set", "env.id=mpper.envs.tictactoe:nothing_here"],
     ["env.id 'mpper.envs.tictactoe:nothing_here' with env.kwargs {}: the env cannot be made (AttributeError: module "
      "'mpper.envs.tictactoe' has no attribute 'nothing_here')"]),
    (["--seed", str(2**64)], [f"--seed: expected an integer in [0, 4294967295], got {2**64}"]),
    (["--set", "network.hidden=[65536,65536]"],
     ["error: this run needs about ", "but this machine has ", "network ",
      "(21,481,914,428 parameters, in every process)"]),
    (["--workers", "4096"], ["error: this run needs about ", "runtime.workers 4096 x envs_per_worker 8",
                             "4101 processes "]),
    (["--set", "runtime.envs_per_worker=30000", "--set", "mcts.num_simulations=100000"],
     ["error: this run needs about ", "players ", "MuZero's search trees",
      "(runtime.workers 2 x envs_per_worker 30000 envs, beside the network: MuZero's search trees)"]),
], ids=["env-kwargs", "env-attribute", "seed", "network", "workers", "search"])  # fmt: skip
def test_a_run_that_cannot_start_is_one_line_and_writes_nothing(tmp_path, capsys, argv, fragments):
    """Sizes are computed from the config (the network on torch's meta device: no
    memory), so even a config that would need terabytes is refused at once."""
    run_dir = tmp_path / "run"
    fails_cleanly(["--config", CARTPOLE, "--run-dir", str(run_dir), "--device", "cpu", "--workers", "2", *argv],
                  capsys, tmp_path, fragments)  # fmt: skip
    assert not run_dir.exists()
