"""Running observation normalisation inside the network (``sampled_network.normalize_observations``),
as Sample Factory and Acme normalise continuous-control observations.

The statistics (``count``, ``mean``, ``var`` per observation value) are registered buffers of
the network, float64: they are in its ``state_dict``, so the published flat weights,
checkpoints, ``best.pt`` and ``--resume`` carry them beside the parameters, and the optimizer
(which holds parameters only) never touches them. Only the learner updates them, from the root
observations of each sampled batch, before its forward pass; self-play, evaluation, reanalyse
and ``mpper.load(...).act`` normalise with the statistics as they arrived with the weights.
The buffer stores raw observations.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RunningObservationNormalizer"]


class RunningObservationNormalizer(nn.Module):
    """``(x - mean) / sqrt(var + epsilon)``, clipped to ``[-clip, clip]``, per value of a
    flattened observation of ``size`` values.

    ``update(observations)`` merges a batch's mean and (population) variance into the running
    ones with the parallel-variance rule (Chan et al.), so that after any sequence of batches
    ``mean`` and ``var`` are those of all the observations seen together. Before the first
    update (``count`` 0) the mean is 0 and the variance 1: the normaliser only clips.
    """

    count: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor

    def __init__(self, size: int, clip: float, epsilon: float = 1e-8):
        super().__init__()
        self.clip = float(clip)
        self.epsilon = float(epsilon)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(size, dtype=torch.float64))
        self.register_buffer("var", torch.ones(size, dtype=torch.float64))

    @torch.no_grad()
    def update(self, observations: torch.Tensor) -> None:
        """Fold a batch of observations (N, *observation_shape), N >= 1, into the statistics."""
        x = observations.detach().flatten(1).to(self.mean.device, torch.float64)
        n = x.shape[0]
        if n == 0:
            return
        batch_mean = x.mean(0)
        batch_var = x.var(0, unbiased=False)
        total = self.count + n
        delta = batch_mean - self.mean
        # M2 of the union: both parts' M2 and the spread between their means
        m2 = self.var * self.count + batch_var * n + delta * delta * (self.count * n / total)
        self.mean.add_(delta * (n / total))
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        """(N, *observation_shape) -> (N, size) float32, normalised and clipped."""
        x = observations.flatten(1).float()
        scale = torch.rsqrt(self.var + self.epsilon).float()
        return ((x - self.mean.float()) * scale).clamp(-self.clip, self.clip)
