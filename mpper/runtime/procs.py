"""What every mpper child process shares: how it starts and how it learns to stop."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..replay.buffer import ReplayBuffer
from .weights import WeightStore

__all__ = ["ForcedStop", "StopRequests", "StopSignal", "child_init", "child_process", "configure_torch", "forkserver_pid",
           "process_context", "report_error", "start_process_server", "stop_process_server", "torch_configured"]


# What every child needs anyway; the forkserver loads it once for all of them.
_PRELOAD = ["mpper.runtime.preload"]


def process_context():
    """The multiprocessing context children start from: ``forkserver`` with torch, numba
    and mpper preloaded (``mpper.runtime.preload``), else ``spawn``.

    A spawned child imports torch, numba and mpper before it does anything, which costs
    it CPU seconds; on a few cores, a run's ten or so children would start one after
    another for that long. The forkserver is a fresh interpreter (not a fork of the
    supervisor, so no threads, locks or CUDA state are inherited) that imports those
    modules once; each child is a fork of it and starts in milliseconds. The server
    exits when the supervisor's process does.
    """
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_process_server() -> None:
    """Start the forkserver of :func:`process_context` now rather than at the first child.

    ``run.py`` calls it once the config has been checked and before it imports torch for
    itself, so the server's imports run beside the supervisor's on another core instead
    of after them (``python bench/startup.py`` times a run's start). Without this call the
    server starts with the first child; calling it twice is harmless (``ensure_running``
    keeps one server per process).
    """
    if process_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def stop_process_server() -> None:
    """Stop the forkserver :func:`start_process_server` booted, at once, for a run refused
    before it started any child (the server would otherwise finish its imports first,
    several CPU seconds, before it noticed). Nothing to do when none was booted."""
    from multiprocessing import forkserver

    pid = forkserver_pid()
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)  # it holds no child and no shared state yet
    except ProcessLookupError:
        pass
    forkserver._forkserver._stop()  # type: ignore[attr-defined]  # reaps it, closes its pipe, removes its socket (no public API)


def forkserver_pid() -> int | None:
    """The pid of this process's forkserver, if it started one."""
    from multiprocessing import forkserver

    # multiprocessing keeps it on its private singleton; there is no public accessor
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


class ForcedStop(BaseException):
    """Raised by :class:`StopRequests` for the Ctrl-C that overrides a clean stop."""


class StopRequests:
    """How a run's own process answers Ctrl-C (SIGINT) and SIGTERM, from the moment the
    run starts until it returns (a context manager; main thread only, elsewhere it does
    nothing).

    The first signal asks the run to stop: ``KeyboardInterrupt`` (Ctrl-C) or
    ``SystemExit(143)`` (SIGTERM) unwinds what the run was doing into its shutdown. From
    then on, and from :meth:`begin_shutdown` on when the run ends by itself, a signal is
    acknowledged with one line and not obeyed, so that the final checkpoint and snapshot
    get written; the next one after that asks for :class:`ForcedStop`, which the shutdown
    catches to quit at once, saying what is lost.

    Where the exception is raised is the point: only at :meth:`check` (the run loop calls
    it every turn) or inside an :meth:`obeying` block (a wait on mpper's own terms: a
    join, the snapshot's write, an evaluation). A signal that lands anywhere else only
    records its exception for the next of those. An exception raised at an arbitrary
    bytecode can break the library code it lands in for good: in ``queue.Queue.put``,
    between ``Condition.notify`` waking a waiter and removing it (CPython gh-92530), it
    leaves a stale waiter that eats the next wake-up, and TensorBoard's writer thread then
    sleeps through the ``close`` its owner waits on (up to its 120-s flush period); landed
    between the ``except KeyboardInterrupt`` and the ``try`` of the shutdown, a
    ``ForcedStop`` would skip the shutdown altogether and leave the process waiting for
    children nobody stopped. Messages go out with ``os.write``: a handler that
    ``print``-ed while the interrupted code was printing would fail (buffered streams
    are not reentrant).
    """

    def __init__(self) -> None:
        self.stopping = False  # a stop was asked, or the run is ending by itself
        self.forced = False  # the Ctrl-C that quits at once came
        self._during_shutdown = 0  # signals after the first
        self._pending: BaseException | None = None  # asked for, not raised yet
        self._obeying = False
        self._previous: dict[int, Any] = {}  # signal.signal's previous handlers

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def check(self) -> None:
        """Raise the exception a signal asked for, if one is waiting (once)."""
        exc, self._pending = self._pending, None
        if exc is not None:
            raise exc

    @contextmanager
    def obeying(self):
        """A block in which a signal raises its exception at once (and a waiting one
        on entry). Not nestable; only around code that an exception can leave at any
        point without harm."""
        assert not self._obeying, "obeying() blocks do not nest"
        try:
            self._obeying = True
            self.check()
            yield
        finally:
            self._obeying = False

    def begin_shutdown(self) -> None:
        """From now on a signal is acknowledged, not obeyed (the run is stopping); a stop
        asked for and not raised yet is moot, a forced one still is."""
        self.stopping = True
        if not isinstance(self._pending, ForcedStop):
            self._pending = None

    def _handle(self, signum, frame) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.forced:
            return
        if not self.stopping:
            self.stopping = True
            _say(f"mpper: {name}: stopping; the final checkpoint and buffer snapshot are being written "
                 f"(press Ctrl-C twice more to quit at once without them)")  # fmt: skip
            exc: BaseException = KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
        else:
            self._during_shutdown += 1
            if self._during_shutdown == 1:
                _say(f"mpper: {name}: still stopping: writing the final checkpoint and buffer snapshot "
                     f"(once more quits at once without them)")  # fmt: skip
                return
            self.forced = True
            _say(f"mpper: {name}: quitting at once; the final checkpoint and buffer snapshot are lost "
                 f"(the previous ones, if any, are whole)")  # fmt: skip
            exc = ForcedStop()
        if self._obeying:
            self._obeying = False  # raised once: the rest of the block is being left
            raise exc
        self._pending = exc


def _say(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class StopSignal:
    """A flag the supervisor sets to stop the run, that also reads as set when the
    supervisor itself is gone (killed), so that no child outlives a dead run.

    Children use it like an event: ``stop.is_set()``, ``stop.wait(timeout)``. It is a
    plain shared byte, not a ``multiprocessing.Event``: an Event's ``set`` waits for
    every sleeping waiter to wake up, so one child killed while waiting would hang the
    supervisor's ``set`` for ever.

    The supervisor's death is seen through a pipe whose write end only the supervisor
    holds (it is never sent to a child): when the supervisor dies, the kernel closes it
    and the children's read ends report end-of-file. (The parent pid cannot tell: a
    forkserver child's parent is the forkserver, which outlives the supervisor while
    any of its children lives.)
    """

    _SLICE_S = 0.02  # how often a waiting child looks at the flag

    def __init__(self, ctx) -> None:
        self.flag = ctx.RawValue(ctypes.c_bool, False)
        self._alive, self._alive_writer = ctx.Pipe(duplex=False)  # nothing is ever written

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_alive_writer"]  # only the supervisor may hold it
        return state

    def set(self) -> None:
        self.flag.value = True

    def is_set(self) -> bool:
        return self.flag.value or self.supervisor_gone()

    def supervisor_gone(self) -> bool:
        """Whether the supervisor's process has ended (nobody reads the reports any more)."""
        return self._alive.poll()  # end-of-file once the supervisor is gone

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, or less if the run stops; returns is_set()."""
        deadline = time.monotonic() + timeout
        while not self.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(remaining, self._SLICE_S))
        return True


def configure_torch(torch_threads: int, flush_denormal: bool = True) -> None:
    """How a process that runs networks sets torch up: ``torch_threads`` threads, and with
    ``flush_denormal`` denormal floats flushed to zero. Weights that weight decay drives
    towards zero (a projection head's dead units, say) become denormal, and CPU
    arithmetic on denormals is many times slower: a learner would slow down as it trains.
    Flushed, such a value is 0, a change below float32's smallest normal number. The flag
    is the calling thread's floating-point state (``torch.set_flush_denormal(False)`` puts
    back the default)."""
    import torch

    torch.set_num_threads(max(1, int(torch_threads)))
    if flush_denormal:
        torch.set_flush_denormal(True)


@contextmanager
def torch_configured(torch_threads: int) -> Iterator[None]:
    """``configure_torch`` in the calling process for the length of what runs networks
    there: a serial run (``--workers 0``), ``--evaluate``, ``--collect``, an agent's
    ``act``, any of them in a test's or a user's process. After it, the caller's torch
    thread count is put back, and torch's default of computing denormals.

    Why a run's thread count and not torch's default (one per core): a search calls the
    network many times on a few rows. Every call then pays for a parallel region whose
    threads wait on each other, and on a busy machine a thread that lost its core holds
    the others until the scheduler gives it back."""
    import torch

    threads = torch.get_num_threads()
    configure_torch(torch_threads)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def child_init(torch_threads: int, own_process: bool | None = None) -> None:
    """First call in every process entry point: torch set up (``configure_torch``), and in
    a child process Ctrl-C is ignored, because the supervisor stops everyone in order
    through the stop signal (a learner killed by the terminal's SIGINT would skip its
    final checkpoint). ``own_process``: this is a process of mpper's own (default: a
    multiprocessing child; a Ray actor says so), whose floating-point state it may set;
    called in-process (tests), the caller's floating-point state and signals are left
    alone."""
    import multiprocessing

    child = multiprocessing.parent_process() is not None
    if child:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_torch(torch_threads, flush_denormal=child if own_process is None else own_process)


def report_error(reports, name: str) -> None:
    """Send the current exception's traceback to the supervisor (best effort)."""
    try:
        reports.put(("error", name, {"traceback": traceback.format_exc()}))
    except Exception:
        pass


@contextmanager
def child_process(name: str, config, reports, stop, buffer_handle=None, weight_handle=None):
    """The frame of every child process's main (learner, self-play worker, reanalyser,
    evaluator): :func:`child_init`, then the shared buffer and weight store attached
    (those whose handles are given), yielded as ``(buffer or None, store or None)``;
    an exception is reported to the supervisor as ``("error", name, {"traceback"})``
    and re-raised; both are closed (never unlinked: the supervisor owns them) on
    the way out, however it goes. ``stop`` is the run's :class:`StopSignal` (or any
    event, for a child that a test or benchmark drives).

    A child whose supervisor is gone drops the reports it has not sent yet: at exit,
    multiprocessing waits until a queue's buffered items are written to its pipe, and
    with nobody left to read a full pipe, that wait would never end (every other child
    holds the pipe's read end, so writing never fails either)."""
    child_init(config.runtime.torch_threads)
    buf = store = None
    try:
        buf = ReplayBuffer.attach(buffer_handle) if buffer_handle is not None else None
        store = WeightStore.attach(weight_handle) if weight_handle is not None else None
        yield buf, store
    except BaseException:
        report_error(reports, name)
        raise
    finally:
        for obj in (store, buf):
            if obj is not None:
                obj.close()
        supervisor_gone = getattr(stop, "supervisor_gone", None)
        if supervisor_gone is not None and supervisor_gone():
            reports.cancel_join_thread()
