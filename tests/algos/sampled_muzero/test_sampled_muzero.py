"""Sampled MuZero: the sampled-policy correction and the policy loss against plain loops
written from the paper, the search against the discrete MuZero search when K covers every
action, float actions through episodes, the ring and snapshots, a short Pendulum run with
``--resume``, and the one-line refusals of action spaces."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import mpper
from mpper import cli
from mpper.algos.configs import config_from_dict
from mpper.algos.muzero.config import MCTSConfig, NetworkConfig
from mpper.algos.muzero.gumbel import GumbelMCTS
from mpper.algos.muzero.mcts import BatchedMCTS
from mpper.algos.muzero.networks import make_network as make_muzero_network
from mpper.algos.registry import get_algorithm, run_env_spec
from mpper.algos.sampled_muzero.config import SampledMCTSConfig
from mpper.algos.sampled_muzero.search import SampledSearch, sampled_prior
from mpper.algos.sampled_muzero.targets import SampledTargets
from mpper.algos.sampled_muzero.trainer import sampled_policy_loss
from mpper.envs import make_env
from mpper.replay.buffer import ReplayBuffer
from mpper.runtime.weights import WeightStore

ROOT = Path(__file__).resolve().parents[3]
TINY = ["runtime.device=cpu", "sampled_mcts.num_simulations=6", "sampled_mcts.num_sampled_actions=5",
        "sampled_network.hidden=[16]", "sampled_network.encoding_size=8", "runtime.envs_per_worker=2"]  # fmt: skip


# ---- the sampled-policy correction and the policy loss, against the paper's formulas --------------


def test_the_sampled_prior_is_beta_hat_over_beta_times_pi_as_a_plain_loop_computes_it():
    rng = np.random.default_rng(3)
    k = 9
    actions = rng.choice([-0.5, 0.0, 0.25, 0.5], size=(k, 1))  # repeats on purpose
    log_pi, log_beta = rng.normal(size=k), rng.normal(size=k)
    prior, distinct = sampled_prior(actions, log_pi, log_beta)
    # The paper: prior(a) = beta_hat(a) / beta(a) * pi(a), beta_hat the empirical distribution
    # of the K samples, normalised over the distinct sampled actions.
    weights = {}
    for j in range(k):
        key = float(actions[j, 0])
        if key in weights:
            continue
        count = sum(1 for i in range(k) if float(actions[i, 0]) == key)
        weights[key] = (j, (count / k) / math.exp(log_beta[j]) * math.exp(log_pi[j]))
    total = sum(w for _, w in weights.values())
    expected = np.zeros(k)
    for j, w in weights.values():
        expected[j] = w / total
    np.testing.assert_allclose(prior, expected, rtol=1e-12)
    assert distinct.tolist() == [expected[j] > 0 for j in range(k)]
    assert distinct.sum() == len(set(actions[:, 0].tolist())) < k


def test_with_beta_equal_to_pi_the_prior_is_the_empirical_distribution():
    actions = np.array([[0.1], [0.2], [0.1], [0.3]])
    log_pi = np.log([0.5, 0.2, 0.5, 0.3])
    prior, _ = sampled_prior(actions, log_pi, log_pi)
    np.testing.assert_allclose(prior, [0.5, 0.25, 0.0, 0.25])


def test_the_policy_loss_is_minus_the_visit_weighted_log_density_of_the_sampled_actions():
    network = get_algorithm("sampled_muzero").make_network(config_from_dict({"algorithm": "sampled_muzero"}), (3,), 2)
    rng = np.random.default_rng(0)
    params = torch.tensor(rng.normal(size=(4, 4)), dtype=torch.float32)
    actions = torch.tensor(rng.uniform(-0.95, 0.95, size=(4, 6, 2)), dtype=torch.float32)
    shares = torch.tensor(rng.dirichlet(np.ones(6), size=4), dtype=torch.float32)
    loss = sampled_policy_loss(network, params, actions, shares).numpy()
    for n in range(4):
        mean, log_std = params[n, :2].double().numpy(), params[n, 2:].double().numpy()
        total = 0.0
        for j in range(6):
            log_density = 0.0
            for d in range(2):  # a = tanh(u), u ~ N(mean, std^2): log N(atanh a) - log(1 - a^2)
                a = float(actions[n, j, d])
                u = math.atanh(a)
                std = math.exp(log_std[d])
                log_density += (-0.5 * ((u - mean[d]) / std) ** 2 - math.log(std) - 0.5 * math.log(2 * math.pi)
                                - math.log(1 - a * a))  # fmt: skip
            total -= float(shares[n, j]) * log_density
        assert loss[n] == pytest.approx(total, rel=1e-4, abs=1e-4)


def test_the_policy_target_is_the_visit_distribution_over_the_root_samples():
    config = config_from_dict({"algorithm": "sampled_muzero", "env": {"id": "Pendulum-v1"}}, "x.json", TINY)
    network = get_algorithm("sampled_muzero").make_network(config, (3,), 1).eval()
    search = SampledSearch(config.sampled_mcts, 1, config.sampled_network.support_size)
    result = search.run(network, np.random.default_rng(1).normal(size=(3, 3)).astype(np.float32), True,
                        np.random.default_rng(2))  # fmt: skip
    assert result.actions.shape == (3, 5, 1) and (np.abs(result.actions) < 1).all()
    assert (result.visit_counts.sum(1) == config.sampled_mcts.num_simulations).all()
    np.testing.assert_allclose(result.policy_target, result.visit_counts / config.sampled_mcts.num_simulations)
    np.testing.assert_allclose(result.prior.sum(1), 1.0)


# ---- K = every action: the discrete search's visits and values -------------------------------------

N_POINTS = 5
POINTS = np.linspace(-1.0, 1.0, N_POINTS)


class PointsPolicy:
    """A policy over N_POINTS fixed 1-D actions whose sampler proposes every one of them
    once, in order, from beta = uniform: beta_hat / beta = 1, so the prior is pi."""

    def sample(self, params, count, rng, temperature=1.0):
        assert count == N_POINTS
        actions = np.broadcast_to(POINTS[None, :, None], (len(params), N_POINTS, 1)).copy()
        return actions, np.full((len(params), N_POINTS), -math.log(N_POINTS))

    def log_prob_np(self, params, actions):
        logits = np.asarray(params, np.float64)
        log_softmax = logits - logits.max(1, keepdims=True)
        log_softmax -= np.log(np.exp(log_softmax).sum(1, keepdims=True))
        index = np.rint((actions[..., 0] + 1) / 2 * (N_POINTS - 1)).astype(np.int64)
        return np.take_along_axis(log_softmax, index, 1)


class PointsNetwork(torch.nn.Module):
    """A discrete MuZero network seen as one over the points: action vector -> its index."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def initial_inference(self, observation):
        return self.inner.initial_inference(observation)

    def recurrent_inference(self, hidden_state, action):
        index = torch.round((action[:, 0] + 1) / 2 * (N_POINTS - 1)).long()
        return self.inner.recurrent_inference(hidden_state, index)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_search_sampling_every_action_gives_the_discrete_searchs_visits_and_values(seed):
    torch.manual_seed(seed)
    inner = make_muzero_network(NetworkConfig(encoding_size=6, hidden=[16], support_size=5), (3,), N_POINTS, 0,
                                None).eval()  # fmt: skip
    rng = np.random.default_rng(seed)
    observations = rng.normal(size=(4, 3)).astype(np.float32)
    tie_break = rng.random((4, N_POINTS))
    constants = dict(num_simulations=30, discount=0.95, pb_c_base=19652.0, pb_c_init=1.25)
    discrete = BatchedMCTS(N_POINTS, MCTSConfig(**constants), 5).run(
        inner, observations, np.ones((4, N_POINTS), bool), np.zeros(4, np.int64), False, np.random.default_rng(0),
        tie_break=tie_break)  # fmt: skip
    sampled = SampledSearch(SampledMCTSConfig(num_sampled_actions=N_POINTS, **constants), 1, 5).run(
        PointsNetwork(inner), observations, False, np.random.default_rng(0), policy=PointsPolicy(), tie_break=tie_break)
    np.testing.assert_array_equal(sampled.visit_counts, discrete.visit_counts)
    # values to float32 precision: the discrete search's compiled support decode differs from a
    # float64 one (torch's, this search's) in the eighth digit
    np.testing.assert_allclose(sampled.root_values, discrete.root_values, rtol=1e-6)
    np.testing.assert_allclose(sampled.policy_target, discrete.child_visits, rtol=1e-12)
    assert len({tuple(v) for v in discrete.visit_counts}) > 1  # the roots' searches differ


@pytest.mark.parametrize("seed, explore, bounds", [(0, True, "node"), (1, False, "node"), (2, True, "tree")])
def test_a_gumbel_search_sampling_every_action_gives_the_discrete_gumbel_searchs_result(seed, explore, bounds):
    torch.manual_seed(seed)
    inner = make_muzero_network(NetworkConfig(encoding_size=6, hidden=[16], support_size=5), (3,), N_POINTS, 0,
                                None).eval()  # fmt: skip
    rng = np.random.default_rng(seed)
    observations = rng.normal(size=(4, 3)).astype(np.float32)
    noise = rng.gumbel(size=(4, N_POINTS))
    constants = dict(kind="gumbel", num_simulations=24, discount=0.95, max_num_considered_actions=4, c_visit=50.0,
                     c_scale=0.1, gumbel_q_bounds=bounds)  # fmt: skip
    discrete = GumbelMCTS(N_POINTS, MCTSConfig(**constants), 5).run(
        inner, observations, np.ones((4, N_POINTS), bool), np.zeros(4, np.int64), explore, np.random.default_rng(0),
        root_noise=noise)  # fmt: skip
    sampled = SampledSearch(SampledMCTSConfig(num_sampled_actions=N_POINTS, **constants), 1, 5).run(
        PointsNetwork(inner), observations, explore, np.random.default_rng(0), policy=PointsPolicy(), root_noise=noise)
    np.testing.assert_array_equal(sampled.chosen, discrete.actions)
    np.testing.assert_array_equal(sampled.visit_counts, discrete.visit_counts)
    np.testing.assert_allclose(sampled.policy_target, discrete.policy_target, rtol=1e-5)
    np.testing.assert_allclose(sampled.root_values, discrete.root_values, rtol=1e-6)


def test_a_gumbel_self_play_move_plays_the_searchs_choice_and_stores_its_improved_policy():
    config = config_from_dict({"algorithm": "sampled_muzero", "env": {"id": "Pendulum-v1"}}, "x.json",
                              [*TINY, "sampled_mcts.kind=gumbel", "sampled_mcts.max_num_considered_actions=4"])
    network = get_algorithm("sampled_muzero").make_network(config, (3,), 1).eval()
    player = get_algorithm("sampled_muzero").make_player(config, [make_env(config.env)], network, True, 0)
    player.step(0.0)
    ep = player.episodes[0]
    target = ep.child_visits[0]
    assert target.sum() == pytest.approx(1.0) and (target > 0).all()  # softmax over every distinct sample
    assert any((ep.sampled_actions[0][j].astype(np.float32) == ep.action[1]).all() for j in range(5))


# ---- float actions in episodes, the ring and snapshots ---------------------------------------------


def test_value_targets_are_the_n_step_returns_of_a_plain_loop():
    rewards = np.array([0.0, 1.0, -2.0, 0.5, 3.0, 1.5], np.float32)  # T = 5 moves, row 0's reward unused
    root = np.array([0.3, -1.0, 2.0, 0.7, 1.1, 4.0], np.float32)
    fields = {"observation": np.zeros((6, 3), np.float32), "action": np.linspace(-1, 1, 6, dtype=np.float32)[:, None],
              "reward": rewards, "root_value": root, "child_visits": np.full((6, 2), 0.5, np.float32),
              "sampled_actions": np.zeros((6, 2, 1), np.float32)}  # fmt: skip
    td, gamma, big_t = 2, 0.9, 5
    for terminated in (True, False):
        out = SampledTargets(3, td, gamma).build(fields, np.arange(5), np.arange(5), np.full(5, big_t),
                                                 np.full(5, terminated), np.random.default_rng(0))  # fmt: skip
        for t in range(5):
            for k in range(4):
                i = t + k
                if i < big_t:
                    z = sum(gamma ** (j - i - 1) * rewards[j] for j in range(i + 1, min(i + td, big_t) + 1))
                    if i + td < big_t:
                        z += gamma**td * root[i + td]
                    elif not terminated:
                        z += gamma ** (big_t - i) * root[big_t]
                else:
                    z = 0.0 if terminated or i > big_t else root[big_t]
                assert out["target_value"][t, k] == pytest.approx(z, rel=1e-5), (terminated, t, k)
                if i <= big_t:
                    assert out["actions"][t, k, 0] == fields["action"][i, 0]
                assert out["policy_mask"][t, k] == (i < big_t)


def test_float_actions_round_trip_through_an_episode_the_ring_and_a_snapshot(tmp_path):
    config = config_from_dict({"algorithm": "sampled_muzero", "env": {"id": "Pendulum-v1", "max_episode_steps": 12}},
                              "x.json", TINY)  # fmt: skip
    algorithm = get_algorithm("sampled_muzero")
    spec = run_env_spec(config)
    assert spec.continuous_actions and spec.num_actions == 1
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions).eval()
    player = algorithm.make_player(config, [make_env(config.env) for _ in range(2)], network, True, 0)
    episodes = []
    while len(episodes) < 2:
        episodes += player.step(0.5)
    with ReplayBuffer.create(algorithm.run_schema(config, spec), 100, alpha=0.5) as buf:
        stored = [player.stored(ep) for ep in episodes]
        for arrays, priorities in stored:
            assert arrays["action"].dtype == np.float32 and arrays["action"].shape == (13, 1)
            assert arrays["sampled_actions"].shape == (13, 5, 1)
            assert len(np.unique(arrays["action"][1:])) > 1 and (np.abs(arrays["action"]) <= 1).all()
            # each played action is one of the root's sampled actions
            assert all((arrays["sampled_actions"][i] == arrays["action"][i + 1]).all(-1).any() for i in range(12))
            buf.add_episode(arrays, priorities)
        buf.save(tmp_path / "snap")
        manifest = json.loads((tmp_path / "snap" / "manifest.json").read_text())
        assert {f["name"]: f["dtype"] for f in manifest["schema"]}["action"] in ("float32", "<f4")
        with ReplayBuffer.load(tmp_path / "snap", num_actions=spec.num_actions) as loaded:
            refs = loaded.episodes()
            assert len(refs) == 2
            for ref, (arrays, _) in zip(refs, stored):
                rows = loaded.read_episode(ref)
                for name in ("action", "sampled_actions", "child_visits", "reward", "observation"):
                    np.testing.assert_array_equal(rows[name], arrays[name], err_msg=name)
            batch = loaded.sample(8, 1.0, algorithm.make_targets(config, 1), rng=np.random.default_rng(0))
            assert batch.data["actions"].shape == (8, 6, 1) and batch.data["target_actions"].shape == (8, 6, 5, 1)


@pytest.mark.parametrize("search_fraction", [0.0, 1.0])
def test_the_reanalyser_refreshes_values_and_with_a_search_the_samples_and_policies_the_targets_use(search_fraction):
    config = config_from_dict({"algorithm": "sampled_muzero", "env": {"id": "Pendulum-v1", "max_episode_steps": 6}},
                              "x.json", [*TINY, f"sampled_reanalyse.search_fraction={search_fraction}",
                                         "sampled_reanalyse.batch_episodes=4"])  # fmt: skip
    algorithm = get_algorithm("sampled_muzero")
    spec = run_env_spec(config)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions).eval()
    player = algorithm.make_player(config, [make_env(config.env) for _ in range(2)], network, True, 0)
    episodes = []
    while len(episodes) < 2:
        episodes += player.step(0.5)
    store = WeightStore.create(network.num_flat_weights())
    try:
        with ReplayBuffer.create(algorithm.run_schema(config, spec), 100, alpha=0.5) as buf:
            for ep in episodes:
                buf.add_episode(*player.stored(ep))
            reanalyser = algorithm.make_reanalyser(config, buf, store)
            store.publish(network.get_flat_weights(), training_step=1)
            assert reanalyser.refresh_weights()
            while reanalyser.episodes < 2:  # episodes are drawn at random, with repeats
                reanalyser.step()
            assert np.isfinite(buf.fields["reanalysed_value"][:14]).all()
            searched = ~np.isnan(buf.fields["reanalysed_policy"][:14]).any(1)
            # a search fills rows 0 .. T-1 of each episode (7 rows: 6 moves), never row T
            assert searched.tolist() == ([True] * 6 + [False]) * 2 if search_fraction else not searched.any()
            slots = np.array([0, 3, 7, 12])
            out = algorithm.make_targets(config, 1).build(buf.fields, slots, slots % 7, np.full(4, 6),
                                                          np.zeros(4, bool), np.random.default_rng(0))  # fmt: skip
            source = "reanalysed" if search_fraction else "stored"
            actions = buf.fields["reanalysed_actions" if search_fraction else "sampled_actions"][slots]
            policy = buf.fields["reanalysed_policy" if search_fraction else "child_visits"][slots]
            np.testing.assert_array_equal(out["target_actions"][:, 0], actions, err_msg=source)
            np.testing.assert_array_equal(out["target_policy"][:, 0], policy, err_msg=source)
            assert reanalyser.stats()["searched_episodes"] == (reanalyser.episodes if search_fraction else 0)
    finally:
        store.close()


# ---- the command line: a short Pendulum run, resumed; refusals --------------------------------------

RUN_FLAGS = ["--set", "training.min_buffer_steps=100", "--set", "training.batch_size=16",
             "--set", "sampled_mcts.num_simulations=4", "--set", "sampled_mcts.num_sampled_actions=4",
             "--set", "runtime.envs_per_worker=2", "--set", "env.max_episode_steps=50",
             "--set", "runtime.evaluation_episodes=2", "--set", "runtime.evaluation_interval_s=1",
             "--set", "training.publish_interval=5", "--set", "runtime.log_interval_s=1"]  # fmt: skip


def _run(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "run.py", "--config", "pendulum_sampled", "--device", "cpu", "--workers",
                           "1", *RUN_FLAGS, *args], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_pendulum_run_trains_evaluates_and_resumes_with_its_float_actions(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _run(["--run-dir", str(run_dir), "--max-train-steps", "20"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any("mean_return" in json.dumps(m) for m in metrics)  # an evaluation ran
    assert (run_dir / "checkpoint.pt").is_file()
    manifest = json.loads((run_dir / "buffer" / "manifest.json").read_text())
    assert {f["name"]: f["dtype"] for f in manifest["schema"]}["action"] in ("float32", "<f4")
    before = np.load(run_dir / "buffer" / "field.action.npy")
    assert np.isfinite(before).all() and (np.abs(before) <= 1).all() and before.std() > 0
    _run(["--resume", str(run_dir), "--max-train-steps", "40"])
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["training_step"] == 40
    after = np.load(run_dir / "buffer" / "field.action.npy")
    kept = np.isin(before, after).mean()  # the resumed ring started from the saved float actions
    assert kept > 0.5
    # the tools on the run (in this process: the run's own processes are done): greedy
    # episodes, the network judged on the snapshot, mpper.load
    capsys.readouterr()
    for args in (["--episodes", "1"], ["--on-snapshot", str(run_dir / "buffer")]):
        code = cli.main(["--evaluate", str(run_dir), *args])
        out, err = capsys.readouterr()
        assert code == 0, out[-2000:] + err[-3000:]
    assert "policy_cross_entropy" in out
    agent = mpper.load(run_dir)
    action = agent.act(np.array([1.0, 0.0, 0.0], np.float32))
    assert action.dtype == np.float32 and action.shape == (1,) and -2.0 <= action[0] <= 2.0  # Pendulum's torque
    assert agent.act(np.zeros((3, 3), np.float32)).shape == (3, 1)
    # --collect plays Discrete-action envs only: one line, nothing written
    code = cli.main(["--collect", str(run_dir), "--env-steps", "10", "--out", str(tmp_path / "collected")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "a continuous (Box) action space" in err, err
    assert not (tmp_path / "collected").exists()


class BoxActionEnv(gym.Env):
    """One step per episode; the action space as given."""

    def __init__(self, low, high):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Box(np.float32(low), np.float32(high), (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, True, False, {}


def make_box_env(low: float = -1.0, high: float = 1.0) -> gym.Env:
    return BoxActionEnv(low, high)


@pytest.mark.parametrize("config, kwargs, expected", [
    ("pendulum_sampled", {"low": "-inf", "high": "inf"}, "has an infinite or non-finite bound"),
    ("cartpole_dqn", {}, 'algorithm: "dqn" cannot train the env \'test_sampled_muzero:make_box_env\', whose action '
                         'space is a continuous (Box) one; "algorithm": "sampled_muzero" trains it'),
    ("cartpole", {}, 'algorithm: "muzero" cannot train'),
])  # fmt: skip
def test_an_action_space_an_algorithm_cannot_train_is_one_line_exit_2_nothing_written(tmp_path, capsys, config,
                                                                                        kwargs, expected):  # fmt: skip
    argv = ["--config", config, "--workers", "0", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
            "--set", "env.id=test_sampled_muzero:make_box_env"]  # fmt: skip
    for key, value in kwargs.items():
        argv += ["--set", f"env.kwargs.{key}={json.dumps(float(value))}"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert expected in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, value, expected", [
    ("runtime.selfplay_inference", '"server"', 'Sampled MuZero\'s workers run their own network: use "auto" or "worker"'),
    ("training.capture", '"static"', 'Sampled MuZero trains with the eager step: expected "auto" or "off", got "static"'),
    ("training.precision", '"bf16"', 'Sampled MuZero trains in float32: expected "fp32", got "bf16"'),
])  # fmt: skip
def test_the_keys_of_the_gpu_paths_it_does_not_take_are_refused(key, value, expected):
    from mpper.config import ConfigError

    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        config_from_dict({"algorithm": "sampled_muzero", key.split(".")[0]: {key.split(".")[1]: json.loads(value)}},
                         check_env=False)  # fmt: skip


def test_sampled_muzero_refuses_a_discrete_env_naming_the_algorithms_that_train_it(tmp_path, capsys):
    argv = ["--config", "pendulum_sampled", "--workers", "0", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
            "--set", "env.id=CartPole-v1"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and '"algorithm": "muzero" or "algorithm": "dqn" trains it' in err
    assert not (tmp_path / "run").exists()




class DivergingEnv(BoxActionEnv):
    """Returns a NaN reward (or observation) at its third move, as a diverged simulation can."""

    def __init__(self, what: str):
        super().__init__(-1.0, 1.0)
        self.what, self.moves = what, 0

    def step(self, action):
        self.moves += 1
        bad = self.moves == 3
        obs = np.full(3, np.nan if bad and self.what == "observation" else 0.0, np.float32)
        return obs, float("nan") if bad and self.what == "reward" else 0.0, False, False, {}


@pytest.mark.parametrize("what", ["reward", "observation"])
def test_a_non_finite_reward_or_observation_from_the_env_stops_self_play_in_one_line(what):
    config = config_from_dict({"algorithm": "sampled_muzero"}, "x.json", TINY)
    network = get_algorithm("sampled_muzero").make_network(config, (3,), 2).eval()
    player = get_algorithm("sampled_muzero").make_player(config, [DivergingEnv(what)], network, True, 0)
    player.step()
    player.step()
    with pytest.raises(ValueError, match=f"^the env returned a non-finite {what}.* at move 3$"):
        player.step()
