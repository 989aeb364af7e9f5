"""The buffer's lock as its methods take it: spin briefly, then block; keep the waits.

``SpinThenBlock`` wraps a ``mpper.shm.RobustLock`` (the shared buffer's) or any lock with
``acquire(block, timeout)`` and ``release()`` (a read-only snapshot's ``threading.Lock``).
"""

from __future__ import annotations

import errno
import os
import time
import weakref

from .. import shm as shm_mod

__all__ = ["SpinThenBlock", "weak_call"]


class SpinThenBlock:
    """Context manager over the buffer's lock that tries briefly before sleeping.

    Critical sections last microseconds, while putting a process to sleep on the
    mutex and waking it again costs tens of microseconds to milliseconds on a busy
    machine; so a waiter first retries without blocking (userspace, no system call),
    and only then blocks.

    It also keeps this process's lock waits: ``wait_hist[i]`` counts acquisitions that
    waited ``[2^(i-1), 2^i)`` microseconds (``wait_hist[0]``: under 1 us, which is every
    acquisition whose first try succeeded), and ``wait_max_ns`` the longest. A free lock
    costs one list increment more; only a contended one reads the clock.
    """

    __slots__ = ("lock", "on_error", "wait_hist", "wait_max_ns", "_trylock", "_unlock", "_mutex", "_holder")
    SPINS = 200  # tens of microseconds of retries before a blocking wait
    BINS = 40

    def __init__(self, lock, on_error=None) -> None:
        """``on_error()``: called, lock still held, when an exception leaves the block."""
        self.lock = lock
        self.on_error = on_error
        self.wait_hist = [0] * self.BINS
        self.wait_max_ns = 0
        # A RobustLock's own C calls, made from here: a frame fewer on every acquisition
        calls = lock.raw_calls() if isinstance(lock, shm_mod.RobustLock) else None
        self._trylock, self._unlock, self._mutex, self._holder = calls or (None, None, None, None)

    def __enter__(self):
        if self._trylock is not None:
            rc = self._trylock(self._mutex)
            if rc == 0:
                self._holder.value = shm_mod.PID
                self.wait_hist[0] += 1
                return self
            if rc != errno.EBUSY:  # the owner died (repaired now), or an error
                self.lock.settle(rc)
                self.wait_hist[0] += 1
                return self
        acquire = self.lock.acquire
        if acquire(False):
            self.wait_hist[0] += 1
            return self
        t0 = time.perf_counter_ns()
        for _ in range(self.SPINS):
            if acquire(False):
                break
        else:
            acquire()
        waited = time.perf_counter_ns() - t0
        self.wait_hist[min(self.BINS - 1, (waited // 1000).bit_length())] += 1
        if waited > self.wait_max_ns:
            self.wait_max_ns = waited
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.on_error is not None:
            try:
                self.on_error()
            finally:
                self._release()
            return
        if self._unlock is not None:  # _release, inlined: this runs on every acquisition
            self._holder.value = 0
            rc = self._unlock(self._mutex)
            if rc != 0:
                raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")
        else:
            self.lock.release()

    def after_trylock(self, rc: int) -> "SpinThenBlock | _TakenBy":
        """The block to enter after compiled code's own ``pthread_mutex_trylock`` returned
        ``rc`` (nonzero) and did nothing: ``EBUSY``, this block itself (it waits for the
        holder); any other code, the lock is this thread's already (``EOWNERDEAD``: its
        holder died; ``settle`` repairs) and the block only settles and releases it."""
        return self if rc == errno.EBUSY else _TakenBy(self, rc)

    def _release(self) -> None:
        if self._unlock is not None:
            self._holder.value = 0
            rc = self._unlock(self._mutex)
            if rc != 0:
                raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")
        else:
            self.lock.release()


class _TakenBy:
    """``SpinThenBlock.after_trylock`` for a lock already taken by the trylock that
    returned ``rc``: entering settles it, leaving releases it as the block does."""

    __slots__ = ("block", "rc")

    def __init__(self, block: SpinThenBlock, rc: int) -> None:
        self.block, self.rc = block, rc

    def __enter__(self) -> SpinThenBlock:
        self.block.lock.settle(self.rc)
        self.block.wait_hist[0] += 1
        return self.block

    def __exit__(self, exc_type, exc, tb) -> None:
        self.block.__exit__(exc_type, exc, tb)


def weak_call(obj, method: str):
    """``obj.method`` without a strong reference to ``obj`` (the buffer's lock holds its
    repair callback: a cycle would keep a dropped buffer's segment mapped until the
    garbage collector runs)."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        if target is not None:
            getattr(target, method)(*args)

    return call
