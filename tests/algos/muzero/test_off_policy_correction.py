"""EfficientZero's off-policy correction (``muzero.off_policy_correction``) against the paper.

Ye et al. 2021 (sec. 4.3 and appendix): the value target of a position whose data was
generated at training step T_st bootstraps after
l = clip(k - floor((T_current - T_st) / (tau * T_total)), 1, k) moves instead of k. The
reference is :func:`paper_horizon` and tests/seed_reference.py's n-step value target with
that l (rewards to the episode's end, the stored, reanalysed where refreshed, value at
t + l; the end of a terminated or truncated episode as for k). The batches come from a
real ``ReplayBuffer`` through ``MuZeroTargets`` and through the learner's sampler.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import seed_reference as ref
import torch
from test_learner import ACTIONS, OBS, _store_for, small_config
from test_selfplay import TIME_LIMIT, make_config
from test_targets import make_episode, sample_with_tags
from test_train_e2e import ROOT

from mpper import ReplayBuffer
from mpper.algos.configs import load_config
from mpper.algos.muzero.algorithm import make_targets
from mpper.algos.muzero.networks import make_network
from mpper.algos.muzero.player import BatchedPlayer
from mpper.algos.muzero.targets import WEIGHTS_STEP, MuZeroTargets, muzero_schema
from mpper.runtime.roles import Learner
from mpper.runtime.setup import RunSetup

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

K_TD, UNROLL, DISCOUNT, A = 5, 4, 0.9, 3
# tau * T_total = 100 training steps exactly (a float boundary case would be ambiguous)
TAU, T_TOTAL, T_CURRENT = 0.25, 400, 1000
# ages T_current - T_st: l = 5 (fresh, and data "newer" than the step: a clip at k), 4, 3,
# 2, 1 at the boundary of each window, and clipped at 1 (k - floor(age / 100) < 1)
AGES = (0, -30, 99, 100, 250, 399, 400, 499, 650, 1000)


def paper_horizon(k: int, t_current: int, t_st: int, tau: float, t_total: int) -> int:
    """The paper's l = (k - floor((T_current - T_st) / (tau * T_total))).clip(1, k)."""
    return int(np.clip(k - math.floor((t_current - t_st) / (tau * t_total)), 1, k))


def test_paper_horizon_by_hand():
    assert [paper_horizon(K_TD, T_CURRENT, T_CURRENT - age, TAU, T_TOTAL) for age in AGES] == \
        [5, 5, 5, 4, 3, 2, 1, 1, 1, 1]  # fmt: skip
    assert paper_horizon(5, 29999, 0, 0.3, 100000) == 5 and paper_horizon(5, 30000, 0, 0.3, 100000) == 4


def filled_buffer(buffers_made: list, players, truncated, seed: int):
    """Random episodes (tests/algos/muzero/test_targets.make_episode, reanalysed values
    on about half the rows) with a weights step per row such that the rows' ages at
    T_CURRENT go through AGES; returns (buffer, episodes, terminated by id)."""
    rng = np.random.default_rng(seed)
    schema = dict(muzero_schema(OBS, A))
    schema["tag"] = ((2,), "int64")
    lengths = [1, 3, 6, 9, 14, 20]
    buf = ReplayBuffer.create(schema, capacity=sum(T + 1 for T in lengths), alpha=0.0, priority_eps=1e-6,
                              priority_clip=None)  # fmt: skip
    buffers_made.append(buf)
    episodes, terminated = {}, {}
    for ep_id, T in enumerate(lengths):
        ep = make_episode(rng, T, OBS, A, players, "mixed", ep_id)
        terminated[ep_id] = ep_id not in truncated
        if not terminated[ep_id]:
            ep["root_value"][T] = rng.standard_normal()
        ep[WEIGHTS_STEP] = T_CURRENT - np.array(AGES)[(np.arange(T + 1) + ep_id) % len(AGES)]
        episodes[ep_id] = ep
        assert buf.add_episode(ep, terminated=terminated[ep_id])
    return buf, episodes, terminated


@pytest.fixture
def buffers_made():
    made: list = []
    yield made
    for buf in made:
        buf.close()


def corrected(**keys) -> MuZeroTargets:
    return MuZeroTargets(UNROLL, K_TD, DISCOUNT, A, off_policy_correction=True, total_training_steps=T_TOTAL,
                         auto_td_steps_ratio=TAU, **keys)  # fmt: skip


@pytest.mark.parametrize("players,truncated", [(1, ()), (2, ()), (1, (1, 3, 5))],
                         ids=["one-player", "two-player", "truncated"])  # fmt: skip
def test_corrected_value_targets_are_the_papers(buffers_made, players, truncated):
    buf, episodes, terminated = filled_buffer(buffers_made, players, truncated, seed=7 + players + len(truncated))
    positions = sum(ref.episode_length(ep) for ep in episodes.values())
    horizons = set()
    for r in range(3):
        batch, tags = sample_with_tags(buf, 3 * positions, None, seed=r)
        slots = batch.indices
        pos, moves = tags[:, 1], np.array([ref.episode_length(episodes[e]) for e in tags[:, 0]])
        term = np.array([terminated[e] for e in tags[:, 0]])
        got = corrected().build(buf.fields, slots, pos, moves, term, np.random.default_rng(r), training_step=T_CURRENT)
        plain = MuZeroTargets(UNROLL, K_TD, DISCOUNT, A).build(buf.fields, slots, pos, moves, term,
                                                               np.random.default_rng(r))  # fmt: skip
        for b, (ep_id, t) in enumerate(tags):
            ep = episodes[ep_id]
            horizon = paper_horizon(K_TD, T_CURRENT, int(ep[WEIGHTS_STEP][t]), TAU, T_TOTAL)
            horizons.add(horizon)
            values, _, _, _ = ref.make_target(ep, t, UNROLL, horizon, DISCOUNT, A, terminated[ep_id])
            np.testing.assert_allclose(got["target_value"][b], values, rtol=1e-5, atol=1e-5,
                                       err_msg=f"episode {ep_id} position {t} l={horizon}")  # fmt: skip
        for key in plain:  # only the value targets change
            if key != "target_value":
                np.testing.assert_array_equal(got[key], plain[key], err_msg=key)
    assert horizons == {1, 2, 3, 4, 5}
    # the correction changed targets: some rows of the batch differ from the uncorrected ones
    assert not np.allclose(got["target_value"], plain["target_value"])


def test_correction_off_gives_todays_targets(buffers_made):
    """Off (the default of every shipped config): td_steps whatever the data's age, the
    targets of the reference at k; on, with every age <= 0, the same bits."""
    buf, episodes, terminated = filled_buffer(buffers_made, 2, (2, 4), seed=3)
    positions = sum(ref.episode_length(ep) for ep in episodes.values())
    batch, tags = sample_with_tags(buf, 3 * positions, None, seed=1)
    pos, moves = tags[:, 1], np.array([ref.episode_length(episodes[e]) for e in tags[:, 0]])
    term = np.array([terminated[e] for e in tags[:, 0]])
    args = (buf.fields, batch.indices, pos, moves, term)
    off = MuZeroTargets(UNROLL, K_TD, DISCOUNT, A).build(*args, np.random.default_rng(0), training_step=T_CURRENT)
    for b, (ep_id, t) in enumerate(tags):
        values, _, _, _ = ref.make_target(episodes[ep_id], t, UNROLL, K_TD, DISCOUNT, A, terminated[ep_id])
        np.testing.assert_allclose(off["target_value"][b], values, rtol=1e-5, atol=1e-5)
    oldest = int(buf.fields[WEIGHTS_STEP].min())
    fresh = corrected().build(*args, np.random.default_rng(0), training_step=oldest)
    for key in off:
        np.testing.assert_array_equal(fresh[key], off[key], err_msg=key)
    shipped = [load_config(path, check_env=False) for path in sorted((ROOT / "mpper" / "configs").glob("*.json"))]
    muzero = [config for config in shipped if config.algorithm == "muzero"]
    built = [make_targets(config, 2) for config in muzero]
    assert len(built) >= 5 and not any(getattr(t, "inner", t).off_policy_correction for t in built)


def test_correction_needs_the_learners_step(buffers_made):
    buf, episodes, terminated = filled_buffer(buffers_made, 1, (), seed=4)
    slots = np.array([0], np.int64)
    with pytest.raises(ValueError, match="needs the learner's training_step"):
        corrected().build(buf.fields, slots, slots, np.array([1]), np.array([True]), np.random.default_rng(0))
    with pytest.raises(ValueError, match="total_training_steps >= 1"):
        MuZeroTargets(UNROLL, K_TD, DISCOUNT, A, off_policy_correction=True, total_training_steps=0)


def test_the_learner_builds_its_batches_at_its_training_step(buffers_made, tmp_path):
    """``Learner.sample(step)``: the buffer's targets of the config's correction, aged at
    ``step``; data of weights step 0, T_total 100, tau 0.3: l = 5 at step 0, 2 at 90
    (floor(90 / 30) = 3), 1 at 200."""
    config = small_config(training_steps=100, batch_size=64, td_steps=5, off_policy_correction=True,
                          auto_td_steps_ratio=0.3)  # fmt: skip
    rng = np.random.default_rng(2)
    schema = dict(muzero_schema(OBS, ACTIONS))
    schema["tag"] = ((2,), "int64")
    buf = ReplayBuffer.create(schema, capacity=512, alpha=0.0)
    buffers_made.append(buf)
    episodes = {}
    for ep_id in range(6):
        ep = make_episode(rng, int(rng.integers(8, 20)), OBS, ACTIONS, 1, "none", ep_id)
        ep[WEIGHTS_STEP] = np.zeros(len(ep["action"]), np.int64)
        episodes[ep_id] = ep
        buf.add_episode(ep)
    store = _store_for(config)
    try:
        learner = Learner(RunSetup.create(config, tmp_path), buf, store)
        for step, horizon in ((0, 5), (90, 2), (200, 1)):
            batch = learner.sample(step)
            tags = buf.fields["tag"][batch.indices]
            for b, (ep_id, t) in enumerate(tags):
                values, _, _, _ = ref.make_target(episodes[ep_id], t, config.muzero.num_unroll_steps, horizon,
                                                  config.mcts.discount, ACTIONS)  # fmt: skip
                np.testing.assert_allclose(batch.data["target_value"][b], values, rtol=1e-5, atol=1e-5,
                                           err_msg=f"step {step}, episode {ep_id}, position {t}")  # fmt: skip
    finally:
        store.close()


def test_self_play_stores_the_training_step_of_the_weights_of_each_move():
    """Each row holds the step ``BatchedPlayer.step`` was told the weights are of when it
    searched that row's observation; row T the last move's; through ``stored`` as the
    buffer gets it."""
    config = make_config()
    torch.manual_seed(0)
    net = make_network(config.network, (4,), 2).eval()
    envs = [gym.wrappers.TimeLimit(gym.make("CartPole-v1").unwrapped, TIME_LIMIT) for _ in range(3)]
    player = BatchedPlayer(config, envs, net, explore=True, seed=1)
    finished, moves = [], 0
    while len(finished) < 4:
        moves += 1
        finished += [(ep, moves) for ep in player.step(0.0, training_step=10 * moves)]
    for ep, last_move in finished:
        arrays, _ = player.stored(ep)
        T = ep.moves
        expected = 10 * np.arange(last_move - T + 1, last_move + 1)
        np.testing.assert_array_equal(arrays[WEIGHTS_STEP], np.r_[expected, expected[-1]])
        assert arrays[WEIGHTS_STEP].dtype == np.int64
