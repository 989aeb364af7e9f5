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
