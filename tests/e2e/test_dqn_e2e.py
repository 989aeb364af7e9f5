"""DQN end to end: `python run.py --config configs/cartpole_dqn.json` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_e2e import check_outputs

from mpper import ReplayBuffer
from mpper.algos.configs import load_config
from mpper.cli import main
from mpper.config_files import read_config_file

ROOT = Path(__file__).resolve().parents[2]
SMALL_DQN = [
    "--set", "training.min_buffer_steps=200", "--set", "training.batch_size=32",
    "--set", "runtime.envs_per_worker=2", "--set", "replay.capacity=20000",
    "--set", "runtime.evaluation_interval_s=1", "--set", "runtime.evaluation_episodes=2",
    "--set", "runtime.log_interval_s=1", "--set", "training.publish_interval=5",
    "--set", "env.max_episode_steps=100", "--set", "runtime.solve_return=null",
]  # fmt: skip


def dqn_args(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "run.py", "--config", "configs/cartpole_dqn.json", "--device", "cpu",
            "--run-dir", str(run_dir), *SMALL_DQN, *extra]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dqn_with_two_workers_trains_and_everything_is_saved(tmp_path):
    run_dir = tmp_path / "run"
    args = dqn_args(run_dir, "--workers", "2", "--max-train-steps", "150", "--set", "training.samples_per_insert=8")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "training finished (150 steps)" in proc.stdout
    out = check_outputs(run_dir)
    c = out["counters"]
    assert c["games"] > 0 and c["steps"] >= 200
    assert c["samples"] >= 150 * 32 and c["priority_updates_applied"] > 0
    assert "reanalysed_episodes" not in c  # DQN's schema declares no reanalyse counters
    last = out["records"][-1]
    assert last["learner"]["training_step"] == 150 and "mean_q" in last["learner"]
    assert max(last["worker_weights_versions"].values()) > 1  # workers acted with new weights
    ckpt = out["checkpoint"]
    assert set(ckpt) >= {"network", "target_network", "optimizer", "training_step"}
    assert ckpt["training_step"] == 150
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        assert set(snap.fields) == {"observation", "action", "reward"}
        leaves = snap.priorities(np.arange(snap.capacity))
    assert len(np.unique(leaves[leaves > 0])) > 10  # TD priorities from actors and learner
    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == c["games"] and all(e["return"] == e["length"] for e in episodes)  # CartPole: 1 per step
    # The saved agent: --evaluate judges the best weights, and --checkpoint the last ones
    assert (run_dir / "best.pt").is_file()
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert "mean_return" in best["extra"]
    assert main(["--evaluate", str(run_dir), "--episodes", "2", "--seed", "1"]) == 0
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    assert evaluation["checkpoint"] == str(run_dir / "best.pt")
    assert evaluation["training_step"] == best["training_step"]
    assert main(["--evaluate", str(run_dir), "--episodes", "2", "--checkpoint", str(run_dir / "checkpoint.pt")]) == 0
    assert json.loads((run_dir / "evaluation.json").read_text())["training_step"] == 150
    # --on-snapshot: the TD-error distribution of the checkpoint over every stored transition,
    # checked against the actors' own per-episode TD errors (same definition, other code path)
    assert main(["--evaluate", str(run_dir), "--on-snapshot", str(run_dir / "buffer")]) == 0
    report = json.loads((run_dir / "snapshot_evaluation.json").read_text())
    rows = {r["transitions"]: r for r in report["table"]}
    from mpper.algos.dqn.dqn import QNetwork, td_errors

    config = load_config(run_dir / "config.json")
    net = QNetwork((4,), 2, list(config.dqn.hidden), config.dqn.dueling)
    net.load_state_dict(ckpt["network"])
    errors = []
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        for ref in snap.episodes():
            rows_ = {k: np.asarray(v) for k, v in snap.read_episode(ref).items()}
            errors.append(td_errors(net.eval(), rows_, ref.terminated, config.dqn.n_step, config.dqn.gamma))
    errors = np.concatenate(errors)
    assert rows["all"]["count"] == errors.size == rows["done"]["count"] + rows["not done"]["count"]
    assert rows["all"]["mean_abs_td"] == pytest.approx(errors.mean(), rel=1e-5)
    assert rows["all"]["max"] == pytest.approx(errors.max(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dqn_in_one_process_is_repeatable_and_resumes(tmp_path):
    runs = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        args = dqn_args(run_dir, "--workers", "0", "--max-train-steps", "60", "--seed", "3")
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=100)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs.append(torch.load(run_dir / "checkpoint.pt", weights_only=True))
    for key in ("network", "target_network"):
        for name, tensor in runs[0][key].items():
            assert torch.equal(tensor, runs[1][key][name]), f"{key}.{name} differs between two runs of one seed"
    # --resume continues from the checkpoint's step, with the snapshot's buffer
    run_dir = tmp_path / "a"
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        before = snap.counters
    proc = subprocess.run([sys.executable, "run.py", "--resume", str(run_dir), "--max-train-steps", "90"],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["training_step"] == 90
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        after = snap.counters
    assert after["samples"] == before["samples"] + 30 * 32  # counters continue from the snapshot's
    assert after["steps"] >= before["steps"] and after["games"] >= before["games"]


def test_shipped_dqn_configs_are_valid_and_set_every_dqn_key():
    from mpper.algos.configs import field_specs

    for name in ("cartpole_dqn.json", "cartpole_dqn_easyrl.json"):
        raw, _ = read_config_file(ROOT / "configs" / name)  # cartpole_dqn_easyrl: a diff of cartpole_dqn
        assert raw["algorithm"] == "dqn", name
        keys = {f"{s}.{k}" for s, sec in raw.items() if isinstance(sec, dict) for k in sec}
        keys |= {k for k, v in raw.items() if not isinstance(v, dict)}
        sections = ("env", "replay", "training", "runtime", "dqn")
        assert keys == {s.key for s in field_specs() if "." not in s.key or s.key.split(".")[0] in sections}, name
        config = load_config(ROOT / "configs" / name)
        assert config.algorithm == "dqn"
    seed = load_config(ROOT / "configs" / "cartpole_dqn_easyrl.json")
    # the easy-rl notebook's hyperparameters
    assert seed.dqn.hidden == [256, 256] and seed.training.lr_init == 1e-4 and seed.dqn.gamma == 0.95
    assert seed.training.batch_size == 64 and seed.replay.capacity == 100_000
    assert seed.dqn.target_update_interval == 4 and seed.dqn.exploration == "decay"
    assert (seed.dqn.epsilon_start, seed.dqn.epsilon_end, seed.dqn.epsilon_decay) == (0.95, 0.01, 500)
    assert (seed.replay.alpha, seed.replay.beta, seed.replay.priority_eps) == (0.6, 0.4, 0.01)
    assert seed.replay.beta_anneal_steps == 600 and seed.dqn.priority_clip == 1.0
    assert seed.env.max_episode_steps == 200 and seed.runtime.max_episodes == 100 and seed.runtime.workers == 1
