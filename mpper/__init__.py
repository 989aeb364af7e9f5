"""mpper: MuZero-style and prioritized-replay training on one machine, with plain OS
processes sharing one replay buffer in shared memory.

``mpper.train(config, **flags)`` trains a run and returns a :class:`TrainedRun`;
``mpper.load(run_dir)`` returns an :class:`Agent` whose ``act(observation)`` plays as
the run's evaluator does (see :mod:`mpper.api`)."""

from .api import Agent, TrainedRun, load, train
from .config import ConfigError
from .envs.tictactoe import TicTacToeEnv  # importing it registers the gymnasium id "mpper/TicTacToe-v0"
from .launch import LaunchError
from .replay import (
    COUNTERS,
    Batch,
    BufferHandle,
    EpisodeRef,
    Field,
    ReplayBuffer,
    SnapshotError,
    SumTree,
    load_snapshot,
)
from .shm import SharedMemoryRoomError

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "COUNTERS",
    "ConfigError",
    "LaunchError",
    "TrainedRun",
    "Batch",
    "BufferHandle",
    "EpisodeRef",
    "Field",
    "ReplayBuffer",
    "SharedMemoryRoomError",
    "SnapshotError",
    "SumTree",
    "TicTacToeEnv",
    "load",
    "load_snapshot",
    "train",
]
