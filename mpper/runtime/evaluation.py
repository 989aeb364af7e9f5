"""Greedy play: ``evaluate`` (one evaluation: greedy episodes or games against the env's
opponents, stopped early when it cannot count), ``play_greedy``, the periodic video.

What an evaluation round of a run does with them is the :class:`~mpper.runtime.roles.Evaluation`
role's; ``--evaluate`` and ``--on-snapshot`` call them directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ..algos.base import EpisodeRows as Episode
from ..algos.registry import algorithm_of
from ..config import Config
from ..envs import make_env
from ..envs.render import RenderError, open_render_env
from ..envs.two_player import evaluation_opponents, is_two_player
from ..extras import MissingExtraError
from .video import EpisodeRecorder, Mp4Writer, require_video

__all__ = ["PeriodicVideo", "best_possible_mean", "evaluate", "evaluation_bar", "greedy_returns", "play_greedy",
           "record_greedy_episode"]  # fmt: skip


def play_greedy(config: Config, envs: list, network, seed: int, stop=None, on_episode=None,
                give_up=None) -> list[Episode] | None:  # fmt: skip
    """One greedy episode (search without noise, most visited action) in each env, played
    together; returns them in env order, or None if ``stop`` was set first.
    ``on_episode(episode)`` is called as each one ends (progress bars). ``give_up()`` is
    asked after every move while episodes are unfinished: when it is true, play stops and
    only the finished episodes are returned (in env order)."""
    player = algorithm_of(config).make_player(config, envs, network, explore=False, seed=seed)
    done: dict[int, Episode] = {}
    while len(done) < len(envs):
        if stop is not None and stop.is_set():
            return None
        before = [id(ep) for ep in player.episodes]  # finished envs keep playing: first episode counts
        for ep in player.step():
            k = before.index(id(ep))
            if k not in done:
                done[k] = ep
                if on_episode is not None:
                    on_episode(ep)
        if give_up is not None and len(done) < len(envs) and give_up():
            break
    return [done[k] for k in sorted(done)]


def evaluate(config: Config, network, seed: int, stop=None, envs: list | None = None,
             must_reach: float | None = None, episodes: int | None = None) -> dict | None:  # fmt: skip
    """One evaluation with ``network``; None if ``stop`` was set first.

    One-player env: ``runtime.evaluation_episodes`` greedy episodes (MuZero: search
    without noise, most visited action; DQN: argmax Q), one per env of ``envs`` (made
    from ``config.env`` when None): ``{"mean_return": mean, "returns": [...]}``.
    ``episodes``: that many instead, one per env, and no solve confirmation (the final
    evaluation).

    With ``must_reach`` (a mean return) and ``runtime.max_episode_return``, play stops as
    soon as the mean can no longer reach ``must_reach`` (every unfinished episode counted
    at ``max_episode_return``): the evaluation then has no ``mean_return`` but
    ``{"stopped_early": True, "mean_return_at_most": that bound, "returns": the finished
    episodes' returns}``.

    With ``runtime.solve_return`` and ``runtime.solve_confirm_episodes``, an evaluation
    whose mean reaches ``solve_return`` plays that many more episodes with the same
    weights (seeds following on): ``mean_return`` and ``returns`` cover all of them, and
    ``confirmation`` holds ``{"episodes": n, "mean_return": the new episodes' mean}``.

    Two-player env (MuZero): games against the opponents the env provides, half as first
    player, half as second (the algorithm's ``play_against``); ``mean_return`` is
    the mean score (win +1, draw 0, loss -1) against the last, strongest one, and
    ``opponents`` holds wins / draws / losses per opponent and side.
    """
    count = config.runtime.evaluation_episodes if episodes is None else episodes
    if envs is None:
        envs = [make_env(config.env) for _ in range(count)]
    algorithm = algorithm_of(config)
    if algorithm.play_against is not None and is_two_player(envs[0]):
        opponents = evaluation_opponents(envs[0], seed)
        return algorithm.play_against(config, network, opponents, count, seed, stop=stop)
    count = len(envs)
    returns = greedy_returns(config, envs, network, seed, count, stop, must_reach)
    if returns is None:
        return None
    if len(returns) < count:  # stopped early, which only a max_episode_return allows
        most = config.runtime.max_episode_return
        assert most is not None
        bound = best_possible_mean(sum(returns), len(returns), count, most)
        return {"stopped_early": True, "mean_return_at_most": bound, "returns": returns}
    solve, confirm = config.runtime.solve_return, config.runtime.solve_confirm_episodes
    if solve is None or confirm == 0 or episodes is not None or np.mean(returns) < solve:
        return {"mean_return": float(np.mean(returns)), "returns": returns}
    more = greedy_returns(config, envs, network, seed + len(returns), confirm, stop)
    if more is None:
        return None
    return {"mean_return": float(np.mean(returns + more)), "returns": returns + more,
            "confirmation": {"episodes": confirm, "mean_return": float(np.mean(more))}}  # fmt: skip


def best_possible_mean(finished_sum: float, finished: int, count: int, max_episode_return: float) -> float:
    """The highest mean ``count`` episodes can still reach when ``finished`` of them have
    ended with returns summing to ``finished_sum``: each other one at ``max_episode_return``."""
    return (finished_sum + (count - finished) * max_episode_return) / count


def evaluation_bar(config: Config, best_mean_return: float) -> float | None:
    """The mean an evaluation has to be able to reach to count: ``runtime.solve_return``
    (stop the run) or the best mean so far (a new ``best.pt``), whichever is lower; None
    (play every episode to the end) without ``runtime.max_episode_return`` or before a
    first evaluation."""
    if config.runtime.max_episode_return is None or not np.isfinite(best_mean_return):
        return None
    solve = config.runtime.solve_return
    return best_mean_return if solve is None else min(solve, best_mean_return)


def greedy_returns(config: Config, envs: list, network, seed: int, count: int, stop=None,
                   must_reach: float | None = None) -> list[float] | None:  # fmt: skip
    """The returns of ``count`` greedy episodes, played ``len(envs)`` at a time; episode
    ``i`` starts from a reset with ``seed + i``. None if ``stop`` was set first.

    With ``must_reach`` and ``runtime.max_episode_return``: play stops once the mean of
    the ``count`` returns cannot reach ``must_reach`` even if every unfinished episode
    returned ``max_episode_return``; the list then holds the finished ones only (fewer
    than ``count``)."""
    best_case = config.runtime.max_episode_return
    returns: list[float] = []
    batch_done, batch_sum = 0, 0.0  # the finished episodes of the batch in play
    earlier_sum = 0.0  # the returns of the batches before it

    def on_episode(ep: Episode) -> None:
        nonlocal batch_done, batch_sum
        if best_case is not None and ep.game_return > best_case:  # the bound would stop evaluations that pass
            raise ValueError(f"runtime.max_episode_return is {best_case:g}, but a greedy episode returned "
                             f"{ep.game_return:g}: set it to the most one episode can return, or null")  # fmt: skip
        batch_done, batch_sum = batch_done + 1, batch_sum + ep.game_return

    give_up = None
    if must_reach is not None and best_case is not None:
        bar, most = must_reach, best_case

        def give_up() -> bool:
            return best_possible_mean(earlier_sum + batch_sum, len(returns) + batch_done, count, most) < bar

    while len(returns) < count:
        batch = envs[: count - len(returns)]
        batch_done, batch_sum, earlier_sum = 0, 0.0, sum(returns)
        episodes = play_greedy(config, batch, network, seed + len(returns), stop, on_episode, give_up)
        if episodes is None:
            return None
        returns += [ep.game_return for ep in episodes]
        if len(episodes) < len(batch):
            break
    return returns


def record_greedy_episode(config: Config, network, seed: int, path: Path, stop=None) -> dict:
    """Play one greedy episode from a reset with ``seed`` (the first episode of the
    evaluation with that seed) and write it to ``path`` as MP4; returns ``{"path",
    "frames", "return"}``. RenderError or MissingExtraError when the env cannot draw or
    the ``video`` extra is missing; no file then, nor when ``stop`` is set first (``{}``)."""
    require_video("runtime.video_every_evaluations")
    env = open_render_env(config.env)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        env.close()
        raise
    writer = Mp4Writer(path, float(env.metadata.get("render_fps") or 30))
    recorder = EpisodeRecorder(env, writer)
    try:
        episodes = play_greedy(config, [recorder], network, seed, stop)
        if episodes is None:
            writer.discard()
            return {}
        writer.close()
    except BaseException:
        writer.discard()
        raise
    finally:
        recorder.close()
    return {"path": str(path), "frames": writer.frames, "return": float(episodes[0].game_return)}


class PeriodicVideo:
    """``runtime.video_every_evaluations``: after every Nth evaluation (the first
    included) of a one-player env, one greedy episode to ``run_dir/videos/<training
    step>.mp4``. An env that cannot draw turns it off with one line on stderr."""

    def __init__(self, config: Config, run_dir: str | Path | None) -> None:
        every = config.runtime.video_every_evaluations if run_dir is not None else None
        if every is not None and algorithm_of(config).two_player and is_two_player_config(config):
            every = None  # a two-player evaluation plays opponents: no one episode to film
        self.config = config
        self.every = every
        self.folder = Path(run_dir) / "videos" if run_dir is not None else None
        self.evaluations = 0

    def after_evaluation(self, network, training_step: int, seed: int, stop=None) -> None:
        if self.every is None:
            return
        self.evaluations += 1
        if (self.evaluations - 1) % self.every:
            return
        try:
            assert self.folder is not None  # no folder: every is None
            record_greedy_episode(self.config, network, seed, self.folder / f"{training_step}.mp4", stop)
        except (RenderError, MissingExtraError, OSError) as exc:
            self.every = None
            why = " ".join(str(exc).removeprefix("--render: ").splitlines())
            print(f"mpper: videos off (runtime.video_every_evaluations): {why}", file=sys.stderr)


def is_two_player_config(config: Config) -> bool:
    """Whether the config's env is two-player (made once to ask it)."""
    env = make_env(config.env)
    try:
        return is_two_player(env)
    finally:
        env.close()
