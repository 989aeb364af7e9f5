"""Checkpoints: ``checkpoint.pt``: ``save_checkpoint`` (a trainer's state) / ``save_network_checkpoint``
  (a network alone: the evaluator's ``best.pt``) / ``load_checkpoint``, which reads with
  ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts only, a
  file holding any other pickled object is refused without running its code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from .atomic import write_atomic


class _HasState(Protocol):
    """A trainer (``mpper.algos.base.Trainer``): what a checkpoint saves of it."""

    def state_dict(self) -> dict: ...

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointError",
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


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a checkpoint written by ``save_checkpoint`` (tensors on the CPU).

    ``torch.load(weights_only=True)``: a file holding any other pickled object is
    refused without running its code. Raises FileNotFoundError or CheckpointError,
    naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError (bad zip), EOFError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path}: cannot be loaded with torch.load(weights_only=True): {first}"
        ) from exc
    if not isinstance(state, dict) or "network" not in state:
        raise CheckpointError(f"checkpoint {path}: not an mpper checkpoint (no 'network' entry)")
    return state


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
