"""``training.ema_decay``: the run publishes, evaluates and checkpoints an exponential
moving average of the trained weights (Polyak averaging), and resumes both exactly."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
from test_learner import ACTIONS, OBS, _drain, _store_for, buffer, make_trainer, sample, small_config  # noqa: F401, F811 (buffer: a fixture)

from mpper.algos.configs import load_config
from mpper.algos.muzero.networks import make_network
from mpper.checkpoint import load_checkpoint, save_checkpoint
from mpper.config import ConfigError
from mpper.runtime.children import run_learner
from mpper.runtime.setup import RunSetup

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]



def state_of(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_the_average_is_the_exponential_moving_average_of_the_trained_weights(buffer):
    decay = 0.7
    trainer = make_trainer(small_config(ema_decay=decay))
    assert trainer.published_network is trainer.network  # nothing averaged yet: the weights as they are
    reference = None
    for seed in range(5):
        trainer.train_step(sample(buffer, trainer.config, seed=seed))
        trainer.update_average()
        trained = state_of(trainer.network)
        # by hand: the first average is a copy, then avg <- decay * avg + (1 - decay) * trained
        reference = trained if reference is None else {k: decay * reference[k] + (1 - decay) * trained[k]
                                                      for k in trained}  # fmt: skip
        published = trainer.published_network
        assert published is not trainer.network
        for key, value in published.state_dict().items():
            torch.testing.assert_close(value, reference[key], rtol=1e-6, atol=1e-7)
    # after several steps the average really lags the trained weights
    diff = max((published.state_dict()[k] - trained[k]).abs().max().item() for k in trained)
    assert diff > 1e-4


def test_without_ema_decay_the_trained_weights_are_published(buffer):
    trainer = make_trainer(small_config())
    trainer.train_step(sample(buffer, trainer.config))
    trainer.update_average()  # a no-op
    assert trainer.averaged is None and trainer.published_network is trainer.network
    assert "online_network" not in trainer.state_dict()


def test_checkpoint_holds_the_average_as_network_and_resumes_both(buffer, tmp_path):
    config = small_config(ema_decay=0.8)
    trainer = make_trainer(config, seed=0)
    for seed in range(3):
        trainer.train_step(sample(buffer, config, seed=seed))
        trainer.update_average()
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, trainer)
    state = load_checkpoint(path)
    # "network" is what everyone acted with (evaluation reads it), the trained weights apart
    for key, value in trainer.published_network.state_dict().items():
        assert torch.equal(state["network"][key], value)
    for key, value in trainer.network.state_dict().items():
        assert torch.equal(state["online_network"][key], value)
    assert state["averaged_updates"] == 3
    assert any(not torch.equal(state["network"][k], state["online_network"][k]) for k in state["network"])

    other = make_trainer(config, seed=1)
    other.load_state_dict(state)
    for seed in (3, 4):  # continuing gives the same weights and average as never stopping
        batch = sample(buffer, config, seed=seed)
        for t in (trainer, other):
            t.train_step(batch)
            t.update_average()
    for a, b in ((trainer.network, other.network), (trainer.published_network, other.published_network)):
        for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), key


def test_a_checkpoint_without_an_average_starts_one_from_its_weights(buffer, tmp_path):
    plain = make_trainer(small_config(), seed=0)
    plain.train_step(sample(buffer, plain.config))
    save_checkpoint(tmp_path / "checkpoint.pt", plain)
    averaged = make_trainer(small_config(ema_decay=0.9), seed=1)
    averaged.load_state_dict(load_checkpoint(tmp_path / "checkpoint.pt"))
    assert averaged.published_network is averaged.network  # no average yet: the loaded weights
    averaged.train_step(sample(buffer, averaged.config, seed=1))
    averaged.update_average()  # the first update copies the trained weights
    for key, value in averaged.network.state_dict().items():
        assert torch.equal(averaged.published_network.state_dict()[key], value)


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.1"])
def test_ema_decay_outside_the_open_unit_interval_is_refused(value):
    with pytest.raises(ConfigError, match="training.ema_decay"):
        load_config("configs/cartpole.json", [f"training.ema_decay={value}"], check_env=False)


@pytest.mark.slow
def test_the_learner_process_publishes_the_average(buffer, tmp_path):
    ctx = mp.get_context("spawn")
    config = small_config(training_steps=6, batch_size=8, min_buffer_steps=8, publish_interval=2, ema_decay=0.5)
    store = _store_for(config)
    try:
        stop, reports = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=run_learner, args=(RunSetup.create(config, tmp_path), buffer.handle, store.handle,
                                                     stop, reports))  # fmt: skip
        proc.start()
        messages = []
        while proc.is_alive():
            messages += _drain(reports, timeout=0.2)
        proc.join(30)
        assert proc.exitcode == 0, messages + _drain(reports, timeout=0.2)
        ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
        assert ckpt["training_step"] == 6 and ckpt["averaged_updates"] == 6
        published = np.empty(store.handle.num_weights, np.float32)
        store.read_into(published)
        for entry, equal in (("network", True), ("online_network", False)):
            net = make_network(config.network, OBS, ACTIONS)
            net.load_state_dict(ckpt[entry])
            assert np.array_equal(published, net.get_flat_weights()) == equal, entry
    finally:
        store.close()
