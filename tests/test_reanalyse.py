"""Reanalyse: fresh values with the latest weights, generation-guarded, in a real child."""

import dataclasses
import multiprocessing as mp
import queue
import signal
import time

import numpy as np
import pytest
import torch
from conftest import make_episode

from mpper import ReplayBuffer
from mpper.algos.configs import default_config
from mpper.algos.muzero.config import NetworkConfig
from mpper.algos.muzero.networks import make_network, support_to_scalar
from mpper.algos.muzero.reanalyse import Reanalyser
from mpper.algos.muzero.targets import muzero_schema
from mpper.runtime.procs import StopSignal
from mpper.runtime.reanalyser import run_reanalyser
from mpper.runtime.supervisor import _JOIN_TIMEOUT_S
from mpper.runtime.weights import WeightStore

CTX = mp.get_context("spawn")
OBS, ACTIONS, STACK = (4,), 2, 2


def make_config(batch_episodes=3):
    c = default_config("muzero")
    return dataclasses.replace(
        c,
        runtime=dataclasses.replace(c.runtime, torch_threads=1, seed=3),
        sections={**c.sections, "network": NetworkConfig(kind="fc", encoding_size=8, hidden=[16], support_size=5),
                  "muzero": dataclasses.replace(c.muzero, stacked_observations=STACK),
                  "reanalyse": dataclasses.replace(c.reanalyse, batch_episodes=batch_episodes)},
    )  # fmt: skip


def make_net(config, seed):
    torch.manual_seed(seed)
    return make_network(config.network, OBS, ACTIONS, STACK).eval()


def naive_stack(obs, action, t):
    """muzero-general's get_stacked_observations, one position at a time."""
    parts = [obs[t]]
    for past in range(t - 1, t - STACK - 1, -1):
        if past >= 0:
            parts += [obs[past], [action[past + 1] / ACTIONS]]
        else:
            parts += [np.zeros_like(obs[t]), [0.0]]
    return np.concatenate(parts).astype(np.float32)


def expected_values(net, config, episode):
    """The network's value for every row 0..T of ``episode`` (the final observation's
    included: a truncated episode's targets bootstrap from it), computed here."""
    T = len(episode["action"]) - 1
    x = torch.from_numpy(np.stack([naive_stack(episode["observation"], episode["action"], t) for t in range(T + 1)]))
    with torch.no_grad():
        return support_to_scalar(net.initial_inference(x).value_logits, config.network.support_size).numpy()


def stored(buf, ref):
    return buf.fields["reanalysed_value"][ref.start : ref.start + ref.rows].copy()


def check_episode(buf, net, config, ref, allow_nan=False):
    rows = buf.read_episode(ref, names=("observation", "action"))
    values = stored(buf, ref)
    if allow_nan and np.isnan(values).all():
        return False
    assert not np.isnan(values).any()
    np.testing.assert_allclose(values, expected_values(net, config, rows), rtol=1e-5, atol=1e-5)
    return True


def all_match(buf, net, config):
    try:
        return all(check_episode(buf, net, config, ref) for ref in buf.episodes())
    except AssertionError:
        return False


@pytest.fixture
def setup():
    config = make_config()
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=256, alpha=0.6)
    nets = [make_net(config, 1), make_net(config, 2)]
    store = WeightStore.create(nets[0].num_flat_weights())
    try:
        yield config, buf, store, nets
    finally:
        store.close()
        buf.close()


def test_reanalyser_in_process(setup):
    config, buf, store, (net1, net2) = setup
    rng = np.random.default_rng(0)
    for T in (5, 12, 1, 30):
        buf.add_episode(make_episode(rng, T))
    r = Reanalyser(config, buf, store)
    with pytest.raises(RuntimeError):
        r.step()  # no weights yet
    assert not r.refresh_weights()
    store.publish(net1.get_flat_weights(), training_step=10)
    assert r.refresh_weights() and r.version == 1 and not r.refresh_weights()
    for _ in range(20):
        r.step()
    assert all_match(buf, net1, config)
    assert r.episodes == buf.counters["reanalysed_episodes"] >= 4 and r.dropped == 0

    store.publish(net2.get_flat_weights(), training_step=20)
    assert r.refresh_weights() and r.version == 2
    for _ in range(20):
        r.step()
    assert all_match(buf, net2, config)


def test_rewritten_episode_is_not_written(setup, monkeypatch):
    config, buf, store, (net1, _) = setup
    rng = np.random.default_rng(1)
    for _ in range(4):
        buf.add_episode(make_episode(rng, 15))  # 16 rows: 16 episodes fill the ring exactly
    store.publish(net1.get_flat_weights(), training_step=1)
    r = Reanalyser(config, buf, store)
    r.refresh_weights()
    real_read = buf.read_episode

    def read_then_overwrite(ref, names=None):
        out = real_read(ref, names)
        monkeypatch.setattr(buf, "read_episode", real_read)
        for _ in range(16):  # every slot rewritten after this first read
            buf.add_episode(make_episode(rng, 15))
        return out

    monkeypatch.setattr(buf, "read_episode", read_then_overwrite)
    assert r.step() == (0, 3)  # one read then refused at store, two seen evicted at read
    assert r.dropped == 3 and r.episodes == 0
    c = buf.counters
    assert c["reanalysed_dropped"] == 1 and c["reanalysed_episodes"] == 0
    assert np.isnan(buf.fields["reanalysed_value"]).all(), "a stale value reached a newer episode"


@pytest.mark.slow
def test_run_reanalyser_process(setup):
    config, buf, store, (net1, net2) = setup
    rng = np.random.default_rng(2)
    for T in (5, 12, 1, 30, 8, 20):
        buf.add_episode(make_episode(rng, T))
    stop, reports = StopSignal(CTX), CTX.Queue()
    p = CTX.Process(target=run_reanalyser, args=(config, buf.handle, store.handle, stop, reports))
    p.start()
    try:
        def wait_for(net, seconds):
            # one batch of episodes per published version: publish the same weights
            # again (as the learner does every publish_interval) until all are done
            deadline = time.monotonic() + seconds
            while not all_match(buf, net, config):
                assert p.is_alive(), "the reanalyser died"
                assert time.monotonic() < deadline, "values were not refreshed in time"
                time.sleep(0.05)
                store.publish(net.get_flat_weights(), training_step=store.training_step + 1)

        time.sleep(0.2)
        assert np.isnan(buf.fields["reanalysed_value"]).all(), "nothing without published weights"
        store.publish(net1.get_flat_weights(), training_step=1)
        wait_for(net1, 30.0)  # the first wait covers the child's start-up (torch import)
        store.publish(net2.get_flat_weights(), training_step=2)
        wait_for(net2, 5.0)

        # Overwrite episodes while it runs: a value computed for an evicted episode must
        # never land in the rows of the episode that replaced it.
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            buf.add_episode(make_episode(rng, int(rng.integers(1, 40))))
            store.publish(net2.get_flat_weights(), training_step=store.training_step + 1)
            time.sleep(0.005)
        stop.set()
        # within the time the supervisor gives a child before it stops it by force (a
        # loaded 2-core machine took 3.3 s; a child that ignores the signal never exits)
        p.join(_JOIN_TIMEOUT_S)
        assert p.exitcode == 0
        refreshed = sum(check_episode(buf, net2, config, ref, allow_nan=True) for ref in buf.episodes())
        assert refreshed >= 1
    finally:
        stop.set()
        if p.is_alive():
            p.kill()
            p.join()
    messages = []
    while True:
        try:
            messages.append(reports.get(timeout=0.2))  # the child flushed its queue before exiting
        except queue.Empty:
            break
    assert not [m for m in messages if m[0] == "error"], messages
    kinds = {m[0] for m in messages}
    assert kinds == {"reanalyse"} and all(m[1] == "reanalyser" for m in messages)
    last = messages[-1][2]
    c = buf.counters
    assert last["episodes"] == c["reanalysed_episodes"] > 0
    assert last["dropped"] >= c["reanalysed_dropped"]
    assert last["episodes_per_s"] >= 0 and 2 <= last["weights_version"] <= store.version


def test_reports_errors(setup):
    """In this process, so it undoes what the child set-up changes here."""
    config, buf, store, _ = setup
    handler, threads = signal.getsignal(signal.SIGINT), torch.get_num_threads()
    bad = dataclasses.replace(config, sections={**config.sections, "network": dataclasses.replace(config.network, hidden=[3])})
    stop, reports = StopSignal(CTX), CTX.Queue()
    try:
        with pytest.raises(ValueError):
            run_reanalyser(bad, buf.handle, store.handle, stop, reports)
    finally:
        signal.signal(signal.SIGINT, handler)
        torch.set_num_threads(threads)
    kind, name, info = reports.get(timeout=5)
    assert (kind, name) == ("error", "reanalyser") and "ValueError" in info["traceback"]
