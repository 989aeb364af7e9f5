"""Shared test fixtures: the /dev/shm leak guard, ``make_episode``, ``small_buffer`` and
``trained_run`` (one real run for the tests of --evaluate, --render, --on-snapshot, --plot).

Leak guard: after every test, any ``mpper_*`` segment that appeared during the test and
is still in /dev/shm fails that test (and is unlinked, so one leak does not fail every
later test). Other mpper test runs may share this machine's /dev/shm, so a new segment
counts as ours only when its owner pid (encoded in the name) is this process or a
process that is gone (a child the test started and that leaked); a live foreign
owner's segment is left alone.

``mapped_semaphores``: a test that SIGKILLs a process together with its resource
tracker (as ``kill -9`` of a process group would) leaves that process's multiprocessing
semaphores (``/dev/shm/sem.mp-*``, 32 bytes each) behind, because the tracker is what
unlinks them; such a test collects them from ``/proc/PID/maps`` before the kill and
unlinks them after.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mpper import ReplayBuffer
from mpper import shm as mpper_shm
from mpper.algos.muzero.targets import muzero_schema


def _ours_or_dead(name: str) -> bool:
    pid = mpper_shm.owner_pid(name)
    return pid == os.getpid() or not mpper_shm.pid_alive(pid)


def _leftovers(before: set[str]) -> list[str]:
    return [n for n in mpper_shm.mpper_segments() if n not in before and _ours_or_dead(n)]


def _unlink(names) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(mpper_shm.SHM_DIR, name))
        except FileNotFoundError:
            pass


def mapped_semaphores(pids) -> set[Path]:
    """The POSIX named semaphores (multiprocessing's ``/dev/shm/sem.mp-*``) that the
    processes ``pids`` have mapped now. glibc maps a semaphore under the temporary name
    it created it with (shown as deleted), so the files are matched by inode."""
    inodes = _mapped_semaphore_inodes(pids)
    return {path for path, inode in _semaphores().items() if inode in inodes}


def unmapped_semaphores() -> set[Path]:
    """multiprocessing's named semaphores that no live process has mapped: what a process
    that died without unlinking its semaphores leaves behind. Those of other programs
    running beside the tests (another mpper run) are mapped by their owners, so they do
    not count."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    inodes = _mapped_semaphore_inodes(pids)
    return {path for path, inode in _semaphores().items() if inode not in inodes}


def _mapped_semaphore_inodes(pids) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for line in maps.splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(f"{mpper_shm.SHM_DIR}/sem."):
                inodes.add(int(fields[4]))
    return inodes


def _semaphores() -> dict[Path, int]:
    """``/dev/shm/sem.mp-*`` by inode; one unlinked by its owner since the listing is left out."""
    found = {}
    for path in Path(mpper_shm.SHM_DIR).glob("sem.mp-*"):
        try:
            found[path] = path.stat().st_ino
        except FileNotFoundError:
            pass
    return found


@pytest.fixture(autouse=True)
def _no_leaked_segments(request):
    before = set(mpper_shm.mpper_segments())
    yield
    leaked = _leftovers(before)
    if leaked:
        _unlink(leaked)
        pytest.fail(f"{request.node.nodeid} left shared-memory segments in /dev/shm: {leaked}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_segments_session():
    before = set(mpper_shm.mpper_segments())
    yield
    leaked = _leftovers(before)
    if leaked:
        _unlink(leaked)
        pytest.fail(f"the test session left shared-memory segments in /dev/shm: {leaked}", pytrace=False)


def make_episode(rng: np.random.Generator, T: int, obs_shape=(4,), num_actions: int = 2,
                 two_player: bool = False) -> dict[str, np.ndarray]:  # fmt: skip
    """A random episode of ``T`` moves (``T + 1`` rows) in the contract's row layout
    for ``muzero_schema(obs_shape, num_actions)`` (``reanalysed_value`` left out)."""
    L = T + 1
    action = rng.integers(0, num_actions, size=L).astype(np.int64)
    action[0] = 0  # no action led to o_0
    reward = rng.normal(size=L).astype(np.float32)
    reward[0] = 0.0
    to_play = (np.arange(L) % 2 if two_player else np.zeros(L)).astype(np.int8)
    root_value = rng.uniform(-1, 1, size=L).astype(np.float32)
    root_value[T] = 0.0
    visits = rng.random((L, num_actions)).astype(np.float32)
    visits /= visits.sum(axis=1, keepdims=True)
    visits[T] = 0.0
    return {
        "observation": rng.normal(size=(L, *obs_shape)).astype(np.float32),
        "action": action,
        "reward": reward,
        "to_play": to_play,
        "root_value": root_value,
        "child_visits": visits,
    }


@pytest.fixture
def one_torch_thread():
    """torch at one intra-op thread for the test, put back after it: tiny networks on a
    shared 2-core machine only thrash with a second thread (and run_learner sets the thread
    count of the calling process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def small_buffer():
    """A 256-slot muzero_schema((4,), 2) buffer owned by this process, closed afterwards."""
    buf = ReplayBuffer.create(muzero_schema((4,), 2), capacity=256, alpha=0.6)
    try:
        yield buf
    finally:
        buf.close()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A real finished run directory, shared by the tests that only read it (copy it with
    ``shutil.copytree`` before changing anything): ``python run.py --workers 0`` on
    CartPole, 40 training steps of the small e2e settings, seed 3 (about 10 s). Records
    and evaluations every 0.1 s, so that even a fast machine leaves a few of each."""
    from test_train_e2e import ROOT, run_args

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    args = run_args(run_dir, "--workers", "0", "--max-train-steps", "40", "--seed", "3",
                    "--set", "training.samples_per_insert=4", "--set", "runtime.log_interval_s=0.1",
                    "--set", "runtime.evaluation_interval_s=0.1")  # fmt: skip
    proc = subprocess.run(args, check=False, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return run_dir
