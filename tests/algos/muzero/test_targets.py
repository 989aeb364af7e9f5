"""Targets built by ``ReplayBuffer.sample`` against a plain reference of muzero-general.

The oracle is tests/seed_reference.py (loop-by-loop, float64).  It is itself checked on
a tiny two-player episode whose numbers are worked out by hand below, so it cannot be
silently wrong.

Each buffer test writes random episodes into a small ``mpper.ReplayBuffer`` with
``alpha = 0`` (uniform), with an extra schema field ``tag = (episode id, position)`` in
every row, samples batches large enough to visit every sampleable position, maps each
sampled slot back to its episode and position through ``tag``, and compares every field
of the batch with the reference (float32 tolerance: rtol 1e-5, plus atol 1e-5 for
targets that sum to nearly 0).
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import seed_reference as ref  # noqa: E402

from mpper.algos.dqn.targets import NStepTargets, dqn_schema  # noqa: E402
from mpper.algos.muzero.targets import MuZeroTargets, muzero_schema  # noqa: E402

pytestmark = pytest.mark.timeout(60)

RTOL = 1e-5
ATOL = 1e-5
BETA = 0.4


# --------------------------------------------------------------------------------------
# 1. The reference itself, on hand-computed numbers
# --------------------------------------------------------------------------------------
#
# Two-player episode, T = 3 moves (4 rows), discount 0.5, num_actions 2:
#
#   row i        0      1      2      3
#   observation [1,2]  [3,4]  [5,6]  [7,8]
#   action       0      1      0      1        (row 0: no action led there)
#   reward       0      1     -2      3        (row 0: 0)
#   to_play      0      1      0      1
#   root_value   0.5   -0.25   0.75   0        (row T unused)
#   child_visits [.2,.8] [.6,.4] [1,0] [0,0]   (row T unused)
#
# compute_target_value, td_steps = 2  (bootstrap only if index + 2 < 3):
#   index 0: bootstrap slot 2, to_play[2] = 0 == to_play[0] -> +0.75 * 0.5**2 = 0.1875
#            i=0: reward[1] =  1, to_play[0+0] = 0 == 0 -> + 1 * 1   = 1
#            i=1: reward[2] = -2, to_play[0+1] = 1 != 0 -> +2 * 0.5  = 1
#            total 2.1875
#   index 1: bootstrap slot 3 is not < 3 -> 0
#            i=0: reward[2] = -2, to_play[1] = 1 == 1  -> -2
#            i=1: reward[3] =  3, to_play[2] = 0 != 1  -> -3 * 0.5 = -1.5
#            total -3.5
#   index 2: bootstrap slot 4 -> 0;  i=0: reward[3] = 3, same player -> 3;  reward slice ends
#            total 3
#   index 3 (= T) and beyond: 0
# td_steps = 1:
#   index 0: bootstrap slot 1, to_play[1] = 1 != 0 -> -(-0.25) * 0.5 = 0.125; + reward[1] = 1
#            total 1.125
#   index 1: bootstrap slot 2, to_play 0 != 1 -> -0.75 * 0.5 = -0.375; + reward[2] = -2
#            total -2.375
#   index 2: bootstrap slot 3 = T -> 0; + reward[3] = 3 -> 3
# Reanalysed [nan, nan, 0.1, nan], td_steps = 2, index 0: 0.1 * 0.25 + 2 = 2.025
#   (index 1 and 2 unchanged: they do not bootstrap)
# Reanalysed [nan, 9, nan, nan], td_steps = 1: index 0 -> -9 * 0.5 + 1 = -3.5;
#   index 1 bootstraps slot 2 (NaN there -> root 0.75) -> -2.375 as before.
#
# Truncated (cut by a time limit, not terminated), root_value[3] = 4 (the value of the
# final observation, from the view of to_play[3] = 1), td_steps = 2: a window that reaches
# row T bootstraps from it with discount**(T - index):
#   index 0: bootstrap slot 2 < T as before -> 2.1875
#   index 1: to_play[3] = 1 == 1 -> +4 * 0.5**2 = 1;    -3.5 + 1 = -2.5
#   index 2: to_play[3] = 1 != 0 -> -4 * 0.5**1 = -2;   3 - 2 = 1
#   index 3 (= T): 4 * 0.5**0 = 4;  index 4 (> T): 0
#   make_target(1, K = 3, td 2) values: [-2.5, 1, 4, 0]
#
# make_target(state_index 1, K = 3, td 2):
#   slot 1 (< T):  value -3.5, reward[1] = 1,  policy [.6,.4], action[1] = 1
#   slot 2 (< T):  value  3,   reward[2] = -2, policy [1, 0], action[2] = 0
#   slot 3 (== T): value  0,   reward[3] = 3,  policy [.5,.5], action[3] = 1
#   slot 4 (> T):  value  0,   reward 0,       policy [.5,.5], action random (-1)
# gradient_scale(T=3, t=1, K=3) = min(3, 4 - 1) = 3 -> [3,3,3,3]; t=2 -> min(3, 2) = 2.
#
# get_stacked_observations(index 1, 2 stacked, 2 actions):
#   [3,4] + ([1,2], action[1]/2 = 0.5) + (zeros(2), 0) = [3,4, 1,2,0.5, 0,0,0]
#
# nstep_transition, gamma 0.5:
#   t=0, n=2: m=2, R = 1 + 0.5*(-2) = 0, discount 0.25, s' = [5,6], a = action[1] = 1,
#             done False
#   t=2, n=2: m=min(2,1)=1, R = 3, discount 0.5, s' = [7,8], a = action[3] = 1,
#             done = terminated
#   t=1, n=5: m=2, R = -2 + 0.5*3 = -0.5, discount 0.25, s' = [7,8], done = terminated


def hand_episode():
    return {
        "observation": np.array([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=np.float32),
        "action": np.array([0, 1, 0, 1]),
        "reward": np.array([0, 1, -2, 3], dtype=np.float32),
        "to_play": np.array([0, 1, 0, 1]),
        "root_value": np.array([0.5, -0.25, 0.75, 0.0], dtype=np.float32),
        "child_visits": np.array([[0.2, 0.8], [0.6, 0.4], [1.0, 0.0], [0.0, 0.0]],
                                 dtype=np.float32),
    }


def test_reference_value_targets_by_hand():
    ep = hand_episode()
    got2 = [ref.compute_target_value(ep, i, 2, 0.5) for i in range(6)]
    assert got2 == pytest.approx([2.1875, -3.5, 3.0, 0.0, 0.0, 0.0])
    got1 = [ref.compute_target_value(ep, i, 1, 0.5) for i in range(3)]
    assert got1 == pytest.approx([1.125, -2.375, 3.0])
    # root_value given as (T,) instead of (T+1,): same answers
    ep_short = dict(ep, root_value=ep["root_value"][:3])
    assert [ref.compute_target_value(ep_short, i, 2, 0.5) for i in range(4)] == \
        pytest.approx([2.1875, -3.5, 3.0, 0.0])

    ep_r = dict(ep, reanalysed_value=np.array([np.nan, np.nan, 0.1, np.nan]))
    assert [ref.compute_target_value(ep_r, i, 2, 0.5) for i in range(3)] == \
        pytest.approx([2.025, -3.5, 3.0])
    ep_r = dict(ep, reanalysed_value=np.array([np.nan, 9.0, np.nan, np.nan]))
    assert [ref.compute_target_value(ep_r, i, 1, 0.5) for i in range(3)] == \
        pytest.approx([-3.5, -2.375, 3.0])


def test_reference_truncated_value_targets_by_hand():
    ep = dict(hand_episode(), root_value=np.array([0.5, -0.25, 0.75, 4.0], dtype=np.float32))
    got = [ref.compute_target_value(ep, i, 2, 0.5, terminated=False) for i in range(5)]
    assert got == pytest.approx([2.1875, -2.5, 1.0, 4.0, 0.0])
    # terminated: row T's value is never read
    assert [ref.compute_target_value(ep, i, 2, 0.5) for i in range(5)] == pytest.approx([2.1875, -3.5, 3.0, 0, 0])
    values, rewards, _, _ = ref.make_target(ep, 1, 3, 2, 0.5, 2, terminated=False)
    np.testing.assert_allclose(values, [-2.5, 1.0, 4.0, 0.0])
    np.testing.assert_allclose(rewards, [1.0, -2.0, 3.0, 0.0])
    # a reanalysed value of the final observation replaces its root value
    ep_r = dict(ep, reanalysed_value=np.array([np.nan, np.nan, np.nan, 8.0]))
    assert ref.compute_target_value(ep_r, 2, 2, 0.5, terminated=False) == pytest.approx(3.0 - 4.0)


def test_reference_make_target_by_hand():
    ep = hand_episode()
    values, rewards, policies, actions = ref.make_target(ep, 1, 3, 2, 0.5, 2)
    np.testing.assert_allclose(values, [-3.5, 3.0, 0.0, 0.0])
    np.testing.assert_allclose(rewards, [1.0, -2.0, 3.0, 0.0])
    np.testing.assert_allclose(policies, [[0.6, 0.4], [1, 0], [0.5, 0.5], [0.5, 0.5]],
                               rtol=1e-6)
    np.testing.assert_array_equal(actions, [1, 0, 1, -1])
    np.testing.assert_array_equal(ref.gradient_scale(3, 1, 3), [3, 3, 3, 3])
    np.testing.assert_array_equal(ref.gradient_scale(3, 2, 3), [2, 2, 2, 2])
    np.testing.assert_array_equal(ref.gradient_scale(3, 0, 2), [2, 2, 2])


def test_reference_stacked_observations_by_hand():
    ep = hand_episode()
    np.testing.assert_allclose(ref.get_stacked_observations(ep, 1, 2, 2),
                               [3, 4, 1, 2, 0.5, 0, 0, 0])
    np.testing.assert_allclose(ref.get_stacked_observations(ep, 3, 2, 2),
                               [7, 8, 5, 6, 0.5, 3, 4, 0.0])
    np.testing.assert_allclose(ref.get_stacked_observations(ep, 2, 0, 2), [5, 6])
    # (C, H, W): each past step adds C channels and one action plane of shape (H, W)
    obs = np.arange(3 * 2 * 2 * 2, dtype=np.float32).reshape(3, 2, 2, 2)
    ep3 = {"observation": obs, "action": np.array([0, 1, 3])}
    st = ref.get_stacked_observations(ep3, 2, 3, 4)
    assert st.shape == (2 + 3 * 3, 2, 2)
    np.testing.assert_array_equal(st[0:2], obs[2])
    np.testing.assert_array_equal(st[2:4], obs[1])
    np.testing.assert_array_equal(st[4], np.full((2, 2), 3 / 4))
    np.testing.assert_array_equal(st[5:7], obs[0])
    np.testing.assert_array_equal(st[7], np.full((2, 2), 1 / 4))
    np.testing.assert_array_equal(st[8:], 0.0)


def test_reference_nstep_by_hand():
    ep = hand_episode()
    tr = ref.nstep_transition(ep, 0, 2, 0.5, terminated=True)
    assert tr["reward"] == pytest.approx(0.0) and tr["discount"] == pytest.approx(0.25)
    assert tr["action"] == 1 and tr["done"] is False
    np.testing.assert_array_equal(tr["observation"], [1, 2])
    np.testing.assert_array_equal(tr["next_observation"], [5, 6])
    for terminated in (True, False):
        tr = ref.nstep_transition(ep, 2, 2, 0.5, terminated=terminated)
        assert tr["reward"] == pytest.approx(3.0) and tr["discount"] == pytest.approx(0.5)
        assert tr["action"] == 1 and tr["done"] is terminated
        np.testing.assert_array_equal(tr["next_observation"], [7, 8])
    tr = ref.nstep_transition(ep, 1, 5, 0.5, terminated=True)
    assert tr["reward"] == pytest.approx(-0.5) and tr["discount"] == pytest.approx(0.25)
    assert tr["done"] is True
    with pytest.raises(ValueError):
        ref.nstep_transition(ep, 3, 1, 0.5, terminated=True)  # row T is not a position


def test_reference_one_player_monte_carlo_limit():
    # One player, td_steps past the end, discount 1: the value target is the plain sum of
    # the rewards still to come, whatever the root values are.
    rng = np.random.default_rng(5)
    T = 6
    ep = {
        "action": np.zeros(T + 1, dtype=np.int64),
        "reward": np.r_[0.0, rng.standard_normal(T)],
        "to_play": np.zeros(T + 1, dtype=np.int64),
        "root_value": rng.standard_normal(T + 1),
    }
    for t in range(T + 1):
        assert ref.compute_target_value(ep, t, 50, 1.0) == pytest.approx(ep["reward"][t + 1:].sum())


# --------------------------------------------------------------------------------------
# 2. Episode generation and helpers for the buffer tests
# --------------------------------------------------------------------------------------

def make_episode(rng, T, obs_shape, num_actions, players, reanalysed, ep_id):
    """A random episode of T moves in the row layout, float32-exact numbers.

    players: 1 (to_play always 0), 2 (alternating, random first player) or
             "random" (to_play drawn per row, so the same player may move twice).
    reanalysed: "none" (all NaN), "all" (every position 0..T-1), "mixed" (about half),
                "omitted" (field not passed to add_episode: the fill value NaN applies);
                reanalysed policies alike ("mixed": about half, independently drawn,
                and some rows NaN in one entry only: a row the reanalyser is writing).
    """
    L = T + 1
    ep = {
        "observation": rng.standard_normal((L, *obs_shape)).astype(np.float32),
        "action": rng.integers(0, num_actions, L).astype(np.int64),
        "reward": rng.standard_normal(L).astype(np.float32),
        "root_value": rng.standard_normal(L).astype(np.float32),
        "child_visits": rng.dirichlet(np.ones(num_actions), L).astype(np.float32),
        "tag": np.stack([np.full(L, ep_id), np.arange(L)], axis=1).astype(np.int64),
    }
    ep["action"][0] = 0
    ep["reward"][0] = 0.0
    ep["root_value"][T] = 0.0
    ep["child_visits"][T] = 0.0
    if players == 1:
        ep["to_play"] = np.zeros(L, dtype=np.int64)
    elif players == 2:
        ep["to_play"] = ((np.arange(L) + rng.integers(0, 2)) % 2).astype(np.int64)
    else:
        ep["to_play"] = rng.integers(0, 2, L).astype(np.int64)
    rean = np.full(L, np.nan, dtype=np.float32)
    if reanalysed == "all":
        rean[:T] = rng.standard_normal(T).astype(np.float32)
    elif reanalysed == "mixed":
        mask = rng.random(T) < 0.5
        mask[rng.integers(0, T)] = True  # at least one stored value per episode
        rean[:T][mask] = rng.standard_normal(int(mask.sum())).astype(np.float32)
    elif reanalysed not in ("none", "omitted"):
        raise ValueError(reanalysed)
    ep["reanalysed_value"] = rean
    policy = np.full((L, num_actions), np.nan, dtype=np.float32)
    if reanalysed == "all":
        policy[:T] = rng.dirichlet(np.ones(num_actions), T)
    elif reanalysed == "mixed":
        mask = rng.random(T) < 0.5
        mask[rng.integers(0, T)] = True
        policy[:T][mask] = rng.dirichlet(np.ones(num_actions), int(mask.sum()))
        half_written = np.flatnonzero(mask & (rng.random(T) < 0.3))
        policy[half_written, rng.integers(0, num_actions, half_written.size)] = np.nan
    ep["reanalysed_policy"] = policy
    return ep


def _mpper():
    import mpper  # an ImportError here fails the test: the contract must be importable

    return mpper


@pytest.fixture
def buffers():
    """Creates ReplayBuffers and closes (unlinks) them after the test."""
    made = []

    def create(schema, capacity):
        buf = _mpper().ReplayBuffer.create(schema, capacity=capacity, alpha=0.0,
                                           priority_eps=1e-6, priority_clip=None,
                                           initial_priority="max")
        made.append(buf)
        return buf

    yield create
    for buf in made:
        buf.close()


def sample_with_tags(buf, batch_size, targets, seed):
    """Sample with targets and return (batch, tags (B, 2) int64).

    The tag comes from batch.data["tag"] when the library passes schema fields through;
    otherwise from a second, target-less sample drawn with an identical generator, whose
    indices must then be identical (same state, same rng -> same draw).
    """
    batch = buf.sample(batch_size, BETA, targets=targets, rng=np.random.default_rng(seed))
    plain = buf.sample(batch_size, BETA, targets=None, rng=np.random.default_rng(seed))
    np.testing.assert_array_equal(
        plain.indices, batch.indices,
        err_msg="two samples with identical rng and buffer state drew different slots")
    tags = np.asarray(plain.data["tag"]).astype(np.int64)
    if "tag" in batch.data:
        np.testing.assert_array_equal(np.asarray(batch.data["tag"]), tags)
    assert tags.shape == (batch_size, 2)
    return batch, tags


def check_sampling_basics(batch, tags, episodes, num_positions, slot_of):
    """Uniform sampling facts that the target checks rely on, and slot <-> tag consistency."""
    B = len(batch.indices)
    assert np.asarray(batch.indices).shape == (B,)
    # alpha = 0: every sampleable slot has the same priority
    np.testing.assert_allclose(batch.probabilities, 1.0 / num_positions, rtol=1e-9)
    np.testing.assert_allclose(batch.weights, 1.0, rtol=1e-6)
    for b in range(B):
        ep_id, t = int(tags[b, 0]), int(tags[b, 1])
        assert ep_id in episodes, f"sampled slot holds unknown episode {ep_id}"
        T = ref.episode_length(episodes[ep_id])
        assert 0 <= t < T, f"sampled row {t} of episode {ep_id} (T={T}); row T is not sampleable"
        slot = int(batch.indices[b])
        prev = slot_of.setdefault((ep_id, t), slot)
        assert prev == slot, f"(episode {ep_id}, position {t}) seen in slots {prev} and {slot}"


def _close(actual, expected, what, ctx):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected,
                               rtol=RTOL, atol=ATOL, err_msg=f"{what} differs: {ctx}")


def check_muzero_batch(batch, tags, episodes, cfg):
    K, A = cfg["K"], cfg["A"]
    d = batch.data
    B = len(batch.indices)
    obs_shape = cfg["obs_shape"]
    N = cfg["stacked"]
    stacked_shape = (obs_shape[0] + N * (obs_shape[0] + 1), *obs_shape[1:])
    for key in ("observation", "actions", "target_value", "target_reward",
                "gradient_scale", "target_policy"):
        assert key in d, f"batch.data lacks {key!r}"
    assert d["observation"].shape == (B, *stacked_shape)
    assert d["observation"].dtype == np.float32
    assert d["actions"].shape == (B, K + 1) and d["actions"].dtype == np.int64
    for key in ("target_value", "target_reward", "gradient_scale", "target_mask", "policy_mask"):
        assert d[key].shape == (B, K + 1), key
        assert d[key].dtype == np.float32, key
    assert d["target_policy"].shape == (B, K + 1, A)
    assert d["target_policy"].dtype == np.float32

    for b in range(B):
        ep_id, t = int(tags[b, 0]), int(tags[b, 1])
        ep = episodes[ep_id]
        T = ref.episode_length(ep)
        ctx = (f"episode {ep_id} (T={T}), position {t}, td_steps={cfg['td']}, "
               f"K={K}, discount={cfg['discount']}, to_play={ep['to_play'].tolist()}, "
               f"reanalysed={ep['reanalysed_value'].tolist()}")
        values, rewards, policies, actions = ref.make_target(
            ep, t, K, cfg["td"], cfg["discount"], A, cfg.get("terminated", {}).get(ep_id, True))
        _close(d["target_value"][b], values, "target_value", ctx)
        _close(d["target_reward"][b], rewards, "target_reward", ctx)
        _close(d["target_policy"][b], policies, "target_policy", ctx)
        _close(d["gradient_scale"][b], ref.gradient_scale(T, t, K), "gradient_scale", ctx)
        # Masks: past the cut of a truncated episode nothing was recorded (value and
        # reward: steps i > T; policy: i >= T); a terminated one trains every step.
        i = t + np.arange(K + 1)
        terminated = cfg.get("terminated", {}).get(ep_id, True)
        np.testing.assert_array_equal(d["target_mask"][b], (terminated | (i <= T)).astype(np.float32),
                                      err_msg=f"target_mask: {ctx}")  # fmt: skip
        np.testing.assert_array_equal(d["policy_mask"][b], (terminated | (i < T)).astype(np.float32),
                                      err_msg=f"policy_mask: {ctx}")  # fmt: skip
        known = actions >= 0
        np.testing.assert_array_equal(d["actions"][b][known], actions[known],
                                      err_msg=f"actions differ: {ctx}")
        rand = d["actions"][b][~known]
        assert np.all((rand >= 0) & (rand < A)), f"random actions {rand} out of range: {ctx}"
        _close(d["observation"][b], ref.get_stacked_observations(ep, t, N, A),
               "stacked observation", ctx)
        if cfg.get("next_observations"):
            # The consistency loss's targets: o_{t+k} for k = 1..K where it exists (t + k <= T).
            for k in range(1, K + 1):
                exists = t + k <= T
                assert d["next_observation_mask"][b, k - 1] == float(exists), f"mask at k={k}: {ctx}"
                if exists:
                    _close(d["next_observation"][b, k - 1], ref.get_stacked_observations(ep, t + k, N, A),
                           f"next observation k={k}", ctx)
    if cfg.get("next_observations"):
        assert d["next_observation"].shape == (B, K, *stacked_shape)
        assert d["next_observation"].dtype == np.float32
        assert d["next_observation_mask"].shape == (B, K)
    else:
        assert "next_observation" not in d and "next_observation_mask" not in d


def _positions(episodes):
    return {(e, t) for e, ep in episodes.items() for t in range(ref.episode_length(ep))}


def run_muzero_case(buffers, rng, lengths, obs_shape, stacked, players, reanalysed,
                    td=5, K=5, discount=0.9, A=3, capacity=None, rounds=3, truncated=(), next_observations=False):
    """``truncated``: ids of episodes stored as cut by a time limit; they get a value
    (and, with reanalysis, a reanalysed value) on their final row to bootstrap from."""
    schema = dict(muzero_schema(observation_shape=obs_shape, num_actions=A))
    schema["tag"] = ((2,), "int64")
    episodes = {}
    terminated = {ep_id: ep_id not in truncated for ep_id in range(len(lengths))}
    for ep_id, T in enumerate(lengths):
        episodes[ep_id] = make_episode(rng, T, obs_shape, A, players, reanalysed, ep_id)
        if not terminated[ep_id]:
            episodes[ep_id]["root_value"][T] = rng.standard_normal()
            if reanalysed == "all" or (reanalysed == "mixed" and ep_id % 4 == 1):
                episodes[ep_id]["reanalysed_value"][T] = rng.standard_normal()
    total_rows = sum(T + 1 for T in lengths)
    # by default the ring is exactly full: the last episode ends on the last slot
    buf = buffers(schema, capacity or total_rows)
    for ep_id, ep in episodes.items():
        data = dict(ep)
        if reanalysed == "omitted":
            del data["reanalysed_value"], data["reanalysed_policy"]
        assert buf.add_episode(data, priorities=None, terminated=terminated[ep_id]) is True
    num_positions = sum(lengths)
    targets = MuZeroTargets(num_unroll_steps=K, td_steps=td, discount=discount,
                            stacked_observations=stacked, num_actions=A, next_observations=next_observations)
    cfg = dict(K=K, A=A, td=td, discount=discount, obs_shape=obs_shape, stacked=stacked, terminated=terminated,
               next_observations=next_observations)
    seen, slot_of = set(), {}
    for r in range(rounds):
        B = 2 * num_positions + r  # stratified: >= 1 draw per slot
        batch, tags = sample_with_tags(buf, B, targets, seed=1000 + r)
        check_sampling_basics(batch, tags, episodes, num_positions, slot_of)
        check_muzero_batch(batch, tags, episodes, cfg)
        seen.update((int(e), int(t)) for e, t in tags)
    missing = _positions(episodes) - seen
    assert not missing, f"positions never sampled in {rounds} batches: {sorted(missing)[:10]}"


# --------------------------------------------------------------------------------------
# 3. MuZero targets from the buffer
# --------------------------------------------------------------------------------------

# 1, 2, 3, 4: shorter than td_steps = 5 and num_unroll_steps = 5; 7 in between; 12 long.
LENGTHS = [1, 2, 3, 4, 7, 12]


@pytest.mark.parametrize("reanalysed", ["none", "all", "mixed"])
@pytest.mark.parametrize("players", [1, 2])
@pytest.mark.parametrize("stacked", [0, 3])
@pytest.mark.parametrize("obs_shape", [(4,), (2, 3, 3)], ids=["1d", "chw"])
def test_muzero_targets_match_reference(buffers, obs_shape, stacked, players, reanalysed):
    seed = zlib.crc32(repr((obs_shape, stacked, players, reanalysed)).encode())
    run_muzero_case(buffers, np.random.default_rng(seed), LENGTHS, obs_shape, stacked,
                    players, reanalysed)


@pytest.mark.parametrize("reanalysed", ["none", "all", "mixed"])
@pytest.mark.parametrize("players", [1, 2])
def test_muzero_targets_of_truncated_episodes_bootstrap_from_the_final_value(buffers, players, reanalysed):
    """Episodes cut by a time limit: every window that reaches row T adds its value."""
    seed = zlib.crc32(repr(("truncated", players, reanalysed)).encode())
    run_muzero_case(buffers, np.random.default_rng(seed), LENGTHS, (4,), 0, players, reanalysed,
                    truncated={0, 2, 4, 5})


def test_muzero_targets_random_to_play(buffers):
    # to_play drawn per row: sign flips at arbitrary places, same player twice in a row
    run_muzero_case(buffers, np.random.default_rng(11), LENGTHS + [9], (4,), 2, "random",
                    "mixed")


def test_muzero_targets_reanalysed_field_omitted(buffers):
    # reanalysed_value left out of add_episode: filled with NaN -> root values are used
    run_muzero_case(buffers, np.random.default_rng(12), LENGTHS, (4,), 0, 2, "omitted")


@pytest.mark.parametrize("td,K,discount", [
    (1, 1, 0.9),      # one-step bootstrap
    (3, 8, 0.5),      # unroll much longer than td and than most episodes
    (10, 2, 0.997),   # td past the end of every episode but the longest
    (2, 0, 0.9),      # no unroll: K + 1 = 1 target per sample (gradient scale min(0, .) = 0)
    (4, 4, 1.0),      # discount 1
])
def test_muzero_targets_td_and_unroll_variants(buffers, td, K, discount):
    run_muzero_case(buffers, np.random.default_rng(100 + td * 10 + K), [1, 2, 5, 11], (4,),
                    1, 2, "mixed", td=td, K=K, discount=discount)


def test_muzero_targets_single_one_move_episode(buffers):
    # the smallest possible buffer content: one episode of one move
    run_muzero_case(buffers, np.random.default_rng(13), [1], (2, 3, 3), 3, 2, "all")


@pytest.mark.parametrize("players", [1, 2])
@pytest.mark.parametrize("stacked", [0, 3])
@pytest.mark.parametrize("obs_shape", [(4,), (2, 3, 3)], ids=["1d", "chw"])
def test_muzero_next_observations_match_reference(buffers, obs_shape, stacked, players):
    seed = zlib.crc32(repr(("next", obs_shape, stacked, players)).encode())
    run_muzero_case(buffers, np.random.default_rng(seed), LENGTHS, obs_shape, stacked, players, "mixed",
                    next_observations=True)


def test_muzero_next_observations_without_unroll(buffers):
    run_muzero_case(buffers, np.random.default_rng(5), LENGTHS, (4,), 0, 1, "none", K=0, next_observations=True)


@pytest.mark.parametrize("next_observations", [False, True])
def test_muzero_targets_after_ring_wraps(buffers, next_observations):
    # Many episodes through a small ring: episodes restart at slot 0 and evict old ones.
    # Whatever survives must still get its own episode's targets, never a neighbour's rows.
    rng = np.random.default_rng(21)
    A, K, td, discount, obs_shape = 2, 4, 3, 0.9, (3,)
    schema = dict(muzero_schema(observation_shape=obs_shape, num_actions=A))
    schema["tag"] = ((2,), "int64")
    capacity = 30
    buf = buffers(schema, capacity)
    episodes = {}
    for ep_id in range(25):
        T = int(rng.integers(1, 12))
        ep = make_episode(rng, T, obs_shape, A, 2, "mixed", ep_id)
        episodes[ep_id] = ep
        assert buf.add_episode(ep, priorities=None, terminated=True) is True
    targets = MuZeroTargets(num_unroll_steps=K, td_steps=td, discount=discount,
                            stacked_observations=2, num_actions=A, next_observations=next_observations)
    cfg = dict(K=K, A=A, td=td, discount=discount, obs_shape=obs_shape, stacked=2,
               next_observations=next_observations)
    seen = set()
    for r in range(3):
        batch, tags = sample_with_tags(buf, 2 * capacity, targets, seed=50 + r)
        check_muzero_batch(batch, tags, episodes, cfg)
        for e, t in tags:
            assert 0 <= t < ref.episode_length(episodes[int(e)])
        seen.update(int(e) for e in tags[:, 0])
    last = max(episodes)
    assert last in seen, "the most recently added episode is never sampled"
    # the resident episodes are the newest ones: ids seen form a contiguous recent range
    assert seen == set(range(min(seen), last + 1)), sorted(seen)


def test_muzero_targets_ignore_row_T_statistics(buffers):
    # muzero-general never reads the search statistics of the final observation
    # (len(root_values) == T): value targets do not bootstrap at slot T (0 there) and the
    # policy target at T is uniform.  Junk in row T of root_value, reanalysed_value and
    # child_visits must therefore change nothing.  (The contract says row T carries zeros
    # for root_value/child_visits; a reanalyser may well fill reanalysed_value[T].)
    rng = np.random.default_rng(31)
    A, K, td, discount, obs_shape = 3, 3, 2, 0.9, (4,)
    schema = dict(muzero_schema(observation_shape=obs_shape, num_actions=A))
    schema["tag"] = ((2,), "int64")
    lengths = [1, 2, 3, 6]
    episodes = {}
    for ep_id, T in enumerate(lengths):
        ep = make_episode(rng, T, obs_shape, A, 2, "all", ep_id)
        ep["root_value"][T] = 100.0 + ep_id
        ep["reanalysed_value"][T] = -200.0 - ep_id
        ep["child_visits"][T] = np.eye(A, dtype=np.float32)[0]
        episodes[ep_id] = ep
    buf = buffers(schema, sum(T + 1 for T in lengths))
    for ep in episodes.values():
        assert buf.add_episode(ep, priorities=None, terminated=True) is True
    targets = MuZeroTargets(num_unroll_steps=K, td_steps=td, discount=discount,
                                  stacked_observations=0, num_actions=A)
    cfg = dict(K=K, A=A, td=td, discount=discount, obs_shape=obs_shape, stacked=0)
    batch, tags = sample_with_tags(buf, 3 * sum(lengths), targets, seed=7)
    check_muzero_batch(batch, tags, episodes, cfg)


# --------------------------------------------------------------------------------------
# 4. DQN n-step transitions from the buffer
# --------------------------------------------------------------------------------------

def make_dqn_episode(rng, T, obs_shape, num_actions, ep_id):
    L = T + 1
    ep = {
        "observation": rng.standard_normal((L, *obs_shape)).astype(np.float32),
        "action": rng.integers(0, num_actions, L).astype(np.int64),
        "reward": rng.standard_normal(L).astype(np.float32),
        "tag": np.stack([np.full(L, ep_id), np.arange(L)], axis=1).astype(np.int64),
    }
    ep["action"][0] = 0
    ep["reward"][0] = 0.0
    return ep


def check_nstep_batch(batch, tags, episodes, terminated, n, gamma, obs_shape):
    d = batch.data
    B = len(batch.indices)
    for key in ("observation", "action", "reward", "discount", "next_observation", "done"):
        assert key in d, f"batch.data lacks {key!r}"
    assert d["observation"].shape == (B, *obs_shape)
    assert d["next_observation"].shape == (B, *obs_shape)
    assert d["action"].shape == (B,)
    assert d["reward"].shape == (B,) and d["discount"].shape == (B,)
    assert d["done"].shape == (B,) and d["done"].dtype == np.bool_
    for b in range(B):
        ep_id, t = int(tags[b, 0]), int(tags[b, 1])
        ep = episodes[ep_id]
        T = ref.episode_length(ep)
        tr = ref.nstep_transition(ep, t, n, gamma, terminated[ep_id])
        ctx = (f"episode {ep_id} (T={T}, terminated={terminated[ep_id]}), position {t}, "
               f"n={n}, gamma={gamma}")
        _close(d["observation"][b], tr["observation"], "observation", ctx)
        _close(d["next_observation"][b], tr["next_observation"], "next_observation", ctx)
        assert int(d["action"][b]) == tr["action"], f"action differs: {ctx}"
        _close(d["reward"][b], tr["reward"], "n-step reward", ctx)
        _close(d["discount"][b], tr["discount"], "discount", ctx)
        assert bool(d["done"][b]) is tr["done"], f"done differs: {ctx}"


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("obs_shape", [(4,), (2, 3, 3)], ids=["1d", "chw"])
def test_nstep_targets_match_reference(buffers, n, obs_shape):
    rng = np.random.default_rng(200 + n + len(obs_shape))
    A, gamma = 4, 0.9
    schema = dict(dqn_schema(observation_shape=obs_shape))
    schema["tag"] = ((2,), "int64")
    # lengths 1, 2 (shorter than n = 3), 3 (= n), longer; each terminated and truncated
    lengths = [1, 1, 2, 2, 3, 3, 5, 8, 9]
    terminated = {i: (i % 2 == 0) for i in range(len(lengths))}
    episodes = {i: make_dqn_episode(rng, T, obs_shape, A, i) for i, T in enumerate(lengths)}
    buf = buffers(schema, sum(T + 1 for T in lengths))
    for i, ep in episodes.items():
        assert buf.add_episode(ep, priorities=None, terminated=terminated[i]) is True
    num_positions = sum(lengths)
    targets = NStepTargets(n=n, gamma=gamma)
    seen, slot_of = set(), {}
    for r in range(3):
        batch, tags = sample_with_tags(buf, 2 * num_positions + r, targets, seed=300 + r)
        check_sampling_basics(batch, tags, episodes, num_positions, slot_of)
        check_nstep_batch(batch, tags, episodes, terminated, n, gamma, obs_shape)
        seen.update((int(e), int(t)) for e, t in tags)
    missing = _positions(episodes) - seen
    assert not missing, f"positions never sampled: {sorted(missing)[:10]}"
    # both kinds of episode end were exercised: some done=True, and truncated ends not done
    assert any(terminated[e] for e, _ in seen) and not all(terminated[e] for e, _ in seen)


def _plain_frame_stack(frames: np.ndarray, t: int, k: int) -> np.ndarray:
    """Frames t-k+1 .. t of one episode along the first axis, zeros before its start."""
    return np.concatenate([frames[j] if j >= 0 else np.zeros_like(frames[0]) for j in range(t - k + 1, t + 1)])


@pytest.mark.parametrize("k", [2, 4])
def test_nstep_frame_stacks_match_a_plain_loop(buffers, k):
    """uint8 frames stored once, stacked at sample time: every sampled transition's
    observation and next observation are the last k frames of their own episode (zeros
    before its start), through a ring that has wrapped many times."""
    rng = np.random.default_rng(40 + k)
    A, n, gamma, obs_shape = 3, 3, 0.9, (1, 3, 3)
    schema = dict(dqn_schema(observation_shape=obs_shape, observation_dtype="uint8"))
    schema["tag"] = ((2,), "int64")
    capacity = 40
    buf = buffers(schema, capacity)
    episodes, terminated = {}, {}
    for ep_id in range(30):
        T = int(rng.integers(1, 10))
        ep = make_dqn_episode(rng, T, obs_shape, A, ep_id)
        ep["observation"] = rng.integers(1, 256, (T + 1, *obs_shape)).astype(np.uint8)  # 0 only as padding
        episodes[ep_id], terminated[ep_id] = ep, bool(ep_id % 2)
        assert buf.add_episode(ep, priorities=None, terminated=terminated[ep_id]) is True
    targets = NStepTargets(n=n, gamma=gamma, frame_stack=k)
    batch, tags = sample_with_tags(buf, 3 * capacity, targets, seed=5)
    d = batch.data
    assert d["observation"].dtype == np.uint8 and d["observation"].shape == (len(tags), k, 3, 3)
    positions = set()
    for b, (ep_id, t) in enumerate(tags):
        ep = episodes[int(ep_id)]
        T = ref.episode_length(ep)
        m = min(n, T - int(t))
        np.testing.assert_array_equal(d["observation"][b], _plain_frame_stack(ep["observation"], int(t), k))
        np.testing.assert_array_equal(d["next_observation"][b], _plain_frame_stack(ep["observation"], int(t) + m, k))
        positions.add(int(t))
    assert {0, 1} <= positions and max(positions) >= k  # padded and unpadded stacks both drawn


def test_nstep_targets_on_muzero_schema(buffers):
    # n-step transitions come "from the same storage": they also work on a MuZero schema
    rng = np.random.default_rng(77)
    A, n, gamma, obs_shape = 3, 3, 0.8, (4,)
    schema = dict(muzero_schema(observation_shape=obs_shape, num_actions=A))
    schema["tag"] = ((2,), "int64")
    lengths = [1, 4, 6]
    terminated = {0: True, 1: False, 2: True}
    episodes = {i: make_episode(rng, T, obs_shape, A, 1, "none", i)
                for i, T in enumerate(lengths)}
    buf = buffers(schema, sum(T + 1 for T in lengths))
    for i, ep in episodes.items():
        assert buf.add_episode(ep, priorities=None, terminated=terminated[i]) is True
    batch, tags = sample_with_tags(buf, 2 * sum(lengths), NStepTargets(n=n, gamma=gamma),
                                   seed=9)
    check_nstep_batch(batch, tags, episodes, terminated, n, gamma, obs_shape)


def test_gather_rows_matches_fancy_indexing_on_every_layout():
    """The compiled gather against numpy's ``src[rows]``: 1-D, 2-D, (C, H, W) rows, strided
    record views (as the shared buffer has) and a view whose rows are not contiguous."""
    from mpper.replay.targets import gather_rows

    rng = np.random.default_rng(0)
    records = np.zeros(50, np.dtype([("a", "<i8"), ("b", "<f4", (3,)), ("c", "<f4", (2, 3, 4))], align=True))
    for name in ("a", "b", "c"):
        records[name] = rng.random(records[name].shape) * 100
    arrays = [records["a"], records["b"], records["c"], rng.random((50, 4, 6))[:, ::2, :], rng.random(50)]
    rows = rng.integers(0, 50, 37)
    for src in arrays:
        out = gather_rows(src, rows)
        np.testing.assert_array_equal(out, src[rows])
        assert out.flags.c_contiguous and out.dtype == src.dtype
