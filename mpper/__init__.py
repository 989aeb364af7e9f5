"""mpper: MuZero-style and prioritized-replay training on one machine, with plain OS
processes sharing one replay buffer in shared memory."""

from .envs.tictactoe import TicTacToeEnv  # importing it registers the gymnasium id "mpper/TicTacToe-v0"
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
    "COUNTERS",
    "Batch",
    "BufferHandle",
    "EpisodeRef",
    "Field",
    "ReplayBuffer",
    "SharedMemoryRoomError",
    "SnapshotError",
    "SumTree",
    "TicTacToeEnv",
    "load_snapshot",
]
