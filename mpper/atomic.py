"""Atomic file writes: every file mpper writes as a whole (checkpoints, JSON records,
plots, GIFs) goes through :func:`write_atomic`, so that a crash or Ctrl-C at any moment
leaves the old file or the new one, never a torn one, and no temporary file behind.

A temporary file in the same directory is written, flushed and fsynced, renamed over
the target, then the directory is fsynced (the rename itself durable). Buffer snapshots
(many files) do the same per directory in :mod:`mpper.replay.snapshot`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["fsync_dir", "write_atomic", "write_json_atomic"]


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, fsync it, rename it over
    ``path`` and fsync the directory. On any error (or Ctrl-C) the temporary file is
    removed and ``path`` is untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)  # make the rename itself durable


def write_json_atomic(path: str | os.PathLike, data: Any, indent: int | None = 1) -> None:
    """``data`` as JSON (and a final newline) through :func:`write_atomic`."""
    text = json.dumps(data, indent=indent) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (its entries: a rename into it survives a crash); a no-op where
    directories cannot be opened."""
    try:
        dir_fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(dir_fd)
