"""Will a run fit this machine? Its sizes, computed from the config before anything
starts, against the free space of /dev/shm and the machine's memory.

What a run holds (the per-process figures are ``python bench/startup.py``'s, in
docs/experiments/runtime.md: a child's private memory beside what it shares with the
forkserver, whose libraries and numba's compiler with the buffer's kernels
``mpper.runtime.preload`` loads there once; and the supervisor, the forkserver and the
resource tracker together):

- the replay buffer, one shared-memory segment: exactly the bytes of its layout;
- the network, as float32 parameters: the learner holds it with its gradients, Adam's
  two moments and a moving average or target network (5 copies), every other process
  one copy, and the weight store one more in shared memory;
- what each self-play worker's player holds beside the network (the algorithm's
  ``player_bytes``; MuZero: its search trees, ``envs_per_worker x (num_simulations + 1)``
  nodes, each with its statistics, children and hidden state);
- every process's own interpreter and libraries (``_CHILD_BYTES``, ``_BASE_BYTES``).

The network and search figures are exact counts; the per-process ones are typical,
so the memory check refuses only what cannot fit, with the figures it computed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .. import shm
from ..algos.registry import algorithm_of
from ..config import Config, ConfigError
from ..envs.spec import EnvSpec
from ..replay.buffer import segment_bytes

__all__ = ["RunSize", "check_fits", "memory_bytes", "run_size"]

_CHILD_BYTES = 32 << 20  # private memory of one child process (worker, learner, evaluator, reanalyser)
_BASE_BYTES = 320 << 20  # supervisor, forkserver and resource tracker, with the libraries all processes share
_LEARNER_COPIES = 5  # weights, gradients, Adam's two moments, moving average or target network


@dataclass(frozen=True)
class RunSize:
    """Bytes a run needs, by what holds them."""

    buffer: int  # the replay buffer's shared-memory segment
    parameters: int  # network parameters (count)
    network: int  # all copies of the network, the weight store included
    search: int  # what the workers' players hold beside the network (MuZero: search trees)
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


def _meta_model(config: Config, spec: EnvSpec):
    """The model built on torch's meta device: shapes only, no memory, whatever the widths."""
    with torch.device("meta"):
        return algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions)


def run_size(config: Config, spec: EnvSpec) -> RunSize:
    """What the run of ``config`` on an env like ``spec`` needs (see the module docstring)."""
    capacity = config.replay.capacity
    algorithm = algorithm_of(config)
    buffer = segment_bytes(algorithm.run_schema(config, spec), capacity)
    model = _meta_model(config, spec)
    parameters = sum(p.numel() for p in model.parameters())
    rt = config.runtime
    workers = rt.workers
    reanalyser = algorithm.make_reanalyser is not None and algorithm.reanalyses(config)
    children = workers + 2 + (1 if reanalyser else 0)  # + learner, evaluator
    copies = _LEARNER_COPIES + (children - 1) + 1  # the learner's, one per other child, the weight store
    search = 0
    if algorithm.player_bytes is not None:
        search = max(workers, 1) * algorithm.player_bytes(config, spec, model)
    processes = children + 2 if workers > 0 else 1
    interpreters = _BASE_BYTES + (children * _CHILD_BYTES if workers > 0 else 0)
    return RunSize(buffer, parameters, copies * parameters * np.dtype(np.float32).itemsize, search, processes,
                   interpreters)  # fmt: skip


def check_fits(config: Config, spec: EnvSpec) -> None:
    """ConfigError (one line, with the figures) unless the run fits: the longest episode
    the env can play in the ring (``spec.max_episode_steps``, as the algorithm stores it),
    the replay buffer in /dev/shm's free space (``shm.check_room``'s message), and
    everything in memory."""
    if spec.max_episode_steps is not None:
        moves = algorithm_of(config).stored_moves(config, spec.max_episode_steps)
        if moves + 1 > config.replay.capacity:
            limit = "env.training_max_episode_steps" if config.env.training_max_episode_steps is not None \
                else "env.max_episode_steps"  # fmt: skip
            raise ConfigError(f"an episode of env.id {config.env.id!r} can last {spec.max_episode_steps:,} moves, "
                              f"stored as {moves + 1:,} rows, but replay.capacity is {config.replay.capacity:,}: "
                              f"raise replay.capacity, or lower {limit}")  # fmt: skip
    size = run_size(config, spec)
    try:
        shm.check_room(size.buffer, f"a replay buffer of {config.replay.capacity} steps")
    except shm.SharedMemoryRoomError as exc:
        raise ConfigError(str(exc)) from None
    available = memory_bytes()
    if size.total <= available:
        return
    h = shm.human_bytes
    parts = [f"replay buffer {h(size.buffer)} (replay.capacity {config.replay.capacity:,})",
             f"network {h(size.network)} ({size.parameters:,} parameters, in every process)"]  # fmt: skip
    if size.search:
        parts.append(f"players {h(size.search)} (runtime.workers {config.runtime.workers} x envs_per_worker "
                     f"{config.runtime.envs_per_worker} envs, beside the network: MuZero's search trees)")  # fmt: skip
    parts.append(f"{size.processes} processes {h(size.interpreters)}")
    raise ConfigError(f"this run needs about {h(size.total)} of memory but this machine has {h(available)}: "
                      f"{', '.join(parts)}; lower the largest")  # fmt: skip
