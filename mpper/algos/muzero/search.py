"""The search a MuZero player runs, by ``mcts.kind``: the pUCT search
(:class:`~.mcts.BatchedMCTS`) or Gumbel MuZero's (:class:`~.gumbel.GumbelMCTS`), two
policies over one batched tree (:class:`~.tree.BatchedSearch`) behind its ``run``."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .config import MCTSConfig
from .gumbel import GumbelMCTS
from .mcts import BatchedMCTS
from .tree import SearchResult

__all__ = ["Search", "make_search"]


class Search(Protocol):
    def run(
        self, network, observations: np.ndarray, legal_actions: np.ndarray, to_play: np.ndarray,
        add_exploration_noise: bool, rng: np.random.Generator, root_noise: np.ndarray | None = None,
        tie_break: np.ndarray | None = None,
    ) -> SearchResult: ...  # fmt: skip


def make_search(num_actions: int, config: MCTSConfig, support_size: int, two_player: bool = False) -> Search:
    """The search ``config.kind`` names, for ``num_actions`` actions."""
    if config.kind == "gumbel":
        return GumbelMCTS(num_actions, config, support_size, two_player)
    if config.kind == "puct":
        return BatchedMCTS(num_actions, config, support_size, two_player)
    raise ValueError(f'mcts.kind must be "puct" or "gumbel", got {config.kind!r}')
