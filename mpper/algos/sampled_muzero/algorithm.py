"""Sampled MuZero's :class:`~mpper.algos.base.Algorithm`: the registry entry."""

from __future__ import annotations

from ..base import Algorithm
from .config import SampledMCTSConfig, SampledMuZeroRunConfig
from .networks import SampledMuZeroNetwork, make_network
from .player import SampledPlayer
from .reanalyse import SampledReanalyser
from .snapshot_eval import evaluate_sampled
from .targets import SampledTargets, sampled_schema
from .trainer import SampledMuZeroTrainer

__all__ = ["ALGORITHM"]


def make_model(config: SampledMuZeroRunConfig, observation_shape: tuple[int, ...],
               action_dim: int) -> SampledMuZeroNetwork:  # fmt: skip
    """The network of ``config.sampled_network`` for actions of ``action_dim`` dimensions."""
    return make_network(config.sampled_network, observation_shape, action_dim)


def make_player(config: SampledMuZeroRunConfig, envs: list, network, explore: bool, seed: int,
                worker_id: int = 0) -> SampledPlayer:  # fmt: skip
    """N envs played together, one batched sampled search per move."""
    return SampledPlayer(config, envs, network, explore, seed)


def make_targets(config: SampledMuZeroRunConfig, action_dim: int) -> SampledTargets:
    """The unroll targets of ``sampled_muzero``'s horizon and ``sampled_mcts.discount`` (with
    the next observations the consistency loss compares against, when it is on)."""
    t = config.sampled_muzero
    return SampledTargets(t.num_unroll_steps, t.td_steps, config.sampled_mcts.discount,
                          next_observations=t.consistency_loss_weight > 0)  # fmt: skip


def run_schema(config: SampledMuZeroRunConfig, observation_shape, action_dim: int, observation_dtype="float32"):
    """The rows of a run of ``config``: K = ``sampled_mcts.num_sampled_actions`` root samples each."""
    return sampled_schema(observation_shape, action_dim, config.sampled_mcts.num_sampled_actions, observation_dtype)


def default_schema(observation_shape, action_dim: int, observation_dtype="float32"):
    """The schema at the default K, for callers that have no config; a run's rows hold K =
    ``sampled_mcts.num_sampled_actions`` root samples (``run_schema``, the ``config_schema``)."""
    return sampled_schema(observation_shape, action_dim, SampledMCTSConfig().num_sampled_actions, observation_dtype)


def _player_bytes(config: SampledMuZeroRunConfig, spec, model) -> int:
    """One worker's search trees: per node its statistics and K edges (prior, child, the
    sampled action), and a hidden state."""
    nodes = config.runtime.envs_per_worker * (config.sampled_mcts.num_simulations + 1)
    k = config.sampled_mcts.num_sampled_actions
    return nodes * (5 * 8 + k * (8 + 8 + 1 + 8 * spec.num_actions) + 4 * config.sampled_network.encoding_size)


ALGORITHM = Algorithm[SampledMuZeroRunConfig](
    name="sampled_muzero",
    schema=default_schema,
    config_schema=run_schema,
    make_network=make_model,
    make_player=make_player,
    make_targets=make_targets,
    make_trainer=SampledMuZeroTrainer,
    evaluate_snapshot=evaluate_sampled,
    make_reanalyser=SampledReanalyser,
    reanalyses=lambda config: config.sampled_reanalyse.enabled,
    player_bytes=_player_bytes,
    continuous_actions=True,
    description="Sampled MuZero: continuous (Box) actions, K sampled actions per node, sampled-policy correction",
)
