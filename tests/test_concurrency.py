"""Real processes on one shared buffer: stress, stale updates, a writer killed mid-copy."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from mpper import NStepTargets, ReplayBuffer, dqn_schema

CTX = mp.get_context("spawn")
GAMMA = 0.5
OBS = (3,)  # (episode id, position, checksum)


def checksum(episode_id, position):
    return (np.asarray(episode_id) * 7919 + np.asarray(position) * 104729) % 1000003


def make_episode(episode_id: int, rows: int) -> dict:
    pos = np.arange(rows)
    obs = np.stack([np.full(rows, episode_id), pos, checksum(episode_id, pos)], axis=1).astype(np.float64)
    return {"observation": obs, "action": pos % 2, "reward": np.ones(rows, np.float32)}


def writer(handle, writer_id: int, seconds: float, out) -> None:
    buf = ReplayBuffer.attach(handle)
    rng = np.random.default_rng(writer_id)
    count, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            buf.add_episode(make_episode(writer_id * 10**6 + count, int(rng.integers(2, 120))),
                            priorities=rng.random(1) * np.ones(1) if False else None)  # fmt: skip
            count += 1
    finally:
        buf.close()
    out.put(("writer", writer_id, count))


def check_rows(data: dict) -> int:
    """Number of torn rows: a row whose observation or next observation is not the
    one its episode id and position say it must be."""
    obs, nxt = data["observation"], data["next_observation"]
    steps = np.rint(np.log(data["discount"]) / np.log(GAMMA)).astype(np.int64)
    bad = obs[:, 2] != checksum(obs[:, 0].astype(np.int64), obs[:, 1].astype(np.int64))
    bad |= nxt[:, 2] != checksum(nxt[:, 0].astype(np.int64), nxt[:, 1].astype(np.int64))
    bad |= nxt[:, 0] != obs[:, 0]
    bad |= nxt[:, 1] != obs[:, 1] + steps
    return int(bad.sum())


def learner(handle, seconds: float, out) -> None:
    buf = ReplayBuffer.attach(handle)
    rng = np.random.default_rng(123)
    targets = NStepTargets(n=3, gamma=GAMMA)
    stats = dict(batches=0, rows=0, torn=0, applied=0, dropped=0, bad_drops=0, bad_applies=0)
    deadline = time.monotonic() + seconds
    try:
        while len(buf) == 0:
            time.sleep(0.001)
        while time.monotonic() < deadline:
            batch = buf.sample(64, beta=0.5, targets=targets, rng=rng)
            stats["torn"] += check_rows(batch.data)
            stats["rows"] += 64
            applied, dropped = buf.update_priorities(batch.indices, batch.generations, rng.random(64) * 10)
            # generations only grow: a row dropped had changed before the update, so it is
            # still changed now; a row unchanged now was unchanged then, so it was applied
            changed_now = int((buf._generation[batch.indices] != batch.generations).sum())
            stats["bad_drops"] += max(0, dropped - changed_now)
            stats["bad_applies"] += max(0, (64 - changed_now) - applied)
            stats["applied"] += applied
            stats["dropped"] += dropped
            stats["batches"] += 1
    finally:
        buf.close()
    out.put(("learner", stats))


def run_processes(procs, timeout):
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


@pytest.mark.timeout(90)
def test_stress_four_writers_one_learner():
    seconds = 10.0
    buf = ReplayBuffer.create({**dqn_schema(OBS, "float64")}, 4000, alpha=0.6)
    out = CTX.Queue()
    try:
        procs = [CTX.Process(target=writer, args=(buf.handle, i, seconds, out)) for i in range(4)]
        procs.append(CTX.Process(target=learner, args=(buf.handle, seconds, out)))
        run_processes(procs, timeout=seconds + 60)
        results = [out.get(timeout=10) for _ in procs]
        stats = next(r[1] for r in results if r[0] == "learner")
        written = sum(r[2] for r in results if r[0] == "writer")
        c = buf.counters
        assert written == c["games"] > 100
        assert stats["batches"] > 50
        assert stats["torn"] == 0, stats
        assert stats["bad_drops"] == 0 and stats["bad_applies"] == 0, stats
        assert stats["applied"] + stats["dropped"] == c["priority_updates_applied"] + c["priority_updates_dropped"]
        assert c["priority_updates_dropped"] == stats["dropped"]
        assert c["samples"] >= stats["rows"]
        # the ring wrapped many times, and the tree still equals the sum of its leaves
        assert c["episodes_evicted"] > 50
        leaves = buf._tree.leaves
        assert buf.total_priority == pytest.approx(float(np.sum(leaves)), rel=1e-9)
        # exactly the published positions of resident episodes have mass
        positions = sum(ref.rows - 1 for ref in buf.episodes())
        assert positions == len(buf) == int(np.count_nonzero(leaves))
        for ref in buf.episodes():  # every stored episode is whole and its own
            obs = buf.fields["observation"][ref.start : ref.start + ref.rows]
            assert (obs[:, 0] == obs[0, 0]).all() and (obs[:, 1] == np.arange(ref.rows)).all()
    finally:
        buf.close()


def stuck_writer(handle, reserved, rows: int) -> None:
    """Adds an episode whose copy stops halfway (as if the process were killed there)."""
    buf = ReplayBuffer.attach(handle)
    real = buf.fields["observation"]

    class HalfCopy:
        def __setitem__(self, key, value):
            real[key.start : key.start + rows // 2] = value[: rows // 2]
            reserved.set()
            time.sleep(600)

    buf.fields["observation"] = HalfCopy()
    buf.add_episode(make_episode(999, rows))


@pytest.mark.timeout(60)
def test_writer_killed_mid_copy_leaves_nothing_sampleable():
    buf = ReplayBuffer.create(dqn_schema(OBS, "float64"), 300, alpha=0.0)
    try:
        for i in range(3):
            buf.add_episode(make_episode(i, 40))
        before = (buf.counters["games"], len(buf))
        reserved = CTX.Event()
        proc = CTX.Process(target=stuck_writer, args=(buf.handle, reserved, 60))
        proc.start()
        try:
            assert reserved.wait(30)
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == -signal.SIGKILL
        assert (buf.counters["games"], len(buf)) == before
        half_written = buf.fields["observation"][120:180]
        assert (half_written[:30, 0] == 999).all()  # the dead writer's rows are there...
        batch = buf.sample(5000, targets=NStepTargets(3, GAMMA), rng=np.random.default_rng(0))
        assert not (batch.data["observation"][:, 0] == 999).any()  # ...but never sampled
        assert not ((batch.indices >= 120) & (batch.indices < 180)).any()
        # writers lap the ring: the dead reservation is reclaimed, not waited on forever
        for i in range(10, 30):
            assert buf.add_episode(make_episode(i, 40))
        assert buf.counters["episodes_abandoned"] == 1
        batch = buf.sample(2000, targets=NStepTargets(3, GAMMA), rng=np.random.default_rng(1))
        assert check_rows(batch.data) == 0
    finally:
        buf.close()


def slow_writer(handle, reserved, release) -> None:
    buf = ReplayBuffer.attach(handle)
    real = buf.fields["observation"]

    class WaitCopy:
        def __setitem__(self, key, value):
            reserved.set()
            release.wait(30)
            real[key] = value

    buf.fields["observation"] = WaitCopy()
    buf.add_episode(make_episode(500, 50))
    buf.close()


@pytest.mark.timeout(60)
def test_live_writers_unpublished_episode_is_waited_for_not_evicted():
    """A second writer that laps onto an episode still being copied waits for it."""
    buf = ReplayBuffer.create(dqn_schema(OBS, "float64"), 100, alpha=0.0)
    try:
        reserved, release = CTX.Event(), CTX.Event()
        proc = CTX.Process(target=slow_writer, args=(buf.handle, reserved, release))
        proc.start()
        try:
            assert reserved.wait(30)  # slots 0..49 reserved by the live, slow writer
            buf.add_episode(make_episode(1, 50))  # fits in 50..99
            t0 = time.monotonic()
            import threading

            threading.Timer(0.5, release.set).start()
            buf.add_episode(make_episode(2, 50))  # must evict episode 500: waits for it
            waited = time.monotonic() - t0
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == 0 and waited >= 0.4
        c = buf.counters
        assert c["games"] == 3 and c["episodes_abandoned"] == 0 and c["episodes_evicted"] == 1
    finally:
        buf.close()
