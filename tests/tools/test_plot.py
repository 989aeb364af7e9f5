"""`python run.py --plot RUN_DIR`: PNGs from a real run's metrics.jsonl; the curves
extracted from records as the supervisor and the in-process mode write them (resumes,
a line being written, DQN's loss names)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from mpper.cli import main
from mpper.tools.plot import read_metrics, run_series

pytestmark = pytest.mark.timeout(120)


def drawn_fraction(png) -> float:
    """Share of pixels that are neither white nor the light grid grey: something was drawn."""
    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return float((rgb.min(axis=2) < 200).mean())


@pytest.mark.slow
def test_plot_a_real_run(trained_run, tmp_path):
    run = shutil.copytree(trained_run, tmp_path / "run")
    from test_train_e2e import ROOT

    proc = subprocess.run([sys.executable, "run.py", "--plot", str(run)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    names = {"return.png": (1200, 460), "loss.png": (1200, 460), "throughput.png": (1200, 820)}
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(names)
    for name, size in names.items():
        assert f"written: {run / 'plots' / name}" in proc.stdout
        with Image.open(run / "plots" / name) as im:
            assert im.format == "PNG" and im.size == size
        assert drawn_fraction(run / "plots" / name) > 0.01, name  # curves, labels: not an empty frame
    records, skipped = read_metrics(run / "metrics.jsonl")
    assert skipped == 0 and records[-1]["event"] == "end"
    s = run_series(records)
    assert set(s.losses) == {"total_loss", "value_loss", "reward_loss", "policy_loss"}
    evaluations = [r for r in records if r["event"] == "evaluation"]  # --workers 0 writes one per evaluation too
    assert len(s.evaluation) == len(evaluations) >= 1  # one point per evaluation, not per record
    assert s.evaluation.y == [r["evaluation"]["mean_return"] for r in evaluations]
    assert s.env_rate.y and max(s.env_rate.y) > 0
    assert not s.resumes


def record(t, env, event="progress", step=None, loss=None, evaluation=None, selfplay=None, loss_key="total_loss"):
    """A metrics.jsonl record shaped like mpper.runtime.supervisor's."""
    learner = {} if step is None else {"training_step": step, "lr": 0.01, "state": "training", "steps_per_s": 3.0}
    if loss is not None:
        learner[loss_key] = loss
    return {"event": event, "time_s": t, "env_steps": env, "games": env // 10, "buffer_positions": env,
            "mean_selfplay_return": selfplay, "counters": {"steps": env}, "learner": learner,
            "evaluation": evaluation or {}, "weights_version": 1}  # fmt: skip


@pytest.mark.slow
def test_series_from_records_with_a_resume_and_a_half_written_line(tmp_path):
    ev1 = {"training_step": 10, "mean_return": 20.0, "returns": [10.0, 30.0]}
    ev2 = {"training_step": 40, "mean_return": 50.0, "returns": [50.0, 50.0]}
    first = [
        record(1.0, 0),  # learner not started
        record(3.0, 200, step=10, loss=5.0, selfplay=12.0),
        record(3.5, 220, event="evaluation", step=10, loss=5.0, evaluation=ev1),
        record(5.0, 400, step=30, loss=4.0, selfplay=15.0, evaluation=ev1),  # same evaluation: no new point
        record(5.1, 410, event="end", step=30, loss=4.0, evaluation=ev1),  # after shutdown: no rate
    ]
    resumed = [  # a resumed run appends; its time_s starts again
        record(2.0, 410),
        record(4.0, 610, step=40, loss=3.0, evaluation=ev2, loss_key="td_loss"),  # in-process style evaluation
        record(6.0, 1010, step=60, loss=2.0, evaluation=ev2, loss_key="td_loss"),
    ]
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in first + resumed]
    lines.insert(2, '{"event": "progress", "time_s": 2.0, "env_steps"')  # a line cut by a crash
    path.write_text("\n".join(lines) + "\n" + '{"event": "progress", "time_s": 7')  # being written
    records, skipped = read_metrics(path)
    assert len(records) == 8 and skipped == 2
    s = run_series(records)
    assert s.resumes == [(410.0, 5.1)]  # wall time: the first segment's 5.1 s, then the second's
    assert s.evaluation.env_steps == [220.0, 610.0] and s.evaluation.y == [20.0, 50.0]
    assert s.evaluation.low == [10.0, 50.0] and s.evaluation.high == [30.0, 50.0]
    assert s.evaluation.wall_s == [3.5, 5.1 + 4.0] and s.evaluation_episodes == 2
    assert s.selfplay.y == [12.0, 15.0]
    assert s.losses["total_loss"].y == [5.0, 4.0, 4.0] and s.losses["td_loss"].y == [3.0, 2.0]  # DQN's keys too
    # env steps / s between consecutive non-evaluation records of one segment
    assert s.env_rate.y == pytest.approx([200 / 2, 200 / 2, 200 / 2, 400 / 2])
    assert s.env_rate.segment == [0, 0, 1, 1]
    # training steps / s: 0 before the learner's first report in a fresh run; unknown
    # (no rate) before its first report after a resume
    assert s.train_rate.y == pytest.approx([10 / 2, 20 / 2, 20 / 2]) and s.train_rate.segment == [0, 0, 1]
    nan_split = s.env_rate.broken(s.env_rate.y)
    assert len(nan_split) == 5 and np.isnan(nan_split[2])  # lines break at the resume

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(path, run / "metrics.jsonl")
    assert main(["--plot", str(run)]) == 0
    for name in ("return", "loss", "throughput"):
        assert drawn_fraction(run / "plots" / f"{name}.png") > 0.01


def test_plot_errors_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    cases = [(tmp_path / "missing", "no such run directory"), (run, "no metrics.jsonl there")]
    for path, fragment in cases:
        assert main(["--plot", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: --plot") and fragment in err, err
    (run / "metrics.jsonl").write_text('{"event": "progress", "time_s": 1.0, "env_')  # nothing complete yet
    assert main(["--plot", str(run)]) == 2
    assert "holds no complete record yet" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text(json.dumps(record(1.0, 0)) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["--plot", str(run)]) == 2
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and "needs matplotlib" in err and "pip install -e .[plot]" in err
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # no plots/
