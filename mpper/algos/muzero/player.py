"""MuZero self-play: K environments played together with one batched MCTS per move.

``BatchedPlayer`` is the game loop of the self-play workers (exploration noise,
visit-count temperature, episodes stored in the replay buffer) and of the evaluator
(greedy, no noise, episodes only scored). ``Episode`` holds one game in
muzero-general's GameHistory layout (:mod:`mpper.algos.muzero.targets`).

Two-player and masked environments report, in ``info`` at reset and after each step,
``to_play`` (0 or 1) and ``action_mask`` (bool per action); other environments have
one player and every action legal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...envs.two_player import is_two_player
from ..base import EpisodeRows, as_stored
from ..muzero_family import temperature_at
from .config import MuZeroRunConfig
from .mcts import select_action
from .networks import support_to_scalar
from .search import make_search
from .targets import WEIGHTS_STEP, MuZeroTargets, latest_stacked_observation

__all__ = ["BatchedPlayer", "Episode", "initial_priorities"]


@dataclass
class Episode(EpisodeRows):
    """One game in muzero-general's GameHistory layout: T moves, T + 1 rows (the common
    rows of :class:`~mpper.algos.base.EpisodeRows`, and the search's)."""

    to_play: list = field(default_factory=list)
    root_value: list = field(default_factory=list)  # search value at o_i, i < T
    child_visits: list = field(default_factory=list)  # visit distribution at o_i, i < T
    legal_actions: list = field(default_factory=list)  # bool mask at o_i, i < T (what a reanalysing search needs)
    weights_step: list = field(default_factory=list)  # training step of the weights that searched o_i, i < T
    # The network's value of o_T, for an episode cut by a time limit: its value targets
    # bootstrap from it (mpper.replay.targets). 0 for a terminated one, whose row T is never read.
    final_value: float = 0.0

    def arrays(self, num_actions: int) -> dict[str, np.ndarray]:
        """Rows for ``ReplayBuffer.add_episode`` (final row: ``final_value`` as its
        root value, no visits, every action legal, the weights step of the last move)."""
        return {
            **self.rows(),
            "to_play": np.asarray(self.to_play, np.int8),
            "root_value": np.asarray(self.root_value + [self.final_value], np.float32),
            "child_visits": np.vstack(self.child_visits + [np.zeros(num_actions)]).astype(np.float32),
            "legal_actions": np.vstack(self.legal_actions + [np.ones(num_actions, bool)]),
            WEIGHTS_STEP: np.asarray(self.weights_step + self.weights_step[-1:], np.int64),
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
        config: the run config (mcts, muzero.stacked_observations, replay.initial_priority).
        envs: K gymnasium environments.
        network: a MuZeroNetwork on the CPU, in eval mode.
        explore: Dirichlet root noise and visit-count temperature (self-play; Gumbel
            noise with ``mcts.kind`` "gumbel"); without it, no noise and the most visited
            action (Gumbel: the search's greedy choice) (evaluation).
        seed: seeds the first reset of env k with ``seed + k``.
    """

    def __init__(self, config: MuZeroRunConfig, envs: list, network, explore: bool, seed: int) -> None:
        self.config = config
        self.envs = envs
        self.network = network
        self.explore = explore
        self.num_actions = int(envs[0].action_space.n)
        self.stacked = config.muzero.stacked_observations
        self.mcts = make_search(self.num_actions, config.mcts, config.network.support_size,
                                two_player=is_two_player(envs[0]))  # fmt: skip
        self.rng = np.random.default_rng(seed)
        self.legal = [np.ones(self.num_actions, bool)] * len(envs)  # set by _reset
        self.episodes = [self._reset(k, seed + k) for k in range(len(envs))]

    def _reset(self, k: int, seed: int | None = None) -> Episode:
        obs, info = self.envs[k].reset(seed=seed)
        ep = Episode()
        ep.observation.append(as_stored(obs))
        ep.to_play.append(int(info.get("to_play", 0)))
        self.legal[k] = _legal(info, self.num_actions)
        return ep

    def network_input(self, ep: Episode) -> np.ndarray:
        """What the network sees at the episode's last observation: that observation, or
        with ``muzero.stacked_observations`` N, it and the N before with their actions."""
        if self.stacked == 0:
            return ep.observation[-1]
        return latest_stacked_observation(ep.observation, ep.action, self.stacked, self.num_actions)

    def step(self, progress: float = 0.0, training_step: int = 0) -> list[Episode]:
        """Search, act and step every env once; returns the episodes that just ended
        (their envs are reset and play on) and, while exploring with
        ``muzero.game_segment_length`` L, the pieces of L moves of games that go on
        (``ends_game`` False; the game goes on in a new episode whose row 0 is the
        piece's last). ``progress``: the share of training done, which sets the
        visit-count temperature while exploring; a game that has played
        ``mcts.temperature_threshold_moves`` moves or more takes the most visited action
        instead (T = 0). ``training_step``: the learner's step of the weights the network
        holds now, stored with each move (``weights_step``)."""
        temperature = temperature_at(self.config.mcts.temperature_schedule, progress) if self.explore else 0.0
        observations = np.stack([self.network_input(ep) for ep in self.episodes])
        legal = np.stack(self.legal)
        to_play = np.array([ep.to_play[-1] for ep in self.episodes])
        result = self.mcts.run(self.network, observations, legal, to_play, self.explore, self.rng)
        threshold = self.config.mcts.temperature_threshold_moves
        actions = self._chosen(result, temperature)
        if result.actions is None and threshold is not None and temperature != 0:
            greedy = np.array([ep.game_moves >= threshold for ep in self.episodes])
            if greedy.any():  # only then: without a threshold the draws stay as they were
                actions[greedy] = select_action(result.visit_counts[greedy], 0.0, self.rng)
        segment = self.config.muzero.game_segment_length if self.explore else None
        finished = []
        for k, (env, ep) in enumerate(zip(self.envs, self.episodes)):
            ep.root_value.append(float(result.root_values[k]))
            ep.child_visits.append(result.policy_target[k])
            ep.legal_actions.append(legal[k])
            ep.weights_step.append(int(training_step))
            obs, reward, terminated, truncated, info = env.step(int(actions[k]))
            ep.observation.append(as_stored(obs))
            ep.action.append(int(actions[k]))
            ep.reward.append(float(reward))
            ep.to_play.append(int(info.get("to_play", 0)))
            self.legal[k] = _legal(info, self.num_actions)
            if terminated or truncated:
                ep.terminated = bool(terminated)
                finished.append(ep)
                self.episodes[k] = self._reset(k)
            elif segment is not None and ep.moves >= segment:
                ep.ends_game = False
                finished.append(ep)
                self.episodes[k] = Episode(observation=[ep.observation[-1]], to_play=[ep.to_play[-1]],
                                           first_move=ep.game_moves, reward_before=ep.game_return)  # fmt: skip
        cut = [ep for ep in finished if not ep.terminated]
        if cut and self.explore:  # only stored episodes need a value to bootstrap from
            values = self._values(np.stack([self.network_input(ep) for ep in cut]))
            for ep, value in zip(cut, values):
                ep.final_value = float(value)
        return finished

    def _chosen(self, result, temperature: float) -> np.ndarray:
        """The actions (K,) a search's result plays at ``temperature`` (0: the most visited)."""
        if result.actions is not None:  # Gumbel: the search chose (its noise is the exploration)
            return result.actions
        return select_action(result.visit_counts, temperature, self.rng)

    def greedy_actions(self, observations: np.ndarray, legal: np.ndarray | None = None,
                       to_play: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """The actions (N,) int64 this player takes without exploring (as the evaluator
        plays: one search per root, no noise, the most visited action) for N network inputs
        ``observations`` (N, *observation_shape) (stacked as the network expects); ``legal``
        (N, A) bool, default all legal; ``to_play`` (N,) int, default 0."""
        observations = np.asarray(observations, np.float32)
        n = len(observations)
        legal = np.ones((n, self.num_actions), bool) if legal is None else np.asarray(legal, bool)
        to_play = np.zeros(n, np.int64) if to_play is None else np.asarray(to_play, np.int64)
        result = self.mcts.run(self.network, observations, legal, to_play, False, self.rng)
        return np.asarray(self._chosen(result, 0.0), np.int64)

    @torch.inference_mode()
    def _values(self, observations: np.ndarray) -> np.ndarray:
        """The network's scalar values (N,) of N (stacked) observations."""
        out = self.network.initial_inference(torch.as_tensor(np.asarray(observations, np.float32)))
        return support_to_scalar(out.value_logits, self.config.network.support_size).numpy()


    def stored(self, ep: Episode) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """(rows, raw initial priorities) to hand to ``ReplayBuffer.add_episode``: with
        ``replay.initial_priority`` "actor", muzero-general's ``|root value - n-step
        target|``; otherwise None (the buffer's own rule)."""
        arrays = ep.arrays(self.num_actions)
        if self.config.replay.initial_priority != "actor":
            return arrays, None
        return arrays, initial_priorities(arrays, self.config.muzero.td_steps, self.config.mcts.discount,
                                          ep.terminated)


def _legal(info: dict, num_actions: int) -> np.ndarray:
    mask = info.get("action_mask")
    return np.ones(num_actions, bool) if mask is None else np.asarray(mask, bool)
