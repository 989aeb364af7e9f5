"""Sampled MuZero's network: fully connected representation, dynamics and prediction, a
policy head that is a tanh-squashed diagonal Gaussian over actions rescaled to [-1, 1]^A,
and the value transform with its categorical supports.

Why a squashed Gaussian and not factorised categorical bins: the paper's continuous-control
agents (DeepMind Control Suite, Real-World RL) use a Gaussian policy; its log-density is what
the sampled-policy correction and the paper's policy loss need, exactly, for any sampled
action; and its parameter count does not grow with a bin resolution. Bins would make the
density piecewise constant, so two samples in one bin count as one action only up to the
bin width. (Not measured against bins here.)

Actions seen by the network are the env's Box rescaled to [-1, 1] per dimension (the
player rescales them back when it steps the env); the dynamics take the action vector
through a linear encoder, concatenated with the hidden state.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..base import FlatWeights
from ..muzero_family import EPS, min_max_scale, mlp, simsiam_heads
from .config import SampledNetworkConfig
from .normalizer import RunningObservationNormalizer

__all__ = ["NetworkOutput", "SampledMuZeroNetwork", "SquashedGaussian", "make_network", "support_to_scalar_np"]

# Squashed actions are kept this far inside (-1, 1): atanh stays finite for a stored +-1.
_EDGE = 1e-6


def support_to_scalar_np(logits: np.ndarray, support_size: int) -> np.ndarray:
    """``support_to_scalar`` in float64 numpy (the search's arithmetic): logits (N, 2S+1) -> (N,)."""
    logits = np.asarray(logits, np.float64)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    y = (weights * np.arange(-support_size, support_size + 1)).sum(1) / weights.sum(1)
    a = np.abs(y) + 1 + EPS
    u = 2 * a / (np.sqrt(1 + 4 * EPS * a) + 1)
    return np.sign(y) * (u * u - 1)


class NetworkOutput(NamedTuple):
    value_logits: torch.Tensor  # (N, 2S+1)
    reward_logits: torch.Tensor  # (N, 2S+1): zeros from the initial inference
    policy_logits: torch.Tensor  # (N, 2A): the Gaussian's mean and log standard deviation (before tanh)
    hidden_state: torch.Tensor  # (N, encoding_size), min-max scaled to [0, 1]


class SquashedGaussian:
    """The policy: ``a = tanh(u)``, ``u ~ Normal(mean, std^2)`` per dimension, with ``mean``
    and ``log std`` the two halves of the policy head's (N, 2A) output. Densities are of
    ``a`` in [-1, 1]^A (the tanh Jacobian included)."""

    def __init__(self, action_dim: int):
        self.action_dim = action_dim

    def split(self, params):
        """(N, 2A) -> mean (N, A), log std (N, A) (torch or numpy)."""
        return params[..., : self.action_dim], params[..., self.action_dim :]

    def sample(self, params: np.ndarray, count: int, rng: np.random.Generator, temperature: float = 1.0):
        """``count`` actions per row from beta = pi^(1/temperature) (the standard deviation
        times sqrt(temperature) before tanh): (actions (N, count, A) float64 in (-1, 1),
        log beta (N, count) of each, a density of ``a`` as :meth:`log_prob_np`'s: the tanh
        Jacobian is in both and cancels in pi / beta)."""
        mean, log_std = self.split(np.asarray(params, np.float64))
        std = np.exp(log_std) * math.sqrt(temperature)
        noise = rng.standard_normal((mean.shape[0], count, self.action_dim))
        u = mean[:, None] + std[:, None] * noise
        log_beta = (-0.5 * noise**2 - np.log(std)[:, None] - 0.5 * math.log(2 * math.pi)).sum(-1)
        actions = np.clip(np.tanh(u), -1 + _EDGE, 1 - _EDGE)
        return actions, log_beta - _log_jacobian_np(actions)

    def log_prob_np(self, params: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """log pi(a) (N, M) of actions (N, M, A) in (-1, 1), float64."""
        mean, log_std = self.split(np.asarray(params, np.float64))
        a = np.clip(np.asarray(actions, np.float64), -1 + _EDGE, 1 - _EDGE)
        z = (np.arctanh(a) - mean[:, None]) / np.exp(log_std)[:, None]
        log_u = (-0.5 * z**2 - log_std[:, None] - 0.5 * math.log(2 * math.pi)).sum(-1)
        return log_u - _log_jacobian_np(a)

    def log_prob(self, params: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """log pi(a) (..., M) of actions (..., M, A) in [-1, 1] for params (..., 2A), torch."""
        mean, log_std = self.split(params)
        a = actions.clamp(-1 + _EDGE, 1 - _EDGE)
        z = (torch.atanh(a) - mean.unsqueeze(-2)) / torch.exp(log_std).unsqueeze(-2)
        log_u = (-0.5 * z**2 - log_std.unsqueeze(-2) - 0.5 * math.log(2 * math.pi)).sum(-1)
        return log_u - torch.log1p(-a * a).sum(-1)

    def mode(self, params: np.ndarray) -> np.ndarray:
        """tanh(mean) (N, A): the density's centre, the action without a search."""
        return np.tanh(self.split(np.asarray(params, np.float64))[0])


def _log_jacobian_np(actions: np.ndarray) -> np.ndarray:
    """log |d tanh(u) / du| summed over the action's dimensions, at a = tanh(u)."""
    return np.log1p(-actions * actions).sum(-1)


class SampledMuZeroNetwork(FlatWeights, nn.Module):
    """Representation h(o), dynamics g(s, a) -> (s', r), prediction f(s) -> (v, policy
    params), all MLPs over flat inputs. ``action_dim``: A of the env's Box. With
    ``normalize_observations``, ``observation_normalizer`` (running statistics, buffers) sits in
    front of the representation; the learner updates it (:meth:`update_observation_statistics`)."""

    def __init__(self, observation_shape: tuple[int, ...], action_dim: int, config: SampledNetworkConfig):
        super().__init__()
        self.observation_shape = tuple(observation_shape)
        self.action_dim = action_dim
        self.support_size = config.support_size
        self.min_log_std, self.max_log_std = config.min_log_std, config.max_log_std
        self.policy = SquashedGaussian(action_dim)
        width = 2 * config.support_size + 1
        size = config.encoding_size
        # running observation statistics (buffers, not parameters) in front of the representation
        self.observation_normalizer = (RunningObservationNormalizer(math.prod(observation_shape), config.observation_clip)
                                       if config.normalize_observations else None)  # fmt: skip
        self.representation_net = mlp(math.prod(observation_shape), config.hidden, size)
        self.action_encoder = nn.Linear(action_dim, config.action_encoding_size)
        self.dynamics_net = mlp(size + config.action_encoding_size, config.hidden, size)
        self.reward_net = mlp(size, config.hidden, width)
        self.value_net = mlp(size, config.hidden, width)
        self.policy_net = mlp(size, config.hidden, 2 * action_dim)
        # EfficientZero's consistency loss compares hidden states through these (not the search)
        self.projection: nn.Module | None = None
        self.projection_predictor: nn.Module | None = None
        if config.projection_size > 0:
            self.projection, self.projection_predictor = simsiam_heads(size, config.projection_size)

    def representation(self, observation: torch.Tensor) -> torch.Tensor:
        """Observations (N, *observation_shape), raw (normalised here when
        ``sampled_network.normalize_observations``) -> hidden states (N, encoding_size)."""
        x = observation.flatten(1).float()
        if self.observation_normalizer is not None:
            x = self.observation_normalizer(x)
        return min_max_scale(self.representation_net(x), 1)

    def update_observation_statistics(self, observations: torch.Tensor) -> None:
        """Fold a batch of raw observations (N, *observation_shape) into the normaliser's
        statistics (the learner's, before its forward pass); nothing without normalisation."""
        if self.observation_normalizer is not None:
            self.observation_normalizer.update(observations)

    def dynamics(self, hidden_state: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, size), actions (N, A) in [-1, 1] -> (next hidden state, reward logits)."""
        x = torch.cat([hidden_state, self.action_encoder(action.float())], 1)
        next_state = min_max_scale(self.dynamics_net(x), 1)
        return next_state, self.reward_net(next_state)

    def prediction(self, hidden_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (value logits (N, 2S+1), policy params (N, 2A): mean, log std softly bounded to
        [min_log_std, max_log_std])."""
        raw = self.policy_net(hidden_state)
        mean, log_std = raw[:, : self.action_dim], raw[:, self.action_dim :]
        # soft bounds (the log std never runs off) that leave it near the raw output inside:
        # an untrained head starts near std 1 before tanh, samples spread over the whole Box
        log_std = self.max_log_std - F.softplus(self.max_log_std - log_std)
        log_std = self.min_log_std + F.softplus(log_std - self.min_log_std)
        return self.value_net(hidden_state), torch.cat([mean, log_std], 1)

    def project(self, hidden_state: torch.Tensor, predict: bool) -> torch.Tensor:
        """Hidden states (N, encoding_size) -> (N, projection_size): through the projection,
        then the predictor when ``predict`` (the dynamics' side of the consistency loss)."""
        if self.projection is None or self.projection_predictor is None:
            raise RuntimeError("this network has no projection heads (sampled_network.projection_size is 0)")
        z = self.projection(hidden_state)
        return self.projection_predictor(z) if predict else z

    def initial_inference(self, observation: torch.Tensor) -> NetworkOutput:
        hidden = self.representation(observation)
        value, policy = self.prediction(hidden)
        return NetworkOutput(value, torch.zeros_like(value), policy, hidden)

    def recurrent_inference(self, hidden_state: torch.Tensor, action: torch.Tensor) -> NetworkOutput:
        next_state, reward = self.dynamics(hidden_state, action)
        value, policy = self.prediction(next_state)
        return NetworkOutput(value, reward, policy, next_state)


def make_network(config: SampledNetworkConfig, observation_shape: tuple[int, ...], action_dim: int):
    """The network of ``config`` for observations of ``observation_shape`` and A = ``action_dim``."""
    return SampledMuZeroNetwork(observation_shape, action_dim, config)
