"""Where a run's metrics records go besides ``metrics.jsonl``: ``metrics.csv``, TensorBoard
and Weights & Biases. Each takes the record :meth:`mpper.runtime.run.Run.record` writes.

The evaluation's figures are logged once per evaluation, from the ``"evaluation"``
record (every record repeats the latest evaluation; plotting each repeat would put
several points, at different env steps, on one evaluation). TensorBoard and wandb
also get the whole config: TensorBoard as hyperparameters (its HPARAMS tab, config keys
flattened to ``section.key``) and as a JSON text summary, wandb as the run's config.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

from ..extras import installed, require
from ..safe_files import open_append, refuse_link

__all__ = ["CSV_COLUMNS", "MetricsCsv", "TensorBoardLog", "WandbLog", "flat_config", "open_tensorboard",
           "open_wandb", "scalars"]  # fmt: skip

# metrics.csv's columns, in order: written as its header when the file is created, so that
# every row of every run lines up. An empty cell: the figure is not in that record (a loss
# the algorithm does not have; the evaluation columns outside "evaluation" rows).
CSV_COLUMNS = (
    "event", "time_s", "unix_time", "env_steps", "games", "buffer_positions", "mean_selfplay_return",
    "weights_version",
    "learner/training_step", "learner/steps_per_s", "learner/total_loss", "learner/value_loss",
    "learner/reward_loss", "learner/policy_loss", "learner/consistency_loss", "learner/mean_q",
    "learner/mean_abs_td", "learner/grad_norm", "learner/lr", "learner/wait_fraction",
    "evaluation/training_step", "evaluation/mean_return", "evaluation/best_mean_return",
    "evaluation/mean_return_at_most", "reanalyse/episodes",
)  # fmt: skip


def scalars(record: dict) -> dict[str, float]:
    """The numbers of one metrics record, flat: ``env_steps``, ``learner/total_loss``,
    ``evaluation/mean_return``, ``evaluation/opponents/perfect/first/wins``, ... The
    ``evaluation/*`` ones only in an ``"evaluation"`` record."""
    own = ("time_s", "unix_time", "env_steps", "games", "buffer_positions", "mean_selfplay_return", "weights_version")
    flat = {key: record[key] for key in own if _is_number(record.get(key))}
    groups = ("learner", "reanalyse", "evaluation") if record.get("event") == "evaluation" else ("learner", "reanalyse")
    for group in groups:
        flat.update(_numbers(record.get(group) or {}, f"{group}/"))
    return flat


class MetricsCsv:
    """``metrics.csv``: one row per record in the columns of :data:`CSV_COLUMNS`. A file
    that already has rows (a resumed run) keeps its header."""

    def __init__(self, path: Path) -> None:
        self._file = open_append(path)  # never through a link: the directory may have been received
        new = os.fstat(self._file.fileno()).st_size == 0
        self._writer = csv.DictWriter(self._file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if new:
            self._writer.writeheader()
            self._file.flush()

    def write(self, record: dict) -> None:
        if self._file.closed:
            return
        self._writer.writerow({"event": record.get("event"), **scalars(record)})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLog:
    """A TensorBoard event file: every number of each record against env steps, the
    config as hyperparameters and as text."""

    def __init__(self, path: Path, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(path))
        # the HPARAMS tab: the config, with the evaluation's mean return as its metric
        # (the plugin reads that metric's scalars from this same event file)
        for summary in hparams(flat_config(config), {"evaluation/mean_return": 0.0}):
            self.writer.file_writer.add_summary(summary)  # type: ignore[attr-defined]  # set while the writer is open
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def write(self, record: dict) -> None:
        step = record["env_steps"]
        for key, value in scalars(record).items():
            if "/" in key or key in _RUN_TAGS:  # the clock, counters and versions are in metrics.csv
                self.writer.add_scalar(_tag(key), value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """A Weights & Biases run in ``run_dir/wandb``: the config, and every number of each
    record (with ``env_steps`` beside it, to plot against)."""

    def __init__(self, project: str, run_dir: Path, config: dict) -> None:
        wandb = require("wandb", "wandb", "wandb", "runtime.wandb_project")
        # console="off": wandb would otherwise wrap stdout and stderr, the progress line's terminal
        settings = wandb.Settings(console="off", silent=True)
        try:
            self.run = wandb.init(project=project, dir=str(run_dir), name=f"{run_dir.parent.name}/{run_dir.name}",
                                  config=config, settings=settings)  # fmt: skip
        except Exception as exc:  # no API key, no network...: one line, before anything starts
            what = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise ConnectionError(f"runtime.wandb_project {project!r}: wandb could not start a run ({what}); "
                                  "WANDB_MODE=offline logs to the run directory without an account") from None

    def write(self, record: dict) -> None:
        self.run.log({_tag(k): v for k, v in scalars(record).items()})

    def close(self) -> None:
        self.run.finish()


def open_tensorboard(path: Path, config: dict) -> TensorBoardLog | None:
    """A :class:`TensorBoardLog` when the ``tensorboard`` package is installed; else None,
    after one line on stderr saying so."""
    if not (installed("tensorboard") and installed("torch.utils.tensorboard")):
        print("mpper: TensorBoard off: the tensorboard package is not installed (pip install -e .[tensorboard]); "
              "metrics.jsonl and metrics.csv have the figures", file=sys.stderr)  # fmt: skip
        return None
    refuse_link(path)  # its event files go under it: never into a directory it links to
    try:
        return TensorBoardLog(path, config)
    except ImportError as exc:
        print(f"mpper: TensorBoard off: {exc}", file=sys.stderr)
        return None


def open_wandb(project: str | None, run_dir: Path, config: dict) -> WandbLog | None:
    """A :class:`WandbLog` in ``project``; None when ``project`` is None. MissingExtraError
    when wandb is not installed, ConnectionError when it cannot start a run."""
    if project is None:
        return None
    os.makedirs(run_dir, exist_ok=True)
    return WandbLog(project, Path(run_dir), config)


def flat_config(config: dict, prefix: str = "") -> dict:
    """A config as ``{"section.key": value}`` of numbers, strings and booleans (lists and
    objects as JSON text, null as ``"null"``), as TensorBoard's hyperparameters take them."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flat_config(value, f"{prefix}{key}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[f"{prefix}{key}"] = value
        else:
            flat[f"{prefix}{key}"] = json.dumps(value)
    return flat


_RUN_TAGS = {"mean_selfplay_return": "selfplay/mean_return", "buffer_positions": "buffer/positions"}


def _tag(key: str) -> str:
    """The TensorBoard / wandb name of a flat key: a group's figures keep theirs, the
    record's own go under ``selfplay/``, ``buffer/`` or ``run/``; ``env_steps`` stays
    (wandb's x axis)."""
    if "/" in key or key == "env_steps":
        return key
    return _RUN_TAGS.get(key, f"run/{key}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers(group: dict, prefix: str = "") -> dict:
    """The numbers of a metrics group, nested dicts as ``a/b/c`` (the per-opponent results
    of a two-player evaluation)."""
    flat = {}
    for key, value in group.items():
        if isinstance(value, dict):
            flat.update(_numbers(value, f"{prefix}{key}/"))
        elif _is_number(value):
            flat[f"{prefix}{key}"] = value
    return flat
