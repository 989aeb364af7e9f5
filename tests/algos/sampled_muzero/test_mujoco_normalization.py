"""Sampled MuZero on gymnasium's MuJoCo envs: the running observation normaliser against
numpy over all the data it saw, its statistics as buffers that the optimizer leaves alone and
that the published weights and checkpoints carry, the ``mujoco`` extra's one-line refusal, and
a short HalfCheetah run with normalisation that trains, evaluates, checkpoints and resumes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpper
from mpper.algos.configs import config_from_dict, load_config
from mpper.algos.registry import get_algorithm, run_env_spec
from mpper.algos.sampled_muzero.normalizer import RunningObservationNormalizer
from mpper.checkpoint import load_checkpoint, load_network_weights, save_checkpoint
from mpper.envs import make_env
from mpper.replay.buffer import ReplayBuffer
from mpper.runtime.weights import WeightStore

ROOT = Path(__file__).resolve().parents[3]
TINY = ["runtime.device=cpu", "sampled_mcts.num_simulations=4", "sampled_mcts.num_sampled_actions=4",
        "sampled_network.hidden=[16]", "sampled_network.encoding_size=8", "runtime.envs_per_worker=2",
        "sampled_network.normalize_observations=true"]  # fmt: skip
STATISTICS = ("observation_normalizer.count", "observation_normalizer.mean", "observation_normalizer.var")


# ---- the normaliser ---------------------------------------------------------------------------------

batches = st.integers(1, 4).flatmap(lambda dim: st.lists(
    st.integers(1, 12).flatmap(lambda rows: st.lists(
        st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=dim, max_size=dim), min_size=rows, max_size=rows)),
    min_size=1, max_size=6))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(batches)
def test_the_running_statistics_are_numpys_over_all_the_batches_seen(rows_per_batch):
    data = [np.asarray(rows, np.float64) for rows in rows_per_batch]
    normalizer = RunningObservationNormalizer(data[0].shape[1], clip=10.0)
    for batch in data:
        normalizer.update(torch.from_numpy(batch))
    everything = np.concatenate(data)
    scale = 1.0 + np.abs(everything).max()
    assert normalizer.count.item() == len(everything)
    np.testing.assert_allclose(normalizer.mean.numpy(), everything.mean(0), rtol=1e-9, atol=1e-12 * scale)
    np.testing.assert_allclose(normalizer.var.numpy(), everything.var(0), rtol=1e-7, atol=1e-9 * scale * scale)


def test_before_any_update_it_only_clips_and_after_it_normalises_and_clips():
    normalizer = RunningObservationNormalizer(2, clip=3.0)
    x = torch.tensor([[0.5, -7.0], [2.0, 40.0]])
    torch.testing.assert_close(normalizer(x), torch.tensor([[0.5, -3.0], [2.0, 3.0]]))
    fitted = torch.tensor([[1.0, 10.0], [3.0, 30.0]], dtype=torch.float64)  # mean (2, 20), std (1, 10)
    normalizer.update(fitted)
    torch.testing.assert_close(normalizer(torch.tensor([[4.0, 0.0], [2.0, 25.0], [100.0, -100.0]])),
                               torch.tensor([[2.0, -2.0], [0.0, 0.5], [3.0, -3.0]]))  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_a_positive_per_value_affine_change_of_the_data_leaves_the_networks_output_unchanged(seed):
    """Fitted to data X and to X * a + b (a > 0 per value), the same weights give the same
    output for x and x * a + b (up to the variance's epsilon, negligible at these scales; a
    negative scale flips the normalised sign, so the property holds for a > 0 only)."""
    config = config_from_dict({"algorithm": "sampled_muzero", "env": {"id": "Pendulum-v1"}}, "x.json", TINY)
    algorithm = get_algorithm("sampled_muzero")
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    first = algorithm.make_network(config, (3,), 1).eval()
    second = algorithm.make_network(config, (3,), 1).eval()
    second.load_state_dict(first.state_dict())
    a, b = rng.uniform(0.5, 20.0, 3), rng.uniform(-20.0, 20.0, 3)
    for _ in range(3):
        data = rng.normal(rng.uniform(-2, 2, 3), rng.uniform(0.5, 2, 3), (16, 3))
        first.update_observation_statistics(torch.from_numpy(data))
        second.update_observation_statistics(torch.from_numpy(data * a + b))
    x = rng.normal(0.0, 2.0, (5, 3))
    out, moved = first.initial_inference(torch.from_numpy(x)), second.initial_inference(torch.from_numpy(x * a + b))
    for name, value in out._asdict().items():
        torch.testing.assert_close(getattr(moved, name), value, rtol=1e-4, atol=1e-4, msg=name)


# ---- the learner updates the statistics; publishing and checkpoints carry them ------------------------

def _halfcheetah_batches(extra: list[str]):
    """A HalfCheetah config with normalisation, its network, and two sampled batches of
    stored self-play (episodes of 8 moves)."""
    config = config_from_dict({"algorithm": "sampled_muzero", "env": {"id": "HalfCheetah-v5", "max_episode_steps": 8}},
                              "x.json", [*TINY, *extra])  # fmt: skip
    algorithm = get_algorithm("sampled_muzero")
    spec = run_env_spec(config)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions)
    player = algorithm.make_player(config, [make_env(config.env) for _ in range(2)], network.eval(), True, 0)
    episodes = []
    while len(episodes) < 2:
        episodes += player.step(0.5)
    with ReplayBuffer.create(algorithm.run_schema(config, spec), 100, alpha=0.5) as buf:
        for ep in episodes:
            buf.add_episode(*player.stored(ep))
        targets = algorithm.make_targets(config, spec.num_actions)
        rng = np.random.default_rng(0)
        sampled = [buf.sample(8, 1.0, targets, rng=rng) for _ in range(2)]
    return config, algorithm, spec, network, sampled


def test_the_learner_fits_the_statistics_to_the_root_observations_and_publishing_and_checkpoints_carry_them(tmp_path):
    # a large learning rate and weight decay: any step of the optimizer on a buffer would show
    config, algorithm, spec, network, sampled = _halfcheetah_batches(["training.weight_decay=0.5",
                                                                      "training.lr_init=0.5"])
    trainer = algorithm.make_trainer(config, network, torch.device("cpu"))
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(b) for b in network.buffers()} and len(list(network.buffers())) == 3
    seen = []
    for batch in sampled:
        trainer.train_step(batch)
        seen.append(np.asarray(batch.data["observation"], np.float64))
        roots = np.concatenate(seen)
        stats = trainer.network.observation_normalizer
        assert stats.count.item() == len(roots) and stats.mean.dtype == torch.float64
        np.testing.assert_allclose(stats.mean.numpy(), roots.mean(0), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(stats.var.numpy(), roots.var(0), rtol=1e-7, atol=1e-12)
    assert np.ptp(roots, axis=0).max() > 0  # the data moved the statistics off their start
    state = {k: v.clone() for k, v in trainer.network.state_dict().items() if k in STATISTICS}

    # publish -> a worker's copy (what workers, the evaluator and reanalyse read), as float32
    store = WeightStore.create(trainer.network.num_flat_weights())
    try:
        store.publish(trainer.published_network.get_flat_weights(), trainer.training_step)
        worker = algorithm.make_network(config, spec.observation_shape, spec.num_actions).eval()
        flat = np.empty(worker.num_flat_weights(), np.float32)
        store.read_into(flat)
        worker.set_flat_weights(flat)
    finally:
        store.close()
    for name in STATISTICS:
        torch.testing.assert_close(worker.state_dict()[name], state[name], rtol=1e-6, atol=1e-6, msg=name)
    observations = torch.from_numpy(roots[:4])
    trainer.network.eval()
    torch.testing.assert_close(worker.initial_inference(observations).policy_logits,
                               trainer.network.initial_inference(observations).policy_logits, rtol=1e-5, atol=1e-5)

    # checkpoint save -> load (weights_only=True), into a fresh network and a fresh trainer: exact
    save_checkpoint(tmp_path / "checkpoint.pt", trainer)
    loaded = load_checkpoint(tmp_path / "checkpoint.pt")
    fresh = load_network_weights(algorithm.make_network(config, spec.observation_shape, spec.num_actions),
                                 loaded["network"], tmp_path / "checkpoint.pt")  # fmt: skip
    resumed = algorithm.make_trainer(config, algorithm.make_network(config, spec.observation_shape,
                                                                    spec.num_actions), torch.device("cpu"))  # fmt: skip
    resumed.load_state_dict(loaded)
    for name in STATISTICS:
        assert torch.equal(fresh.state_dict()[name], state[name]), name
        assert torch.equal(resumed.network.state_dict()[name], state[name]), name


def test_without_normalisation_the_network_has_no_statistics():
    config = config_from_dict({"algorithm": "sampled_muzero", "env": {"id": "Pendulum-v1"}}, "x.json",
                              [*TINY, "sampled_network.normalize_observations=false"])  # fmt: skip
    network = get_algorithm("sampled_muzero").make_network(config, (3,), 1)
    assert network.observation_normalizer is None and not list(network.buffers())


# ---- the configs and the extra ------------------------------------------------------------------------

@pytest.mark.parametrize("name, env_id, normalized, solve", [
    ("inverted_pendulum_sampled", "InvertedPendulum-v5", True, 950.0), ("hopper_sampled", "Hopper-v5", True, None),
    ("halfcheetah_sampled", "HalfCheetah-v5", True, None)])  # fmt: skip
def test_the_mujoco_configs_name_their_env_and_normalisation(name, env_id, normalized, solve):
    config = load_config(ROOT / "configs" / f"{name}.json")
    assert config.env.id == env_id and config.sampled_network.normalize_observations is normalized
    assert config.runtime.solve_return == solve and config.runtime.time_limit_s is not None
    spec = run_env_spec(config)
    assert spec.continuous_actions


@pytest.mark.slow  # a child process
def test_a_mujoco_env_without_the_mujoco_package_is_one_line_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['mujoco'] = None\n"  # the import of mujoco now fails
            "import runpy; sys.argv = ['run.py', '--config', 'halfcheetah_sampled', '--workers', '0', '--run-dir', "
            f"{str(tmp_path / 'run')!r}]\n"
            "runpy.run_path('run.py', run_name='__main__')")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "env.id" in lines[0] and "'HalfCheetah-v5'" in lines[0] and "pip install -e .[mujoco]" in lines[0]
    assert not (tmp_path / "run").exists()


# ---- a short HalfCheetah run: trains, evaluates, checkpoints, resumes -------------------------------

RUN_FLAGS = ["--set", "training.min_buffer_steps=60", "--set", "training.batch_size=16",
             "--set", "sampled_mcts.num_simulations=3", "--set", "sampled_mcts.num_sampled_actions=4",
             "--set", "sampled_network.hidden=[16]", "--set", "sampled_network.encoding_size=8",
             "--set", "runtime.envs_per_worker=2", "--set", "env.max_episode_steps=30",
             "--set", "runtime.evaluation_episodes=1", "--set", "runtime.evaluation_interval_s=1",
             "--set", "runtime.final_evaluation_episodes=null", "--set", "training.samples_per_insert=64",
             "--set", "training.publish_interval=5", "--set", "runtime.log_interval_s=1"]  # fmt: skip


def _run(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--config", "halfcheetah_sampled", "--device", "cpu",
                           "--workers", "1", *RUN_FLAGS, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=400, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _statistics(path: Path) -> dict[str, torch.Tensor]:
    network = torch.load(path, weights_only=True)["network"]
    return {name: network[name] for name in STATISTICS}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_halfcheetah_run_with_normalisation_trains_evaluates_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(tmp_path, ["--run-dir", str(run_dir), "--max-train-steps", "100"])
    assert "MuJoCo:" not in proc.stderr  # a model file's deprecation notice stays out of the progress lines
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any("mean_return" in json.dumps(m) for m in metrics)  # an evaluation ran
    first = _statistics(run_dir / "checkpoint.pt")
    # the learner's statistics: 16 root observations a step, of HalfCheetah's 17 values
    assert first["observation_normalizer.count"].item() == 16 * 100
    assert first["observation_normalizer.mean"].shape == (17,) and first["observation_normalizer.var"].min() > 0
    # best.pt: the weights the evaluator judged best, published at some step, with the learner's
    # statistics of that step (through the shared-memory weights)
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert best["network"]["observation_normalizer.count"].item() == 16 * best["training_step"]
    _run(tmp_path, ["--resume", str(run_dir), "--max-train-steps", "130"])
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["training_step"] == 130
    # the resumed learner went on from the checkpoint's statistics, not from fresh ones
    assert _statistics(run_dir / "checkpoint.pt")["observation_normalizer.count"].item() == 16 * 130
    agent = mpper.load(run_dir / "checkpoint.pt")  # the run's best.pt may hold the untrained weights
    assert agent.network.observation_normalizer.count.item() == 16 * 130
    action = agent.act(np.zeros(17, np.float32))
    assert action.dtype == np.float32 and action.shape == (6,) and (np.abs(action) <= 1).all()
    assert not list(tmp_path.glob("MUJOCO_LOG*")) and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
