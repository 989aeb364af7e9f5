"""mpper's Adam and SGD (``mpper.algos.optim``) against ``torch.optim``'s for-loop
(``foreach=False``) implementations, step for step; their checkpoints in both directions;
refused states; and a learner that never imports ``torch._dynamo``.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpper.algos.optim import SGD, Adam

ROOT = Path(__file__).resolve().parents[2]


def two_networks(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(5, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    twin.load_state_dict(net.state_dict())
    return net, twin


def make_pair(kind: str, net, twin, lr: float, weight_decay: float, momentum: float):
    if kind == "adam":
        return (Adam(net.parameters(), lr=lr, weight_decay=weight_decay),
                torch.optim.Adam(twin.parameters(), lr=lr, weight_decay=weight_decay, foreach=False))  # fmt: skip
    return (SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay),
            torch.optim.SGD(twin.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=False))  # fmt: skip


def one_step(net, optimizer, x: torch.Tensor, lr: float) -> None:
    optimizer.param_groups[0]["lr"] = lr  # as the trainers set it before each step
    optimizer.zero_grad(set_to_none=True)
    (net(x) ** 2).mean().backward()
    optimizer.step()


def through_a_file(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("kind, weight_decay, momentum", [
    ("adam", 0.0, 0.0), ("adam", 1e-2, 0.0), ("sgd", 0.0, 0.0), ("sgd", 1e-3, 0.9), ("sgd", 0.0, 0.5),
])  # fmt: skip
def test_each_step_is_torch_optims_step(kind, weight_decay, momentum):
    """30 steps with a learning rate that changes every step, on the same batches: the
    weights stay within float32 rounding of torch.optim's."""
    net, twin = two_networks(0)
    mine, reference = make_pair(kind, net, twin, 0.01, weight_decay, momentum)
    generator = torch.Generator().manual_seed(1)
    start = [p.detach().clone() for p in net.parameters()]
    for k in range(30):
        x = torch.randn(16, 5, generator=generator)
        lr = 0.01 * 0.95**k
        one_step(net, mine, x, lr)
        one_step(twin, reference, x, lr)
        assert max_difference(net, twin) < 1e-6, k
    assert max(float((p.detach() - s).abs().max()) for p, s in zip(net.parameters(), start)) > 1e-3  # it did move


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_checkpoints_go_both_ways_between_mpper_and_torch_optim(kind):
    """A state written by either loads into the other, and both then take the same next
    steps (the moments, momentum buffers and Adam's step counts came across)."""
    net, twin = two_networks(2)
    mine, reference = make_pair(kind, net, twin, 0.02, 1e-3, 0.9)
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        x = torch.randn(8, 5, generator=generator)
        one_step(net, mine, x, 0.02)
        one_step(twin, reference, x, 0.02)

    # mpper -> torch.optim, and torch.optim -> mpper, into fresh optimizers on copies
    net_b, twin_b = two_networks(2)
    net_b.load_state_dict(twin.state_dict())
    twin_b.load_state_dict(net.state_dict())
    # other hyperparameters: the files' win
    mine_resuming_torch, torch_resuming_mine = make_pair(kind, net_b, twin_b, 0.5, 0.0, 0.0)
    # through bytes, as a checkpoint: torch.optim's load keeps the very tensors it is given
    mine_resuming_torch.load_state_dict(through_a_file(reference.state_dict()))
    torch_resuming_mine.load_state_dict(through_a_file(mine.state_dict()))
    assert mine_resuming_torch.param_groups[0]["weight_decay"] == 1e-3
    for _ in range(5):
        x = torch.randn(8, 5, generator=generator)
        for n, o in ((net, mine), (twin, reference), (net_b, mine_resuming_torch), (twin_b, torch_resuming_mine)):
            one_step(n, o, x, 0.02)
    assert max_difference(net, twin_b) < 1e-6  # mpper, and torch.optim that resumed mpper's state
    assert max_difference(twin, net_b) < 1e-6  # torch.optim, and mpper that resumed torch.optim's state
    assert max_difference(net, twin) < 1e-6


def test_the_state_dict_is_torch_optims_format():
    net, twin = two_networks(4)
    mine, reference = make_pair("adam", net, twin, 0.01, 0.0, 0.0)
    x = torch.randn(4, 5)
    one_step(net, mine, x, 0.01)
    one_step(twin, reference, x, 0.01)
    ours, theirs = mine.state_dict(), reference.state_dict()
    assert ours["state"].keys() == theirs["state"].keys() == set(range(4))
    for index, state in ours["state"].items():
        assert state.keys() == theirs["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == float(theirs["state"][index]["step"]) == 1.0
    assert set(ours["param_groups"][0]) == set(theirs["param_groups"][0])
    assert ours["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]


@pytest.mark.parametrize("broken, message", [
    ("two-groups", "2 parameter groups"),
    ("fewer-params", "has 3 parameters, this optimizer's has 4"),
    ("amsgrad", "amsgrad=True"),
    ("no-betas", "missing ['betas']"),
    ("unknown-param", "parameter 9"),
    ("not-a-tensor", "is a str"),
])  # fmt: skip
def test_a_state_that_does_not_fit_is_refused_and_nothing_changes(broken, message):
    net, _ = two_networks(5)
    optimizer = Adam(net.parameters(), lr=0.01)
    one_step(net, optimizer, torch.randn(4, 5), 0.01)
    before = {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state_dict()["state"].items()}
    state = optimizer.state_dict()
    state = {"state": {k: dict(s) for k, s in state["state"].items()}, "param_groups": [dict(state["param_groups"][0])]}
    group = state["param_groups"][0]
    if broken == "two-groups":
        state["param_groups"].append(dict(group))
    elif broken == "fewer-params":
        group["params"] = group["params"][:3]
    elif broken == "amsgrad":
        group["amsgrad"] = True
    elif broken == "no-betas":
        del group["betas"]
    elif broken == "unknown-param":
        state["state"][9] = state["state"][0]
    else:
        state["state"][0]["exp_avg"] = "zeros"
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        optimizer.load_state_dict(state)
    after = optimizer.state_dict()["state"]
    assert all(torch.equal(after[k][n], t) for k, s in before.items() for n, t in s.items())


@pytest.mark.slow  # a fresh interpreter: seconds
def test_a_learner_trains_and_checkpoints_without_importing_torch_dynamo():
    """torch.optim imports torch._dynamo (seconds of CPU and tens of MiB) on its first
    optimizer; a learner's whole path, with a moving average, a checkpoint and a resume
    from it, must not."""
    code = """
import sys
import numpy as np
import torch
from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of
for name in ("configs/cartpole_dqn.json", "configs/cartpole.json"):
    config = load_config(name, ["training.ema_decay=0.99", "training.batch_size=8"])
    algorithm = algorithm_of(config)
    network = algorithm.make_network(config, (4,), 2)
    trainer = algorithm.make_trainer(config, network, torch.device("cpu"))
    trainer.load_state_dict(trainer.state_dict())
    trainer.optimizer.zero_grad()
    sum(p.sum() for p in trainer.network.parameters()).backward()
    trainer.optimizer.step()
    trainer.update_average()
    trainer.load_state_dict(trainer.state_dict())
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
