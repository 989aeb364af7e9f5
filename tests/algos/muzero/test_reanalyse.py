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
from mpper.algos.muzero.reanalyse import Reanalyser, store_reanalysed
from mpper.algos.muzero.search import make_search
from mpper.algos.muzero.targets import muzero_schema
from mpper.runtime.children import run_reanalyser
from mpper.runtime.procs import StopSignal
from mpper.runtime.setup import RunSetup
from mpper.runtime.supervisor import _JOIN_TIMEOUT_S
from mpper.runtime.weights import WeightStore

CTX = mp.get_context("spawn")
OBS, ACTIONS, STACK = (4,), 2, 2


def make_config(batch_episodes=3):
    c = default_config("muzero")
    return dataclasses.replace(
        c,
        runtime=dataclasses.replace(c.runtime, torch_threads=1, seed=3),
        network=NetworkConfig(kind="fc", encoding_size=8, hidden=[16], support_size=5),
        muzero=dataclasses.replace(c.muzero, stacked_observations=STACK),
        reanalyse=dataclasses.replace(c.reanalyse, batch_episodes=batch_episodes),
    )  # fmt: skip


def make_net(config, seed):
    torch.manual_seed(seed)
    return make_network(config.network, OBS, ACTIONS, STACK).eval()


def naive_stack(obs, action, t, num_actions=ACTIONS):
    """muzero-general's get_stacked_observations, one position at a time."""
    parts = [obs[t]]
    for past in range(t - 1, t - STACK - 1, -1):
        if past >= 0:
            parts += [obs[past], [action[past + 1] / num_actions]]
        else:
            parts += [np.zeros_like(obs[t]), [0.0]]
    return np.concatenate(parts).astype(np.float32)


def expected_values(net, config, episode, num_actions=ACTIONS):
    """The network's value for every row 0..T of ``episode`` (the final observation's
    included: a truncated episode's targets bootstrap from it), computed here."""
    T = len(episode["action"]) - 1
    x = torch.from_numpy(np.stack([naive_stack(episode["observation"], episode["action"], t, num_actions) for t in range(T + 1)]))
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


def test_values_go_through_the_network_in_passes_of_bounded_input(setup, monkeypatch):
    """Rows are stacked and evaluated pass by pass, a pass's stacked float32 input
    within ``INPUT_BYTES_PER_PASS`` (here 5 rows: passes cross episode borders and
    split episodes), and every row's value is still its own stack's."""
    import mpper.algos.muzero.reanalyse as reanalyse_module

    config, buf, store, (net, _) = setup
    row_bytes = 4 * (OBS[0] + STACK * (OBS[0] + 1))
    monkeypatch.setattr(reanalyse_module, "INPUT_BYTES_PER_PASS", 5 * row_bytes + row_bytes // 2)
    rng = np.random.default_rng(1)
    for T in (5, 12, 1, 30):
        buf.add_episode(make_episode(rng, T))
    store.publish(net.get_flat_weights(), training_step=1)
    r = Reanalyser(config, buf, store)
    r.refresh_weights()
    inputs = []
    forward = r.network.initial_inference
    monkeypatch.setattr(r.network, "initial_inference", lambda x: inputs.append(x.nbytes) or forward(x))
    for _ in range(30):  # 90 episode draws out of 4: each drawn (the reanalyser's rng is seeded)
        r.step()
    assert all(check_episode(buf, net, config, ref) for ref in buf.episodes())
    assert inputs and max(inputs) <= 5 * row_bytes
    assert any(n == 5 * row_bytes for n in inputs)  # full passes (the 30-move episode needs them)


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
def test_run_reanalyser_process(setup, tmp_path):
    config, buf, store, (net1, net2) = setup
    rng = np.random.default_rng(2)
    for T in (5, 12, 1, 30, 8, 20):
        buf.add_episode(make_episode(rng, T))
    stop, reports = StopSignal(CTX), CTX.Queue()
    p = CTX.Process(target=run_reanalyser, args=(RunSetup.create(config, tmp_path), buf.handle, store.handle, stop,
                                                  reports))  # fmt: skip
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


def test_reports_errors(setup, tmp_path):
    """In this process, so it undoes what the child set-up changes here."""
    config, buf, store, _ = setup
    handler, threads = signal.getsignal(signal.SIGINT), torch.get_num_threads()
    bad = dataclasses.replace(config, network=dataclasses.replace(config.network, hidden=[3]))
    stop, reports = StopSignal(CTX), CTX.Queue()
    try:
        with pytest.raises(ValueError):
            run_reanalyser(RunSetup.create(bad, tmp_path), buf.handle, store.handle, stop, reports)
    finally:
        signal.signal(signal.SIGINT, handler)
        torch.set_num_threads(threads)
    kind, name, info = reports.get(timeout=5)
    assert (kind, name) == ("error", "reanalyser") and "ValueError" in info["traceback"]


# ---- full reanalyse: a new search per stored position ----------------------------------


def search_config(kind, two_player=False):
    """make_config() with every episode searched again, noise that cannot change the
    result (pUCT: no Dirichlet share; Gumbel: no Gumbel noise), 8 simulations."""
    c = make_config()
    mcts = dataclasses.replace(c.mcts, kind=kind, num_simulations=12, root_exploration_fraction=0.0,
                               gumbel_scale=0.0, max_num_considered_actions=4)  # fmt: skip
    reanalyse = dataclasses.replace(c.reanalyse, search_fraction=1.0, num_simulations=8)
    return dataclasses.replace(c, mcts=mcts, reanalyse=reanalyse)


def one_root_search(net, config, episode, t, two_player):
    """The search of one stored position alone, its stacked observation built here:
    (root value, policy target)."""
    mcts = dataclasses.replace(config.mcts, num_simulations=config.reanalyse.num_simulations)
    search = make_search(ACTIONS_FULL, mcts, config.network.support_size, two_player=two_player)
    obs = naive_stack(episode["observation"], episode["action"], t, ACTIONS_FULL)[None]
    result = search.run(net, obs, episode["legal_actions"][t][None], episode["to_play"][t : t + 1],
                        add_exploration_noise=True, rng=np.random.default_rng(0))  # fmt: skip
    return result.root_values[0], result.policy_target[0]


ACTIONS_FULL = 4


def masked_episode(rng, T, two_player):
    """make_episode over 4 actions with a random legal mask per row (at least one legal)."""
    ep = make_episode(rng, T, OBS, ACTIONS_FULL, two_player=two_player)
    legal = rng.random((T + 1, ACTIONS_FULL)) < 0.6
    legal[np.arange(T + 1), rng.integers(0, ACTIONS_FULL, T + 1)] = True
    ep["legal_actions"] = legal
    return ep


@pytest.mark.parametrize("kind", ["puct", "gumbel"])
@pytest.mark.parametrize("two_player", [False, True])
def test_full_reanalyse_stores_each_positions_own_search(kind, two_player):
    """Every position of every episode gets the policy target and root value of a search
    of that position alone (its own stacked observation, legal actions and player), in
    the rows of its episode; row T keeps the network's value."""
    config = search_config(kind)
    torch.manual_seed(4)
    net = make_network(config.network, OBS, ACTIONS_FULL, STACK).eval()
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS_FULL), capacity=256, alpha=0.6)
    store = WeightStore.create(net.num_flat_weights())
    try:
        rng = np.random.default_rng(5)
        episodes = {}
        for T in (5, 1, 9):
            ep = masked_episode(rng, T, two_player)
            buf.add_episode(ep)
            episodes[T] = ep
        store.publish(net.get_flat_weights(), training_step=1)
        r = Reanalyser(config, buf, store, max_search_positions=4, two_player=two_player)  # 15 roots: 4 searches
        r.refresh_weights()
        while r.episodes < 3:
            r.step()
        assert r.stats()["searched_episodes"] == r.episodes and r.stats()["positions_searched"] >= 15
        for ref in buf.episodes():
            ep = episodes[ref.rows - 1]
            T = ref.rows - 1
            policies = buf.fields["reanalysed_policy"][ref.start : ref.start + ref.rows]
            values = buf.fields["reanalysed_value"][ref.start : ref.start + ref.rows]
            for t in range(T):
                value, policy = one_root_search(net, config, ep, t, two_player)
                # The network's float32 outputs for a root depend in their last bits on
                # the batch it is evaluated in (which BLAS kernel the CPU gets); Gumbel's
                # policy divides Q by the node's own Q range before scaling it by
                # (c_visit + N) * c_scale, which magnifies those bits to ~1e-5.
                rtol, atol = (1e-4, 1e-5) if kind == "gumbel" else (1e-5, 1e-6)
                np.testing.assert_allclose(policies[t], policy, rtol=rtol, atol=atol)
                np.testing.assert_allclose(values[t], value, rtol=1e-5, atol=1e-5)
                assert (policies[t][~ep["legal_actions"][t]] == 0).all()
            assert np.isnan(policies[T]).all(), "row T has no move: no policy"
            np.testing.assert_allclose(values[T], expected_values(net, config, ep, ACTIONS_FULL)[T], rtol=1e-5, atol=1e-5)
    finally:
        store.close()
        buf.close()


def test_search_fraction_searches_that_share_of_episodes(setup):
    """search_fraction 0.5: about half of the reanalysed episodes get policies, the rest
    values only (their policies stay NaN); the counts add up."""
    config, buf, store, (net1, _) = setup
    config = dataclasses.replace(config, reanalyse=dataclasses.replace(
        config.reanalyse, search_fraction=0.5, batch_episodes=8, num_simulations=4))
    rng = np.random.default_rng(6)
    for _ in range(40):
        buf.add_episode(make_episode(rng, 3))
    store.publish(net1.get_flat_weights(), training_step=1)
    r = Reanalyser(config, buf, store, two_player=False)
    r.refresh_weights()
    for _ in range(12):
        r.step()
    searched = r.stats()["searched_episodes"]
    assert 96 * 0.3 < searched < 96 * 0.7 and r.episodes == 96
    policies = buf.fields["reanalysed_policy"]
    with_policy = [not np.isnan(policies[ref.start]).any() for ref in buf.episodes()]
    assert 0 < sum(with_policy) < len(with_policy)


def test_full_reanalyse_needs_the_search_fields(setup):
    config, _, store, _ = setup
    config = dataclasses.replace(config, reanalyse=dataclasses.replace(config.reanalyse, search_fraction=1.0))
    schema = {k: v for k, v in muzero_schema(OBS, ACTIONS).items() if k != "legal_actions"}
    buf = ReplayBuffer.create(schema, capacity=64)
    try:
        with pytest.raises(KeyError, match=r"search_fraction 1.0 .*missing \['legal_actions'\]"):
            Reanalyser(config, buf, store)
    finally:
        buf.close()


def test_stored_policies_obey_shape_values_and_the_generation_rule():
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS), capacity=12, alpha=0.6)
    try:
        rng = np.random.default_rng(8)
        buf.add_episode(make_episode(rng, 4))
        ref = buf.episodes()[0]
        with pytest.raises(ValueError, match=r"policies for the 4 positions of episode 0, got shape \(5, 2\)"):
            store_reanalysed(buf, ref, np.zeros(5), np.full((5, 2), 0.5))
        with pytest.raises(ValueError, match="must be finite"):
            store_reanalysed(buf, ref, np.zeros(5), np.full((4, 2), np.nan))
        with pytest.raises(ValueError, match=r"expected 4 or 5 values for episode 0, got \(3,\)"):
            store_reanalysed(buf, ref, np.zeros(3))
        assert np.isnan(buf.fields["reanalysed_policy"]).all() and np.isnan(buf.fields["reanalysed_value"]).all()
        for _ in range(3):  # lap the 12-slot ring: episode 0 is evicted
            buf.add_episode(make_episode(rng, 4))
        assert not store_reanalysed(buf, ref, np.zeros(5), np.full((4, 2), 0.5))
        assert np.isnan(buf.fields["reanalysed_policy"]).all(), "a stale policy reached a newer episode"
        newest = buf.episodes()[-1]
        assert store_reanalysed(buf, newest, np.zeros(5), np.full((4, 2), 0.25))
        rows = slice(newest.start, newest.start + 4)
        assert (buf.fields["reanalysed_policy"][rows] == 0.25).all()
        assert np.isnan(buf.fields["reanalysed_policy"][newest.start + 4]).all()  # row T: no move
    finally:
        buf.close()


def _reanalysed_rows(config, device, episodes, net):
    """Every row's reanalysed value and policy after a full pass of a Reanalyser on ``device``."""
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS_FULL), capacity=256, alpha=0.6)
    store = WeightStore.create(net.num_flat_weights())
    try:
        for ep in episodes:
            buf.add_episode(ep)
        store.publish(net.get_flat_weights(), training_step=1)
        r = Reanalyser(config, buf, store, two_player=False, device=device)
        assert next(r.network.parameters()).device.type == torch.device(device).type
        r.refresh_weights()
        while r.episodes < len(episodes):
            r.step()
        n = buf.fields["reanalysed_value"].shape[0]
        return buf.fields["reanalysed_value"][:n].copy(), buf.fields["reanalysed_policy"][:n].copy()
    finally:
        store.close()
        buf.close()


def test_the_reanalysers_device_follows_runtime_device():
    """runtime.device "cpu": the CPU; "auto": CUDA where torch sees it, else the CPU."""
    config = search_config("puct")
    torch.manual_seed(4)
    net = make_network(config.network, OBS, ACTIONS_FULL, STACK).eval()
    buf = ReplayBuffer.create(muzero_schema(OBS, ACTIONS_FULL), capacity=64, alpha=0.6)
    store = WeightStore.create(net.num_flat_weights())
    try:
        for device, expected in (("cpu", "cpu"), ("auto", "cuda" if torch.cuda.is_available() else "cpu")):
            c = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device=device))
            assert Reanalyser(c, buf, store, two_player=False).device.type == expected
    finally:
        store.close()
        buf.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the reanalyser on the GPU")
@pytest.mark.parametrize("kind", ["puct", "gumbel"])
def test_a_reanalyser_on_cuda_stores_what_one_on_the_cpu_does(kind):
    """The same weights and episodes, searched on the GPU and on the CPU: the same values and
    policy targets, within float32 noise of the two devices' kernels."""
    config = search_config(kind)
    torch.manual_seed(4)
    net = make_network(config.network, OBS, ACTIONS_FULL, STACK).eval()
    rng = np.random.default_rng(5)
    episodes = [masked_episode(rng, T, False) for T in (5, 1, 9)]
    cpu_values, cpu_policies = _reanalysed_rows(config, "cpu", episodes, net)
    gpu_values, gpu_policies = _reanalysed_rows(config, "cuda", episodes, net)
    np.testing.assert_allclose(gpu_values, cpu_values, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gpu_policies, cpu_policies, rtol=1e-3, atol=1e-4)
