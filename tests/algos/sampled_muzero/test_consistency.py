"""EfficientZero's consistency loss in Sampled MuZero (``sampled_muzero.consistency_loss_weight``):
the next observations the targets gather, against the episodes they came from through a
real buffer; the trainer's loss against a plain per-sample loop written from the paper
(Ye et al. 2021, section 4.1: the negative cosine similarity of SimSiam's predicted
projection of the hidden state the dynamics reached after k real actions and the
projection of the representation of the real observation k moves later, none past the
episode's end); the config rule that ties the loss to the projection heads.

The network is put in eval mode where values are compared row by row (BatchNorm then uses
its running statistics, so one row at a time is the same function as a batch)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mpper.algos.configs import config_from_dict
from mpper.algos.muzero_family import consistency_loss
from mpper.algos.registry import get_algorithm
from mpper.algos.sampled_muzero.targets import SampledTargets, sampled_schema
from mpper.algos.sampled_muzero.trainer import SampledMuZeroTrainer
from mpper.config import ConfigError
from mpper.replay.buffer import ReplayBuffer

pytestmark = pytest.mark.timeout(120)

OBS, ACTION_DIM, SAMPLES, UNROLL = (3,), 2, 4, 3


def config_of(weight: float = 2.0, projection: int = 16):
    return config_from_dict({
        "algorithm": "sampled_muzero", "env": {"id": "Pendulum-v1"},
        "sampled_network": {"encoding_size": 8, "hidden": [16], "projection_size": projection},
        "sampled_muzero": {"num_unroll_steps": UNROLL, "td_steps": 3, "consistency_loss_weight": weight},
        "training": {"batch_size": 32}, "runtime": {"device": "cpu"},
    }, "x.json")  # fmt: skip


def episode(rng: np.random.Generator, episode_id: int, moves: int) -> dict[str, np.ndarray]:
    """T = ``moves`` moves (T + 1 rows); observation row r is (episode_id, r, noise), so a
    gathered observation says where it came from."""
    rows = moves + 1
    observation = np.stack([np.full(rows, episode_id), np.arange(rows), rng.normal(size=rows)], 1)
    return {
        "observation": observation.astype(np.float32),
        "action": rng.uniform(-1, 1, (rows, ACTION_DIM)).astype(np.float32),
        "reward": rng.normal(size=rows).astype(np.float32),
        "root_value": rng.normal(size=rows).astype(np.float32),
        "child_visits": rng.dirichlet(np.ones(SAMPLES), rows).astype(np.float32),
        "sampled_actions": rng.uniform(-1, 1, (rows, SAMPLES, ACTION_DIM)).astype(np.float32),
    }


@pytest.fixture
def buffer():
    rng = np.random.default_rng(5)
    with ReplayBuffer.create(sampled_schema(OBS, ACTION_DIM, SAMPLES), 400, alpha=0.5) as buf:
        # short episodes among them: batches hold steps past an episode's end
        for episode_id in range(12):
            moves = int(rng.integers(1, 15))
            buf.add_episode(episode(rng, episode_id, moves), rng.uniform(0.1, 1, moves))
        yield buf


def sample(buf, seed: int = 0):
    targets = SampledTargets(UNROLL, 3, 0.97, next_observations=True)
    return buf.sample(32, 1.0, targets, np.random.default_rng(seed))


def test_the_next_observations_are_the_episodes_next_rows_up_to_its_last(buffer):
    moves_of = {int(buffer.read_episode(ref)["observation"][0, 0]): buffer.read_episode(ref)["observation"].shape[0] - 1
                for ref in buffer.episodes()}  # fmt: skip
    batch = sample(buffer)
    d = batch.data
    assert d["next_observation"].shape == (32, UNROLL, *OBS) and d["next_observation_mask"].shape == (32, UNROLL)
    past_the_end = 0
    for b in range(32):
        episode_id, t = int(d["observation"][b, 0]), int(d["observation"][b, 1])
        big_t = moves_of[episode_id]
        for k in range(1, UNROLL + 1):
            row = min(t + k, big_t)
            assert d["next_observation"][b, k - 1, :2].tolist() == [episode_id, row], (b, k)
            assert d["next_observation_mask"][b, k - 1] == (t + k <= big_t)
            past_the_end += t + k > big_t
    assert past_the_end > 0, "a degenerate batch: no step past an episode's end"


def test_without_the_loss_the_targets_carry_no_next_observations(buffer):
    d = buffer.sample(8, 1.0, SampledTargets(UNROLL, 3, 0.97), np.random.default_rng(0)).data
    assert "next_observation" not in d and "next_observation_mask" not in d


def reference_consistency(net, d) -> np.ndarray:
    """(B,): per sample, per step k = 1..K, by hand from the paper: the dynamics stepped from
    the representation of o_t through the actions taken, projection then predictor; the
    projection of the representation of o_{t+k}; minus the cosine of the two vectors
    (L2-normalised with eps 1e-5); masked past the episode's end; the mean over the K steps."""
    out = np.zeros(len(d["observation"]))
    with torch.no_grad():
        for b in range(len(out)):
            hidden = net.representation(torch.as_tensor(d["observation"][b : b + 1]))
            for k in range(1, UNROLL + 1):
                hidden, _ = net.dynamics(hidden, torch.as_tensor(d["actions"][b : b + 1, k]))
                predicted = net.projection_predictor(net.projection(hidden))[0]
                real = net.projection(net.representation(torch.as_tensor(d["next_observation"][b, k - 1 : k])))[0]
                cosine = float(predicted @ real) / max(float(predicted.norm()), 1e-5) / max(float(real.norm()), 1e-5)
                out[b] += -cosine * d["next_observation_mask"][b, k - 1] / UNROLL
    return out


def trainer_of(config, network) -> SampledMuZeroTrainer:
    trainer = SampledMuZeroTrainer(config, copy.deepcopy(network), torch.device("cpu"))
    trainer.network.eval()
    return trainer


def test_the_trainers_loss_is_the_papers_per_sample_loop_and_part_of_the_total(buffer):
    torch.manual_seed(0)
    network = get_algorithm("sampled_muzero").make_network(config_of(), OBS, ACTION_DIM)
    with torch.no_grad():  # running statistics that are not the identity: a wrong layer order shows
        for module in network.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    batch = sample(buffer, seed=1)
    expected_per_sample = reference_consistency(network.eval(), batch.data)
    assert expected_per_sample.std() > 1e-3, "a degenerate case: every sample equally similar"
    metrics, _ = trainer_of(config_of(weight=2.0), network).train_step(batch)
    assert metrics["consistency_loss"] == pytest.approx(float(expected_per_sample.mean()), rel=1e-4, abs=1e-6)
    # the same weights and batch with the loss off: the total without the term, no metric
    metrics_off, _ = trainer_of(config_of(weight=0.0), network).train_step(batch)
    assert "consistency_loss" not in metrics_off
    expected_total = metrics_off["total_loss"] + 2.0 * float(np.mean(batch.weights * expected_per_sample))
    assert metrics["total_loss"] == pytest.approx(expected_total, rel=1e-4, abs=1e-5)


def test_the_loss_trains_the_dynamics_and_the_heads_not_the_target_side(buffer):
    config = config_of(weight=2.0)
    torch.manual_seed(0)
    network = get_algorithm("sampled_muzero").make_network(config, OBS, ACTION_DIM)
    batch = sample(buffer, seed=2)
    d = {k: torch.as_tensor(v) for k, v in batch.data.items()}

    hidden = network.representation(d["observation"])
    unrolled = []
    for k in range(1, UNROLL + 1):
        hidden, _ = network.dynamics(hidden, d["actions"][:, k])
        unrolled.append(hidden)
    consistency_loss(network, torch.stack(unrolled, 1), d["next_observation"]).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in network.projection_predictor.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in network.dynamics_net.parameters())
    for name, parameter in network.named_parameters():
        if name.startswith(("value_net", "policy_net", "reward_net")):
            assert parameter.grad is None, f"{name} got a gradient from the consistency loss"


def test_the_loss_needs_the_projection_heads_one_line():
    with pytest.raises(ConfigError, match="sampled_network.projection_size >= 1"):
        config_of(weight=1.0, projection=0)
    assert config_of(weight=0.0, projection=0).sampled_muzero.consistency_loss_weight == 0
