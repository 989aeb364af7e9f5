"""mpper.algos.muzero.networks: value transform, supports, both architectures, flat weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpper.algos.muzero.config import NetworkConfig
from mpper.algos.muzero.networks import (
    MuZeroNetwork,
    h,
    h_inv,
    make_network,
    scalar_to_support,
    stacked_shape,
    support_to_scalar,
)
from mpper.algos.muzero.targets import stacked_observations


def wide_range(dtype) -> torch.Tensor:
    """Every integer in [-300, 300], random values of several scales, tiny ones and 0."""
    g = torch.Generator().manual_seed(0)
    parts = [
        torch.arange(-300, 301, dtype=torch.float64),
        torch.randn(2000, generator=g, dtype=torch.float64) * 100,
        torch.randn(500, generator=g, dtype=torch.float64),
        torch.randn(500, generator=g, dtype=torch.float64) * 1e-3,
    ]
    return torch.cat(parts).clamp(-300, 300).to(dtype)


# ---- transform and supports ----------------------------------------------------------


def test_h_inv_inverts_h():
    x = wide_range(torch.float64)
    assert torch.allclose(h_inv(h(x)), x, rtol=0, atol=1e-9)
    y = h(x)  # and the other way round, on h's range
    assert torch.allclose(h(h_inv(y)), y, rtol=0, atol=1e-12)
    # float32 resolves 3e-5 at |x| = 300, hence the small relative term.
    x32 = x.float()
    assert torch.allclose(h_inv(h(x32)), x32, rtol=1e-6, atol=1e-4)
    assert h(torch.tensor(0.0)) == 0 and h_inv(torch.tensor(0.0)) == 0


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 0, 1e-9), (torch.float32, 1e-6, 1e-4)])
def test_support_round_trip(dtype, rtol, atol):
    # support 20 covers h(300) = 16.65 (support 10 would clip above |x| = 109).
    x = wide_range(dtype)
    probabilities = scalar_to_support(x, 20)
    assert probabilities.shape == (x.shape[0], 41) and probabilities.dtype == dtype
    assert torch.allclose(probabilities.sum(1), torch.ones((), dtype=dtype))
    assert ((probabilities > 0).sum(1) <= 2).all() and (probabilities >= 0).all()
    back = support_to_scalar(torch.log(probabilities), 20)  # log: softmax(log p) = p
    assert back.shape == x.shape
    # float32: within 1e-4, or 4 ulps (1.2e-4) near |x| = 300 where one ulp is 3e-5.
    assert torch.allclose(back, x, rtol=rtol, atol=atol)
    small = x.abs() <= 100
    assert (back - x)[small].abs().max() <= atol


def test_support_is_two_hot_with_expectation_h_and_clips():
    bins = torch.arange(-10, 11, dtype=torch.float64)
    x = torch.tensor([0.0, 1.0, -2.5, 7.3, 100.0, 1e6, -1e6], dtype=torch.float64)
    p = scalar_to_support(x, 10)
    assert torch.allclose(p @ bins, h(x).clamp(-10, 10))
    assert p[0, 10] == 1  # 0 -> the middle bin
    assert p[5, 20] == 1 and p[6, 0] == 1  # beyond the support: the end bins


# ---- networks ------------------------------------------------------------------------


def check_output(out, batch, support_size, num_actions, hidden_shape):
    full = 2 * support_size + 1
    assert out.value_logits.shape == (batch, full)
    assert out.reward_logits.shape == (batch, full)
    assert out.policy_logits.shape == (batch, num_actions)
    assert out.hidden_state.shape == (batch, *hidden_shape)
    hs = out.hidden_state
    assert torch.isfinite(hs).all() and hs.min() >= 0 and hs.max() <= 1


def test_fc_network_shapes_and_scaling():
    torch.manual_seed(0)
    net = make_network(NetworkConfig(kind="fc", encoding_size=16, hidden=[64], support_size=10), (4,), 2).eval()
    obs = torch.randn(5, 4)
    with torch.no_grad():
        out = net.initial_inference(obs)
        check_output(out, 5, 10, 2, (16,))
        # Scaled per sample: every row spans exactly [0, 1].
        assert torch.allclose(out.hidden_state.min(1).values, torch.zeros(5))
        assert torch.allclose(out.hidden_state.max(1).values, torch.ones(5))
        # The initial reward is the support of 0.
        assert torch.equal(torch.softmax(out.reward_logits, 1), scalar_to_support(torch.zeros(5), 10))
        assert torch.equal(support_to_scalar(out.reward_logits, 10), torch.zeros(5))
        nxt = net.recurrent_inference(out.hidden_state, torch.tensor([0, 1, 1, 0, 1]))
        check_output(nxt, 5, 10, 2, (16,))
        # The action matters.
        other = net.recurrent_inference(out.hidden_state, torch.tensor([1, 0, 0, 1, 0]))
        assert not torch.allclose(nxt.hidden_state, other.hidden_state)


def test_residual_network_shapes_and_scaling():
    torch.manual_seed(0)
    cfg = NetworkConfig(kind="residual", encoding_size=8, hidden=[16], blocks=1, support_size=5)
    net = make_network(cfg, (3, 3, 3), 9).eval()
    with torch.no_grad():
        out = net.initial_inference(torch.randn(4, 3, 3, 3))
        check_output(out, 4, 5, 9, (8, 3, 3))
        nxt = net.recurrent_inference(out.hidden_state, torch.tensor([0, 4, 8, 2]))
        check_output(nxt, 4, 5, 9, (8, 3, 3))
        # muzero-general scales each (sample, channel) plane separately.
        planes = nxt.hidden_state.flatten(2)
        assert torch.allclose(planes.max(2).values, torch.ones(4, 8))


@pytest.mark.parametrize("kind, obs_shape", [("fc", (4,)), ("residual", (2, 3, 3))])
def test_stacked_observations_match_targets_layout(kind, obs_shape):
    """The network's input is exactly what mpper.algos.muzero.targets.stacked_observations builds:
    muzero-general's stacking (the current observation, then per past step its
    observation and an action plane, zeros before the episode's start), row for row,
    and every one of its channels reaches the network's hidden state."""
    import seed_reference as ref

    n_stack, num_actions = 3, 4
    cfg = NetworkConfig(kind=kind, encoding_size=8, hidden=[16], blocks=1, support_size=5)
    torch.manual_seed(0)
    net = make_network(cfg, obs_shape, num_actions, stacked_observations=n_stack).eval()
    channels = obs_shape[0]
    assert net.observation_shape == stacked_shape(obs_shape, n_stack) == (channels + n_stack * (channels + 1), *obs_shape[1:])  # fmt: skip
    rng = np.random.default_rng(0)
    episode_obs = rng.normal(size=(10, *obs_shape)).astype(np.float32)
    episode_act = rng.integers(0, num_actions, size=10)
    slots = np.array([0, 2, 9])
    stacked = stacked_observations(episode_obs, episode_act, slots, slots, n_stack, num_actions)
    episode = {"observation": episode_obs, "action": episode_act}
    for row, t in enumerate(slots):
        expected = ref.get_stacked_observations(episode, int(t), n_stack, num_actions)
        np.testing.assert_allclose(stacked[row], expected, rtol=0, atol=1e-7, err_msg=f"position {t}")
    np.testing.assert_array_equal(stacked[0, channels:], 0.0)  # position 0 has no past
    x = torch.from_numpy(stacked)
    with torch.no_grad():
        out = net.initial_inference(x)
        assert out.policy_logits.shape == (3, num_actions)
        for row in range(3):  # each row is read on its own
            alone = net.initial_inference(x[row : row + 1])
            torch.testing.assert_close(alone.hidden_state[0], out.hidden_state[row], rtol=1e-5, atol=1e-6)
        for c in range(x.shape[1]):
            moved = x.clone()
            moved[:, c] += 1.0
            changed = (net.initial_inference(moved).hidden_state - out.hidden_state).abs().amax()
            assert changed > 1e-4, f"input channel {c} does not reach the hidden state"


@pytest.mark.parametrize("kind", ["fc", "residual"])
def test_flat_weights_round_trip(kind):
    torch.manual_seed(0)
    cfg = NetworkConfig(kind=kind, encoding_size=8, hidden=[16], blocks=1, support_size=5)
    net = make_network(cfg, (2, 3, 3), 5)
    if kind == "residual":  # give BatchNorm non-trivial running statistics first
        net.train()
        with torch.no_grad():
            net.initial_inference(torch.randn(8, 2, 3, 3))
    net.eval()
    obs = torch.randn(3, 2, 3, 3)
    with torch.no_grad():
        before = net.initial_inference(obs)
    flat = net.get_flat_weights()
    assert flat.dtype == np.float32 and flat.shape == (net.num_flat_weights(),)
    n_params = sum(p.numel() for p in net.parameters())
    assert flat.size >= n_params and (flat.size > n_params) == (kind == "residual")  # BN buffers included

    net.set_flat_weights(flat + np.random.default_rng(0).normal(0, 0.05, flat.shape).astype(np.float32))
    with torch.no_grad():
        changed = net.initial_inference(obs)
    assert not torch.allclose(changed.value_logits, before.value_logits)

    net.set_flat_weights(flat)
    with torch.no_grad():
        after = net.initial_inference(obs)
    for a, b in zip(after, before):
        assert torch.equal(a, b)
    assert np.array_equal(net.get_flat_weights(), flat)

    # A copy of the architecture loads the same vector and computes the same outputs.
    twin = make_network(cfg, (2, 3, 3), 5).eval()
    twin.set_flat_weights(flat)
    with torch.no_grad():
        assert torch.equal(twin.initial_inference(obs).policy_logits, before.policy_logits)


def test_errors():
    net = make_network(NetworkConfig(), (4,), 2)
    with pytest.raises(ValueError, match="expected a vector"):
        net.set_flat_weights(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="network.kind"):
        make_network(NetworkConfig(kind="transformer"), (4,), 2)
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        make_network(NetworkConfig(kind="residual"), (4,), 2)
    assert isinstance(net, MuZeroNetwork)


@pytest.mark.parametrize("hidden", [[16], [], [12, 8]])
@pytest.mark.parametrize("k_steps", [0, 1, 5])
def test_fc_batched_unroll_matches_step_by_step_inference(hidden, k_steps):
    """The fully connected network's batched ``unroll`` against the plain loop of
    ``initial_inference`` / ``recurrent_inference`` with ``scale_gradient(h, 0.5)``
    between dynamics steps: same logits, same parameter gradients."""
    from mpper.algos.muzero.networks import FullyConnectedNetwork, scale_gradient

    torch.manual_seed(0)
    net = make_network(NetworkConfig(kind="fc", encoding_size=8, hidden=hidden, support_size=5), (4,), 3)
    assert isinstance(net, FullyConnectedNetwork)
    obs = torch.randn(7, 4)
    actions = torch.randint(0, 3, (7, k_steps))
    weights = torch.randn(7, k_steps + 1, 11), torch.randn(7, k_steps, 11), torch.randn(7, k_steps + 1, 3)

    def loss_and_grads(value, reward, policy):
        loss = sum((w * x).sum() for w, x in zip(weights, (value, reward, policy)))
        net.zero_grad()
        loss.backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]

    got = net.unroll(obs, actions, 0.5)
    got_grads = loss_and_grads(*got[:3])
    out = net.initial_inference(obs)
    values, rewards, policies, hidden_state = [out.value_logits], [], [out.policy_logits], out.hidden_state
    hidden_states = [hidden_state]
    for k in range(k_steps):
        out = net.recurrent_inference(hidden_state if k == 0 else scale_gradient(hidden_state, 0.5), actions[:, k])
        values.append(out.value_logits)
        rewards.append(out.reward_logits)
        policies.append(out.policy_logits)
        hidden_state = out.hidden_state
        hidden_states.append(hidden_state)
    want = (torch.stack(values, 1), torch.stack(rewards, 1) if rewards else torch.zeros(7, 0, 11), torch.stack(policies, 1),
            torch.stack(hidden_states, 1))  # fmt: skip
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, loss_and_grads(*want[:3])):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_fc_dynamics_is_the_state_mlp_on_hidden_and_one_hot_action():
    """The fully connected dynamics never builds the one-hot input; its result must be
    the MLP applied to ``[hidden, one_hot(action)]`` as muzero-general writes it."""
    torch.manual_seed(3)
    net = make_network(NetworkConfig(kind="fc", encoding_size=6, hidden=[16, 8], support_size=4), (5,), 3)
    hidden = torch.rand(9, 6)
    action = torch.randint(0, 3, (9,))
    plain_input = torch.cat([hidden, torch.nn.functional.one_hot(action, 3).float()], 1)
    unscaled = net.dynamics_state_network(plain_input)
    next_hidden, reward_logits = net.dynamics(hidden, action)
    low, high = unscaled.min(1, keepdim=True).values, unscaled.max(1, keepdim=True).values
    torch.testing.assert_close(next_hidden, (unscaled - low) / (high - low), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reward_logits, net.dynamics_reward_network(unscaled), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "cfg, obs_shape, num_actions",
    [
        (NetworkConfig(kind="fc", encoding_size=8, hidden=[16], support_size=10, zero_init_heads=True), (4,), 2),
        (NetworkConfig(kind="residual", encoding_size=4, hidden=[8], blocks=1, support_size=5, zero_init_heads=True),
         (3, 3, 3), 9),
    ],
)  # fmt: skip
def test_zero_init_heads_predict_zero_value_and_reward_and_a_uniform_prior_and_still_learn(cfg, obs_shape, num_actions):
    torch.manual_seed(0)
    net = make_network(cfg, obs_shape, num_actions)
    obs = torch.randn(6, *obs_shape)
    actions = torch.randint(num_actions, (6, 3))
    with torch.no_grad():
        out = net.unroll(obs, actions)
    # Equal logits: a uniform distribution over the support, whose expectation is 0.
    assert torch.equal(out.value_logits, torch.zeros_like(out.value_logits))
    assert torch.equal(out.reward_logits, torch.zeros_like(out.reward_logits))
    assert torch.equal(out.policy_logits, torch.zeros(6, 4, num_actions))
    value = support_to_scalar(out.value_logits.flatten(0, 1), cfg.support_size)
    assert torch.allclose(value, torch.zeros(6 * 4), atol=1e-5)
    # The rest of the network is initialised as usual: the hidden states still depend on
    # the observation and the actions.
    assert not torch.allclose(out.hidden_states[0], out.hidden_states[1])
    # One gradient step moves every head away from zero.
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    out = net.unroll(obs, actions)
    (out.value_logits[..., -1].sum() + out.reward_logits[..., -1].sum() + out.policy_logits[..., 0].sum()).backward()
    optimizer.step()
    with torch.no_grad():
        after = net.unroll(obs, actions)
    assert after.value_logits.abs().sum() > 0
    assert after.reward_logits.abs().sum() > 0
    assert after.policy_logits.abs().sum() > 0


def test_heads_start_random_without_zero_init():
    torch.manual_seed(0)
    net = make_network(NetworkConfig(kind="fc", encoding_size=8, hidden=[16], support_size=10), (4,), 2)
    with torch.no_grad():
        out = net.initial_inference(torch.randn(6, 4))
    assert out.policy_logits.abs().sum() > 0
    assert out.value_logits.std() > 0


@pytest.mark.parametrize("name", ["cartpole", "tictactoe", "minatar_breakout", "atari_pong"])
def test_the_declared_hidden_shape_is_what_the_representation_returns(name):
    """``hidden_shape``, which sizes the search trees at a run's start (no forward there),
    against a real forward of one observation, stacked as the config stacks them."""
    from mpper.algos.configs import load_config
    from mpper.algos.registry import algorithm_of, run_env_spec
    from mpper.config_files import config_name_path

    config = load_config(config_name_path(name))
    spec = run_env_spec(config)
    net = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions).eval()
    shape = stacked_shape(spec.observation_shape, config.muzero.stacked_observations)
    with torch.no_grad():
        hidden = net.representation(torch.zeros((1, *shape)))
    assert tuple(hidden.shape[1:]) == tuple(net.hidden_shape)
