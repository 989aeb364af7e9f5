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
import fcntl
import os
import secrets
import signal
import sys
import threading
from contextlib import contextmanager
from multiprocessing import resource_tracker, shared_memory

__all__ = [
    "NamedLock",
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
            os.posix_fallocate(shm._fd, 0, nbytes)  # noqa: SLF001 - only handle to the fd
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
        fcntl.flock(shm._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # noqa: SLF001 - only handle to the fd
        try:
            same = os.stat(os.path.join(SHM_DIR, shm.name)).st_ino == os.fstat(shm._fd).st_ino  # noqa: SLF001
        except FileNotFoundError:
            same = False
        if same or not os.path.isdir(SHM_DIR):
            return shm
        shm.close()
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - already unlinked by the remover
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


class NamedLock:
    """A ``multiprocessing`` lock opened by its name, for a process that multiprocessing
    did not start (a Ray actor on this machine) and so cannot inherit the lock.

    On POSIX a lock of a ``spawn`` or ``forkserver`` context is a named semaphore
    (``/dev/shm/sem.mp-...``) that lives until its creator drops it; multiprocessing
    only refuses to pickle it outside a child's start. A ``NamedLock`` pickles as the
    semaphore's name and reopens it on first use: both sides then lock the very same
    semaphore. It never unlinks it (its creator does). A lock of a ``fork`` context has
    no name left (it is unlinked at once) and is refused.
    """

    def __init__(self, state: tuple) -> None:
        self._state = tuple(state)  # (handle, kind, maxvalue, name), as SemLock pickles itself
        self._lock = None

    @classmethod
    def of(cls, lock) -> "NamedLock":
        """The name of ``lock`` (a ``multiprocessing`` Lock of a spawn or forkserver context)."""
        if isinstance(lock, NamedLock):
            return lock
        semlock = getattr(lock, "_semlock", None)
        if semlock is None or getattr(lock, "_is_fork_ctx", False) or not getattr(semlock, "name", None):
            raise ValueError(f"{lock!r} cannot be opened by name: expected a Lock of a spawn or forkserver "
                             "multiprocessing context")  # fmt: skip
        return cls((semlock.handle, semlock.kind, semlock.maxvalue, semlock.name))

    @property
    def name(self) -> str:
        return self._state[3]

    def _opened(self):
        if self._lock is None:
            from multiprocessing import synchronize

            lock = synchronize.Lock.__new__(synchronize.Lock)
            try:
                lock.__setstate__(self._state)  # sem_open(name): the creator's semaphore
            except FileNotFoundError:
                raise FileNotFoundError(f"the lock {self.name} is gone (its creator exited)") from None
            self._lock = lock
        return self._lock

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return self._opened().acquire(block, timeout)

    def release(self) -> None:
        self._opened().release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __getstate__(self) -> dict:
        return {"_state": self._state, "_lock": None}

    def __repr__(self) -> str:
        return f"NamedLock({self.name!r})"
