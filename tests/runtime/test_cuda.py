"""The CUDA learner: the same updates on the GPU as on the CPU, and a whole run with its
learner on the GPU whose checkpoint, snapshot and resume work on a machine without one.

These run only where torch sees a CUDA device; elsewhere each is skipped with the reason
(``pytest -ra`` lists it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_learner import buffer  # noqa: F401 (a fixture)
from test_learner import test_the_fused_adam_step_is_adam_with_l2_weight_decay_by_the_paper as fused_adam_by_the_paper
from test_train_e2e import ROOT, SMALL, check_outputs, complete_lines

from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of
from mpper.envs import env_spec, make_env
from mpper.runtime.run import create_buffer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: torch.cuda.is_available() is false")  # fmt: skip

CONFIGS = ["cartpole.json", "cartpole_dqn.json", "tictactoe.json", "minatar_breakout.json",
           "minatar_breakout_dqn.json"]  # fmt: skip


@pytest.fixture
def exact_float32():
    """No TF32 in matrix products and convolutions while a test compares the two devices
    (the CPU computes in full float32)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def played_buffer(config, moves: int):
    """A buffer holding at least ``moves`` moves played in the config's env by its own
    player, exploring, with a freshly initialised network (as a worker starts)."""
    algorithm, spec = algorithm_of(config), env_spec(config.env)
    buf = create_buffer(config, spec)
    torch.manual_seed(1)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions).eval()
    envs = [make_env(config.env) for _ in range(4)]
    try:
        player = algorithm.make_player(config, envs, network, explore=True, seed=1)
        while buf.counters["steps"] < moves:
            for episode in player.step(0.0):
                arrays, priorities = player.stored(episode)
                buf.add_episode(arrays, priorities=priorities, terminated=episode.terminated)
    except BaseException:
        buf.close()
        raise
    finally:
        for env in envs:
            env.close()
    return buf


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CONFIGS)
def test_updates_on_cuda_match_the_cpu(name, exact_float32):
    """Three updates of the config's own trainer, eager (SGD with momentum, so that a weight moves
    by the learning rate times its gradient and the comparison is about the gradients,
    not Adam's division by their size) on the same batches: from the same weights and
    momentum, the losses, the priorities written back and the weights after each step
    agree. Each step starts the GPU trainer from the CPU trainer's state, since float32
    sums in another order grow apart over steps of a deep network. (The captured step
    against the eager one: test_cuda_graph.py.)"""
    if name.startswith("minatar"):
        pytest.importorskip("minatar")
    config = load_config(ROOT / "configs" / name, check_env=False)
    config = dataclasses.replace(config, training=dataclasses.replace(
        config.training, batch_size=32, optimizer="sgd", momentum=0.9, lr_init=0.01, grad_clip=None, capture="off"))
    algorithm, spec = algorithm_of(config), env_spec(config.env)
    with played_buffer(config, 600) as buf:
        targets = algorithm.make_targets(config, spec.num_actions)
        batches = [buf.sample(32, 1.0, targets, np.random.default_rng(step)) for step in range(3)]
        batches = [dataclasses.replace(b, data={k: np.array(v) for k, v in b.data.items()}) for b in batches]
    torch.manual_seed(0)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions)
    on_cpu = algorithm.make_trainer(config, network, torch.device("cpu"))
    on_gpu = algorithm.make_trainer(config, copy.deepcopy(network), torch.device("cuda"))
    assert next(on_gpu.network.parameters()).is_cuda
    for step, batch in enumerate(batches):
        on_gpu.network.load_state_dict(on_cpu.network.state_dict())
        on_gpu.optimizer.load_state_dict(copy.deepcopy(on_cpu.optimizer.state_dict()))
        cpu_metrics, cpu_priorities = on_cpu.train_step(batch)
        gpu_metrics, gpu_priorities = on_gpu.train_step(batch)
        for key, value in cpu_metrics.items():
            if isinstance(value, float) and not key.endswith("_s"):
                assert gpu_metrics[key] == pytest.approx(value, rel=1e-3, abs=1e-5), (step, key)
        np.testing.assert_allclose(gpu_priorities, cpu_priorities, rtol=1e-3, atol=1e-5, err_msg=f"step {step}")
        for (key, cpu_w), gpu_w in zip(on_cpu.network.state_dict().items(), on_gpu.network.state_dict().values()):
            np.testing.assert_allclose(gpu_w.cpu().numpy(), cpu_w.numpy(), rtol=1e-3, atol=1e-5,
                                       err_msg=f"{key} after step {step}")  # fmt: skip


def test_the_fused_adam_step_on_cuda_is_adam_by_the_paper(buffer):
    """The learner's fused Adam kernel on the GPU (the configs' optimizer; the parity test
    above uses SGD) against Adam written from the paper."""
    fused_adam_by_the_paper(buffer, device="cuda")


def cpu_only() -> dict:
    """The environment of a child process that sees no GPU, as on a machine without one."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_on_cuda_leaves_what_a_machine_without_one_reads_and_resumes(tmp_path):
    """``run.py --device cuda``: the learner trains on the GPU (its reports say so), the run
    ends cleanly with everything saved; then, with the GPU hidden, the checkpoint is
    evaluated and the run resumed on the CPU from where it stopped."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "run.py", "--config", "configs/cartpole.json", "--run-dir", str(run_dir), *SMALL,
            "--workers", "2", "--max-train-steps", "60", "--seed", "0"]  # fmt: skip
    proc = subprocess.run([*args, "--device", "cuda"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    outputs = check_outputs(run_dir)
    devices = {r["learner"]["device"] for r in outputs["records"] if r.get("learner", {}).get("device")}
    assert devices and all(d.startswith("cuda") for d in devices), devices
    assert outputs["checkpoint"]["training_step"] == 60
    # Written on the CPU: the checkpoints load with plain torch.load where there is no GPU.
    for name in ("checkpoint.pt", "best.pt"):
        proc = subprocess.run([sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=True)",
                               str(run_dir / name)], capture_output=True, text=True, timeout=120, env=cpu_only())  # fmt: skip
        assert proc.returncode == 0, (name, proc.stderr[-2000:])

    proc = subprocess.run([sys.executable, "run.py", "--evaluate", str(run_dir), "--episodes", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=200, env=cpu_only())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len(json.loads((run_dir / "evaluation.json").read_text())["returns"]) == 2

    records_before = len(complete_lines(run_dir / "metrics.jsonl"))
    proc = subprocess.run([sys.executable, "run.py", "--resume", str(run_dir), "--device", "cpu",
                           "--max-train-steps", "80"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env=cpu_only())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    resumed = [json.loads(line) for line in complete_lines(run_dir / "metrics.jsonl")[records_before:]]
    assert resumed[-1]["event"] == "end" and resumed[-1]["learner"]["training_step"] == 80
    assert {r["learner"]["device"] for r in resumed if r.get("learner", {}).get("device")} == {"cpu"}
