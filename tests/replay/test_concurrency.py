"""Real processes on one shared buffer: stress, stale updates, a writer killed mid-copy."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from mpper import ReplayBuffer
from mpper.algos.dqn.targets import NStepTargets, dqn_schema

pytestmark = pytest.mark.slow

CTX = mp.get_context("spawn")
GAMMA = 0.5
OBS = (3,)  # (episode id, position, checksum)


def checksum(episode_id, position):
    return (np.asarray(episode_id) * 7919 + np.asarray(position) * 104729) % 1000003


def make_episode(episode_id: int, rows: int) -> dict:
    pos = np.arange(rows)
    obs = np.stack([np.full(rows, episode_id), pos, checksum(episode_id, pos)], axis=1).astype(np.float64)
    return {"observation": obs, "action": pos % 2, "reward": np.ones(rows, np.float32)}


def writer(handle, writer_id: int, episodes: int, learner_started, out) -> None:
    """Write ``episodes`` episodes, every other one with its own random priorities (the
    rest get the initial priority); after the first, wait until the learner samples."""
    buf = ReplayBuffer.attach(handle)
    rng = np.random.default_rng(writer_id)
    top = 0.0
    try:
        for count in range(episodes):
            rows = int(rng.integers(2, 120))
            priorities = rng.random(rows - 1) * 10 if count % 2 else None
            buf.add_episode(make_episode(writer_id * 10**6 + count, rows), priorities=priorities)
            top = max(top, 0.0 if priorities is None else float(priorities.max()))
            if count == 0:
                assert learner_started.wait(120), "the learner did not start sampling"
    finally:
        buf.close()
    out.put(("writer", writer_id, episodes, top))


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


def learner(handle, writers_done, min_batches: int, learner_started, out) -> None:
    """Sample, check and update priorities until the writers are done and at least
    ``min_batches`` batches were taken."""
    buf = ReplayBuffer.attach(handle)
    rng = np.random.default_rng(123)
    targets = NStepTargets(n=3, gamma=GAMMA)
    stats = dict(batches=0, rows=0, torn=0, applied=0, dropped=0, bad_drops=0, bad_applies=0)
    try:
        while len(buf) == 0:
            time.sleep(0.001)
        while stats["batches"] < min_batches or not writers_done.is_set():
            batch = buf.sample(64, beta=0.5, targets=targets, rng=rng)
            learner_started.set()
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


def join_all(procs, timeout: float) -> None:
    for p in procs:
        p.join(timeout)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


@pytest.mark.timeout(600)
def test_stress_four_writers_one_learner():
    """Four writers (150 episodes each, half with priorities of their own) and a learner
    sampling and updating priorities all the while, on a ring they lap many times: no
    torn row sampled, every update applied or dropped by the generation rule, the
    counters add up and the tree is the sum of its leaves, and every stored episode is
    whole. Bounded by counts, not time: a loaded machine only makes it slower."""
    episodes = 150
    buf = ReplayBuffer.create({**dqn_schema(OBS, "float64")}, 4000, alpha=0.6)
    out, writers_done, learner_started = CTX.Queue(), CTX.Event(), CTX.Event()
    writers = [CTX.Process(target=writer, args=(buf.handle, i, episodes, learner_started, out)) for i in range(4)]
    reader = CTX.Process(target=learner, args=(buf.handle, writers_done, 50, learner_started, out))
    procs = [*writers, reader]
    try:
        for p in procs:
            p.start()
        join_all(writers, timeout=300)
        writers_done.set()
        join_all([reader], timeout=300)
        results = [out.get(timeout=60) for _ in procs]
        stats = next(r[1] for r in results if r[0] == "learner")
        written = sum(r[2] for r in results if r[0] == "writer")
        top_given = max(r[3] for r in results if r[0] == "writer")
        c = buf.counters
        assert written == c["games"] == 4 * episodes
        assert stats["batches"] >= 50
        assert stats["torn"] == 0, stats
        assert stats["bad_drops"] == 0 and stats["bad_applies"] == 0, stats
        assert stats["applied"] + stats["dropped"] == c["priority_updates_applied"] + c["priority_updates_dropped"]
        assert c["priority_updates_dropped"] == stats["dropped"]
        assert c["samples"] >= stats["rows"]  # and the rows drawn again
        # the ring wrapped many times, and the tree still equals the sum of its leaves
        assert c["episodes_evicted"] > 50
        leaves = buf._tree.leaves
        assert buf.total_priority == pytest.approx(float(np.sum(leaves)), rel=1e-9)
        # exactly the published positions of resident episodes have mass, at most that of
        # the largest raw priority given (10), which the buffer remembers as its max
        positions = sum(ref.rows - 1 for ref in buf.episodes())
        assert positions == len(buf) == int(np.count_nonzero(leaves))
        assert top_given <= buf.max_priority <= 10.0
        assert leaves.max() <= (10.0 + buf.priority_eps) ** 0.6
        for ref in buf.episodes():  # every stored episode is whole and its own
            obs = buf.fields["observation"][ref.start : ref.start + ref.rows]
            assert (obs[:, 0] == obs[0, 0]).all() and (obs[:, 1] == np.arange(ref.rows)).all()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
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
