"""Sampled MuZero's config sections (Hubert et al. 2021, "Learning and Planning in
Complex Action Spaces"): ``network``, ``mcts``, ``sampled_muzero`` and ``reanalyse``, and
:class:`SampledMuZeroRunConfig`, the whole config of a run with them as typed fields.

Names follow the paper (K: ``sampled_mcts.num_sampled_actions``; beta, the sampling distribution:
the network's policy, at the root with ``root_sampling_temperature``) and, where MuZero
has the same key, MuZero's (:mod:`mpper.algos.muzero.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import SCHEDULE, WIDTHS, AlgorithmConfig, Config, Rule, opt

__all__ = ["CONFIG", "SampledMCTSConfig", "SampledMuZeroConfig", "SampledMuZeroRunConfig", "SampledNetworkConfig",
           "SampledReanalyseConfig"]


@dataclass
class SampledNetworkConfig:
    """Fully connected representation, dynamics and prediction networks; the policy head is
    a tanh-squashed diagonal Gaussian over the env's Box, rescaled to [-1, 1]."""

    encoding_size: int = opt(32, "[1, 4096]", "hidden-state size")
    hidden: list = opt([64], WIDTHS, "widths of the hidden layers of each function's MLP")
    support_size: int = opt(10, "[1, 10000]", "value/reward support is [-support_size, support_size]")
    action_encoding_size: int = opt(16, "[1, 4096]", "width of the linear encoder of the action vector that the "
                                    "dynamics take beside the hidden state")
    min_log_std: float = opt(-5.0, "[-20, 0]", "soft lower bound of the policy's log standard deviation (before "
                             "tanh)")
    max_log_std: float = opt(2.0, "[-5, 5]", "soft upper bound of the policy's log standard deviation (before tanh)")
    normalize_observations: bool = opt(False, None, "normalise observations with running per-value mean and "
                                       "variance statistics inside the network (updated by the learner from each "
                                       "batch; carried with the weights)")
    observation_clip: float = opt(10.0, "> 0", "normalize_observations: the normalised values are clipped to "
                                  "[-observation_clip, observation_clip]")
    projection_size: int = opt(0, "[0, 8192]", "width of the projection and predictor heads of the consistency loss "
                               "(sampled_muzero.consistency_loss_weight); 0: no heads")


@dataclass
class SampledMCTSConfig:
    """The search (pUCT, or Gumbel MuZero's) over K actions sampled at each expanded node,
    with the paper's sampled-policy correction: the prior of sampled action a is
    beta_hat(a) / beta(a) * pi(a), normalised over the node's samples."""

    kind: str = opt("puct", ("puct", "gumbel"), '"puct" (the paper\'s search) or "gumbel" (Gumbel MuZero over the '
                    "sampled actions: Sequential Halving at the root, completed Q-values; the Dirichlet and "
                    "temperature keys then do not apply)")
    num_simulations: int = opt(50, "[1, 100000]", "simulations (recurrent inferences) per move")
    num_sampled_actions: int = opt(16, "[1, 1024]", "K, the actions sampled from beta at each expanded node")
    root_sampling_temperature: float = opt(1.0, "> 0", "tau of the root's sampling distribution in self-play: beta "
                                           "is pi^(1/tau) (the Gaussian's standard deviation times sqrt(tau) before "
                                           "tanh); 1: beta = pi. Below the root, and in evaluation, beta = pi")
    discount: float = opt(0.997, "(0, 1]", "reward discount, in the search and in the value targets")
    pb_c_base: float = opt(19652.0, "> 0", "pUCT exploration base")
    pb_c_init: float = opt(1.25, ">= 0", "pUCT exploration constant")
    root_dirichlet_alpha: float = opt(0.25, "> 0", "Dirichlet noise concentration over the root's K samples")
    root_exploration_fraction: float = opt(0.25, "[0, 1]", "share of Dirichlet noise in the root priors")
    max_num_considered_actions: int = opt(16, "[1, 100000]", "gumbel: the root samples Sequential Halving starts "
                                          "from (at most num_sampled_actions)")
    gumbel_scale: float = opt(1.0, ">= 0", "gumbel: scale of the root's Gumbel noise in self-play (0: greedy)")
    c_visit: float = opt(50.0, ">= 0", "gumbel: sigma(q) = (c_visit + max visit count) * c_scale * q, q in [0, 1]")
    c_scale: float = opt(0.1, "> 0", "gumbel: see c_visit")
    gumbel_q_bounds: str = opt("node", ("node", "tree"), 'gumbel: the bounds that rescale completed Q to [0, 1]: '
                               '"node", the node\'s own; "tree", the whole tree\'s Q-values')
    temperature_schedule: list = opt(
        [[0.0, 1.0], [0.5, 0.5], [0.75, 0.25]],
        SCHEDULE,
        "visit-count temperature over the K root samples by training progress: [[fraction_of_training_steps, T], "
        "...]; T = 0: the most visited",
    )


@dataclass
class SampledMuZeroConfig:
    """What the learner unrolls, and how it weighs the losses."""

    num_unroll_steps: int = opt(5, "[0, 100]", "dynamics steps unrolled from each position")
    td_steps: int = opt(10, "[1, 1000000]", "n of the n-step bootstrapped value target")
    value_loss_weight: float = opt(0.25, ">= 0", "scale of the value loss")
    policy_entropy_weight: float = opt(0.0, ">= 0", "weight of a bonus on the policy's entropy (of the Gaussian "
                                       "before tanh); 0: the paper's loss")
    consistency_loss_weight: float = opt(
        0.0, ">= 0", "weight of EfficientZero's consistency loss: the negative cosine similarity between the "
        "dynamics' hidden state k steps deep and the representation of the real observation k steps later, "
        "through sampled_network.projection_size heads, that side with a stop-gradient; 0: off")


@dataclass
class SampledReanalyseConfig:
    """The reanalyse process: stored targets refreshed with the newest weights: values, and
    for a share of the episodes the policy targets and root samples of a new search."""

    enabled: bool = opt(True, None, "run the reanalyse process")
    batch_episodes: int = opt(8, "[1, 100000]", "episodes refreshed per reanalyse batch")
    search_fraction: float = opt(0.0, "[0, 1]", "share of reanalysed episodes searched again with the newest weights "
                                 "(sampled_mcts.kind, with self-play's root noise): fresh root samples, policy "
                                 "targets and root values for every position; the rest get the network's values only")
    num_simulations: int | None = opt(None, "[1, 100000]", "simulations per reanalysed position; null: "
                                      "sampled_mcts.num_simulations")


@dataclass
class SampledMuZeroRunConfig(Config):
    """A Sampled MuZero run's config: the shared sections and its own."""

    algorithm: str = opt("sampled_muzero", None, "the algorithm to train; its own sections are the other keys of "
                         "the file")
    sampled_network: SampledNetworkConfig = field(default_factory=SampledNetworkConfig)
    sampled_mcts: SampledMCTSConfig = field(default_factory=SampledMCTSConfig)
    sampled_muzero: SampledMuZeroConfig = field(default_factory=SampledMuZeroConfig)
    sampled_reanalyse: SampledReanalyseConfig = field(default_factory=SampledReanalyseConfig)


def _log_std_range(config: SampledMuZeroRunConfig) -> str | None:
    n = config.sampled_network
    if n.min_log_std >= n.max_log_std:
        return f"must be below sampled_network.max_log_std ({n.max_log_std}), got {n.min_log_std}"
    return None


def _workers_run_their_network(config: SampledMuZeroRunConfig) -> str | None:
    if config.runtime.selfplay_inference == "server":
        return 'Sampled MuZero\'s workers run their own network: use "auto" or "worker"'
    return None


def _eager_step(config: SampledMuZeroRunConfig) -> str | None:
    capture = config.training.capture
    if capture in ("auto", "off"):
        return None
    return f'Sampled MuZero trains with the eager step: expected "auto" or "off", got "{capture}"'


def _fp32(config: SampledMuZeroRunConfig) -> str | None:
    precision = config.training.precision
    return None if precision == "fp32" else f'Sampled MuZero trains in float32: expected "fp32", got "{precision}"'


def _consistency_needs_projection(config: SampledMuZeroRunConfig) -> str | None:
    if config.sampled_muzero.consistency_loss_weight > 0 and config.sampled_network.projection_size == 0:
        return "needs sampled_network.projection_size >= 1 (the heads the hidden states are compared through), got 0"
    return None


CONFIG = AlgorithmConfig(
    SampledMuZeroRunConfig,
    rules=(
        Rule(("sampled_network.min_log_std", "sampled_network.max_log_std"), _log_std_range),
        Rule(("runtime.selfplay_inference",), _workers_run_their_network),
        Rule(("training.capture",), _eager_step),
        Rule(("training.precision",), _fp32),
        Rule(("sampled_muzero.consistency_loss_weight", "sampled_network.projection_size"),
             _consistency_needs_projection),
    ),
)
