"""mpper: MuZero-style and prioritized-replay training on one machine, with plain OS
processes sharing one replay buffer in shared memory."""

from .inspect_snapshot import load_snapshot
from .replay_buffer import COUNTERS, Batch, BufferHandle, EpisodeRef, ReplayBuffer
from .schema import Field, dqn_schema, muzero_schema
from .shm import SharedMemoryRoomError
from .snapshot import SnapshotError
from .sum_tree import SumTree
from .targets import MuZeroTargets, NStepTargets
from .tictactoe import TicTacToeEnv  # importing it registers the gymnasium id "mpper/TicTacToe-v0"

__version__ = "0.1.0"

__all__ = [
    "COUNTERS",
    "Batch",
    "BufferHandle",
    "EpisodeRef",
    "Field",
    "MuZeroTargets",
    "NStepTargets",
    "ReplayBuffer",
    "SharedMemoryRoomError",
    "SnapshotError",
    "SumTree",
    "TicTacToeEnv",
    "dqn_schema",
    "load_snapshot",
    "muzero_schema",
]
