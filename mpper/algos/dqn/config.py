"""DQN's config section, ``dqn``: the Q-network, acting, targets and target updates, and
:class:`DQNRunConfig`, the whole config of a DQN run with it as a typed field.

Optimizer, learning rate, batch size, gradient clipping and the rate control are the
shared ``training`` section; priorities are ``replay`` (:mod:`mpper.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import WIDTHS, AlgorithmConfig, Config, Rule, opt

__all__ = ["CONFIG", "DQNConfig", "DQNRunConfig"]


@dataclass
class DQNConfig:
    """DQN (algorithm "dqn"): the Q-network, acting, targets and target updates."""

    torso: str = opt("mlp", ("mlp", "minatar", "nature"), '"mlp": the observation flattened; "minatar": one 3x3 '
                     'conv of 16 channels (MinAtar paper); "nature": the Nature DQN CNN on pixels / 255 (Atari)')
    frame_stack: int = opt(1, "[1, 64]", "frames stacked into the network input, built at sample time from frames "
                           "stored once (the Nature DQN: 4 on Atari)")
    hidden: list = opt([64], WIDTHS, "widths of the Q-network's hidden layers (an MLP after the torso)")
    dueling: bool = opt(False, None, "dueling head: Q = V + A - mean(A)")
    n_step: int = opt(3, "[1, 1000000]", "n of the n-step return R = sum_{i<n} gamma^i r_{t+1+i} (1: one-step DQN)")
    gamma: float = opt(0.99, "(0, 1]", "discount of the n-step return and of the bootstrap")
    double: bool = opt(True, None, "double DQN: the online net picks the next action, the target net values it")
    loss: str = opt("huber", ("huber", "mse"), '"huber" (smooth L1, delta 1) or "mse" (squared TD error)')
    target_update: str = opt("hard", ("hard", "soft"), '"hard": copy every target_update_interval steps; "soft": Polyak tau each step')
    target_update_interval: int = opt(100, "[1, 1000000000]", "hard updates: training steps between target-network copies")
    tau: float = opt(0.005, "(0, 1]", "soft updates: target = tau * online + (1 - tau) * target, each step")
    grad_clip_value: float | None = opt(None, "> 0", "clamp each gradient element to [-v, v] (easy-rl's PER-DQN notebook: clamp_(-1, 1)); null: off")
    exploration: str = opt("apex", ("apex", "decay"), '"apex": a constant epsilon per actor; "decay": one exponential schedule')
    apex_epsilon: float = opt(0.4, "[0, 1]", "apex: eps_i = apex_epsilon ** (1 + i * apex_alpha / (N - 1)), actor i of N")
    apex_alpha: float = opt(7.0, ">= 0", "apex: exponent spread of the per-actor epsilons")
    epsilon_start: float = opt(1.0, "[0, 1]", "decay: epsilon at the first step")
    epsilon_end: float = opt(0.05, "[0, 1]", "decay: epsilon it decays to")
    epsilon_decay: float = opt(10_000.0, "> 0", "decay: eps = end + (start - end) * exp(-steps / decay), steps of each worker")
    priority_clip: float | None = opt(None, "> 0", "raw priorities |TD| clipped to at most this (easy-rl's notebook: abs_err_upper); null: off")
    # Offline learning (--offline): a conservative penalty on the TD loss, or no TD at all
    objective: str = opt("td", ("td", "bc"), '"td": the TD loss (with cql_alpha\'s penalty); "bc": behaviour '
                         "cloning, the cross-entropy of softmax(Q(s, .)) against the stored action (a baseline for "
                         "offline runs; no target network, priorities are each sample's cross-entropy)")
    cql_alpha: float = opt(0.0, ">= 0", "discrete CQL(H) (Kumar et al., 2020): adds cql_alpha * (logsumexp_a Q(s, a) "
                           "- Q(s, a_data)) per sample, weighted as the TD loss, to the TD loss; 0: off")


@dataclass
class DQNRunConfig(Config):
    """A DQN run's config: the shared sections and ``dqn``."""

    algorithm: str = opt("dqn", None, "the algorithm to train; its own sections are the other keys of the file")
    dqn: DQNConfig = field(default_factory=DQNConfig)


def _cql_needs_td(config: DQNRunConfig) -> str | None:
    if config.dqn.cql_alpha > 0 and config.dqn.objective != "td":
        return f'penalises the TD loss: needs dqn.objective "td", got {config.dqn.objective!r}'
    return None


def _workers_run_their_network(config: DQNRunConfig) -> str | None:
    if config.runtime.selfplay_inference == "server":
        return 'is for MuZero\'s search; DQN\'s workers run their own network: use "auto" or "worker"'
    return None


def _dqn_step_is_eager(config: DQNRunConfig) -> str | None:
    capture = config.training.capture
    return None if capture in ("auto", "off") else f'DQN trains with the eager step: expected "auto" or "off", got "{capture}"'


def _dqn_trains_in_fp32(config: DQNRunConfig) -> str | None:
    precision = config.training.precision
    return None if precision == "fp32" else f'DQN trains in float32: expected "fp32", got "{precision}"'


CONFIG = AlgorithmConfig(DQNRunConfig, rules=(
    Rule(("dqn.cql_alpha", "dqn.objective"), _cql_needs_td),
    Rule(("runtime.selfplay_inference",), _workers_run_their_network),
    Rule(("training.capture",), _dqn_step_is_eager),
    Rule(("training.precision",), _dqn_trains_in_fp32),
))  # fmt: skip
