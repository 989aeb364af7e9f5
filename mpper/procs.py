"""What every mpper child process shares: how it starts and how it learns to stop."""

from __future__ import annotations

import os
import signal
import traceback

__all__ = ["StopSignal", "child_init", "report_error"]


class StopSignal:
    """An ``Event`` the supervisor sets to stop the run, that also reads as set when the
    supervisor itself is gone (killed), so that no child outlives a dead run.

    Children use it like the event: ``stop.is_set()``, ``stop.wait(timeout)``.
    """

    def __init__(self, event) -> None:
        self.event = event
        self.parent_pid = os.getpid()  # taken in the supervisor, where it is created

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set() or os.getppid() != self.parent_pid

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds (in slices, to notice a dead parent)."""
        remaining = timeout
        while remaining > 0:
            if self.event.wait(min(remaining, 0.5)) or os.getppid() != self.parent_pid:
                return True
            remaining -= 0.5
        return self.is_set()


def child_init(torch_threads: int) -> None:
    """First call in every child: Ctrl-C goes to the supervisor only (which stops
    everyone in order), and torch gets its share of the cores."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(max(1, int(torch_threads)))


def report_error(reports, name: str) -> None:
    """Send the current exception's traceback to the supervisor (best effort)."""
    try:
        reports.put(("error", name, {"traceback": traceback.format_exc()}))
    except Exception:
        pass
