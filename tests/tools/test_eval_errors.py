"""Error paths of --evaluate (with --render and --on-snapshot) and --plot, on real runs:
each mistake is one line ``error: ...`` on stderr, exit code 2, and nothing written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_train_e2e import ROOT, SMALL

from mpper import ReplayBuffer
from mpper.algos.dqn.targets import dqn_schema
from mpper.algos.muzero.targets import muzero_schema
from mpper.cli import main

pytestmark = pytest.mark.timeout(120)


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``root`` with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def fails_cleanly(argv: list[str], capsys, watched: Path, *fragments: str) -> str:
    """Run the command line in-process: exit 2, nothing on stdout, one ``error:`` line on
    stderr holding every fragment, and nothing under ``watched`` created or changed."""
    before = listing(watched)
    assert main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert out == "", out
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert listing(watched) == before
    return err


@pytest.fixture
def run(trained_run, tmp_path):
    return shutil.copytree(trained_run, tmp_path / "run")


def test_missing_run_directory(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    gif = str(tmp_path / "x.gif")
    for argv in (["--evaluate", missing], ["--evaluate", missing, "--on-snapshot", missing],
                 ["--evaluate", missing, "--render", "gif", gif]):  # fmt: skip
        fails_cleanly(argv, capsys, tmp_path, f"--evaluate {missing}: no run directory")
    fails_cleanly(["--plot", missing], capsys, tmp_path, f"--plot {missing}: no such run directory")


def test_missing_checkpoint(run, tmp_path, capsys):
    (run / "checkpoint.pt").unlink()
    (run / "best.pt").unlink()  # without best.pt, --evaluate plays checkpoint.pt
    ckpt = str(run / "checkpoint.pt")
    fails_cleanly(["--evaluate", str(run), "--on-snapshot", str(run / "buffer")], capsys, tmp_path, ckpt, "no such file")
    fails_cleanly(["--evaluate", str(run), "--render", "gif", str(tmp_path / "x.gif")], capsys, tmp_path, ckpt)
    other = str(tmp_path / "other.pt")
    fails_cleanly(["--evaluate", str(run), "--on-snapshot", str(run / "buffer"), "--checkpoint", other], capsys,
                  tmp_path, other)  # fmt: skip


@pytest.mark.parametrize("schema,fragment", [
    (muzero_schema((8,), 3), ("observation is (8,) float32 there, the run stores (4,) float32; "
                              "child_visits is (3,) float32 there, the run stores (2,) float32")),
    (dqn_schema((4,)), "fields the snapshot lacks: to_play, root_value, child_visits, legal_actions, "
                       "reanalysed_value, reanalysed_policy"),
], ids=["other-env", "dqn-buffer"])  # fmt: skip
def test_snapshot_of_another_schema_names_both(run, tmp_path, capsys, schema, fragment):
    buf = ReplayBuffer.create(schema, 64)
    try:
        obs_shape = schema["observation"][0]
        buf.add_episode({"observation": np.zeros((5, *obs_shape), np.float32), "reward": np.ones(5)})
        buf.save(tmp_path / "other")
    finally:
        buf.close()
    fails_cleanly(["--evaluate", str(run), "--on-snapshot", str(tmp_path / "other")], capsys, tmp_path,
                  f"snapshot {tmp_path / 'other'} does not match run {run}: {fragment}")  # fmt: skip


def _data_offset(path: Path) -> int:
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def test_corrupt_snapshot(run, tmp_path, capsys):
    snap = run / "buffer"
    argv = ["--evaluate", str(run), "--on-snapshot", str(snap)]
    obs = snap / "field.observation.npy"
    good = obs.read_bytes()
    obs.write_bytes(good[:-7])  # truncated
    fails_cleanly(argv, capsys, tmp_path, str(obs), "truncated")
    raw = bytearray(good)
    raw[_data_offset(obs) + 3] ^= 0x40  # one bit of one observation: still a valid .npy
    obs.write_bytes(bytes(raw))
    fails_cleanly(argv, capsys, tmp_path, str(obs), "sha256 checksum mismatch")
    (snap / "manifest.json").unlink()
    fails_cleanly(argv, capsys, tmp_path, "manifest.json")
    fails_cleanly(["--evaluate", str(run), "--on-snapshot", str(tmp_path / "none")], capsys, tmp_path,
                  f"{tmp_path / 'none'}: no such snapshot directory")  # fmt: skip


# A tiny env without rgb_array frames, importable as "<module>:<callable>" (config env.id).
TINY_ENV = '''
import gymnasium as gym
import numpy as np


class NoFrames(gym.Env):
    """Walks 12 steps; renders only for people ("human"), never to an array."""

    metadata = {"render_modes": ["human"], "render_fps": 4}

    def __init__(self, render_mode=None):
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.full(4, self.t / 12 if action else -self.t / 12, np.float32)
        return obs, 1.0, self.t >= 12, False, {}


def no_render_mode():
    """A factory that takes no render_mode at all."""
    return NoFrames()
'''


@pytest.mark.slow
def test_render_on_an_env_without_rgb_array(tmp_path, capsys, monkeypatch):
    (tmp_path / "noframes_env.py").write_text(textwrap.dedent(TINY_ENV))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "run.py", "--config", "configs/cartpole.json", "--device", "cpu",
                           "--run-dir", str(run_dir), *SMALL, "--workers", "0", "--max-train-steps", "2",
                           "--set", "env.id=noframes_env:NoFrames", "--set", "reanalyse.enabled=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=100, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.syspath_prepend(str(tmp_path))  # the env module, for the in-process calls below
    gif = tmp_path / "out" / "episode.gif"
    gif.parent.mkdir()
    # a run directory's env factory is used only when named on the command line
    for factory, fragment in (("NoFrames", "cannot render rgb_array frames (its render_modes: ['human'])"),
                              ("no_render_mode", "cannot be made with render_mode='rgb_array'")):  # fmt: skip
        argv = ["--evaluate", str(run_dir), "--render", "gif", str(gif), "--set", f"env.id=noframes_env:{factory}"]
        fails_cleanly(argv, capsys, tmp_path, f"error: --render: env 'noframes_env:{factory}' {fragment}")
    # no GIF, no temp file, no evaluation.json (fails_cleanly compared the whole tree);
    # the same run evaluates without --render: the error was about frames only
    assert main(["--evaluate", str(run_dir), "--episodes", "1", "--set", "env.id=noframes_env:NoFrames"]) == 0
    assert "return: mean 12.00" in capsys.readouterr().out
