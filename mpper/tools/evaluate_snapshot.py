"""Judge a checkpoint on stored data: ``python run.py --evaluate RUN_DIR --on-snapshot SNAPSHOT_DIR``.

Where ``--evaluate`` plays new episodes, this runs the run's checkpoint over every
sampleable position of a buffer snapshot (opened memory-mapped and read-only, so a
snapshot larger than RAM still works) and compares its predictions with the targets
the learner would train on, built from the stored episodes by the same code
(``mpper.replay.targets``). It answers "how well does this network fit this data", for
instance its own final buffer, or another run's.

The comparison depends on the algorithm: its ``evaluate_snapshot``
(:class:`mpper.algos.base.Algorithm`) gets a :class:`~mpper.algos.base.SnapshotRun`
(config, env facts, checkpoint, buffer, every position) and returns a dict with a
``"table"`` entry (a list of rows, each a dict of column -> value, printed as a table)
and whatever else it wants in ``snapshot_evaluation.json``. The snapshot must hold the
fields the run's buffer stores (the algorithm's ``schema``), with the same shapes and
dtypes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from ..algos.base import SnapshotRun
from ..algos.configs import load_run_config
from ..algos.registry import algorithm_of, load_run_checkpoint
from ..atomic import write_json_atomic
from ..checkpoint import CheckpointError
from ..config import ConfigError
from ..envs import env_spec
from ..replay.buffer import ReplayBuffer
from ..replay.positions import all_positions
from ..replay.schema import Field, normalize_schema
from ..replay.snapshot import SnapshotError

__all__ = [
    "SnapshotMismatchError",
    "evaluate_on_snapshot",
    "evaluate_snapshot_main",
    "format_table",
]

RESULT_NAME = "snapshot_evaluation.json"


class SnapshotMismatchError(ValueError):
    """The snapshot does not hold what the run's buffer stores (other fields or shapes),
    or the run's algorithm has no snapshot evaluation."""


def check_schema(snapshot: Path, run_dir: Path, stored: tuple[Field, ...], expected: tuple[Field, ...],
                 optional: Sequence[str] = ()) -> None:  # fmt: skip
    """SnapshotMismatchError naming the snapshot, the run and each field that differs
    (name, shape or dtype; the fill value is not compared). The snapshot may lack the
    ``optional`` fields (the schema's: added after older snapshots were written)."""
    have = {f.name: f for f in stored}
    want = {f.name: f for f in expected}
    problems = []
    for name, field in want.items():
        if name in have and (have[name].shape, have[name].dtype) != (field.shape, field.dtype):
            problems.append(f"{name} is {_describe(have[name])} there, the run stores {_describe(field)}")
    only_snapshot = [n for n in have if n not in want]
    only_run = [n for n in want if n not in have and n not in optional]
    if only_snapshot:
        problems.append(f"fields only in the snapshot: {', '.join(only_snapshot)}")
    if only_run:
        problems.append(f"fields the snapshot lacks: {', '.join(only_run)}")
    if problems:
        raise SnapshotMismatchError(f"snapshot {snapshot} does not match run {run_dir}: {'; '.join(problems)}")


def _describe(f: Field) -> str:
    return f"{tuple(f.shape)} {f.dtype}"


def evaluate_on_snapshot(run_dir: Path, snapshot_dir: Path, checkpoint: Path | None = None,
                         batch_size: int = 1024, overrides: Sequence[str] = ()) -> dict:  # fmt: skip
    """Run the checkpoint (default ``run_dir/checkpoint.pt``) over every position of the
    snapshot, in batches of ``batch_size`` positions; returns the report (also written to
    ``run_dir/snapshot_evaluation.json``, atomically).

    Raises ConfigError, FileNotFoundError / CheckpointError (checkpoint), SnapshotError
    (missing or corrupt snapshot), SnapshotMismatchError (schema, algorithm).
    """
    run_dir, snapshot_dir = Path(run_dir), Path(snapshot_dir)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    config = load_run_config(run_dir, overrides)  # names no code to import unless an override does
    algorithm = algorithm_of(config)
    named = checkpoint is not None  # --checkpoint FILE: the user's own path, which may be a link of theirs
    checkpoint = Path(checkpoint) if checkpoint is not None else run_dir / "checkpoint.pt"
    spec = env_spec(config.env)
    state = load_run_checkpoint(checkpoint, config, spec, follow_links=named)
    started = time.monotonic()
    # memory-mapped, read-only; its stored actions checked against this env's (the network indexes by them)
    with ReplayBuffer.load(snapshot_dir, mmap=True, num_actions=spec.num_actions) as buf:
        expected = algorithm.run_schema(config, spec)
        check_schema(snapshot_dir, run_dir, buf.schema, normalize_schema(expected), getattr(expected, "optional", ()))
        positions = all_positions(buf)
        if len(positions) == 0:
            raise SnapshotMismatchError(f"snapshot {snapshot_dir} holds no sampleable position")
        with tqdm(total=len(positions), desc="evaluate on snapshot", unit="position",
                  disable=not sys.stderr.isatty()) as bar:  # fmt: skip
            run = SnapshotRun(config, spec, state, checkpoint, buf, positions, batch_size, bar.update)
            result = algorithm.evaluate_snapshot(run)
        episodes = len(buf.episodes())
    report = {
        "algorithm": config.algorithm,
        "run_dir": str(run_dir),
        "snapshot": str(snapshot_dir),
        "checkpoint": str(checkpoint),
        "training_step": int(state.get("training_step", -1)),
        "episodes": episodes,
        "positions": len(positions),
        "batch_size": batch_size,
        "seconds": round(time.monotonic() - started, 3),
        **result,
    }
    write_json_atomic(run_dir / RESULT_NAME, report)
    return report


def format_table(rows: list[dict]) -> str:
    """Rows of dicts (same keys) as an aligned text table: numbers to 4 significant
    digits, None as '-'."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def evaluate_snapshot_main(run_dir: str, snapshot_dir: str, checkpoint: str | None,
                           overrides: Sequence[str] = ()) -> int:  # fmt: skip
    """``--evaluate RUN_DIR --on-snapshot SNAPSHOT_DIR``: the table, or one line
    ``error: ...`` on stderr and exit code 2 (nothing written)."""
    path = Path(run_dir)
    if not os.path.lexists(path / "config.json"):  # one that is there but not a regular file: refused when read
        print(f"error: --evaluate {run_dir}: no run directory with a config.json there", file=sys.stderr)
        return 2
    try:
        report = evaluate_on_snapshot(path, Path(snapshot_dir), None if checkpoint is None else Path(checkpoint),
                                      overrides=overrides)  # fmt: skip
    except (ConfigError, CheckpointError, FileNotFoundError, SnapshotError, SnapshotMismatchError) as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    print(f"{report['algorithm']} checkpoint at training step {report['training_step']} on {report['snapshot']}: "
          f"{report['positions']:,} positions in {report['episodes']:,} episodes ({report['seconds']:.1f} s)")  # fmt: skip
    print(format_table(report["table"]))
    print(f"written: {path / RESULT_NAME}")
    return 0
