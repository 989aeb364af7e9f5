"""A Sampled MuZero network judged on stored data (``--evaluate RUN --on-snapshot DIR``)."""

from __future__ import annotations

import numpy as np
import torch

from ..base import SnapshotRun
from ..muzero_family import support_to_scalar
from .config import SampledMuZeroRunConfig
from .networks import make_network
from .targets import SampledTargets
from .trainer import sampled_policy_loss

__all__ = ["evaluate_sampled"]


def evaluate_sampled(run: SnapshotRun[SampledMuZeroRunConfig]) -> dict:
    """At the stored positions (unroll step 0 only): the mean value error ``|v - z|``
    against the n-step value target (return units) and the mean policy cross-entropy
    ``-sum_k n_k / N log pi(a_k)`` over the stored sampled root actions (nats)."""
    cfg = run.config
    network = run.load_weights(make_network(cfg.sampled_network, run.spec.observation_shape, run.spec.num_actions))
    targets = SampledTargets(0, cfg.sampled_muzero.td_steps, cfg.sampled_mcts.discount)
    rng = np.random.default_rng(0)
    value_error = cross_entropy = 0.0
    count = 0
    with torch.no_grad():
        for p in run.positions.batches(run.batch_size):
            d = targets.build(run.buffer.fields, p.slots, p.pos, p.moves, p.terminated, rng)
            out = network.initial_inference(torch.from_numpy(d["observation"]))
            value = support_to_scalar(out.value_logits, cfg.sampled_network.support_size).numpy()
            value_error += float(np.abs(value - d["target_value"][:, 0]).sum())
            loss = sampled_policy_loss(network, out.policy_logits, torch.from_numpy(d["target_actions"][:, 0]),
                                       torch.from_numpy(d["target_policy"][:, 0]))  # fmt: skip
            cross_entropy += float(loss.sum())
            count += len(p.slots)
            run.advance(len(p.slots))
    n = max(count, 1)
    return {"table": [{"positions": count, "value_error": value_error / n, "policy_cross_entropy": cross_entropy / n}]}
