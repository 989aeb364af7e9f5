"""Check the d3rlpy exporter against d3rlpy itself: random episodes (half terminated, half
cut by a time limit) stored as a snapshot, exported with ``mpper.tools.d3rlpy_export``,
and every transition d3rlpy's own ``BasicTransitionPicker`` reads back compared with the
episodes' moves (observation, action, reward, next observation or terminal).

d3rlpy 2.8 pins gymnasium 1.0.0, so it lives in a venv of its own (docs/offline.md):

    PYTHONPATH=.:tests/tools <d3rlpy-venv>/bin/python bench/d3rlpy_export_check.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import d3rlpy
import numpy as np
from test_d3rlpy_export import expected, make_episodes

from mpper import ReplayBuffer
from mpper.algos.dqn.targets import dqn_schema
from mpper.tools.d3rlpy_export import to_mdp_dataset


def main() -> None:
    episodes = make_episodes(np.random.default_rng(1), 40)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "snapshot"
        with ReplayBuffer.create(dqn_schema((3,)), 4096) as buf:
            for ep in episodes:
                buf.add_episode({k: ep[k] for k in ("observation", "action", "reward")}, terminated=ep["terminated"])
            buf.save(path)
        dataset = to_mdp_dataset(path, num_actions=4)
    picker = d3rlpy.dataset.BasicTransitionPicker()
    got = [picker(ep, i) for ep in dataset.episodes for i in range(ep.transition_count)]
    want = expected(episodes)
    assert len(got) == len(want), (len(got), len(want))
    for tr, (obs, action, reward, following) in zip(got, want):
        np.testing.assert_array_equal(tr.observation, obs)
        assert int(np.ravel(tr.action)[0]) == action and np.float32(np.ravel(tr.reward)[0]) == reward
        assert bool(np.ravel(tr.terminal)[0]) == (following is None)
        if following is not None:
            np.testing.assert_array_equal(tr.next_observation, following)
    print(f"d3rlpy {d3rlpy.__version__}: its {len(got)} transitions equal the snapshot's")


if __name__ == "__main__":
    main()
