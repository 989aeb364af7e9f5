"""A child process main for the fault tests (importable by a spawned child: pytest puts
this directory on ``sys.path``): mpper's child frame around more reports than a pipe
holds, then a wait for the stop signal."""

from __future__ import annotations

from types import SimpleNamespace

from mpper.runtime.procs import child_process


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
