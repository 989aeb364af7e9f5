"""DQN pieces alone: Q-network, exploration, TD errors, the trainer, the player.

The end-to-end runs (processes, snapshots, checkpoints) are in test_train_e2e.py.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from mpper import ReplayBuffer
from mpper.algos.configs import config_from_dict
from mpper.algos.dqn.dqn import DQNTrainer, EpsilonGreedyPlayer, QNetwork, apex_epsilons, decayed_epsilon, td_errors
from mpper.algos.dqn.targets import NStepTargets, dqn_schema
from mpper.algos.registry import algorithm_of
from mpper.checkpoint import load_checkpoint, save_checkpoint


def dqn_config(replay=None, **dqn):
    return config_from_dict({
        "algorithm": "dqn",
        "dqn": {"hidden": [32, 32], "n_step": 3, "gamma": 0.9, **dqn},
        "replay": replay or {},
        "training": {"batch_size": 16, "min_buffer_steps": 16, "lr_init": 1e-2, "weight_decay": 0.0},
        "runtime": {"workers": 2, "envs_per_worker": 3},
    }, check_env=False)  # fmt: skip


def plain_td(q_online, q_target, ep, t, n, gamma, terminated, double):
    """One TD error by the textbook, with loops: Q(s_t, a_t) - (R + gamma^m * bootstrap)."""
    T = len(ep["observation"]) - 1
    m = min(n, T - t)
    ret = sum(gamma**i * float(ep["reward"][t + 1 + i]) for i in range(m))
    done = terminated and t + m == T
    if done:
        bootstrap = 0.0
    elif double:
        bootstrap = q_target[t + m][int(np.argmax(q_online[t + m]))]
    else:
        bootstrap = max(q_target[t + m])
    return q_online[t][int(ep["action"][t + 1])] - (ret + gamma**m * bootstrap)


def cartpole_episodes(truncate_at: int):
    """Real CartPole episodes from the epsilon-greedy player: random play terminates
    early, and a time limit of ``truncate_at`` cuts the lucky ones (truncated)."""
    config = dqn_config(exploration="decay", epsilon_start=1.0, epsilon_end=1.0)
    envs = [gym.make("CartPole-v1", max_episode_steps=truncate_at) for _ in range(4)]
    net = QNetwork((4,), 2, [32, 32]).eval()
    player = EpsilonGreedyPlayer(config, envs, net, explore=True, seed=0)
    done = []
    while not (any(ep.terminated for ep in done) and any(not ep.terminated for ep in done)):
        done += player.step()
    return config, net, done


# ---- exploration ------------------------------------------------------------------------------


def test_apex_epsilons_follow_the_paper_formula():
    eps = apex_epsilons(0.4, 7.0, 8)
    expected = [0.4 ** (1 + i * 7 / 7) for i in range(8)]
    np.testing.assert_allclose(eps, expected)
    assert eps[0] == pytest.approx(0.4) and eps[-1] == pytest.approx(0.4**8)
    np.testing.assert_allclose(apex_epsilons(0.4, 7.0, 1), [0.4])


def test_decayed_epsilon_is_the_seed_schedule():
    assert decayed_epsilon(0.95, 0.01, 500, 0) == pytest.approx(0.95)
    assert decayed_epsilon(0.95, 0.01, 500, 500) == pytest.approx(0.01 + 0.94 * math.exp(-1))
    assert decayed_epsilon(0.95, 0.01, 500, 10**6) == pytest.approx(0.01)


def test_the_decaying_epsilon_follows_the_actors_own_clock_as_it_plays():
    """With ``exploration: "decay"`` each step of the player advances the schedule:
    after n steps every env explores with ``decayed_epsilon(start, end, decay, n)``, so
    that a player which has decayed to epsilon 0 takes the greedy action everywhere."""
    config = dqn_config(exploration="decay", epsilon_start=1.0, epsilon_end=0.0, epsilon_decay=5)
    envs = [gym.make("CartPole-v1") for _ in range(4)]
    net = QNetwork((4,), 2, [8]).eval()
    player = EpsilonGreedyPlayer(config, envs, net, explore=True, seed=3)
    for n in range(60):
        np.testing.assert_allclose(player.current_epsilons(), np.full(4, decayed_epsilon(1.0, 0.0, 5, n)))
        player.step()
    # past 12 time constants epsilon is below 1e-5: every action is the network's argmax
    for _ in range(20):
        observations = np.stack([ep.observation[-1] for ep in player.episodes]).astype(np.float32)
        greedy = net(torch.from_numpy(observations)).argmax(dim=1).numpy()
        before = [len(ep.action) for ep in player.episodes]
        player.step()
        taken = [ep.action[n] if len(ep.action) > n else None for ep, n in zip(player.episodes, before)]
        for k, action in enumerate(taken):
            if action is not None:  # None: that env's episode ended and it was reset
                assert action == greedy[k]


def test_each_env_of_each_worker_is_one_apex_actor():
    config = dqn_config()  # 2 workers x 3 envs = 6 actors
    all_eps = apex_epsilons(0.4, 7.0, 6)
    for worker in range(2):
        envs = [gym.make("CartPole-v1") for _ in range(3)]

        player = algorithm_of(config).make_player(config, envs, QNetwork((4,), 2, [8]).eval(), explore=True, seed=1, worker_id=worker)
        np.testing.assert_allclose(player.current_epsilons(), all_eps[3 * worker : 3 * worker + 3])
        greedy = algorithm_of(config).make_player(config, envs, QNetwork((4,), 2, [8]).eval(), explore=False, seed=1)
        assert (greedy.current_epsilons() == 0).all()


def test_greedy_player_takes_the_argmax_action():
    config = dqn_config()
    net = QNetwork((4,), 2, [8]).eval()
    with torch.no_grad():  # a network that always prefers action 1
        net.advantage.weight.zero_()
        net.advantage.bias.copy_(torch.tensor([0.0, 1.0]))
    player = EpsilonGreedyPlayer(config, [gym.make("CartPole-v1")], net, explore=False, seed=3)
    episodes = []
    while not episodes:
        episodes = player.step()
    assert set(episodes[0].action[1:]) == {1}


# ---- terminated vs truncated, TD errors ---------------------------------------------------


def test_player_keeps_terminated_and_truncated_apart_and_rows_follow_the_layout():
    _, _, episodes = cartpole_episodes(truncate_at=20)
    for ep in episodes:
        a = ep.arrays()
        T = ep.moves
        assert a["observation"].shape == (T + 1, 4) and a["action"].shape == (T + 1,)
        assert a["action"][0] == 0 and a["reward"][0] == 0.0
        assert (a["reward"][1:] == 1.0).all()  # CartPole pays 1 per step, the last included
        assert ep.terminated == (T < 20)  # cut at 20 moves: truncated, not terminated


@pytest.mark.parametrize("n", [1, 3])
def test_initial_td_errors_match_a_plain_loop_at_termination_and_truncation(n):
    config, net, episodes = cartpole_episodes(truncate_at=12)
    for ep in episodes:
        arrays = ep.arrays()
        with torch.no_grad():
            q = net(torch.from_numpy(arrays["observation"])).double().numpy()
        got = td_errors(net, arrays, ep.terminated, n, 0.9)
        want = [abs(plain_td(q, q, arrays, t, n, 0.9, ep.terminated, double=True)) for t in range(ep.moves)]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        if not ep.terminated:  # a truncated end bootstraps: the last error includes gamma * max Q(o_T)
            last = abs(1.0 + 0.9 * q[-1].max() - q[-2][arrays["action"][-1]])
            assert got[-1] == pytest.approx(last, rel=1e-6)
        else:  # a terminated end does not
            assert got[-1] == pytest.approx(abs(1.0 - q[-2][arrays["action"][-1]]), rel=1e-6)


@pytest.mark.parametrize("terminated", [True, False])
def test_initial_td_errors_of_a_long_frame_stacked_episode_go_through_the_network_in_chunks(monkeypatch, terminated):
    """An episode longer than ``TD_ERROR_CHUNK_ROWS`` (the actor's memory bound): the
    chunks' stacks reach back over chunk borders, and the errors are a plain loop's
    (stacks built frame by frame, zeros before the episode's start)."""
    import mpper.algos.dqn.dqn as dqn_module

    monkeypatch.setattr(dqn_module, "TD_ERROR_CHUNK_ROWS", 8)  # 30 moves: 8, 8, 8 and 7 rows padded to 8
    rng = np.random.default_rng(0)
    T, k, n, gamma = 30, 3, 3, 0.9
    arrays = {"observation": rng.normal(size=(T + 1, 2)).astype(np.float32),
              "action": np.r_[0, rng.integers(0, 2, T)].astype(np.int64),
              "reward": np.r_[0.0, rng.normal(size=T)].astype(np.float32)}  # fmt: skip
    net = QNetwork((k * 2,), 2, [8]).eval()
    stacks = np.zeros((T + 1, k * 2), np.float32)
    for t in range(T + 1):
        for j in range(k):  # frame t - (k - 1 - j) in slot j
            if t - (k - 1 - j) >= 0:
                stacks[t, 2 * j : 2 * j + 2] = arrays["observation"][t - (k - 1 - j)]
    with torch.no_grad():
        q = net(torch.from_numpy(stacks)).double().numpy()
    got = td_errors(net, arrays, terminated, n, gamma, frame_stack=k)
    want = [abs(plain_td(q, q, arrays, t, n, gamma, terminated, double=True)) for t in range(T)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_new_and_updated_priorities_obey_the_same_clip():
    """The run's buffer clips every raw priority at ``dqn.priority_clip``: the actors'
    |TD| errors, the "max" default of new episodes (which starts at 1, above a clip
    below 1) and the learner's updates alike."""
    from mpper.envs import env_spec
    from mpper.runtime.run import create_buffer

    net = QNetwork((4,), 2, [8]).eval()
    for initial in ("actor", "max"):
        config = dqn_config(priority_clip=0.05, replay={"initial_priority": initial})
        config = dataclasses.replace(config, replay=dataclasses.replace(config.replay, alpha=0.5, priority_eps=1e-3))
        buf = create_buffer(config, env_spec(config.env))
        try:
            player = EpsilonGreedyPlayer(config, [gym.make("CartPole-v1")], net, explore=True, seed=0)
            while not (done := player.step()):
                pass
            arrays, priorities = player.stored(done[0])
            assert (priorities is None) == (initial == "max")
            buf.add_episode(arrays, priorities, done[0].terminated)
            T = done[0].moves
            raw = np.ones(T) if priorities is None else priorities  # "max" so far: 1 in a new buffer
            expected = np.minimum(raw + 1e-3, 0.05) ** 0.5
            np.testing.assert_allclose(buf.priorities(np.arange(T)), expected, rtol=1e-12)
            assert raw.max() > 0.05  # the clip did something
            batch = buf.sample(8, 0.4, rng=np.random.default_rng(0))
            buf.update_priorities(batch.indices, batch.generations, np.full(8, 7.0))
            np.testing.assert_allclose(buf.priorities(batch.indices), 0.05**0.5, rtol=1e-12)
        finally:
            buf.close()


# ---- the trainer -------------------------------------------------------------------------------


def trainer_and_batch(tmp_path=None, **dqn):
    config = dqn_config(**dqn)
    _, _, episodes = cartpole_episodes(truncate_at=15)
    buf = ReplayBuffer.create(dqn_schema((4,)), 2000, alpha=0.6)
    for ep in episodes:
        buf.add_episode(ep.arrays(), None, ep.terminated)
    trainer = DQNTrainer(config, QNetwork((4,), 2, [32, 32], dueling=config.dqn.dueling), torch.device("cpu"))
    targets = algorithm_of(config).make_targets(config, 2)
    assert isinstance(targets, NStepTargets) and targets.n == 3
    return config, buf, trainer, targets


@pytest.mark.parametrize("double", [True, False])
@pytest.mark.parametrize("loss", ["huber", "mse"])
def test_train_step_loss_and_priorities_match_the_formulas(double, loss):
    config, buf, trainer, targets = trainer_and_batch(double=double, loss=loss, target_update_interval=1000)
    try:
        for i in range(3):  # move the online net away from the target net, priorities apart
            batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(i))
            buf.update_priorities(batch.indices, batch.generations, trainer.train_step(batch)[1])
        batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(7))
        d = batch.data
        with torch.no_grad():
            q = trainer.network(torch.from_numpy(d["observation"])).double()
            q_next_online = trainer.network(torch.from_numpy(d["next_observation"])).double()
            q_next_target = trainer.target_network(torch.from_numpy(d["next_observation"])).double()
        td = []
        for b in range(16):
            if d["done"][b]:
                boot = 0.0
            elif double:
                boot = float(q_next_target[b, int(q_next_online[b].argmax())])
            else:
                boot = float(q_next_target[b].max())
            td.append(float(q[b, int(d["action"][b])]) - (float(d["reward"][b]) + float(d["discount"][b]) * boot))
        td = np.array(td)
        per = np.where(np.abs(td) < 1, 0.5 * td**2, np.abs(td) - 0.5) if loss == "huber" else td**2
        want_loss = float(np.mean(per * batch.weights))
        metrics, priorities = trainer.train_step(batch)
        assert metrics["total_loss"] == pytest.approx(want_loss, rel=1e-4)
        np.testing.assert_allclose(priorities, np.abs(td), rtol=1e-4, atol=1e-5)
        assert (batch.weights < 1).any()  # the importance weights were not all 1: they mattered
    finally:
        buf.close()


def test_adopted_weights_go_into_the_online_and_the_target_network():
    """The learner starts from the supervisor's published weights: both networks take them."""
    config, buf, trainer, _ = trainer_and_batch()
    try:
        other = QNetwork((4,), 2, [32, 32]).get_flat_weights()  # another initialisation
        assert not np.array_equal(other, trainer.network.get_flat_weights())
        trainer.adopt_weights(other)
        np.testing.assert_array_equal(trainer.network.get_flat_weights(), other)
        np.testing.assert_array_equal(trainer.target_network.get_flat_weights(), other)
    finally:
        buf.close()


def test_target_network_is_a_copy_that_lags_and_hard_sync_makes_it_equal():
    config, buf, trainer, targets = trainer_and_batch(target_update_interval=3)
    try:
        online, target = trainer.network, trainer.target_network
        assert online is not target
        for a, b in zip(online.parameters(), target.parameters()):
            assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)  # a copy, equal at the start
        rng = np.random.default_rng(0)
        trainer.train_step(buf.sample(16, 0.4, targets=targets, rng=rng))
        assert any(not torch.equal(a, b) for a, b in zip(online.parameters(), target.parameters()))
        trainer.train_step(buf.sample(16, 0.4, targets=targets, rng=rng))
        assert any(not torch.equal(a, b) for a, b in zip(online.parameters(), target.parameters()))
        trainer.train_step(buf.sample(16, 0.4, targets=targets, rng=rng))  # step 3: hard sync
        assert all(torch.equal(a, b) for a, b in zip(online.parameters(), target.parameters()))
        assert not any(p.requires_grad for p in target.parameters())
    finally:
        buf.close()


def test_soft_update_moves_the_target_by_tau():
    config, buf, trainer, targets = trainer_and_batch(target_update="soft", tau=0.25)
    try:
        before = [p.detach().clone() for p in trainer.target_network.parameters()]
        trainer.train_step(buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(0)))
        for old, new, online in zip(before, trainer.target_network.parameters(), trainer.network.parameters()):
            torch.testing.assert_close(new, 0.75 * old + 0.25 * online.detach())
    finally:
        buf.close()


def test_gradient_value_clipping():
    config, buf, trainer, targets = trainer_and_batch(grad_clip_value=1e-3, priority_clip=0.01)
    try:
        before = [p.detach().clone() for p in trainer.network.parameters()]
        _, priorities = trainer.train_step(buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(0)))
        for p in trainer.network.parameters():
            assert p.grad.abs().max() <= 1e-3 + 1e-12
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.network.parameters()))
    finally:
        buf.close()


@pytest.mark.parametrize("grad_clip, clip_value", [(None, None), (1e-2, None), (1e3, None), (1e-2, 2e-3)])
def test_trainer_backward_clips_as_torch_does(grad_clip, clip_value):
    """``Trainer.backward`` against torch's own ``clip_grad_value_`` and
    ``clip_grad_norm_`` on a copy of the same network and loss: the same gradients, and
    the norm before the norm clipping."""
    config = dataclasses.replace(dqn_config(), training=dataclasses.replace(dqn_config().training, grad_clip=grad_clip))
    torch.manual_seed(0)
    trainer = DQNTrainer(config, QNetwork((4,), 2, [32, 32], dueling=True), torch.device("cpu"))
    reference = QNetwork((4,), 2, [32, 32], dueling=True)
    reference.load_state_dict(trainer.network.state_dict())
    x = torch.randn(16, 4)
    norm = trainer.backward(trainer.network(x).pow(2).mean() * 50, clip_value=clip_value)
    reference(x).pow(2).mean().mul(50).backward()
    params = list(reference.parameters())
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(params, clip_value)
    if grad_clip is not None:
        expected_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        expected_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.testing.assert_close(norm, expected_norm)
    for ours, theirs in zip(trainer.network.parameters(), params):
        torch.testing.assert_close(ours.grad, theirs.grad)
    if grad_clip == 1e-2:  # the clip did something
        assert float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in params]))) < float(norm)


def test_dueling_head_combines_value_and_centred_advantage():
    net = QNetwork((4,), 3, [8], dueling=True)
    x = torch.randn(5, 4)
    h = net.body(x)
    adv = net.advantage(h)
    torch.testing.assert_close(net(x), net.value(h) + adv - adv.mean(1, keepdim=True))
    flat = net.get_flat_weights()
    other = QNetwork((4,), 3, [8], dueling=True)
    other.set_flat_weights(flat)
    torch.testing.assert_close(other(x), net(x))


def test_trainer_checkpoint_round_trip_keeps_the_target_network(tmp_path):
    config, buf, trainer, targets = trainer_and_batch(target_update_interval=1000)
    try:
        rng = np.random.default_rng(0)
        for _ in range(4):
            trainer.train_step(buf.sample(16, 0.4, targets=targets, rng=rng))
        save_checkpoint(tmp_path / "c.pt", trainer)
        fresh = DQNTrainer(config, QNetwork((4,), 2, [32, 32]), torch.device("cpu"))
        fresh.load_state_dict(load_checkpoint(tmp_path / "c.pt"))
        assert fresh.training_step == 4
        for a, b in zip(fresh.target_network.parameters(), trainer.target_network.parameters()):
            assert torch.equal(a, b)
        for a, b in zip(fresh.network.parameters(), trainer.network.parameters()):
            assert torch.equal(a, b)
        batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(9))
        m1, p1 = trainer.train_step(batch)
        m2, p2 = fresh.train_step(batch)
        assert m1["total_loss"] == m2["total_loss"]
        np.testing.assert_array_equal(p1, p2)
    finally:
        buf.close()


def test_non_finite_loss_raises_before_the_step():
    config, buf, trainer, targets = trainer_and_batch()
    try:
        batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(0))
        batch.data["reward"][0] = np.nan
        before = [p.detach().clone() for p in trainer.network.parameters()]
        with pytest.raises(FloatingPointError, match="training step 0"):
            trainer.train_step(batch)
        assert trainer.training_step == 0
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.network.parameters()))
    finally:
        buf.close()


def test_dqn_config_rejects_muzero_only_options():
    from mpper.config import ConfigError

    with pytest.raises(ConfigError, match='network: a section of algorithm "muzero", not of "dqn"'):
        config_from_dict({"algorithm": "dqn", "network": {"kind": "residual"}}, check_env=False)
    with pytest.raises(ConfigError, match="training.stacked_observations: renamed to muzero.stacked_observations"):
        config_from_dict({"algorithm": "dqn", "training": {"stacked_observations": 2}}, check_env=False)


# ---- offline objectives: CQL(H) and behaviour cloning ----------------------------------------


def _plain_huber(x: float) -> float:
    return 0.5 * x * x if abs(x) < 1 else abs(x) - 0.5


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_the_cql_loss_and_its_gradient_match_the_paper_written_as_a_loop(alpha):
    """CQL(H) for discrete actions (Kumar et al., 2020, eq. 4 with the entropy regulariser):
    alpha * E_s[log sum_a exp Q(s, a) - E_{a ~ data} Q(s, a)] added to the TD loss; here a
    sample at a time, the soft maximum as log(sum(exp)), against the trainer's one step."""
    config, buf, trainer, targets = trainer_and_batch(cql_alpha=alpha, target_update_interval=1000)
    config.training.grad_clip = None  # compare raw gradients
    try:
        for i in range(2):
            batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(i))
            buf.update_priorities(batch.indices, batch.generations, trainer.train_step(batch)[1])
        batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(9))
        d = batch.data
        reference = copy.deepcopy(trainer.network)
        with torch.no_grad():
            q_next_online = trainer.network(torch.from_numpy(d["next_observation"])).double()
            q_next_target = trainer.target_network(torch.from_numpy(d["next_observation"])).double()
        losses, penalties = [], []
        for b in range(16):
            q = reference(torch.from_numpy(d["observation"][b : b + 1]))[0].double()
            a = int(d["action"][b])
            boot = 0.0 if d["done"][b] else float(q_next_target[b, int(q_next_online[b].argmax())])
            target = float(d["reward"][b]) + float(d["discount"][b]) * boot
            td = q[a] - target
            huber = 0.5 * td * td if abs(float(td.detach())) < 1 else td.abs() - 0.5
            soft_max = torch.log(sum(torch.exp(q[k]) for k in range(q.shape[0])))
            penalties.append(float((soft_max - q[a]).detach()))
            assert penalties[-1] == pytest.approx(math.log(sum(math.exp(float(v)) for v in q.detach())) - float(q[a].detach()))
            assert float(huber.detach()) == pytest.approx(_plain_huber(float(td.detach())))
            losses.append(float(batch.weights[b]) * (huber + alpha * (soft_max - q[a])))
        want = sum(losses) / 16
        want.backward()
        metrics, _ = trainer.train_step(batch)
        assert metrics["total_loss"] == pytest.approx(float(want.detach()), rel=1e-4)
        assert metrics["cql_loss"] == pytest.approx(float(np.mean(np.array(penalties) * batch.weights)), rel=1e-4)
        for mine, theirs in zip(trainer.network.parameters(), reference.parameters()):
            np.testing.assert_allclose(mine.grad.numpy(), theirs.grad.numpy(), rtol=1e-3, atol=1e-6)
    finally:
        buf.close()


def test_cql_alpha_zero_is_plain_dqn():
    results = []
    for alpha in (0.0, None):
        _, buf, trainer, targets = trainer_and_batch(**({} if alpha is None else {"cql_alpha": alpha}))
        torch.manual_seed(0)
        trainer.network.load_state_dict(QNetwork((4,), 2, [32, 32]).state_dict())
        trainer.sync_target()
        try:
            batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(3))
            metrics, priorities = trainer.train_step(batch)
            results.append((metrics["total_loss"], priorities, "cql_loss" in metrics))
        finally:
            buf.close()
    assert results[0][0] == results[1][0] and not results[0][2]
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_behaviour_cloning_is_the_cross_entropy_of_the_stored_action():
    config, buf, trainer, targets = trainer_and_batch(objective="bc")
    try:
        batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(5))
        d = batch.data
        with torch.no_grad():
            q = trainer.network(torch.from_numpy(d["observation"])).double().numpy()
        per = [math.log(sum(math.exp(v) for v in q[b])) - q[b, int(d["action"][b])] for b in range(16)]
        metrics, priorities = trainer.train_step(batch)
        assert metrics["total_loss"] == pytest.approx(float(np.mean(np.array(per) * batch.weights)), rel=1e-4)
        np.testing.assert_allclose(priorities, per, rtol=1e-4)
        agree = np.mean([int(np.argmax(q[b])) == int(d["action"][b]) for b in range(16)])
        assert metrics["bc_accuracy"] == pytest.approx(agree)
        losses = [trainer.train_step(buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(6 + i)))[0]
                  for i in range(60)]  # fmt: skip
        assert losses[-1]["bc_accuracy"] > 0.5 or losses[-1]["total_loss"] < metrics["total_loss"]
    finally:
        buf.close()


def test_cql_with_behaviour_cloning_is_refused():
    from mpper.config import ConfigError

    with pytest.raises(ConfigError, match='needs dqn.objective "td"'):
        dqn_config(cql_alpha=1.0, objective="bc")
