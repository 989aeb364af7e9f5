"""The d3rlpy exporter: the arrays it hands to ``MDPDataset`` hold exactly the snapshot's
transitions, read back the way d3rlpy reads them."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

from mpper import ReplayBuffer
from mpper.algos.dqn.targets import dqn_schema
from mpper.extras import MissingExtraError
from mpper.tools.d3rlpy_export import to_mdp_dataset, transitions


def make_episodes(rng, count: int) -> list[dict]:
    """Episodes of random lengths (one of a single move), half terminated, half cut."""
    episodes = []
    for k in range(count):
        moves = 1 if k == 3 else int(rng.integers(1, 9))
        episodes.append({"observation": rng.normal(size=(moves + 1, 3)).astype(np.float32),
                         "action": np.r_[0, rng.integers(0, 4, moves)].astype(np.int64),
                         "reward": np.r_[0.0, rng.normal(size=moves)].astype(np.float32),
                         "terminated": bool(k % 2)})  # fmt: skip
    return episodes


def expected(episodes: list[dict]) -> list[tuple]:
    """(o_t, a_t, r_{t+1}, o_{t+1} or None when the env ended there) of every move, in order."""
    out = []
    for ep in episodes:
        moves = len(ep["action"]) - 1
        for t in range(moves):
            last = t == moves - 1
            following = None if last and ep["terminated"] else ep["observation"][t + 1]
            out.append((ep["observation"][t], ep["action"][t + 1], ep["reward"][t + 1], following))
    return out


def read_as_d3rlpy(t) -> list[tuple]:
    """d3rlpy's reading of the flat arrays: an episode ends at a terminal or timeout step;
    each step but an episode's last is a transition to the next step's observation; the
    last step of a terminated episode is a transition to nothing, that of a cut one none."""
    out, start = [], 0
    ends = np.flatnonzero((t.terminals > 0) | (t.timeouts > 0))
    for end in ends:
        for i in range(start, end + 1):
            if i < end:
                out.append((t.observations[i], t.actions[i], t.rewards[i], t.observations[i + 1]))
            elif t.terminals[i]:
                out.append((t.observations[i], t.actions[i], t.rewards[i], None))
        start = end + 1
    assert start == len(t.actions)  # nothing after the last episode's end
    return out


def test_the_exported_transitions_are_the_snapshots(tmp_path):
    rng = np.random.default_rng(0)
    episodes = make_episodes(rng, 9)
    with ReplayBuffer.create(dqn_schema((3,)), 256) as buf:
        for ep in episodes:
            buf.add_episode({k: ep[k] for k in ("observation", "action", "reward")}, terminated=ep["terminated"])
        buf.save(tmp_path / "snap")
    t = transitions(tmp_path / "snap", num_actions=4)
    assert t.num_actions == 4 and t.actions.dtype == np.int64 and t.observations.dtype == np.float32
    got, want = read_as_d3rlpy(t), expected(episodes)
    assert len(got) == len(want) == sum(len(ep["action"]) - 1 for ep in episodes)
    for (o, a, r, nxt), (wo, wa, wr, wnxt) in zip(got, want):
        np.testing.assert_array_equal(o, wo)
        assert a == wa and r == wr
        assert (nxt is None) == (wnxt is None)
        if nxt is not None:
            np.testing.assert_array_equal(nxt, wnxt)
    assert transitions(tmp_path / "snap").num_actions == int(max(ep["action"].max() for ep in episodes)) + 1


def test_without_d3rlpy_the_export_says_which_extra_installs_it(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_d3rlpy(name, *args, **kwargs):
        if name == "d3rlpy" or name.startswith("d3rlpy."):
            raise ImportError("No module named 'd3rlpy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_d3rlpy)
    monkeypatch.delitem(__import__("sys").modules, "d3rlpy", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install -e \.\[bench\]"):
        to_mdp_dataset(tmp_path / "whatever")
