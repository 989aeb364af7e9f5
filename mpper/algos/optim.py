"""The trainers' optimizers, Adam and SGD with momentum, without ``torch.optim``'s compiler hooks.

A ``torch.optim`` optimizer imports ``torch._dynamo`` when it is built and wraps every
step in hooks for ``torch.compile`` (``_disable_dynamo``, graph breaks, a profiler
record). The import costs a learner seconds of CPU and tens of MiB before its first
update, on every start. These two classes do the same arithmetic: Adam calls
``torch._fused_adam_``, the single kernel behind ``torch.optim.Adam(fused=True)``, and
SGD does ``torch.optim.SGD``'s heavy-ball update with ``foreach`` ops
(``tests/algos/test_optim.py`` holds both to ``torch.optim``'s step for step).

Their ``state_dict`` is ``torch.optim``'s format, parameters by index: a checkpoint
written with either loads into the other, so checkpoints from ``torch.optim.Adam`` resume
here, and the static step (``mpper.algos.muzero.static_step``, which keeps
``torch.optim``'s capturable fused optimizers for CUDA graphs and ``torch.compile``)
resumes from checkpoints written here.

The interface is the part of ``torch.optim.Optimizer`` the trainers use: one parameter
group in ``param_groups`` (its ``"lr"`` is set before each step), ``state`` (per
parameter: its tensors), ``zero_grad``, ``step``, ``state_dict`` and ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any

import torch


class _Optimizer:
    """One parameter group, the state per parameter, and the checkpoint format."""

    # the group's hyperparameters a checkpoint must hold (torch.optim's names)
    _hyperparameters: tuple[str, ...] = ()
    # the flags torch.optim's optimizer of this kind writes in a group, with the values that
    # describe this one's arithmetic (so that torch.optim loads its checkpoints)
    _flags: dict[str, Any] = {}
    # the flags whose other values would change the arithmetic: a checkpoint with another
    # value is refused (fused, foreach and capturable choose kernels, not results)
    _arithmetic_flags: tuple[str, ...] = ()

    def __init__(self, params, **hyperparameters: Any) -> None:
        params = list(params)
        if not params:
            raise ValueError("an optimizer needs at least one parameter")
        self.param_groups: list[dict[str, Any]] = [{"params": params, **hyperparameters, **self._flags}]
        self.state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}

    @property
    def _params(self) -> list[torch.nn.Parameter]:
        return self.param_groups[0]["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s format: ``{"state": {index: {name: tensor}}, "param_groups":
        [{hyperparameters..., "params": [indices]}]}`` (references to the live tensors, as
        torch's own; ``torch.save`` copies them)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self._params)))
        state = {index[id(p)]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` or a ``torch.optim`` optimizer of the same kind wrote
        for the same parameters: the group's hyperparameters (``"lr"`` among them, as torch
        loads it; the trainers set it again before each step) and every parameter's state,
        onto its parameter's device and dtype.
        Raises ValueError (or KeyError: no ``param_groups``) where it does not fit."""
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"the optimizer state has {len(groups)} parameter groups, this optimizer has 1")
        group = groups[0]
        params = self._params
        if len(group["params"]) != len(params):
            raise ValueError(f"the optimizer state's parameter group has {len(group['params'])} parameters, "
                             f"this optimizer's has {len(params)}")  # fmt: skip
        for flag in self._arithmetic_flags:
            if flag in group and group[flag] != self._flags[flag]:
                raise ValueError(f"the optimizer state has {flag}={group[flag]!r}, which this optimizer does not do")
        missing = [k for k in self._hyperparameters if k not in group]
        if missing:
            raise ValueError(f"the optimizer state's parameter group is missing {missing}")
        by_index = {saved: p for saved, p in zip(group["params"], params)}
        state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for key, saved in state_dict["state"].items():
            if key not in by_index:
                raise ValueError(f"the optimizer state has parameter {key!r}, which is not in its group")
            p = by_index[key]
            state[p] = {name: self._restored(name, value, p) for name, value in saved.items() if value is not None}
        hyperparameters = {k: _numbers(group[k]) for k in self._hyperparameters}
        self.param_groups[0].update(hyperparameters)
        self.state = state

    def _restored(self, name: str, value: Any, p: torch.nn.Parameter) -> torch.Tensor:
        if not torch.is_tensor(value):
            raise ValueError(f"the optimizer state's {name!r} is a {type(value).__name__}, not a tensor")
        return value.detach().to(device=p.device, dtype=p.dtype).clone()


def _numbers(value: Any) -> float | tuple[float, ...]:
    """A hyperparameter as a float, or a tuple of floats (Adam's betas)."""
    return tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else float(value)


class Adam(_Optimizer):
    """Adam (Kingma & Ba, 2015), with ``weight_decay`` as an L2 term added to the gradient
    (``torch.optim.Adam``'s, not AdamW's), bias-corrected moments, ``eps`` added to the
    square root of the second moment. One ``torch._fused_adam_`` call per step (CPU and
    CUDA). State per parameter: ``step`` (a 0-d float32 tensor on its device, as the
    fused kernel wants it), ``exp_avg`` and ``exp_avg_sq`` (its shape)."""

    _hyperparameters = ("lr", "betas", "eps", "weight_decay")
    _flags = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
              "fused": True, "decoupled_weight_decay": False}  # fmt: skip
    _arithmetic_flags = ("amsgrad", "maximize", "decoupled_weight_decay")

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:  # fmt: skip
        super().__init__(params, lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                         weight_decay=float(weight_decay))  # fmt: skip

    def _restored(self, name: str, value: Any, p: torch.nn.Parameter) -> torch.Tensor:
        if name == "step":  # torch.optim keeps it on the CPU unless fused or capturable
            step = value if torch.is_tensor(value) else torch.tensor(float(value))
            return step.detach().to(device=p.device, dtype=torch.float32).reshape(()).clone()
        return super()._restored(name, value, p)

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state.get(p)
            if state is None:
                state = self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=float(group["lr"]), beta1=beta1,
                           beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                           maximize=False)  # fmt: skip


class SGD(_Optimizer):
    """SGD with heavy-ball momentum as ``torch.optim.SGD`` (no dampening, no Nesterov):
    ``g += weight_decay * p``; ``buf = g`` on the first step, then ``buf = momentum * buf
    + g``; ``p -= lr * buf``. State per parameter: ``momentum_buffer`` (with momentum)."""

    _hyperparameters = ("lr", "momentum", "weight_decay")
    _flags = {"dampening": 0.0, "nesterov": False, "maximize": False, "foreach": None, "differentiable": False,
              "fused": None}  # fmt: skip
    _arithmetic_flags = ("dampening", "nesterov", "maximize")

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=float(lr), momentum=float(momentum), weight_decay=float(weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads: list[torch.Tensor] = [p.grad for p in params if p.grad is not None]
        if group["weight_decay"] != 0:
            grads = list(torch._foreach_add(grads, params, alpha=group["weight_decay"]))
        momentum = group["momentum"]
        if momentum != 0:
            buffers = []
            for p, g in zip(params, grads):
                state = self.state.setdefault(p, {})
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = g.detach().clone()  # the first step: buf = g
                else:
                    state["momentum_buffer"].mul_(momentum).add_(g)
                buffers.append(state["momentum_buffer"])
            grads = buffers
        torch._foreach_add_(params, grads, alpha=-float(group["lr"]))
