"""Samples-per-insert rate control between self-play (inserts) and the learner (samples).

This is Reverb's ``SampleToInsertRatio`` rate limiter (and muzero-general's ``ratio``)
for mpper's processes. Let ``I`` be the number of positions inserted into the replay
buffer so far (``counters["steps"]``), ``S`` the number of positions sampled so far
(``counters["samples"]``, ``batch_size`` per learner batch), ``r`` the target
``samples_per_insert``, ``tol`` the relative tolerance and ``B`` the batch size:

- **Sampling** (the learner, before each batch) waits while ``I < min_size`` (nothing is
  learned before the buffer holds ``min_size`` positions: Reverb's
  ``min_size_to_sample``) or while ``S + B > r * I * (1 + tol)``: taking the next batch
  would put the learner more than ``tol`` ahead of the ratio.
- **Inserting** (a self-play worker, before storing an episode) waits, once ``I >=
  min_size``, while ``r * I > (S + B) * (1 + tol)``: the actors are more than ``tol``
  ahead of the learner. Below ``min_size`` inserts never wait, so learning can start.

The observed ratio ``S / I`` therefore stays within about ``[r / (1 + tol), r * (1 +
tol)]`` (up to one batch and one episode of granularity). The slack of one batch ``B`` on
the insert side is what makes a deadlock impossible: both sides blocked at once would need
``S + B > r I (1 + tol) > (S + B) (1 + tol)^2``, which no ``tol >= 0`` allows. Reverb
uses an absolute error buffer around ``r * min_size`` instead of a relative tolerance;
the relative form keeps the same meaning at any buffer size.

``samples_per_insert=None`` turns the ratio off: inserts never wait and sampling waits
only for ``min_size`` (Reverb's ``MinSize`` limiter).

``insert_budget``: the inserts that will ever come (``training.env_steps`` when
``training.after_env_steps`` is "train": self-play ends there, the learner goes on). Once
``I`` reaches it, nothing the learner could wait for is coming, so sampling no longer
waits for the ratio.

Waiting blocks on a semaphore per side, a doorbell (no busy polling): after each
insert or sample the caller rings both with :meth:`RateLimiter.notify`, and a waiter
wakes to re-check the counters. Every wait also wakes up every ``poll_s`` seconds
(0.1 s) to re-check the counters and ``stop``, so a missed ring only delays. Why not a
``multiprocessing.Condition``: its ``notify`` waits until every sleeper acknowledges,
so a process killed while waiting (a crashed self-play worker, say) would block every
later ``notify`` for ever. A doorbell nobody answers costs nothing.

The limiter is created in the main process and passed to the children as a
``Process`` argument (the condition travels the way multiprocessing locks do). Progress
comes from callables the caller passes at each call, typically
``lambda: buf.counters["steps"]`` / ``lambda: buf.counters["samples"]`` on a shared
:class:`~mpper.ReplayBuffer`, so the limiter itself holds no counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["RateLimiter", "Wait"]

Count = int | float | Callable[[], int | float]


class Wait(NamedTuple):
    """What a ``wait_to_*`` call did: whether it had to wait, and for how long."""

    waited: bool
    seconds: float


_NO_WAIT = Wait(False, 0.0)


def can_sample(inserted: float, sampled: float, samples_per_insert: float | None, tolerance: float,
               min_size: int, batch_size: int, insert_budget: int | None = None) -> bool:  # fmt: skip
    """Whether the learner may take its next batch (the limiter's rule, without waiting)."""
    if inserted < min_size:
        return False
    if samples_per_insert is None or (insert_budget is not None and inserted >= insert_budget):
        return True
    return sampled + batch_size <= samples_per_insert * inserted * (1.0 + tolerance)


_MAX_RINGS = 4  # pending rings per doorbell: enough to wake the waiters of one side


def _value(x: Count) -> float:
    return x() if callable(x) else x


class RateLimiter:
    """Samples-per-insert rate limiter shared by processes (see the module docstring).

    Args:
        samples_per_insert: target sampled positions per inserted position ``r``; None
            turns the ratio off (sampling still waits for ``min_size``).
        tolerance: relative slack ``tol >= 0`` before a side waits.
        min_size: inserted positions before the first sample.
        batch_size: positions per sample call ``B`` (the learner's batch).
        ctx: multiprocessing context (``mp.get_context("spawn")``) to create the
            doorbells with; None: no doorbells, a wait polls every ``poll_s`` (for a
            process that multiprocessing did not start, such as a Ray actor).
        poll_s: longest sleep between two checks of the counters and of ``stop``.
        insert_budget: the inserts that will ever come; once reached, sampling no longer
            waits for the ratio. None: no end.
    """

    def __init__(self, samples_per_insert: float | None, tolerance: float, min_size: int, batch_size: int,
                 ctx, poll_s: float = 0.1, insert_budget: int | None = None) -> None:  # fmt: skip
        if samples_per_insert is not None and not samples_per_insert > 0:
            raise ValueError(f"samples_per_insert must be > 0 or None, got {samples_per_insert}")
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        if not min_size >= 0:
            raise ValueError(f"min_size must be >= 0, got {min_size}")
        if not batch_size >= 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.samples_per_insert = None if samples_per_insert is None else float(samples_per_insert)
        self.tolerance = float(tolerance)
        self.min_size = int(min_size)
        self.batch_size = int(batch_size)
        self.poll_s = float(poll_s)
        self.insert_budget = None if insert_budget is None else int(insert_budget)
        # one doorbell per side; a few pending rings at most (see notify). Without a
        # context (a process multiprocessing did not start, which could share no doorbell
        # with the others), a wait only polls.
        self._sample_bell = ctx.Semaphore(0) if ctx is not None else None
        self._insert_bell = ctx.Semaphore(0) if ctx is not None else None

    @classmethod
    def from_config(cls, training, ctx, poll_s: float = 0.1) -> RateLimiter:
        """From a :class:`~mpper.config.TrainingConfig` (``samples_per_insert`` or
        ``replay_ratio``, ``samples_per_insert_tolerance``, ``min_buffer_steps``,
        ``batch_size``; ``env_steps`` as the insert budget when ``after_env_steps`` is "train")."""
        budget = training.env_steps if training.after_env_steps == "train" else None
        return cls(training.paced_samples_per_insert, training.samples_per_insert_tolerance,
                   training.min_buffer_steps, training.batch_size, ctx, poll_s, budget)  # fmt: skip

    @property
    def enabled(self) -> bool:
        """Whether a samples-per-insert ratio is enforced (not only ``min_size``)."""
        return self.samples_per_insert is not None

    # ---- decisions (pure) --------------------------------------------------------------
    def can_sample(self, inserted: float, sampled: float) -> bool:
        """Whether the learner may take the next batch now."""
        return can_sample(inserted, sampled, self.samples_per_insert, self.tolerance, self.min_size, self.batch_size,
                          self.insert_budget)  # fmt: skip

    def can_insert(self, inserted: float, sampled: float) -> bool:
        """Whether a writer may store its next episode now."""
        if self.samples_per_insert is None or inserted < self.min_size:
            return True
        return self.samples_per_insert * inserted <= (sampled + self.batch_size) * (1.0 + self.tolerance)

    # ---- blocking ----------------------------------------------------------------------
    def wait_to_sample(self, inserted_fn: Count, sampled_fn: Count, stop: Any = None,
                       timeout: float | None = None) -> Wait:  # fmt: skip
        """Block the learner until :meth:`can_sample`, ``stop.is_set()`` or ``timeout``.

        The caller re-checks ``stop`` afterwards (and ``can_sample`` when it passed a
        timeout). Returns whether it waited and for how long (the learner's wait-time
        metric)."""
        return self._wait(lambda: self.can_sample(_value(inserted_fn), _value(sampled_fn)), self._sample_bell,
                          stop, timeout)  # fmt: skip

    def wait_to_insert(self, inserted_fn: Count, sampled_fn: Count, stop: Any = None,
                       timeout: float | None = None) -> Wait:  # fmt: skip
        """Block a writer until :meth:`can_insert`, ``stop.is_set()`` or ``timeout``;
        same contract as :meth:`wait_to_sample`."""
        if self.samples_per_insert is None:
            return _NO_WAIT
        return self._wait(lambda: self.can_insert(_value(inserted_fn), _value(sampled_fn)), self._insert_bell,
                          stop, timeout)  # fmt: skip

    def notify(self) -> None:
        """Ring both doorbells so that waiters re-check (call after each insert and each
        sample, and after setting ``stop``). Never blocks."""
        for bell in (self._sample_bell, self._insert_bell):
            if bell is None:
                continue
            try:
                if bell.get_value() >= _MAX_RINGS:  # nobody is answering: do not pile up
                    continue
            except NotImplementedError:  # macOS has no sem_getvalue
                pass
            bell.release()

    def _wait(self, ready: Callable[[], bool], bell, stop, timeout: float | None) -> Wait:
        if ready():  # fast path
            return _NO_WAIT
        start = time.monotonic()
        deadline = None if timeout is None else start + float(timeout)
        while not ready():
            if stop is not None and stop.is_set():
                break
            slice_s = self.poll_s
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                slice_s = min(slice_s, remaining)
            if bell is None:
                time.sleep(slice_s)
            else:
                bell.acquire(timeout=slice_s)
        return Wait(True, time.monotonic() - start)

    def __repr__(self) -> str:
        return (f"RateLimiter(samples_per_insert={self.samples_per_insert}, tolerance={self.tolerance}, "
                f"min_size={self.min_size}, batch_size={self.batch_size}, insert_budget={self.insert_budget})")  # fmt: skip
