"""``training.lr_drop_return`` and the weights history (``runtime.weights_history_interval_steps``).

Once an evaluation's mean greedy return reaches ``lr_drop_return``, the evaluator marks
the weight store, and the learner multiplies its learning rate by
``training.lr_drop_factor`` from its next update on, for the rest of the run (kept in
``checkpoint.pt``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpper.algos.configs import config_from_dict
from mpper.algos.registry import algorithm_of
from mpper.checkpoint import load_checkpoint
from mpper.runtime.weights import WeightStore

ROOT = Path(__file__).resolve().parents[2]


def test_the_weight_store_keeps_the_first_mark_and_every_process_sees_it():
    store = WeightStore.create(4)
    try:
        assert store.return_reached_at is None
        store.mark_return_reached(0)  # the first weights can be the ones that reached it
        store.mark_return_reached(750)
        assert store.return_reached_at == 0
        other = WeightStore.attach(store.handle)
        try:
            assert other.return_reached_at == 0
        finally:
            other.close()
    finally:
        store.close()


def _trainer(**training):
    config = config_from_dict({"env": {"id": "CartPole-v1"}, "training": training}, check_env=False)
    algorithm = algorithm_of(config)
    return algorithm.make_trainer(config, algorithm.make_network(config, (4,), 2), torch.device("cpu"))


def test_the_learning_rate_drops_once_from_the_step_it_was_asked_and_a_checkpoint_keeps_it():
    trainer = _trainer(lr_init=0.02, lr_decay_rate=0.8, lr_decay_steps=1000, lr_drop_factor=0.25)
    trainer.training_step = 300
    assert trainer.learning_rate() == pytest.approx(0.02 * 0.8 ** (300 / 1000))
    trainer.drop_learning_rate()
    trainer.training_step = 500
    trainer.drop_learning_rate()  # a second call changes nothing: the drop stays at step 300
    assert trainer.lr_drop_step == 300
    assert trainer.learning_rate(299) == pytest.approx(0.02 * 0.8 ** (299 / 1000))
    assert trainer.learning_rate() == pytest.approx(0.25 * 0.02 * 0.8 ** (500 / 1000))
    resumed = _trainer(lr_init=0.02, lr_decay_rate=0.8, lr_decay_steps=1000, lr_drop_factor=0.25)
    resumed.load_state_dict(trainer.state_dict())
    assert resumed.lr_drop_step == 300 and resumed.learning_rate() == pytest.approx(trainer.learning_rate())
    undropped = _trainer()
    state = undropped.state_dict()
    assert "lr_drop_step" not in state  # checkpoints of runs without a drop read as before
    undropped.load_state_dict(state)
    assert undropped.lr_drop_step is None


@pytest.fixture(scope="module", params=[0, 1], ids=["workers0", "workers1"])
def short_run(request, tmp_path_factory) -> Path:
    """A short CartPole run with a drop threshold every evaluation reaches (a CartPole mean
    is at least 8) and a weights history every 100 steps, with worker processes (the
    evaluator process marks the store, the learner process reads it) and in turns."""
    run_dir = tmp_path_factory.mktemp(f"lr-drop-workers{request.param}") / "run"
    argv = [sys.executable, "run.py", "--config", "cartpole", "--device", "cpu", "--workers", str(request.param),
            "--run-dir", str(run_dir), "--max-train-steps", "300", "--time-limit", "300",
            "--set", "training.lr_drop_return=1", "--set", "runtime.weights_history_interval_steps=100",
            "--set", "training.min_buffer_steps=100", "--set", "training.batch_size=16",
            "--set", "mcts.num_simulations=4", "--set", "runtime.envs_per_worker=2",
            "--set", "runtime.evaluation_episodes=2", "--set", "runtime.evaluation_interval_s=0.5",
            "--set", "runtime.log_interval_s=0.2", "--set", "runtime.solve_return=null",
            "--set", "training.samples_per_insert=null"]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=390, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_drops_its_learning_rate_after_the_evaluation_that_reached_the_return(short_run):
    """The learner's rate is the schedule's until the first evaluation, a tenth of it after."""
    records = [json.loads(line) for line in (short_run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["evaluation"]["training_step"] for r in records if r["event"] == "evaluation"]
    assert evaluated, "no evaluation was recorded"
    state = load_checkpoint(short_run / "checkpoint.pt")
    drop_step = state["lr_drop_step"]
    assert evaluated[0] <= drop_step <= state["training_step"]

    def schedule(step: int) -> float:  # the config's lr_init 0.02, decay 0.8 per 1,000 steps
        return 0.02 * 0.8 ** (step / 1000)

    learner = [r["learner"] for r in records if "lr" in (r.get("learner") or {})]
    # a learner record's lr is the one of its last update, the one that made step - 1 step
    ratios = {round(m["lr"] / schedule(m["training_step"] - 1), 6) for m in learner}
    assert ratios <= {1.0, 0.1} and 0.1 in ratios, ratios
    assert all(m["lr"] == pytest.approx(0.1 * schedule(m["training_step"] - 1)) for m in learner
               if m["training_step"] - 1 >= drop_step)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_weights_history_keeps_every_hundredth_step_as_a_checkpoint_evaluate_reads(short_run):
    """runtime.weights_history_interval_steps=100: weights/step-<step>.pt for steps 100,
    200, 300, each the network of its step, which --evaluate --checkpoint plays."""
    kept = sorted(p.name for p in (short_run / "weights").iterdir())
    assert kept == ["step-00000100.pt", "step-00000200.pt", "step-00000300.pt"]
    states = [load_checkpoint(short_run / "weights" / name) for name in kept]
    assert [s["training_step"] for s in states] == [100, 200, 300]
    assert not torch.equal(states[0]["network"]["representation_network.0.weight"],
                           states[2]["network"]["representation_network.0.weight"])  # fmt: skip
    proc = subprocess.run([sys.executable, "run.py", "--evaluate", str(short_run), "--checkpoint",
                           str(short_run / "weights" / kept[1]), "--episodes", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((short_run / "evaluation.json").read_text())["training_step"] == 200
