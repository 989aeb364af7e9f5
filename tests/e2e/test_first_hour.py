"""A new user's first hour, end to end, as the README tells it, in an empty directory:

1. the installed ``mpper`` command is there;
2. a script trains CartPole from Python with ``mpper.train`` (videos of every third
   evaluation switched on);
3. ``mpper.load(run).act`` scores >= 475 on 10 fresh episodes when the run solved (it must:
   CartPole's config solves within minutes on two cores); the episodes are played side by
   side, their observations in one batch per move;
4. ``mpper --evaluate RUN`` judges the solving weights (``best.pt``) and reports their return;
5. a custom env from the current directory (docs/custom_envs.md's ``myenv.py``) trains;
6. the MP4s of the evaluations exist and decode;
7. ``metrics.csv`` and TensorBoard hold one point per evaluation, as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MPPER = Path(sys.executable).parent / "mpper"  # the console script `pip install` puts beside python
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN_SCRIPT = textwrap.dedent('''
    import json

    import gymnasium as gym
    import numpy as np

    import mpper

    if __name__ == "__main__":
        run = mpper.train("cartpole", workers=2, device="cpu", time_limit=300, run_dir="runs/cartpole",
                          overrides={"runtime.solve_confirm_episodes": 20, "runtime.video_every_evaluations": 3})
        agent = mpper.load(run.dir)
        envs = [gym.make("CartPole-v1") for _ in range(10)]
        observations = [env.reset(seed=10_000 + i)[0] for i, env in enumerate(envs)]
        returns, playing = [0.0] * 10, list(range(10))
        while playing:  # the 10 episodes side by side: one batched act() per move
            actions = agent.act(np.stack([observations[i] for i in playing]))
            for i, action in zip(list(playing), actions):
                observations[i], reward, terminated, truncated, _ = envs[i].step(int(action))
                returns[i] += reward
                if terminated or truncated:
                    playing.remove(i)
        json.dump({"dir": str(run.dir), "solved": run.solved, "solved_at": run.solved_at, "best": {
            "path": str(run.best["path"]), "training_step": run.best["training_step"],
            "mean_return": run.best["mean_return"]}, "checkpoint": str(agent.checkpoint),
            "agent_training_step": agent.training_step, "last_checkpoint": str(run.agent("last").checkpoint),
            "last_event": run.metrics[-1]["event"], "returns": returns}, open("result.json", "w"))
''')


def doc_block(name: str) -> str:
    """The fenced block of docs/custom_envs.md whose info string names ``name``."""
    text = (ROOT / "docs" / "custom_envs.md").read_text()
    return text.split(f" {name}\n", 1)[1].split("\n```", 1)[0]


def run(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def first_hour(tmp_path_factory):
    """Steps 1-5 in one fresh directory; returns (the directory, train.py's result, the
    ``--evaluate`` output)."""
    home = tmp_path_factory.mktemp("first-hour")
    assert MPPER.is_file(), f"no mpper command beside {sys.executable}: is the package installed?"
    (home / "train.py").write_text(TRAIN_SCRIPT)
    trained = run(home, sys.executable, "train.py")
    result = json.loads((home / "result.json").read_text())
    result["last_line"] = trained.stdout.strip().splitlines()[-1]
    evaluated = run(home, str(MPPER), "--evaluate", "runs/cartpole", "--episodes", "3")
    (home / "myenv.py").write_text(doc_block("myenv.py"))
    (home / "corridor.json").write_text(doc_block("corridor.json"))
    # no solve rule: a fresh network may walk the corridor greedily at once, before any training
    run(home, str(MPPER), "--config", "./corridor.json", "--workers", "1", "--max-train-steps", "40",
        "--set", "runtime.solve_return=null", "--run-dir", "runs/corridor")  # fmt: skip
    return home, result, evaluated.stdout


def test_the_run_solves_and_its_best_agent_plays_fresh_episodes(first_hour):
    home, result, _ = first_hour
    assert result["solved"] and result["solved_at"]["mean_return"] >= 475, result
    at = home / "runs" / "cartpole"  # the script named it relative to its directory
    assert home / result["checkpoint"] == home / result["best"]["path"] == at / "best.pt"
    assert result["agent_training_step"] == result["best"]["training_step"] and result["last_event"] == "end"
    assert home / result["last_checkpoint"] == at / "checkpoint.pt"
    assert np.mean(result["returns"]) >= 475, result["returns"]
    # the run's last line names the weights that judge it
    assert f"best weights {result['best']['path']} (mean greedy return {result['best']['mean_return']:g}" \
        in result["last_line"], result["last_line"]  # fmt: skip


def test_evaluate_reports_the_solving_weights_and_their_return(first_hour):
    home, result, printed = first_hour
    best = result["best"]
    first = printed.splitlines()[0]
    assert f"(training step {best['training_step']}; the run's best evaluation, mean return {best['mean_return']:g})" \
        in first, first  # fmt: skip
    evaluation = json.loads((home / "runs" / "cartpole" / "evaluation.json").read_text())
    assert evaluation["checkpoint"].endswith("best.pt") and evaluation["checkpoint_evaluation"] >= 475


def test_a_custom_env_from_the_current_directory_trains(first_hour):
    home, _, _ = first_hour
    records = [json.loads(line) for line in (home / "runs" / "corridor" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "end" and records[-1]["learner"]["training_step"] == 40
    assert json.loads((home / "runs" / "corridor" / "config.json").read_text())["env"]["id"] == "myenv:make_corridor"


def test_the_evaluations_videos_exist_and_decode(first_hour):
    import imageio_ffmpeg

    home, _, _ = first_hour
    videos = sorted((home / "runs" / "cartpole" / "videos").glob("*.mp4"))
    assert videos, "no video written"
    reader = imageio_ffmpeg.read_frames(str(videos[-1]))
    meta = next(reader)
    frames = list(reader)
    assert meta["size"] == (600, 400) and len(frames) >= 2  # CartPole's frames: the reset and its moves


def test_csv_and_tensorboard_hold_one_point_per_evaluation(first_hour):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    home, _, _ = first_hour
    run_dir = home / "runs" / "cartpole"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if r["event"] == "evaluation" and "mean_return" in r["evaluation"]]
    assert len(evaluations) >= 2
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["event"] == "evaluation"]
    assert [float(row["evaluation/mean_return"]) for row in rows if row["evaluation/mean_return"]] == \
        pytest.approx([r["evaluation"]["mean_return"] for r in evaluations])  # fmt: skip
    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    points = acc.Scalars("evaluation/mean_return")
    assert [p.value for p in points] == pytest.approx([r["evaluation"]["mean_return"] for r in evaluations])
