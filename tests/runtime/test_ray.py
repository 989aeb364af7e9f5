"""Self-play on Ray (``--ray ADDRESS``) with Ray's own multi-node test cluster: several
raylets on this machine, each with its resources. Self-play actors are pinned to the
worker nodes by a custom resource ("remote"), the buffer, learner, reanalyser and
evaluator stay with the supervisor, as in a real cluster.

Network rule: every node and the driver bind to 127.0.0.1. Ray's driver turns a
loopback head address into the machine's interface address unless Ray's cluster mode
is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when ray is imported), so this
module sets it before it imports ray, and the runs it starts inherit it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_episode, unmapped_semaphores
from test_train_e2e import (
    ROOT,
    assert_counters_match_the_episodes,
    check_outputs,
    complete_lines,
    run_args,
    segments_of,
    training_step,
    wait_until_training,
)  # fmt: skip

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # see the module docstring
# The cluster's workers (started by its raylets, with this process's environment) and the
# runs import tests/faulty_env.py as "faulty_env".
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])

from mpper import ReplayBuffer  # noqa: E402
from mpper.algos.configs import default_config  # noqa: E402

pytestmark = pytest.mark.slow

LOOPBACK = "127.0.0.1"
REMOTE = ["--set", 'runtime.ray_actor_resources={"remote": 1}']


@pytest.fixture(scope="module")
def cluster():
    """A head node (the supervisor's: no "remote" resource) and two worker nodes."""
    from ray.cluster_utils import Cluster

    # Ray starts its workers at nice 15: on two busy cores a restarted actor, whose start
    # imports torch, then waits behind the run's own processes at nice 0 for most of a test.
    head = {"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False,
            "_system_config": {"worker_niceness": 0}}  # fmt: skip
    c = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        c.add_node(num_cpus=2, resources={"remote": 4}, node_ip_address=LOOPBACK)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


# ---- helpers ----------------------------------------------------------------------------------


def descendants(pid: int) -> set[int]:
    """``pid``'s children, their children, and so on."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def listening_addresses(pids: set[int]) -> set[str]:
    """The local addresses of the TCP sockets in state LISTEN that processes ``pids`` hold
    (from /proc: no extra package)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except (FileNotFoundError, PermissionError):
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_ip = local.split(":")[0]
            raw = b"".join(bytes.fromhex(hex_ip[i:i + 8])[::-1] for i in range(0, len(hex_ip), 8))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def actor_processes() -> list[tuple[int, str]]:
    """Live processes of mpper's Ray actors on this machine (by Ray's process titles)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if text.startswith(("ray::SelfPlayActor", "ray::EpisodeIngest")):
            found.append((int(cmdline.parent.name), text.strip()))
    return found


def wait_for_placements(proc, run_dir: Path, ready, timeout: float = 120.0) -> dict:
    """``ray_actors.json`` once ``ready(placements)`` holds."""
    path, deadline = run_dir / "ray_actors.json", time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()
        if path.exists():
            placements = json.loads(path.read_text())
            if ready(placements):
                return placements
        assert time.monotonic() < deadline, f"actors not placed as expected: {path.exists() and path.read_text()}"
        time.sleep(0.2)


def stop_and_check(proc, run_dir: Path) -> tuple[str, str]:
    """Stop the run with Ctrl-C; everything it leaves loads, its counters agree with its
    episode table, and nothing of it is left: no process, no segment, no actor."""
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stderr[-4000:]
    check_outputs(run_dir)
    assert not segments_of(proc.pid)
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        assert_counters_match_the_episodes(snap)
    deadline = time.monotonic() + 30
    while actor_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not actor_processes()
    return stdout, stderr


def start_run(run_dir: Path, cluster, *extra: str) -> subprocess.Popen:
    args = run_args(run_dir, "--workers", "2", "--ray", cluster.address, *REMOTE, "--max-train-steps", "100000", *extra)
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- runs on the cluster ----------------------------------------------------------------------


@pytest.mark.timeout(600)  # the sum of its own waits, which a loaded machine may need
def test_remote_actors_feed_the_learner_survive_a_kill_and_a_lost_node_and_ctrl_c_leaves_nothing(tmp_path, cluster):
    run_dir = tmp_path / "run"
    semaphores = unmapped_semaphores()  # left by something else before this test
    proc = start_run(run_dir, cluster)
    try:
        wait_until_training(proc, run_dir)
        placed = wait_for_placements(proc, run_dir, lambda p: len(p) == 2)
        assert {p["node_id"] for p in placed.values()} <= {n.node_id for n in cluster.worker_nodes}  # pinned
        # every socket the cluster, the supervisor and the actors listen on is on loopback
        addresses = listening_addresses(descendants(os.getpid()))
        assert addresses and all(is_loopback(a) for a in addresses), addresses

        os.kill(placed["ray-worker-0"]["pid"], signal.SIGKILL)  # an actor killed mid-episode
        placed = wait_for_placements(proc, run_dir, lambda p: p["ray-worker-0"]["restarts"] == 1)

        lost = placed["ray-worker-1"]["node_id"]  # a node lost with the actors on it
        on_lost = {name: p["restarts"] for name, p in placed.items() if p["node_id"] == lost}
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == lost))
        placed = wait_for_placements(proc, run_dir, lambda p: all(p[n]["restarts"] > r for n, r in on_lost.items()))
        assert all(placed[name]["node_id"] != lost for name in on_lost)
        games = lambda: sum(1 for line in complete_lines(run_dir / "episodes.jsonl")
                            if json.loads(line)["worker"] in on_lost)  # fmt: skip
        before, step, deadline = games(), training_step(run_dir), time.monotonic() + 60
        while games() < before + 2 or training_step(run_dir) < step + 5:  # the moved actors play, the learner learns
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not go on after the restarts"
            time.sleep(0.2)
        stdout, stderr = stop_and_check(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "ray-worker-0 died (its actor or its node was lost" in stderr
    assert "restarting ray-worker-0 (1/3)" in stderr
    assert all(f"restarting {name} ({r + 1}/3)" in stderr for name, r in on_lost.items())
    assert "interrupted" in stdout
    episodes = [json.loads(line) for line in complete_lines(run_dir / "episodes.jsonl")]
    assert episodes and {e["worker"] for e in episodes} <= {"ray-worker-0", "ray-worker-1"}
    assert all(e["store_latency_s"] >= 0 and e["insert_wait_s"] >= 0 for e in episodes)
    assert "worker-0" not in json.loads((run_dir / "processes.json").read_text())  # no local self-play
    deadline = time.monotonic() + 10
    while unmapped_semaphores() - semaphores and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not unmapped_semaphores() - semaphores  # no semaphore left behind either


@pytest.mark.timeout(360)
def test_an_env_error_in_an_actor_is_reported_the_actor_restarted_then_the_run_stopped(tmp_path, cluster):
    """Env 1 of the actor raises in ``step`` after 30 steps, in every life: the actor's
    traceback comes back to the supervisor, it is restarted once
    (max_worker_restarts=1), and its second failure stops the run, nothing left."""
    run_dir = tmp_path / "run"
    args = run_args(run_dir, "--workers", "1", "--ray", cluster.address, *REMOTE, "--max-train-steps", "100000",
                    "--set", "env.id=faulty_env:raising", "--set", 'env.kwargs={"fail_after": 30, "fail_instance": 1}',
                    "--set", "runtime.max_worker_restarts=1", "--set", "training.min_buffer_steps=1000")  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stdout[-2000:] + stderr[-4000:]
    env_error = ("EnvError: ray-worker-0 env 1 (faulty_env:raising): step raised RuntimeError: "
                 "simulated env failure after 30 steps")  # fmt: skip
    assert stderr.count("mpper: ray-worker-0 failed:\n") == 2 and stderr.count(env_error) >= 2, stderr[-4000:]
    assert stderr.count("restarting ray-worker-0 (1/1)") == 1
    stopped = [line for line in stderr.splitlines() if "run stopped:" in line]
    assert len(stopped) == 1 and stopped[0].startswith(
        "mpper: run stopped: ray-worker-0 ended 2 times (max_worker_restarts=1); last: failed: ") and env_error in stopped[0]
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:  # what the two lives stored, whole
        assert snap.counters["games"] == len(snap.episodes()) > 0
        assert all(ep.rows == 21 for ep in snap.episodes())
    assert not segments_of(proc.pid)
    deadline = time.monotonic() + 30
    while actor_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not actor_processes()


@pytest.mark.timeout(360)  # a Ray run on a loaded 2-core machine takes many times its unloaded time
def test_at_the_env_step_budget_the_actors_stop_and_the_learner_trains_on(tmp_path, cluster):
    """``training.after_env_steps`` "train" with Ray actors: the budget stops the actors, and
    the learner makes its 150 steps alone (its replay ratio allows about 24 before)."""
    run_dir = tmp_path / "run"
    args = run_args(run_dir, "--workers", "1", "--ray", cluster.address, *REMOTE, "--env-steps", "400",
                    "--max-train-steps", "150", "--set", "training.after_env_steps=train",
                    "--set", "training.min_buffer_steps=200", "--set", "training.samples_per_insert=null",
                    "--set", "training.replay_ratio=0.05", "--set", "runtime.solve_return=null")  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert stdout.strip().splitlines()[-1].startswith("mpper: training finished (150 steps); ")
    assert "mpper: self-play ended at " in stderr and "restarting" not in stderr
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        assert snap.counters["steps"] >= 400 and snap.counters["games"] == len(snap.episodes())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    past = [r["env_steps"] for r in records if r["env_steps"] >= 400]
    assert len(set(past[1:])) <= 1  # the record that saw the budget first may precede the actors' last episodes
    assert not segments_of(proc.pid)
    deadline = time.monotonic() + 30
    while actor_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not actor_processes()


# ---- refused before anything starts -----------------------------------------------------------


def one_line_refusal(argv: list[str]) -> str:
    """Run ``argv`` (``run.py``) expecting a refusal: exit 2, one line on stderr, nothing left."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert not segments_of(proc.pid)
    return lines[0]


def test_an_unreachable_cluster_is_one_line_and_exit_2(tmp_path):
    t0 = time.monotonic()
    line = one_line_refusal(run_args(tmp_path / "run", "--workers", "1", "--ray", "127.0.0.1:9"))
    assert line.startswith("error: cannot reach the Ray cluster at 127.0.0.1:9 (Connection refused)"), line
    assert time.monotonic() - t0 < 60  # not Ray's minutes of retries


@pytest.mark.parametrize("overrides, expected", [
    (["runtime.workers=0", "runtime.ray_address=127.0.0.1:6379"],
     "runtime.ray_address: Ray actors need runtime.workers >= 1"),
    (["runtime.ray_address=head-without-port"], 'runtime.ray_address: expected "auto" or the head\'s "host:port"'),
    (["runtime.ray_address=ray://10.0.0.5:10001"], "is a Ray Client address; mpper joins the cluster as a node's driver"),
    (["runtime.ray_address=auto", 'runtime.ray_actor_resources={"remote": 0}'],
     "runtime.ray_actor_resources.remote: expected a number > 0 per resource name, got 0"),
])  # fmt: skip
def test_ray_settings_are_checked_with_the_config(overrides, expected):
    from mpper.algos.configs import load_config
    from mpper.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(ROOT / "configs" / "cartpole.json", overrides)


def test_without_the_ray_extra_ray_is_one_line_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; import mpper.cli as c; sys.argv[0] = 'run.py'; "
            "sys.exit(c.main(sys.argv[1:]))")  # fmt: skip
    args = [sys.executable, "-c", code, *run_args(tmp_path / "run", "--workers", "1", "--ray", "127.0.0.1:9")[2:]]
    line = one_line_refusal(args)
    assert "needs Ray, which is not installed" in line and "pip install -e .[ray]" in line, line


def test_without_ray_address_no_module_of_mpper_imports_ray():
    """Every module of mpper but runtime/remote.py, imported: ray is not among the
    imported modules, so a run without ``ray_address`` never loads it."""
    code = """
import importlib, pkgutil, sys
import mpper
names = [m.name for m in pkgutil.walk_packages(mpper.__path__, "mpper.") if m.name != "mpper.runtime.remote"]
for name in names:
    importlib.import_module(name)
print(len(names), "ray" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, imported = out.stdout.split()
    assert int(count) > 40 and imported == "False"


# ---- the ingest actor's rules, as a plain object ----------------------------------------------


def test_the_ingest_waits_for_the_ratio_stores_whole_episodes_and_stops(small_buffer):
    """``EpisodeIngest.add`` (without Ray around it): it waits while the samples-per-insert
    ratio says the actors are ahead, stores once the learner samples, and a stop makes a
    waiting add return without storing."""
    from mpper.runtime.remote import EpisodeIngest
    from mpper.runtime.roles import StoredEpisode

    cfg = default_config("muzero")
    training = dataclasses.replace(cfg.training, samples_per_insert=1.0, samples_per_insert_tolerance=0.0,
                                   min_buffer_steps=10, batch_size=4)  # fmt: skip
    buf = small_buffer
    ingest = EpisodeIngest(buf.handle.portable(), training)
    rng = np.random.default_rng(0)
    try:
        def add(T: int):
            ep = make_episode(rng, T)
            return ingest.add(StoredEpisode("ray-worker-0", ep, None, True, {"return": float(T)}, time.time()))

        assert add(12)  # below min_buffer_steps: never waits
        result = []
        blocked = threading.Thread(target=lambda: result.append(add(5)))
        blocked.start()  # 12 inserted, 0 sampled: 1.0 * 12 > (0 + 4): waits
        blocked.join(0.5)
        assert blocked.is_alive() and buf.counters["games"] == 1
        buf.sample(8)  # the learner catches up: 12 <= 8 + 4
        blocked.join(10)
        assert result == [True] and buf.counters["games"] == 2 and buf.counters["steps"] == 17
        waiting = threading.Thread(target=lambda: result.append(add(5)))
        waiting.start()  # 17 > 8 + 4: waits again
        waiting.join(0.5)
        assert waiting.is_alive()
        ingest.stop()
        waiting.join(10)
        assert result == [True, False] and buf.counters["games"] == 2  # not stored
        reports, stats = ingest.drain()
        assert [r[2]["return"] for r in reports] == [12.0, 5.0]
        assert stats["episodes"] == 2 and stats["rows"] == 13 + 6
        assert all(r[2]["store_latency_s"] >= 0 for r in reports) and reports[1][2]["insert_wait_s"] > 0.3
        assert ingest.drain()[0] == []
    finally:
        ingest.close()
