"""MuZero's :class:`~mpper.algos.base.Algorithm`: the registry entry, and the small
functions it is made of."""

from __future__ import annotations

import math

from ...envs import config_symmetries
from ...envs.symmetry import SymmetryAugmented
from ..base import Algorithm
from .arena import evaluate_against_opponents
from .config import MuZeroRunConfig
from .networks import MuZeroNetwork, lstm_horizon, make_network
from .player import BatchedPlayer
from .reanalyse import Reanalyser
from .snapshot_eval import evaluate_muzero
from .targets import MuZeroTargets, muzero_schema
from .trainer import MuZeroTrainer

__all__ = ["ALGORITHM"]


def make_model(config: MuZeroRunConfig, observation_shape: tuple[int, ...], num_actions: int) -> MuZeroNetwork:
    """The MuZero network of ``config.network``, over ``muzero.stacked_observations``
    stacked observations (with ``muzero.value_prefix``, the value prefix's LSTM)."""
    return make_network(config.network, observation_shape, num_actions, config.muzero.stacked_observations,
                        lstm_horizon(config.muzero))  # fmt: skip


def make_player(config: MuZeroRunConfig, envs: list, network, explore: bool, seed: int,
                worker_id: int = 0) -> BatchedPlayer:  # fmt: skip
    """K envs played together with one batched search per move."""
    return BatchedPlayer(config, envs, network, explore, seed)


def make_targets(config: MuZeroRunConfig, num_actions: int):
    """Unroll targets (with the next observations the consistency loss compares
    against when ``muzero.consistency_loss_weight`` > 0, the value horizon shortened for
    old data with ``muzero.off_policy_correction``), seen through a random board
    symmetry with ``muzero.symmetry_augmentation``."""
    t = config.muzero
    targets = MuZeroTargets(
        num_unroll_steps=t.num_unroll_steps, td_steps=t.td_steps, discount=config.mcts.discount,
        num_actions=num_actions, stacked_observations=t.stacked_observations,
        next_observations=t.consistency_loss_weight > 0, off_policy_correction=t.off_policy_correction,
        total_training_steps=config.training.training_steps, auto_td_steps_ratio=t.auto_td_steps_ratio,
        value_prefix_horizon=lstm_horizon(t),
    )  # fmt: skip
    if t.symmetry_augmentation:
        return SymmetryAugmented(targets, config_symmetries(config))
    return targets


# Per search-tree node: visit count, value sum, reward, network value, player (8 bytes
# each), path entry; per action a prior (8) and a child index (8).
_NODE_BYTES, _NODE_ACTION_BYTES = 6 * 8, 16


def search_tree_bytes(config: MuZeroRunConfig, spec, model: MuZeroNetwork) -> int:
    """Bytes of one worker's search trees: ``envs_per_worker x (num_simulations + 1)``
    nodes, each with its statistics, a prior and a child per action, a hidden state (the
    ``hidden_shape`` that ``model`` declares) and, with a value prefix, its prefix and LSTM
    state."""
    hidden = math.prod(model.hidden_shape)
    nodes = config.runtime.envs_per_worker * (config.mcts.num_simulations + 1)
    prefix = 8 + 4 * 2 * config.network.lstm_hidden_size if config.muzero.value_prefix else 0
    return nodes * (_NODE_BYTES + _NODE_ACTION_BYTES * spec.num_actions + 4 * hidden + prefix)


ALGORITHM = Algorithm[MuZeroRunConfig](
    name="muzero",
    schema=muzero_schema,
    make_network=make_model,
    make_player=make_player,
    make_targets=make_targets,
    make_trainer=MuZeroTrainer,
    evaluate_snapshot=evaluate_muzero,
    make_reanalyser=Reanalyser,
    reanalyses=lambda config: config.reanalyse.enabled,
    augments_symmetries=lambda config: config.muzero.symmetry_augmentation,
    player_bytes=search_tree_bytes,
    play_against=evaluate_against_opponents,
    stored_moves=lambda config, moves: min(moves, config.muzero.game_segment_length or moves),
    search_nodes=lambda config: config.mcts.num_simulations + 1,
    # a value prefix sums the rewards of both players, whose signs the search flips ply by ply
    two_player_refusal=lambda config: ("muzero.value_prefix is for one-player envs (the prefix would sum both "
                                       "players' rewards)") if config.muzero.value_prefix else None,
    description="MuZero: learned model, batched MCTS, reanalyse",
)
