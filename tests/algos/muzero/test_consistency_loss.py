"""EfficientZero's consistency loss (``muzero.consistency_loss_weight``): the loss
against a plain per-sample loop written from the paper (Ye et al. 2021, section 4.1:
SimSiam's negative cosine similarity between the projected and predicted hidden state
the dynamics reached after k real actions and the projection of the representation of
the real observation k moves later, that side under a stop-gradient), its masking past
an episode's end, its stop-gradient, its place in the trainer's total, and the config
rule that ties it to the projection heads.

Real parts throughout: a real ``ReplayBuffer`` filled with random episodes, batches from
``buffer.sample`` with ``MuZeroTargets(next_observations=True)``, the real network and
trainer. The networks are put in eval mode where a value is compared row by row
(BatchNorm then uses its running statistics, so a batch of one row is the same
function as a batch of many).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import make_episode
from test_learner import ACTIONS, OBS, small_config

from mpper import ReplayBuffer
from mpper.algos.configs import load_config
from mpper.algos.muzero.networks import MuZeroNetwork, make_network
from mpper.algos.muzero.targets import MuZeroTargets, muzero_schema
from mpper.algos.muzero.trainer import MuZeroTrainer
from mpper.algos.muzero_family import consistency_loss
from mpper.config import ConfigError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

K = 3
PROJECTION = 16


def consistency_config(weight: float = 2.0, projection: int = PROJECTION):
    config = small_config(consistency_loss_weight=weight)
    config.network.projection_size = projection
    return config


@pytest.fixture
def buffer():
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=512, alpha=0.6)
    try:
        rng = np.random.default_rng(3)
        # Short episodes among them, so that batches hold steps past an episode's end.
        for _ in range(14):
            buf.add_episode(make_episode(rng, int(rng.integers(1, 12)), OBS, ACTIONS))
        yield buf
    finally:
        buf.close()


def sample(buf, batch_size: int = 32, seed: int = 0):
    targets = MuZeroTargets(K, 5, 0.997, ACTIONS, next_observations=True)
    return buf.sample(batch_size, 0.4, targets, np.random.default_rng(seed))


def make_net(seed: int = 0) -> MuZeroNetwork:
    torch.manual_seed(seed)
    net = make_network(consistency_config().network, OBS, ACTIONS)
    # Give BatchNorm running statistics that are not the identity, so eval mode computes
    # something a wrong layer order would change.
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return net.eval()


def reference_negative_cosine(net: MuZeroNetwork, observation, actions, next_observation) -> np.ndarray:
    """(B, K), one sample and one step at a time: the dynamics stepped by hand from the
    representation of o_t through the actions taken, projection then predictor on that
    side, projection alone on the representation of o_{t+k}, cosine similarity of the two
    L2-normalised vectors (eps 1e-5), negated."""
    out = np.zeros(actions.shape)
    with torch.no_grad():
        for b in range(actions.shape[0]):
            hidden = net.representation(torch.as_tensor(observation[b : b + 1]))
            for k in range(actions.shape[1]):
                hidden, _ = net.dynamics(hidden, torch.as_tensor(actions[b : b + 1, k]))
                predicted = net.projection_predictor(net.projection(hidden))[0]
                real = net.representation(torch.as_tensor(next_observation[b, k : k + 1]))
                target = net.projection(real)[0]
                predicted = predicted / max(float(predicted.norm()), 1e-5)
                target = target / max(float(target.norm()), 1e-5)
                out[b, k] = -float(predicted @ target)
    return out


def test_negative_cosine_matches_a_per_sample_loop(buffer):
    net = make_net()
    batch = sample(buffer)
    d = batch.data
    unrolled = net.unroll(torch.as_tensor(d["observation"]), torch.as_tensor(d["actions"][:, 1:]))
    got = consistency_loss(net, unrolled.hidden_states[:, 1:], torch.as_tensor(d["next_observation"]))
    expected = reference_negative_cosine(net, d["observation"], d["actions"][:, 1:], d["next_observation"])
    assert got.shape == (len(batch.indices), K)
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-5, atol=1e-6)
    assert np.all(expected >= -1 - 1e-6) and np.all(expected <= 1 + 1e-6)
    assert expected.std() > 1e-3, "a degenerate case: every pair equally similar"


def test_the_target_side_passes_no_gradient():
    net = make_net()
    net.train()
    hidden = torch.rand(8, K, 8, requires_grad=True)  # stands for the dynamics' hidden states
    next_observation = torch.randn(8, K, *OBS)
    consistency_loss(net, hidden, next_observation).sum().backward()
    for name, parameter in net.named_parameters():
        if name.startswith(("representation_network", "dynamics", "prediction")):
            assert parameter.grad is None, f"{name} got a gradient through the stop-gradient side"
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.projection_predictor.parameters())
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def _trainer(net: MuZeroNetwork, weight: float = 2.0) -> MuZeroTrainer:
    trainer = MuZeroTrainer(consistency_config(weight), copy.deepcopy(net), torch.device("cpu"))
    trainer.network.eval()  # row-wise BatchNorm, so the reference below is exact
    return trainer


def test_trainer_reports_the_masked_importance_weighted_loss_and_adds_it_to_the_total(buffer):
    net = make_net()
    batch = sample(buffer, seed=1)
    d = batch.data
    mask = d["next_observation_mask"]
    assert 0 < mask.sum() < mask.size, "the batch needs steps both inside and past an episode's end"
    expected_per_step = reference_negative_cosine(net, d["observation"], d["actions"][:, 1:], d["next_observation"])
    expected = float(np.mean(batch.weights * (expected_per_step * mask).sum(1)))

    weight = 2.0
    metrics, _ = _trainer(net, weight).train_step(batch)
    assert metrics["consistency_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert metrics["total_loss"] == pytest.approx(
        0.25 * metrics["value_loss"] + metrics["reward_loss"] + metrics["policy_loss"] + weight * expected,
        rel=1e-5, abs=1e-6)

    # Off: the same batch gives the total without the term and no consistency metric.
    metrics_off, _ = MuZeroTrainer(small_config(), _strip(net), torch.device("cpu")).train_step(batch)
    assert "consistency_loss" not in metrics_off
    assert metrics_off["total_loss"] == pytest.approx(
        0.25 * metrics_off["value_loss"] + metrics_off["reward_loss"] + metrics_off["policy_loss"], rel=1e-5)


def _strip(net: MuZeroNetwork) -> MuZeroNetwork:
    """The same weights without the projection heads (what projection_size 0 builds)."""
    plain = copy.deepcopy(net)
    plain.projection = plain.projection_predictor = None
    return plain


def test_steps_past_the_episode_end_change_nothing(buffer):
    net = make_net()
    batch = sample(buffer, seed=2)
    masked = batch.data["next_observation_mask"] == 0
    assert masked.any()
    garbage = copy.deepcopy(batch)
    garbage.data["next_observation"][masked] = 1e3 * np.random.default_rng(0).standard_normal(
        garbage.data["next_observation"][masked].shape).astype(np.float32)
    first, second = _trainer(net), _trainer(net)
    m1, p1 = first.train_step(batch)
    m2, p2 = second.train_step(garbage)
    assert m1["consistency_loss"] == m2["consistency_loss"] and m1["total_loss"] == m2["total_loss"]
    np.testing.assert_array_equal(p1, p2)
    for a, b in zip(first.network.parameters(), second.network.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_training_pulls_the_dynamics_towards_the_real_next_representation(buffer):
    torch.manual_seed(0)
    trainer = MuZeroTrainer(consistency_config(weight=2.0), make_network(consistency_config().network, OBS, ACTIONS),
                            torch.device("cpu"))
    batch = sample(buffer, batch_size=64, seed=4)
    first = trainer.train_step(batch)[0]["consistency_loss"]
    for _ in range(60):
        last = trainer.train_step(batch)[0]["consistency_loss"]
    assert last < first - 0.2 * abs(first), (first, last)


def test_the_loss_needs_projection_heads(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"algorithm": "muzero", "muzero": {"consistency_loss_weight": 2.0}}')
    with pytest.raises(ConfigError, match=r"muzero\.consistency_loss_weight.*network\.projection_size >= 1"):
        load_config(str(path))
    net = make_network(small_config().network, OBS, ACTIONS)
    with pytest.raises(RuntimeError, match="projection_size"):
        net.project(torch.zeros(2, 8), predict=True)


def reference_predictor_gradient(net: MuZeroNetwork, batch, weight: float) -> list[torch.Tensor]:
    """The gradient of the consistency term in the predictor head's parameters, by a
    per-sample, per-step loop: each step's negative cosine, masked past the episode's
    end, is divided by the step's ``gradient_scale`` (muzero-general's per-step gradient
    hook, which the paper's loss inherits from MuZero), weighted by the importance weight,
    then averaged over the batch. The head takes no other loss's gradient."""
    net = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    d = batch.data
    observation, actions = torch.as_tensor(d["observation"]), torch.as_tensor(d["actions"][:, 1:])
    total = torch.zeros(())
    for b in range(actions.shape[0]):
        hidden = net.representation(observation[b : b + 1])
        for k in range(actions.shape[1]):
            hidden, _ = net.dynamics(hidden, actions[b : b + 1, k])
            predicted = net.projection_predictor(net.projection(hidden))[0]
            with torch.no_grad():
                target = net.projection(net.representation(torch.as_tensor(d["next_observation"][b, k : k + 1])))[0]
            cosine = (predicted / predicted.norm().clamp(min=1e-5)) @ (target / target.norm().clamp(min=1e-5))
            step = -cosine * float(d["next_observation_mask"][b, k]) / float(d["gradient_scale"][b, k + 1])
            total = total + float(batch.weights[b]) * step
    (weight * total / actions.shape[0]).backward()
    return [p.grad.clone() for p in net.projection_predictor.parameters()]


def test_each_unrolled_steps_consistency_gradient_is_divided_by_its_gradient_scale(buffer):
    net = make_net()
    batch = sample(buffer, seed=5)
    assert (batch.data["gradient_scale"][:, 1:] > 1).any(), "a scale of 1 everywhere would hide the division"
    trainer = _trainer(net, weight=2.0)
    trainer.train_step(batch)
    got = [p.grad for p in trainer.network.projection_predictor.parameters()]
    for g, expected in zip(got, reference_predictor_gradient(net, batch, weight=2.0)):
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-7)
