"""Shared-memory lifecycle: attach from other processes, who unlinks, signals, room, stale.

Processes: ``spawn`` children for ReplayBuffer.attach (the handle carries a
multiprocessing lock), and independent ``python -c`` subprocesses where the point is a
process *not* started by multiprocessing: such a process has its own resource tracker,
which is what unlinks a segment behind its owner's back (cpython issue 82300) and what
would silently clean up after an owner that did not unlink on a signal. Those tests read
the subprocess's stderr to the end, which also waits for its resource tracker (it holds
the same stderr) to finish, and assert the tracker reported nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import make_episode, mapped_semaphores

import mpper
from mpper import ReplayBuffer, SharedMemoryRoomError
from mpper import shm as mpper_shm
from mpper.algos.dqn.targets import dqn_schema
from mpper.algos.muzero.targets import muzero_schema
from mpper.replay.buffer import segment_bytes

pytestmark = pytest.mark.timeout(60)

SPAWN = mp.get_context("spawn")
# Environment for python -c subprocesses: find mpper from this checkout.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(mpper_shm.SHM_DIR, name))


def _tracker_complaints(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "resource_tracker" in line or "leaked" in line]


# --------------------------------------------------------------------------------------
# Spawned child attaches through the handle
# --------------------------------------------------------------------------------------
def _child_attach(handle, start, rows, to_parent, from_parent):
    buf = ReplayBuffer.attach(handle)
    # What the parent wrote, as the child sees it.
    seen = {
        "observation": buf.fields["observation"][start : start + rows].copy(),
        "reward": buf.fields["reward"][start : start + rows].copy(),
        "games": buf.counters["games"],
        "len": len(buf),
    }
    ep = make_episode(np.random.default_rng(7), 5)
    ok = buf.add_episode(ep, priorities=np.arange(1.0, 6.0))
    to_parent.put((seen, ok))
    buf.close()  # a non-owner's close must only unmap
    to_parent.put("closed")
    from_parent.get(timeout=30)  # parent checked the segment while we are still alive


@pytest.mark.slow
def test_spawned_child_attaches_sees_writes_and_close_does_not_unlink(small_buffer):
    buf = small_buffer
    name = buf.handle.segment
    rng = np.random.default_rng(0)
    ep = make_episode(rng, 9)
    assert buf.add_episode(ep)
    [ref] = buf.episodes()

    to_parent, from_parent = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=_child_attach, args=(buf.handle, ref.start, ref.rows, to_parent, from_parent))
    proc.start()
    try:
        seen, ok = to_parent.get(timeout=30)
        # child sees the parent's writes
        np.testing.assert_array_equal(seen["observation"], ep["observation"])
        np.testing.assert_array_equal(seen["reward"], ep["reward"])
        assert seen["games"] == 1 and seen["len"] == 9
        # parent sees the child's writes
        assert ok is True
        assert buf.counters["games"] == 2 and len(buf) == 9 + 5
        child_ep = make_episode(np.random.default_rng(7), 5)
        refs = buf.episodes()
        assert [r.rows for r in refs] == [10, 6]
        got = buf.read_episode(refs[1])
        for key, value in child_ep.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        np.testing.assert_allclose(
            buf.priorities(np.arange(refs[1].start, refs[1].start + 5)), (np.arange(1.0, 6.0) + 1e-6) ** 0.6
        )
        # the child closed its view: the segment is still there and works in the parent
        assert to_parent.get(timeout=30) == "closed"
        assert _segment_exists(name)
        from_parent.put("go")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    # the child has exited: still there, still usable
    assert _segment_exists(name)
    batch = buf.sample(64, 0.4, rng=rng)
    assert batch.data["observation"].shape == (64, 4)
    assert buf.add_episode(make_episode(rng, 3))
    assert buf.counters["games"] == 3
    # the owner's close unlinks
    buf.close()
    assert not _segment_exists(name)
    assert name not in mpper_shm.mpper_segments()
    buf.close()  # idempotent


def test_attach_and_close_in_same_process_keeps_segment(small_buffer):
    small_buffer.add_episode(make_episode(np.random.default_rng(1), 4))
    view = ReplayBuffer.attach(small_buffer.handle)
    assert len(view) == 4
    view.close()
    view.close()
    assert _segment_exists(small_buffer.handle.segment)
    assert small_buffer.add_episode(make_episode(np.random.default_rng(2), 4))
    assert len(small_buffer) == 8


# --------------------------------------------------------------------------------------
# A process not started by multiprocessing attaches and exits (resource-tracker bug)
# --------------------------------------------------------------------------------------
_ATTACH_SCRIPT = r"""
import pickle, sys
from mpper import ReplayBuffer
handle = pickle.load(open(sys.argv[1], "rb"))
buf = ReplayBuffer.attach(handle)
print(buf.counters["games"], float(buf.fields["reward"][int(sys.argv[2])]), flush=True)
if sys.argv[3] == "close":
    buf.close()
# else: just exit with the mapping open
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "exit"])
def test_independent_process_attach_and_exit_keeps_segment(small_buffer, tmp_path, how):
    buf = small_buffer
    name = buf.handle.segment
    ep = make_episode(np.random.default_rng(3), 6)
    buf.add_episode(ep)
    [ref] = buf.episodes()
    handle_file = tmp_path / "handle.pkl"
    handle_file.write_bytes(pickle.dumps(buf.handle))
    res = subprocess.run(
        [sys.executable, "-c", _ATTACH_SCRIPT, str(handle_file), str(ref.start + 2), how],
        check=False, capture_output=True, text=True, timeout=30, env=_ENV,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    games, reward = res.stdout.split()
    assert int(games) == 1 and float(reward) == float(ep["reward"][2])
    assert _tracker_complaints(res.stderr) == [], res.stderr
    # its resource tracker has exited too (it held the captured stderr): nothing unlinked
    assert _segment_exists(name)
    assert buf.add_episode(make_episode(np.random.default_rng(4), 3))
    assert buf.sample(16, rng=np.random.default_rng(0)).indices.shape == (16,)


_PORTABLE_SCRIPT = r"""
import pickle, sys, time
import numpy as np
sys.path.insert(0, sys.argv[2])
from conftest import make_episode
from mpper import ReplayBuffer
buf = ReplayBuffer.attach(pickle.loads(open(sys.argv[1], "rb").read()))
print("locked" if not buf._lock.acquire(False) else "free", flush=True)  # the parent holds it
t0 = time.monotonic()
buf.add_episode(make_episode(np.random.default_rng(5), 4))  # waits for the parent's release
print(f"{time.monotonic() - t0:.3f}", buf.counters["games"], flush=True)
buf.close()
"""


@pytest.mark.slow
def test_a_portable_handle_shares_the_writers_lock_with_a_process_multiprocessing_did_not_start(small_buffer, tmp_path):
    """``BufferHandle.portable()`` (for a Ray actor beside the learner): it pickles like any
    data, and the independent process that attaches it takes the very lock the other
    writers take (the mutex lives in the segment): while this process holds it, that
    process cannot write."""
    buf = small_buffer
    handle_file = tmp_path / "handle.pkl"
    handle_file.write_bytes(pickle.dumps(buf.handle.portable()))
    buf._lock.acquire()
    proc = subprocess.Popen([sys.executable, "-c", _PORTABLE_SCRIPT, str(handle_file), os.path.dirname(__file__)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ENV)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "locked"
        time.sleep(0.5)
        assert buf.counters["games"] == 0  # its write waits for our lock
    finally:
        buf._lock.release()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    waited, games = out.split()
    assert float(waited) >= 0.3 and int(games) == 1 == buf.counters["games"]
    assert _tracker_complaints(err) == [], err
    assert _segment_exists(buf.handle.segment)


# --------------------------------------------------------------------------------------
# The owner dies from a signal
# --------------------------------------------------------------------------------------
_OWNER_SCRIPT = r"""
import time
from mpper import ReplayBuffer
from mpper.algos.dqn.targets import dqn_schema
buf = ReplayBuffer.create(dqn_schema((4,)), capacity=64)
print(buf.handle.segment, flush=True)
while True:  # until the test signals or kills it (a fixed sleep could run out on a loaded machine)
    time.sleep(3600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_owner_killed_by_signal_unlinks(sig):
    proc = subprocess.Popen([sys.executable, "-c", _OWNER_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_ENV)  # fmt: skip
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith(f"mpper_{proc.pid}_"), name
        assert _segment_exists(name)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, stderr  # SystemExit(143) from mpper's handler
    else:
        assert "KeyboardInterrupt" in stderr
    assert not _segment_exists(name)
    # The owner unlinked it itself: its resource tracker (the last net) had nothing to do.
    assert _tracker_complaints(stderr) == [], stderr


# --------------------------------------------------------------------------------------
# /dev/shm room check
# --------------------------------------------------------------------------------------
def _needed_bytes(schema, capacity):
    return segment_bytes(schema, capacity)


def test_room_check_refuses_and_creates_nothing(monkeypatch):
    schema = muzero_schema((8,), 4)
    capacity = 10_000
    needed = _needed_bytes(schema, capacity)
    monkeypatch.setattr(mpper.shm, "free_bytes", lambda path=mpper_shm.SHM_DIR: 1 << 20)
    def own():  # other test runs may share /dev/shm
        return [n for n in mpper_shm.mpper_segments() if mpper_shm.owner_pid(n) == os.getpid()]

    before = own()
    with pytest.raises(SharedMemoryRoomError) as info:
        ReplayBuffer.create(schema, capacity=capacity)
    msg = str(info.value)
    assert mpper_shm.human_bytes(needed) in msg, msg
    assert "/dev/shm" in msg
    assert "1.0 MiB" in msg  # the free space it saw
    assert isinstance(info.value, MemoryError)
    assert own() == before


def test_room_check_boundary(monkeypatch):
    schema = dqn_schema((4,))
    needed = _needed_bytes(schema, 1000)
    free = {"n": needed + mpper_shm._ROOM_MARGIN - 1}
    monkeypatch.setattr(mpper.shm, "free_bytes", lambda path=mpper_shm.SHM_DIR: free["n"])
    with pytest.raises(SharedMemoryRoomError):
        ReplayBuffer.create(schema, capacity=1000)
    free["n"] += 1  # exactly enough with the margin
    with ReplayBuffer.create(schema, capacity=1000) as buf:
        assert buf.capacity == 1000 and _segment_exists(buf.handle.segment)


# --------------------------------------------------------------------------------------
# Stale segments
# --------------------------------------------------------------------------------------
def _fake_segment(pid: int) -> str:
    name = f"mpper_{pid}_{os.urandom(4).hex()}_test"
    seg = shared_memory.SharedMemory(name=name, create=True, size=64)
    # we unlink it by hand below (or remove_stale_segments does): keep the tracker out
    resource_tracker.unregister(seg._name, "shared_memory")
    seg.close()
    return name


def test_stale_segments_found_and_removed_live_left(small_buffer):
    dead_pid = 2**22 + 12345  # above any pid_max: never a live process
    assert not mpper_shm.pid_alive(dead_pid)
    live = small_buffer.handle.segment
    fake = _fake_segment(dead_pid)
    try:
        assert mpper_shm.owner_pid(fake) == dead_pid
        stale = mpper_shm.stale_segments()
        assert fake in stale
        assert live not in stale
        removed = mpper_shm.remove_stale_segments()
        assert fake in removed and live not in removed
        assert not _segment_exists(fake)
        assert _segment_exists(live)
        assert small_buffer.add_episode(make_episode(np.random.default_rng(5), 3))
        assert fake not in mpper_shm.stale_segments()
    finally:
        if _segment_exists(fake):
            os.unlink(os.path.join(mpper_shm.SHM_DIR, fake))


def test_zombie_owner_counts_as_dead():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 20
    # wait until it has exited but do not reap it: it is a zombie
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.02)
    fake = _fake_segment(proc.pid)
    try:
        assert fake in mpper_shm.stale_segments()
        proc.wait()
        assert fake in mpper_shm.remove_stale_segments()
        assert not _segment_exists(fake)
    finally:
        proc.wait()
        if _segment_exists(fake):
            os.unlink(os.path.join(mpper_shm.SHM_DIR, fake))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.slow
def test_a_start_removes_a_dead_owners_segments_and_keeps_a_live_owners():
    """Two real owners: one alive, one SIGKILLed together with its resource tracker (as
    `kill -9` of its process group would), so nobody unlinked its segment. What every
    start runs first (``remove_stale_segments``, called by ``mpper.runtime.supervisor.train``), run
    in a third process, removes the dead owner's segment and leaves the live one's,
    which its owner then still uses and unlinks itself."""
    live = subprocess.Popen([sys.executable, "-c", _OWNER_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_ENV)  # fmt: skip
    dead = subprocess.Popen([sys.executable, "-c", _OWNER_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_ENV)  # fmt: skip
    dead_name = ""
    semaphores: set = set()
    try:
        live_name, dead_name = live.stdout.readline().strip(), dead.stdout.readline().strip()
        assert live_name.startswith(f"mpper_{live.pid}_") and dead_name.startswith(f"mpper_{dead.pid}_")
        tracker = [p for p in _children(dead.pid) if b"resource_tracker" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(tracker) == 1, "the owner's resource tracker (the last net) was not found"
        semaphores = mapped_semaphores([dead.pid, *tracker])  # Python's, unlinked below
        os.kill(tracker[0], signal.SIGKILL)
        dead.kill()
        dead.communicate(timeout=30)
        assert _segment_exists(dead_name), "nobody was left to unlink the dead owner's segment"
        assert dead_name in mpper_shm.stale_segments() and live_name not in mpper_shm.stale_segments()

        start = subprocess.run([sys.executable, "-c", "from mpper import shm; print(' '.join(shm.remove_stale_segments()))"],
                               capture_output=True, text=True, timeout=60, env=_ENV, check=False)  # fmt: skip
        assert start.returncode == 0, start.stderr
        assert dead_name in start.stdout.split() and live_name not in start.stdout.split()
        assert not _segment_exists(dead_name)
        assert _segment_exists(live_name)
        seg = mpper_shm.attach(live_name)  # still there, still mappable; its owner unlinks it
        assert seg.size > 0
        mpper_shm.release(seg, unlink=False)
        live.send_signal(signal.SIGTERM)
        live.communicate(timeout=30)
        assert live.returncode == 128 + signal.SIGTERM
        assert not _segment_exists(live_name)
    finally:
        for proc in (live, dead):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if dead_name and _segment_exists(dead_name):
            os.unlink(os.path.join(mpper_shm.SHM_DIR, dead_name))
        for path in semaphores:  # the killed tracker would have unlinked them
            path.unlink(missing_ok=True)


def _unused_pid() -> int:
    """A pid no process here has: what a process in another pid namespace looks like."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


@pytest.mark.slow
def test_a_live_owner_whose_pid_is_not_visible_keeps_its_segment():
    """A live owner in another pid namespace (a container sharing /dev/shm): the pid in
    its segment's name is not one this namespace sees. Stood in for by renaming a live
    owner's segment to name a pid that no process here has. A start keeps it, because
    its owner holds its lock; once the owner is gone (SIGKILL, its resource tracker
    too), the lock is gone with it and the next start removes the segment."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER_SCRIPT], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_ENV)  # fmt: skip
    foreign = ""
    semaphores: set = set()
    try:
        name = owner.stdout.readline().strip()
        assert name.startswith(f"mpper_{owner.pid}_"), name
        foreign = f"mpper_{_unused_pid()}_{name.split('_', 2)[2]}"
        os.rename(os.path.join(mpper_shm.SHM_DIR, name), os.path.join(mpper_shm.SHM_DIR, foreign))
        assert not mpper_shm.pid_alive(mpper_shm.owner_pid(foreign))
        assert foreign not in mpper_shm.stale_segments()
        assert foreign not in mpper_shm.remove_stale_segments() and _segment_exists(foreign)
        tracker = [p for p in _children(owner.pid) if b"resource_tracker" in open(f"/proc/{p}/cmdline", "rb").read()]
        semaphores = mapped_semaphores([owner.pid, *tracker])  # Python's, unlinked below
        for pid in (*tracker, owner.pid):  # nobody left to unlink it: only the lock tells
            os.kill(pid, signal.SIGKILL)
        owner.communicate(timeout=30)
        assert foreign in mpper_shm.remove_stale_segments() and not _segment_exists(foreign)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.communicate()
        if foreign and _segment_exists(foreign):
            os.unlink(os.path.join(mpper_shm.SHM_DIR, foreign))
        for path in semaphores:  # the killed tracker would have unlinked them
            path.unlink(missing_ok=True)
