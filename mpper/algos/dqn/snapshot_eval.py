"""A DQN network judged on stored data (``--evaluate RUN --on-snapshot DIR``)."""

from __future__ import annotations

import numpy as np
import torch

from ..base import SnapshotRun
from .config import DQNRunConfig
from .targets import NStepTargets

__all__ = ["evaluate_dqn"]


def evaluate_dqn(run: SnapshotRun[DQNRunConfig]) -> dict:
    """DQN: the distribution of n-step TD errors ``delta = Q(s_t, a_t) - (R + gamma^m *
    max_a Q(s_{t+m}, a) * (1 - done))`` over every stored transition, built by the
    learner's ``NStepTargets`` (n = dqn.n_step, gamma = dqn.gamma).

    The checkpoint's online network plays both roles (``best.pt`` holds no target
    network, and the online one is the agent being judged); with ``dqn.double`` that
    is the same as the max. Rows: all transitions, those that end the episode by
    termination (``done``: no bootstrap) and the rest; columns: count, mean and
    percentiles of ``|delta|`` (return units), mean ``delta`` (its sign says whether the
    network over- or under-estimates) and mean ``Q(s_t, a_t)``.
    """
    from .dqn import make_q_network

    cfg = run.config
    network = run.load_weights(make_q_network(cfg, run.spec.observation_shape, run.spec.num_actions))
    targets = NStepTargets(cfg.dqn.n_step, cfg.dqn.gamma, cfg.dqn.frame_stack)
    deltas, done, q_taken = [], [], []
    with torch.no_grad():
        for p in run.positions.batches(run.batch_size):
            d = targets.build(run.buffer.fields, p.slots, p.pos, p.moves, p.terminated, None)
            q = network(torch.from_numpy(d["observation"])).double()
            q_sa = q.gather(1, torch.from_numpy(d["action"]).long()[:, None]).squeeze(1).numpy()
            q_next = network(torch.from_numpy(d["next_observation"])).double().max(1).values.numpy()
            target = d["reward"] + d["discount"] * np.where(d["done"], 0.0, q_next)
            deltas.append(q_sa - target)
            done.append(d["done"])
            q_taken.append(q_sa)
            run.advance(len(p))
    delta = np.concatenate(deltas) if deltas else np.zeros(0)
    is_done = np.concatenate(done) if done else np.zeros(0, bool)
    q_all = np.concatenate(q_taken) if q_taken else np.zeros(0)

    def row(name: str, mask: np.ndarray) -> dict:
        a = np.abs(delta[mask])
        if a.size == 0:
            return {"transitions": name, "count": 0}
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return {"transitions": name, "count": int(a.size), "mean_abs_td": float(a.mean()), "p50": float(p50),
                "p90": float(p90), "p99": float(p99), "max": float(a.max()), "mean_td": float(delta[mask].mean()),
                "mean_q": float(q_all[mask].mean())}  # fmt: skip

    table = [row("all", np.ones(delta.shape, bool)), row("done", is_done), row("not done", ~is_done)]
    edges = np.concatenate([[0.0], np.logspace(-3, 3, 13)])
    hist = np.histogram(np.abs(delta), bins=np.append(edges, np.inf))[0]
    return {"n_step": cfg.dqn.n_step, "gamma": cfg.dqn.gamma, "table": table,
            "abs_td_histogram": {"edges": edges.tolist() + ["inf"], "counts": hist.tolist()}}  # fmt: skip
