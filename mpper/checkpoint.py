"""Checkpoints: ``checkpoint.pt``: ``save_checkpoint`` (a trainer's state) / ``save_network_checkpoint``
  (a network alone: the evaluator's ``best.pt``) / ``load_checkpoint``, which reads with
  ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts only, a
  file holding any other pickled object is refused without running its code.

A checkpoint may come from someone else, so what it may make this process allocate is
bounded before ``torch.load`` reads it: ``torch.save`` stores its zip entries
uncompressed, so an entry that is compressed (a small file that expands to gigabytes) is
refused from the zip's directory, and with ``max_bytes`` (:func:`checkpoint_budget` of the
network the config builds) so is a file, or an archive, larger than such a network's
checkpoint can be.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from .atomic import write_atomic
from .safe_files import ReceivedFileError, open_received


class _HasState(Protocol):
    """A trainer (``mpper.algos.base.Trainer``): what a checkpoint saves of it."""

    def state_dict(self) -> dict: ...

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointError",
    "checkpoint_budget",
    "load_checkpoint",
    "load_network_weights",
    "save_checkpoint",
    "save_network_checkpoint",
]


CHECKPOINT_NAME = "checkpoint.pt"


CHECKPOINT_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read back (corrupt, truncated, or holding
    something other than tensors, numbers, strings, lists and dicts)."""


def save_checkpoint(path: str | os.PathLike, trainer: _HasState, extra: dict | None = None) -> None:
    """Write ``trainer.state_dict()`` plus ``extra`` (plain values) to ``path`` atomically.

    The file is written under a temporary name in the same directory, flushed to disk
    and renamed over ``path``: a crash at any moment leaves either the previous
    checkpoint or the new one, never a torn file.
    """
    _save_atomic(Path(path), {"format": CHECKPOINT_FORMAT, **trainer.state_dict(), "extra": dict(extra or {})})


def save_network_checkpoint(path: str | os.PathLike, network: torch.nn.Module, training_step: int,
                            extra: dict | None = None) -> None:  # fmt: skip
    """Write a network alone (no optimizer) as a checkpoint that ``load_checkpoint`` and
    ``--evaluate --checkpoint`` read: the evaluator's ``best.pt``."""
    payload = {"format": CHECKPOINT_FORMAT, "network": network.state_dict(), "training_step": int(training_step),
               "extra": dict(extra or {})}  # fmt: skip
    _save_atomic(Path(path), payload)


def _save_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = _on_cpu(payload)
    write_atomic(path, lambda f: torch.save(payload, f))


def _on_cpu(value):
    """``value`` with every tensor in it copied to the CPU: a checkpoint of a CUDA learner
    then loads with a plain ``torch.load(path, weights_only=True)`` on a machine without
    a GPU (tensors saved on a GPU would be restored to one)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value


# What a checkpoint holds beside the network it was written for: an online network
# beside an average, a target network (DQN), the optimizer's moment estimates (two per
# weight with Adam), and one copy of room.
NETWORK_COPIES_PER_CHECKPOINT = 6
CHECKPOINT_OVERHEAD_BYTES = 1 << 20  # the pickled structure, step counters, evaluation extras
# Without a network to size it by (max_bytes None): a ceiling no mpper checkpoint nears,
# so that a link-free regular file is still not read without any bound.
_MAX_CHECKPOINT_BYTES = 64 << 30


def checkpoint_budget(network: torch.nn.Module) -> int:
    """The most bytes a checkpoint of ``network`` can hold, file or archive: its tensors
    ``NETWORK_COPIES_PER_CHECKPOINT`` times over, plus ``CHECKPOINT_OVERHEAD_BYTES``."""
    tensor_bytes = sum(t.numel() * t.element_size() for t in network.state_dict().values())
    return NETWORK_COPIES_PER_CHECKPOINT * tensor_bytes + CHECKPOINT_OVERHEAD_BYTES


def _check_size(path: Path, file, max_bytes: int | None) -> None:
    """Refuse, from the file's size and the zip's directory and before anything is read
    into memory, a checkpoint that would expand beyond what it stores or beyond ``max_bytes``.
    ``file``: ``path`` opened (binary), left at its start."""
    size = os.fstat(file.fileno()).st_size
    if max_bytes is not None and size > max_bytes:
        raise CheckpointError(f"checkpoint {path}: {size:,} bytes, more than the {max_bytes:,} a checkpoint of this "
                              f"config's network can hold: written for another config, or not by mpper")  # fmt: skip
    try:
        with zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError):
        return  # not a zip archive: torch.load says what is wrong with it, reading no more than the file
    finally:
        file.seek(0)
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"checkpoint {path}: entry {entry.filename!r} is compressed "
                                  f"({entry.compress_size:,} bytes that expand to {entry.file_size:,}); torch.save "
                                  f"stores every entry uncompressed, so this file was not written by mpper")  # fmt: skip
    stored = sum(entry.file_size for entry in entries)
    if stored > size:
        raise CheckpointError(f"checkpoint {path}: its zip directory claims {stored:,} bytes of entries in a file "
                              f"of {size:,}: corrupt")  # fmt: skip


def load_checkpoint(path: str | os.PathLike, max_bytes: int | None = None, follow_links: bool = False) -> dict:
    """Read a checkpoint written by ``save_checkpoint`` (tensors on the CPU).

    ``torch.load(weights_only=True)``: a file holding any other pickled object is
    refused without running its code. The file is opened only as a regular file
    (:func:`mpper.safe_files.open_received`: a FIFO, device or socket is refused unread,
    and so is a symbolic link unless ``follow_links``, for a file the user named). Then
    the size checks of ``_check_size``: no compressed entry, and with ``max_bytes``
    (:func:`checkpoint_budget` of the network it will be loaded into) no file larger
    than that. Raises FileNotFoundError or CheckpointError, naming the file.
    """
    path = Path(path)
    ceiling = _MAX_CHECKPOINT_BYTES if max_bytes is None else 1 << 62  # max_bytes: checked below, in its words
    try:
        file = open_received(path, ceiling, follow_links=follow_links)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path}: no such file") from None
    except ReceivedFileError as exc:
        raise CheckpointError(f"checkpoint {exc}") from None
    with file:
        _check_size(path, file, max_bytes)
        state = _torch_load(path, file)
    if not isinstance(state, dict) or "network" not in state:
        raise CheckpointError(f"checkpoint {path}: not an mpper checkpoint (no 'network' entry)")
    return state


def _torch_load(path: Path, file) -> dict:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError (bad zip), EOFError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path}: cannot be loaded with torch.load(weights_only=True): {first}"
        ) from exc


def load_network_weights(network: torch.nn.Module, weights: Mapping, path: str | os.PathLike,
                         entry: str = "network") -> torch.nn.Module:  # fmt: skip
    """Load ``weights`` (the ``entry`` state dict of checkpoint ``path``) into ``network``
    after checking that they fit it; CheckpointError, one line naming the first tensor
    that is missing, extra or of another shape (with both shapes), when they do not: a
    checkpoint written for another config (network sizes, env, algorithm)."""
    wanted = network.state_dict()
    where = f"checkpoint {path}: '{entry}'"
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{where} is not a state dict of tensors")
    for name, tensor in wanted.items():
        if name not in weights:
            raise CheckpointError(f"{where} has no tensor {name!r} (shape {tuple(tensor.shape)} in the network of "
                                  f"this config): written for another config")  # fmt: skip
        stored = weights[name]
        if not isinstance(stored, torch.Tensor):
            raise CheckpointError(f"{where}: {name!r} is a {type(stored).__name__}, not a tensor")
        if tuple(stored.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(stored.shape)}, the network of this "
                                  f"config has {tuple(tensor.shape)}: written for another config")  # fmt: skip
    extra = [name for name in weights if name not in wanted]
    if extra:
        shape = tuple(getattr(weights[extra[0]], "shape", ()))
        raise CheckpointError(f"{where} has tensor {extra[0]!r} (shape {shape}), which the network of this config "
                              f"does not: written for another config")  # fmt: skip
    network.load_state_dict(weights)
    return network
