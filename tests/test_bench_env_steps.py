"""bench/env_steps.py: its figures come from a run directory's records and final
evaluation, and the summary's medians and ratio from the rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import env_steps  # noqa: E402


def test_run_figures_read_the_evaluation_curve_and_the_final_evaluation(tmp_path):
    records = [
        {"event": "evaluation", "time_s": 1.0, "env_steps": 0, "evaluation": {"mean_return": 0.5}},
        {"event": "progress", "time_s": 5.0, "env_steps": 800, "evaluation": {"mean_return": 0.5}},
        {"event": "evaluation", "time_s": 9.0, "env_steps": 1500, "evaluation": {"stopped_early": True}},
        {"event": "evaluation", "time_s": 12.0, "env_steps": 2100, "evaluation": {"mean_return": 3.0}},
        {"event": "end", "time_s": 14.0, "env_steps": 2400, "evaluation": {}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    final = {"training_step": 300, "env_steps": 2400, "episodes": 2, "mean_return": 2.5, "returns": [2.0, 3.0]}
    (tmp_path / "final_evaluation.json").write_text(json.dumps(final))
    figures = env_steps.run_figures(tmp_path)
    assert figures["curve"] == [(0, 1.0, 0.5), (2100, 12.0, 3.0)]  # an evaluation stopped early has no mean
    assert (figures["env_steps"], figures["training_steps"], figures["final_mean"]) == (2400, 300, 2.5)


def test_the_summary_takes_medians_per_system_and_their_ratios():
    rows = [{"game": "breakout", "system": s, "final_mean": m} for s, m in
            [("dqn", 4.0), ("dqn", 2.0), ("dqn", 9.0), ("muzero", 6.0), ("muzero", 10.0), ("vp", 12.0)]]  # fmt: skip
    rows.append({"game": "space_invaders", "system": "dqn", "final_mean": 0.0})
    result = env_steps.summary(rows)
    assert result["breakout"]["medians"] == {"dqn": {"median": 4.0, "seeds": 3}, "muzero": {"median": 8.0, "seeds": 2},
                                             "vp": {"median": 12.0, "seeds": 1}}  # fmt: skip
    assert result["breakout"]["ratio"] == pytest.approx(2.0)
    assert result["breakout"]["variants"] == {"vp": pytest.approx(1.5)}
    assert result["space_invaders"]["ratio"] is None and result["space_invaders"]["variants"] == {}


def test_an_override_for_no_known_system_is_one_line(capsys, tmp_path):
    assert env_steps.main(["--set", "ppo:training.lr_init=1", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --set ppo:training.lr_init=1: expected SYSTEM:KEY=VALUE")


@pytest.mark.parametrize("variant", ["muzero:muzero.value_prefix=true", "vp", ":muzero.value_prefix=true"])
def test_a_variant_needs_a_new_label_and_overrides(capsys, tmp_path, variant):
    assert env_steps.main(["--variant", variant, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: --variant {variant}: expected LABEL:KEY=VALUE")
