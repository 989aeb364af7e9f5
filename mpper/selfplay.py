"""Self-play: K environments played together with one batched MCTS per move.

``BatchedPlayer`` is the game loop shared by the self-play workers (exploration noise,
visit-count temperature, episodes stored in the replay buffer) and the evaluator
(greedy, no noise, episodes only scored). ``run_selfplay`` and ``run_evaluator`` are
the process entry points the supervisor spawns.

Two-player and masked environments report, in ``info`` at reset and after each step,
``to_play`` (0 or 1) and ``action_mask`` (bool per action); other environments have
one player and every action legal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from .config import Config
from .envs import make_env
from .learner import save_network_checkpoint
from .mcts import BatchedMCTS, select_action, temperature_at
from .networks import make_model, support_to_scalar
from .procs import child_init, report_error
from .targets import MuZeroTargets, stacked_observations

__all__ = [
    "BatchedPlayer",
    "EnvError",
    "Episode",
    "LabelledEnv",
    "best_checkpoint_extra",
    "best_so_far",
    "evaluate",
    "initial_priorities",
    "make_player",
    "play_greedy",
    "run_evaluator",
    "run_selfplay",
]


@dataclass
class Episode:
    """One game in muzero-general's GameHistory layout: T moves, T + 1 rows."""

    observation: list = field(default_factory=list)  # o_0 .. o_T
    action: list = field(default_factory=lambda: [0])  # a_{i-1} on row i (row 0: 0)
    reward: list = field(default_factory=lambda: [0.0])  # r_i on row i (row 0: 0)
    to_play: list = field(default_factory=list)
    root_value: list = field(default_factory=list)  # search value at o_i, i < T
    child_visits: list = field(default_factory=list)  # visit distribution at o_i, i < T
    terminated: bool = False
    # The network's value of o_T, for an episode cut by a time limit: its value targets
    # bootstrap from it (mpper.targets). 0 for a terminated one, whose row T is never read.
    final_value: float = 0.0

    @property
    def moves(self) -> int:
        return len(self.observation) - 1

    @property
    def total_reward(self) -> float:
        return float(sum(self.reward))

    def arrays(self, num_actions: int) -> dict[str, np.ndarray]:
        """Rows for ``ReplayBuffer.add_episode`` (final row: ``final_value`` as its
        root value, no visits)."""
        return {
            "observation": np.stack(self.observation).astype(np.float32, copy=False),
            "action": np.asarray(self.action, np.int64),
            "reward": np.asarray(self.reward, np.float32),
            "to_play": np.asarray(self.to_play, np.int8),
            "root_value": np.asarray(self.root_value + [self.final_value], np.float32),
            "child_visits": np.vstack(self.child_visits + [np.zeros(num_actions)]).astype(np.float32),
        }


def initial_priorities(arrays: dict[str, np.ndarray], td_steps: int, discount: float,
                       terminated: bool = True) -> np.ndarray:
    """muzero-general's initial priorities, |root value - n-step value target| (raw; the
    buffer applies alpha), for the T positions of one episode (``terminated`` False: cut
    by a time limit, targets bootstrap from the final row's value).

    The episode's own rows serve as a tiny ring, so the targets come from the very
    kernel the learner's batches use.
    """
    moves = arrays["root_value"].shape[0] - 1
    slots = np.arange(moves, dtype=np.int64)
    targets = MuZeroTargets(0, td_steps, discount, arrays["child_visits"].shape[1])
    no_random_actions = np.random.default_rng(0)  # unroll 0: no step past the end
    value = targets.build(arrays, slots, slots, np.full(moves, moves), np.full(moves, terminated),
                          no_random_actions)
    return np.abs(arrays["root_value"][:moves].astype(np.float64) - value["target_value"][:, 0])


class BatchedPlayer:
    """Steps K environments with one batched search per move.

    Args:
        config: the run config (mcts, training.stacked_observations).
        envs: K gymnasium environments.
        network: a MuZeroNetwork on the CPU, in eval mode.
        explore: Dirichlet root noise and visit-count temperature (self-play); without
            it, no noise and the most visited action (evaluation).
        seed: seeds the first reset of env k with ``seed + k``.
    """

    def __init__(self, config: Config, envs: list, network, explore: bool, seed: int) -> None:
        self.config = config
        self.envs = envs
        self.network = network
        self.explore = explore
        self.num_actions = int(envs[0].action_space.n)
        self.stacked = config.training.stacked_observations
        self.mcts = BatchedMCTS(self.num_actions, config.mcts, config.network.support_size,
                                two_player=_two_player(envs[0]))  # fmt: skip
        self.rng = np.random.default_rng(seed)
        self.legal = [np.ones(self.num_actions, bool)] * len(envs)  # set by _reset
        self.episodes = [self._reset(k, seed + k) for k in range(len(envs))]

    def _reset(self, k: int, seed: int | None = None) -> Episode:
        obs, info = self.envs[k].reset(seed=seed)
        ep = Episode()
        ep.observation.append(np.asarray(obs, np.float32))
        ep.to_play.append(int(info.get("to_play", 0)))
        self.legal[k] = _legal(info, self.num_actions)
        return ep

    def _network_input(self, ep: Episode) -> np.ndarray:
        if self.stacked == 0:
            return ep.observation[-1]
        t = len(ep.observation) - 1
        obs = np.stack(ep.observation)
        act = np.asarray(ep.action, np.int64)
        one = np.array([t])
        return stacked_observations(obs, act, one, one, self.stacked, self.num_actions)[0]

    def step(self, progress: float = 0.0) -> list[Episode]:
        """Search, act and step every env once; returns the episodes that just ended
        (their envs are reset and play on). ``progress``: the share of training done,
        which sets the visit-count temperature while exploring; an episode that has
        played ``mcts.temperature_threshold_moves`` moves or more takes the most visited
        action instead (T = 0)."""
        temperature = temperature_at(self.config.mcts.temperature_schedule, progress) if self.explore else 0.0
        observations = np.stack([self._network_input(ep) for ep in self.episodes])
        legal = np.stack(self.legal)
        to_play = np.array([ep.to_play[-1] for ep in self.episodes])
        result = self.mcts.run(self.network, observations, legal, to_play, self.explore, self.rng)
        actions = select_action(result.visit_counts, temperature, self.rng)
        threshold = self.config.mcts.temperature_threshold_moves
        if threshold is not None and temperature != 0:
            greedy = np.array([ep.moves >= threshold for ep in self.episodes])
            if greedy.any():  # only then: without a threshold the draws stay as they were
                actions[greedy] = select_action(result.visit_counts[greedy], 0.0, self.rng)
        finished = []
        for k, (env, ep) in enumerate(zip(self.envs, self.episodes)):
            ep.root_value.append(float(result.root_values[k]))
            ep.child_visits.append(result.child_visits[k])
            obs, reward, terminated, truncated, info = env.step(int(actions[k]))
            ep.observation.append(np.asarray(obs, np.float32))
            ep.action.append(int(actions[k]))
            ep.reward.append(float(reward))
            ep.to_play.append(int(info.get("to_play", 0)))
            self.legal[k] = _legal(info, self.num_actions)
            if terminated or truncated:
                ep.terminated = bool(terminated)
                finished.append(ep)
                self.episodes[k] = self._reset(k)
        cut = [ep for ep in finished if not ep.terminated]
        if cut and self.explore:  # only stored episodes need a value to bootstrap from
            values = self._values(np.stack([self._network_input(ep) for ep in cut]))
            for ep, value in zip(cut, values):
                ep.final_value = float(value)
        return finished

    @torch.inference_mode()
    def _values(self, observations: np.ndarray) -> np.ndarray:
        """The network's scalar values (N,) of N (stacked) observations."""
        out = self.network.initial_inference(torch.as_tensor(np.asarray(observations, np.float32)))
        return support_to_scalar(out.value_logits, self.config.network.support_size).numpy()


    def stored(self, ep: Episode) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """(rows, raw initial priorities) to hand to ``ReplayBuffer.add_episode``."""
        arrays = ep.arrays(self.num_actions)
        return arrays, initial_priorities(arrays, self.config.training.td_steps, self.config.mcts.discount,
                                          ep.terminated)


def make_player(config: Config, envs: list, network, explore: bool, seed: int, worker_id: int = 0):
    """The game loop of ``config.algorithm``: a ``BatchedPlayer`` (MuZero search) or a
    ``mpper.dqn.EpsilonGreedyPlayer``. Both have ``step(progress) -> finished episodes``
    (with ``total_reward`` and ``moves``), ``stored(episode) -> (rows, priorities)`` and
    ``episodes`` (the K running games)."""
    if config.algorithm == "dqn":
        from .dqn import EpsilonGreedyPlayer

        k = config.runtime.envs_per_worker
        return EpsilonGreedyPlayer(config, envs, network, explore, seed, actor_index=worker_id * k,
                                   num_actors=max(1, config.runtime.workers) * k)  # fmt: skip
    return BatchedPlayer(config, envs, network, explore, seed)


def _legal(info: dict, num_actions: int) -> np.ndarray:
    mask = info.get("action_mask")
    return np.ones(num_actions, bool) if mask is None else np.asarray(mask, bool)


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


def _labelled_envs(config: Config, process: str, count: int) -> list[gym.Env]:
    return [LabelledEnv(make_env(config.env), f"{process} env {k} ({config.env.id})") for k in range(count)]


def _two_player(env) -> bool:
    return bool(getattr(env.unwrapped, "two_player", False))


class _Weights:
    """A network kept in step with the weight store (copies only on a new version)."""

    def __init__(self, config: Config, store, observation_shape, num_actions) -> None:
        self.store = store
        self.network = make_model(config, observation_shape, num_actions).eval()
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


def run_selfplay(worker_id: int, config: Config, buffer_handle, weight_handle, stop, reports, seed: int,
                 rate=None) -> None:  # fmt: skip
    """Self-play worker process: play, store whole episodes, report their returns."""
    from .replay_buffer import ReplayBuffer
    from .weights import WeightStore

    name = f"worker-{worker_id}"
    child_init(config.runtime.torch_threads)
    buf = store = None
    try:
        buf = ReplayBuffer.attach(buffer_handle)
        store = WeightStore.attach(weight_handle)
        torch.manual_seed(seed)
        envs = _labelled_envs(config, name, config.runtime.envs_per_worker)
        obs_shape = buf.fields["observation"].shape[1:]
        weights = _Weights(config, store, obs_shape, int(envs[0].action_space.n))
        if not weights.wait_first(stop):
            return
        player = make_player(config, envs, weights.network, explore=True, seed=seed, worker_id=worker_id)
        total_steps = config.training.training_steps
        while not stop.is_set():
            weights.refresh()
            for ep in player.step(weights.training_step / total_steps):
                arrays, priorities = player.stored(ep)
                if rate is not None:
                    rate.wait_to_insert(lambda: buf.counters["steps"], lambda: buf.counters["samples"], stop)
                buf.add_episode(arrays, priorities=priorities, terminated=ep.terminated)
                if rate is not None:
                    rate.notify()
                reports.put(("episode", name, {"return": ep.total_reward, "length": ep.moves,
                                               "weights_version": weights.version}))  # fmt: skip
    except BaseException:
        report_error(reports, name)
        raise
    finally:
        for obj in (buf, store):
            if obj is not None:
                obj.close()


def play_greedy(config: Config, envs: list, network, seed: int, stop=None, on_episode=None) -> list[Episode] | None:
    """One greedy episode (search without noise, most visited action) in each env, played
    together; returns them in env order, or None if ``stop`` was set first.
    ``on_episode(episode)`` is called as each one ends (progress bars)."""
    player = make_player(config, envs, network, explore=False, seed=seed)
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
    return [done[k] for k in range(len(envs))]


def evaluate(config: Config, network, seed: int, stop=None, envs: list | None = None) -> dict | None:
    """One evaluation with ``network``; None if ``stop`` was set first.

    One-player env: ``runtime.evaluation_episodes`` greedy episodes (MuZero: search
    without noise, most visited action; DQN: argmax Q), one per env of ``envs`` (made
    from ``config.env`` when None): ``{"mean_return": mean, "returns": [...]}``.

    Two-player env (MuZero): games against the opponents the env provides, half as first
    player, half as second (:func:`mpper.arena.evaluate_two_player`); ``mean_return`` is
    the mean score (win +1, draw 0, loss -1) against the last, strongest one, and
    ``opponents`` holds wins / draws / losses per opponent and side.
    """
    if envs is None:
        envs = [make_env(config.env) for _ in range(config.runtime.evaluation_episodes)]
    if config.algorithm == "muzero" and _two_player(envs[0]):
        from .arena import evaluate_two_player

        return evaluate_two_player(config, network, seed, stop)
    episodes = play_greedy(config, envs, network, seed, stop)
    if episodes is None:
        return None
    values = [ep.total_reward for ep in episodes]
    return {"mean_return": float(np.mean(values)), "returns": values}


def best_checkpoint_extra(evaluation: dict) -> dict:
    """What ``best.pt`` records about the evaluation that put it there."""
    keys = ("mean_return", "returns", "against", "opponents")
    return {k: evaluation[k] for k in keys if k in evaluation}


def best_so_far(run_dir: str | Path | None) -> float:
    """The mean return ``run_dir/best.pt`` was saved with (a resumed run keeps its best),
    or -inf."""
    path = Path(run_dir) / "best.pt" if run_dir is not None else None
    if path is None or not path.is_file():
        return -np.inf
    try:
        return float(torch.load(path, map_location="cpu", weights_only=True)["extra"]["mean_return"])
    except Exception:  # unreadable: the next evaluation replaces it
        return -np.inf


def run_evaluator(config: Config, weight_handle, observation_shape, num_actions: int, stop, reports,
                  seed: int, run_dir: str | None = None) -> None:  # fmt: skip
    """Evaluator process: every ``evaluation_interval_s``, run :func:`evaluate` with the
    latest weights (one-player env: the mean return of ``evaluation_episodes`` greedy
    episodes; two-player env: results against the env's opponents, ``mean_return`` the
    score against the strongest) and report it.

    With ``run_dir``, the weights with the best mean return so far (the latest among
    equals) are kept in ``run_dir/best.pt``: DQN often learns and then collapses, and
    ``--evaluate --checkpoint best.pt`` judges the best agent a run produced."""
    from .weights import WeightStore

    name = "evaluator"
    child_init(config.runtime.torch_threads)
    store = None
    try:
        store = WeightStore.attach(weight_handle)
        weights = _Weights(config, store, observation_shape, num_actions)
        if not weights.wait_first(stop):
            return
        envs = _labelled_envs(config, name, config.runtime.evaluation_episodes)
        round_, best = 0, best_so_far(run_dir)
        while not stop.is_set():
            started = time.monotonic()
            weights.refresh()
            evaluation = evaluate(config, weights.network, seed + 10_000 * round_, stop, envs)
            if evaluation is not None:
                mean = evaluation["mean_return"]
                if run_dir is not None and mean >= best:
                    best = mean
                    save_network_checkpoint(Path(run_dir) / "best.pt", weights.network, weights.training_step,
                                            best_checkpoint_extra(evaluation))  # fmt: skip
                reports.put(("eval", name, {"training_step": weights.training_step, **evaluation,
                                            "best_mean_return": best, "weights_version": weights.version}))  # fmt: skip
            round_ += 1
            stop.wait(max(0.0, config.runtime.evaluation_interval_s - (time.monotonic() - started)))
    except BaseException:
        report_error(reports, name)
        raise
    finally:
        if store is not None:
            store.close()
