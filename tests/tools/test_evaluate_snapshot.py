"""`python run.py --evaluate RUN_DIR --on-snapshot SNAPSHOT_DIR` on a real run, against a
plain loop: targets from tests/seed_reference.py (float64), the network one position at
a time."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import seed_reference as ref
import torch

from mpper import config as mpper_config
from mpper import load_snapshot
from mpper.algos.configs import load_config
from mpper.algos.muzero.networks import make_network, support_to_scalar
from mpper.algos.registry import ALGORITHMS
from mpper.checkpoint import load_checkpoint
from mpper.cli import main
from mpper.replay.positions import all_positions
from mpper.tools.evaluate_snapshot import evaluate_on_snapshot, format_table

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def run(trained_run, tmp_path):
    """A copy of the shared run: the evaluation writes snapshot_evaluation.json into it."""
    return shutil.copytree(trained_run, tmp_path / "run")


def reference_errors(run_dir) -> dict:
    """Per unroll step k, the lists of value / reward errors and policy KLs, one position
    and one step at a time, counting only steps on stored data (see evaluate_muzero)."""
    config = load_config(run_dir / "config.json")
    t = config.muzero
    K, S = t.num_unroll_steps, config.network.support_size
    network = make_network(config.network, (4,), 2, t.stacked_observations)
    network.load_state_dict(load_checkpoint(run_dir / "checkpoint.pt")["network"])
    network.eval()
    errors = {"value": [[] for _ in range(K + 1)], "reward": [[] for _ in range(K + 1)],
              "kl": [[] for _ in range(K + 1)]}  # fmt: skip
    with load_snapshot(run_dir / "buffer") as buf, torch.no_grad():
        for episode_ref in buf.episodes():
            ep = buf.read_episode(episode_ref)
            T = episode_ref.rows - 1
            for pos in range(T):
                values, rewards, policies, actions = ref.make_target(ep, pos, K, t.td_steps, config.mcts.discount, 2)
                out = network.initial_inference(torch.as_tensor(ep["observation"][pos : pos + 1]))
                for k in range(K + 1):
                    if pos + k > T:
                        break  # past the end: made-up targets, not counted
                    if k > 0:
                        out = network.recurrent_inference(out.hidden_state, torch.tensor([actions[k]]))
                        errors["reward"][k].append(abs(float(support_to_scalar(out.reward_logits, S)) - rewards[k]))
                    if pos + k < T:
                        errors["value"][k].append(abs(float(support_to_scalar(out.value_logits, S)) - values[k]))
                        q = torch.softmax(out.policy_logits, 1)[0].double().numpy()
                        p = policies[k]
                        errors["kl"][k].append(float(np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1) / q), 0))))
    return errors


@pytest.mark.slow
def test_on_snapshot_matches_a_plain_loop_over_every_position(run, capsys):
    assert main(["--evaluate", str(run), "--on-snapshot", str(run / "buffer")]) == 0
    out = capsys.readouterr().out
    report = json.loads((run / "snapshot_evaluation.json").read_text())
    with load_snapshot(run / "buffer") as buf:
        assert report["positions"] == len(buf) > 0 and report["episodes"] == len(buf.episodes())
        assert np.isfinite(buf.fields["reanalysed_value"]).any()  # value targets use reanalysed values too
    assert report["training_step"] == 40 and report["algorithm"] == "muzero"
    expected = reference_errors(run)
    K = report["num_unroll_steps"]
    assert len(report["per_step"]) == K + 1
    for k, row in enumerate(report["per_step"]):
        assert row["k"] == k
        assert row["positions"] == len(expected["value"][k]) and row["reward_positions"] == len(expected["reward"][k])
        assert row["value_error"] == pytest.approx(np.mean(expected["value"][k]), rel=1e-4)
        assert row["policy_kl"] == pytest.approx(np.mean(expected["kl"][k]), rel=1e-3, abs=1e-6)
        if k == 0:
            assert row["reward_error"] is None and row["reward_positions"] == 0  # step 0 predicts no reward
        else:
            assert row["reward_error"] == pytest.approx(np.mean(expected["reward"][k]), rel=1e-4)
        assert row["policy_cross_entropy"] >= row["policy_kl"] - 1e-6  # CE = KL + entropy of the target
    overall = report["overall"]
    assert overall["value_error"] == pytest.approx(np.mean(np.concatenate(expected["value"])), rel=1e-4)
    assert overall["reward_error"] == pytest.approx(np.mean(np.concatenate(expected["reward"][1:])), rel=1e-4)
    assert overall["positions"] == sum(len(v) for v in expected["value"])
    # the printed table: one header, K + 1 steps and the overall row
    table = out.split("\n", 1)[1].split("written:")[0].strip().splitlines()
    assert len(table) == K + 3 and table[0].split()[:3] == ["k", "positions", "value_error"]
    assert table[-1].split()[0] == "all" and f"training step 40 on {run / 'buffer'}" in out


def test_batch_size_does_not_change_the_result(run):
    whole = evaluate_on_snapshot(run, run / "buffer")
    small = evaluate_on_snapshot(run, run / "buffer", batch_size=50)  # batches cut through episodes
    for a, b in zip(whole["table"], small["table"]):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == (pytest.approx(b[key], rel=1e-5) if isinstance(a[key], float) else b[key])


def test_every_position_once_and_one_function_per_algorithm(run, monkeypatch, capsys):
    """The dispatch: an algorithm's evaluator gets every stored position once, and its
    rows become the table and the JSON (what a DQN evaluator will plug into)."""
    seen = {}

    def fake(snapshot_run) -> dict:
        p = snapshot_run.positions
        seen.update(slots=p.slots.copy(), pos=p.pos, moves=p.moves, batches=[len(b) for b in p.batches(64)])
        snapshot_run.advance(len(p))
        return {"table": [{"statistic": "mean", "td_error": 0.25}], "extra": [1, 2]}

    muzero = ALGORITHMS["muzero"]
    monkeypatch.setitem(ALGORITHMS, "muzero", dataclasses.replace(muzero, evaluate_snapshot=fake))
    assert main(["--evaluate", str(run), "--on-snapshot", str(run / "buffer")]) == 0
    assert "statistic  td_error\n     mean      0.25" in capsys.readouterr().out
    report = json.loads((run / "snapshot_evaluation.json").read_text())
    assert report["extra"] == [1, 2] and report["positions"] == len(seen["slots"])
    with load_snapshot(run / "buffer") as buf:
        stored = np.concatenate([np.arange(r.start, r.start + r.rows - 1) for r in buf.episodes()])
        assert np.array_equal(np.sort(seen["slots"]), np.sort(stored))  # every position, once
        assert sum(seen["batches"]) == len(stored) and max(seen["batches"]) == 64
        info_pos = buf._info[seen["slots"]] >> 32  # the position each slot's record holds
        assert np.array_equal(seen["pos"], info_pos) and (seen["pos"] < seen["moves"]).all()
        assert np.array_equal(all_positions(buf).slots, seen["slots"])


@pytest.mark.slow
def test_a_run_whose_learner_was_on_a_gpu_is_read_without_one(run, monkeypatch, capsys):
    """The run's config names its learner's device; reading the run needs none: on a
    machine without CUDA, --evaluate and --on-snapshot read a run that trained on "cuda",
    while --resume (which trains) still names the missing device."""
    monkeypatch.setattr(mpper_config.schema, "_cuda_available", lambda: False)
    config = json.loads((run / "config.json").read_text())
    config["runtime"]["device"] = "cuda"
    (run / "config.json").write_text(json.dumps(config))
    assert main(["--evaluate", str(run), "--episodes", "2"]) == 0
    assert len(json.loads((run / "evaluation.json").read_text())["returns"]) == 2
    assert main(["--evaluate", str(run), "--on-snapshot", str(run / "buffer")]) == 0
    capsys.readouterr()
    assert main(["--resume", str(run)]) == 2
    assert 'runtime.device: "cuda" but torch.cuda.is_available() is false' in capsys.readouterr().err


def test_format_table_aligns_columns():
    rows = [{"k": 0, "error": 1.23456, "n": 1200, "r": None}, {"k": "all", "error": 10.0, "n": 5, "r": 2.5}]
    text = format_table(rows)
    assert text.splitlines() == ["  k  error      n    r", "  0  1.235  1,200    -", "all     10      5  2.5"]
