"""Run configuration: JSON files validated into dataclasses.

Every key of every section is a dataclass field below, with its default and a comment;
``python run.py --help-config`` prints them. Names follow muzero-general (and the MuZero
paper) where a counterpart exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EnvConfig:
    id: str = "CartPole-v1"  # gymnasium id, or "module:factory" returning a gymnasium.Env
    kwargs: dict = field(default_factory=dict)  # passed to gymnasium.make / the factory
    max_episode_steps: int | None = None  # time limit (truncation); None: the env's own


@dataclass
class NetworkConfig:
    kind: str = "fc"  # "fc" (fully connected) or "residual" (board games)
    encoding_size: int = 16  # hidden-state size (fc) ; channels for residual
    hidden: list = field(default_factory=lambda: [64])  # fc: widths of each head's hidden layers
    blocks: int = 2  # residual: residual blocks per function
    support_size: int = 10  # value/reward support is [-support_size, support_size]
    # residual: planes of the 1x1 conv before each head's MLP (muzero-general's
    # reduced_channels_{value,reward,policy}, one number for all three); added for mpper.networks
    reduced_channels: int = 2


@dataclass
class MCTSConfig:
    num_simulations: int = 50
    discount: float = 0.997
    pb_c_base: float = 19652.0
    pb_c_init: float = 1.25
    root_dirichlet_alpha: float = 0.25
    root_exploration_fraction: float = 0.25
    # visit-count temperature by training progress: [[fraction_of_training_steps, T], ...]
    temperature_schedule: list = field(default_factory=lambda: [[0.0, 1.0], [0.5, 0.5], [0.75, 0.25]])


@dataclass
class ReplayConfig:
    capacity: int = 100_000  # steps (rows) in the shared ring
    alpha: float = 0.5  # priority exponent (PER_alpha); 0: uniform
    beta: float = 1.0  # initial importance-sampling exponent, annealed to 1
    priority_eps: float = 1e-6
    initial_priority: str | float = "max"  # "max" or a number
    snapshot_interval_s: float = 300.0  # periodic buffer snapshot; 0: only at the end


@dataclass
class TrainingConfig:
    training_steps: int = 10_000
    batch_size: int = 128
    num_unroll_steps: int = 10
    td_steps: int = 50
    stacked_observations: int = 0
    value_loss_weight: float = 0.25
    optimizer: str = "adam"  # "adam" or "sgd"
    momentum: float = 0.9  # sgd only
    lr_init: float = 0.02
    lr_decay_rate: float = 0.8  # exponential: lr = lr_init * rate ** (step / lr_decay_steps)
    lr_decay_steps: int = 1000
    weight_decay: float = 1e-4
    grad_clip: float | None = None  # max global gradient norm; None: off
    checkpoint_interval: int = 10  # publish weights to self-play every N training steps
    samples_per_insert: float | None = None  # training samples per stored step; None: off
    samples_per_insert_tolerance: float = 0.2  # relative slack before a side waits
    min_buffer_steps: int = 500  # stored steps before learning starts


@dataclass
class RuntimeConfig:
    workers: int = 8  # self-play processes; 0: everything in one process, in turns
    envs_per_worker: int = 8  # K environments searched together by each worker
    device: str = "auto"  # learner device: "auto" (cuda when available), "cpu", "cuda"
    seed: int = 0
    reanalyse: bool = True  # run the reanalyse process (use_last_model_value)
    reanalyse_batch_episodes: int = 8
    evaluation_interval_s: float = 10.0
    evaluation_episodes: int = 10
    solve_return: float | None = None  # stop when the mean greedy return reaches this
    checkpoint_interval_s: float = 60.0
    max_worker_restarts: int = 3
    time_limit_s: float | None = None
    log_interval_s: float = 5.0  # compact progress line when stdout is not a terminal
    torch_threads: int = 1  # per child process


@dataclass
class Config:
    algorithm: str = "muzero"
    env: EnvConfig = field(default_factory=EnvConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    mcts: MCTSConfig = field(default_factory=MCTSConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
