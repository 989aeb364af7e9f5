"""MuZero's training step with static shapes, for a learner at the GPU's speed.

The eager step (``MuZeroTrainer.train_step``) reads the losses and the priorities back to
the host before the optimizer step, to refuse a non-finite update: one synchronisation
per step, and thousands of small kernels launched one by one from Python. The static
step runs the same arithmetic (``MuZeroTrainer.losses``, ``Trainer.backward``, the
optimizer) on persistent device tensors, so that it can run as:

- ``"cuda_graph"``: captured once with ``torch.cuda.graph`` and replayed (one launch per
  step); the optimizer is fused and capturable, its learning rate a device tensor;
- ``"compile"``: the forward half (and with it the backward) through
  ``torch.compile(mode="reduce-overhead")``, the optimizer step eager and fused;
- ``"static"``: eagerly, the same code and the same bookkeeping (and the CPU's form).

Nothing in a step waits for the device. A non-finite update is refused on the device:
a sticky flag, set by the first update whose losses, gradient norm or priorities are not
finite, is the fused optimizer's ``found_inf``, so that update and every later one leave
the weights and the optimizer's state as they were; the host sees the flag one step late
and raises ``FloatingPointError`` then (the weights are those before the bad update).

Each step's readout (``Losses.readout`` and the flag) is copied into page-locked host
memory behind the step and consumed one step later: :meth:`StaticStep.submit` returns the
previous update's metrics and priorities with its batch. On CUDA a batch goes numpy ->
a page-locked buffer -> a device staging buffer on a side stream (the copy overlaps the
update before it), two of each in turn, then device -> the step's persistent inputs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from ...replay.buffer import Batch
from ..base import Finished

__all__ = ["STATIC_MODES", "StaticStep", "static_mode"]

STATIC_MODES = ("static", "cuda_graph", "compile")
WARMUP_STEPS = 3  # eager runs on a side stream before a capture: lazy initialisations happen outside the graph


def static_mode(capture: str, device: torch.device) -> str | None:
    """``training.capture`` on ``device`` -> the static step's mode, or None for the eager
    step: "auto" is "cuda_graph" on CUDA and the eager step elsewhere. A mode that needs
    CUDA on another device is a ValueError (one line)."""
    if capture == "auto":
        return "cuda_graph" if device.type == "cuda" else None
    if capture == "off":
        return None
    if capture not in STATIC_MODES:
        raise ValueError(f'training.capture: expected one of "auto", "off", {", ".join(map(repr, STATIC_MODES))}, '
                         f"got {capture!r}")  # fmt: skip
    if capture in ("cuda_graph", "compile") and device.type != "cuda":
        raise ValueError(f'training.capture: "{capture}" runs on CUDA, the learner is on {device.type}')
    return capture


@dataclasses.dataclass
class _Pending:
    batch: Batch
    step: int  # completed updates after it
    lr: float
    host: torch.Tensor  # where its readout lands (page-locked on CUDA)
    ready: torch.cuda.Event | None  # recorded after the copy into ``host`` (CUDA)
    actions_shape: tuple[int, ...]


class _Inputs:
    """The step's persistent input tensors on the device, one per batch array, and the
    way a new batch gets into them (see the module docstring)."""

    def __init__(self, arrays: dict[str, np.ndarray], device: torch.device) -> None:
        self.device = device
        self.shapes = {k: (v.shape, v.dtype) for k, v in arrays.items()}
        self.tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device).clone() for k, v in arrays.items()}
        self.cuda = device.type == "cuda"
        self.slot = 0
        if self.cuda:
            self.pinned = [{k: torch.empty_like(t, device="cpu").pin_memory() for k, t in self.tensors.items()}
                           for _ in range(2)]  # fmt: skip
            self.staging = [{k: torch.empty_like(t) for k, t in self.tensors.items()} for _ in range(2)]
            self.copy_stream = torch.cuda.Stream(device)
            self.copied: list[torch.cuda.Event | None] = [None, None]  # host -> staging[slot] done
            self.consumed: list[torch.cuda.Event | None] = [None, None]  # staging[slot] -> tensors done

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Put ``arrays`` (the same keys, shapes and dtypes as the first batch's) into the
        persistent tensors, ordered before whatever the current stream runs next."""
        shapes = {k: (v.shape, v.dtype) for k, v in arrays.items()}
        if shapes != self.shapes:
            changed = sorted(k for k in set(shapes) | set(self.shapes) if shapes.get(k) != self.shapes.get(k))
            raise ValueError(f"the static training step needs batches of one shape; {', '.join(changed)} changed")
        if not self.cuda:
            for k, v in arrays.items():
                self.tensors[k].copy_(torch.from_numpy(np.ascontiguousarray(v)))
            return
        slot = self.slot
        self.slot ^= 1
        copied = self.copied[slot]
        if copied is not None:
            copied.synchronize()  # the last copy out of this page-locked buffer (two steps ago) is done
        pinned, staging = self.pinned[slot], self.staging[slot]
        for k, v in arrays.items():
            pinned[k].copy_(torch.from_numpy(np.ascontiguousarray(v)))
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            consumed = self.consumed[slot]
            if consumed is not None:
                self.copy_stream.wait_event(consumed)
            for k in arrays:
                staging[k].copy_(pinned[k], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self.copied[slot] = done
        main.wait_event(done)
        for k in arrays:
            self.tensors[k].copy_(staging[k])
        consumed = torch.cuda.Event()
        consumed.record(main)
        self.consumed[slot] = consumed


class StaticStep:
    """The static-shape step of one ``MuZeroTrainer`` (see the module docstring):
    ``submit(batch)`` starts an update and returns the updates that finished since (the
    previous one); ``drain()`` waits for the last one. ``capture_seconds``: the one-off
    cost of the capture (warm-up included) or of the first compiled step, once paid."""

    def __init__(self, trainer: Any, mode: str, precision: str, fall_back: bool = False) -> None:
        # trainer: the MuZeroTrainer that owns this step (its losses, backward, optimizer);
        # fall_back: a capture that fails goes on uncaptured (training.capture "auto")
        if mode not in STATIC_MODES:
            raise ValueError(f"unknown static step mode {mode!r}")
        self.trainer, self.mode, self.fall_back = trainer, mode, fall_back
        self.device = trainer.device
        self.cuda = self.device.type == "cuda"
        self.autocast = torch.bfloat16 if precision == "bf16" else None
        if self.autocast is not None and not self.cuda:
            raise ValueError('training.precision: "bf16" runs on CUDA, the learner is on ' + self.device.type)
        # conv nets on CUDA: NHWC weights and inputs (tensor cores' layout)
        self.channels_last = self.cuda and any(isinstance(m, torch.nn.Conv2d) for m in trainer.network.modules())
        if self.channels_last:
            cast(Any, trainer.network).to(memory_format=torch.channels_last)
        self.lr = torch.tensor(trainer.train_config.lr_init, dtype=torch.float32, device=self.device) if self.cuda \
            else None  # fmt: skip
        self.diverged = torch.zeros((), dtype=torch.float32, device=self.device)  # sticky: 1 after a bad update
        self.inputs: _Inputs | None = None
        self.out: torch.Tensor | None = None  # the readout and the flag, on the device
        self.host_out: list[torch.Tensor] = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled: Callable[[dict[str, torch.Tensor]], Any] | None = None
        self.pending: _Pending | None = None
        self.capture_seconds: float | None = None
        self.steps = 0

    def make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The trainer's optimizer in its fused form (whose kernel takes ``found_inf``),
        capturable with a device-tensor learning rate on CUDA."""
        t = self.trainer.train_config
        lr = self.lr if self.lr is not None else t.lr_init
        if t.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=t.weight_decay, fused=True, capturable=self.cuda)
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay, fused=True)
        raise ValueError(f'training.optimizer must be "adam" or "sgd", got {t.optimizer!r}')

    def group_overrides(self) -> dict:
        """What a loaded optimizer state's param groups take from this step, not from the file."""
        overrides: dict = {"fused": True}
        if self.trainer.train_config.optimizer == "adam":
            overrides["capturable"] = self.cuda
        return overrides

    def reset(self) -> None:
        """Forget the captured graph (the optimizer's state tensors were replaced: a loaded
        checkpoint); the next update captures again."""
        self.graph = None

    # ---- one update -------------------------------------------------------------------------
    def _body(self) -> None:
        """One whole update on the persistent inputs, with no host synchronisation: what
        the graph holds."""
        trainer, inputs = self.trainer, self.inputs
        assert inputs is not None and self.out is not None
        if self.compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
            losses = self.compiled(inputs.tensors)
        else:
            losses = trainer.losses(inputs.tensors, self.autocast, self.channels_last)
        grad_norm = trainer.backward(losses.loss)
        with torch.no_grad():
            readout = losses.readout(grad_norm)
            bad = (~torch.isfinite(readout).all()).to(self.diverged.dtype)
            torch.maximum(self.diverged, bad, out=self.diverged)
        trainer.optimizer.found_inf = self.diverged  # the fused kernel skips the update where it is 1
        trainer.optimizer.step()
        with torch.no_grad():
            self.out[:-1].copy_(readout)
            self.out[-1].copy_(self.diverged)

    def _first_batch(self, arrays: dict[str, np.ndarray]) -> None:
        self.inputs = _Inputs(arrays, self.device)
        batch_size, k1 = arrays["actions"].shape
        priorities = batch_size * k1 if self.trainer.config.muzero.priority_update == "unrolled" else batch_size
        self.out = torch.zeros(6 + priorities + 1, dtype=torch.float32, device=self.device)
        if self.cuda:
            self.host_out = [torch.empty(self.out.shape, dtype=torch.float32).pin_memory() for _ in range(2)]
        if self.mode == "compile":
            trainer = self.trainer

            def forward(tensors: dict[str, torch.Tensor]):
                return trainer.losses(tensors, self.autocast, self.channels_last)

            # the inputs' addresses never change: no copy into the graphs' own inputs per step
            for tensor in self.inputs.tensors.values():
                torch._dynamo.mark_static_address(tensor)
            self.compiled = torch.compile(forward, mode="reduce-overhead", dynamic=False)

    def _capture(self) -> None:
        """Warm up on a side stream (lazy state: the optimizer's moments, cuDNN's plans,
        autograd's), put back every weight, buffer and optimizer state the warm-up
        touched, then capture one update."""
        trainer = self.trainer
        started = time.perf_counter()
        params = list(trainer.network.parameters())
        saved_tensors = [t.detach().clone() for t in [*params, *trainer.network.buffers()]]
        saved_state = {id(p): {k: v.clone() for k, v in trainer.optimizer.state[p].items() if torch.is_tensor(v)}
                       for p in params if p in trainer.optimizer.state}  # fmt: skip
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self._body()
        finally:
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._put_back(params, saved_tensors, saved_state)
        trainer.optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._body()
        torch.cuda.synchronize(self.device)
        self.graph = graph
        self.capture_seconds = time.perf_counter() - started

    def _put_back(self, params: list, saved_tensors: list[torch.Tensor], saved_state: dict) -> None:
        """The weights, buffers and optimizer state as they were before the warm-up."""
        trainer = self.trainer
        with torch.no_grad():
            for tensor, saved in zip([*params, *trainer.network.buffers()], saved_tensors, strict=True):
                tensor.copy_(saved)
            for p in params:
                for name, value in trainer.optimizer.state.get(p, {}).items():
                    if not torch.is_tensor(value):
                        continue
                    before = saved_state.get(id(p), {}).get(name)
                    # a state the warm-up created starts from zero, as a fresh one (Adam's
                    # moments and step; SGD's momentum, whose first update is then the gradient)
                    value.copy_(before) if before is not None else value.zero_()
            self.diverged.zero_()

    def _capture_or_fall_back(self) -> None:
        """Capture; where that fails and the mode came from ``training.capture: "auto"``,
        say so in one line on stderr and go on with the same step uncaptured ("static")."""
        try:
            self._capture()
        except Exception as exc:
            if not self.fall_back:
                raise
            reason = (str(exc).strip().splitlines() or [""])[0]
            print(f"mpper: learner: the training step could not be captured as a CUDA graph "
                  f"({type(exc).__name__}: {reason}); it runs uncaptured, as with training.capture "
                  '"static"', file=sys.stderr, flush=True)  # fmt: skip
            self.mode, self.graph = "static", None

    def submit(self, batch: Batch) -> list[Finished]:
        """Start the next update on ``batch``; returns the previous update, finished (none
        after the first). Raises FloatingPointError when the previous update was not
        finite: the weights and the optimizer's state are then those before it, and the
        trainer's step counter counts the updates before it."""
        trainer = self.trainer
        arrays = {**batch.data, "weights": batch.weights}
        lr = trainer.learning_rate()
        if self.lr is not None:
            for group in trainer.optimizer.param_groups:
                group["lr"] = self.lr
            self.lr.fill_(lr)
        else:
            for group in trainer.optimizer.param_groups:
                group["lr"] = lr
        first = self.inputs is None
        if first:
            self._first_batch(arrays)
        assert self.inputs is not None and self.out is not None
        self.inputs.load(arrays)
        if self.mode == "cuda_graph" and self.graph is None:
            self._capture_or_fall_back()
        if self.mode == "cuda_graph":
            assert self.graph is not None
            self.graph.replay()
        else:
            started = time.perf_counter()
            self._body()
            if first and self.mode == "compile":
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                self.capture_seconds = time.perf_counter() - started
        trainer.training_step += 1
        self.steps += 1
        if self.cuda:
            host = self.host_out[self.steps % 2]
            host.copy_(self.out, non_blocking=True)
            ready: torch.cuda.Event | None = torch.cuda.Event()
            assert ready is not None
            ready.record()
        else:
            host, ready = self.out.clone(), None
        previous = self.pending
        self.pending = _Pending(batch, trainer.training_step, lr, host, ready, tuple(arrays["actions"].shape))
        return self._finish(previous) if previous is not None else []

    def drain(self) -> list[Finished]:
        """Wait for the last update started and return it (none if all were returned)."""
        pending, self.pending = self.pending, None
        return self._finish(pending) if pending is not None else []

    def _finish(self, pending: _Pending) -> list[Finished]:
        if pending.ready is not None:
            pending.ready.synchronize()
        host = pending.host.numpy().astype(np.float64)
        if host[-1] != 0:
            # This update (the first bad one) and any started after it changed nothing.
            self.pending = None
            self.trainer.training_step = pending.step - 1
            self.diverged.zero_()
            self.trainer.read_update(host[:-1], pending.lr, pending.step, pending.actions_shape)  # raises
            raise FloatingPointError(f"non-finite update at training step {pending.step - 1}")
        metrics, priorities = self.trainer.read_update(host[:-1], pending.lr, pending.step, pending.actions_shape)
        return [Finished(pending.batch, metrics, priorities)]
