"""Who may write into a run directory: one live run at a time, held by a lock that
cannot go stale.

A run holds an exclusive ``flock`` on ``RUN_DIR/.lock`` from before it writes anything
until its process exits. The kernel drops the lock with the last descriptor of the
open file, however the holder ends (SIGKILL included), so there is no pid to check and
nothing to clean up; the file itself stays, holding the pid of the last run that took
it (for messages only). The descriptor is not inherited by child processes (they are
forked from mpper's forkserver, not from the run's process).

:func:`claim_run_dir` is what ``run.py`` calls before a run starts: it creates the
directory, takes the lock, and refuses (``RunDirError``, one line) a directory another
live run holds, one that already holds a run unless resuming it, and one that cannot be
created or written.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from ..safe_files import ReceivedFileError, open_received, refuse_link

__all__ = ["LOCK_NAME", "RunDir", "RunDirError", "RunDirLock", "check_entries", "check_run_dir", "claim_run_dir", "holds_a_run",
           "live_run_pid"]  # fmt: skip

LOCK_NAME = ".lock"
# What every run writes as it starts (config.json first): a directory holding any of
# these holds a run, which only --resume may continue.
_RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.pt", "buffer")
# Everything a run, --evaluate or --plot reads or writes in a run directory, by kind.
_RUN_ENTRIES = {
    **dict.fromkeys((LOCK_NAME, "config.json", "metrics.jsonl", "episodes.jsonl", "processes.json", "ray_actors.json",
                     "checkpoint.pt", "best.pt", "evaluation.json", "snapshot_evaluation.json"), "file"),
    **dict.fromkeys(("buffer", "tensorboard", "plots", "weights"), "directory"),
}  # fmt: skip
_LOCK_MAX_BYTES = 4096  # the lock file holds a pid


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory, named once (docs/run_directory.md says what each holds)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint.pt"

    @property
    def best(self) -> Path:
        return self.root / "best.pt"

    @property
    def buffer(self) -> Path:
        return self.root / "buffer"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def metrics_csv(self) -> Path:
        return self.root / "metrics.csv"

    @property
    def episodes(self) -> Path:
        return self.root / "episodes.jsonl"

    @property
    def processes(self) -> Path:
        return self.root / "processes.json"

    @property
    def ray_actors(self) -> Path:
        return self.root / "ray_actors.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def videos(self) -> Path:
        return self.root / "videos"

    def weights_at(self, training_step: int) -> Path:
        """The weights history's file of ``training_step`` (``runtime.weights_history_interval_steps``)."""
        return self.root / "weights" / f"step-{training_step:08d}.pt"


class RunDirError(ValueError):
    """A run directory that this run may not, or cannot, write into."""


class RunDirLock:
    """The held lock of one run directory; ``release()`` (or process exit) frees it."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir = run_dir
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_entries(run_dir: Path) -> None:
    """RunDirError when an entry a run reads or writes in ``run_dir`` is a symbolic link
    or not of its kind (a FIFO or device where a file belongs, a file where a directory
    does): a run directory may have come from someone else, and a write through a link
    lands wherever it points."""
    for name, kind in _RUN_ENTRIES.items():
        try:
            refuse_link(run_dir / name, kind)
        except ReceivedFileError as exc:
            raise RunDirError(str(exc)) from None


def holds_a_run(run_dir: Path) -> list[str]:
    """The files of a run that ``run_dir`` holds (empty: none)."""
    return [name for name in _RUN_FILES if (run_dir / name).exists()]


def live_run_pid(run_dir: Path) -> int | None:
    """None when no live process holds ``run_dir``'s lock; else the pid written in the
    lock file (0 if unreadable). Checked with a non-blocking flock of a descriptor
    opened without creating anything; RunDirError when the lock file is not a regular
    file (a FIFO, device or symbolic link)."""
    try:
        lock_file = open_received(run_dir / LOCK_NAME, _LOCK_MAX_BYTES)
    except ReceivedFileError as exc:  # a FIFO would hang the open, a link lead anywhere
        raise RunDirError(str(exc)) from None
    except OSError:
        return None  # no lock file: no run has held this directory
    with lock_file:
        fd = lock_file.fileno()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return int(os.pread(fd, 32, 0).decode().strip() or 0)
            except (OSError, ValueError, UnicodeDecodeError):
                return 0
        return None


def _describe(exc: OSError) -> str:
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return "a parent of it is a file, not a directory"
    return exc.strerror or str(exc)


def check_run_dir(run_dir: Path, flag: str, resume: bool) -> None:
    """What :func:`claim_run_dir` will refuse, found without writing anything: a live
    run holds ``run_dir``, it holds a run and ``resume`` is false, it is a file, an entry
    in it is a symbolic link or not of its kind (:func:`check_entries`), or it cannot be
    created or written. ``flag``: how the user named it, for the messages."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{flag} {run_dir}: exists and is not a directory")
    if run_dir.is_dir():
        try:
            check_entries(run_dir)
        except RunDirError as exc:
            raise RunDirError(f"{flag} {run_dir}: {exc}") from None
    live = live_run_pid(run_dir)
    if live is not None:
        raise RunDirError(f"{flag} {run_dir}: a run is still writing there (pid {live} holds "
                          f"{run_dir / LOCK_NAME}); stop it first, or choose another directory")  # fmt: skip
    existing = holds_a_run(run_dir)
    if existing and not resume:
        raise RunDirError(f"{flag} {run_dir}: holds a run already ({', '.join(existing)}); continue it with "
                          f"--resume {run_dir}, or choose another --run-dir")  # fmt: skip
    nearest = run_dir  # the directory, or the closest ancestor that exists
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise RunDirError(f"{flag} {run_dir}: cannot be created ({nearest} is a file, not a directory)")
    if not os.access(nearest, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only_fs(nearest) else "permission denied"
        raise RunDirError(f"{flag} {run_dir}: cannot write there ({nearest}: {reason})")


def _read_only_fs(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def claim_run_dir(run_dir: Path, flag: str, resume: bool) -> RunDirLock:
    """Create ``run_dir`` if needed and take its lock for this process's run.

    Raises RunDirError for what :func:`check_run_dir` refuses (checked again here, under
    the lock, so that two runs starting together cannot both pass), or when the
    directory cannot be created or written after all; nothing but the directory and
    its lock file is written before the lock is held.
    """
    check_run_dir(run_dir, flag, resume)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RunDirError(f"{flag} {run_dir}: cannot write there ({_describe(exc)})") from None
    lock = RunDirLock(run_dir, fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(f"{flag} {run_dir}: another run started writing there just now; stop it first") from None
        existing = holds_a_run(run_dir)  # a run that started, ran and ended since the check
        if existing and not resume:
            raise RunDirError(f"{flag} {run_dir}: holds a run already ({', '.join(existing)}); continue it with "
                              f"--resume {run_dir}, or choose another --run-dir")  # fmt: skip
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            raise RunDirError(f"{flag} {run_dir}: cannot write there ({_describe(exc)})") from None
    except BaseException:
        lock.release()
        raise
    return lock
