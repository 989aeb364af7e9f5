"""The progress line: one line on stderr, the same for ``--workers N`` and ``--workers 0``.

On a terminal it is rewritten in place (at most every :data:`REDRAW_S`); piped to a file
it is a plain line every ``runtime.log_interval_s``, so the log reads top to bottom.
Example (fields drop from the right-hand priority list, never ``eval``, when the line
would pass :data:`LINE_WIDTH` columns)::

    2:41 step 1060 | eval 500.0 | loss 0.412 | train 8.40/s | env 2.10k/s | buf 12% | left 8:17

- ``step``: the learner's training step; ``eval``: the latest greedy evaluation (the mean
  return; two-player envs: the mean score and W/D/L against the strongest opponent);
- ``train``: training steps per second over the last :data:`RATE_WINDOW_S` seconds (the
  one training-speed figure), or ``stalled 1m05s`` when the learner has not made a
  training step for :data:`STALLED_AFTER_S` seconds (``train wait`` while it waits for
  ``training.min_buffer_steps``, before its first step);
- ``env``: env steps per second, same window; ``buf``: how full the replay buffer is;
- ``left``: the time to the run's nearest stop (:func:`seconds_left` over the run's
  budgets: the time limit, the training steps, and any other (done, total) budget).

Only the standard library: the command line imports this before torch.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["LINE_WIDTH", "RATE_WINDOW_S", "STALLED_AFTER_S", "Budget", "ProgressFigures", "ProgressLine",
           "eval_text", "format_duration", "format_number", "progress_text", "seconds_left", "startup_line"]  # fmt: skip

LINE_WIDTH = 100  # columns: the line never passes it (nor the terminal's width, when narrower)
STALLED_AFTER_S = 30.0  # a learner without a new training step this long is shown as stalled
RATE_WINDOW_S = 30.0  # the rates are averages over about this many seconds
REDRAW_S = 0.5  # a terminal's line is redrawn at most this often


@dataclass(frozen=True)
class Budget:
    """One thing that stops the run when ``done`` reaches ``total``, counted in ``counts``:
    ``"seconds"`` (the time limit: done is the elapsed time), ``"training_steps"`` or
    ``"env_steps"``; the line knows the rate of each."""

    name: str
    done: float
    total: float
    counts: str = "seconds"


def seconds_left(budgets: list[Budget], rates: dict[str, float | None]) -> float | None:
    """The time to the nearest stop among ``budgets`` (seconds): each budget's remainder
    at ``rates[budget.counts]`` per second (seconds: 1); None when none can be told (no
    budget has a rate yet)."""
    left = []
    for b in budgets:
        rate = 1.0 if b.counts == "seconds" else rates.get(b.counts)
        if b.done >= b.total:
            left.append(0.0)
        elif rate is not None and rate > 0:
            left.append((b.total - b.done) / rate)
    return min(left) if left else None


@dataclass
class ProgressFigures:
    """What the line shows at one moment. ``evaluation``: the run's latest evaluation
    record (``mean_return``, or ``opponents`` for a two-player env, or ``stopped_early``);
    ``learner_state``: the learner's last reported state (``"waiting_for_data"``,
    ``"training"``, ``"done"``)."""

    elapsed_s: float
    training_step: int
    env_steps: int
    buffer_fill: float  # [0, 1]
    evaluation: dict = field(default_factory=dict)
    loss: float | None = None
    learner_state: str = ""
    budgets: list[Budget] = field(default_factory=list)


class _Rate:
    """The rate of a growing count over the last ``window_s`` seconds (per second)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.points: deque = deque()

    def add(self, now: float, count: float) -> None:
        self.points.append((now, count))
        while len(self.points) > 2 and now - self.points[1][0] >= self.window_s:
            self.points.popleft()

    def per_second(self) -> float | None:
        if len(self.points) < 2:
            return None
        (t0, c0), (t1, c1) = self.points[0], self.points[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None


def format_number(x: float | None) -> str:
    """A number in at most 7 characters: ``500.0``, ``-21.0``, ``9.50``, ``0.412``, ``12.3k``,
    ``-4.56M``; ``-`` for None."""
    if x is None or not math.isfinite(x):
        return "-" if x is None else str(x)
    a = abs(x)
    if a >= 999.95:
        for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
            v = x / scale
            if abs(v) < 999.5:
                return f"{v:.{2 if abs(v) < 9.995 else 1 if abs(v) < 99.95 else 0}f}{unit}"
        return f"{x:.0e}"
    if a >= 10 or a == 0:
        return f"{x:.1f}"
    if a >= 0.001:
        return f"{x:#.3g}"
    return f"{x:.0e}"


def format_duration(seconds: float) -> str:
    """``m:ss`` under an hour, then ``h:mm:ss`` (``123h`` from 100 hours, at most ``99999h+``)."""
    s = max(0, int(min(seconds, 1e12)))
    h, rest = divmod(s, 3600)
    if h >= 100:
        return f"{h}h" if h < 100_000 else "99999h+"
    if h == 0:
        return f"{rest // 60}:{rest % 60:02d}"
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _short_duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s < 360000 else f"{s // 3600}h"


def eval_text(evaluation: dict) -> str:
    """The ``eval`` field: the mean greedy return; ``<bound`` for an evaluation stopped
    early; two-player envs: the mean score and W/D/L (both sides together) against the
    last, strongest opponent (name cut to 10 characters)."""
    if not evaluation:
        return "eval -"
    if evaluation.get("stopped_early"):
        return f"eval <{format_number(evaluation['mean_return_at_most'])}"
    opponents = evaluation.get("opponents")
    if opponents:
        name, r = list(opponents.items())[-1]
        w, d, l = (r["first"][k] + r["second"][k] for k in ("wins", "draws", "losses"))
        return f"eval {evaluation.get('mean_return', float('nan')):+.2f} {name[:10]} {w}/{d}/{l}"
    return f"eval {format_number(evaluation.get('mean_return'))}"


def progress_text(f: ProgressFigures, train_rate: float | None, env_rate: float | None, stalled_s: float | None,
                  width: int = LINE_WIDTH) -> str:  # fmt: skip
    """The line for ``f``, at most ``width`` characters. ``stalled_s``: seconds since the
    learner's last new training step when that is at least :data:`STALLED_AFTER_S`, else
    None. Fields are given up in this order when the line is too long: ``buf``, ``env``,
    ``loss``, ``left``, ``train``; ``eval`` stays."""
    if stalled_s is not None:
        train = f"stalled {_short_duration(stalled_s)}"
    elif f.learner_state == "waiting_for_data" or (f.training_step == 0 and not f.learner_state):
        train = "train wait"
    else:
        train = f"train {format_number(train_rate)}/s"
    left = seconds_left(f.budgets, {"training_steps": train_rate, "env_steps": env_rate})
    fields = [  # (priority: lower is kept longer, text)
        (0, f"{format_duration(f.elapsed_s)} step {f.training_step}"),
        (0, eval_text(f.evaluation)),
        (5, f"loss {format_number(f.loss)}"),
        (2, train),
        (6, f"env {format_number(env_rate)}/s"),
        (7, f"buf {f.buffer_fill:.0%}"),
        (3, f"left {format_duration(left) if left is not None else '-'}"),
    ]
    while True:
        line = " | ".join(text for _, text in fields)
        if len(line) <= width or len(fields) <= 2:
            return line[:width]
        fields.remove(max(fields, key=lambda pt: pt[0]))


def startup_line(run_dir, tensorboard: bool) -> str:
    """The run's first line, printed once the run is set up, before its processes start:
    where its files go and, with TensorBoard on, the command to watch it."""
    line = f"mpper: run directory {run_dir}"
    if tensorboard:
        line += f"; watch it with: tensorboard --logdir {os.path.join(run_dir, 'tensorboard')}"
    return line


class ProgressLine:
    """The progress line of one run on ``stream`` (stderr): :meth:`update` with the newest
    figures as often as they come, :meth:`close` once. On a terminal it rewrites one line;
    otherwise it prints a plain line when :meth:`update` is given ``log=True`` (the run's
    log interval)."""

    def __init__(self, stream=None, clock=time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._train, self._env = _Rate(), _Rate()
        self._last_step: int | None = None
        self._step_changed = clock()
        self._drawn = 0.0
        self._shown = False

    def stalled_s(self, now: float) -> float | None:
        """Seconds since the training step last changed, when at least :data:`STALLED_AFTER_S`."""
        waited = now - self._step_changed
        return waited if waited >= STALLED_AFTER_S else None

    def text(self, f: ProgressFigures, now: float | None = None) -> str:
        """Take in ``f`` and return its line (fitted to the terminal on a terminal)."""
        now = self.clock() if now is None else now
        waiting = f.learner_state == "waiting_for_data" or (f.training_step == 0 and not f.learner_state)
        if f.training_step != self._last_step or waiting:  # a wait for data is no stall: the clock starts after it
            self._last_step, self._step_changed = f.training_step, now
        self._train.add(now, f.training_step)
        self._env.add(now, f.env_steps)
        stalled = None if waiting or f.learner_state == "done" else self.stalled_s(now)
        width = LINE_WIDTH
        if self.tty:
            width = max(20, min(LINE_WIDTH, shutil.get_terminal_size((LINE_WIDTH + 1, 24)).columns - 1))
        return progress_text(f, self._train.per_second(), self._env.per_second(), stalled, width)

    def update(self, f: ProgressFigures, log: bool = False) -> None:
        now = self.clock()
        line = self.text(f, now)
        if self.tty:
            if log or now - self._drawn >= REDRAW_S:
                self._drawn, self._shown = now, True
                self.stream.write("\r" + line + "\x1b[K")
                self.stream.flush()
        elif log:
            self.stream.write(line + "\n")
            self.stream.flush()

    def finish(self, f: ProgressFigures) -> None:
        """The run's last line, whatever the interval: the figures it ended with, drawn and
        ended on a terminal, printed when piped."""
        self.update(f, log=True)
        self.clear()

    def clear(self) -> None:
        """End the rewritten line (on a terminal), so that other output starts on a new one."""
        if self.tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False

    close = clear
