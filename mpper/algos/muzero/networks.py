"""MuZero networks: value/reward supports, the fully connected and the residual model.

Read top-down:

1. ``h`` / ``h_inv`` and the categorical supports (``scalar_to_support``,
   ``support_to_scalar``): values and rewards are predicted as a distribution over the
   integers ``[-S, S]`` of the transformed scalar ``h(x)`` (MuZero paper, appendix F;
   Pohlen et al. 2018), exactly as muzero-general does.
2. ``MuZeroNetwork``: the common interface (``initial_inference``,
   ``recurrent_inference``, the training unroll ``unroll``, flat weights for the
   shared-memory weight store).
3. ``FullyConnectedNetwork`` (``kind="fc"``, CartPole) and ``ResidualNetwork``
   (``kind="residual"``, board games), each built from representation, dynamics
   (+ reward) and prediction functions as in muzero-general's ``models.py``.
4. ``make_network``: from a ``NetworkConfig``, the observation shape, the number of
   actions, the number of stacked past observations and, for EfficientZero's value
   prefix, the LSTM's horizon.

The value prefix (EfficientZero, Ye et al. 2021, section 4.2; ``muzero.value_prefix``):
the dynamics' reward head becomes an LSTM cell over the unroll, fed the same features the
reward head reads, whose output goes through the head's MLP to the support of the sum of
the rewards since the last reset. Its state (h, c) starts at zero at the root and again
after every ``lstm_horizon_len`` dynamics steps, in the training unroll and in the search
(``tree.py`` turns prefixes back into rewards). ``recurrent_inference`` then takes the
parent's LSTM state and returns a ``PrefixOutput``: the four fields of a
``NetworkOutput`` (the reward logits the prefix's), then the new LSTM state.

Shapes: B is the batch, S the support size (``2S+1`` bins), A the number of actions.
Hidden states are min-max scaled to [0, 1] per sample (per sample and channel for the
residual network, as muzero-general), so the dynamics always sees inputs of the same
scale as the representation produced.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import numpy as np
import torch
from torch import nn

from ..base import FlatWeights
from ..muzero_family import EPS, h, h_inv, min_max_scale, mlp, scalar_to_support, simsiam_heads, support_to_scalar
from .config import MuZeroConfig, NetworkConfig

__all__ = [
    "EPS",
    "FlatWeights",
    "FullyConnectedNetwork",
    "MuZeroNetwork",
    "NetworkOutput",
    "PrefixOutput",
    "ResidualNetwork",
    "h",
    "h_inv",
    "lstm_horizon",
    "make_network",
    "scalar_to_support",
    "scale_gradient",
    "stacked_shape",
    "support_to_scalar",
    "Unrolled",
]



# --------------------------------------------------------------------------------------
# 1. Value transform and categorical supports
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# 2. The interface
# --------------------------------------------------------------------------------------


def scale_gradient(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Same value as ``x``, gradient multiplied by ``scale`` (the MuZero pseudocode's
    ``scale_gradient``). ``scale`` may be a tensor that broadcasts against ``x``."""
    return x * scale + x.detach() * (1 - scale)


class Unrolled(NamedTuple):
    """Predictions along a training unroll of K steps from B observations."""

    value_logits: torch.Tensor  # (B, K+1, 2S+1): step 0 from the observation, then after each action
    reward_logits: torch.Tensor  # (B, K, 2S+1): the reward of each of the K actions
    policy_logits: torch.Tensor  # (B, K+1, A)
    hidden_states: torch.Tensor  # (B, K+1, *hidden_shape): min-max scaled, step 0 the representation's


class NetworkOutput(NamedTuple):
    value_logits: torch.Tensor  # (B, 2S+1)
    reward_logits: torch.Tensor  # (B, 2S+1)
    policy_logits: torch.Tensor  # (B, A)
    hidden_state: torch.Tensor  # (B, *hidden_shape), min-max scaled to [0, 1]


class PrefixOutput(NamedTuple):
    """What a network with a value prefix returns: ``NetworkOutput``'s fields, then its LSTM state."""

    value_logits: torch.Tensor  # (B, 2S+1)
    reward_logits: torch.Tensor  # (B, 2S+1): the value prefix (0 from the initial inference)
    policy_logits: torch.Tensor  # (B, A)
    hidden_state: torch.Tensor  # (B, *hidden_shape), min-max scaled to [0, 1]
    reward_state: torch.Tensor  # (B, 2, lstm_hidden_size): the LSTM's (h, c) after this step (zeros at the root)


class MuZeroNetwork(FlatWeights, nn.Module):
    """Base class: representation ``h``, dynamics ``g`` (+ reward), prediction ``f``.

    Subclasses implement ``representation(obs) -> hidden``, ``dynamics(hidden, action)
    -> (next_hidden, reward_logits)`` and ``prediction(hidden) -> (policy_logits,
    value_logits)``; the hidden states they return are already min-max scaled.
    """

    # set by every subclass
    hidden_shape: tuple[int, ...]  # one hidden state's shape, without the batch dimension
    dynamics_reward_network: nn.Module  # the reward head, or with a value prefix the MLP after the LSTM
    # With a value prefix (``lstm_horizon_len`` not None): the LSTM cell on the reward head's
    # features (subclasses' ``_reward_features``).
    lstm_horizon_len: int | None
    dynamics_reward_lstm: nn.LSTMCell | None
    prediction_value_network: nn.Module
    prediction_policy_network: nn.Module

    def __init__(self, observation_shape: tuple[int, ...], num_actions: int, support_size: int):
        super().__init__()
        self.observation_shape = tuple(observation_shape)  # network input, stacking included
        self.num_actions = num_actions
        self.support_size = support_size
        self.full_support_size = 2 * support_size + 1
        # Logits of the "support of 0" for the initial inference's reward: 0 on the middle
        # bin, -1e9 elsewhere. Finite (not log(0) = -inf as in muzero-general) so that a
        # cross-entropy against it is 0 * -1e9 = 0, never 0 * -inf = NaN; softmax is
        # still exactly one-hot in float32. Not a buffer: not part of the weights.
        zero = torch.full((1, self.full_support_size), -1e9)
        zero[0, support_size] = 0.0
        self._zero_reward_logits = zero
        self.projection: nn.Module | None = None
        self.projection_predictor: nn.Module | None = None
        self.lstm_horizon_len = None
        self.dynamics_reward_lstm = None

    def add_projection(self, size: int) -> None:
        """EfficientZero's SimSiam heads for the consistency loss (``simsiam_heads``) on
        flattened hidden states (B, prod(hidden_shape))."""
        self.projection, self.projection_predictor = simsiam_heads(int(np.prod(self.hidden_shape)), size)

    def zero_init_heads(self) -> None:
        """Zero the last Linear layer (weight and bias) of the value, reward and policy
        heads (LightZero's ``last_linear_layer_init_zero``): a new network then predicts
        value 0, reward 0 and a uniform prior everywhere, so that its first searches
        favour no action. With random heads, some initial networks give one of a CartPole
        root's two children the higher value in nearly every state, and self-play with them
        pushes the cart one way (``bench/cartpole_first_play.py``)."""
        for head in (self.prediction_value_network, self.dynamics_reward_network, self.prediction_policy_network):
            last = [m for m in head.modules() if isinstance(m, nn.Linear)][-1]
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)

    def add_value_prefix(self, lstm_horizon_len: int, lstm_hidden_size: int, features: int, hidden: list[int]) -> None:
        """Replace the reward head by the value prefix's: an LSTM cell on the ``features``
        the subclass's ``_reward_features`` gives, then an MLP of widths ``hidden`` to the
        support (EfficientZero's ``lstm`` and ``fc`` after it)."""
        self.lstm_horizon_len = lstm_horizon_len
        self.dynamics_reward_lstm = nn.LSTMCell(features, lstm_hidden_size)
        self.dynamics_reward_network = mlp(lstm_hidden_size, hidden, self.full_support_size)

    def zero_reward_state(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        """The LSTM state at a reset: zeros (batch, 2, lstm_hidden_size) of ``like``'s dtype and device."""
        assert self.dynamics_reward_lstm is not None
        return like.new_zeros(batch, 2, self.dynamics_reward_lstm.hidden_size)

    def _lstm_step(self, features: torch.Tensor, reward_state: torch.Tensor) -> torch.Tensor:
        """One LSTM step: features (B, F), state (B, 2, H) -> the new state (B, 2, H)."""
        assert self.dynamics_reward_lstm is not None
        h, c = self.dynamics_reward_lstm(features, (reward_state[:, 0], reward_state[:, 1]))
        return torch.stack([h, c], 1)

    def value_prefix_unroll(self, features: torch.Tensor) -> torch.Tensor:
        """The value-prefix logits (B, K, 2S+1) of K dynamics steps from a root, given each
        step's reward features (B, K, F): the LSTM state starts at zero and is reset to
        zero after steps ``lstm_horizon_len``, ``2 lstm_horizon_len``, ...; the head's MLP
        runs once on all K outputs."""
        assert self.lstm_horizon_len is not None
        batch, k_steps = features.shape[:2]
        state = self.zero_reward_state(batch, features)
        outputs = []
        for k in range(k_steps):
            state = self._lstm_step(features[:, k], state)
            outputs.append(state[:, 0])
            if (k + 1) % self.lstm_horizon_len == 0:
                state = torch.zeros_like(state)
        return self.dynamics_reward_network(torch.stack(outputs, 1))

    def project(self, hidden_state: torch.Tensor, predict: bool) -> torch.Tensor:
        """Hidden states (N, *hidden_shape) -> (N, projection size): through the
        projection, then the predictor when ``predict`` (the dynamics' side of the
        consistency loss; the representation's side, the target, stops there)."""
        if self.projection is None or self.projection_predictor is None:
            raise RuntimeError("this network has no projection heads (network.projection_size is 0)")
        z = self.projection(hidden_state.flatten(1))
        return self.projection_predictor(z) if predict else z

    # Subclass hooks -------------------------------------------------------------------
    def representation(self, observation: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _next_state(self, hidden_state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """The dynamics' next hidden state (B, *hidden_shape), before min-max scaling."""
        raise NotImplementedError

    def _scale(self, next_state: torch.Tensor) -> torch.Tensor:
        """``_next_state``'s output min-max scaled as hidden states are."""
        raise NotImplementedError

    def _reward_features(self, next_state: torch.Tensor) -> torch.Tensor:
        """With a value prefix: the LSTM's input (B, F) from the unscaled next state."""
        raise NotImplementedError

    def dynamics(self, hidden_state: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def prediction(self, hidden_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    # Inference ------------------------------------------------------------------------
    def initial_inference(self, observation: torch.Tensor) -> NetworkOutput | PrefixOutput:
        """Observations (B, *observation_shape) float32 -> NetworkOutput (PrefixOutput with
        a value prefix, its LSTM state zeros); the reward is the support of 0 (nothing was
        received before the first observation)."""
        hidden_state = self.representation(observation)
        policy_logits, value_logits = self.prediction(hidden_state)
        zero = self._zero_reward_logits
        if zero.device != observation.device or zero.dtype != value_logits.dtype:
            zero = self._zero_reward_logits = zero.to(observation.device, value_logits.dtype)
        reward_logits = zero.expand(observation.shape[0], -1)
        if self.lstm_horizon_len is None:
            return NetworkOutput(value_logits, reward_logits, policy_logits, hidden_state)
        reward_state = self.zero_reward_state(observation.shape[0], value_logits)
        return PrefixOutput(value_logits, reward_logits, policy_logits, hidden_state, reward_state)

    def recurrent_inference(self, hidden_state: torch.Tensor, action: torch.Tensor,
                            reward_state: torch.Tensor | None = None) -> NetworkOutput | PrefixOutput:  # fmt: skip
        """Hidden states (B, *hidden_shape) and actions LongTensor (B,) -> NetworkOutput
        for the next hidden state, with the reward of taking ``action``.

        With a value prefix: ``reward_state`` (B, 2, lstm_hidden_size) is the parent's LSTM
        state (None: zeros, a reset; the caller resets it every ``lstm_horizon_len``
        steps); a PrefixOutput, whose reward logits are the value prefix's and which carries
        the new LSTM state. Without one, ``reward_state`` is ignored."""
        if self.lstm_horizon_len is None:
            next_hidden, reward_logits = self.dynamics(hidden_state, action)
            policy_logits, value_logits = self.prediction(next_hidden)
            return NetworkOutput(value_logits, reward_logits, policy_logits, next_hidden)
        next_state = self._next_state(hidden_state, action)
        if reward_state is None:
            reward_state = self.zero_reward_state(next_state.shape[0], next_state)
        reward_state = self._lstm_step(self._reward_features(next_state), reward_state)
        next_hidden = self._scale(next_state)
        policy_logits, value_logits = self.prediction(next_hidden)
        reward_logits = self.dynamics_reward_network(reward_state[:, 0])
        return PrefixOutput(value_logits, reward_logits, policy_logits, next_hidden, reward_state)

    def unroll(self, observation: torch.Tensor, actions: torch.Tensor, between_steps: float = 0.5) -> Unrolled:
        """The training unroll: the initial inference on ``observation`` (B, *obs), then K
        recurrent inferences on ``actions`` (B, K) int64. The hidden state a dynamics
        step returns reaches the next step through ``scale_gradient(h, between_steps)``
        (the MuZero pseudocode's 0.5), step 1 starts from the representation unscaled.

        With a value prefix the reward logits are the value prefix's, the LSTM state
        carried from step to step and reset to zero after every ``lstm_horizon_len`` steps.

        This is the reference form, one ``recurrent_inference`` per step; a subclass may
        batch the work differently for the same values and gradients."""
        out = self.initial_inference(observation)
        values, rewards, policies = [out.value_logits], [], [out.policy_logits]
        hidden = out.hidden_state
        hiddens = [hidden]
        reward_state = None  # zeros
        for k in range(actions.shape[1]):
            out = self.recurrent_inference(hidden if k == 0 else scale_gradient(hidden, between_steps), actions[:, k],
                                           reward_state)  # fmt: skip
            reward_state = None  # zeros: no value prefix, or a reset after this step
            if isinstance(out, PrefixOutput) and (k + 1) % cast(int, self.lstm_horizon_len) != 0:
                reward_state = out.reward_state
            hidden = out.hidden_state
            hiddens.append(hidden)
            values.append(out.value_logits)
            rewards.append(out.reward_logits)
            policies.append(out.policy_logits)
        reward_logits = torch.stack(rewards, 1) if rewards else values[0].new_empty(actions.shape[0], 0, values[0].shape[1])
        return Unrolled(torch.stack(values, 1), reward_logits, torch.stack(policies, 1), torch.stack(hiddens, 1))


# --------------------------------------------------------------------------------------
# 3. The two architectures
# --------------------------------------------------------------------------------------


class FullyConnectedNetwork(MuZeroNetwork):
    """muzero-general's ``MuZeroFullyConnectedNetwork``: five MLPs.

    Observation (B, *observation_shape) is flattened; hidden state (B, encoding_size);
    the dynamics input is the hidden state with the action one-hot concatenated,
    (B, encoding_size + A).
    """

    def __init__(self, observation_shape, num_actions: int, support_size: int, encoding_size: int, hidden: list[int],
                 lstm_horizon_len: int | None = None, lstm_hidden_size: int = 64):  # fmt: skip
        super().__init__(observation_shape, num_actions, support_size)
        self.encoding_size = encoding_size
        self.hidden_shape = (encoding_size,)
        obs_size = int(np.prod(observation_shape))
        self.representation_network = mlp(obs_size, hidden, encoding_size)
        self.dynamics_state_network = mlp(encoding_size + num_actions, hidden, encoding_size)
        self.dynamics_reward_network = mlp(encoding_size, hidden, self.full_support_size)
        self.prediction_policy_network = mlp(encoding_size, hidden, num_actions)
        self.prediction_value_network = mlp(encoding_size, hidden, self.full_support_size)
        if lstm_horizon_len is not None:
            self.add_value_prefix(lstm_horizon_len, lstm_hidden_size, encoding_size, hidden)

    def representation(self, observation):
        return min_max_scale(self.representation_network(observation.flatten(1)), 1)

    def _next_state(self, hidden_state, action):
        return self._dynamics_first_layer(hidden_state, self._action_terms(action.reshape(-1)))

    def _scale(self, next_state):
        return min_max_scale(next_state, 1)

    def _reward_features(self, next_state):
        return next_state  # the unscaled state, as the reward head's

    def _dynamics_first_layer(self, hidden_state: torch.Tensor, action_term: torch.Tensor) -> torch.Tensor:
        """The dynamics' state MLP on ``[hidden_state, one_hot(action)]`` (B, E + A), given
        the action half of its first layer, ``action_term`` (B, H1) from
        ``_action_terms``: ``Linear([h, one_hot(a)]) = h @ W_h^T + (W_a[:, a] + b)``, one
        matmul and no one-hot tensor, concatenation or scatter (per-op overhead is most of
        the time of these 16-unit layers)."""
        first = cast(nn.Linear, self.dynamics_state_network[0])
        x = torch.addmm(action_term, hidden_state, first.weight[:, : self.encoding_size].t())
        return self.dynamics_state_network[1:](x)

    def _action_terms(self, action: torch.Tensor) -> torch.Tensor:
        """``W_a[:, a] + b`` of the dynamics' first layer for actions of any shape: (..., H1)."""
        first = cast(nn.Linear, self.dynamics_state_network[0])
        return nn.functional.embedding(action, first.weight[:, self.encoding_size :].t()) + first.bias

    def dynamics(self, hidden_state, action):
        next_hidden = self._dynamics_first_layer(hidden_state, self._action_terms(action.reshape(-1)))
        reward_logits = self.dynamics_reward_network(next_hidden)  # from the unscaled state, as muzero-general
        return min_max_scale(next_hidden, 1), reward_logits

    def prediction(self, hidden_state):
        return self.prediction_policy_network(hidden_state), self.prediction_value_network(hidden_state)

    def unroll(self, observation, actions, between_steps=0.5):
        """``MuZeroNetwork.unroll``, batched: only the dynamics' state MLP runs step by
        step (each step needs the one before); the reward MLP runs once on all K
        states, prediction once on all K + 1, and the action half of the dynamics'
        first layer once for all K actions. With CartPole's 16-unit MLPs the time of a
        training step is almost all per-op overhead, and this calls about a quarter of
        the ops of K ``recurrent_inference`` calls, for the same values and gradients
        (no BatchNorm here: batching steps together changes no statistic)."""
        batch, k_steps = actions.shape
        action_terms = self._action_terms(actions)  # (B, K, H1): every step's at once
        hidden = min_max_scale(self.representation_network(observation.flatten(1)), 1)
        states, unscaled = [hidden], []
        for k in range(k_steps):
            x = hidden if k == 0 else scale_gradient(hidden, between_steps)
            nxt = self._dynamics_first_layer(x, action_terms[:, k])
            unscaled.append(nxt)
            hidden = min_max_scale(nxt, 1)
            states.append(hidden)
        if k_steps == 0:
            reward_logits = hidden.new_empty(batch, 0, self.full_support_size)
        elif self.lstm_horizon_len is not None:
            reward_logits = self.value_prefix_unroll(torch.stack(unscaled, 1))
        else:
            reward_logits = self.dynamics_reward_network(torch.stack(unscaled, 1))  # from the unscaled states
        hidden_states = torch.stack(states, 1)
        policy_logits, value_logits = self.prediction(hidden_states)
        return Unrolled(value_logits, reward_logits, policy_logits, hidden_states)


def conv3x3(in_channels: int, out_channels: int) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN, plus the input, ReLU (AlphaZero's block)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = conv3x3(channels, channels)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = conv3x3(channels, channels)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + x)


def conv_stem(in_channels: int, channels: int, blocks: int) -> nn.Sequential:
    """conv3x3-BN-ReLU to ``channels``, then ``blocks`` residual blocks."""
    return nn.Sequential(
        conv3x3(in_channels, channels),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        *[ResidualBlock(channels) for _ in range(blocks)],
    )


def downsample_stem(in_channels: int, channels: int) -> nn.Sequential:
    """The MuZero paper's Atari downsampling (appendix "Network Architecture";
    muzero-general's ``DownSample``, its ``downsample: "resnet"``): a stride-2 conv to
    C / 2 planes, 2 residual blocks, a stride-2 conv to C, 3 blocks, average pooling
    (stride 2), 3 blocks, average pooling (stride 2): (B, C_in, H, W) -> (B, C,
    ceil(H / 16), ceil(W / 16)), 96 x 96 -> 6 x 6."""
    half = channels // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, half, 3, stride=2, padding=1, bias=False),
        *[ResidualBlock(half) for _ in range(2)],
        nn.Conv2d(half, channels, 3, stride=2, padding=1, bias=False),
        *[ResidualBlock(channels) for _ in range(3)],
        nn.AvgPool2d(3, stride=2, padding=1),
        *[ResidualBlock(channels) for _ in range(3)],
        nn.AvgPool2d(3, stride=2, padding=1),
    )


class ResidualNetwork(MuZeroNetwork):
    """muzero-general's ``MuZeroResidualNetwork``.

    Observation (B, C_in, H, W); hidden state (B, C, H, W) with C = encoding_size, scaled
    per sample and channel. With ``downsample`` (Atari), the representation first
    shrinks the observation with :func:`downsample_stem` and the hidden state is
    (B, C, ceil(H / 16), ceil(W / 16)); then ``blocks`` residual blocks. The dynamics sees the hidden state with one extra plane
    filled with ``action / A`` (muzero-general's action encoding for board games), and
    its conv maps the C + 1 planes back to C. Reward, value and policy heads: a 1x1
    conv to ``reduced_channels`` planes, flattened, then an MLP with widths ``hidden``.
    """

    def __init__(
        self, observation_shape, num_actions: int, support_size: int, encoding_size: int,
        hidden: list[int], blocks: int, reduced_channels: int, downsample: bool = False,
        lstm_horizon_len: int | None = None, lstm_hidden_size: int = 64,
    ):  # fmt: skip
        super().__init__(observation_shape, num_actions, support_size)
        if len(observation_shape) != 3:
            raise ValueError(f"the residual network needs (C, H, W) observations, got shape {tuple(observation_shape)}")
        in_channels, height, width = observation_shape
        c = encoding_size
        if downsample:
            # muzero-general: the downsampling, then num_blocks blocks (no stem conv)
            self.representation_network = nn.Sequential(downsample_stem(in_channels, c),
                                                         *[ResidualBlock(c) for _ in range(blocks)])  # fmt: skip
            height, width = -(-height // 16), -(-width // 16)
        else:
            self.representation_network = conv_stem(in_channels, c, blocks)
        self.hidden_shape = (c, height, width)
        head_size = reduced_channels * height * width
        self.dynamics_state_network = conv_stem(c + 1, c, blocks)
        self.dynamics_reward_network = nn.Sequential(nn.Conv2d(c, reduced_channels, 1), nn.Flatten(), mlp(head_size, hidden, self.full_support_size))  # fmt: skip
        self.prediction_trunk = nn.Sequential(*[ResidualBlock(c) for _ in range(blocks)])
        self.prediction_value_network = nn.Sequential(nn.Conv2d(c, reduced_channels, 1), nn.Flatten(), mlp(head_size, hidden, self.full_support_size))  # fmt: skip
        self.prediction_policy_network = nn.Sequential(nn.Conv2d(c, reduced_channels, 1), nn.Flatten(), mlp(head_size, hidden, num_actions))  # fmt: skip
        if lstm_horizon_len is not None:
            # the reward head's 1x1 conv feeds the LSTM; its MLP follows the LSTM
            self.dynamics_reward_encoder = nn.Sequential(nn.Conv2d(c, reduced_channels, 1), nn.Flatten())
            self.add_value_prefix(lstm_horizon_len, lstm_hidden_size, head_size, hidden)

    def representation(self, observation):
        return min_max_scale(self.representation_network(observation), 2)

    def dynamics(self, hidden_state, action):
        next_hidden = self._next_state(hidden_state, action)
        reward_logits = self.dynamics_reward_network(next_hidden)
        return min_max_scale(next_hidden, 2), reward_logits

    def _next_state(self, hidden_state, action):
        b, _, height, width = hidden_state.shape
        plane = (action.to(hidden_state.dtype) / self.num_actions).view(b, 1, 1, 1).expand(b, 1, height, width)
        return self.dynamics_state_network(torch.cat([hidden_state, plane], dim=1))

    def _scale(self, next_state):
        return min_max_scale(next_state, 2)

    def _reward_features(self, next_state):
        return self.dynamics_reward_encoder(next_state)

    def prediction(self, hidden_state):
        x = self.prediction_trunk(hidden_state)
        return self.prediction_policy_network(x), self.prediction_value_network(x)


# --------------------------------------------------------------------------------------
# 4. Construction
# --------------------------------------------------------------------------------------


def stacked_shape(observation_shape: tuple[int, ...], stacked_observations: int) -> tuple[int, ...]:
    """Network input shape when ``stacked_observations`` past observations are stacked
    as ``mpper.algos.muzero.targets.stacked_observations`` lays them out: for (C, ...) it is
    (C + n * (C + 1), ...): the current observation, then per past step its
    observation and one action plane. A (C,) vector observation counts as C channels."""
    channels, *rest = observation_shape
    return (channels + stacked_observations * (channels + 1), *rest)


def make_network(
    config: NetworkConfig, observation_shape: tuple[int, ...], num_actions: int, stacked_observations: int = 0,
    lstm_horizon_len: int | None = None,
) -> MuZeroNetwork:
    """Build the network that ``config.kind`` names, for raw observations of shape
    ``observation_shape`` (one env step, before stacking); with ``lstm_horizon_len``, with
    the value prefix of ``network.lstm_hidden_size`` (see the module docstring)."""
    input_shape = stacked_shape(tuple(observation_shape), stacked_observations)
    network: MuZeroNetwork
    if config.kind == "fc":
        network = FullyConnectedNetwork(input_shape, num_actions, config.support_size, config.encoding_size,
                                        list(config.hidden), lstm_horizon_len, config.lstm_hidden_size)  # fmt: skip
    elif config.kind == "residual":
        network = ResidualNetwork(
            input_shape, num_actions, config.support_size, config.encoding_size, list(config.hidden),
            config.blocks, config.reduced_channels, config.downsample, lstm_horizon_len, config.lstm_hidden_size,
        )  # fmt: skip
    else:
        raise ValueError(f'network.kind must be "fc" or "residual", got {config.kind!r}')
    if config.zero_init_heads:
        network.zero_init_heads()
    if config.projection_size > 0:
        network.add_projection(config.projection_size)
    return network


def lstm_horizon(muzero_config: MuZeroConfig) -> int | None:
    """The value prefix's horizon a run's network is built with (``make_network``'s
    ``lstm_horizon_len``): ``muzero.lstm_horizon_len`` with ``muzero.value_prefix``, else None."""
    return muzero_config.lstm_horizon_len if muzero_config.value_prefix else None
