"""Shared-memory segments: naming, the /dev/shm room check, create, attach, cleanup.

Every segment mpper creates is named ``mpper_<owner pid>_<random token>_<tag>``: the
prefix lets tests and the supervisor find mpper's segments, and the owner pid says who
made it. A later run tells a dead run's leftovers from a live run's by a lock, not by
that pid (which another pid namespace, such as a container sharing /dev/shm, does not
see, and which the system may reuse): the owner holds an exclusive ``flock`` on the
segment for its whole life, dropped by the kernel when the owner's descriptor closes,
at ``close()`` or at its death, however it dies (``stale_segments``).

Ownership: the process that creates a segment owns it and is the only one that
unlinks it, on ``close()``, at interpreter exit, on SIGTERM (turned into SystemExit so
that ``finally`` blocks and ``atexit`` run) and on Ctrl-C (KeyboardInterrupt unwinds the
same way). Python's resource tracker, which the owner registers with, is the last net:
if the owner is SIGKILLed, the tracker unlinks the segment once the owner and all its
children are gone. Other processes attach without registering (see ``attach``).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import os
import secrets
import signal
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing import resource_tracker, shared_memory

__all__ = [
    "RobustLock",
    "SharedObject",
    "SharedMemoryRoomError",
    "SHM_DIR",
    "create",
    "attach",
    "release",
    "stale_segments",
    "remove_stale_segments",
    "mpper_segments",
    "human_bytes",
]

SHM_DIR = "/dev/shm"
PREFIX = "mpper_"
# Head-room left free in /dev/shm beyond what a segment needs (other users, metadata).
_ROOM_MARGIN = 16 << 20

_owned: dict[str, shared_memory.SharedMemory] = {}
_owned_lock = threading.Lock()
_cleanup_installed = False


class SharedObject:
    """Base of objects living in a segment: ``close()`` on ``with`` exit and on garbage
    collection (the owner's close unlinks; see ``release``)."""

    def close(self) -> None:  # pragma: no cover - subclasses implement it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class SharedMemoryRoomError(MemoryError):
    """/dev/shm has not enough free space for a segment mpper wants to create."""


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: str = SHM_DIR) -> int:
    """Bytes available to this user in ``path`` (the shared-memory filesystem)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_room(nbytes: int, what: str, path: str = SHM_DIR) -> None:
    """Raise SharedMemoryRoomError unless ``path`` has room for ``nbytes`` more."""
    if not os.path.isdir(path):  # not Linux-like: nothing to check against
        return
    free = free_bytes(path)
    if nbytes + _ROOM_MARGIN > free:
        raise SharedMemoryRoomError(
            f"{what} needs {human_bytes(nbytes)} of shared memory but {path} has only "
            f"{human_bytes(free)} free. Lower the capacity, free space in {path}, or give the "
            f"container more (Docker defaults to 64 MiB: docker run --shm-size=8g ...)."
        )


def _new_name(tag: str) -> str:
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(4)}_{tag}"


def create(nbytes: int, tag: str, what: str | None = None) -> shared_memory.SharedMemory:
    """Create and own a zero-filled segment of ``nbytes`` bytes.

    The space is reserved up front with ``posix_fallocate`` where available, so a full
    /dev/shm is a clear error now rather than a SIGBUS on some later write.
    """
    what = what or f"the '{tag}' segment"
    nbytes = max(int(nbytes), 1)
    check_room(nbytes, what)
    shm = _create_locked(tag, nbytes)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(shm._fd, 0, nbytes)  # type: ignore[attr-defined]  # noqa: SLF001 - only handle to the fd
    except OSError as exc:
        shm.close()
        shm.unlink()
        raise SharedMemoryRoomError(
            f"{what}: could not reserve {human_bytes(nbytes)} in {SHM_DIR} ({exc.strerror}). "
            f"Lower the capacity or give the container more shared memory."
        ) from exc
    with _owned_lock:
        _owned[shm.name] = shm
    _install_cleanup()
    return shm


def _create_locked(tag: str, nbytes: int) -> shared_memory.SharedMemory:
    """A new segment whose exclusive flock this process holds (see the module docstring).

    Between the creation and the lock another process's ``remove_stale_segments`` may
    find it unlocked and unlink it: the name then no longer leads to this segment, so
    it is given up and another one made."""
    for _ in range(100):
        shm = shared_memory.SharedMemory(name=_new_name(tag), create=True, size=nbytes)
        fd = shm._fd  # type: ignore[attr-defined]  # noqa: SLF001 - only handle to the fd
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            same = os.stat(os.path.join(SHM_DIR, shm.name)).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same or not os.path.isdir(SHM_DIR):
            return shm
        shm.close()
        # already unlinked by the remover
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # noqa: SLF001
    raise RuntimeError("could not create a shared-memory segment: every new one was removed at once")


@contextmanager
def _untracked():
    # Python < 3.13 registers every attached segment with the resource tracker, which
    # then unlinks it when *this* process exits (CPython gh-82300): a reader would
    # destroy the owner's buffer. Only the owner may unlink, so attach untracked.
    original = resource_tracker.register

    def skip(name, rtype):
        if rtype != "shared_memory":
            original(name, rtype)

    resource_tracker.register = skip
    try:
        yield
    finally:
        resource_tracker.register = original


def attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment by name without taking ownership."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    with _untracked():
        return shared_memory.SharedMemory(name=name)


def release(shm: shared_memory.SharedMemory, unlink: bool) -> None:
    """Unmap ``shm`` and, for its owner, remove it from /dev/shm. Idempotent."""
    try:
        shm.close()
    except BufferError:
        # A numpy view still points into the mapping (a caller kept an array). The
        # mapping then lives until that view dies; unlinking below still removes the name.
        pass
    if unlink:
        with _owned_lock:
            owned = _owned.pop(shm.name, None)
        if owned is not None:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def _unlink_all_owned() -> None:
    with _owned_lock:
        items = list(_owned.values())
    for shm in items:
        release(shm, unlink=True)


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through subprocess tests
    # Turn SIGTERM into an exception so that context managers and atexit unlink.
    raise SystemExit(128 + signum)


def _install_cleanup() -> None:
    global _cleanup_installed
    if _cleanup_installed:
        return
    _cleanup_installed = True
    atexit.register(_unlink_all_owned)
    # Only replace the default SIGTERM action, and only where Python allows it; an
    # application that installed its own handler keeps it (and must exit normally).
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def mpper_segments() -> list[str]:
    """Names of all mpper segments currently in /dev/shm."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped) is dead for our purposes
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, IndexError):
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def owner_pid(name: str) -> int:
    """The pid encoded in an mpper segment name, or -1."""
    try:
        return int(name[len(PREFIX) :].split("_", 1)[0])
    except ValueError:
        return -1


def _held(name: str) -> bool:
    """Whether a live process holds the flock of segment ``name`` (its owner does for
    the segment's life). A non-blocking shared lock, taken and dropped at once, fails
    exactly when some process holds the exclusive one."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # gone already: nothing to remove
    except OSError:
        return True  # not ours to judge (another user's, or not a plain segment)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def stale_segments() -> list[str]:
    """mpper segments that no live process owns: nobody holds their lock."""
    return [n for n in mpper_segments() if not _held(n)]


def remove_stale_segments() -> list[str]:
    """Unlink segments left by dead mpper runs; returns the names removed."""
    removed = []
    for name in stale_segments():
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


class RobustLock:
    """A process-shared, robust pthread mutex living in a shared-memory segment.

    The kernel tracks its owner: every thread keeps a list of the robust mutexes it
    holds, and when the thread dies, however it dies (SIGKILL included), the kernel marks
    each one "owner died" and wakes a waiter. The next locker then gets the lock together
    with ``EOWNERDEAD``; ``acquire`` calls ``on_owner_death(pid)`` (the data it guards may
    be half-updated: the callback repairs it), then marks the mutex consistent. So a
    holder's death never leaves the lock held, and the one who finds it dead knows.

    The mutex is plain bytes of the segment (``SIZE`` bytes: the ``pthread_mutex_t`` and
    the holder's pid, which the owner-died path of glibc overwrites in the mutex itself),
    so any process that maps the segment (forked, spawned, forkserver-started, or one
    multiprocessing did not start at all) locks the very same mutex; nothing to inherit
    and nothing to unlink. Owned by a thread, not a process: two threads of one process
    exclude each other. The calls that may wait go through ``ctypes.CDLL``, which releases
    the GIL, so a blocked locker never stops its process's other threads (``trylock`` and
    ``unlock``, which never wait, keep it); a blocking ``acquire`` waits in slices of
    ``_SLICE_S`` so that Ctrl-C still interrupts it.
    """

    SIZE = 64
    # int64 pid of the holder (0: free, or its holder died before writing it), past the
    # pthread_mutex_t (40 bytes on x86-64 glibc, 48 on aarch64)
    _HOLDER_OFFSET = 56
    _SLICE_S = 0.25

    def __init__(self, region, on_owner_death=None) -> None:
        """``region``: a writable numpy uint8 array of ``SIZE`` bytes, already
        ``initialize``d by the segment's creator. ``on_owner_death(pid)``: called with the
        lock held when the previous holder died holding it (``pid``: 0 if unknown)."""
        if region.nbytes < self.SIZE or region.ctypes.data % 8:
            raise ValueError(f"a RobustLock needs {self.SIZE} 8-byte aligned bytes")
        lib = _pthread()
        self._region = region  # keeps the mapping alive while the addresses below are used
        self._ptr = ctypes.c_void_p(region.ctypes.data)
        self._holder = ctypes.c_int64.from_address(region.ctypes.data + self._HOLDER_OFFSET)
        self._trylock, self._unlock = lib.trylock_keeping_gil, lib.unlock_keeping_gil
        self.on_owner_death = on_owner_death

    @classmethod
    def initialize(cls, region) -> None:
        """Make ``region`` (``SIZE`` zeroed bytes of a shared segment) a robust,
        process-shared mutex, unlocked. Done once, by the segment's creator."""
        lib = _pthread()
        attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t is 4 or 8 bytes
        _check(lib.pthread_mutexattr_init(attr), "pthread_mutexattr_init")
        try:
            _check(lib.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED), "pthread_mutexattr_setpshared")
            _check(lib.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST), "pthread_mutexattr_setrobust")
            _check(lib.pthread_mutex_init(ctypes.c_void_p(region.ctypes.data), attr), "pthread_mutex_init")
        finally:
            lib.pthread_mutexattr_destroy(attr)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; False when ``block`` is False and it is held, or when
        ``timeout`` seconds passed."""
        rc = self._trylock(self._ptr)
        if rc == 0:
            self._holder.value = PID
            return True
        if rc == errno.EBUSY and block:
            rc = self._wait(timeout)
        return self.settle(rc)

    def _wait(self, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            until = time.monotonic() + self._SLICE_S
            if deadline is not None:
                until = min(until, deadline)
            rc = _timed_lock(_pthread(), self._ptr, until)
            if rc != errno.ETIMEDOUT or (deadline is not None and time.monotonic() >= deadline):
                return rc

    def settle(self, rc: int) -> bool:
        """Whether a lock call that returned ``rc`` took the lock; on ``EOWNERDEAD`` (taken,
        its previous holder dead) runs ``on_owner_death`` and marks the mutex consistent."""
        if rc == 0:
            self._holder.value = PID
            return True
        if rc in (errno.EBUSY, errno.ETIMEDOUT):
            return False
        if rc == errno.EOWNERDEAD:
            dead = int(self._holder.value)
            self._holder.value = PID
            try:
                if self.on_owner_death is not None:
                    self.on_owner_death(dead)
            finally:
                _pthread().pthread_mutex_consistent(self._ptr)
            return True
        if rc == errno.ENOTRECOVERABLE:
            raise RuntimeError("the shared lock is unusable: a process found its holder dead and released it "
                               "without marking it consistent")  # fmt: skip
        raise OSError(rc, f"pthread_mutex_lock: {os.strerror(rc)}")

    def release(self) -> None:
        self._holder.value = 0
        rc = self._unlock(self._ptr)
        if rc != 0:
            raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")

    def raw_calls(self) -> tuple:
        """``(trylock, unlock, mutex, holder)`` for a caller that inlines the uncontended
        path: ``trylock(mutex)`` returns 0 (then set ``holder.value = PID``), ``EBUSY``, or
        another code for ``settle``; before ``unlock(mutex)``, set ``holder.value = 0``."""
        return self._trylock, self._unlock, self._ptr, self._holder

    def kernel_calls(self):
        """For compiled code that takes the lock itself (``mpper.replay.kernels``):
        ``(calls, holder)``, ``calls`` an int64 array of the mutex's address and the
        addresses of ``pthread_mutex_trylock`` and ``pthread_mutex_unlock``, ``holder`` the
        int64 array (1,) of the holder's pid (set it after taking the lock, 0 before
        unlocking, as ``raw_calls`` says). The addresses hold while this lock is open."""
        import numpy as np  # the lock itself needs no numpy; only this view of it does

        lib = _pthread()
        calls = np.array([self._ptr.value, ctypes.cast(lib.pthread_mutex_trylock, ctypes.c_void_p).value,
                          ctypes.cast(lib.pthread_mutex_unlock, ctypes.c_void_p).value], np.int64)  # fmt: skip
        holder = np.ndarray((1,), np.int64, buffer=self._region, offset=self._HOLDER_OFFSET)
        return calls, holder

    def holder(self) -> int:
        """The pid that holds the lock now (0: nobody, or not known yet)."""
        return int(self._holder.value)

    def close(self) -> None:
        """Drop the view of the segment (so that it can be unmapped); the lock is unusable after."""
        self._region = self._holder = self._ptr = None  # type: ignore[assignment]  # unusable after close

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __reduce__(self):
        raise TypeError("a RobustLock lives in its segment: attach the segment instead of pickling the lock")


_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1
_CLOCK_MONOTONIC = 1
_lib = None
_lib_lock = threading.Lock()
PID = os.getpid()  # this process's pid, kept current across fork (os.getpid() is a system call)


def _after_fork() -> None:
    global PID
    PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _pthread():
    """glibc's pthread functions (in libc since glibc 2.34, in libpthread before: both
    are loaded in a CPython process, so the global namespace has them)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL(None)
            ptr = ctypes.c_void_p
            for name in ("pthread_mutex_lock", "pthread_mutex_trylock", "pthread_mutex_unlock",
                         "pthread_mutex_consistent", "pthread_mutexattr_init", "pthread_mutexattr_destroy"):  # fmt: skip
                getattr(lib, name).argtypes = [ptr]
            for name in ("pthread_mutexattr_setpshared", "pthread_mutexattr_setrobust"):
                getattr(lib, name).argtypes = [ptr, ctypes.c_int]
            lib.pthread_mutex_init.argtypes = [ptr, ptr]
            lib.pthread_mutex_timedlock.argtypes = [ptr, ctypes.POINTER(_Timespec)]
            if hasattr(lib, "pthread_mutex_clocklock"):  # glibc >= 2.30: waits on the monotonic clock
                lib.pthread_mutex_clocklock.argtypes = [ptr, ctypes.c_int, ctypes.POINTER(_Timespec)]
            # trylock and unlock never wait: called keeping the GIL (PyDLL), which spares
            # the release and re-take of CDLL around each call; everything that may wait
            # (lock, clocklock, timedlock) goes through CDLL and lets other threads run
            nowait = ctypes.PyDLL(None)
            lib.trylock_keeping_gil, lib.unlock_keeping_gil = nowait.pthread_mutex_trylock, nowait.pthread_mutex_unlock
            lib.trylock_keeping_gil.argtypes = lib.unlock_keeping_gil.argtypes = [ptr]
            _lib = lib
    return _lib


def _timed_lock(lib, ptr, until_monotonic: float) -> int:
    if hasattr(lib, "pthread_mutex_clocklock"):
        sec = int(until_monotonic)
        return lib.pthread_mutex_clocklock(ptr, _CLOCK_MONOTONIC, _Timespec(sec, int((until_monotonic - sec) * 1e9)))
    until = time.time() + (until_monotonic - time.monotonic())  # timedlock waits on the realtime clock
    sec = int(until)
    return lib.pthread_mutex_timedlock(ptr, _Timespec(sec, int((until - sec) * 1e9)))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")
