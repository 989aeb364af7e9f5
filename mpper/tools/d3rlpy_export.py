"""A buffer snapshot as a d3rlpy ``MDPDataset``, so that d3rlpy trains on exactly the
transitions an offline mpper run learns from.

    python -m mpper.tools.d3rlpy_export SNAPSHOT_DIR OUT.h5   # d3rlpy's own file (MDPDataset.dump)

d3rlpy (the ``bench`` extra) is imported only by :func:`to_mdp_dataset`; :func:`transitions`
is numpy alone. d3rlpy keeps an episode as its steps: step ``t`` holds the observation
o_t, the action a_t taken there, the reward r_{t+1} it brought, and on the episode's last
step ``terminals`` 1 (the env ended it) or ``timeouts`` 1 (a time limit, or a piece of a
game, cut it). mpper's rows (``EpisodeRows``: row i holds o_i, a_{i-1}, r_i) map one to
one onto them (:func:`transitions` says how a cut episode keeps its final observation).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..extras import require
from ..replay.buffer import ReplayBuffer

__all__ = ["Transitions", "to_mdp_dataset", "transitions"]


@dataclass
class Transitions:
    """All stored transitions, episode after episode (oldest first), N steps in all:
    ``observations`` (N, *obs) in the stored dtype, ``actions`` (N,) int64, ``rewards``
    (N,) float32, ``terminals`` and ``timeouts`` (N,) float32 (1 on an episode's last
    step), ``num_actions``."""

    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminals: np.ndarray
    timeouts: np.ndarray
    num_actions: int


def transitions(snapshot: str | Path, num_actions: int | None = None) -> Transitions:
    """Every published episode of ``snapshot`` (checked as any snapshot is loaded) as
    d3rlpy's flat arrays; episodes without a move are left out. ``num_actions``: the
    env's action count (default: the width of a stored ``child_visits``, else the largest
    stored action + 1).

    An episode of T moves that terminated is T steps, ``terminals`` 1 on the last. One that
    was cut (a time limit) is T + 1 steps: its final observation o_T as a last step of
    its own (action 0, reward 0, ``timeouts`` 1), which d3rlpy takes as the next
    observation of step T - 1 and as no transition itself, so that its T transitions are
    the snapshot's T, the last one bootstrapping from o_T."""
    with ReplayBuffer.load(snapshot, mmap=True, verify=True, num_actions=num_actions) as buf:
        f = buf.fields
        width = int(f["child_visits"].shape[1]) if "child_visits" in f else None
        parts: dict[str, list[np.ndarray]] = {"observations": [], "actions": [], "rewards": [], "terminals": [],
                                              "timeouts": []}  # fmt: skip
        for ref in buf.episodes():
            moves = ref.rows - 1
            if moves == 0:
                continue
            steps = moves if ref.terminated else moves + 1  # a cut episode keeps o_T as a step of its own
            lo = ref.start
            actions = np.zeros(steps, np.int64)
            rewards = np.zeros(steps, np.float32)
            actions[:moves] = f["action"][lo + 1 : lo + 1 + moves]  # a_t on row t + 1
            rewards[:moves] = f["reward"][lo + 1 : lo + 1 + moves]  # r_{t+1} on row t + 1
            end = np.zeros(steps, np.float32)
            end[-1] = 1.0
            parts["observations"].append(np.asarray(f["observation"][lo : lo + steps]))
            parts["actions"].append(actions)
            parts["rewards"].append(rewards)
            parts["terminals"].append(end if ref.terminated else np.zeros(steps, np.float32))
            parts["timeouts"].append(np.zeros(steps, np.float32) if ref.terminated else end)
        empty = {"observations": np.empty((0, *f["observation"].shape[1:]), f["observation"].dtype),
                 "actions": np.empty(0, np.int64)}  # fmt: skip
        arrays = {k: np.concatenate(v) if v else empty.get(k, np.empty(0, np.float32)) for k, v in parts.items()}
    count = num_actions or width or (int(arrays["actions"].max()) + 1 if arrays["actions"].size else 0)
    return Transitions(**arrays, num_actions=count)


def to_mdp_dataset(snapshot: str | Path, num_actions: int | None = None):
    """``d3rlpy.dataset.MDPDataset`` of :func:`transitions` (discrete actions, ``action_size``
    the env's action count). MissingExtraError without d3rlpy."""
    d3rlpy = require("d3rlpy", "d3rlpy", "bench", "exporting a snapshot to d3rlpy")
    t = transitions(snapshot, num_actions)
    return d3rlpy.dataset.MDPDataset(observations=t.observations, actions=t.actions, rewards=t.rewards,
                                     terminals=t.terminals, timeouts=t.timeouts,
                                     action_space=d3rlpy.constants.ActionSpace.DISCRETE,
                                     action_size=t.num_actions)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m mpper.tools.d3rlpy_export SNAPSHOT_DIR OUT.h5", file=sys.stderr)
        return 2
    dataset = to_mdp_dataset(args[0])
    with open(args[1], "wb") as f:
        dataset.dump(f)
    print(f"written: {args[1]} ({dataset.transition_count} transitions, {len(dataset.episodes)} episodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
