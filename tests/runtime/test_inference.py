"""The inference server (``mpper/runtime/inference.py``) against the network in the
worker: the same searches through the server's batches choose the same actions; its
failure paths (a worker killed mid-request, the server killed mid-run) leave the others
served and nothing hanging; and a CartPole run with ``runtime.selfplay_inference`` "server"
trains."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from children import wait_for_inference
from test_train_e2e import ROOT, assert_no_process_left, complete_lines, run_args, segments_of, wait_until_training

from mpper.algos.configs import load_config
from mpper.algos.muzero.algorithm import ALGORITHM
from mpper.algos.muzero.search import make_search
from mpper.config import ConfigError
from mpper.runtime.inference import (
    InferenceServer,
    InferenceSlots,
    InferenceStopped,
    SearchInterrupted,
    ServedNetwork,
    serves_selfplay,
)
from mpper.runtime.procs import process_context
from mpper.runtime.setup import RunSetup

K, SIMS, ACTIONS, OBS = 3, 12, 2, (4,)


def network_and_config(kind: str = "puct", *overrides: str):
    config = load_config(ROOT / "configs" / "cartpole.json", [f"mcts.kind={kind}", f"mcts.num_simulations={SIMS}",
                                                              *overrides])  # fmt: skip
    torch.manual_seed(3)
    return ALGORITHM.make_network(config, OBS, ACTIONS).eval(), config


def make_slots(ctx, slots: int, network, config) -> InferenceSlots:
    return InferenceSlots.create(ctx, slots, K, network.observation_shape, network.full_support_size, ACTIONS,
                                 K * ALGORITHM.search_nodes(config), network.lstm_horizon_len)  # fmt: skip


class Never:
    def is_set(self) -> bool:
        return False


def search(network, config, observations: np.ndarray, seed: int):
    mcts = make_search(ACTIONS, config.mcts, config.network.support_size)
    return mcts.run(network, observations, np.ones((K, ACTIONS), bool), np.zeros(K, np.int64), True,
                    np.random.default_rng(seed))  # fmt: skip


def serve_together(server: InferenceServer, clients: list[threading.Thread], timeout: float = 60) -> None:
    """Answer requests only when every client still searching has one pending, so that each
    batch spans them all (the clients run the same number of inferences)."""
    deadline = time.monotonic() + timeout
    while any(t.is_alive() for t in clients):
        assert time.monotonic() < deadline, "the clients did not finish"
        pending = server.pending()
        if pending and len(pending) >= sum(t.is_alive() for t in clients):
            server.serve(pending)
        else:
            time.sleep(0.0005)


def in_threads(calls) -> tuple[list[threading.Thread], list]:
    results: list = [None] * len(calls)

    def runner(i, call):
        results[i] = call()

    threads = [threading.Thread(target=runner, args=(i, call), daemon=True) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, results


@pytest.mark.parametrize("config_file,overrides,cuda,served", [
    ("cartpole.json", [], False, False),  # auto on a CPU-only machine: today's path
    ("cartpole.json", [], True, True),  # auto with CUDA: the server
    ("cartpole.json", ["runtime.device=cpu"], True, False),  # auto, the run kept on the CPU
    ("cartpole.json", ["runtime.selfplay_inference=server"], False, True),
    ("cartpole.json", ["runtime.selfplay_inference=worker"], True, False),
    ("cartpole.json", ["runtime.lockstep=true"], True, False),  # lockstep streams run their own network
    ("cartpole_dqn.json", [], True, False),  # DQN's workers run their own network
])  # fmt: skip
def test_which_runs_serve_their_selfplay_inference(tmp_path, monkeypatch, config_file, overrides, cuda, served):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    config = load_config(ROOT / "configs" / config_file, overrides, workers=2)
    assert serves_selfplay(RunSetup.create(config, tmp_path)) is served


@pytest.mark.parametrize("config_file,overrides,workers,message", [
    ("cartpole.json", [], 0, '"server" serves local self-play worker processes (--workers >= 1, not lockstep, no '
                             "Ray); got runtime.workers 0"),
    ("cartpole.json", ["runtime.lockstep=true"], 2, "got lockstep"),
    ("cartpole_dqn.json", [], 2, "is for MuZero's search; DQN's workers run their own network"),
])  # fmt: skip
def test_a_run_the_server_cannot_serve_is_refused_in_one_line(config_file, overrides, workers, message):
    with pytest.raises(ConfigError, match="runtime.selfplay_inference") as refused:
        load_config(ROOT / "configs" / config_file, [*overrides, "runtime.selfplay_inference=server"], workers=workers)
    assert message in str(refused.value) and "\n" not in str(refused.value)


# the value prefix: LSTM states kept on the server beside the hidden states, reset every 2 steps
VALUE_PREFIX = ("muzero.value_prefix=true", "muzero.lstm_horizon_len=2", "network.lstm_hidden_size=8")


@pytest.mark.parametrize("kind,overrides", [("puct", ()), ("gumbel", ()), ("puct", VALUE_PREFIX),
                                            ("gumbel", VALUE_PREFIX)])  # fmt: skip
def test_searches_batched_across_workers_choose_as_the_network_in_each_worker(kind, overrides):
    network, config = network_and_config(kind, *overrides)
    rng = np.random.default_rng(0)
    observations = [rng.normal(size=(K, *OBS)).astype(np.float32) for _ in range(2)]
    local = [search(network, config, obs, seed) for seed, obs in enumerate(observations)]
    slots = make_slots(mp.get_context(), 2, network, config)
    try:
        server = InferenceServer(slots, network, torch.device("cpu"))
        server.start(version=1, training_step=0)
        served = [ServedNetwork(slots, w, Never()) for w in range(2)]
        clients, results = in_threads([lambda w=w: search(served[w], config, observations[w], w) for w in range(2)])
        serve_together(server, clients)
        assert server.largest_batch == 2 * K  # the batches spanned both workers
        assert server.batches == 1 + SIMS  # one initial, then one recurrent per simulation
        assert (server.reward_states is not None) == bool(overrides)  # the LSTM states stay on the server
        assert slots.calls() == (1 + SIMS, (1 + SIMS) * 2 * K)  # what bench/selfplay.py reads
        for mine, theirs in zip(results, local):
            np.testing.assert_array_equal(mine.visit_counts, theirs.visit_counts)
            np.testing.assert_allclose(mine.root_values, theirs.root_values, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(mine.policy_target, theirs.policy_target, rtol=1e-5, atol=1e-6)
            if theirs.actions is not None:
                np.testing.assert_array_equal(mine.actions, theirs.actions)
    finally:
        slots.close()


def test_a_request_the_server_cannot_answer_is_refused_with_a_clear_error():
    network, config = network_and_config()
    slots = make_slots(mp.get_context(), 1, network, config)
    try:
        server = InferenceServer(slots, network, torch.device("cpu"))
        server.start(version=1, training_step=0)
        client = ServedNetwork(slots, 0, Never())
        threads, _ = in_threads([lambda: client.initial_inference(torch.zeros((K, *OBS)))])
        serve_together(server, threads)
        errors: list = []

        def recurrent_from_unknown_tokens():
            try:
                client.recurrent_inference(torch.tensor([[0], [1], [99]]), torch.zeros(K, dtype=torch.long))
            except RuntimeError as exc:
                errors.append(str(exc))

        threads, _ = in_threads([recurrent_from_unknown_tokens])
        serve_together(server, threads)
        assert errors and "refused" in errors[0]
        with pytest.raises(ValueError, match="1 to 3 rows"):
            client.initial_inference(torch.zeros((K + 1, *OBS)))
    finally:
        slots.close()


def test_a_restarted_server_interrupts_the_search_under_way_and_serves_the_next_one():
    network, config = network_and_config()
    slots = make_slots(mp.get_context(), 1, network, config)
    try:
        first = InferenceServer(slots, network, torch.device("cpu"))
        first.start(version=1, training_step=0)
        client = ServedNetwork(slots, 0, Never())
        threads, results = in_threads([lambda: client.initial_inference(torch.zeros((K, *OBS)))])
        serve_together(first, threads)
        tokens = results[0].hidden_state
        second = InferenceServer(slots, network, torch.device("cpu"))  # as the restarted process does
        assert second.start(version=1, training_step=0) == 2
        with pytest.raises(SearchInterrupted):  # the tokens name hidden states the first server held
            client.recurrent_inference(tokens, torch.zeros(K, dtype=torch.long))
        obs = np.random.default_rng(2).normal(size=(K, *OBS)).astype(np.float32)
        threads, results = in_threads([lambda: search(client, config, obs, 7)])
        serve_together(second, threads)
        np.testing.assert_array_equal(results[0].visit_counts, search(network, config, obs, 7).visit_counts)
        assert first.requests == 1 and second.requests == 1 + SIMS
    finally:
        slots.close()


def test_a_worker_waiting_for_an_answer_leaves_when_the_run_stops():
    network, config = network_and_config()
    slots = make_slots(mp.get_context(), 1, network, config)
    try:
        InferenceServer(slots, network, torch.device("cpu")).start(version=1, training_step=0)  # never answers
        stop = threading.Event()
        client = ServedNetwork(slots, 0, stop)
        outcome: list = []

        def wait():
            try:
                client.initial_inference(torch.zeros((1, *OBS)))
            except InferenceStopped:
                outcome.append("stopped")

        threads, _ = in_threads([wait])
        time.sleep(0.3)
        assert threads[0].is_alive()  # waiting
        stop.set()
        threads[0].join(10)
        assert outcome == ["stopped"]
    finally:
        slots.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_killed_mid_request_leaves_the_server_serving_the_others_and_its_slot_reusable():
    network, config = network_and_config()
    ctx = process_context()  # the run's context: a forkserver started here has mpper's preload, as in a run
    slots = make_slots(ctx, 2, network, config)
    try:
        server = InferenceServer(slots, network, torch.device("cpu"))
        server.start(version=1, training_step=0)
        doomed = ctx.Process(target=wait_for_inference, args=(slots.handle, 0), daemon=True)
        doomed.start()
        deadline = time.monotonic() + 60
        while server.pending() != [0]:  # its request is in the slot, unanswered
            assert doomed.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join(10)
        # The other worker is served; the orphan request is answered too (to nobody).
        rng = np.random.default_rng(1)
        obs = rng.normal(size=(K, *OBS)).astype(np.float32)
        other = ServedNetwork(slots, 1, Never())
        threads, results = in_threads([lambda: search(other, config, obs, 5)])
        while threads[0].is_alive():
            server.serve_once(0.01)
        np.testing.assert_array_equal(results[0].visit_counts, search(network, config, obs, 5).visit_counts)
        assert not server.pending()
        # The restarted worker takes slot 0 over: its doorbell still holds the orphan's
        # wake-up, which must not pass for an answer to its own requests.
        successor = ServedNetwork(slots, 0, Never())
        threads, results = in_threads([lambda: search(successor, config, obs, 6)])
        while threads[0].is_alive():
            server.serve_once(0.01)
        np.testing.assert_array_equal(results[0].visit_counts, search(network, config, obs, 6).visit_counts)
    finally:
        slots.close()


# ---- whole runs ----------------------------------------------------------------------------------

SERVED = ["--workers", "2", "--set", "runtime.selfplay_inference=server", "--set", "reanalyse.enabled=false"]


def episodes_of(run_dir, worker: str) -> int:
    return sum(json.loads(line)["worker"] == worker for line in complete_lines(run_dir / "episodes.jsonl"))


def wait_for(what: str, condition, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_served_run_trains_and_survives_its_inference_process_and_a_worker_being_killed(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(run_args(run_dir, *SERVED, "--time-limit", "200"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until_training(proc, run_dir)
        pids = json.loads((run_dir / "processes.json").read_text())
        assert "inference" in pids and episodes_of(run_dir, "worker-0") and episodes_of(run_dir, "worker-1")
        supervisor = pids["supervisor"]
        # The inference process killed mid-run: restarted, the workers play on with the new one.
        os.kill(pids["inference"], signal.SIGKILL)
        wait_for("the restarted inference process",
                 lambda: json.loads((run_dir / "processes.json").read_text())["inference"] != pids["inference"], proc)
        played = {w: episodes_of(run_dir, w) for w in ("worker-0", "worker-1")}
        wait_for("episodes from both workers after the restart",
                 lambda: all(episodes_of(run_dir, w) > n + 1 for w, n in played.items()), proc)
        # A worker killed: the server serves the other one meanwhile, and the restarted one.
        os.kill(json.loads((run_dir / "processes.json").read_text())["worker-0"], signal.SIGKILL)
        played = {w: episodes_of(run_dir, w) for w in ("worker-0", "worker-1")}
        wait_for("episodes from both workers after worker-0's restart",
                 lambda: all(episodes_of(run_dir, w) > n + 1 for w, n in played.items()), proc)
        steps = max(json.loads(x)["learner"].get("training_step", 0) for x in complete_lines(run_dir / "metrics.jsonl"))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "mpper: inference died (killed by SIGKILL)" in err and "mpper: restarting inference (1/3)" in err, err
    assert "mpper: inference: serving again (start 2)" in err
    assert "mpper: worker-0 died (killed by SIGKILL)" in err
    end = json.loads(complete_lines(run_dir / "metrics.jsonl")[-1])
    assert end["event"] == "end" and end["learner"]["training_step"] >= steps > 5
    assert end["env_steps"] > 200
    assert_no_process_left(run_dir)
    assert not segments_of(supervisor)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_inference_process_dying_past_the_restart_limit_stops_the_run_and_nothing_hangs(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(run_args(run_dir, *SERVED, "--time-limit", "200", "--set", "runtime.max_worker_restarts=0"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until_training(proc, run_dir, steps=1)
        pids = json.loads((run_dir / "processes.json").read_text())
        os.kill(pids["inference"], signal.SIGKILL)
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    assert "mpper: run stopped: inference died 1 times (max_worker_restarts=0)" in err, err
    assert (run_dir / "checkpoint.pt").exists()  # the learner stopped cleanly, with its final checkpoint
    assert_no_process_left(run_dir)
    assert not segments_of(pids["supervisor"])
