"""Judge a saved agent: ``python run.py --evaluate RUN_DIR [--episodes N] [--checkpoint FILE] [--seed S]
[--render gif|mp4 PATH]``.

Loads the run's ``config.json`` and its best weights (``best.pt``, the best evaluation the
run made; ``checkpoint.pt`` when it has none; ``--checkpoint FILE`` chooses) with
``torch.load(weights_only=True)``, says which,
plays N greedy episodes (search without noise, most visited action; all N envs searched
together) with a progress bar, prints mean, std, min and max of return and length, and
writes ``evaluation.json`` into the run directory. With ``--render gif PATH``, the first
of those episodes is also recorded from the env's ``rgb_array`` frames and written to
PATH as an animated GIF (needs the ``render`` extra: Pillow, and pygame for gymnasium's
classic-control envs); ``--render mp4 PATH`` writes it as an H.264 MP4 (the ``video``
extra: imageio and imageio-ffmpeg).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from ..algos.configs import load_run_config
from ..algos.registry import algorithm_of, load_run_checkpoint
from ..atomic import write_atomic, write_json_atomic
from ..checkpoint import CheckpointError, load_network_weights
from ..config import ConfigError
from ..envs.render import RenderError, open_render_env
from ..envs.spec import env_spec, make_env
from ..envs.two_player import evaluation_opponents
from ..extras import MissingExtraError, require
from ..runtime.evaluation import play_greedy
from ..runtime.procs import torch_configured
from ..runtime.video import EpisodeRecorder, Mp4Writer, require_video

__all__ = ["RenderError", "describe_weights", "evaluate_main", "evaluate_run", "load_network", "open_render_env",
           "run_weights", "write_gif"]


def evaluate_run(run_dir: Path, episodes: int = 10, checkpoint: Path | None = None, seed: int = 0,
                 render: Path | None = None, overrides: Sequence[str] = (),
                 render_format: str = "gif") -> dict:  # fmt: skip
    """Play ``episodes`` greedy episodes with ``checkpoint`` (default: :func:`run_weights`,
    ``best.pt`` when the run has one); returns the statistics (also written to
    ``run_dir/evaluation.json``).

    ``render``: also write the first episode, as the env draws it, to this file, a GIF
    or (``render_format="mp4"``) an MP4. Every check (Pillow or imageio-ffmpeg installed,
    the env renders ``rgb_array``, the directory exists) runs
    before the first move, so a failed check writes nothing. ``overrides``: ``--set``
    strings applied to the run's config (:func:`mpper.algos.configs.load_run_config`: the only
    way a ``module:callable`` env of a run directory gets imported).
    """
    config = load_run_config(run_dir, overrides)
    named = checkpoint is not None  # --checkpoint FILE: the user's own path, which may be a link of theirs
    checkpoint = checkpoint or run_weights(run_dir)
    spec = env_spec(config.env)
    state = load_run_checkpoint(checkpoint, config, spec, follow_links=named)
    network = load_network(config, spec, state, checkpoint)
    if spec.two_player and algorithm_of(config).two_player:
        if render is not None:
            raise RenderError("--render: not available for a two-player run (its evaluation plays opponents)")
        with torch_configured(config.runtime.torch_threads):
            return _evaluate_two_player(run_dir, config, network, episodes, checkpoint, int(state["training_step"]),
                                        seed)  # fmt: skip
    envs: list[gym.Env] = []
    recorder: EpisodeRecorder | _FirstEpisodeFrames | None = None
    try:
        if render is not None and render_format == "mp4":
            require_video("--render mp4")
            _check_output_path(render, render_format)
            env = open_render_env(config.env)
            recorder = EpisodeRecorder(env, Mp4Writer(render, float(env.metadata.get("render_fps") or 30)))
            envs.append(recorder)
        elif render is not None:
            image = require("PIL.Image", "Pillow", "render", "--render gif")
            _check_output_path(render, render_format)
            recorder = _FirstEpisodeFrames(open_render_env(config.env), image)
            envs.append(recorder)
        envs += [make_env(config.env) for _ in range(episodes - len(envs))]
        started = time.monotonic()
        with tqdm(total=episodes, desc="evaluate", unit="episode", disable=not sys.stderr.isatty()) as bar, \
                torch_configured(config.runtime.torch_threads):  # as the run's evaluator plays
            played = play_greedy(config, envs, network, seed, on_episode=lambda ep: bar.update(1))
        assert played is not None  # None only when stopped, and no stop was given
        if isinstance(recorder, EpisodeRecorder):
            recorder.writer.close()
    except BaseException:
        if isinstance(recorder, EpisodeRecorder):
            recorder.writer.discard()
        raise
    finally:
        for env in envs:
            env.close()
    returns = np.array([ep.total_reward for ep in played])
    lengths = np.array([ep.moves for ep in played])
    stats = {
        "checkpoint": str(checkpoint),
        "training_step": int(state["training_step"]),
        "checkpoint_evaluation": _stored_evaluation(state),
        "episodes": episodes,
        "seed": seed,
        "seconds": round(time.monotonic() - started, 3),
        "return": _describe(returns),
        "length": _describe(lengths),
        "returns": returns.tolist(),
    }
    if isinstance(recorder, EpisodeRecorder):
        stats["render"] = {"path": str(render), "frames": recorder.writer.frames, "fps": recorder.writer.fps,
                           "episode_return": float(returns[0])}  # fmt: skip
    elif recorder is not None and render is not None:  # the GIF's frames
        duration_ms = write_gif(render, recorder.frames, recorder.fps)
        stats["render"] = {"path": str(render), "frames": len(recorder.frames), "frame_ms": duration_ms,
                           "episode_return": float(returns[0])}  # fmt: skip
    write_json_atomic(run_dir / "evaluation.json", stats)
    return stats


def run_weights(run_dir: Path) -> Path:
    """The weights that judge a run: ``best.pt`` (the best evaluation the run made) when
    it has one, else ``checkpoint.pt`` (the learner's latest)."""
    best = run_dir / "best.pt"
    # lexists: a best.pt that is not a regular file is refused when read, never passed over
    return best if os.path.lexists(best) else run_dir / "checkpoint.pt"


def load_network(config, spec, state: dict, checkpoint: Path):
    """The run's network (the algorithm's, for ``spec``'s observation shape and actions)
    with the weights of a loaded checkpoint, in eval mode; CheckpointError when they do
    not fit."""
    network = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions)
    return load_network_weights(network, state["network"], checkpoint).eval()


def _stored_evaluation(state: dict) -> float | None:
    """The mean return ``best.pt`` scored when the run kept it (None: another checkpoint)."""
    mean = (state.get("extra") or {}).get("mean_return")
    return None if mean is None else float(mean)


def describe_weights(checkpoint: Path, training_step: int, stored_mean: float | None) -> str:
    """Which weights were loaded, for the first line of ``--evaluate``'s report."""
    text = f"weights {checkpoint} (training step {training_step}"
    if stored_mean is not None:
        text += f"; the run's best evaluation, mean return {stored_mean:g}"
    return text + ")"


def _evaluate_two_player(run_dir: Path, config, network, games: int, checkpoint: Path, training_step: int,
                         seed: int) -> dict:  # fmt: skip
    """A two-player run: ``games`` games against each opponent the env provides (half as
    the first player), as the run's evaluator plays them (the algorithm's ``play_against``)."""
    probe = make_env(config.env)
    try:
        opponents = evaluation_opponents(probe, seed)
    finally:
        probe.close()
    started = time.monotonic()
    play_against = algorithm_of(config).play_against
    assert play_against is not None  # a two-player run's algorithm plays against opponents
    result = play_against(config, network, opponents, games, seed)
    assert result is not None  # None only when stopped, and no stop was given
    stats = {"checkpoint": str(checkpoint), "training_step": training_step, "games_per_opponent": games,
             "seed": seed, "seconds": round(time.monotonic() - started, 3), **result}  # fmt: skip
    write_json_atomic(run_dir / "evaluation.json", stats)
    return stats


# ---- rendering ---------------------------------------------------------------------------
def _check_output_path(path: Path, fmt: str) -> None:
    if path.is_dir():
        raise RenderError(f"--render {fmt} {path}: is a directory; expected a file name")
    if not path.parent.is_dir():
        raise RenderError(f"--render {fmt} {path}: directory {path.parent} does not exist")


class _FirstEpisodeFrames(gym.Wrapper):
    """Records the frame of every state of the env's first episode (after the reset and
    after each step), as palette images: a 600x400 RGB frame takes 720 kB, its palette
    image a third of that, so a 500-step CartPole episode stays near 120 MB."""

    def __init__(self, env: gym.Env, image_module) -> None:
        super().__init__(env)
        self.image = image_module
        self.frames: list = []
        self.recording = True
        self.fps = float(env.metadata.get("render_fps") or 30)

    def _record(self) -> None:
        # fast octree: an adaptive palette per frame, several times faster than median cut
        self.frames.append(self.image.fromarray(self.env.render()).quantize(256, method=self.image.Quantize.FASTOCTREE))

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        if self.recording:
            self.frames = []
            self._record()
        return out

    def step(self, action):
        out = self.env.step(action)
        if self.recording:
            self._record()
            if out[2] or out[3]:  # terminated or truncated: the first episode is complete
                self.recording = False
        return out


def write_gif(path: Path, frames: list, fps: float) -> int:
    """Write PIL images as a looping GIF at ``fps`` frames per second, atomically (a temp
    file in the same directory renamed over ``path``: a reader never sees half a GIF and
    a failure leaves no file). Returns the frame duration in ms (GIF counts in 10 ms)."""
    duration_ms = max(20, round(100.0 / fps) * 10)  # browsers slow frames under 20 ms to 100 ms
    write_atomic(path, lambda f: frames[0].save(f, format="GIF", save_all=True, append_images=frames[1:],
                                                duration=duration_ms, loop=0))
    return duration_ms


def _describe(x: np.ndarray) -> dict:
    return {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()), "max": float(x.max())}


def evaluate_main(run_dir: str, episodes: int, checkpoint: str | None, seed: int, render: str | None = None,
                  overrides: Sequence[str] = (), render_format: str = "gif") -> int:  # fmt: skip
    """``--evaluate``: clear one-line errors (exit code 2) for a missing or broken run."""
    path = Path(run_dir)
    if not os.path.lexists(path / "config.json"):  # one that is there but not a regular file: refused when read
        print(f"error: --evaluate {run_dir}: no run directory with a config.json there", file=sys.stderr)
        return 2
    try:
        stats = evaluate_run(path, episodes, None if checkpoint is None else Path(checkpoint), seed,
                             None if render is None else Path(render), overrides, render_format)  # fmt: skip
    except (ConfigError, CheckpointError, FileNotFoundError, RenderError, MissingExtraError) as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    if "opponents" in stats:  # a two-player run
        print(f"{episodes} games against each opponent with "
              f"{describe_weights(Path(stats['checkpoint']), stats['training_step'], None)}:")
        for name, r in stats["opponents"].items():
            first, second = r["first"], r["second"]
            print(f"  vs {name}: as first W/D/L {first['wins']}/{first['draws']}/{first['losses']}, "
                  f"as second {second['wins']}/{second['draws']}/{second['losses']}, mean score {r['score']:+.2f}")
        print(f"written: {path / 'evaluation.json'}")
        return 0
    r, ln = stats["return"], stats["length"]
    weights = describe_weights(Path(stats["checkpoint"]), stats["training_step"], stats["checkpoint_evaluation"])
    print(f"{episodes} greedy episodes with {weights}:")
    print(f"  return: mean {r['mean']:.2f}, std {r['std']:.2f}, min {r['min']:.2f}, max {r['max']:.2f}")
    print(f"  length: mean {ln['mean']:.1f}, std {ln['std']:.1f}, min {ln['min']:.0f}, max {ln['max']:.0f}")
    if "render" in stats:
        g = stats["render"]
        print(f"  rendered: episode 1 (return {g['episode_return']:.2f}), {g['frames']} frames -> {g['path']}")
    print(f"written: {path / 'evaluation.json'}")
    return 0
