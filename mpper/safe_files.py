"""Files of a run directory or snapshot that a user may have received from someone else:
read and written as data, never as a way to hang, exhaust or redirect mpper.

- :func:`open_received` / :func:`read_received`: a file opened for reading only if it is a
  regular file of its own and at most ``max_bytes`` long. It is opened with
  ``O_NONBLOCK`` (opening a FIFO cannot wait for a writer) and ``O_NOFOLLOW`` (a symbolic
  link, which could lead to ``/dev/zero`` or to anyone's file, is refused), then checked
  with ``fstat`` on the open descriptor, so the file checked is the file read.
- :func:`open_append`: a file opened for appending (created if missing) without following
  a symbolic link, and only if it is a regular file: appending to a link would write
  wherever it points, and opening a FIFO for writing would wait for a reader.
- :func:`refuse_link`: a directory mpper writes into (``tensorboard/``, ``plots/``) must not
  be a symbolic link either.

Whole-file writes (:mod:`mpper.atomic`) need none of this: they rename a new file over
the name, which replaces a link there instead of writing through it.
Every refusal is a :class:`ReceivedFileError` whose message is one line naming the file.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path
from typing import BinaryIO, TextIO

__all__ = ["ReceivedFileError", "open_append", "open_received", "read_received", "refuse_link"]


class ReceivedFileError(OSError):
    """A file that is not a regular file of its own (a symbolic link, FIFO, device, socket
    or directory), or one larger than the reader allows. ``str()`` is one line."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "refused file"


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "of an unknown kind"


def _open_checked(path: Path, flags: int, follow_links: bool, mode: int = 0o644) -> int:
    """A descriptor of ``path`` opened with ``flags`` (plus O_NONBLOCK, O_CLOEXEC and,
    unless ``follow_links``, O_NOFOLLOW), refused unless it is a regular file; blocking
    again once checked. FileNotFoundError when it is missing."""
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, mode)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise ReceivedFileError(f"{path}: is a symbolic link; mpper reads and writes a run directory's files "
                                    "only as regular files of their own (refused)") from None  # fmt: skip
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without reader or a socket (ENXIO), a directory
            try:
                st_mode = (os.stat if follow_links else os.lstat)(path).st_mode
            except OSError:
                raise exc from None
            raise ReceivedFileError(f"{path}: is {_kind(st_mode)}, not a regular file (refused)") from None
        raise
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise ReceivedFileError(f"{path}: is {_kind(st_mode)}, not a regular file (refused)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_received(path: str | os.PathLike, max_bytes: int, follow_links: bool = False) -> BinaryIO:
    """``path`` opened for reading (binary) if it is a regular file of at most
    ``max_bytes`` bytes; ReceivedFileError otherwise, FileNotFoundError when missing.
    ``follow_links``: for a file the user named on the command line, which may be a link
    of theirs (its target must still be a regular file within the size)."""
    path = Path(path)
    fd = _open_checked(path, os.O_RDONLY, follow_links)
    size = os.fstat(fd).st_size
    if size > max_bytes:
        os.close(fd)
        raise ReceivedFileError(f"{path}: {size:,} bytes, more than the {max_bytes:,} mpper reads from such a file "
                                "(refused)")  # fmt: skip
    return os.fdopen(fd, "rb")


def read_received(path: str | os.PathLike, max_bytes: int, follow_links: bool = False) -> bytes:
    """The bytes of ``path``, opened as :func:`open_received` does; at most ``max_bytes``
    are read even if the file grows meanwhile."""
    with open_received(path, max_bytes, follow_links) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ReceivedFileError(f"{path}: grew past the {max_bytes:,} bytes mpper reads from such a file (refused)")
    return data


def open_append(path: str | os.PathLike, line_buffered: bool = False) -> TextIO:
    """``path`` opened for appending text (UTF-8), created if missing, without following a
    symbolic link and only if it is a regular file; ReceivedFileError otherwise.
    ``line_buffered``: flush each line as it is written."""
    fd = _open_checked(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, follow_links=False)
    raw = os.fdopen(fd, "ab", buffering=0)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", line_buffering=line_buffered)


def refuse_link(path: str | os.PathLike, kind: str = "directory") -> None:
    """ReceivedFileError when ``path`` is a symbolic link, or exists and is not a
    ``kind`` ("directory" or "file"): mpper is about to write into or under it."""
    path = Path(path)
    try:
        st_mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st_mode):
        raise ReceivedFileError(f"{path}: is a symbolic link; mpper writes into a run directory only through "
                                "entries of its own (refused)")  # fmt: skip
    ok = stat.S_ISDIR(st_mode) if kind == "directory" else stat.S_ISREG(st_mode)
    if not ok:
        expected = "a regular file" if kind == "file" else "a directory"
        raise ReceivedFileError(f"{path}: is {_kind(st_mode)}, not {expected} (refused)")
