"""EfficientZero's value prefix (``muzero.value_prefix``; Ye et al. 2021, section 4.2).

Each part against a plain implementation written from the paper and EfficientZero's code:

* the targets: ``MuZeroTargets`` with a value prefix against EfficientZero's
  ``make_target`` loop (the sum of rewards restarting every ``lstm_horizon_len`` steps),
  over episodes that end (terminated and truncated) inside the unroll;
* the network: the training unroll against step-by-step ``recurrent_inference`` with the
  LSTM state carried and reset by hand, for both architectures;
* the search: on a fake network whose prefix is a known function of the LSTM state it is
  given, the batched search's node rewards (pUCT and Gumbel) against the prefixes of each
  node's path converted with EfficientZero's reset rule, and pUCT's visits and values
  against a plain per-node MCTS that converts prefixes the same way;
* the config: refusals, one line each;
* one short CartPole run end to end (slow).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_episode
from torch import nn

from mpper.algos.configs import load_config
from mpper.algos.muzero.config import MCTSConfig, NetworkConfig
from mpper.algos.muzero.gumbel import GumbelMCTS
from mpper.algos.muzero.mcts import BatchedMCTS
from mpper.algos.muzero.networks import NetworkOutput, PrefixOutput, make_network, scalar_to_support, support_to_scalar
from mpper.algos.muzero.targets import MuZeroTargets
from mpper.algos.registry import algorithm_of, run_env_spec
from mpper.cli import main
from mpper.config_files import ConfigError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

ROOT = Path(__file__).resolve().parents[3]
SUPPORT = 10


# ---- targets ------------------------------------------------------------------------------------


def efficientzero_prefixes(rewards_after: list[float], state_index: int, num_unroll_steps: int,
                           horizon: int) -> list[float]:  # fmt: skip
    """EfficientZero's ``_compute_target_reward_value`` (value prefix part), for one position:
    ``rewards_after[i]`` is the reward received after the action at index i of the trajectory.
    Entry j is the target of unroll step j + 1."""
    targets = []
    value_prefix = 0.0
    horizon_id = 0
    for current_index in range(state_index, state_index + num_unroll_steps + 1):
        if horizon_id % horizon == 0:
            value_prefix = 0.0
        horizon_id += 1
        if current_index < len(rewards_after):
            value_prefix += rewards_after[current_index]
        targets.append(value_prefix)
    return targets


@pytest.mark.parametrize("horizon, num_unroll_steps", [(1, 3), (2, 5), (3, 7), (5, 5)])
def test_prefix_targets_are_efficientzeros(horizon, num_unroll_steps):
    rng = np.random.default_rng(horizon)
    episodes = [make_episode(rng, T) for T in (1, 2, 4, 6, 9)]
    fields = {name: np.concatenate([ep[name] for ep in episodes]) for name in episodes[0]}
    starts = np.cumsum([0] + [len(ep["reward"]) for ep in episodes])[:-1]
    slots, pos, moves, terminated = [], [], [], []
    for j, (ep, start) in enumerate(zip(episodes, starts)):
        T = len(ep["reward"]) - 1
        for t in range(T):  # every position, past the end of each episode within the unroll
            slots.append(start + t)
            pos.append(t)
            moves.append(T)
            terminated.append(j % 2 == 0)  # truncated ones too: their rewards are the same
    slots, pos, moves = (np.array(x, np.int64) for x in (slots, pos, moves))
    targets = MuZeroTargets(num_unroll_steps, 3, 0.9, 2, value_prefix_horizon=horizon)
    out = targets.build(fields, slots, pos, moves, np.array(terminated), np.random.default_rng(0))
    plain = MuZeroTargets(num_unroll_steps, 3, 0.9, 2).build(fields, slots, pos, moves, np.array(terminated),
                                                             np.random.default_rng(0))  # fmt: skip
    for b in range(len(slots)):
        ep = episodes[int(np.searchsorted(starts, slots[b], side="right")) - 1]
        rewards_after = ep["reward"][1:].astype(np.float64).tolist()  # row i + 1 holds the reward of action i
        expected = efficientzero_prefixes(rewards_after, int(pos[b]), num_unroll_steps, horizon)
        np.testing.assert_allclose(out["target_reward"][b, 1:], expected[:num_unroll_steps], rtol=1e-5, atol=1e-5)
    # everything else is the plain targets'; the rewards differ wherever two steps are summed
    for key in plain:
        if key != "target_reward":
            np.testing.assert_array_equal(out[key], plain[key])
    assert (out["target_reward"][:, 0] == plain["target_reward"][:, 0]).all()  # step 0: not trained
    assert (horizon == 1) == np.allclose(out["target_reward"], plain["target_reward"])


# ---- network ------------------------------------------------------------------------------------

NETWORKS = {
    "fc": (NetworkConfig(kind="fc", encoding_size=8, hidden=[16], lstm_hidden_size=6), (4,)),
    "residual": (NetworkConfig(kind="residual", encoding_size=4, hidden=[8], blocks=1, reduced_channels=2,
                               lstm_hidden_size=6), (2, 4, 4)),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(NETWORKS))
@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_unroll_is_recurrent_inference_with_the_lstm_reset_every_horizon(kind, horizon):
    config, shape = NETWORKS[kind]
    torch.manual_seed(0)
    net = make_network(config, shape, 3, 0, horizon).eval()  # eval: BatchNorm the same in both
    obs, actions = torch.randn(5, *shape), torch.randint(0, 3, (5, 7))
    with torch.no_grad():
        unrolled = net.unroll(obs, actions)
        out = net.initial_inference(obs)
        assert isinstance(out, PrefixOutput) and (out.reward_state == 0).all()
        assert out.reward_state.shape == (5, 2, 6)
        hidden, state = out.hidden_state, out.reward_state
        for k in range(7):
            out = net.recurrent_inference(hidden, actions[:, k], state)
            torch.testing.assert_close(unrolled.reward_logits[:, k], out.reward_logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(unrolled.value_logits[:, k + 1], out.value_logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(unrolled.hidden_states[:, k + 1], out.hidden_state, rtol=1e-5, atol=1e-5)
            # the LSTM state: carried within a horizon (a fresh state gives other logits there),
            # zeros after each horizon (what None means)
            fresh = net.recurrent_inference(hidden, actions[:, k], None)
            assert torch.equal(fresh.hidden_state, out.hidden_state)
            reset_before = k % horizon == 0
            assert torch.allclose(fresh.reward_logits, out.reward_logits) == reset_before
            hidden = out.hidden_state
            state = torch.zeros_like(out.reward_state) if (k + 1) % horizon == 0 else out.reward_state


def test_without_a_value_prefix_the_network_is_as_it_was():
    config, shape = NETWORKS["residual"]
    torch.manual_seed(0)
    plain = make_network(config, shape, 3)
    prefixed = make_network(config, shape, 3, 0, 2)
    assert not any("lstm" in name or "encoder" in name for name, _ in plain.named_parameters())
    assert any("dynamics_reward_lstm" in name for name, _ in prefixed.named_parameters())
    out = plain.eval().recurrent_inference(plain.initial_inference(torch.randn(2, *shape)).hidden_state,
                                           torch.tensor([0, 1]))  # fmt: skip
    assert type(out) is NetworkOutput and len(out) == 4 and plain.lstm_horizon_len is None


def test_zero_init_heads_predict_a_zero_prefix():
    config, shape = NETWORKS["fc"]
    net = make_network(NetworkConfig(**{**config.__dict__, "zero_init_heads": True}), shape, 3, 0, 2).eval()
    with torch.no_grad():
        unrolled = net.unroll(torch.randn(4, *shape), torch.randint(0, 3, (4, 5)))
    assert torch.allclose(support_to_scalar(unrolled.reward_logits.reshape(-1, 2 * SUPPORT + 1), SUPPORT),
                          torch.zeros(20), atol=1e-6)  # fmt: skip


# ---- search -------------------------------------------------------------------------------------


def two_hot_logits(x: torch.Tensor) -> torch.Tensor:
    """Logits (B, 2S+1) whose expectation is ``x`` (B,) (log of the two-hot, clamped finite)."""
    return torch.log(scalar_to_support(x.float().reshape(-1), SUPPORT)).clamp(min=-50)


class PrefixModel(nn.Module):
    """A fake value-prefix network on a finite deterministic game: hidden states are (B, 1)
    state ids; the LSTM state (B, 2, 1) holds (prefix so far, steps since its reset). The
    prefix of a step is ``h + reward[s, a] + 0.1 * (c + 1)`` (the step count makes it depend on
    where the resets fell, as a learned LSTM's does), with value and policy from tables."""

    def __init__(self, rng: np.random.Generator, n_states: int, n_actions: int, horizon: int):
        super().__init__()
        self.lstm_horizon_len = horizon
        self.next_state = torch.as_tensor(rng.integers(0, n_states, size=(n_states, n_actions)))
        self.reward = torch.as_tensor(rng.normal(size=(n_states, n_actions)).round(2), dtype=torch.float32)
        self.value_logits = two_hot_logits(torch.as_tensor(rng.normal(size=n_states) * 2))
        self.policy_logits = torch.as_tensor(rng.normal(size=(n_states, n_actions)), dtype=torch.float32)

    def initial_inference(self, observation):
        s = observation[:, 0].long()
        zeros = torch.zeros(len(s))
        return PrefixOutput(self.value_logits[s], two_hot_logits(zeros), self.policy_logits[s], observation.clone(),
                             torch.zeros(len(s), 2, 1))  # fmt: skip

    def step(self, s: torch.Tensor, a: torch.Tensor, state: torch.Tensor):
        """(next state ids, prefixes, new LSTM states) of actions ``a`` from ``s``."""
        prefix = state[:, 0, 0] + self.reward[s, a] + 0.1 * (state[:, 1, 0] + 1)
        return self.next_state[s, a], prefix, torch.stack([prefix, state[:, 1, 0] + 1], 1)[:, :, None]

    def recurrent_inference(self, hidden_state, action, reward_state):
        s = hidden_state[:, 0].long()
        nxt, prefix, new_state = self.step(s, action, reward_state)
        return PrefixOutput(self.value_logits[nxt], two_hot_logits(prefix), self.policy_logits[nxt],
                             nxt[:, None].float(), new_state)  # fmt: skip


def scalar(logits: torch.Tensor) -> float:
    return float(support_to_scalar(logits.double(), SUPPORT)[0])


def path_rewards(model: PrefixModel, root_state: int, actions: list[int]) -> list[float]:
    """The rewards of the nodes along ``actions`` from ``root_state``, from the paper: the LSTM
    state starts at zero and is zeroed at every node whose depth is a multiple of the horizon
    (the root included); a node's reward is its prefix minus its parent's, or its prefix where
    the parent's state was reset (EfficientZero's ``is_reset``)."""
    h = model.lstm_horizon_len
    s = torch.tensor([root_state])
    state = torch.zeros(1, 2, 1)
    parent_prefix = 0.0
    rewards = []
    for depth, a in enumerate(actions):  # depth: the parent's
        reset = depth % h == 0
        if reset:
            state = torch.zeros(1, 2, 1)
        s, _, state = model.step(s, torch.tensor([a]), state)
        prefix = scalar(two_hot_logits(state[:, 0, 0]))  # what the search reads back from the logits
        rewards.append(prefix if reset else prefix - parent_prefix)
        parent_prefix = prefix
    return rewards


class Recording:
    """A search policy whose ``decide`` keeps the tree, to read its nodes."""

    def decide(self, tree, draws):
        self.tree = tree
        return super().decide(tree, draws)


class RecordingMCTS(Recording, BatchedMCTS):
    pass


class RecordingGumbel(Recording, GumbelMCTS):
    pass


@pytest.mark.parametrize("policy", [RecordingMCTS, RecordingGumbel])
@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_node_rewards_are_prefix_differences_with_efficientzeros_resets(policy, horizon):
    rng = np.random.default_rng(horizon)
    model = PrefixModel(rng, 30, 3, horizon)
    k_roots = 6
    search = policy(3, MCTSConfig(kind="gumbel" if policy is RecordingGumbel else "puct", num_simulations=60,
                                  max_num_considered_actions=3), SUPPORT)  # fmt: skip
    roots = rng.integers(0, 30, size=k_roots)
    result = search.run(model, roots[:, None].astype(np.float32), np.ones((k_roots, 3), bool), np.zeros(k_roots),
                        True, rng)  # fmt: skip
    assert result.max_tree_depth > horizon  # resets happen below the root
    tree = search.tree
    checked = 0
    for k in range(k_roots):
        parent_of = {}
        for node in range(tree.children.shape[1]):
            for a in range(3):
                child = tree.children[k, node, a]
                if child >= 0:
                    parent_of[int(child)] = (node, a)
        for node in parent_of:
            actions, n = [], node
            while n != 0:
                n, a = parent_of[n]
                actions.append(a)
            expected = path_rewards(model, int(roots[k]), actions[::-1])[-1]
            assert tree.reward[k, node] == pytest.approx(expected, abs=1e-5), (k, node, actions)
            checked += 1
    assert checked == k_roots * 60


class Node:
    def __init__(self, prior: float):
        self.prior = prior
        self.visit_count = 0
        self.value_sum = 0.0
        self.reward = 0.0
        self.prefix = 0.0
        self.depth = 0
        self.children: dict[int, Node] = {}
        self.hidden_state = None
        self.reward_state = None

    def value(self) -> float:
        return 0.0 if self.visit_count == 0 else self.value_sum / self.visit_count


def reference_prefix_search(model, observation, cfg: MCTSConfig, noise, tie_keys):
    """muzero-general's one-player MCTS for one root (as ``test_mcts.reference_search``) with
    EfficientZero's value prefix: a node keeps its prefix and LSTM state, the state passed on
    from a node at a depth that is a multiple of the horizon is zeros, and a node's reward is
    its prefix minus its parent's (the prefix alone below a reset)."""
    h = model.lstm_horizon_len
    out = model.initial_inference(torch.as_tensor(observation[None], dtype=torch.float32))
    root = Node(0.0)
    root.hidden_state, root.reward_state = out.hidden_state, out.reward_state
    num_actions = out.policy_logits.shape[1]
    for a, p in enumerate(torch.softmax(out.policy_logits[0].double(), 0).tolist()):
        root.children[a] = Node(p * (1 - cfg.root_exploration_fraction) + noise[a] * cfg.root_exploration_fraction)
    lo, hi = math.inf, -math.inf

    def ucb(parent, child):
        pb_c = math.log((parent.visit_count + cfg.pb_c_base + 1) / cfg.pb_c_base) + cfg.pb_c_init
        pb_c *= math.sqrt(parent.visit_count) / (child.visit_count + 1)
        value_score = 0.0
        if child.visit_count > 0:
            q = child.reward + cfg.discount * child.value()
            value_score = (q - lo) / (hi - lo) if hi > lo else q
        return pb_c * child.prior + value_score

    for _ in range(cfg.num_simulations):
        node, path = root, [root]
        while node.hidden_state is not None:
            scores = {a: ucb(node, c) for a, c in node.children.items()}
            action = max(scores, key=lambda a: (scores[a], node.children[a].prior, tie_keys[a]))
            node = node.children[action]
            path.append(node)
        parent = path[-2]
        reset = parent.depth % h == 0
        state = torch.zeros_like(parent.reward_state) if reset else parent.reward_state
        out = model.recurrent_inference(parent.hidden_state, torch.tensor([action]), state)
        node.depth = parent.depth + 1
        node.prefix = scalar(out.reward_logits)
        node.reward = node.prefix if reset else node.prefix - parent.prefix
        node.hidden_state, node.reward_state = out.hidden_state, out.reward_state
        for a, p in enumerate(torch.softmax(out.policy_logits[0].double(), 0).tolist()):
            node.children[a] = Node(p)
        value = scalar(out.value_logits)
        for n in reversed(path):
            n.value_sum += value
            n.visit_count += 1
            lo, hi = min(lo, n.reward + cfg.discount * n.value()), max(hi, n.reward + cfg.discount * n.value())
            value = n.reward + cfg.discount * value
    visits = np.array([root.children[a].visit_count for a in range(num_actions)])
    rewards = np.array([root.children[a].reward for a in range(num_actions)])
    return visits, root.value(), rewards


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_puct_with_a_value_prefix_matches_a_plain_reference(horizon):
    rng = np.random.default_rng(10 + horizon)
    model = PrefixModel(rng, 25, 3, horizon)
    cfg = MCTSConfig(num_simulations=40, discount=0.95)
    mcts = RecordingMCTS(3, cfg, SUPPORT)
    deep = 0
    for root in rng.integers(0, 25, size=4):
        obs = np.array([[root]], np.float32)
        legal = np.ones((1, 3), bool)
        noise, ties = mcts.sample_root_noise(legal, rng), rng.random(legal.shape)
        result = mcts.run(model, obs, legal, np.zeros(1), True, rng, root_noise=noise, tie_break=ties)
        with torch.no_grad():
            visits, root_value, rewards = reference_prefix_search(model, obs[0], cfg, noise[0], ties[0])
        np.testing.assert_array_equal(result.visit_counts[0], visits)
        assert result.root_values[0] == pytest.approx(root_value, rel=1e-6, abs=1e-6)
        children = mcts.tree.children[0, 0]
        expanded = children >= 0
        np.testing.assert_allclose(mcts.tree.reward[0, children[expanded]], rewards[expanded], atol=1e-6)
        deep = max(deep, result.max_tree_depth)
    assert deep > horizon


def test_a_value_prefix_cannot_search_a_two_player_game():
    model = PrefixModel(np.random.default_rng(0), 5, 2, 2)
    with pytest.raises(ValueError, match="two-player"):
        BatchedMCTS(2, MCTSConfig(num_simulations=2), SUPPORT, two_player=True).run(
            model, np.zeros((1, 1), np.float32), np.ones((1, 2), bool), np.zeros(1), False, np.random.default_rng(0))


# ---- config -------------------------------------------------------------------------------------


def test_the_keys_default_off_and_build_the_run_network_and_targets():
    off = load_config("configs/cartpole.json", ["runtime.device=cpu"], check_env=False)
    assert not off.muzero.value_prefix and off.muzero.lstm_horizon_len == 5 and off.network.lstm_hidden_size == 64
    algorithm = algorithm_of(off)
    assert algorithm.make_network(off, (4,), 2).lstm_horizon_len is None
    assert algorithm.make_targets(off, 2).value_prefix_horizon is None
    on = load_config("configs/cartpole.json", ["runtime.device=cpu", "muzero.value_prefix=true",
                                               "muzero.lstm_horizon_len=3"], check_env=False)  # fmt: skip
    assert algorithm.make_network(on, (4,), 2).lstm_horizon_len == 3
    assert algorithm.make_targets(on, 2).value_prefix_horizon == 3


@pytest.mark.parametrize("sets, expected", [
    (["muzero.lstm_horizon_len=0"], "muzero.lstm_horizon_len"),
    (["network.lstm_hidden_size=0"], "network.lstm_hidden_size"),
])  # fmt: skip
def test_refusals_are_one_line_naming_the_key(sets, expected):
    with pytest.raises(ConfigError) as e:
        load_config("configs/cartpole.json", ["runtime.device=cpu", *sets], check_env=False)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_two_player_env_is_refused_before_the_run():
    config = load_config("configs/tictactoe.json", ["runtime.device=cpu", "muzero.value_prefix=true"],
                         check_env=False)  # fmt: skip
    with pytest.raises(ValueError, match="muzero.value_prefix is for one-player envs") as e:
        run_env_spec(config)
    assert "\n" not in str(e.value)
    run_env_spec(load_config("configs/tictactoe.json", ["runtime.device=cpu"], check_env=False))  # off: fine


def test_the_command_line_refuses_a_two_player_value_prefix_in_one_line_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["--config", "configs/tictactoe.json", "--device", "cpu", "--run-dir", str(run_dir), "--set",
            "muzero.value_prefix=true"]  # fmt: skip
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "muzero.value_prefix is for one-player" in err
    assert not run_dir.exists()


# ---- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cartpole_trains_and_evaluates_with_a_value_prefix(tmp_path):
    """One short CartPole run with a worker process served by the inference process, the
    learner, the reanalyser (searching again) and the evaluator (their own networks), all with
    the value prefix's network; its checkpoint loads into that network, and ``--evaluate
    --on-snapshot`` judges it on the run's buffer."""
    run_dir = tmp_path / "run"
    sets = ["training.min_buffer_steps=200", "training.batch_size=32", "mcts.num_simulations=6",
            "runtime.envs_per_worker=4", "replay.capacity=20000", "runtime.evaluation_interval_s=1",
            "runtime.evaluation_episodes=2", "runtime.log_interval_s=1", "training.publish_interval=5",
            "env.max_episode_steps=100", "muzero.value_prefix=true", "muzero.lstm_horizon_len=2",
            "network.lstm_hidden_size=8", "reanalyse.search_fraction=1.0",
            "runtime.selfplay_inference=server"]  # fmt: skip
    args = [sys.executable, "run.py", "--config", "configs/cartpole.json", "--device", "cpu", "--run-dir",
            str(run_dir), "--workers", "1", "--max-train-steps", "40"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "inference" in json.loads((run_dir / "processes.json").read_text())  # self-play was served
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "end" and records[-1]["learner"]["training_step"] == 40
    losses = [r["learner"]["reward_loss"] for r in records if "reward_loss" in (r["learner"] or {})]
    assert losses and all(math.isfinite(x) for x in losses)
    evaluations = [r["evaluation"] for r in records if r["event"] == "evaluation"]
    assert evaluations and all(math.isfinite(e["mean_return"]) for e in evaluations)
    assert records[-1]["reanalyse"]["searched_episodes"] > 0  # the reanalyser's searches ran too
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    config = load_config(run_dir / "config.json")
    assert config.muzero.value_prefix
    network = algorithm_of(config).make_network(config, (4,), 2)
    network.load_state_dict(ckpt["network"])  # strict: the LSTM's weights are there
    assert "dynamics_reward_lstm.weight_ih" in ckpt["network"]
    # the network judged on the run's own data: its prefixes against the prefix targets
    assert main(["--evaluate", str(run_dir), "--on-snapshot", str(run_dir / "buffer")]) == 0
    report = json.loads((run_dir / "snapshot_evaluation.json").read_text())
    errors = [row["reward_error"] for row in report["per_step"][1:]]
    assert errors and all(math.isfinite(e) for e in errors)
