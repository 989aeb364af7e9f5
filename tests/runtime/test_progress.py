"""The progress line (mpper/runtime/progress.py): its worst-case width for every kind of
evaluation, the time left against the nearest stop, "stalled", and plain lines when
stderr is not a terminal."""

from __future__ import annotations

import io

import pytest

from mpper.algos.configs import load_config
from mpper.runtime.progress import (
    LINE_WIDTH,
    STALLED_AFTER_S,
    Budget,
    ProgressFigures,
    ProgressLine,
    format_number,
    progress_text,
    seconds_left,
)
from mpper.runtime.run import Run

# The evaluation records each algorithm's evaluator produces, at their widest: returns
# and bounds of many digits, a confirmed solve, and (two-player) the most games and the
# longest opponent name.
MUZERO_EVALUATIONS = [
    {"training_step": 9_999_999, "mean_return": -123456789.123, "returns": [0.0] * 10},
    {"training_step": 9_999_999, "mean_return": 500.0, "returns": [500.0] * 30,
     "confirmation": {"episodes": 20, "mean_return": 500.0}},
    {"training_step": 9_999_999, "stopped_early": True, "mean_return_at_most": -98765.4321, "returns": [1.0]},
]  # fmt: skip
DQN_EVALUATIONS = [{"training_step": 9_999_999, "mean_return": -1e300, "returns": [-1e300]},
                   {"training_step": 9_999_999, "mean_return": 1e-7, "returns": [1e-7]}]  # fmt: skip
TICTACTOE_EVALUATIONS = [{
    "training_step": 9_999_999, "mean_return": -1.0, "against": "an-opponent-with-a-very-long-name",
    "opponents": {
        "random": {"first": {"wins": 5000, "draws": 0, "losses": 0}, "second": {"wins": 5000, "draws": 0, "losses": 0}},
        "an-opponent-with-a-very-long-name": {"first": {"wins": 99999, "draws": 99999, "losses": 99999},
                                              "second": {"wins": 99999, "draws": 99999, "losses": 99999}},
    },
}]  # fmt: skip


def widest(evaluation: dict, stalled: bool) -> str:
    figures = ProgressFigures(elapsed_s=10**9, training_step=9_999_999_999, env_steps=10**13, buffer_fill=1.0,
                              evaluation=evaluation, loss=-1.23456789e30, learner_state="training",
                              budgets=[Budget("training steps", 1, 10**12, "training_steps"),
                                       Budget("env steps", 1, 10**15, "env_steps")])  # fmt: skip
    return progress_text(figures, train_rate=1e-9, env_rate=-1.5e25, stalled_s=10**9 if stalled else None)


@pytest.mark.parametrize("evaluation", MUZERO_EVALUATIONS + DQN_EVALUATIONS + TICTACTOE_EVALUATIONS)
@pytest.mark.parametrize("stalled", [False, True])
def test_the_widest_line_fits_100_columns_and_shows_the_evaluation(evaluation, stalled):
    line = widest(evaluation, stalled)
    assert len(line) <= LINE_WIDTH, (len(line), line)
    eval_field = line.split(" | ")[1]
    if "opponents" in evaluation:
        assert eval_field == "eval -1.00 an-opponen 199998/199998/199998"
    elif evaluation.get("stopped_early"):
        assert eval_field == "eval <-98.8k"
    else:
        assert eval_field == f"eval {format_number(evaluation['mean_return'])}"
    assert ("stalled" in line) == stalled


@pytest.mark.parametrize("evaluation,shown", [
    ({"mean_return": 500.0}, "eval 500.0"), ({"mean_return": -20.5}, "eval -20.5"),
    ({"opponents": {"random": {"first": {"wins": 5, "draws": 0, "losses": 0},
                               "second": {"wins": 4, "draws": 1, "losses": 0}},
                    "perfect": {"first": {"wins": 0, "draws": 5, "losses": 0},
                                "second": {"wins": 0, "draws": 4, "losses": 1}}}, "mean_return": -0.1},
     "eval -0.10 perfect 0/9/1"),
])  # fmt: skip
def test_a_typical_line_has_every_field_once(evaluation, shown):
    figures = ProgressFigures(elapsed_s=161, training_step=1060, env_steps=52_000, buffer_fill=0.12,
                              evaluation=evaluation, loss=0.412, learner_state="training",
                              budgets=[Budget("training steps", 1060, 20_000, "training_steps"),
                                       Budget("time limit", 161, 600, "seconds")])  # fmt: skip
    line = progress_text(figures, train_rate=8.4, env_rate=2100.0, stalled_s=None)
    # the time limit (439 s) is nearer than the training steps ((20000 - 1060) / 8.4 s)
    fields = ["2:41 step 1060", shown, "loss 0.412", "train 8.40/s", "env 2.10k/s", "buf 12%", "left 7:19"]
    if "opponents" in evaluation:  # the longer evaluation leaves no room for the buffer's fill
        fields.remove("buf 12%")
    assert line == " | ".join(fields) and len(line) <= LINE_WIDTH
    assert line.count("/s") == 2  # one training speed, one env speed


def test_time_left_is_the_nearest_of_the_run_budgets():
    assert seconds_left([], {}) is None
    budgets = [Budget("training steps", 100, 1100, "training_steps"), Budget("time limit", 50, 1000, "seconds")]
    assert seconds_left(budgets, {"training_steps": 10.0}) == 100.0  # 1000 steps at 10/s, before 950 s
    assert seconds_left(budgets, {"training_steps": 1.0}) == 950.0  # the time limit comes first
    assert seconds_left(budgets, {"training_steps": None}) == 950.0  # no rate yet: the time limit alone
    assert seconds_left(budgets[:1], {"training_steps": None}) is None
    env_budget = Budget("env steps", 9_000, 10_000, "env_steps")  # one more (done, total) entry
    assert seconds_left(budgets + [env_budget], {"training_steps": 10.0, "env_steps": 100.0}) == 10.0
    assert seconds_left([Budget("time limit", 700, 600, "seconds")], {}) == 0.0


def test_the_run_lists_its_time_limit_and_training_steps_as_budgets(tmp_path):
    config = load_config("configs/cartpole.json", ["runtime.time_limit_s=600"], training_steps=3000)
    budgets = Run(config, tmp_path).budgets(training_step=1000, env_steps=5)
    assert [(b.name, b.done, b.total, b.counts) for b in budgets if b.counts != "seconds"] == [
        ("training steps", 1000, 3000, "training_steps")]
    (limit,) = [b for b in budgets if b.counts == "seconds"]
    assert limit.total == 600 and 0 <= limit.done < 60
    assert [b.counts for b in Run(load_config("configs/cartpole.json"), tmp_path).budgets(0, 0)] == ["training_steps"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def figures(step: int, state: str = "training") -> ProgressFigures:
    return ProgressFigures(elapsed_s=0, training_step=step, env_steps=step * 10, buffer_fill=0.5,
                           evaluation={"mean_return": 12.0}, loss=1.0, learner_state=state)  # fmt: skip


def test_a_learner_without_a_new_step_is_shown_as_stalled_not_at_its_last_rate():
    clock = Clock()
    line = ProgressLine(io.StringIO(), clock)
    assert "train wait" in line.text(figures(0, "waiting_for_data"))  # no step yet: waiting for data
    for step in range(1, 11):  # 10 steps in 10 s
        clock.now += 1
        text = line.text(figures(step))
    assert "train 1.00/s" in text and "stalled" not in text
    clock.now += STALLED_AFTER_S - 1
    assert "train 0.0333/s" in line.text(figures(10))  # not yet: one step in the last 30 s
    clock.now += 1
    text = line.text(figures(10))
    assert f"stalled {STALLED_AFTER_S:.0f}s" in text and "train" not in text
    clock.now += 95
    assert "stalled 2m05s" in line.text(figures(10))
    clock.now += 1
    assert "stalled" not in line.text(figures(11))  # a new step ends it
    clock.now += 100
    assert "stalled" not in line.text(figures(11, "done"))  # the learner finished: not stalled
    resumed = ProgressLine(io.StringIO(), clock)  # a resumed run's learner waits for data at its old step
    for _ in range(2):  # a wait for data, then a stall; and again: each wait restarts the clock
        clock.now += 100
        assert "train wait" in resumed.text(figures(11, "waiting_for_data"))
        clock.now += 1
        assert "stalled" not in resumed.text(figures(11))  # its wait ended a moment ago: not stalled yet
        clock.now += STALLED_AFTER_S
        assert "stalled" in resumed.text(figures(11))


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_piped_it_prints_plain_lines_at_the_log_interval_only():
    clock = Clock()
    out = io.StringIO()
    line = ProgressLine(out, clock)
    for step in range(5):
        clock.now += 1
        line.update(figures(step), log=step % 2 == 0)
    line.clear()
    lines = out.getvalue().split("\n")
    assert len(lines) == 4 and lines[-1] == ""  # steps 0, 2 and 4, each a whole line
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert [ln.split(" | ")[0] for ln in lines[:3]] == ["0:00 step 0", "0:00 step 2", "0:00 step 4"]


def test_on_a_terminal_it_rewrites_one_line():
    clock = Clock()
    out = Terminal()
    line = ProgressLine(out, clock)
    for step in range(3):
        clock.now += 1
        line.update(figures(step))
    line.clear()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")
    assert all(len(part.split("\x1b")[0]) <= LINE_WIDTH for part in text.split("\r")[1:])
