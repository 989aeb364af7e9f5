"""bench/holds_peers.py's judgement of a peer's evaluations by bench/holds.py's rule."""

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import holds  # noqa: E402
import holds_peers  # noqa: E402

ARGS = argparse.Namespace(target=475.0, past_solve=1000, final_episodes=4, hold_share=0.9)


def evals(*points: tuple[int, float]) -> list[dict]:
    """Evaluations at (training step, mean return), one second apart."""
    return [{"time_s": float(i), "training_step": step, "mean_return": mean} for i, (step, mean) in enumerate(points)]


def test_unsolved_seed_has_no_solve_fields_and_does_not_hold():
    row = holds_peers.judge(3, evals((0, 20.0), (500, 300.0)), None, ARGS, wall_s=9.0)
    assert row["solved"] is False and "solve_training_step" not in row
    assert row["wall_s"] == 9.0 and row["curve"] == [(0.0, 0, 20.0), (1.0, 500, 300.0)]
    assert not holds.holds(row, ARGS)
    assert "| 3 | not solved" in holds.report([row], ARGS, "cmd")


def test_share_worst_and_final_are_judged_up_to_the_final_weights_only():
    points = evals((0, 10.0), (500, 480.0), (1000, 500.0), (1500, 400.0), (2000, 500.0), (2500, 12.0))
    final = {"training_step": 1500, "returns": [500.0, 500.0, 500.0, 400.0]}
    row = holds_peers.judge(0, points, final, ARGS)
    assert (row["solve_training_step"], row["solve_time_s"]) == (500, 1.0)
    # after the solve at 500, up to the final weights at 1,500: 500.0 and 400.0 (2,000 and 2,500 are past the stop)
    assert row["evaluations_after"] == 2 and row["share_after_at_target"] == 0.5 and row["worst_after"] == 400.0
    assert row["final"] == {"training_step": 1500, "mean_return": 475.0, "min_return": 400.0, "episodes": 4}
    assert row["past_solve_reached"] is True
    assert not holds.holds(row, ARGS)  # half the later evaluations fell below the target


def test_seed_holds_when_every_later_evaluation_and_the_final_weights_reach_the_target():
    points = evals((0, 10.0), (500, 475.0), (1000, 500.0), (1500, 490.0))
    row = holds_peers.judge(1, points, {"training_step": 1500, "returns": [500.0] * 4}, ARGS)
    assert row["share_after_at_target"] == 1.0 and holds.holds(row, ARGS)
    assert "| 1 | 1.0, 500 | 2 | 100% | 490.0 | 1,500, 500.0 (500) | yes |" in holds.report([row], ARGS, "cmd")


def test_solved_seed_that_did_not_get_past_the_solve_does_not_hold_even_when_every_evaluation_did():
    row = holds_peers.judge(2, evals((0, 10.0), (500, 500.0), (1000, 500.0)), None, ARGS)
    assert row["past_solve_reached"] is False and "final" not in row
    assert row["evaluations_after"] == 1 and row["share_after_at_target"] == 1.0
    assert not holds.holds(row, ARGS)


def test_notes_say_how_far_a_seed_got_that_the_rule_could_not_judge_whole():
    unsolved = holds_peers.judge(5, evals((0, 10.0)), None, ARGS, training_steps_trained=800)
    short = holds_peers.judge(6, evals((0, 10.0), (500, 500.0)), None, ARGS, training_steps_trained=900,
                              evaluation_cut_by_time_limit=True,
                              final_weights_partial={"training_step": 1500, "returns": [500.0, 300.0]})  # fmt: skip
    whole = holds_peers.judge(7, evals((500, 500.0), (1500, 500.0)), {"training_step": 1500, "returns": [500.0]}, ARGS)
    assert holds_peers.notes([unsolved, short, whole], ARGS) == [
        "- seed 5: no evaluation reached 475, trained to training step 800",
        "- seed 6: no final weights 1,000 training steps past the solve (last judged evaluation at training step 500, "
        "trained to training step 900)",
        "- seed 6: playing the saved weights was cut by the time limit",
        "- seed 6: final weights (training step 1,500) played 2 of 4 episodes before the time limit, mean 400.0",
    ]
