"""The reanalyser process: :class:`~mpper.algos.muzero.reanalyse.Reanalyser` (or any
algorithm's ``make_reanalyser``) run until the stop signal, one batch per published
weight version."""

from __future__ import annotations

import time

from ..algos.registry import algorithm_of
from .procs import child_process

__all__ = ["run_reanalyser"]

NAME = "reanalyser"
_REPORT_INTERVAL_S = 1.0


def run_reanalyser(config, buffer_handle, weight_handle, stop, reports) -> None:
    """Child-process entry: reanalyse until ``stop`` is set.

    Args:
        config: the run's :class:`~mpper.config.Config`.
        buffer_handle: :class:`~mpper.BufferHandle` of the replay buffer.
        weight_handle: :class:`~mpper.runtime.weights.WeightHandle` of the weight store.
        stop: an event-like object (``is_set()``, ``wait(timeout)``), e.g.
            :class:`~mpper.runtime.procs.StopSignal`.
        reports: a queue; gets ``("reanalyse", "reanalyser", {**stats(), "episodes_per_s"})``
            (MuZero's: episodes, dropped, weights_version, searched_episodes,
            positions_searched) about once a second (and once at exit), or
            ``("error", "reanalyser", {"traceback"})`` before an exception is re-raised.
    """
    with child_process(NAME, config, reports, stop, buffer_handle, weight_handle) as (buf, store):
        worker = algorithm_of(config).make_reanalyser(config, buf, store)
        while store.version < 1:  # nothing published yet
            if stop.wait(0.1):
                return
        last_time, last_count = time.monotonic(), 0

        def report(now: float) -> None:
            stats = worker.stats()
            rate = (stats["episodes"] - last_count) / max(now - last_time, 1e-9)
            reports.put(("reanalyse", NAME, {**stats, "episodes_per_s": rate}))

        fresh = True
        while not stop.is_set():
            fresh = worker.refresh_weights() or fresh
            if not fresh:
                # One batch per published weight version: muzero-general reanalyses
                # flat out, which on a few cores takes the CPU self-play needs, and
                # values from the same weights would come out the same again.
                stop.wait(0.02)
            else:
                stored, dropped = worker.step()
                fresh = stored == 0 and dropped == 0  # empty buffer: try again soon
                if fresh:
                    stop.wait(0.1)
            now = time.monotonic()
            if now - last_time >= _REPORT_INTERVAL_S:
                report(now)
                last_time, last_count = now, worker.stats()["episodes"]
        report(time.monotonic())
