"""The benchmarks against peers: a run's first evaluation at a return, the Markdown of runs to
a return with their ratios (bench/peer_runs.py), and bench/sac_mujoco.py's per-run summary."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import peer_runs  # noqa: E402
import sac_mujoco  # noqa: E402


def curve(*points: tuple[float, int, float]) -> list[dict]:
    """Evaluations at (seconds, env steps, mean return), 10 training steps per env step."""
    return [{"time_s": t, "env_steps": s, "training_steps": s * 10, "mean_return": m} for t, s, m in points]


def test_the_first_evaluation_at_the_return_is_the_one_reported_and_the_best_is_kept():
    run = peer_runs.to_return({"curve": curve((5.0, 100, -900.0), (9.0, 300, -200.0), (12.0, 400, -150.0))}, -200.0)
    assert run["solved"] and (run["wall_s"], run["env_steps"], run["training_steps"]) == (9.0, 300, 3000)
    assert run["best_return"] == -150.0
    short = peer_runs.to_return({"curve": curve((5.0, 100, -900.0), (9.0, 300, -200.5))}, -200.0)
    assert not short["solved"] and "wall_s" not in short and short["best_return"] == -200.5
    assert peer_runs.to_return({"curve": []}, -200.0)["best_return"] is None


def runs(system: str, *per_seed: tuple[int, float | None, int | None]) -> list[dict]:
    """Runs of ``system``: (seed, wall seconds to -200 or None for a run that did not reach it, env steps)."""
    out = []
    for seed, wall, steps in per_seed:
        points = curve((wall, steps, -190.0)) if wall is not None else curve((100.0, 5000, -400.0))
        out.append(peer_runs.to_return({"system": system, "seed": seed, "curve": points}, -200.0))
    return out


def test_solve_report_gives_ratios_seed_by_seed_and_of_the_medians_with_unreached_runs_as_infinite():
    mpper = runs("mpper", (0, 20.0, 4000), (1, 30.0, 6000), (2, None, None))
    peer = runs(peer_runs.LIGHTZERO, (0, 200.0, 8000), (1, None, None), (2, 100.0, 2000))
    lines = peer_runs.solve_report(mpper + peer, -200.0)
    assert "| 0 | mpper | yes | 20.0 | 4,000 | -190.0 |" in lines
    assert "| 1 | LightZero 0.2.0 | no | - | - | -400.0 |" in lines
    assert "| 0 | mpper | 0.100 | 0.500 |" in lines  # 20 s / 200 s, 4,000 / 8,000 steps
    assert "| 1 | mpper | - | - |" in lines and "| 2 | mpper | - | - |" in lines  # a side that did not reach it
    assert "- mpper: 2/3 reached -200, median wall 30.0 s, median env steps 6,000" in lines
    assert "- LightZero 0.2.0: 2/3 reached -200, median wall 200.0 s, median env steps 8,000" in lines
    assert "\nmpper against LightZero 0.2.0, medians: wall time 0.150x, env steps 0.750x" in lines


def test_solve_report_without_the_peer_gives_the_medians_alone():
    lines = peer_runs.solve_report(runs("mpper", (0, None, None)), -200.0)
    assert "- mpper: 0/1 reached -200, median wall inf s, median env steps inf" in lines
    assert not any("against" in line for line in lines)
    unreached = peer_runs.solve_report(runs("mpper", (0, None, None)) + runs(peer_runs.LIGHTZERO, (0, 9.0, 90)), -200.0)
    assert "\nmpper against LightZero 0.2.0, medians: wall time -, env steps -" in unreached


def test_earlier_runs_takes_the_peers_runs_of_the_seeds_and_refuses_a_missing_seed(tmp_path):
    saved = tmp_path / "earlier.json"
    saved.write_text(
        '[{"system": "SB3 SAC", "seed": 0}, {"system": "SB3 SAC", "seed": 1}, {"system": "mpper", "seed": 0}]'
    )
    assert peer_runs.earlier_runs(str(saved), "SB3 SAC", [1]) == [{"system": "SB3 SAC", "seed": 1}]
    assert peer_runs.earlier_runs(None, "SB3 SAC", [1]) == []
    with pytest.raises(SystemExit, match=r"no SB3 SAC run of seeds \[2\]"):
        peer_runs.earlier_runs(str(saved), "SB3 SAC", [0, 2])


def test_sac_summary_and_table_give_final_best_and_time_to_the_solve_return():
    final = {"mean_return": 990.0, "episodes": 10}
    sac = sac_mujoco.summary(
        {
            "system": "SB3 SAC",
            "seed": 0,
            "final": final,
            "end": {"time_s": 900.0, "env_steps": 52_000, "training_steps": 51_900},
            "curve": curve((30.0, 3000, 200.0), (60.0, 6000, 1000.0), (90.0, 9000, 960.0)),
        },
        950.0,
    )
    assert sac["solved"] and (sac["solve_wall_s"], sac["solve_env_steps"]) == (60.0, 6000)
    assert sac["best"] == {"mean_return": 1000.0, "time_s": 60.0, "env_steps": 6000}
    cut = sac_mujoco.summary({"system": "mpper", "seed": 0, "final": None, "end": None, "curve": []}, 950.0)
    assert cut["solved"] is False and cut["best"] is None
    lines = sac_mujoco.table([sac, cut], 950.0)
    assert lines[0].endswith("| time to 950 (s, env steps) |")
    assert "| 0 | SB3 SAC | 990.0 (10 episodes) | 52,000 | 51,900 | 1000.0 @ 60 s, 6,000 | 60, 6,000 |" in lines
    assert "| 0 | mpper | - | - | - | - | not reached |" in lines
    assert "- SB3 SAC: 1/1 seeds reached 950" in lines and "- mpper: 0/1 seeds reached 950" in lines
    no_solve = sac_mujoco.summary({"system": "SB3 SAC", "seed": 1, "final": final, "end": None, "curve": []}, None)
    assert "solved" not in no_solve and "time to" not in sac_mujoco.table([no_solve], None)[0]
