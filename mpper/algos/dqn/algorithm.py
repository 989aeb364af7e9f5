"""DQN's :class:`~mpper.algos.base.Algorithm`: the registry entry, and the small
functions it is made of."""

from __future__ import annotations

from collections.abc import Sequence

from ..base import Algorithm
from .config import DQNRunConfig
from .dqn import DQNTrainer, EpsilonGreedyPlayer, QNetwork, make_q_network
from .snapshot_eval import evaluate_dqn
from .targets import NStepTargets, dqn_schema

__all__ = ["ALGORITHM"]


def make_model(config: DQNRunConfig, observation_shape: tuple[int, ...], num_actions: int) -> QNetwork:
    """The Q-network: ``dqn.torso``, ``dqn.hidden`` widths, a dueling head with ``dqn.dueling``."""
    return make_q_network(config, observation_shape, num_actions)


def make_player(config: DQNRunConfig, envs: list, network, explore: bool, seed: int,
                worker_id: int = 0) -> EpsilonGreedyPlayer:  # fmt: skip
    """K envs stepped together; worker ``worker_id``'s envs are Ape-X actors
    ``worker_id * K .. worker_id * K + K - 1`` of ``workers * K``."""
    k = config.runtime.envs_per_worker
    return EpsilonGreedyPlayer(config, envs, network, explore, seed, actor_index=worker_id * k,
                               num_actors=max(1, config.runtime.workers) * k)  # fmt: skip


def make_targets(config: DQNRunConfig, num_actions: int) -> NStepTargets:
    """n-step transitions of ``dqn.n_step`` and ``dqn.gamma``."""
    return NStepTargets(config.dqn.n_step, config.dqn.gamma, config.dqn.frame_stack)


def priority_clip(config: DQNRunConfig) -> float | None:
    """``dqn.priority_clip``: the buffer clips new and updated raw priorities alike."""
    return config.dqn.priority_clip


def schema(observation_shape: Sequence[int], num_actions: int, observation_dtype="float32") -> dict:
    """:func:`~mpper.algos.dqn.targets.dqn_schema` (the number of actions is not stored)."""
    return dqn_schema(observation_shape, observation_dtype)


ALGORITHM = Algorithm[DQNRunConfig](
    name="dqn",
    schema=schema,
    make_network=make_model,
    make_player=make_player,
    make_targets=make_targets,
    make_trainer=DQNTrainer,
    evaluate_snapshot=evaluate_dqn,
    priority_clip=priority_clip,
    description="DQN with prioritized replay (double, dueling, n-step), Ape-X exploration",
)
