"""Child process mains for the fault tests (importable by a spawned child: pytest puts
this directory on ``sys.path``)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from mpper import ReplayBuffer
from mpper.runtime.procs import child_process


def hold_the_buffer_lock_and_exit(handle) -> None:
    """Attach the buffer, take its lock, and exit without releasing it (a process that
    dies inside a critical section)."""
    buf = ReplayBuffer.attach(handle)
    buf._locked.lock.acquire()  # noqa: SLF001
    os._exit(0)


def hold_the_buffer_lock_until(handle, holding, release) -> None:
    """Attach the buffer, take its lock, set ``holding``, and keep the lock (alive) until
    ``release`` is set: a live holder, stuck."""
    buf = ReplayBuffer.attach(handle)
    buf._locked.lock.acquire()  # noqa: SLF001
    holding.set()
    release.wait(600)
    buf._locked.lock.release()  # noqa: SLF001
    buf.close()


def report_then_wait(reports, stop, queued, count: int) -> None:
    """Queue ``count`` reports of ~1 KB (the pipe holds 64 KiB: the rest waits in the
    queue's feeder thread), set ``queued``, and return once ``stop`` is set."""
    config = SimpleNamespace(runtime=SimpleNamespace(torch_threads=1))
    with child_process("worker-0", config, reports, stop):
        for i in range(count):
            reports.put(("episode", "worker-0", {"return": float(i), "pad": "x" * 1000}))
        queued.set()
        while not stop.wait(0.05):
            pass


def write_tagged_episodes(handle, ready, stop, tag: int) -> None:
    """Attach the buffer and add episodes until ``stop`` is set; episode k of this writer
    holds ``observation[:, 0] = tag * 1e6 + k`` and ``observation[:, 1] = row index``, so
    that a reader can tell a whole episode from a torn one. Sets ``ready`` after the first."""
    import numpy as np

    buf = ReplayBuffer.attach(handle)
    rng = np.random.default_rng(tag)
    k = 0
    while not stop.is_set():
        rows = int(rng.integers(2, 12))
        obs = np.zeros((rows, 4), np.float32)
        obs[:, 0], obs[:, 1] = tag * 1e6 + k, np.arange(rows)
        buf.add_episode({"observation": obs}, priorities=rng.random(rows - 1) + 0.1)
        k += 1
        ready.set()
    buf.close()


def wait_for_inference(handle, slot: int) -> None:
    """A self-play worker's request through inference slot ``slot``: one initial inference
    on zeros, then waiting for the answer (the test kills this process meanwhile)."""
    import torch

    from mpper.runtime.inference import InferenceSlots, ServedNetwork

    class Never:
        def is_set(self) -> bool:
            return False

    slots = InferenceSlots.attach(handle)
    ServedNetwork(slots, slot, Never()).initial_inference(torch.zeros((1, *handle.observation_shape)))
