"""The candidates for the replay buffer's lock, measured side by side.

* ``semaphore``: ``multiprocessing.Lock`` (a POSIX semaphore; what the buffer used before:
  it has no owner, so a holder's death leaves it held);
* ``robust mutex``: ``mpper.shm.RobustLock``, a robust process-shared pthread mutex in a
  shared segment, called through ``ctypes`` (the kernel tells the next locker that the
  holder died);
* ``fcntl OFD``: an open-file-description byte-range lock (``F_OFD_SETLKW``) on a file
  (the kernel drops it when the holder dies);
* ``robust mutex, compiled``: the same mutex taken by compiled code, as the buffer's
  priority update takes it (``mpper.replay.kernels.locked_update``: ``pthread_mutex_*``
  called through their addresses from a numba kernel, holder pid written beside it); a
  kernel call makes 100 round trips, so the figure is the lock's own cost there, without
  the call.

Two measures, the candidates interleaved in every repetition: the uncontended round trip
(acquire + release in one process, ns per pair), and two processes (spawn) taking the
lock in turn around a shared counter (pairs per second in all; the counter checks that
the lock excluded).

Usage::

    python bench/lock.py                  # 7 repetitions
    python bench/lock.py --reps 3 --seconds 1
"""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing as mp
import os
import statistics
import struct
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numba  # noqa: E402

from mpper.replay.kernels import _call_c  # noqa: E402
from mpper.shm import RobustLock, attach  # noqa: E402

F_OFD_SETLK, F_OFD_SETLKW = 37, 38  # Linux
_WRITE_LOCK = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 1, 0)
_UNLOCK = struct.pack("hhqqi", fcntl.F_UNLCK, 0, 0, 1, 0)


class OfdLock:
    """An OFD byte-range lock on ``path``; each opener (process or thread) its own."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def acquire(self, block: bool = True) -> bool:
        try:
            fcntl.fcntl(self.fd, F_OFD_SETLKW if block else F_OFD_SETLK, _WRITE_LOCK)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        fcntl.fcntl(self.fd, F_OFD_SETLK, _UNLOCK)

    def __reduce__(self):
        return OfdLock, (self.path,)


@numba.njit(nogil=True)
def _compiled_pairs(calls, holder, pid, counter, pairs):
    """``pairs`` times: pthread_mutex_lock, holder pid, counter + 1, holder 0, unlock."""
    for _ in range(pairs):
        if _call_c(calls[1], calls[0]) != 0:
            return -1
        holder[0] = pid
        counter[0] += 1
        holder[0] = 0
        _call_c(calls[2], calls[0])
    return pairs


class CompiledRobustLock:
    """``RobustLock``'s mutex as compiled code takes it; ``run(counter, pairs)`` makes
    ``pairs`` round trips in one kernel call, each adding 1 to ``counter[0]``."""

    def __init__(self, lock: RobustLock) -> None:
        import ctypes

        self.lock = lock
        calls, self.holder = lock.kernel_calls()
        blocking = ctypes.cast(ctypes.CDLL(None).pthread_mutex_lock, ctypes.c_void_p).value
        self.calls = np.array([calls[0], blocking, calls[2]], np.int64)  # blocks when held, as the others do

    def run(self, counter: np.ndarray, pairs: int) -> None:
        assert _compiled_pairs(self.calls, self.holder, os.getpid(), counter, pairs) == pairs


def open_lock(kind: str, shared):
    """The lock of ``kind`` in this process, from what ``make_locks`` shared."""
    if kind == "robust mutex, compiled":
        seg = attach(shared)
        return CompiledRobustLock(RobustLock(np.ndarray((RobustLock.SIZE,), np.uint8, buffer=seg.buf))), seg
    if kind == "robust mutex":
        seg = attach(shared)
        return RobustLock(np.ndarray((RobustLock.SIZE,), np.uint8, buffer=seg.buf)), seg
    return shared, None


def round_trip_ns(lock, pairs: int) -> float:
    if isinstance(lock, CompiledRobustLock):
        counter = np.zeros(1, np.int64)
        lock.run(counter, 100)  # compiled before the clock starts
        t0 = time.perf_counter_ns()
        for _ in range(pairs // 100):
            lock.run(counter, 100)
        return (time.perf_counter_ns() - t0) / (pairs // 100 * 100)
    acquire, release = lock.acquire, lock.release
    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        acquire()
        release()
    return (time.perf_counter_ns() - t0) / pairs


def _contender(kind: str, shared, counter_name: str, seconds: float, start, out) -> None:
    lock, seg = open_lock(kind, shared)
    counter_seg = attach(counter_name)
    counter = np.ndarray((1,), np.int64, buffer=counter_seg.buf)
    pairs = 0
    if isinstance(lock, CompiledRobustLock):
        lock.run(np.zeros(1, np.int64), 1)  # compiled before the clock starts
    start.wait()
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        if isinstance(lock, CompiledRobustLock):
            lock.run(counter, 100)
        else:
            for _ in range(100):
                lock.acquire()
                counter[0] += 1  # not atomic: only the lock keeps the count exact
                lock.release()
        pairs += 100
    out.put(pairs)
    del counter, lock


def contended_pairs_per_s(kind: str, shared, seconds: float) -> tuple[float, bool]:
    ctx = mp.get_context("spawn")
    counter_seg = shared_memory.SharedMemory(create=True, size=8)
    try:
        counter = np.ndarray((1,), np.int64, buffer=counter_seg.buf)
        counter[0] = 0
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_contender, args=(kind, shared, counter_seg.name, seconds, start, out))
                 for _ in range(2)]  # fmt: skip
        for p in procs:
            p.start()
        time.sleep(1.0)  # both imported and waiting
        start.set()
        total = sum(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
        exact = int(counter[0]) == total
        del counter
        return total / seconds, exact
    finally:
        counter_seg.close()
        counter_seg.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=200_000, help="round trips per uncontended measure")
    ap.add_argument("--seconds", type=float, default=2.0, help="per contended measure")
    args = ap.parse_args(argv)
    seg = shared_memory.SharedMemory(create=True, size=RobustLock.SIZE)
    tmp = tempfile.NamedTemporaryFile(prefix="mpper-lock-bench-")
    try:
        RobustLock.initialize(np.ndarray((RobustLock.SIZE,), np.uint8, buffer=seg.buf))
        shared = {"semaphore": mp.get_context("spawn").Lock(), "robust mutex": seg.name, "fcntl OFD": OfdLock(tmp.name),
                  "robust mutex, compiled": seg.name}  # fmt: skip
        kinds = list(shared)
        uncontended = {k: [] for k in kinds}
        contended = {k: [] for k in kinds}
        for rep in range(args.reps):
            order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
            for kind in order:
                lock, own = open_lock(kind, shared[kind])
                uncontended[kind].append(round_trip_ns(lock, args.pairs))
                del lock
                if own is not None:
                    own.close()
            for kind in order:
                rate, exact = contended_pairs_per_s(kind, shared[kind], args.seconds)
                assert exact, f"{kind}: the shared counter lost increments: the lock did not exclude"
                contended[kind].append(rate)
            print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)
        print(f"python bench/lock.py --reps {args.reps} --pairs {args.pairs} --seconds {args.seconds:g}; "
              f"median (min-max) over the repetitions\n")  # fmt: skip
        print("| lock | uncontended round trip (ns) | 2 processes in turn (pairs/s) |")
        print("|---|---|---|")
        for kind in kinds:
            u, c = uncontended[kind], contended[kind]
            print(f"| {kind} | {statistics.median(u):.0f} ({min(u):.0f}-{max(u):.0f}) | "
                  f"{statistics.median(c):,.0f} ({min(c):,.0f}-{max(c):,.0f}) |")  # fmt: skip
    finally:
        seg.close()
        seg.unlink()
        tmp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
