"""The roles of a run, each written once: a self-play turn, a learner step, an evaluation
round, and the checkpoint.

The schedulers only decide when each runs and where: ``runtime/children.py`` (one process
per role, beside the supervisor), ``runtime/turns.py`` (``--workers 0`` and lockstep runs:
the roles take turns in one process, self-play optionally in worker processes) and
``runtime/remote.py`` (self-play as Ray actors). Each role takes the run's
:class:`~mpper.runtime.setup.RunSetup` and the shared objects it works on:

- :class:`SelfPlay`: the algorithm's player on K envs with the newest weights
  (:class:`LatestWeights`); each :meth:`SelfPlay.turn` plays one move in every env and
  hands the episodes that ended to a *sink*: :class:`BufferSink` (the shared buffer,
  behind the samples-per-insert :class:`~mpper.runtime.rate.RateLimiter`), the Ray
  ingest, or a list a lockstep scheduler inserts in a fixed order.
- :class:`Learner`: sample -> train -> priorities back -> publish weights every
  ``training.publish_interval`` steps; :meth:`Learner.checkpoint` writes ``checkpoint.pt``.
  It owns the run's first weights: fresh ones from ``runtime.seed``, or the checkpoint's.
- :class:`Evaluation`: one greedy evaluation round, ``best.pt`` when it is the best so
  far, the periodic video, and the final evaluation of a run that ended on its own.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from ..checkpoint import load_checkpoint, save_checkpoint, save_network_checkpoint
from ..config import config_to_dict
from ..envs.spec import make_env
from ..replay.buffer import ReplayBuffer
from .evaluation import PeriodicVideo, evaluate, evaluation_bar
from .rate import RateLimiter
from .run import BestCheckpoint
from .setup import RunSetup
from .weights import WeightStore

__all__ = ["BufferSink", "EnvError", "Evaluation", "LabelledEnv", "LatestWeights", "Learner", "SelfPlay",
           "StoredEpisode", "beta_schedule", "evaluation_envs", "pick_device", "selfplay_envs"]  # fmt: skip


# ---- envs and weights, as every acting role sees them ------------------------------------


class EnvError(RuntimeError):
    """An env's ``reset`` or ``step`` raised; the message says where (see ``LabelledEnv``)."""


class LabelledEnv(gym.Wrapper):
    """An env that names itself when it fails: whatever its ``step`` or ``reset`` raises
    comes out as ``EnvError("worker-3 env 1 (CartPole-v1): step raised ValueError: ...")``
    (process, index of the env in that process, env id), the original exception chained
    to it, so the traceback the supervisor prints and its one-line summary say which
    env of which worker broke."""

    def __init__(self, env: gym.Env, where: str) -> None:
        super().__init__(env)
        self.where = where

    def step(self, action):
        try:
            return self.env.step(action)
        except Exception as exc:
            raise EnvError(f"{self.where}: step raised {type(exc).__name__}: {exc}") from exc

    def reset(self, **kwargs):
        try:
            return self.env.reset(**kwargs)
        except Exception as exc:
            raise EnvError(f"{self.where}: reset raised {type(exc).__name__}: {exc}") from exc


def selfplay_envs(config, process: str, count: int) -> list[gym.Env]:
    """The ``count`` envs one self-play process steps, labelled: the training envs, with the
    training-only settings (``env.episodic_life``, ``env.clip_rewards``)."""
    return [LabelledEnv(make_env(config.env, training=True), f"{process} env {k} ({config.env.id})")
            for k in range(count)]  # fmt: skip


def evaluation_envs(config, process: str, count: int) -> list[gym.Env]:
    """The ``count`` envs the evaluator plays, labelled: the game as it is, without the
    training-only settings (whole games, the game's own score)."""
    return [LabelledEnv(make_env(config.env), f"{process} env {k} ({config.env.id})") for k in range(count)]


class LatestWeights:
    """A network kept in step with the weight store (copies only on a new version)."""

    def __init__(self, setup: RunSetup, store: WeightStore) -> None:
        self.store = store
        self.network = setup.make_network().eval()
        self.flat = np.empty(self.network.num_flat_weights(), np.float32)
        self.version = 0
        self.training_step = 0

    def refresh(self) -> bool:
        if self.store.version == self.version:
            return False
        self.version, self.training_step = self.store.read_into(self.flat)
        self.network.set_flat_weights(self.flat)
        return True

    def wait_first(self, stop) -> bool:
        """Block until the learner published once (False if stopped first)."""
        while self.store.version == 0:
            if stop.wait(0.05):
                return False
        return self.refresh() or True


# ---- self-play ---------------------------------------------------------------------------


@dataclass
class StoredEpisode:
    """One episode as a self-play turn hands it to a sink. ``arrays``: the rows to store
    (schema fields, ``T + 1`` rows), ``priorities``: their initial priorities (``T``) or
    None, ``terminated``: whether it ended in a terminal state; ``report``: what the run
    logs of it (``return``, ``length``, ``weights_version``) for a game that ended, None
    for a piece of a game that goes on; ``ended_unix``: ``time.time()`` at its last move."""

    source: str
    arrays: dict[str, np.ndarray]
    priorities: np.ndarray | None
    terminated: bool
    report: dict | None
    ended_unix: float


Sink = Callable[[StoredEpisode], object]  # what it returns is the sink's own business


class SelfPlay:
    """The self-play turn: ``turn(sink)`` refreshes the weights when a new version was
    published, plays one move in each of the player's K envs, and hands every episode
    that ended (or piece of a long game) to ``sink`` in the order the player returns them."""

    def __init__(self, setup: RunSetup, name: str, envs: list, weights, seed: int, worker_id: int = 0) -> None:
        self.name = name
        self.weights = weights  # LatestWeights, or anything with refresh(), network, version, training_step
        self.total_steps = setup.config.training.training_steps
        self.player = setup.algorithm.make_player(setup.config, envs, weights.network, explore=True, seed=seed,
                                                  worker_id=worker_id)  # fmt: skip

    def turn(self, sink: Sink) -> None:
        self.weights.refresh()
        step = self.weights.training_step
        for ep in self.player.step(step / self.total_steps, step):
            arrays, priorities = self.player.stored(ep)
            report = None
            if ep.ends_game:
                report = {"return": ep.game_return, "length": ep.game_moves, "weights_version": self.weights.version}
            sink(StoredEpisode(self.name, arrays, priorities, bool(ep.terminated), report, time.time()))


class BufferSink:
    """Episodes into the shared buffer: each waits for the samples-per-insert ratio
    (``rate``, when the run has one), is stored, rings the rate limiter's doorbells, and
    its report (completed with ``insert_wait_s``, the ratio's wait, and
    ``store_latency_s``, from its last move to its being sampleable) goes to
    ``deliver(source, report)``. An episode whose wait ends because ``stop`` was set is
    not stored: the run is ending."""

    def __init__(self, buf: ReplayBuffer, rate: RateLimiter | None, stop, deliver: Callable[[str, dict], None]) -> None:
        self.buf, self.rate, self.stop, self.deliver = buf, rate, stop, deliver

    def __call__(self, episode: StoredEpisode) -> float | None:
        """Store ``episode``; returns the seconds it waited for the ratio, or None when
        ``stop`` came during the wait and it was not stored."""
        waited = 0.0
        if self.rate is not None:
            buf = self.buf
            wait = self.rate.wait_to_insert(lambda: buf.counters["steps"], lambda: buf.counters["samples"], self.stop)
            if wait.waited and self.stop is not None and self.stop.is_set():
                return None
            waited = wait.seconds
        self.buf.add_episode(episode.arrays, priorities=episode.priorities, terminated=episode.terminated)
        if self.rate is not None:
            self.rate.notify()
        if episode.report is not None:
            report = {**episode.report, "insert_wait_s": round(waited, 6),
                      "store_latency_s": round(max(0.0, time.time() - episode.ended_unix), 6)}  # fmt: skip
            self.deliver(episode.source, report)
        return waited


# ---- learning ----------------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    """``"auto"``: CUDA when available, else the CPU; ``"cuda"`` without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError('runtime.device is "cuda" but torch.cuda.is_available() is false')
    return torch.device(name)


def beta_schedule(config, step: int) -> float:
    """Importance-sampling exponent after ``step`` updates: linear from ``replay.beta``
    to 1 over ``replay.beta_anneal_steps`` (default: all training steps), then 1."""
    r = config.replay
    horizon = r.beta_anneal_steps or config.training.training_steps
    return r.beta + (1.0 - r.beta) * min(1.0, step / horizon)


class Learner:
    """The learner step: :meth:`sample` a batch, :meth:`step` on it (train, write the
    priorities back unless the slots were rewritten since they were sampled, publish the
    weights every ``training.publish_interval`` steps); :meth:`checkpoint`.

    Built with torch seeded from ``runtime.seed``, so that the first weights are the
    run's bit for bit; resuming, the checkpoint's state is loaded. Either way it
    publishes them at once: it is the one owner of the weights everyone acts with."""

    def __init__(self, setup: RunSetup, buf: ReplayBuffer, store: WeightStore) -> None:
        config = setup.config
        self.setup, self.config, self.buf, self.store = setup, config, buf, store
        self.device = pick_device(config.runtime.device)
        torch.manual_seed(config.runtime.seed)
        self.trainer = setup.algorithm.make_trainer(config, setup.make_network(), self.device)
        if setup.resume_checkpoint is not None:
            self.trainer.load_state_dict(load_checkpoint(setup.resume_checkpoint))
        self.targets = self.trainer.learner_targets(setup.algorithm.make_targets(config, setup.spec.num_actions))
        self.rng = np.random.default_rng([config.runtime.seed, 0x1EA2])  # the learner's own sampling stream
        self.metrics: dict[str, float] = {}  # the latest step's losses, lr and beta (none before the first)
        self.priorities_applied = self.priorities_dropped = 0
        self.published_at = -1
        self.publish()

    @property
    def training_step(self) -> int:
        return self.trainer.training_step

    @property
    def done(self) -> bool:
        return self.trainer.training_step >= self.config.training.training_steps

    def sample(self, step: int | None = None):
        """A batch for training step ``step`` (default: the next one; ``step`` updates
        done before it), drawn by priority with that step's importance-sampling exponent,
        its targets built at that step (the age of the data, where they depend on it)."""
        step = self.training_step if step is None else step
        return self.buf.sample(self.config.training.batch_size, beta_schedule(self.config, step), self.targets,
                               self.rng, training_step=step)  # fmt: skip

    def step(self, batch) -> dict[str, float]:
        """One update on ``batch``; returns the metrics of the latest update whose results
        reached the host (with MuZero's static step on a GPU, the update before this one:
        its priorities are written back one call late). A diverged update
        (FloatingPointError: the weights are those before it) writes the checkpoint and
        re-raises."""
        if self.trainer.lr_drop_step is None and self.store.return_reached_at is not None:
            self.trainer.drop_learning_rate()  # an evaluation reached training.lr_drop_return
        try:
            finished = self.trainer.submit(batch)
        except FloatingPointError:
            self.checkpoint()
            raise
        self.trainer.update_average()
        self._apply(finished)
        if self.training_step % self.config.training.publish_interval == 0:
            self.publish()
        history = self.config.runtime.weights_history_interval_steps
        if history and self.training_step % history == 0:
            path = self.setup.run_dir.weights_at(self.training_step)
            try:
                save_network_checkpoint(path, self.trainer.published_network, self.training_step)
            except OSError as exc:  # a full disk: the history misses this step, training goes on
                print(f"mpper: learner: {path} not written ({exc.strerror or exc}); training goes on",
                      file=sys.stderr, flush=True)  # fmt: skip
        return self.metrics

    def _apply(self, finished) -> None:
        """Write the priorities of finished updates back (unless their slots were
        rewritten since they were sampled) and keep the latest one's metrics, with the
        importance-sampling exponent its batch was drawn with."""
        for update in finished:
            applied, dropped = self.buf.update_priorities(update.batch.indices, update.batch.generations,
                                                          update.priorities)  # fmt: skip
            self.priorities_applied += applied
            self.priorities_dropped += dropped
            before = int(update.metrics["training_step"]) - 1  # updates completed before this one
            self.metrics = {**update.metrics, "beta": beta_schedule(self.config, before)}

    def drain(self) -> None:
        """Wait for the updates still on the device and write their priorities back."""
        self._apply(self.trainer.drain())

    def publish(self) -> None:
        """The weights everyone acts with, to the weight store (once per training step)."""
        if self.published_at != self.training_step:
            self.store.publish(self.trainer.published_network.get_flat_weights(), self.training_step)
            self.published_at = self.training_step

    def checkpoint(self) -> None:
        """``checkpoint.pt``: the trainer's state, the config, the weight version, the time
        (an atomic write: cut midway, the previous checkpoint stays whole), after the
        updates still on the device finished (a diverged one: written, then re-raised)."""
        try:
            self.drain()
        except FloatingPointError:
            self._write_checkpoint()
            raise
        self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        extra = {"config": config_to_dict(self.config), "weights_version": self.store.version, "time": time.time()}
        save_checkpoint(self.setup.run_dir.checkpoint, self.trainer, extra)


# ---- evaluation --------------------------------------------------------------------------


class Evaluation:
    """One greedy evaluation round at a time (``mpper.runtime.evaluation.evaluate``, round
    ``k`` with the seed ``Seeds.evaluation(k)``), keeping ``best.pt``
    (:class:`~mpper.runtime.run.BestCheckpoint`), telling the learner through the weight
    store when one reached ``training.lr_drop_return``, and filming every
    ``runtime.video_every_evaluations``-th one (:meth:`film`)."""

    def __init__(self, setup: RunSetup, store: WeightStore, envs: list | None = None) -> None:
        self.setup, self.config, self.store, self.envs = setup, setup.config, store, envs
        self.best = BestCheckpoint(setup.run_dir.root)
        self.video = PeriodicVideo(setup.config, setup.run_dir.root)
        self.rounds = 0

    def round(self, network, training_step: int, weights_version: int, stop=None) -> dict | None:
        """Evaluate ``network`` (the weights of ``training_step``, version ``weights_version``);
        the evaluation record, or None if ``stop`` was set first."""
        seed = self.setup.seeds.evaluation(self.rounds)
        self.rounds += 1
        evaluation = evaluate(self.config, network, seed, stop, self.envs, evaluation_bar(self.config, self.best.best))
        if evaluation is None:
            return None
        self.best.offer(network, training_step, evaluation)
        drop_at = self.config.training.lr_drop_return
        if drop_at is not None and evaluation["mean_return"] >= drop_at:
            self.store.mark_return_reached(training_step)
        return {"training_step": training_step, **evaluation, "best_mean_return": self.best.best,
                "weights_version": weights_version}  # fmt: skip

    def final(self, network, training_step: int, env_steps: int, stop=None) -> dict | None:
        """The final evaluation: ``runtime.final_evaluation_episodes`` greedy episodes of
        ``network`` (the run's last weights), one env each, from ``Seeds.final_evaluation``;
        ``{"training_step", "env_steps", "episodes", "mean_return", "returns", ...}``, or
        None if ``stop`` was set first."""
        count = self.config.runtime.final_evaluation_episodes
        assert count is not None
        network = self._searching_device(network)
        envs = evaluation_envs(self.config, "final-evaluation", count)
        try:
            evaluation = evaluate(self.config, network, self.setup.seeds.final_evaluation(), stop, envs, episodes=count)
        finally:
            for env in envs:
                env.close()
        if evaluation is None:
            return None
        return {"training_step": training_step, "env_steps": env_steps, "episodes": count, **evaluation}

    def _searching_device(self, network):
        """``network``, or for an algorithm whose player searches with a network on any
        device (MuZero's, as the inference server and the reanalyser run it) a copy on the
        learner's device when that is CUDA: the final evaluation's many simulations (32
        Atari games of 50 simulations a move) are played on the GPU, not the CPU."""
        device = pick_device(self.config.runtime.device)
        if device.type == "cpu" or self.setup.algorithm.search_nodes is None:
            return network
        return copy.deepcopy(network).to(device)

    def film(self, network, training_step: int, stop=None) -> None:
        """The periodic video of the round just played (its first episode, same seed)."""
        self.video.after_evaluation(network, training_step, self.setup.seeds.evaluation(self.rounds - 1), stop)
