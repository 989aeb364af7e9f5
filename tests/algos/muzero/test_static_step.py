"""MuZero's static-shape training step (``training.capture``), on the CPU.

The static step is what a GPU captures as a CUDA graph; on the CPU it runs eagerly
(``training.capture: "static"``) with the same bookkeeping: persistent inputs, a fused
optimizer that skips a non-finite update on its own, results read one update late. Here
it is held to today's eager step (``MuZeroTrainer.train_step``) on the same batches, for
a CartPole and a small convolutional config, with Adam (as the configs train) and SGD
with momentum. ``tests/runtime/test_cuda_graph.py`` holds the captured step on CUDA.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import make_episode

from mpper import ReplayBuffer
from mpper.algos.configs import load_config
from mpper.algos.muzero.static_step import static_mode
from mpper.algos.muzero.targets import muzero_schema
from mpper.algos.muzero.trainer import MuZeroTrainer
from mpper.algos.registry import algorithm_of
from mpper.config_files import ConfigError
from mpper.runtime.roles import Learner
from mpper.runtime.setup import RunSetup
from mpper.runtime.weights import WeightStore

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

# A small convolutional MuZero: MinAtar Breakout's config (residual network, consistency
# loss with BatchNorm1d projection heads) at a tenth of its width.
SMALL_CONV = ["network.encoding_size=8", "network.blocks=1", "network.hidden=[16]", "network.reduced_channels=4",
              "network.projection_size=16", "network.support_size=5"]  # fmt: skip
CASES = {
    "cartpole": ("configs/cartpole.json", [], (4,), 2),
    "small_conv": ("configs/minatar_breakout.json", SMALL_CONV, (4, 10, 10), 3),
}



def config_of(case: str, *overrides: str):
    path, sets, _, _ = CASES[case]
    return load_config(path, [*sets, "runtime.device=cpu", "training.batch_size=16", "training.min_buffer_steps=16",
                              *overrides], check_env=False)  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """(name, buffer) with random episodes of the case's shapes."""
    _, _, shape, actions = CASES[request.param]
    buf = ReplayBuffer.create(muzero_schema(shape, actions), capacity=2048, alpha=0.6)
    rng = np.random.default_rng(0)
    for i in range(24):
        buf.add_episode(make_episode(rng, int(rng.integers(5, 30)), shape, actions), terminated=i % 3 != 1)
    try:
        yield request.param, buf
    finally:
        buf.close()


def make_trainer(config, case_name: str) -> MuZeroTrainer:
    _, _, shape, actions = CASES[case_name]
    algorithm = algorithm_of(config)
    torch.manual_seed(0)
    trainer = algorithm.make_trainer(config, algorithm.make_network(config, shape, actions), torch.device("cpu"))
    assert isinstance(trainer, MuZeroTrainer)
    return trainer


def batches(config, buf: ReplayBuffer, case_name: str, count: int):
    targets = algorithm_of(config).make_targets(config, CASES[case_name][3])
    rng = np.random.default_rng(3)
    return [buf.sample(config.training.batch_size, 0.4, targets, rng) for _ in range(count)]


def weights(trainer: MuZeroTrainer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in trainer.network.state_dict().values()]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_static_step_is_todays_step(case, optimizer):
    """The static step gives the eager step's results (``check_static_equals_eager``)."""
    name, buf = case
    sets = [f"training.optimizer={optimizer}", "training.lr_decay_rate=0.5", "training.lr_decay_steps=2",
            "training.grad_clip=1.0"]  # fmt: skip
    check_static_equals_eager(name, buf, sets)


def test_the_static_step_is_todays_step_with_a_value_prefix(case):
    """The same with EfficientZero's value prefix: its LSTM in the unroll, its targets."""
    name, buf = case
    sets = ["muzero.value_prefix=true", "muzero.lstm_horizon_len=2", "network.lstm_hidden_size=8",
            "training.grad_clip=1.0"]  # fmt: skip
    eager = check_static_equals_eager(name, buf, sets)
    assert eager.network.lstm_horizon_len == 2 and eager.network.dynamics_reward_lstm is not None


def check_static_equals_eager(name: str, buf: ReplayBuffer, sets: list[str]) -> MuZeroTrainer:
    """Five updates on the same batches from the same weights: the static step, its
    results one call late, gives the eager step's losses, gradient norms and
    priorities, and the same weights (BatchNorm statistics included) and optimizer
    state after each update."""
    eager = make_trainer(config_of(name, *sets, "training.capture=off"), name)
    static = make_trainer(config_of(name, *sets, "training.capture=static"), name)
    assert eager.static is None and static.static is not None and static.static.mode == "static"
    data = batches(eager.config, buf, name, 5)
    expected = [eager.train_step(b) for b in data]
    finished = []
    for i, batch in enumerate(data):
        returned = static.submit(batch)
        assert len(returned) == (0 if i == 0 else 1)  # one call late
        finished += returned
        assert static.training_step == i + 1  # started updates count at once
    finished += static.drain()
    assert static.drain() == []
    assert [f.batch for f in finished] == data
    for (metrics, priorities), done in zip(expected, finished, strict=True):
        assert done.metrics.keys() == metrics.keys()
        for key, value in metrics.items():
            assert done.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        np.testing.assert_allclose(done.priorities, priorities, rtol=1e-5, atol=1e-7)
    for a, b in zip(weights(eager), weights(static), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for p_eager, p_static in zip(eager.network.parameters(), static.network.parameters(), strict=True):
        for key, value in eager.optimizer.state[p_eager].items():
            torch.testing.assert_close(static.optimizer.state[p_static][key].float(), value.float(),
                                       rtol=1e-5, atol=1e-7)  # fmt: skip
    return eager


def test_train_step_waits_for_its_own_update(case):
    """``train_step`` on a static trainer returns that update's results, as the eager one."""
    name, buf = case
    eager = make_trainer(config_of(name, "training.capture=off"), name)
    static = make_trainer(config_of(name, "training.capture=static"), name)
    for batch in batches(eager.config, buf, name, 2):
        (m1, p1), (m2, p2) = eager.train_step(batch), static.train_step(batch)
        assert m2["total_loss"] == pytest.approx(m1["total_loss"], rel=1e-6)
        np.testing.assert_allclose(p2, p1, rtol=1e-5, atol=1e-7)
    assert static.static is not None and static.static.pending is None


def test_a_non_finite_update_changes_nothing_and_is_reported_one_call_late(case):
    """A batch with an infinite target: its update is skipped on the device by the fused
    optimizer (weights, BatchNorm statistics aside, and optimizer state stay as they
    were), the update after it too (the flag is sticky); the host raises at the next call
    and the step counter goes back to the updates before the bad one. Training then goes
    on from there."""
    name, buf = case
    static = make_trainer(config_of(name, "training.capture=static"), name)
    good = batches(static.config, buf, name, 3)
    bad = dataclasses.replace(good[1], data={**good[1].data, "target_value": np.full_like(good[1].data["target_value"],
                                                                                         np.inf)})  # fmt: skip
    static.submit(good[0])
    static.drain()
    params_before = [p.detach().clone() for p in static.network.parameters()]
    state_before = [{k: v.clone() for k, v in static.optimizer.state[p].items()} for p in static.network.parameters()]
    assert static.submit(bad) == []
    with pytest.raises(FloatingPointError, match="at training step 1"):
        static.submit(good[2])
    assert static.training_step == 1
    for p, before in zip(static.network.parameters(), params_before, strict=True):
        torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
    for p, before in zip(static.network.parameters(), state_before, strict=True):
        for key, value in before.items():
            torch.testing.assert_close(static.optimizer.state[p][key], value, rtol=0, atol=0)
    static.submit(good[2])
    (done,) = static.drain()
    assert done.metrics["training_step"] == 2 and np.isfinite(done.metrics["total_loss"])
    assert any(not torch.equal(p.detach(), b) for p, b in zip(static.network.parameters(), params_before, strict=True))


def test_the_learner_writes_each_updates_priorities_to_its_own_batch(case, tmp_path):
    """Through ``Learner.step``: with the static step each batch's priorities reach the
    buffer one step late (so the next batch is drawn before them) and the checkpoint
    drains the last. A learner with the eager step, given the batches the static one
    drew, on a buffer filled alike, reports the same metrics one step earlier and leaves
    the same priorities in its buffer."""
    name, _ = case
    _, _, shape, actions = CASES[name]
    drawn: list = []
    results = {}
    for capture in ("static", "off"):
        config = config_of(name, f"training.capture={capture}", "training.publish_interval=2")
        buf = ReplayBuffer.create(muzero_schema(shape, actions), capacity=2048, alpha=0.6)
        rng = np.random.default_rng(0)
        for i in range(24):
            buf.add_episode(make_episode(rng, int(rng.integers(5, 30)), shape, actions), terminated=i % 3 != 1)
        setup = RunSetup.create(config, tmp_path / capture)
        setup = dataclasses.replace(setup, spec=dataclasses.replace(setup.spec, observation_shape=shape,
                                                                    num_actions=actions))  # fmt: skip
        store = WeightStore.create(setup.make_network().num_flat_weights())
        try:
            learner = Learner(setup, buf, store)
            metrics = []
            for k in range(4):
                if capture == "static":
                    drawn.append(learner.sample())
                metrics.append(dict(learner.step(drawn[k])))
            learner.checkpoint()
            results[capture] = (metrics, learner.metrics, buf.priorities(np.arange(buf.capacity)).copy(),
                                learner.priorities_applied)  # fmt: skip
        finally:
            store.close()
            buf.close()
    static, eager = results["static"], results["off"]
    assert static[0][0] == {}  # nothing finished after the first call
    for got, want in [*zip(static[0][1:], eager[0][:-1], strict=True), (static[1], eager[1])]:
        assert got.keys() == want.keys()
        assert got["training_step"] == want["training_step"] and got["beta"] == want["beta"]
        assert got["total_loss"] == pytest.approx(want["total_loss"], rel=1e-5)
    assert static[3] == eager[3] > 0  # every priority of the four batches applied
    np.testing.assert_allclose(static[2], eager[2], rtol=1e-5)


def test_the_cpu_default_is_the_eager_step():
    """``training.capture: "auto"`` (every shipped config) keeps the CPU's eager step and
    its optimizer (fused Adam, not capturable, a number for the learning rate)."""
    for case_name in CASES:
        config = config_of(case_name)
        assert config.training.capture == "auto" and config.training.precision == "fp32"
        trainer = make_trainer(config, case_name)
        assert trainer.static is None
        (group,) = trainer.optimizer.param_groups
        assert group["fused"] and not group["capturable"] and isinstance(group["lr"], float)
    assert static_mode("auto", torch.device("cpu")) is None
    assert static_mode("auto", torch.device("cuda")) == "cuda_graph"
    assert static_mode("off", torch.device("cuda")) is None
    with pytest.raises(ValueError, match='training.capture: "cuda_graph" runs on CUDA, the learner is on cpu'):
        static_mode("cuda_graph", torch.device("cpu"))


def test_a_static_checkpoint_resumes_eagerly_and_back(case, tmp_path):
    """The static trainer's state (its learning rate saved as a number) loads into an
    eager trainer and the other way round; both then take the same update."""
    name, buf = case
    data = batches(config_of(name), buf, name, 3)
    static = make_trainer(config_of(name, "training.capture=static"), name)
    static.train_step(data[0])
    state = static.state_dict()
    assert all(isinstance(g["lr"], float) for g in state["optimizer"]["param_groups"])
    eager = make_trainer(config_of(name, "training.capture=off"), name)
    eager.load_state_dict(state)
    again = make_trainer(config_of(name, "training.capture=static"), name)
    again.load_state_dict(eager.state_dict())
    (m1, p1), (m2, p2) = eager.train_step(data[1]), again.train_step(data[1])
    assert m1["training_step"] == m2["training_step"] == 2
    assert m2["total_loss"] == pytest.approx(m1["total_loss"], rel=1e-6)
    np.testing.assert_allclose(p2, p1, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sets,expected", [
    (["training.capture=graph"], 'training.capture: expected one of "auto", "off", "static", "cuda_graph", '
                                 '"compile", got "graph" (did you mean "cuda_graph"?)'),
    (["training.capture=cuda_graph", "runtime.device=cpu"], 'training.capture: "cuda_graph" runs on CUDA: needs '
                                                           'runtime.device "cuda" or "auto", got "cpu"'),
    (["training.capture=compile", "runtime.device=cpu"], 'training.capture: "compile" runs on CUDA'),
    (["training.precision=fp16"], 'training.precision: expected one of "fp32", "bf16", got "fp16"'),
    (["training.precision=bf16", "runtime.device=cpu"], "training.precision: bfloat16 autocast runs on CUDA"),
    (["training.precision=bf16", "training.capture=off"], 'training.precision: needs the static-shape step'),
])  # fmt: skip
def test_bad_capture_and_precision_values_are_one_line_naming_the_key(sets, expected):
    with pytest.raises(ConfigError) as caught:
        load_config("configs/cartpole.json", sets, check_env=False)
    message = str(caught.value)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("sets,expected", [
    (["training.capture=cuda_graph"], 'training.capture: DQN trains with the eager step: expected "auto" or "off", '
                                      'got "cuda_graph"'),
    (["training.precision=bf16"], 'training.precision: DQN trains in float32: expected "fp32", got "bf16"'),
])  # fmt: skip
def test_dqn_refuses_a_static_step(sets, expected):
    with pytest.raises(ConfigError) as caught:
        load_config("configs/cartpole_dqn.json", sets, check_env=False)
    assert expected in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("fall_back", [True, False])
def test_a_capture_that_fails_goes_on_uncaptured_only_when_auto_chose_it(case, fall_back, monkeypatch, capsys):
    """``training.capture: "auto"`` on CUDA chose the CUDA graph: a capture that fails
    (here: made to) says so in one line and the same step runs uncaptured, with the
    eager step's results. Asked for by name, the failure is the learner's error."""
    name, buf = case
    eager = make_trainer(config_of(name, "training.capture=off"), name)
    static = make_trainer(config_of(name, "training.capture=static"), name)
    assert static.static is not None
    static.static.mode, static.static.fall_back = "cuda_graph", fall_back

    def capture_fails():
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(static.static, "_capture", capture_fails)
    data = batches(eager.config, buf, name, 2)
    if not fall_back:
        with pytest.raises(RuntimeError, match="operation not permitted"):
            static.submit(data[0])
        return
    for batch in data:
        (m1, p1), (m2, p2) = eager.train_step(batch), static.train_step(batch)
        assert m2["total_loss"] == pytest.approx(m1["total_loss"], rel=1e-6)
        np.testing.assert_allclose(p2, p1, rtol=1e-5, atol=1e-7)
    assert static.static.mode == "static"
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("mpper: learner: the training step could not be captured as a CUDA graph (RuntimeError: "
                    "operation not permitted when stream is capturing); it runs uncaptured, as with "
                    'training.capture "static"')  # fmt: skip


def stacked_buffer(shape, actions: int, episodes: int = 16) -> ReplayBuffer:
    """uint8 image episodes of 3-20 moves (shorter than the stack plus the unroll, some)."""
    buf = ReplayBuffer.create(muzero_schema(shape, actions, observation_dtype="uint8"), capacity=1024, alpha=0.6)
    rng = np.random.default_rng(7)
    for i in range(episodes):
        episode = make_episode(rng, int(rng.integers(3, 20)), shape, actions)
        episode["observation"] = rng.integers(0, 256, episode["observation"].shape).astype(np.uint8)
        buf.add_episode(episode, terminated=i % 3 != 1)
    return buf


@pytest.mark.parametrize("stacked,next_observations", [(3, True), (3, False), (0, True)])
def test_observations_stacked_on_the_device_are_the_hosts(stacked, next_observations):
    """``MuZeroTargets(stack_on_device=True)`` hands the rows (uint8, each once) and
    ``stack_frames`` stacks them: the same observation and next_observation, bit for bit,
    as the host's float32 stacking, at episode starts (fewer past rows than the stack)
    and ends (unroll steps past the last row); every other target the same."""
    from mpper.algos.muzero.targets import MuZeroTargets
    from mpper.algos.muzero.trainer import stack_frames

    shape, actions = (2, 5, 6), 3
    buf = stacked_buffer(shape, actions)
    try:
        host = MuZeroTargets(4, 5, 0.99, actions, stacked, next_observations)
        device = dataclasses.replace(host, stack_on_device=True)
        a = buf.sample(64, 0.5, host, np.random.default_rng(11))
        b = buf.sample(64, 0.5, device, np.random.default_rng(11))
    finally:
        buf.close()
    np.testing.assert_array_equal(a.indices, b.indices)
    assert b.data["frames"].dtype == np.uint8 and "observation" not in b.data
    stacked_obs = stack_frames({k: torch.from_numpy(v) for k, v in b.data.items()}, stacked, actions).numpy()
    np.testing.assert_array_equal(stacked_obs[:, 0], a.data["observation"])
    if next_observations:
        np.testing.assert_array_equal(stacked_obs[:, 1:], a.data["next_observation"])
    else:
        assert stacked_obs.shape[1] == 1
    assert (a.data["observation"][:, :2] != 0).any()  # real frames, not an empty check
    for key in a.data.keys() - {"observation", "next_observation"}:
        np.testing.assert_array_equal(b.data[key], a.data[key], err_msg=key)


def test_the_static_step_on_device_stacked_frames_is_todays_step(tmp_path):
    """A convolutional config with stacked observations and the consistency loss: the
    static trainer's learner targets hand it rows, which it stacks itself; its updates
    are the eager step's on the host-stacked batches."""
    shape, actions = (2, 10, 10), 3
    sets = [*SMALL_CONV, "muzero.stacked_observations=2", "runtime.device=cpu", "training.batch_size=16",
            "training.min_buffer_steps=16"]  # fmt: skip
    eager_config = load_config("configs/minatar_breakout.json", [*sets, "training.capture=off"], check_env=False)
    static_config = load_config("configs/minatar_breakout.json", [*sets, "training.capture=static"], check_env=False)
    algorithm = algorithm_of(eager_config)
    trainers = []
    for config in (eager_config, static_config):
        torch.manual_seed(0)
        network = algorithm.make_network(config, shape, actions)
        trainers.append(algorithm.make_trainer(config, network, torch.device("cpu")))
    eager, static = trainers
    host_targets = eager.learner_targets(algorithm.make_targets(eager_config, actions))
    device_targets = static.learner_targets(algorithm.make_targets(static_config, actions))
    assert not host_targets.stack_on_device and device_targets.stack_on_device
    buf = stacked_buffer(shape, actions)
    try:
        for step in range(3):
            a = buf.sample(16, 0.5, host_targets, np.random.default_rng(step))
            b = buf.sample(16, 0.5, device_targets, np.random.default_rng(step))
            (m1, p1), (m2, p2) = eager.train_step(a), static.train_step(b)
            assert m2["total_loss"] == pytest.approx(m1["total_loss"], rel=1e-5)
            assert m2["consistency_loss"] == pytest.approx(m1["consistency_loss"], rel=1e-5, abs=1e-7)
            np.testing.assert_allclose(p2, p1, rtol=1e-5, atol=1e-7)
    finally:
        buf.close()
    for x, y in zip(weights(eager), weights(static), strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
