"""MP4 videos of greedy episodes (the ``video`` extra: imageio and imageio-ffmpeg).

``--evaluate RUN --render mp4 PATH`` records the first evaluation episode; with
``runtime.video_every_evaluations`` the run records one greedy episode every Nth
evaluation to ``run_dir/videos/<training step>.mp4``
(:func:`mpper.runtime.evaluation.record_greedy_episode`).
Frames go to ffmpeg as the episode is played (H.264, yuv420p: an even width and height,
the frame padded by one row or column where not), so a long episode holds no frame in memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from ..extras import require

__all__ = ["EpisodeRecorder", "Mp4Writer", "require_video"]


def require_video(purpose: str):
    """The ``imageio_ffmpeg`` module, or MissingExtraError naming the ``video`` extra."""
    return require("imageio_ffmpeg", "imageio-ffmpeg", "video", purpose)


class Mp4Writer:
    """An H.264 MP4 at ``fps`` frames per second, written atomically: frames go to a
    temporary file beside ``path`` that :meth:`close` renames over it (a failure, or
    :meth:`discard`, leaves no file)."""

    def __init__(self, path: Path, fps: float) -> None:
        self.ffmpeg = require_video("an MP4 video")
        self.path = Path(path)
        self.fps = fps
        self.tmp = self.path.with_name(f".{self.path.stem}.tmp-{os.getpid()}{self.path.suffix or '.mp4'}")
        self.frames = 0
        self._gen: Any = None  # imageio-ffmpeg's frame writer (a generator), from the first frame

    def add(self, frame: np.ndarray) -> None:
        """One ``(H, W, 3)`` (or RGBA) uint8 frame."""
        frame = np.ascontiguousarray(frame[..., :3])
        h, w = frame.shape[:2]
        if h % 2 or w % 2:  # yuv420p needs even sides: pad with the edge rather than rescale
            frame = np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")
        if self._gen is None:
            self._gen = self.ffmpeg.write_frames(str(self.tmp), (frame.shape[1], frame.shape[0]), fps=self.fps,
                                                 codec="libx264", pix_fmt_out="yuv420p", macro_block_size=1,
                                                 output_params=["-crf", "18"], ffmpeg_log_level="error")  # fmt: skip
            self._gen.send(None)
        self._gen.send(frame)
        self.frames += 1

    def close(self) -> None:
        if self._gen is None:
            return
        self._gen.close()
        self._gen = None
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if self._gen is not None:
            try:
                self._gen.close()
            except Exception:
                pass
            self._gen = None
        self.tmp.unlink(missing_ok=True)


class EpisodeRecorder(gym.Wrapper):
    """Gives every frame of the env's first episode (after the reset and after each step)
    to ``writer.add``; later episodes are not recorded."""

    def __init__(self, env: gym.Env, writer: Mp4Writer) -> None:
        super().__init__(env)
        self.writer = writer
        self.recording = True

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        if self.recording and self.writer.frames == 0:
            self.writer.add(self.env.render())
        return out

    def step(self, action):
        out = self.env.step(action)
        if self.recording:
            self.writer.add(self.env.render())
            if out[2] or out[3]:  # terminated or truncated: the first episode is complete
                self.recording = False
        return out
