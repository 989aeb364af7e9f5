"""MuZero's captured training step on CUDA (``training.capture``, ``training.precision``)
against the eager step on the same GPU: the losses, the gradients, the priorities and the
weights over 20 updates, with Adam (fused and capturable, as the configs train) and SGD
with momentum, a learning rate that changes every other update, and gradient clipping.

These run only where torch sees a CUDA device; elsewhere each is skipped with the reason
(``pytest -rs`` lists it). The CPU form of the static step: tests/algos/muzero/test_static_step.py.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from test_cuda import exact_float32, played_buffer  # noqa: F401 (a fixture)
from test_train_e2e import ROOT

from mpper.algos.base import Finished
from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of
from mpper.envs import env_spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: torch.cuda.is_available() is false")  # fmt: skip

STEPS = 20
CONFIGS = {  # config file (+ a variant of VARIANTS) -> the module its env needs
    "cartpole.json": None,
    "minatar_breakout.json": "minatar",
    "atari_pong.json": "ale_py",
    "cartpole.json+value_prefix": None,
    "minatar_breakout.json+value_prefix": "minatar",
}
VARIANTS = {  # EfficientZero's value prefix: an LSTM in the unroll, reset every 2 steps
    "value_prefix": ["muzero.value_prefix=true", "muzero.lstm_horizon_len=2", "network.lstm_hidden_size=16"],
}
_BATCHES: dict = {}


def config_of(name: str, optimizer: str, **training):
    file, _, variant = name.partition("+")
    config = load_config(ROOT / "configs" / file, VARIANTS[variant] if variant else [], check_env=False)
    return dataclasses.replace(config, training=dataclasses.replace(
        config.training, batch_size=32, optimizer=optimizer, momentum=0.9, lr_init=0.003 if optimizer == "adam" else 0.01,
        lr_decay_rate=0.5, lr_decay_steps=2, grad_clip=5.0, **training))  # fmt: skip


def batches_of(name: str, stacked_on_device: bool = False) -> list:
    """20 batches of 32 from moves played in the config's env (made once per config);
    ``stacked_on_device``: the same positions as the static step's learner samples them
    (the rows of stacked observations, ``MuZeroTargets.stack_on_device``)."""
    if CONFIGS[name] is not None:
        pytest.importorskip(CONFIGS[name])
    if name not in _BATCHES:
        config = config_of(name, "adam")
        algorithm, spec = algorithm_of(config), env_spec(config.env)
        with played_buffer(config, 400) as buf:
            targets = algorithm.make_targets(config, spec.num_actions)
            on_device = dataclasses.replace(targets, stack_on_device=config.muzero.stacked_observations > 0)
            drawn = {
                False: [buf.sample(32, 0.6, targets, np.random.default_rng(100 + i)) for i in range(STEPS)],
                True: [buf.sample(32, 0.6, on_device, np.random.default_rng(100 + i)) for i in range(STEPS)],
            }
            _BATCHES[name] = {
                key: [dataclasses.replace(b, data={k: np.array(v) for k, v in b.data.items()}) for b in batches]
                for key, batches in drawn.items()
            }
    return _BATCHES[name][stacked_on_device]


def trainers(name: str, optimizer: str, capture: str, precision: str = "fp32"):
    """(eager, static) trainers of the config on CUDA from the same first weights."""
    batches_of(name)  # skips without the env's module
    eager_config = config_of(name, optimizer, capture="off")
    static_config = config_of(name, optimizer, capture=capture, precision=precision)
    algorithm, spec = algorithm_of(eager_config), env_spec(eager_config.env)
    torch.manual_seed(0)
    network = algorithm.make_network(eager_config, spec.observation_shape, spec.num_actions)
    eager = algorithm.make_trainer(eager_config, copy.deepcopy(network), torch.device("cuda"))
    static = algorithm.make_trainer(static_config, network, torch.device("cuda"))
    assert eager.static is None and static.static is not None and static.static.mode == capture
    return eager, static


def gradients(trainer) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in trainer.network.parameters()]


def compare(name, eager, static, rtol, atol, pipelined=True):
    """Run the 20 updates on both; the static trainer through ``submit`` (results one call
    late) when ``pipelined``, else ``train_step``, on the batches as its learner samples
    them (Pong: the rows of stacked observations); compare step by step."""
    expected, eager_grads = [], []
    for batch in batches_of(name):
        expected.append(eager.train_step(batch))
        eager_grads.append(gradients(eager))
    finished, static_grads = [], []
    for batch in batches_of(name, stacked_on_device=pipelined):
        if pipelined:
            finished += static.submit(batch)
        else:
            metrics, priorities = static.train_step(batch)
            finished.append(Finished(batch, metrics, priorities))
        static_grads.append(gradients(static))
    finished += static.drain()
    assert len(finished) == STEPS
    for step, ((metrics, priorities), done) in enumerate(zip(expected, finished, strict=True)):
        for key in ("total_loss", "value_loss", "reward_loss", "policy_loss", "grad_norm", "lr"):
            assert done.metrics[key] == pytest.approx(metrics[key], rel=rtol, abs=atol), (step, key)
        assert done.metrics["training_step"] == metrics["training_step"] == step + 1
        np.testing.assert_allclose(done.priorities, priorities, rtol=rtol, atol=atol, err_msg=f"step {step}")
    for step, (ge, gs) in enumerate(zip(eager_grads, static_grads, strict=True)):
        for a, b in zip(ge, gs, strict=True):
            torch.testing.assert_close(b, a, rtol=rtol * 10, atol=atol, msg=lambda m: f"gradient, step {step}: {m}")
    for (key, a), b in zip(eager.network.state_dict().items(), static.network.state_dict().values(), strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=rtol * 10, atol=atol * 10,
                                   msg=lambda m: f"{key} after {STEPS} steps: {m}")  # fmt: skip


def convolutional(name: str) -> bool:
    return not name.startswith("cartpole.json")


def lockstep_updates(name, eager, static):
    """The 20 updates in lockstep (see ``lockstep``): per update, its index, the eager and
    the static trainer's (metrics, priorities), and each side's move of the weights
    (static's, eager's), flattened."""
    for step, (batch, device_batch) in enumerate(zip(batches_of(name), batches_of(name, stacked_on_device=True),
                                                     strict=True)):  # fmt: skip
        eager.load_state_dict(static.state_dict())
        before = [p.detach().float().clone() for p in static.network.parameters()]
        eager_out = eager.train_step(batch)
        static_out = static.train_step(device_batch)
        moved = [torch.cat([(p.detach().float() - b).reshape(-1) for p, b in zip(t.network.parameters(), before)])
                 for t in (static, eager)]  # fmt: skip
        yield step, eager_out, static_out, moved


def lockstep(name, eager, static, rtol, atol, optimizer):
    """The 20 updates, each from the same state: before each, the eager trainer takes the
    static trainer's whole state (weights, BatchNorm statistics, optimizer state, step);
    both update on the same positions (``train_step``: the static one waits for its
    update); the readouts must agree within ``rtol``/``atol``, and the gradients (and,
    with SGD, each update of the weights) must point the same way (cosine similarity).
    Adam's update from a gradient is held to the paper by
    ``test_the_fused_adam_step_on_cuda_is_adam_by_the_paper`` and, in the graph, by the
    fully connected configs' 20 updates.

    Why not ``compare``'s 20-update trajectories: the captured step lays convolutional
    nets out NHWC, so its convolutions round differently from the eager NCHW ones, and
    the residual network's hidden states are min-max scaled per channel: where a
    channel's smallest (or largest) entries tie to within rounding, the two layouts pick
    different ones, and the gradient goes to different weights. One update's rounding then
    shows in the next loss; the eager float32 step is as far from a float64 one after a
    single update. In lockstep no difference carries over, and the update's direction, not
    each weight, is what two roundings agree on."""
    for step, (metrics, priorities), (done_metrics, done_priorities), moved in lockstep_updates(name, eager, static):
        for key in ("total_loss", "value_loss", "reward_loss", "policy_loss", "grad_norm", "lr", "training_step"):
            assert done_metrics[key] == pytest.approx(metrics[key], rel=rtol, abs=atol), (step, key)
        np.testing.assert_allclose(done_priorities, priorities, rtol=rtol, atol=atol, err_msg=f"step {step}")
        cosine = torch.nn.functional.cosine_similarity(*(torch.cat([g.reshape(-1) for g in gradients(t)])
                                                         for t in (static, eager)), dim=0)  # fmt: skip
        assert cosine >= 0.95, (step, "gradient", float(cosine))
        if optimizer == "sgd":  # linear in the gradient; Adam's update is held to its paper on CUDA elsewhere
            cosine = torch.nn.functional.cosine_similarity(*moved, dim=0)
            assert cosine >= 0.95, (step, "update", float(cosine))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_captured_step_is_the_eager_step(name, optimizer, exact_float32):  # noqa: F811
    """fp32, TF32 off: the CUDA graph's updates are the eager step's within float32
    rounding (the learning rate is a device tensor in the graph). Fully connected nets:
    20 updates read one step late, as the learner reads them. Convolutional nets: in
    lockstep (see ``lockstep``)."""
    eager, static = trainers(name, optimizer, "cuda_graph")
    if convolutional(name):
        lockstep(name, eager, static, rtol=1e-3, atol=1e-4, optimizer=optimizer)
    else:
        compare(name, eager, static, rtol=1e-4, atol=1e-5)
    assert static.static.capture_seconds is not None and static.static.capture_seconds > 0
    assert static.optimizer.param_groups[0]["fused"]
    if optimizer == "adam":
        assert static.optimizer.param_groups[0]["capturable"]
    if convolutional(name):  # conv nets on CUDA: NHWC
        conv = next(m for m in static.network.modules() if isinstance(m, torch.nn.Conv2d))
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_step_on_the_captured_step_waits_for_its_update(exact_float32):  # noqa: F811
    """``train_step`` (no pipelining) over 20 updates (the convolutional configs run it in
    ``lockstep`` above)."""
    eager, static = trainers("cartpole.json", "adam", "cuda_graph")
    compare("cartpole.json", eager, static, rtol=1e-4, atol=1e-5, pipelined=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["minatar_breakout.json", "atari_pong.json"])
def test_the_bf16_step_stays_near_the_fp32_step(name):
    """bfloat16 autocast for the network (supports and losses in float32), each of 20
    updates from the float32 eager step's state (as in ``lockstep``, for the same reason):
    the losses and the gradient norm within a few per cent of float32's, the priorities
    within a few per cent on average, and the weights moved the same way (SGD: linear in
    the gradient, so the move's direction is the gradient's; see ``lockstep``)."""
    eager, static = trainers(name, "sgd", "cuda_graph", precision="bf16")
    for step, (metrics, priorities), (done_metrics, done_priorities), moved in lockstep_updates(name, eager, static):
        for key in ("total_loss", "grad_norm"):
            assert done_metrics[key] == pytest.approx(metrics[key], rel=0.05), (step, key)
        assert np.abs(done_priorities - priorities).mean() <= 0.05 * max(1.0, np.abs(priorities).mean()), step
        assert torch.nn.functional.cosine_similarity(*moved, dim=0) >= 0.9, step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_compiled_step_is_the_eager_step(exact_float32):  # noqa: F811
    """``training.capture: "compile"`` (torch.compile, mode "reduce-overhead"): the same
    updates within the rounding of fused kernels."""
    eager, static = trainers("minatar_breakout.json", "adam", "compile")
    lockstep("minatar_breakout.json", eager, static, rtol=1e-3, atol=1e-4, optimizer="adam")
    assert static.static.capture_seconds is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_non_finite_update_in_the_graph_changes_nothing(exact_float32):  # noqa: F811
    """An infinite target in the captured step: the graph's fused Adam skips that update
    and the next; the host raises one call late, naming the step; the weights and Adam's
    state are those before it, and training goes on."""
    _, static = trainers("minatar_breakout.json", "adam", "cuda_graph")
    good = batches_of("minatar_breakout.json")
    bad = dataclasses.replace(
        good[1], data={**good[1].data, "target_value": np.full_like(good[1].data["target_value"], np.inf)}
    )
    static.train_step(good[0])
    params = [p.detach().clone() for p in static.network.parameters()]
    state = [{k: v.clone() for k, v in static.optimizer.state[p].items()} for p in static.network.parameters()]
    assert static.submit(bad) == []
    with pytest.raises(FloatingPointError, match="at training step 1"):
        static.submit(good[2])
    assert static.training_step == 1
    for p, before in zip(static.network.parameters(), params, strict=True):
        assert torch.equal(p.detach(), before)
    for p, before in zip(static.network.parameters(), state, strict=True):
        for key, value in before.items():
            assert torch.equal(static.optimizer.state[p][key], value), key
    metrics, _ = static.train_step(good[3])
    assert metrics["training_step"] == 2 and np.isfinite(metrics["total_loss"])
