"""Will a run fit this machine? Its sizes, computed from the config before anything
starts, against the free space of /dev/shm and the machine's memory.

What a run holds (figures per process measured on the 2-core VM with
``configs/cartpole.json``: a child's private memory, beside the libraries it shares
with the forkserver, was 83-86 MiB; the supervisor and the forkserver about 260 MiB
together):

- the replay buffer, one shared-memory segment: exactly the bytes of its layout;
- the network, as float32 parameters: the learner holds it with its gradients, Adam's
  two moments and a moving average or target network (5 copies), every other process
  one copy, and the weight store one more in shared memory;
- each self-play worker's search trees: ``envs_per_worker x (num_simulations + 1)``
  nodes, each with its statistics, children and hidden state;
- every process's own interpreter and libraries (``_CHILD_BYTES``, ``_BASE_BYTES``).

The network and search figures are exact counts; the per-process ones are typical,
so the memory check refuses only what cannot fit, with the figures it computed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from . import shm
from .config import Config, ConfigError
from .envs import EnvSpec

__all__ = ["RunSize", "check_fits", "memory_bytes", "run_size"]

_CHILD_BYTES = 80 << 20  # private memory of one child process (worker, learner, evaluator, reanalyser)
_BASE_BYTES = 260 << 20  # the supervisor and the forkserver, with the libraries all processes share
_LEARNER_COPIES = 5  # weights, gradients, Adam's two moments, moving average or target network
# Per search-tree node: visit count, value sum, reward, player (8 bytes each), path entry;
# per action a prior (8) and a child index (8).
_NODE_BYTES, _NODE_ACTION_BYTES = 5 * 8, 16


@dataclass(frozen=True)
class RunSize:
    """Bytes a run needs, by what holds them."""

    buffer: int  # the replay buffer's shared-memory segment
    parameters: int  # network parameters (count)
    network: int  # all copies of the network, the weight store included
    search: int  # the search trees of all workers
    processes: int  # number of processes: children, supervisor and forkserver
    interpreters: int  # the processes' own interpreters and libraries

    @property
    def total(self) -> int:
        return self.buffer + self.network + self.search + self.interpreters


def memory_bytes() -> int:
    """The memory this process may use: physical memory, or a smaller cgroup limit."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _network_size(config: Config, spec: EnvSpec) -> tuple[int, int]:
    """(parameters, numbers in one hidden state), from the model built on torch's meta
    device: shapes only, no memory, whatever the widths."""
    import torch

    from .networks import make_model, stacked_shape

    with torch.device("meta"):
        model = make_model(config, spec.observation_shape, spec.num_actions)
    parameters = sum(p.numel() for p in model.parameters())
    hidden = config.network.encoding_size
    if config.algorithm == "muzero":
        shape = stacked_shape(spec.observation_shape, config.training.stacked_observations)
        try:
            hidden = math.prod(model.representation(torch.empty((1, *shape), device="meta")).shape[1:])
        except (RuntimeError, NotImplementedError, TypeError):  # an op without a meta kernel
            pass
    return parameters, hidden


def run_size(config: Config, spec: EnvSpec) -> RunSize:
    """What the run of ``config`` on an env like ``spec`` needs (see the module docstring)."""
    from .replay_buffer import _layout, _offsets
    from .schema import normalize_schema, schema_for

    capacity = config.replay.capacity
    schema = normalize_schema(schema_for(config.algorithm, spec.observation_shape, spec.num_actions,
                                         spec.observation_dtype))  # fmt: skip
    buffer = _offsets(_layout(schema, capacity, max(1, capacity // 2)))[1]
    parameters, hidden = _network_size(config, spec)
    rt = config.runtime
    workers = rt.workers
    children = workers + 2 + (1 if rt.reanalyse and config.algorithm == "muzero" else 0)  # + learner, evaluator
    copies = _LEARNER_COPIES + (children - 1) + 1  # the learner's, one per other child, the weight store
    search = 0
    if config.algorithm == "muzero":
        nodes = rt.envs_per_worker * (config.mcts.num_simulations + 1)
        per_node = _NODE_BYTES + _NODE_ACTION_BYTES * spec.num_actions + 4 * hidden
        search = max(workers, 1) * nodes * per_node
    processes = children + 2 if workers > 0 else 1
    interpreters = _BASE_BYTES + (children * _CHILD_BYTES if workers > 0 else 0)
    return RunSize(buffer, parameters, copies * parameters * np.dtype(np.float32).itemsize, search, processes,
                   interpreters)  # fmt: skip


def check_fits(config: Config, spec: EnvSpec) -> None:
    """ConfigError (one line, with the figures) unless the run fits: the replay buffer
    in /dev/shm's free space (``shm.check_room``'s message), and everything in memory."""
    size = run_size(config, spec)
    try:
        shm.check_room(size.buffer, f"a replay buffer of {config.replay.capacity} steps")
    except shm.SharedMemoryRoomError as exc:
        raise ConfigError(str(exc)) from None
    available = memory_bytes()
    if size.total <= available:
        return
    h = shm._human
    parts = [f"replay buffer {h(size.buffer)} (replay.capacity {config.replay.capacity:,})",
             f"network {h(size.network)} ({size.parameters:,} parameters, network.hidden {config.network.hidden}, "
             f"encoding_size {config.network.encoding_size}, in every process)"]  # fmt: skip
    if size.search:
        parts.append(f"search trees {h(size.search)} (runtime.workers {config.runtime.workers} x envs_per_worker "
                     f"{config.runtime.envs_per_worker} x (mcts.num_simulations {config.mcts.num_simulations} + 1) "
                     f"nodes)")  # fmt: skip
    parts.append(f"{size.processes} processes {h(size.interpreters)}")
    raise ConfigError(f"this run needs about {h(size.total)} of memory but this machine has {h(available)}: "
                      f"{', '.join(parts)}; lower the largest")  # fmt: skip
