"""`python run.py --evaluate RUN_DIR --render gif|mp4 PATH` on a real run: the GIF or MP4
holds the first greedy episode, frame by frame; missing packages are one clear line."""

from __future__ import annotations

import json
import shutil
import sys

import gymnasium as gym
import numpy as np
import pytest
from PIL import Image

from mpper.cli import main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def run(trained_run, tmp_path):
    """A copy of the shared run: --evaluate writes evaluation.json into it."""
    return shutil.copytree(trained_run, tmp_path / "run")


def gif_frames(path) -> tuple[list[np.ndarray], list[int], dict]:
    """Every frame of a GIF as RGB, the duration of each (ms) and the file's info."""
    with Image.open(path) as im:
        info = dict(im.info)
        frames, durations = [], []
        for k in range(im.n_frames):
            im.seek(k)
            frames.append(np.asarray(im.convert("RGB")))
            durations.append(im.info["duration"])
    return frames, durations, info


def test_render_writes_the_first_greedy_episode_as_a_looping_gif(run, tmp_path, capsys):
    gif = tmp_path / "out" / "episode.gif"
    gif.parent.mkdir()
    assert main(["--evaluate", str(run), "--episodes", "2", "--seed", "5", "--render", "gif", str(gif)]) == 0
    out = capsys.readouterr().out
    assert f"-> {gif}" in out
    evaluation = json.loads((run / "evaluation.json").read_text())
    moves = int(evaluation["returns"][0])  # CartPole: reward 1 per move, so return = length
    assert evaluation["render"]["frames"] == moves + 1  # the reset, then one frame per move
    frames, durations, info = gif_frames(gif)
    assert info.get("loop") == 0  # loops for ever
    # Pillow merges identical consecutive frames and adds up their durations, so the
    # total time is what counts: (moves + 1) frames of 1000 / 50 fps = 20 ms each
    assert sum(durations) == (moves + 1) * 20 == (moves + 1) * evaluation["render"]["frame_ms"]
    assert frames[0].shape == (400, 600, 3)
    # the first frame is CartPole just after reset(seed=5), the seed of the first episode
    env = gym.make("CartPole-v1", render_mode="rgb_array")
    env.reset(seed=5)
    expected = env.render()
    env.close()
    assert np.abs(frames[0].astype(int) - expected).mean() < 1.0  # 256-colour palette: near exact
    assert np.abs(frames[-1].astype(int) - expected).mean() > 1.0  # the pole moved
    assert [p.name for p in gif.parent.iterdir()] == ["episode.gif"]  # no temp file left


def mp4_frames(path) -> tuple[list[np.ndarray], dict]:
    """Every frame of an MP4 as (H, W, 3) uint8, decoded by ffmpeg, and its metadata."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    return [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader], meta


def test_render_mp4_writes_the_first_greedy_episode_as_a_video(run, tmp_path, capsys):
    mp4 = tmp_path / "out" / "episode.mp4"
    mp4.parent.mkdir()
    assert main(["--evaluate", str(run), "--episodes", "2", "--seed", "5", "--render", "mp4", str(mp4)]) == 0
    assert f"-> {mp4}" in capsys.readouterr().out
    evaluation = json.loads((run / "evaluation.json").read_text())
    moves = int(evaluation["returns"][0])  # CartPole: reward 1 per move, so return = length
    assert evaluation["render"]["frames"] == moves + 1  # the reset, then one frame per move
    frames, meta = mp4_frames(mp4)
    assert len(frames) == moves + 1 and meta["fps"] == 50  # CartPole's render_fps
    assert frames[0].shape == (400, 600, 3)
    env = gym.make("CartPole-v1", render_mode="rgb_array")
    env.reset(seed=5)  # the seed of the first episode
    expected = env.render()
    env.close()
    # H.264 is lossy: the first frame is the reset's frame up to small coding errors
    assert np.abs(frames[0].astype(int) - expected).mean() < 2.0
    assert np.abs(frames[-1].astype(int) - expected).mean() > 2 * np.abs(frames[0].astype(int) - expected).mean()
    assert [p.name for p in mp4.parent.iterdir()] == ["episode.mp4"]  # no temp file left


def test_render_mp4_without_imageio_ffmpeg_is_one_line_naming_the_extra(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    mp4 = tmp_path / "episode.mp4"
    assert main(["--evaluate", str(run), "--episodes", "1", "--render", "mp4", str(mp4)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: --render mp4"), err
    assert "imageio-ffmpeg" in err and "pip install -e .[video]" in err
    assert not mp4.exists() and not (run / "evaluation.json").exists()


@pytest.mark.parametrize("missing,package", [("PIL", "Pillow"), ("pygame", "pygame")])
def test_a_missing_render_package_is_one_line_naming_the_extra(run, tmp_path, capsys, monkeypatch, missing,
                                                                package):  # fmt: skip
    # None in sys.modules makes `import missing` raise ImportError, as if not installed
    for name in [m for m in sys.modules if m == missing or m.startswith(missing + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, missing, None)
    before = sorted(p.name for p in run.iterdir())
    gif = tmp_path / "episode.gif"
    assert main(["--evaluate", str(run), "--episodes", "1", "--render", "gif", str(gif)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: --render"), err
    assert package in err and "pip install -e .[render]" in err
    assert not gif.exists() and sorted(p.name for p in run.iterdir()) == before  # no evaluation.json either


def test_render_format_and_flag_mistakes(run, tmp_path, capsys):
    gif = tmp_path / "x.gif"
    cases = [
        (["--evaluate", str(run), "--render", "avi", str(gif)], "unknown format 'avi'; expected: gif or mp4"),
        (["--render", "gif", str(gif)], "--render does not apply to training runs (it applies to --evaluate)"),
        (["--evaluate", str(run), "--render", "gif"], "--render: expected 2 arguments"),
        (["--evaluate", str(run), "--render", "gif", str(tmp_path / "no" / "x.gif")], "does not exist"),
        (["--evaluate", str(run), "--render", "gif", str(tmp_path)], "is a directory"),
        (["--evaluate", str(run), "--render", "gif", str(gif), "--on-snapshot", str(run / "buffer")],
         "--render does not apply to --evaluate --on-snapshot"),
    ]
    for argv, fragment in cases:
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err
    assert not gif.exists() and not (run / "evaluation.json").exists()
