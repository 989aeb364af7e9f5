"""The learner: the MuZero update, checkpoints, and the learner process.

Everything runs on the CPU with a small fully connected network and a real
``ReplayBuffer`` (muzero_schema, observations (4,), 2 actions) filled with random
episodes; batches come from ``buffer.sample(..., MuZeroTargets(...))``.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing as mp
import os
import queue
import threading
import time

import numpy as np
import pytest
import torch
from conftest import make_episode

from mpper import ReplayBuffer
from mpper.algos.configs import load_config
from mpper.algos.muzero.config import MCTSConfig, MuZeroConfig, MuZeroRunConfig, NetworkConfig, ReanalyseConfig
from mpper.algos.muzero.networks import make_network, scale_gradient, support_to_scalar
from mpper.algos.muzero.targets import MuZeroTargets, muzero_schema
from mpper.algos.muzero.trainer import MuZeroTrainer
from mpper.algos.optim import Adam
from mpper.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mpper.config import ReplayConfig, RuntimeConfig, TrainingConfig
from mpper.replay.buffer import Batch
from mpper.runtime.children import run_learner
from mpper.runtime.rate import RateLimiter
from mpper.runtime.roles import beta_schedule
from mpper.runtime.setup import RunSetup
from mpper.runtime.weights import WeightStore

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

OBS, ACTIONS, K = (4,), 2, 3


MUZERO_KEYS = {f.name for f in dataclasses.fields(MuZeroConfig)}


def small_config(**keys) -> MuZeroRunConfig:
    """A small MuZero config (not checked, so that a test can pick any sizes): ``keys``
    of the ``training`` and ``muzero`` sections."""
    training = dict(
        training_steps=6, batch_size=16, optimizer="adam", lr_init=0.01, lr_decay_rate=1.0, lr_decay_steps=100,
        weight_decay=1e-4, publish_interval=2, min_buffer_steps=16,
    )  # fmt: skip
    muzero = dict(num_unroll_steps=K, td_steps=5, value_loss_weight=0.25)
    for key, value in keys.items():
        (muzero if key in MUZERO_KEYS else training)[key] = value
    return MuZeroRunConfig(
        replay=ReplayConfig(capacity=512, alpha=0.6, beta=0.4),
        training=TrainingConfig(**training),
        runtime=RuntimeConfig(device="cpu", torch_threads=1, checkpoint_interval_s=3600.0, seed=0),
        network=NetworkConfig(kind="fc", encoding_size=8, hidden=[16], support_size=5),
        mcts=MCTSConfig(), muzero=MuZeroConfig(**muzero), reanalyse=ReanalyseConfig(),
    )  # fmt: skip


def make_trainer(config: MuZeroRunConfig, seed: int = 0) -> MuZeroTrainer:
    torch.manual_seed(seed)
    net = make_network(config.network, OBS, ACTIONS, config.muzero.stacked_observations)
    return MuZeroTrainer(config, net, torch.device("cpu"))


def fill(buf: ReplayBuffer, episodes: int = 12, seed: int = 0) -> None:
    """``episodes`` random episodes of 5-29 moves, every third one truncated (its unroll
    stops at the cut: masked targets past it)."""
    rng = np.random.default_rng(seed)
    for i in range(episodes):
        buf.add_episode(make_episode(rng, int(rng.integers(5, 30)), OBS, ACTIONS), terminated=i % 3 != 1)



@pytest.fixture
def buffer():
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=512, alpha=0.6)
    try:
        fill(buf)
        yield buf
    finally:
        buf.close()


def sample(buf: ReplayBuffer, config: MuZeroRunConfig, batch_size: int = 16, seed: int = 0) -> Batch:
    t = config.muzero
    targets = MuZeroTargets(t.num_unroll_steps, t.td_steps, 0.997, ACTIONS, t.stacked_observations)
    return buf.sample(batch_size, 0.4, targets, np.random.default_rng(seed))


def subset(batch: Batch, rows: np.ndarray) -> Batch:
    return Batch(batch.indices[rows], batch.generations[rows], batch.weights[rows], batch.probabilities[rows],
                 {k: v[rows] for k, v in batch.data.items()})  # fmt: skip


def flat(trainer: MuZeroTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in trainer.network.parameters()])


# --------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------


def test_scale_gradient_keeps_value_and_scales_gradient():
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = scale_gradient(x, 0.5)
    assert torch.equal(y, x)
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.allclose(x.grad, torch.tensor([0.5, 1.0, 1.5]))


def test_loss_falls_on_a_fixed_batch(buffer):
    config = small_config()
    trainer = make_trainer(config)
    batch = sample(buffer, config)
    losses = []
    for _ in range(30):
        metrics, _ = trainer.train_step(batch)
        losses.append(metrics["total_loss"])
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.6 * losses[0], losses
    m = metrics
    assert m["training_step"] == 30
    assert m["total_loss"] == pytest.approx(0.25 * m["value_loss"] + m["reward_loss"] + m["policy_loss"], rel=1e-5)


def test_priorities_are_root_value_errors(buffer):
    config = small_config()
    trainer = make_trainer(config)
    batch = sample(buffer, config)
    before = copy.deepcopy(trainer.network)  # the priorities come from the pre-update forward pass
    _, priorities = trainer.train_step(batch)
    with torch.no_grad():
        out = before.initial_inference(torch.from_numpy(batch.data["observation"]))
        predicted = support_to_scalar(out.value_logits, config.network.support_size).numpy().astype(np.float64)
    expected = np.abs(predicted - batch.data["target_value"][:, 0].astype(np.float64))
    assert priorities.shape == (16,) and priorities.dtype == np.float64
    np.testing.assert_allclose(priorities, expected, rtol=1e-5, atol=1e-6)
    # and they go back into the tree: the sampled leaves change to (p + eps) ** alpha
    buffer.update_priorities(batch.indices, batch.generations, priorities)
    np.testing.assert_allclose(buffer.priorities(batch.indices[-1:]), (priorities[-1:] + 1e-6) ** 0.6, rtol=1e-9)


def test_unrolled_priorities_are_the_value_errors_of_every_unrolled_position(buffer):
    """``priority_update: "unrolled"``: |v_k - z_k| for k = 0..K, v_k from the network
    before the update (initial inference, then the dynamics on the batch's actions)."""
    config = small_config(priority_update="unrolled")
    trainer = make_trainer(config)
    batch = sample(buffer, config)
    before = copy.deepcopy(trainer.network)
    _, priorities = trainer.train_step(batch)
    k1 = config.muzero.num_unroll_steps + 1
    support = config.network.support_size
    expected = np.empty((16, k1))
    with torch.no_grad():
        out = before.initial_inference(torch.from_numpy(batch.data["observation"]))
        for k in range(k1):
            if k:
                out = before.recurrent_inference(out.hidden_state, torch.from_numpy(batch.data["actions"][:, k]))
            expected[:, k] = support_to_scalar(out.value_logits, support).numpy()
    expected = np.abs(expected - batch.data["target_value"].astype(np.float64))
    assert priorities.shape == (16, k1) and priorities.dtype == np.float64
    np.testing.assert_allclose(priorities, expected, rtol=1e-5, atol=1e-5)


def test_importance_weights_weight_each_sample(buffer):
    # Plain SGD (no momentum, no weight decay): the step is -lr * gradient, so weight
    # changes compare gradients. A row with IS weight 0 must contribute nothing: the
    # batch with it gives the gradient of the batch without it, times (B - 1) / B (the
    # mean's denominator).
    config = small_config(optimizer="sgd", momentum=0.0, weight_decay=0.0, lr_init=0.1)
    batch = sample(buffer, config, batch_size=8)
    weighted = copy.deepcopy(batch)
    weighted.weights = np.ones(8, np.float32)
    weighted.weights[3] = 0.0
    rest = subset(weighted, np.array([0, 1, 2, 4, 5, 6, 7]))
    a, b, c = make_trainer(config), make_trainer(config), make_trainer(config)
    start = flat(a)
    a.train_step(weighted)
    b.train_step(rest)
    weighted.weights[3] = 1.0
    c.train_step(weighted)
    delta_a, delta_b, delta_c = flat(a) - start, flat(b) - start, flat(c) - start
    torch.testing.assert_close(delta_a * 8 / 7, delta_b, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(delta_c * 8 / 7, delta_b, rtol=1e-3, atol=1e-6)  # row 3 does matter at weight 1


def reference_gradient(net, batch: Batch, value_loss_weight: float, support: int) -> torch.Tensor:
    """The loss of the MuZero pseudocode (``update_weights``), written with
    ``register_hook``: the hidden state a dynamics step returns is passed on to the next
    step through ``scale_gradient(hidden_state, 0.5)``, so the gradient is halved where
    it enters dynamics steps 2..K, not step 1, and not on the way from a step's own
    predictions; each unrolled step's loss gradient divided by ``gradient_scale``, no
    reward loss at step 0, IS-weighted mean; past the cut of a truncated episode a
    step's terms are dropped (``target_mask`` for value and reward, ``policy_mask`` for
    the policy), which the pseudocode, whose episodes all end, does not need. Returns the
    flat gradient of all parameters."""
    from mpper.algos.muzero.networks import scalar_to_support

    d = {k: torch.from_numpy(v) for k, v in batch.data.items()}
    w = torch.from_numpy(batch.weights)

    def ce(logits, target):
        return (-target * torch.nn.LogSoftmax(dim=1)(logits)).sum(1)

    def two_hot(x):
        return scalar_to_support(x.reshape(-1), support).view(x.shape[0], x.shape[1], -1)

    tv, tr, tp, gs = two_hot(d["target_value"]), two_hot(d["target_reward"]), d["target_policy"], d["gradient_scale"]
    keep, keep_policy = d["target_mask"], d["policy_mask"]
    out = net.initial_inference(d["observation"])
    value_loss = ce(out.value_logits, tv[:, 0]) * keep[:, 0]
    policy_loss = ce(out.policy_logits, tp[:, 0]) * keep_policy[:, 0]
    reward_loss = 0
    hidden = out.hidden_state
    for k in range(1, d["actions"].shape[1]):
        start = hidden
        if k > 1:
            start = hidden * 1.0  # a node of its own, so the hook acts on this edge only
            start.register_hook(lambda g: g * 0.5)
        out = net.recurrent_inference(start, d["actions"][:, k])
        hidden = out.hidden_state
        losses = (ce(out.value_logits, tv[:, k]) * keep[:, k], ce(out.reward_logits, tr[:, k]) * keep[:, k],
                  ce(out.policy_logits, tp[:, k]) * keep_policy[:, k])  # fmt: skip
        for loss in losses:
            loss.register_hook(lambda g, s=gs[:, k]: g / s)
        value_loss = value_loss + losses[0]
        reward_loss = reward_loss + losses[1]
        policy_loss = policy_loss + losses[2]
    total = ((value_loss * value_loss_weight + reward_loss + policy_loss) * w).mean()
    net.zero_grad()
    total.backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def test_gradient_matches_the_pseudocode_loss(buffer):
    # SGD with lr 1, no momentum, no weight decay: the update is minus the gradient.
    config = small_config(optimizer="sgd", momentum=0.0, weight_decay=0.0, lr_init=1.0)
    batch = sample(buffer, config, batch_size=64)
    assert (batch.data["target_mask"] == 0).any()  # steps past a cut are in the batch
    batch.weights = np.random.default_rng(0).uniform(0.2, 1.0, 64).astype(np.float32)
    trainer = make_trainer(config)
    expected = reference_gradient(copy.deepcopy(trainer.network), batch, 0.25, config.network.support_size)
    start = flat(trainer)
    trainer.train_step(batch)
    torch.testing.assert_close(start - flat(trainer), expected, rtol=1e-4, atol=1e-6)


def test_targets_past_a_cut_do_not_move_the_weights(buffer):
    """The unroll steps past the cut of a truncated episode (masks 0) train nothing:
    whatever their targets say, the update is the same."""
    config = small_config(optimizer="sgd", momentum=0.0, weight_decay=0.0, lr_init=1.0, num_unroll_steps=6)
    batch = sample(buffer, config, batch_size=64)
    value_off, policy_off = batch.data["target_mask"] == 0, batch.data["policy_mask"] == 0
    assert value_off.any() and (policy_off & ~value_off).any()  # both masks at work in this batch
    changed = copy.deepcopy(batch)
    rng = np.random.default_rng(1)
    changed.data["target_value"][value_off] = rng.uniform(-4, 4, value_off.sum())
    changed.data["target_reward"][value_off] = rng.uniform(-4, 4, value_off.sum())
    changed.data["target_policy"][policy_off] = rng.dirichlet(np.ones(ACTIONS), policy_off.sum())
    a, b = make_trainer(config), make_trainer(config)
    a.train_step(batch)
    b.train_step(changed)
    torch.testing.assert_close(flat(a), flat(b), rtol=0, atol=0)
    unmasked = copy.deepcopy(changed)  # the same change where the masks are 1 does move them
    unmasked.data["target_value"][~value_off] += 3.0
    c = make_trainer(config)
    c.train_step(unmasked)
    assert not torch.allclose(flat(a), flat(c))


def test_non_finite_loss_raises_and_changes_nothing(buffer):
    config = small_config()
    trainer = make_trainer(config)
    trainer.train_step(sample(buffer, config, seed=1))  # so that the optimizer has state
    weights, opt_state = flat(trainer), copy.deepcopy(trainer.optimizer.state_dict())
    bad = sample(buffer, config, seed=2)
    bad.data["observation"][5] = np.nan
    with pytest.raises(FloatingPointError, match="non-finite loss at training step 1"):
        trainer.train_step(bad)
    assert torch.equal(flat(trainer), weights)
    assert trainer.training_step == 1
    state = trainer.optimizer.state_dict()["state"]
    for key, value in opt_state["state"].items():
        for name, tensor in value.items():
            assert torch.equal(state[key][name], tensor), (key, name)


def test_learning_rate_follows_the_schedule(buffer):
    config = small_config(lr_init=0.1, lr_decay_rate=0.5, lr_decay_steps=2)
    trainer = make_trainer(config)
    batch = sample(buffer, config)
    lrs = [trainer.train_step(batch)[0]["lr"] for _ in range(5)]
    np.testing.assert_allclose(lrs, [0.1 * 0.5 ** (s / 2) for s in range(5)], rtol=1e-12)
    assert trainer.optimizer.param_groups[0]["lr"] == lrs[-1]


def test_grad_clip_bounds_the_step(buffer):
    # SGD without momentum: with clipping at c the update's norm is at most lr * c.
    config = small_config(optimizer="sgd", momentum=0.0, weight_decay=0.0, lr_init=1.0, grad_clip=1e-3)
    trainer = make_trainer(config)
    start = flat(trainer)
    metrics, _ = trainer.train_step(sample(buffer, config))
    assert metrics["grad_norm"] > 1e-3  # it was clipped
    assert torch.linalg.vector_norm(flat(trainer) - start) <= 1e-3 * (1 + 1e-4)


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


def test_checkpoint_round_trip(buffer, tmp_path):
    config = small_config()
    trainer = make_trainer(config, seed=0)
    for seed in range(3):
        trainer.train_step(sample(buffer, config, seed=seed))
    path = tmp_path / "run" / "checkpoint.pt"
    save_checkpoint(path, trainer, {"note": "x", "numbers": [1, 2.5, None]})
    assert os.listdir(path.parent) == ["checkpoint.pt"]  # no temporary file left

    state = torch.load(path, weights_only=True)  # the plain safe loader reads it
    assert state["training_step"] == 3 and state["extra"] == {"note": "x", "numbers": [1, 2.5, None]}

    other = make_trainer(config, seed=1)
    other.load_state_dict(load_checkpoint(path))
    assert other.training_step == 3
    obs = torch.from_numpy(sample(buffer, config, seed=9).data["observation"])
    with torch.no_grad():
        for x, y in zip(trainer.network.initial_inference(obs), other.network.initial_inference(obs), strict=True):
            assert torch.equal(x, y)
    saved, loaded = trainer.optimizer.state_dict(), other.optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for key, value in saved["state"].items():
        for name, tensor in value.items():
            assert torch.equal(loaded["state"][key][name], tensor)
    # the same next step: the optimizer's moments were restored, not restarted
    batch = sample(buffer, config, seed=4)
    m1, p1 = trainer.train_step(batch)
    m2, p2 = other.train_step(batch)
    assert torch.equal(flat(trainer), flat(other))
    assert m1 == m2 and np.array_equal(p1, p2)


def test_the_trainers_adam_matches_torch_optims_and_resumes_its_checkpoint(buffer, tmp_path):
    """The trainer's Adam (``mpper.algos.optim``, the fused kernel): the same updates as
    torch's reference (for-loop) Adam, and a checkpoint written by a ``torch.optim``
    optimizer (an older run, or the static step) resumes into it with its moments."""
    config = small_config()
    fused = make_trainer(config, seed=0)
    assert isinstance(fused.optimizer, Adam)
    plain = make_trainer(config, seed=0)
    plain.optimizer = torch.optim.Adam(plain.network.parameters(), lr=config.training.lr_init,
                                       weight_decay=config.training.weight_decay, foreach=False)  # fmt: skip
    for seed in range(5):
        batch = sample(buffer, config, seed=seed)
        fused.train_step(batch)
        plain.train_step(batch)
    assert torch.allclose(flat(fused), flat(plain), rtol=1e-5, atol=1e-6)
    assert not torch.equal(flat(fused), flat(make_trainer(config, seed=0)))  # it did train

    path = tmp_path / "unfused.pt"
    save_checkpoint(path, plain)
    state = load_checkpoint(path)
    assert state["optimizer"]["param_groups"][0]["fused"] is None
    resumed = make_trainer(config, seed=1)
    resumed.load_state_dict(state)
    assert isinstance(resumed.optimizer, Adam)
    batch = sample(buffer, config, seed=7)
    plain.train_step(batch)
    resumed.train_step(batch)
    assert torch.allclose(flat(resumed), flat(plain), rtol=1e-5, atol=1e-6)


class _Payload:
    """Unpickling this would run ``touch(path)``: a checkpoint must never do that."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_checkpoint_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_checkpoint(missing)

    evil = tmp_path / "evil.pt"
    marker = tmp_path / "was_run"
    torch.save({"network": {}, "x": _Payload(str(marker))}, evil)
    with pytest.raises(CheckpointError, match=str(evil)):
        load_checkpoint(evil)
    assert not marker.exists()

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=str(garbage)):
        load_checkpoint(garbage)


# --------------------------------------------------------------------------------------
# The learner process
# --------------------------------------------------------------------------------------


def _drain(q, timeout: float = 0.0) -> list:
    out = []
    while True:
        try:
            out.append(q.get(timeout=timeout))
        except queue.Empty:
            return out


def _store_for(config: MuZeroRunConfig) -> WeightStore:
    net = make_network(config.network, OBS, ACTIONS, config.muzero.stacked_observations)
    return WeightStore.create(net.num_flat_weights())


@pytest.mark.slow
def test_run_learner_in_a_spawned_process(buffer, tmp_path):
    ctx = mp.get_context("spawn")
    config = small_config(training_steps=6, batch_size=8, min_buffer_steps=8, publish_interval=2)
    store = _store_for(config)
    try:
        leaves_before = buffer.priorities(np.arange(buffer.capacity)).copy()
        stop, reports = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=run_learner, args=(RunSetup.create(config, tmp_path), buffer.handle, store.handle,
                                                     stop, reports))  # fmt: skip
        proc.start()
        messages = []
        while proc.is_alive():
            messages += _drain(reports, timeout=0.2)
        proc.join(30)
        messages += _drain(reports, timeout=0.2)
        assert proc.exitcode == 0, messages

        assert [m for m in messages if m[0] == "error"] == []
        metrics = [m[2] for m in messages if m[:2] == ("metrics", "learner")]
        final = metrics[-1]
        assert final["training_step"] == 6 and final["state"] == "done"
        for key in ("total_loss", "value_loss", "reward_loss", "policy_loss", "lr", "steps_per_s", "wait_fraction"):
            assert np.isfinite(final[key]), key
        assert final["priority_updates_applied"] + final["priority_updates_dropped"] == 6 * 8
        # version 1 at start, then at steps 2, 4 and 6
        assert store.version == 4 and store.training_step == 6
        assert buffer.counters["priority_updates_applied"] == 6 * 8
        assert not np.array_equal(buffer.priorities(np.arange(buffer.capacity)), leaves_before)

        ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
        assert ckpt["training_step"] == 6 and ckpt["extra"]["weights_version"] == 4
        # the published weights are the checkpoint's
        net = make_network(config.network, OBS, ACTIONS)
        net.load_state_dict(ckpt["network"])
        published = np.empty(store.handle.num_weights, np.float32)
        store.read_into(published)
        np.testing.assert_array_equal(published, net.get_flat_weights())
    finally:
        store.close()


class _CountingRate(RateLimiter):
    """The run's rate limiter (no ratio: sampling waits for min_size only), counting how
    often the learner asks it whether it may sample (waiting for a batch, or before
    drawing the next one ahead)."""

    def __init__(self, config: MuZeroRunConfig):
        t = config.training
        super().__init__(None, 0.0, t.min_buffer_steps, t.batch_size, None)
        self.calls = 0

    def can_sample(self, inserted, sampled) -> bool:
        self.calls += 1
        return super().can_sample(inserted, sampled)


def test_run_learner_resumes_and_uses_the_rate_limiter(buffer, tmp_path):
    # In-process (threads and a plain queue) to keep it fast; the spawned test above
    # covers the process boundary.
    config = small_config(training_steps=3, batch_size=8, min_buffer_steps=8, publish_interval=10)
    store = _store_for(config)
    try:
        reports, rate = queue.Queue(), _CountingRate(config)
        run_learner(RunSetup.create(config, tmp_path), buffer.handle, store.handle, threading.Event(), reports, rate)
        assert rate.calls >= 3  # asked before each of the 3 batches
        assert store.version == 2  # initial, then the final weights (step 3 is not a multiple of 10)
        first = load_checkpoint(tmp_path / "checkpoint.pt")
        assert first["training_step"] == 3

        config.training.training_steps = 5
        rate.calls = 0
        run_learner(RunSetup.create(config, tmp_path, resume=True), buffer.handle, store.handle, threading.Event(),
                    reports, rate)  # fmt: skip
        assert rate.calls >= 2  # asked before each of the 2 missing steps, which alone ran
        resumed = load_checkpoint(tmp_path / "checkpoint.pt")
        assert resumed["training_step"] == 5
        assert store.version == 4 and store.training_step == 5  # resumed weights, then the final ones
        final = [m for m in _drain(reports) if m[0] == "metrics"][-1][2]
        assert final["training_step"] == 5 and final["state"] == "done"
    finally:
        store.close()


class _CountedStop(threading.Event):
    """A stop event that counts ``is_set()`` calls: while the learner is held, each
    counts one pass of the rate limiter's wait loop."""

    def __init__(self):
        super().__init__()
        self.checks = 0

    def is_set(self) -> bool:
        self.checks += 1
        return super().is_set()


def _poll(condition, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout  # generous: only a hang gets near it
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_learner_is_held_by_the_real_rate_limiter(buffer, tmp_path):
    """mpper.runtime.rate.RateLimiter with tolerance 0: sampling waits while samples + B > r * I.
    With r = 3.5 B / I the learner takes exactly 3 batches, then stays blocked (no
    self-play inserts anything) through 20 passes of the limiter's wait loop, sleeping
    ``poll_s`` between them instead of spinning, until stop ends the run cleanly."""
    from mpper.runtime.rate import _MAX_RINGS, RateLimiter

    config = small_config(training_steps=50, batch_size=8, min_buffer_steps=8)
    inserted = buffer.counters["steps"]
    poll_s = 0.05
    rate = RateLimiter(3.5 * 8 / inserted, 0.0, 8, 8, mp.get_context("spawn"), poll_s=poll_s)
    store = _store_for(config)
    stop, reports = _CountedStop(), queue.Queue()
    learner = threading.Thread(target=run_learner, args=(RunSetup.create(config, tmp_path), buffer.handle,
                                                         store.handle, stop, reports, rate))  # fmt: skip
    try:
        started = time.monotonic()
        learner.start()
        _poll(lambda: buffer.counters["samples"] == 3 * 8, "the learner's 3 batches")
        checks = stop.checks
        _poll(lambda: stop.checks >= checks + 3, "the learner waiting on the limiter")  # at most 2 are the loop's
        held, checks = time.monotonic(), stop.checks
        # Held for 20 passes of the wait loop, and at least as long as it took to get here.
        _poll(lambda: stop.checks >= checks + 20 and time.monotonic() - held >= held - started,
              "20 passes of the wait loop")  # fmt: skip
        passes, seconds = stop.checks - checks, time.monotonic() - held
        assert buffer.counters["samples"] == 3 * 8  # still held
        assert learner.is_alive()
        # Each pass sleeps poll_s on the doorbell unless a pending ring (at most _MAX_RINGS)
        # wakes it early; a load can only make the sleeps longer.
        assert passes <= seconds / poll_s + _MAX_RINGS + 2, (passes, seconds)
    finally:
        stopped = time.monotonic()
        stop.set()
        rate.notify()
        learner.join(120)
        store.close()
    joined = time.monotonic()
    assert not learner.is_alive()
    final = [m for m in _drain(reports) if m[0] == "metrics"][-1][2]
    assert final["training_step"] == 3 and final["state"] == "done"
    assert buffer.counters["samples"] == 3 * 8
    # The final report's interval lies within [started, joined] and it waited at least
    # from ``held`` to ``stopped``: the reported share of waiting is at least that ratio.
    assert final["wait_fraction"] >= (stopped - held) / (joined - started), final["wait_fraction"]
    assert load_checkpoint(tmp_path / "checkpoint.pt")["training_step"] == 3


def test_beta_schedule_anneals_linearly_to_one():
    config = small_config(training_steps=8)
    config.replay.beta = 0.2
    # over replay.beta_anneal_steps when set, else over all training steps; then 1
    config.replay.beta_anneal_steps = 4
    assert [beta_schedule(config, s) for s in range(7)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0])
    config.replay.beta_anneal_steps = None
    assert [beta_schedule(config, s) for s in (0, 2, 4, 8, 20)] == pytest.approx([0.2, 0.4, 0.6, 1.0, 1.0])


def record_train_steps(monkeypatch) -> list:
    """Patch ``MuZeroTrainer.train_step`` to record (training step, importance weights,
    P(i)) of every batch it trains on, in this process; returns the growing list."""
    seen = []
    train_step = MuZeroTrainer.train_step

    def recording_train_step(self, batch):
        seen.append((self.training_step, batch.weights.copy(), batch.probabilities.copy()))
        return train_step(self, batch)

    monkeypatch.setattr(MuZeroTrainer, "train_step", recording_train_step)
    return seen


def test_run_learner_trains_with_the_annealed_importance_weights(tmp_path, monkeypatch):
    """Every batch the learner trains on carries the importance weights of the annealed
    beta at its step, ``(P(i) / min_j P(j)) ** -beta_schedule(step)``, and the metrics
    report that beta. The buffer's priorities span two orders of magnitude, so weights
    of different betas differ."""
    config = small_config(training_steps=6, batch_size=16, min_buffer_steps=8)
    config.replay.beta, config.replay.beta_anneal_steps = 0.2, 4
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=512, alpha=0.6)
    store = _store_for(config)
    seen = record_train_steps(monkeypatch)
    try:
        rng = np.random.default_rng(5)
        for _ in range(12):
            T = int(rng.integers(5, 30))
            buf.add_episode(make_episode(rng, T, OBS, ACTIONS), priorities=10.0 ** rng.uniform(-1, 1, T))
        reports = queue.Queue()
        run_learner(RunSetup.create(config, tmp_path), buf.handle, store.handle, threading.Event(), reports)
    finally:
        store.close()
        buf.close()
    assert [step for step, _, _ in seen] == list(range(6))
    for step, weights, prob in seen:
        ratio = prob / prob.min()
        assert ratio.max() > 2.0  # weights depend on beta
        expected = ratio.astype(np.float32) ** np.float32(-beta_schedule(config, step))
        np.testing.assert_allclose(weights, expected, rtol=1e-5, err_msg=f"step {step}")
    assert [beta_schedule(config, s) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    final = [m for m in _drain(reports) if m[0] == "metrics"][-1][2]
    assert final["training_step"] == 6 and final["beta"] == pytest.approx(1.0)


def test_priorities_of_episodes_rewritten_during_a_step_are_dropped(tmp_path, monkeypatch):
    """Workers may overwrite the sampled episodes while the learner trains on them: the
    learner hands ``update_priorities`` the generations it sampled, so every rewritten
    position keeps the priority its new episode was stored with. (A learner that handed
    the slots' current generations would write the old positions' errors over the new
    episodes.) Here each training step rewrites the whole ring before its priorities
    come back."""
    config = small_config(training_steps=4, batch_size=16, min_buffer_steps=8)
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=64, alpha=1.0, priority_eps=0.0)
    store = _store_for(config)
    rng = np.random.default_rng(11)
    stored_with = 123.0  # no value error of the trainer comes near it
    train_step = MuZeroTrainer.train_step
    rewrites = []

    def train_step_while_workers_rewrite(self, batch):
        result = train_step(self, batch)
        for _ in range(10):  # 10 episodes of 8 rows: every slot of the 64-slot ring rewritten
            buf.add_episode(make_episode(rng, 7, OBS, ACTIONS), priorities=np.full(7, stored_with))
        rewrites.append(self.training_step)
        return result

    monkeypatch.setattr(MuZeroTrainer, "train_step", train_step_while_workers_rewrite)
    try:
        for _ in range(8):
            buf.add_episode(make_episode(rng, 7, OBS, ACTIONS), priorities=np.full(7, 1.0))
        reports = queue.Queue()
        run_learner(RunSetup.create(config, tmp_path), buf.handle, store.handle, threading.Event(), reports)
        slots = np.concatenate([np.arange(ep.start, ep.start + ep.rows - 1) for ep in buf.episodes()])
        priorities = buf.priorities(slots)
    finally:
        store.close()
        buf.close()
    assert len(rewrites) == 4 and slots.size > 0
    np.testing.assert_array_equal(priorities, np.full(slots.size, stored_with))


def test_inline_run_trains_with_the_annealed_importance_weights(tmp_path, monkeypatch):
    """``--workers 0`` (the in-process loop) samples with the same annealed beta."""
    from test_train_e2e import ROOT, SMALL

    from mpper import cli

    seen = record_train_steps(monkeypatch)
    sets = ["replay.beta=0.2", "replay.beta_anneal_steps=4", "training.min_buffer_steps=64", "training.batch_size=16",
            "reanalyse.enabled=false", "runtime.evaluation_interval_s=1000"]  # fmt: skip
    rc = cli.main(["--config", str(ROOT / "configs" / "cartpole.json"), "--workers", "0", "--device", "cpu",
                   "--run-dir", str(tmp_path / "run"), "--max-train-steps", "6", *SMALL,
                   *(x for kv in sets for x in ("--set", kv))])  # fmt: skip
    assert rc == 0
    config = load_config(tmp_path / "run" / "config.json")
    assert [step for step, _, _ in seen] == list(range(6))
    assert [beta_schedule(config, s) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    for step, weights, prob in seen:
        ratio = (prob / prob.min()).astype(np.float32)
        np.testing.assert_allclose(weights, ratio ** np.float32(-beta_schedule(config, step)), rtol=1e-5,
                                   err_msg=f"step {step}")  # fmt: skip
    # and those weights are not the ones of the initial beta
    assert any(not np.allclose(w, (p / p.min()).astype(np.float32) ** np.float32(-0.2), rtol=1e-3) for _, w, p in seen)


def test_run_learner_waits_for_data_and_stops(tmp_path):
    # Below min_buffer_steps the learner sleeps on the stop event and says so; setting it
    # ends the run cleanly without a training step (and still leaves a checkpoint).
    config = small_config(min_buffer_steps=400)
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=512, alpha=0.6)
    store = _store_for(config)
    try:
        fill(buf, episodes=2)
        stop, reports, seen = threading.Event(), queue.Queue(), []

        def stop_once_it_reports_waiting() -> None:
            # (not a timer: the learner's start-up, its first optimizer's imports
            # included, can take longer than any fixed delay on a loaded machine)
            while not stop.is_set():
                seen.append(reports.get(timeout=30))
                if seen[-1][2].get("state") == "waiting_for_data":
                    stop.set()

        watcher = threading.Thread(target=stop_once_it_reports_waiting, daemon=True)
        watcher.start()
        run_learner(RunSetup.create(config, tmp_path), buf.handle, store.handle, stop, reports)
        watcher.join(timeout=30)
        messages = seen + _drain(reports)
        waiting = [m[2] for m in messages if m[2].get("state") == "waiting_for_data"]
        assert waiting and waiting[0]["training_step"] == 0 and waiting[0]["wait_fraction"] > 0.5
        assert messages[-1][2]["state"] == "done" and messages[-1][2]["training_step"] == 0
        assert store.version == 1
        assert load_checkpoint(tmp_path / "checkpoint.pt")["training_step"] == 0
    finally:
        stop.set()
        store.close()
        buf.close()


def test_run_learner_starts_once_min_buffer_steps_were_stored_even_if_the_ring_holds_fewer(tmp_path):
    """``min_buffer_steps`` counts env steps stored since the run began: a full ring of
    whole episodes holds fewer positions than its capacity (one row more than the moves
    per episode, a gap at the wrap), so min_buffer_steps == capacity must still start."""
    config = small_config(training_steps=4, batch_size=8, min_buffer_steps=64)
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=64, alpha=0.6)
    store = _store_for(config)
    try:
        fill(buf, episodes=12)  # 5-29 moves each: the ring wraps several times
        assert buf.counters["steps"] >= 64 > len(buf)
        reports = queue.Queue()
        run_learner(RunSetup.create(config, tmp_path), buf.handle, store.handle, threading.Event(), reports)
        assert load_checkpoint(tmp_path / "checkpoint.pt")["training_step"] == 4
        assert _drain(reports)[-1][2]["state"] == "done"
    finally:
        store.close()
        buf.close()


def test_run_learner_reports_errors(buffer, tmp_path):
    config = small_config(batch_size=8, min_buffer_steps=8)
    store = _store_for(config)
    try:
        (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")  # resuming from it fails in the learner
        reports = queue.Queue()
        with pytest.raises(CheckpointError, match="checkpoint.pt"):
            run_learner(RunSetup.create(config, tmp_path, resume=True), buffer.handle, store.handle, threading.Event(),
                        reports)  # fmt: skip
        kind, source, payload = reports.get_nowait()
        assert (kind, source) == ("error", "learner") and "checkpoint.pt" in payload["traceback"]
    finally:
        store.close()


def test_the_fused_adam_step_is_adam_with_l2_weight_decay_by_the_paper(buffer, device="cpu"):
    """The trainer's Adam (one fused kernel on the CPU and on CUDA) against Adam written
    from Kingma & Ba (2015, Algorithm 1) with the L2 weight decay of ``torch.optim.Adam``
    added to the gradient: over three steps, each weight moves by
    ``lr * m_hat / (sqrt(v_hat) + eps)`` computed from the gradients the step left.
    (``tests/runtime/test_cuda.py`` runs it on CUDA.)"""
    config = small_config(optimizer="adam", lr_init=0.01, weight_decay=1e-2)
    torch.manual_seed(0)
    net = make_network(config.network, OBS, ACTIONS, config.muzero.stacked_observations)
    trainer = MuZeroTrainer(config, net, torch.device(device))
    assert isinstance(trainer.optimizer, Adam)
    group = trainer.optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    eps, decay = group["eps"], group["weight_decay"]
    params = list(trainer.network.parameters())
    m = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    v = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for t in range(1, 4):
        before = [p.detach().double().clone() for p in params]
        trainer.train_step(sample(buffer, config, seed=t))
        lr = trainer.optimizer.param_groups[0]["lr"]
        for i, p in enumerate(params):
            g = p.grad.double() + decay * before[i]
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat, v_hat = m[i] / (1 - beta1**t), v[i] / (1 - beta2**t)
            expected = before[i] - lr * m_hat / (v_hat.sqrt() + eps)
            torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
