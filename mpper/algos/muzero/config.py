"""MuZero's config sections: ``network``, ``mcts``, ``muzero`` (what the learner unrolls
and how it weighs the losses) and ``reanalyse``, and :class:`MuZeroRunConfig`, the whole
config of a MuZero run with them as typed fields (what the loaders build and MuZero's
code is annotated with).

Names follow muzero-general (and the MuZero paper) where a counterpart exists. The
shared sections (``env``, ``replay``, ``training``, ``runtime``) and the engine that
checks every key are :mod:`mpper.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import SCHEDULE, WIDTHS, AlgorithmConfig, Config, Rule, opt

__all__ = ["CONFIG", "MCTSConfig", "MuZeroConfig", "MuZeroRunConfig", "NetworkConfig", "ReanalyseConfig"]


@dataclass
class NetworkConfig:
    """Representation, dynamics and prediction networks."""

    kind: str = opt("fc", ("fc", "residual"), '"fc" (fully connected) or "residual" (board games)')
    encoding_size: int = opt(16, "[1, 4096]", "hidden-state size (fc); channels for residual")
    hidden: list = opt([64], WIDTHS, "widths of the hidden layers of each head's MLP (fc and residual)")
    blocks: int = opt(2, "[1, 64]", "residual: residual blocks per function")
    support_size: int = opt(10, "[1, 10000]", "value/reward support is [-support_size, support_size]")
    # muzero-general's reduced_channels_{value,reward,policy}: one number for the three
    # heads of the residual network (whose MLPs use the widths in hidden).
    reduced_channels: int = opt(2, "[1, 1024]", "residual: planes of the 1x1 conv before each head's MLP (widths: hidden)")
    downsample: bool = opt(False, None, "residual: shrink observations by 16 first (the MuZero paper's Atari network, "
                           "muzero-general's downsample \"resnet\"): 96 x 96 -> a 6 x 6 hidden state")
    zero_init_heads: bool = opt(False, None, "start the value, reward and policy heads' last layers at zero "
                                "(LightZero's last_linear_layer_init_zero): value 0, reward 0 and a uniform prior "
                                "before training; false: PyTorch's default init, as muzero-general")
    # EfficientZero's SimSiam heads (LightZero's proj_hid = proj_out = 2 * pred_hid):
    # what muzero.consistency_loss_weight compares hidden states through.
    projection_size: int = opt(0, "[0, 8192]", "width of the projection and predictor heads of the consistency loss "
                               "(predictor bottleneck: half of it); 0: none")
    lstm_hidden_size: int = opt(64, "[1, 4096]", "with muzero.value_prefix: width of the LSTM cell between the "
                                "dynamics and the value-prefix head (EfficientZero: 512)")


@dataclass
class MCTSConfig:
    """Batched Monte-Carlo tree search in the self-play workers: muzero-general's pUCT
    search, or Gumbel MuZero's (names of its keys as in the paper and mctx)."""

    kind: str = opt("puct", ("puct", "gumbel"), '"puct" (MuZero\'s search, muzero-general) or "gumbel" (Gumbel MuZero: '
                    'Sequential Halving at the root, completed Q-values; the Dirichlet and temperature keys then '
                    'do not apply)')
    num_simulations: int = opt(50, "[1, 100000]", "simulations (recurrent inferences) per move")
    discount: float = opt(0.997, "(0, 1]", "reward discount, in the search and in the value targets")
    pb_c_base: float = opt(19652.0, "> 0", "pUCT exploration base")
    pb_c_init: float = opt(1.25, ">= 0", "pUCT exploration constant")
    root_dirichlet_alpha: float = opt(0.25, "> 0", "Dirichlet noise concentration at the root")
    root_exploration_fraction: float = opt(0.25, "[0, 1]", "share of Dirichlet noise in the root priors")
    temperature_schedule: list = opt(
        [[0.0, 1.0], [0.5, 0.5], [0.75, 0.25]],
        SCHEDULE,
        "visit-count temperature by training progress: [[fraction_of_training_steps, T], ...]; T = 0: greedy",
    )
    max_num_considered_actions: int = opt(16, "[1, 100000]", "gumbel: m, the root actions sampled without replacement "
                                          "(Gumbel-top-m) that Sequential Halving starts from")
    gumbel_scale: float = opt(1.0, ">= 0", "gumbel: scale of the root's Gumbel noise in self-play (0: greedy)")
    c_visit: float = opt(50.0, ">= 0", "gumbel: sigma(q) = (c_visit + max visit count) * c_scale * q, q in [0, 1]")
    c_scale: float = opt(0.1, "> 0", "gumbel: see c_visit (mctx's default value_scale 0.1)")
    gumbel_q_bounds: str = opt("node", ("node", "tree"), 'gumbel: the bounds that rescale completed Q to [0, 1]: '
                               '"node", the node\'s own (mctx); "tree", the whole tree\'s Q-values (as pUCT\'s '
                               'MinMaxStats), which keeps small value gaps small')
    temperature_threshold_moves: int | None = opt(
        None,
        "[1, 1000000]",
        "self-play: the first N moves of each episode use temperature_schedule, later moves the most visited "
        "action (T = 0; muzero-general's temperature_threshold N samples N - 1 moves); null: the schedule for "
        "every move",
    )


@dataclass
class MuZeroConfig:
    """What the learner unrolls, and how it weighs and prioritises."""

    num_unroll_steps: int = opt(10, "[0, 100]", "dynamics steps unrolled from each position (K)")
    td_steps: int = opt(50, "[1, 1000000]", "n of the n-step bootstrapped value target")
    stacked_observations: int = opt(0, "[0, 64]", "past observations (and actions) stacked into the input")
    value_loss_weight: float = opt(0.25, ">= 0", "scale of the value loss (paper: 0.25 with reanalyse)")
    symmetry_augmentation: bool = opt(False, None, "train each sampled position through a random board symmetry "
                                      "the env declares (env.unwrapped.symmetries(); needs stacked_observations 0)")
    consistency_loss_weight: float = opt(
        0.0, ">= 0", "weight of EfficientZero's consistency loss: the negative cosine similarity between the "
        "dynamics' hidden state k steps deep and the representation of the real observation k steps later, "
        "through network.projection_size heads, that side with a stop-gradient; 0: off")
    # LightZero's game_segment_length: with 64 envs in play, a game stored whole reaches
    # the learner thousands of training steps after its first move; a piece is
    # sampleable as soon as it is played.
    game_segment_length: int | None = opt(
        None, "[1, 1000000]", "self-play stores a game in pieces of this many moves, each as soon as it is played (its "
        "value targets bootstrap from the network's value at the cut, refreshed by the reanalyser; the learner's "
        "unroll stops at the cut); null: whole games (muzero-general)")
    # EfficientZero's off-policy correction (Ye et al. 2021, sec. 4.3 and appendix): the older
    # the data, the fewer of its rewards (the old policy's) the value target trusts.
    off_policy_correction: bool = opt(False, None, "EfficientZero's off-policy correction: the value target of a "
                                      "position whose moves were searched by weights of T_st training steps "
                                      "bootstraps after l = clip(td_steps - floor((T_current - T_st) / "
                                      "(auto_td_steps_ratio * training.training_steps)), 1, td_steps) moves, "
                                      "T_current the learner's step; false: always td_steps")
    auto_td_steps_ratio: float = opt(0.3, "> 0", "off_policy_correction: tau, the share of training.training_steps "
                                     "by which data must age for its value horizon to shrink by one move "
                                     "(EfficientZero: 0.3)")
    value_prefix: bool = opt(False, None, "EfficientZero's value prefix: the dynamics' reward head is an LSTM over "
                             "the unroll that predicts the sum of the rewards since its last reset (every "
                             "lstm_horizon_len steps); the search turns prefixes back into rewards. One-player envs "
                             "only")
    lstm_horizon_len: int = opt(5, "[1, 1000]", "with value_prefix: the LSTM state and the summed rewards restart "
                                "every this many dynamics steps, in training and in the search (EfficientZero: 5)")
    priority_update: str = opt("sampled", ("sampled", "unrolled"), 'new priorities after a step: "sampled" '
                               '(|v - z| of each sampled position) or "unrolled" (of each of the K + 1 unrolled '
                               'positions, as muzero-general)')


@dataclass
class ReanalyseConfig:
    """The reanalyse process: stored targets refreshed with the newest weights, values
    only (muzero-general) or, for a share of the episodes, policies and values from a new
    search (EfficientZero's reanalyse)."""

    enabled: bool = opt(True, None, "run the reanalyse process (muzero-general's use_last_model_value)")
    batch_episodes: int = opt(8, "[1, 100000]", "episodes refreshed per reanalyse batch")
    search_fraction: float = opt(0.0, "[0, 1]", "share of reanalysed episodes searched again with the newest "
                                 "weights (mcts.kind, with self-play's root noise, as EfficientZero): fresh policy "
                                 "targets and root values for every position; the rest get the network's values only. "
                                 "0: values only (muzero-general); 1: every episode (EfficientZero, LightZero)")
    num_simulations: int | None = opt(None, "[1, 100000]", "simulations per reanalysed position; null: "
                                      "mcts.num_simulations")


@dataclass
class MuZeroRunConfig(Config):
    """A MuZero run's config: the shared sections and MuZero's own."""

    network: NetworkConfig = field(default_factory=NetworkConfig)
    mcts: MCTSConfig = field(default_factory=MCTSConfig)
    muzero: MuZeroConfig = field(default_factory=MuZeroConfig)
    reanalyse: ReanalyseConfig = field(default_factory=ReanalyseConfig)


def _symmetry_needs_no_stacking(config: MuZeroRunConfig) -> str | None:
    m = config.muzero
    if m.symmetry_augmentation and m.stacked_observations != 0:
        return (f"needs muzero.stacked_observations 0 (stacked action planes are not transformed), "
                f"got {m.stacked_observations}")  # fmt: skip
    return None


def _segments_need_no_stacking(config: MuZeroRunConfig) -> str | None:
    m = config.muzero
    if m.game_segment_length is not None and m.stacked_observations != 0:
        return (f"needs muzero.stacked_observations 0 (a piece's first rows would miss the observations of the "
                f"piece before), got {m.stacked_observations}")  # fmt: skip
    return None


def _consistency_needs_projection(config: MuZeroRunConfig) -> str | None:
    if config.muzero.consistency_loss_weight > 0 and config.network.projection_size == 0:
        return "needs network.projection_size >= 1 (the heads the hidden states are compared through), got 0"
    return None


CONFIG = AlgorithmConfig(
    MuZeroRunConfig,
    rules=(
        Rule(("muzero.symmetry_augmentation", "muzero.stacked_observations"), _symmetry_needs_no_stacking),
        Rule(("muzero.consistency_loss_weight", "network.projection_size"), _consistency_needs_projection),
        Rule(("muzero.game_segment_length", "muzero.stacked_observations"), _segments_need_no_stacking),
    ),
    # MuZero Unplugged: offline, reanalyse is where the targets come from; every reanalysed
    # episode is searched again, so both its policy and its value targets are the newest
    # weights' (a stored episode of a DQN run has no search statistics of its own)
    offline=("reanalyse.enabled=true", "reanalyse.search_fraction=1.0"),
)
