"""Sampled MuZero self-play and evaluation: N environments with a Box action space played
together, one batched sampled search per move.

Self-play explores (the root samples at ``sampled_mcts.root_sampling_temperature``, Dirichlet noise
over them, the played sample drawn from the visit counts at the scheduled temperature);
evaluation plays the most visited sampled action of a search without noise. Actions are
chosen in [-1, 1]^A and rescaled to the env's Box (``low + (a + 1) / 2 * (high - low)``)
when the env is stepped; episodes store them as chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..base import EpisodeRows, as_stored
from ..muzero_family import support_to_scalar, temperature_at
from .config import SampledMuZeroRunConfig
from .search import SampledSearch, choose
from .targets import initial_priorities

__all__ = ["SampledEpisode", "SampledPlayer", "to_env_action"]


def to_env_action(actions: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Actions (..., A) in [-1, 1] -> the Box [low, high] (float32, clipped into it)."""
    scaled = low + (np.asarray(actions, np.float64) + 1.0) * 0.5 * (high - low)
    return np.clip(scaled, low, high).astype(np.float32)


def _check_finite(observation, reward, move: int) -> None:
    """ValueError (one line) when the env returned a NaN or infinite reward or observation:
    stored, it would turn every loss that samples it into NaN (a physics simulation that
    diverged does this)."""
    if not math.isfinite(float(reward)):
        raise ValueError(f"the env returned a non-finite reward ({reward}) at move {move}")
    obs = np.asarray(observation)
    if obs.dtype.kind == "f" and not np.isfinite(obs).all():
        raise ValueError(f"the env returned a non-finite observation at move {move}")


@dataclass
class SampledEpisode(EpisodeRows):
    """One game: the common rows (actions (A,) float vectors in [-1, 1]) and the search's."""

    root_value: list = field(default_factory=list)  # search value at o_i, i < T
    child_visits: list = field(default_factory=list)  # (K,) visit shares at o_i, i < T
    sampled_actions: list = field(default_factory=list)  # (K, A) root samples at o_i, i < T
    final_value: float = 0.0  # the network's value of o_T (a truncated episode bootstraps from it)

    def arrays(self, action_dim: int, num_sampled: int) -> dict[str, np.ndarray]:
        """The rows for ``ReplayBuffer.add_episode`` (row T: ``final_value``, no visits)."""
        return {
            "observation": np.stack(self.observation),
            "action": np.stack(self.action).astype(np.float32).reshape(-1, action_dim),
            "reward": np.asarray(self.reward, np.float32),
            "root_value": np.asarray(self.root_value + [self.final_value], np.float32),
            "child_visits": np.stack(self.child_visits + [np.zeros(num_sampled)]).astype(np.float32),
            "sampled_actions": np.stack(self.sampled_actions
                                        + [np.zeros((num_sampled, action_dim))]).astype(np.float32),  # fmt: skip
        }


class SampledPlayer:
    """Steps N envs (a bounded ``Box`` action space of shape (A,)) with one batched search
    per move; ``explore``: self-play (stored episodes), else evaluation (greedy)."""

    def __init__(self, config: SampledMuZeroRunConfig, envs: list, network, explore: bool, seed: int) -> None:
        self.config = config
        self.envs = envs
        self.network = network
        self.explore = explore
        space = envs[0].action_space
        self.low, self.high = np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
        self.action_dim = int(np.prod(space.shape))
        self.shape = tuple(space.shape)
        self.num_sampled = int(config.sampled_mcts.num_sampled_actions)
        self.search = SampledSearch(config.sampled_mcts, self.action_dim, config.sampled_network.support_size)
        self.rng = np.random.default_rng(seed)
        self.episodes = [self._reset(k, seed + k) for k in range(len(envs))]

    def _reset(self, k: int, seed: int | None = None) -> SampledEpisode:
        obs, _ = self.envs[k].reset(seed=seed)
        return SampledEpisode(observation=[as_stored(obs)], action=[np.zeros(self.action_dim, np.float32)])

    def network_input(self, ep: SampledEpisode) -> np.ndarray:
        return ep.observation[-1]

    def step(self, progress: float = 0.0, training_step: int = 0) -> list[SampledEpisode]:
        """Search, act and step every env once; returns the episodes that ended (their
        envs reset and play on)."""
        temperature = temperature_at(self.config.sampled_mcts.temperature_schedule, progress) if self.explore else 0.0
        observations = np.stack([self.network_input(ep) for ep in self.episodes])
        result = self.search.run(self.network, observations, self.explore, self.rng)
        chosen = choose(result.visit_counts, temperature, self.rng) if result.chosen is None else result.chosen
        actions = result.actions[np.arange(len(self.envs)), chosen].astype(np.float32)
        finished = []
        for k, (env, ep) in enumerate(zip(self.envs, self.episodes)):
            ep.root_value.append(float(result.root_values[k]))
            ep.child_visits.append(result.policy_target[k])
            ep.sampled_actions.append(result.actions[k])
            env_action = to_env_action(actions[k], self.low, self.high).reshape(self.shape)
            obs, reward, terminated, truncated, _ = env.step(env_action)
            _check_finite(obs, reward, ep.game_moves + 1)
            ep.observation.append(as_stored(obs))
            ep.action.append(actions[k])
            ep.reward.append(float(reward))
            if terminated or truncated:
                ep.terminated = bool(terminated)
                finished.append(ep)
                self.episodes[k] = self._reset(k)
        cut = [ep for ep in finished if not ep.terminated]
        if cut and self.explore:
            for ep, value in zip(cut, self._values(np.stack([ep.observation[-1] for ep in cut]))):
                ep.final_value = float(value)
        return finished

    def greedy_actions(self, observations: np.ndarray, legal: np.ndarray | None = None,
                       to_play: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """The env actions (N, *action shape) float32 played without exploring: the most
        visited sampled action of a search without noise, rescaled to the Box."""
        result = self.search.run(self.network, np.asarray(observations, np.float32), False, self.rng)
        chosen = choose(result.visit_counts, 0.0, self.rng) if result.chosen is None else result.chosen
        actions = result.actions[np.arange(len(observations)), chosen]
        return to_env_action(actions, self.low, self.high).reshape((len(observations), *self.shape))

    @torch.inference_mode()
    def _values(self, observations: np.ndarray) -> np.ndarray:
        out = self.network.initial_inference(torch.as_tensor(np.asarray(observations, np.float32)))
        return support_to_scalar(out.value_logits, self.config.sampled_network.support_size).numpy()

    def stored(self, ep: SampledEpisode) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """(rows, raw initial priorities: |root value - n-step target| with
        ``replay.initial_priority`` "actor", else None)."""
        arrays = ep.arrays(self.action_dim, self.num_sampled)
        if self.config.replay.initial_priority != "actor":
            return arrays, None
        t = self.config.sampled_muzero
        return arrays, initial_priorities(arrays, t.td_steps, self.config.sampled_mcts.discount, ep.terminated)
