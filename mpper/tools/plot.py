"""Plots of a run's ``metrics.jsonl``: ``python run.py --plot RUN_DIR``.

Writes three PNGs into ``RUN_DIR/plots/``, each with one column of panels against env
steps and one against wall time:

- ``return.png``: mean greedy-evaluation return (with the min-max band of its episodes)
  and the mean return of recent self-play episodes, with the solve threshold;
- ``loss.png``: every numeric learner key whose name contains ``loss`` (MuZero's total,
  value, reward and policy losses; DQN's keys as well, whatever they are called);
- ``throughput.png``: env steps per second and training steps per second, from the
  counters of consecutive records.

Records are those the supervisor (``mpper.runtime.supervisor``) and the in-process mode
(``mpper.runtime.turns``) append; lines that are not complete JSON objects (the one a live run
is writing, a line cut by a crash) are skipped. A resumed run appends to the same file
and its ``time_s`` starts again from 0: wall time here is the sum of the segments'
running times (the pause between them left out), and each resume is marked.

Needs matplotlib (``pip install -e .[plot]``), drawn with the Agg backend: no display.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from ..atomic import write_atomic
from ..extras import MissingExtraError, require
from ..safe_files import ReceivedFileError, read_received, refuse_link

__all__ = ["RunSeries", "plot_main", "plot_run", "read_metrics", "run_series"]

PLOTS = ("return", "loss", "throughput")
MAX_METRICS_BYTES = 1 << 30  # far above any run's metrics.jsonl (one record every runtime.log_interval_s)
_MAX_CONFIG_BYTES = 16 << 20


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The complete records of a metrics.jsonl and the number of lines skipped.

    A line counts when it ends with a newline and parses as a JSON object: a live run
    may be half-way through writing the last one. The file is read only as a regular file
    of at most ``MAX_METRICS_BYTES`` (ReceivedFileError: a link, FIFO or device).
    """
    pieces = read_received(path, MAX_METRICS_BYTES).decode("utf-8", errors="replace").split("\n")
    records, skipped = [], 0
    for piece in pieces[:-1]:  # the last piece has no newline after it: never complete
        if not piece.strip():
            continue
        try:
            record = json.loads(piece)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("time_s"), (int, float)):
            records.append(record)
        else:
            skipped += 1
    if pieces[-1].strip():
        skipped += 1
    return records, skipped


@dataclass
class Points:
    """One curve: x in env steps and in wall seconds, y, optional band (low, high), and
    the segment (0, then 1 after the first resume, ...) each point belongs to."""

    env_steps: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)
    segment: list[int] = field(default_factory=list)

    def add(self, segment: int, env_steps: float, wall_s: float, y: float, low: float | None = None,
            high: float | None = None) -> None:  # fmt: skip
        self.segment.append(segment)
        self.env_steps.append(env_steps)
        self.wall_s.append(wall_s)
        self.y.append(y)
        self.low.append(y if low is None else low)
        self.high.append(y if high is None else high)

    def __len__(self) -> int:
        return len(self.y)

    def broken(self, values: list[float]) -> list[float]:
        """``values`` with a NaN between segments: matplotlib breaks lines and bands at
        NaN, so a curve never joins the end of one segment to the start of the next."""
        out = []
        for k, v in enumerate(values):
            if k and self.segment[k] != self.segment[k - 1]:
                out.append(math.nan)
            out.append(v)
        return out


@dataclass
class RunSeries:
    """What the plots draw, extracted from the records (see :func:`run_series`)."""

    evaluation: Points = field(default_factory=Points)
    selfplay: Points = field(default_factory=Points)
    losses: dict[str, Points] = field(default_factory=dict)
    env_rate: Points = field(default_factory=Points)  # env steps per second
    train_rate: Points = field(default_factory=Points)  # training steps per second
    resumes: list[tuple[float, float]] = field(default_factory=list)  # (env steps, wall s) of each resume
    evaluation_episodes: int | None = None


def _number(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def run_series(records: list[dict]) -> RunSeries:
    """Curves from metrics records, in file order.

    Evaluations: a point for each ``"evaluation"`` event (the supervisor writes one as
    each evaluation arrives) and for each record whose ``evaluation`` differs from the
    previous record's (the in-process mode only repeats the latest one in its progress
    records). Rates: see :func:`_rates`.
    """
    s = RunSeries()
    offset = 0.0  # wall seconds of the segments before this one
    last_time = None
    last_eval = None
    counts = []  # (segment, time_s, wall s, env steps, training step) of the progress records
    last_env = 0.0
    segment = 0
    for r in records:
        if r.get("event") == "train_step":
            continue  # a lockstep run's per-step losses: no time, no counters
        t = float(r["time_s"])
        env = _env_steps(r)
        if last_time is not None and t < last_time:  # time_s went back: a resumed run
            offset += last_time
            last_eval = None
            segment += 1
            s.resumes.append((last_env if env is None else env, offset))
        last_time = t
        wall = offset + t
        if env is None:
            continue
        last_env = env
        ev = r.get("evaluation") or {}
        if _number(ev.get("mean_return")) and (r.get("event") == "evaluation" or ev != last_eval):
            returns = [x for x in ev.get("returns", []) if _number(x)]
            s.evaluation.add(segment, env, wall, float(ev["mean_return"]), min(returns, default=None),
                             max(returns, default=None))  # fmt: skip
            s.evaluation_episodes = len(returns) or s.evaluation_episodes
        last_eval = ev
        if r.get("event") == "evaluation":
            continue  # the same learner figures as the progress records around it
        if _number(r.get("mean_selfplay_return")):
            s.selfplay.add(segment, env, wall, float(r["mean_selfplay_return"]))
        learner = r.get("learner") or {}
        for key, value in learner.items():
            if "loss" in key and _number(value):
                s.losses.setdefault(key, Points()).add(segment, env, wall, float(value))
        if r.get("event") == "end":
            continue  # written after the shutdown (joins, final snapshot): no rate over that
        step = learner.get("training_step")
        # no learner figures yet: no step made in a fresh run; in a resumed one, unknown
        step = float(step) if _number(step) else (0.0 if segment == 0 else None)
        counts.append((segment, t, wall, env, step))
    _rates(counts, s)
    return s


def _rates(counts: list[tuple], s: RunSeries) -> None:
    """Env and training steps per second between consecutive progress records of one
    segment, placed at the later one. A record closer to the previous one than half the
    usual interval is skipped (the rate then spans both gaps): the supervisor writes one
    more record as it stops, milliseconds after the last, and a rate over that is noise."""
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(counts) if a[0] == b[0] and b[1] > a[1]]
    min_gap = 0.5 * float(sorted(gaps)[len(gaps) // 2]) if gaps else 0.0
    anchor = None
    for segment, t, wall, env, step in counts:
        if anchor is None or anchor[0] != segment:
            anchor = (segment, t, env, step)
            continue
        dt = t - anchor[1]
        if dt <= 0 or dt < min_gap:
            continue
        s.env_rate.add(segment, env, wall, (env - anchor[2]) / dt)
        if step is not None and anchor[3] is not None:
            s.train_rate.add(segment, env, wall, (step - anchor[3]) / dt)
        anchor = (segment, t, env, step)


def _env_steps(record: dict) -> float | None:
    if _number(record.get("env_steps")):
        return float(record["env_steps"])
    steps = (record.get("counters") or {}).get("steps")  # the in-process "end" record
    return float(steps) if _number(steps) else None


# ---- drawing -------------------------------------------------------------------------------
def _time_unit(seconds: float) -> tuple[str, float]:
    if seconds < 300:
        return "s", 1.0
    if seconds < 3 * 3600:
        return "min", 60.0
    return "h", 3600.0


class _Axes:
    """The two x axes every figure uses: env steps (left column), wall time (right)."""

    def __init__(self, series: RunSeries, ticker) -> None:
        all_wall = [w for p in (series.evaluation, series.env_rate, series.selfplay, *series.losses.values())
                    for w in p.wall_s]  # fmt: skip
        self.unit, self.scale = _time_unit(max(all_wall, default=0.0))
        self.series = series
        self.ticker = ticker

    def plot(self, ax, points: Points, column: int, *args, band: bool = False, **kwargs) -> None:
        """``points`` against this column's x; NaN breaks between resumed segments."""
        x = points.broken(points.env_steps if column == 0 else [w / self.scale for w in points.wall_s])
        if band:
            ax.fill_between(x, points.broken(points.low), points.broken(points.high), color=kwargs.get("color"),
                            alpha=0.2, linewidth=0, label=kwargs.pop("band_label", None))  # fmt: skip
        kwargs.pop("band_label", None)
        ax.plot(x, points.broken(points.y), *args, **kwargs)

    def style(self, ax, column: int, ylabel: str, empty: bool, empty_text: str) -> None:
        if column == 0:
            ax.set_xlabel("env steps (moves stored in the buffer)")
            ax.xaxis.set_major_formatter(self.ticker.FuncFormatter(_steps_label))  # 12k, not 1.2e4 at the corner
        else:
            resumed = ", pauses between resumes left out" if self.series.resumes else ""
            ax.set_xlabel(f"wall time ({self.unit}{resumed})")
        ax.set_ylabel(ylabel)
        for k, (env, wall) in enumerate(self.series.resumes):
            ax.axvline(env if column == 0 else wall / self.scale, color="0.5", linestyle=":", linewidth=1,
                       label="resumed" if k == 0 else None)  # fmt: skip
        ax.grid(True, alpha=0.3)
        if empty:  # say so, rather than draw made-up 0..1 ticks
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.5, empty_text, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _steps_label(value: float, _pos=None) -> str:
    """Tick label for a count: 500, 2.5k, 1.2M."""
    for limit, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:g}{suffix}"
    return f"{value:g}"


def _figure(rows: int, title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 1.0 + 3.6 * rows), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg backend, whatever matplotlib's default: no display needed
    axes = fig.subplots(rows, 2, squeeze=False)
    fig.suptitle(title)
    return fig, axes


def _legend(fig, ax) -> None:
    """One legend for the figure, under the panels: both columns draw the same curves,
    and a legend inside a panel hides some of them."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(handles), 4), fontsize="small")


def _return_figure(s: RunSeries, ax_: _Axes, title: str, solve: float | None):
    fig, axes = _figure(1, f"Episode return: {title}")
    n = f"{s.evaluation_episodes} " if s.evaluation_episodes else ""
    empty = not (len(s.evaluation) or len(s.selfplay))
    for col, ax in enumerate(axes[0]):
        if len(s.evaluation):
            ax_.plot(ax, s.evaluation, col, "o-", band=True, color="C0", markersize=3,
                     label=f"greedy evaluation: mean of {n}episodes", band_label="min-max of those episodes")  # fmt: skip
        if len(s.selfplay):
            ax_.plot(ax, s.selfplay, col, color="C1", linewidth=1, label="self-play: mean of the last 100 episodes")
        if solve is not None and not empty:
            ax.axhline(solve, color="C2", linestyle="--", linewidth=1, label=f"solve threshold ({solve:g})")
        ax_.style(ax, col, "episode return", empty, "no evaluation or self-play return recorded yet")
    _legend(fig, axes[0][0])
    return fig


def _loss_figure(s: RunSeries, ax_: _Axes, title: str):
    fig, axes = _figure(1, f"Learner losses: {title}")
    values = [v for p in s.losses.values() for v in p.y]
    # losses fall over orders of magnitude in a long run: log scale when all are > 0 and they do
    log = bool(values) and min(values) > 0 and max(values) / min(values) > 30
    keys = sorted(s.losses, key=lambda key: (key != "total_loss", key))  # the total first, drawn thicker
    for col, ax in enumerate(axes[0]):
        for k, key in enumerate(keys):
            ax_.plot(ax, s.losses[key], col, ".-", color=f"C{k}", markersize=3,
                     linewidth=2 if key == "total_loss" else 1, label=key.replace("_", " "))  # fmt: skip
        if log:
            ax.set_yscale("log")
        ax_.style(ax, col, "loss of the latest batch" + (" (log scale)" if log else ""), not keys,
                  "no learner loss recorded yet")  # fmt: skip
    _legend(fig, axes[0][0])
    return fig


def _throughput_figure(s: RunSeries, ax_: _Axes, title: str):
    fig, axes = _figure(2, f"Throughput: {title}")
    rows = ((s.env_rate, "env steps / s", "C0", "not enough records for a rate yet"),
            (s.train_rate, "training steps / s", "C3", "no training steps recorded yet"))  # fmt: skip
    for row, (points, label, color, empty_text) in enumerate(rows):
        for col, ax in enumerate(axes[row]):
            if len(points):
                ax_.plot(ax, points, col, ".-", color=color, markersize=3, linewidth=1)
                # from 0, so that a flat rate looks flat, with room above the highest point
                ax.set_ylim(0, max(max(points.y), 1e-9) * 1.1)
            ax_.style(ax, col, label, not len(points), empty_text)
    _legend(fig, axes[0][0])  # only the resume marker, when there is one
    return fig


def _save(fig, path: Path) -> None:
    """PNG written to a temp file and renamed: a viewer never sees half an image."""
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))


class PlotError(ValueError):
    """No run directory, or no metrics in it to plot."""


def plot_run(run_dir: Path) -> list[Path]:
    """Write return.png, loss.png and throughput.png into ``run_dir/plots/``; returns
    their paths. Raises PlotError (nothing to plot) or MissingExtraError (matplotlib)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise PlotError(f"--plot {run_dir}: no such run directory")
    if not os.path.lexists(metrics):
        raise PlotError(f"--plot {run_dir}: no metrics.jsonl there (not a run directory, or the run never started)")
    require("matplotlib", "matplotlib", "plot", "--plot")
    from matplotlib import ticker

    try:  # a run directory may have been received: its files are read only as regular files, and
        # nothing is written through a link (the PNGs are renamed into place, replacing one)
        records, _ = read_metrics(metrics)
        solve = _solve_return(run_dir / "config.json")
        refuse_link(run_dir / "plots")
    except ReceivedFileError as exc:
        raise PlotError(f"--plot {run_dir}: {exc}") from None
    if not records:
        raise PlotError(f"--plot {run_dir}: {metrics} holds no complete record yet")
    series = run_series(records)
    title = "/".join(run_dir.resolve().parts[-2:])
    axes = _Axes(series, ticker)
    figures = {
        "return": _return_figure(series, axes, title, solve if _number(solve) else None),
        "loss": _loss_figure(series, axes, title),
        "throughput": _throughput_figure(series, axes, title),
    }
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for name in PLOTS:
        path = out / f"{name}.png"
        _save(figures[name], path)
        written.append(path)
    return written


def _solve_return(config: Path):
    """The threshold the run stops at (``runtime.solve_return``), when its config still
    says; ReceivedFileError when config.json is not a regular file within the size."""
    try:
        return json.loads(read_received(config, _MAX_CONFIG_BYTES))["runtime"]["solve_return"]
    except ReceivedFileError:
        raise
    except (OSError, ValueError, KeyError, TypeError):
        return None


def plot_main(run_dir: str) -> int:
    """``--plot RUN_DIR``: the PNGs' paths, or one line ``error: ...`` and exit code 2."""
    try:
        written = plot_run(Path(run_dir))
    except (PlotError, MissingExtraError) as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    for path in written:
        print(f"written: {path}")
    return 0
