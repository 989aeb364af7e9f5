"""The replay core: a sum tree (``sum_tree``) under an episode ring (``episode_ring``)
under the shared-memory buffer (``buffer``), with the row layout (``schema``), the
target-builder contract and shared gathers (``targets``), whole-buffer passes
(``positions``) and snapshots on disk (``snapshot``). It knows no algorithm, no env
and no process: an algorithm hands it a schema (with the counters it counts) and a
target builder."""

from .buffer import COUNTERS, Batch, BufferHandle, EpisodeRef, ReplayBuffer, load_snapshot
from .schema import Field, Schema
from .snapshot import SnapshotError
from .sum_tree import SumTree
from .targets import RawRows, TargetBuilder

__all__ = ["COUNTERS", "Batch", "BufferHandle", "EpisodeRef", "Field", "RawRows", "ReplayBuffer", "Schema",
           "SnapshotError", "SumTree", "TargetBuilder", "load_snapshot"]
