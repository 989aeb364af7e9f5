"""The replay buffer's lock survives its holder's death (``mpper.shm.RobustLock``).

Real processes take the real lock in the shared segment and die by SIGKILL inside a
critical section (the test-only fault of ``MPPER_FAULT_DIE_IN_LOCK``, or a kill from
outside); the next locker must get the lock, repair the buffer with one line on
stderr, and the buffer must pass its consistency checks, sample, and save a snapshot
that loads.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from children import write_tagged_episodes

from mpper import ReplayBuffer
from mpper.replay.episode_ring import FAULT_ENV
from mpper.runtime.procs import StopSignal

_REPO = str(Path(__file__).resolve().parents[2])
_ENV = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
_SCHEMA = {"observation": ((4,), "float32"), "value": ((), "float32")}
_DIED = "died holding the replay buffer's lock"


def _episode(tag: float, rows: int) -> dict:
    obs = np.zeros((rows, 4), np.float32)
    obs[:, 0], obs[:, 1] = tag, np.arange(rows)
    return {"observation": obs}


def _assert_whole_and_consistent(buf: ReplayBuffer) -> None:
    """Every check a repaired buffer must pass: the bookkeeping rules
    (``check_consistency``: generations, leaves, sum tree, positions), the counters equal
    to what the episode table holds, and every stored episode whole (one tag, rows in order)."""
    assert buf.check_consistency() == []
    refs = buf.episodes()
    c = buf.counters
    assert c["games"] - c["episodes_evicted"] == len(refs)
    assert c["positions"] == sum(r.rows - 1 for r in refs) == len(buf)
    for ref in refs:
        obs = buf.read_episode(ref)["observation"]
        assert (obs[:, 0] == obs[0, 0]).all() and (obs[:, 1] == np.arange(ref.rows)).all(), ref
    tree = buf._tree
    assert tree.total == pytest.approx(tree.leaves.sum(), rel=1e-12)


def _assert_snapshot_round_trip(buf: ReplayBuffer, path) -> None:
    buf.save(path)
    with ReplayBuffer.load(path) as loaded:
        assert loaded.check_consistency() == []
        assert [(r.episode_id, r.start, r.rows) for r in loaded.episodes()] == [
            (r.episode_id, r.start, r.rows) for r in buf.episodes()]  # fmt: skip
        assert loaded.sample(32, rng=np.random.default_rng(0)).indices.shape == (32,)


_FAULTY_WRITER = r"""
import pickle, sys
import numpy as np
from mpper import ReplayBuffer
buf = ReplayBuffer.attach(pickle.loads(open(sys.argv[1], "rb").read()))
rng = np.random.default_rng(1)
if sys.argv[2] == "priorities":
    batch = buf.sample(16, rng=rng)
    buf.update_priorities(batch.indices, batch.generations, rng.random(16) * 5)
elif sys.argv[2] == "rewrite":
    ref = buf.episodes()[-1]
    buf.rewrite_rows(ref, {"value": np.full(ref.rows, 5.0), "observation": np.zeros((ref.rows, 4))})
else:
    for _ in range(50):
        obs = np.zeros((9, 4), np.float32)
        obs[:, 0], obs[:, 1] = 7777, np.arange(9)
        buf.add_episode({"observation": obs}, priorities=rng.random(8))
print("survived the fault", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["reserve", "publish", "evict", "priorities", "rewrite"])
def test_a_writer_sigkilled_inside_the_lock_is_repaired_by_the_next_locker(point, tmp_path, capfd):
    """A child SIGKILLs itself with the lock held: inside ``add_episode`` while reserving
    (the table row written, the ring not yet advanced), while publishing (leaves and
    generations written, the table not yet), while evicting (leaves zeroed, counters
    not yet), inside ``update_priorities`` (half the leaves written, none of their
    ancestors), or inside ``rewrite_rows`` (one of two fields written). The next locker
    gets the lock, repairs, and the buffer is whole."""
    with ReplayBuffer.create(_SCHEMA, capacity=64, max_episodes=16) as buf:
        for i in range(7):  # 63 of 64 slots: the next episode evicts the oldest
            buf.add_episode(_episode(i, 9), priorities=np.full(8, 1.0 + i))
        before = buf.counters
        handle_file = tmp_path / "handle.pkl"
        handle_file.write_bytes(pickle.dumps(buf.handle))
        child = subprocess.run([sys.executable, "-c", _FAULTY_WRITER, str(handle_file), point], capture_output=True,
                               text=True, timeout=300, env={**_ENV, FAULT_ENV: f"{point}:1"})  # fmt: skip
        assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
        assert buf._lock.holder() > 0  # the dead child's pid, still recorded in the segment

        assert buf._lock.acquire(True, 10.0)  # at once: the kernel says the owner died; repaired now
        buf._lock.release()
        err = capfd.readouterr().err.splitlines()
        died = [line for line in err if _DIED in line]
        assert len(died) == 1 and "process " in died[0] and "repaired" in died[0], err
        after = buf.counters
        _assert_whole_and_consistent(buf)
        if point in ("reserve", "publish"):
            assert after["episodes_abandoned"] == 1 and after["games"] == before["games"]
            assert not any(buf.read_episode(r)["observation"][0, 0] == 7777 for r in buf.episodes())
            assert f"while {'reserving' if point == 'reserve' else 'publishing'} episode 7" in died[0]
            assert "episode 7 (being" in died[0] and "dropped" in died[0]
        elif point == "evict":
            assert after["episodes_evicted"] == before["episodes_evicted"] + 1 and after["episodes_abandoned"] == 0
            assert "while evicting episode 0" in died[0]
        elif point == "rewrite":
            newest = buf.episodes()[-1]
            assert (buf.read_episode(newest)["value"] == 5.0).all()  # the field it wrote stays
            assert after == before
            assert f"while rewriting rows of episode {newest.episode_id}" in died[0]
            assert f"rows of episode {newest.episode_id} kept as written" in died[0]
        else:
            assert buf._tree.leaves.max() == 1e3  # the leaves it wrote stay; their sums are rebuilt
            assert after["priority_updates_applied"] == before["priority_updates_applied"]
            assert "while updating priorities" in died[0]

        # training goes on
        assert buf.add_episode(_episode(100, 9), priorities=np.ones(8))
        batch = buf.sample(32, rng=np.random.default_rng(0))
        assert buf.update_priorities(batch.indices, batch.generations, np.ones(32))[0] > 0
        _assert_whole_and_consistent(buf)
        _assert_snapshot_round_trip(buf, tmp_path / "snap")


_START_METHODS = r"""
import multiprocessing as mp, os, pickle, signal, sys, threading
import numpy as np
from mpper import ReplayBuffer

def hold_and_die(handle):
    buf = ReplayBuffer.attach(handle)
    buf._lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    buf = ReplayBuffer.create({"observation": ((4,), "float32")}, capacity=64)
    for method in ("fork", "forkserver", "spawn"):
        child = mp.get_context(method).Process(target=hold_and_die, args=(buf.handle,))
        child.start()
        child.join(120)
        got = buf._lock.acquire(True, 10.0)
        buf._lock.release()
        print(method, child.exitcode, got, buf.check_consistency() == [], flush=True)
    buf.close()
"""


@pytest.mark.slow
def test_the_lock_is_shared_and_survives_its_holder_with_every_start_method(tmp_path):
    """A child started by fork, forkserver or spawn locks the very mutex of the segment
    and dies holding it: each time the parent gets the lock back and the buffer is
    consistent. (Run in a fresh interpreter: the test process is not forked.)"""
    script = tmp_path / "start_methods.py"
    script.write_text(_START_METHODS)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=_ENV)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == [f"{m} -9 True True" for m in ("fork", "forkserver", "spawn")], res.stdout
    assert res.stderr.count(_DIED) == 3, res.stderr


def test_threads_exclude_each_other_and_a_blocked_locker_does_not_hold_the_gil(small_buffer):
    """The mutex is owned by a thread: a second thread of the same process waits for it
    (the learner's prefetch thread beside its main thread), and while it waits in the
    C call the GIL is free, so a third thread still runs Python code."""
    buf = small_buffer
    lock = buf._lock
    got, other_ran = threading.Event(), threading.Event()

    def locker():
        with buf._locked:
            got.set()

    assert lock.acquire()
    try:
        waiter = threading.Thread(target=locker, daemon=True)
        waiter.start()
        runner = threading.Thread(target=other_ran.set, daemon=True)
        runner.start()
        assert other_ran.wait(30)
        assert not got.wait(0.3)  # still waiting for this thread's lock
        assert not lock.acquire(False)  # not re-entrant: held is held
    finally:
        lock.release()
    assert got.wait(30)
    waiter.join(30)
    assert lock.acquire(False)
    lock.release()


def test_a_priority_update_waits_for_a_live_holder_then_applies(small_buffer):
    """``update_priorities`` takes the lock in its compiled kernel; while another thread
    holds it, the kernel does nothing and the update waits on the lock the slow way."""
    buf = small_buffer
    buf.add_episode({"observation": np.zeros((9, 4))}, priorities=np.ones(8))
    batch = buf.sample(4, rng=np.random.default_rng(0))
    done = threading.Event()
    result = []

    def update():
        result.append(buf.update_priorities(batch.indices, batch.generations, np.full(4, 7.0)))
        done.set()

    assert buf._lock.acquire()
    try:
        updater = threading.Thread(target=update, daemon=True)
        updater.start()
        assert not done.wait(0.3)  # waiting: nothing applied while the lock is held
        assert buf.counters["priority_updates_applied"] == 0
    finally:
        buf._lock.release()
    assert done.wait(30)
    updater.join(30)
    assert result == [(4, 0)] and buf.max_priority == 7.0
    assert buf.counters["priority_updates_applied"] == 4 and buf.check_consistency() == []
    assert buf._lock.holder() == 0 and buf._ring.journal[0] == 0


@pytest.mark.slow
def test_a_priority_update_after_a_holders_death_repairs_then_applies(small_buffer, capfd):
    """The next locker after a death is the compiled update itself: its trylock returns
    EOWNERDEAD with the lock taken, and the buffer repairs (one line) before the update
    applies."""
    from children import hold_the_buffer_lock_and_exit

    buf = small_buffer
    buf.add_episode({"observation": np.zeros((9, 4))}, priorities=np.ones(8))
    batch = buf.sample(4, rng=np.random.default_rng(0))
    child = mp.get_context("spawn").Process(target=hold_the_buffer_lock_and_exit, args=(buf.handle,))
    child.start()
    child.join(120)
    assert child.exitcode == 0 and buf._lock.holder() == child.pid
    assert buf.update_priorities(batch.indices, batch.generations, np.full(4, 3.0)) == (4, 0)
    died = [line for line in capfd.readouterr().err.splitlines() if _DIED in line]
    assert len(died) == 1 and f"process {child.pid} died" in died[0] and "repaired" in died[0], died
    assert buf.max_priority == 3.0 and buf.check_consistency() == []
    assert buf._lock.holder() == 0 and buf._lock.acquire(False)
    buf._lock.release()


@pytest.mark.slow
def test_writers_sigkilled_at_random_moments_beside_a_sampling_learner(tmp_path):
    """Three writer processes add episodes while a learner thread samples and updates
    priorities; writers are SIGKILLed at random moments (inside the lock or outside) and
    restarted. The learner never stops for good, and at the end every stored episode is
    whole, the bookkeeping consistent, and a snapshot saves and loads."""
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(0)
    stop_learner = threading.Event()
    steps = [0]
    errors = []
    with ReplayBuffer.create(_SCHEMA, capacity=2048, alpha=0.6) as buf:

        def learner():
            lrng = np.random.default_rng(1)
            try:
                while not stop_learner.is_set():
                    if len(buf) == 0:
                        time.sleep(0.01)
                        continue
                    batch = buf.sample(64, rng=lrng)
                    obs = batch.data["observation"]
                    assert (obs[:, 1] < 12).all()
                    buf.update_priorities(batch.indices, batch.generations, lrng.random(64))
                    steps[0] += 1
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        learner_thread = threading.Thread(target=learner, daemon=True)
        learner_thread.start()
        stop = StopSignal(ctx)  # a shared byte: a writer SIGKILLed inside an Event's is_set would hold its lock
        writers = {}
        tags = iter(range(1, 1000))

        def start_writer(slot):
            ready = ctx.Event()
            proc = ctx.Process(target=write_tagged_episodes, args=(buf.handle, ready, stop, next(tags)))
            proc.start()
            writers[slot] = (proc, ready)

        try:
            for slot in range(3):
                start_writer(slot)
            for _kill in range(6):
                slot = int(rng.integers(3))
                proc, ready = writers[slot]
                assert ready.wait(120), "a writer never stored its first episode"
                time.sleep(float(rng.uniform(0.0, 0.3)))
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(60)
                start_writer(slot)
            for proc, ready in writers.values():
                assert ready.wait(120)
            at_last_kill = steps[0]
            deadline = time.monotonic() + 120
            while steps[0] < at_last_kill + 20 and time.monotonic() < deadline and not errors:
                time.sleep(0.05)
            assert steps[0] >= at_last_kill + 20, "the learner stopped after a writer was killed"
        finally:
            stop.set()
            for proc, _ in writers.values():
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
                    proc.join(60)
            stop_learner.set()
            learner_thread.join(60)
        assert not errors, errors
        assert all(proc.exitcode == 0 for proc, _ in writers.values())
        assert buf._lock.acquire(True, 10.0)  # any death not yet found is repaired here
        buf._lock.release()
        _assert_whole_and_consistent(buf)
        assert buf.counters["games"] > 0
        _assert_snapshot_round_trip(buf, tmp_path / "snap")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_whose_worker_dies_inside_the_lock_trains_on_and_ends_at_its_limit(tmp_path):
    """``run.py --workers 2 --env-steps 2000``, where the first worker to publish its 15th
    episode SIGKILLs itself inside the lock, half-way through the publication (the
    test-only fault ``MPPER_FAULT_DIE_IN_LOCK``; the claim file makes it happen once in
    the run). The next locker repairs with one line naming the dead pid, the supervisor
    restarts the worker, training goes on, and the run ends at its budget with exit 0,
    checkpoint.pt and a consistent snapshot, leaving nothing in /dev/shm."""
    from test_train_e2e import ROOT, assert_no_process_left, complete_lines, run_args, segments_of

    run_dir, claim = tmp_path / "run", tmp_path / "fault-claimed"
    env = {**_ENV, FAULT_ENV: f"publish:15:{claim}"}
    proc = subprocess.run(run_args(run_dir, "--workers", "2", "--env-steps", "2000", "--time-limit", "240"),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 0, proc.stdout[-2000:] + err[-4000:]
    assert claim.exists(), "the fault never fired"
    died = [line for line in err.splitlines() if _DIED in line]
    assert len(died) == 1 and "while publishing episode" in died[0] and "dropped" in died[0], err[-4000:]
    dead_pid = int(died[0].split("process ", 1)[1].split()[0])
    pids = json.loads((run_dir / "processes.json").read_text())
    assert any(f"mpper: {name} died (killed by SIGKILL)" in err for name in pids if name.startswith("worker")), err
    assert "env-step budget reached: " in proc.stdout.strip().splitlines()[-1], proc.stdout[-1000:]
    assert (run_dir / "checkpoint.pt").is_file()
    records = [json.loads(x) for x in complete_lines(run_dir / "metrics.jsonl")]
    killed_at = claim.stat().st_mtime
    before = max((r["learner"].get("training_step", 0) for r in records if r["unix_time"] <= killed_at), default=0)
    later = [r for r in records if r["unix_time"] > killed_at and r["learner"].get("training_step", 0) > before]
    assert later, "training did not go on after the worker died inside the lock"
    print(f"worker {dead_pid} died inside the lock at step {before}; training stepped again "
          f"{later[0]['unix_time'] - killed_at:.1f} s later (metrics every second)")
    with ReplayBuffer.load(run_dir / "buffer") as snap:  # the final snapshot, checksums and all
        assert snap.check_consistency() == []
        assert snap.counters["episodes_abandoned"] >= 1 and len(snap.episodes()) > 0
    assert_no_process_left(run_dir)
    assert not segments_of(pids["supervisor"])


def test_an_error_inside_a_critical_section_is_repaired_before_the_lock_goes(small_buffer, monkeypatch, capfd):
    """An exception half-way through a reservation (the table row written, the ring not
    yet advanced) leaves its journal entry open: the buffer finishes it as a hole before
    releasing the lock, says so, and the next writer finds everything consistent."""
    buf = small_buffer
    buf.add_episode(_episode(1, 6))
    import mpper.replay.episode_ring as ring_module

    class FailAtReserve:
        def reached(self, point, tear=None):
            if point == "reserve":
                raise MemoryError("simulated failure inside the lock")

    monkeypatch.setattr(ring_module, "_fault", FailAtReserve())
    with pytest.raises(MemoryError, match="simulated"):
        buf.add_episode(_episode(2, 6))
    monkeypatch.undo()
    err = capfd.readouterr().err
    assert "an error stopped process" in err and "while reserving episode 1" in err and "dropped" in err, err
    assert buf.counters["episodes_abandoned"] == 1
    _assert_whole_and_consistent(buf)
    assert buf.add_episode(_episode(3, 6))
    _assert_whole_and_consistent(buf)
