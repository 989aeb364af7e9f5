"""What the MuZero-family algorithms (``muzero``, ``sampled_muzero``) share, written once:
MuZero's value transform ``h`` and its categorical support, the min-max scaling of hidden
states, the MLP of muzero-general's networks, EfficientZero's consistency loss and its
SimSiam heads, the visit-count temperature schedule, and Gumbel MuZero's Sequential
Halving schedule. A module beside the algorithms' folders, so
that neither imports the other (``tests/test_layers.py``).

Shapes: B is the batch, S the support size (``2S+1`` bins).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["EPS", "considered_visits", "consistency_loss", "h", "h_inv", "min_max_scale", "mlp", "scalar_to_support",
           "simsiam_heads", "support_to_scalar", "temperature_at"]

EPS = 0.001  # the epsilon of h(x); muzero-general and the paper use 0.001


def h(x: torch.Tensor) -> torch.Tensor:
    """``h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x``: squashes large returns so that a
    small support (e.g. [-10, 10] for S = 10) covers them. Any shape."""
    return torch.sign(x) * (torch.sqrt(torch.abs(x) + 1) - 1) + EPS * x


def h_inv(y: torch.Tensor) -> torch.Tensor:
    """Exact inverse of ``h``. Any shape.

    Solving ``|y| = sqrt(|x|+1) - 1 + eps |x|`` for ``u = sqrt(|x|+1)`` gives
    ``u = (sqrt(1 + 4 eps (|y| + 1 + eps)) - 1) / (2 eps)``. Written here as
    ``2 (|y| + 1 + eps) / (sqrt(1 + 4 eps (|y| + 1 + eps)) + 1)`` (same value, multiplied
    through by the conjugate) because the textbook form subtracts two numbers close to 1
    and loses about 4 digits in float32 for small ``|y|``.
    """
    a = torch.abs(y) + 1 + EPS
    u = 2 * a / (torch.sqrt(1 + 4 * EPS * a) + 1)
    return torch.sign(y) * (u * u - 1)


def scalar_to_support(x: torch.Tensor, support_size: int) -> torch.Tensor:
    """Scalars (B,) -> two-hot target distributions (B, 2S+1) over ``h(x)``.

    ``h(x)`` is clipped to [-S, S] and split between its two neighbouring integers in
    proportion to the distance, so the expectation of the result is exactly ``h(x)``
    (muzero-general's ``scalar_to_support``).
    """
    y = h(x.reshape(-1)).clamp(-support_size, support_size)
    floor = y.floor()
    upper = y - floor  # weight of the bin above floor
    out = torch.zeros(y.shape[0], 2 * support_size + 1, dtype=x.dtype, device=x.device)
    low = (floor + support_size).long()
    out.scatter_(1, low.unsqueeze(1), (1 - upper).unsqueeze(1))
    # At y == S the upper bin would be 2S+1 (out of range); its weight is 0 there anyway.
    high = (low + 1).clamp(max=2 * support_size)
    out.scatter_add_(1, high.unsqueeze(1), torch.where(low + 1 > 2 * support_size, 0.0, upper).unsqueeze(1))
    return out


_SUPPORT_CACHE: dict[tuple, torch.Tensor] = {}


def _support(support_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The bins ``[-S, ..., S]`` (2S+1,), cached: this runs twice per MCTS simulation."""
    key = (support_size, dtype, device)
    bins = _SUPPORT_CACHE.get(key)
    if bins is None:
        bins = torch.arange(-support_size, support_size + 1, dtype=dtype, device=device)
        _SUPPORT_CACHE[key] = bins
    return bins


def support_to_scalar(logits: torch.Tensor, support_size: int) -> torch.Tensor:
    """Logits (B, 2S+1) -> scalars (B,): expectation of the softmax over the bins,
    then ``h_inv`` (muzero-general's ``support_to_scalar``)."""
    probabilities = torch.softmax(logits, dim=1)
    y = probabilities @ _support(support_size, probabilities.dtype, probabilities.device)
    return h_inv(y)


def min_max_scale(x: torch.Tensor, start_dim: int) -> torch.Tensor:
    """Scale ``x`` to [0, 1] over the dimensions from ``start_dim`` on, separately for
    each index of the leading ones. Like muzero-general, a range below 1e-5 gets 1e-5
    added, so a constant hidden state stays finite (it becomes 0)."""
    flat = x.flatten(start_dim)
    low = flat.min(dim=-1, keepdim=True).values
    scale = flat.max(dim=-1, keepdim=True).values - low
    scale = torch.where(scale < 1e-5, scale + 1e-5, scale)
    return ((flat - low) / scale).view_as(x)


def mlp(input_size: int, hidden: list[int], output_size: int) -> nn.Sequential:
    """Linear layers with ELU between them and none after the output (muzero-general)."""
    sizes = [input_size, *hidden, output_size]
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ELU())
    return nn.Sequential(*layers)


def simsiam_heads(flat: int, size: int) -> tuple[nn.Sequential, nn.Sequential]:
    """EfficientZero's SimSiam heads for the consistency loss, on flattened hidden states
    (N, ``flat``): the projection Linear-BN-ReLU-Linear-BN-ReLU-Linear-BN to ``size`` and
    the predictor Linear-BN-ReLU-Linear through ``size // 2`` (LightZero's MLP model:
    1024, 1024 and 512). Not used by the search."""
    bottleneck = max(1, size // 2)
    projection = nn.Sequential(
        nn.Linear(flat, size), nn.BatchNorm1d(size), nn.ReLU(),
        nn.Linear(size, size), nn.BatchNorm1d(size), nn.ReLU(),
        nn.Linear(size, size), nn.BatchNorm1d(size),
    )  # fmt: skip
    predictor = nn.Sequential(nn.Linear(size, bottleneck), nn.BatchNorm1d(bottleneck), nn.ReLU(),
                              nn.Linear(bottleneck, size))  # fmt: skip
    return projection, predictor


def consistency_loss(network, hidden_states: torch.Tensor, next_observation: torch.Tensor) -> torch.Tensor:
    """EfficientZero's self-supervised consistency loss (Ye et al. 2021, SimSiam-style):
    (B, K): the negative cosine similarity between the dynamics' hidden state after k
    actions, ``hidden_states`` (B, K, *hidden), taken through the projection and the
    predictor (``network.project(x, predict=True)``), and the representation of the real
    observation k moves later, ``next_observation`` (B, K, *obs), taken through the
    projection only and under a stop-gradient (no gradient reaches the representation or
    the projection from that side). Both vectors are L2-normalised with eps 1e-5, as in
    EfficientZero and LightZero; -1 is a perfect match.
    """
    b, k = hidden_states.shape[:2]
    if k == 0:
        return hidden_states.new_zeros(b, 0)
    with torch.no_grad():
        target = network.project(network.representation(next_observation.flatten(0, 1)), predict=False)
    prediction = network.project(hidden_states.flatten(0, 1), predict=True)
    prediction = torch.nn.functional.normalize(prediction, dim=-1, eps=1e-5)
    target = torch.nn.functional.normalize(target, dim=-1, eps=1e-5)
    return -(prediction * target).sum(-1).view(b, k)


def considered_visits(max_num_considered_actions: int, num_simulations: int) -> list[int]:
    """Sequential Halving's schedule (mctx's ``get_sequence_of_considered_visits``): the
    visit count a root child must have to be visited at each of the ``num_simulations``
    simulations, with ``max_num_considered_actions`` = m actions considered at first.

    Rounds: the considered actions each get ``max(1, n // (ceil(log2 m) * considered))``
    more visits, then the number considered halves (never below 2)."""
    if max_num_considered_actions <= 1:
        return list(range(num_simulations))
    log2max = math.ceil(math.log2(max_num_considered_actions))
    sequence: list[int] = []
    visits = [0] * max_num_considered_actions
    considered = max_num_considered_actions
    while len(sequence) < num_simulations:
        extra = max(1, int(num_simulations / (log2max * considered)))
        for _ in range(extra):
            sequence.extend(visits[:considered])
            for i in range(considered):
                visits[i] += 1
        considered = max(2, considered // 2)
    return sequence[:num_simulations]


def temperature_at(schedule: list, progress: float) -> float:
    """Visit-count temperature at ``progress`` (fraction of the training steps done) for
    ``MCTSConfig.temperature_schedule`` ``[[fraction, T], ...]``: the T of the last
    entry whose fraction is <= progress (the first entry's T before it); a step function
    like muzero-general's ``visit_softmax_temperature_fn``."""
    entries = sorted((float(f), float(t)) for f, t in schedule)
    if not entries:
        raise ValueError("temperature_schedule is empty")
    temperature = entries[0][1]
    for fraction, t in entries:
        if progress >= fraction:
            temperature = t
    return temperature
