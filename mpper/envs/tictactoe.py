"""TicTacToe as a two-player gymnasium env, and two reference opponents.

``TicTacToeEnv`` follows the two-player contract of :mod:`mpper.envs.two_player`; importing
this module (``import mpper`` does) registers it as ``"mpper/TicTacToe-v0"``, so a config
can say ``"env": {"id": "mpper/TicTacToe-v0"}`` (or ``"mpper.envs.tictactoe:TicTacToeEnv"``).

Cells and actions: action ``a`` in 0..8 puts a stone on row ``a // 3``, column ``a % 3``::

    0 | 1 | 2
    3 | 4 | 5
    6 | 7 | 8

Player 0 (X) moves first, then the players alternate.

Opponents, for judging a trained agent (:mod:`mpper.algos.muzero.arena`):

* :func:`random_player`: uniform over the legal moves;
* :func:`perfect_player`: a negamax over every reachable position (5478 of them, the
  empty board and the terminal ones included), computed once on first use and cached.
  It never loses. Among the moves of equal game value it prefers the fastest win and
  the slowest loss; among the moves still tied it takes the lowest index, or draws one
  at random when given a random generator.

Both read the board from an observation (planes 0 and 1: the mover's and the opponent's
stones), so they play either side without being told which.
``TicTacToeEnv.evaluation_opponents(seed)`` hands both to the evaluator, which reports
wins, draws and losses against each (:func:`mpper.runtime.evaluation.evaluate`).
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium as gym
import numpy as np

from .symmetry import dihedral_symmetries
from .two_player import AgentFn

__all__ = [
    "ENV_ID",
    "LINES",
    "TicTacToeEnv",
    "optimal_actions",
    "perfect_agent",
    "perfect_player",
    "position_scores",
    "position_value",
    "random_agent",
    "random_player",
    "reachable_positions",
]

ENV_ID = "mpper/TicTacToe-v0"

# The 8 winning lines as cell indices: rows, columns, the two diagonals.
LINES: tuple[tuple[int, int, int], ...] = (
    (0, 1, 2), (3, 4, 5), (6, 7, 8),
    (0, 3, 6), (1, 4, 7), (2, 5, 8),
    (0, 4, 8), (2, 4, 6),
)  # fmt: skip
_LINE_MASKS = tuple(sum(1 << c for c in line) for line in LINES)
_FULL = (1 << 9) - 1
_SYMBOLS = ("X", "O")


def _has_line(stones: int) -> bool:
    """Whether the 9-bit set of one player's stones (bit c: cell c) holds a whole line."""
    return any(stones & m == m for m in _LINE_MASKS)


class TicTacToeEnv(gym.Env):
    """TicTacToe for MuZero self-play, from the point of view of the player to move.

    Observation: float32 ``(3, 3, 3)``, planes first (the residual network's (C, H, W)):

    * plane 0: 1.0 where the player to move has a stone, else 0.0;
    * plane 1: 1.0 where the other player has a stone, else 0.0;
    * plane 2: all 1.0 when player 0 (X, who moves first) is to move, all 0.0 when
      player 1 (O) is.

    Planes 0 and 1 show the board as the mover sees it (a MuZero network evaluates a
    position for the player to move); plane 2 keeps who that is, since X and O do not
    stand equal in a position with the same stones.

    Actions: ``Discrete(9)``, the cell ``row * 3 + col``. Playing an occupied cell, an
    action outside 0..8, or any move after the game ended raises ``ValueError`` (no
    silent penalty: the search never proposes an illegal move, so one is a bug).

    Reward: from the point of view of the player who just moved: +1.0 when the move
    completes a line (a win), 0.0 otherwise (draw or game going on). The game
    terminates at a win or when the board is full (draw); it is never truncated.

    ``info`` at reset and after each step (the two-player contract):

    * ``to_play``: int, the player to move next, 0 or 1 (after the last move: the one
      who would move next);
    * ``action_mask``: bool ``(9,)``, True on the empty cells; all False once the game
      ended (no move is legal any more);
    * ``winner``: only when the game just ended: 0 or 1 for the winner, -1 for a draw.

    Render modes: ``"ansi"`` (a string; X, O and '.' for an empty cell) and
    ``"rgb_array"`` (a uint8 ``(96, 96, 3)`` image drawn with numpy).
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi", "rgb_array"], "render_fps": 2}
    two_player = True  # read by mpper.runtime.roles and mpper.envs.spec (the two-player contract)

    def __init__(self, render_mode: str | None = None) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"TicTacToeEnv: render_mode must be one of {self.metadata['render_modes']} or None, "
                             f"got {render_mode!r}")  # fmt: skip
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Box(0.0, 1.0, (3, 3, 3), np.float32)
        self.action_space = gym.spaces.Discrete(9)
        self._stones = [0, 0]  # per player, a 9-bit set of cells (bit c: cell c)
        self._to_play = 0
        self._winner: int | None = None  # 0 / 1, -1 for a draw, None while playing

    # -- state ---------------------------------------------------------------------------

    @property
    def to_play(self) -> int:
        """The player to move (0: X, 1: O)."""
        return self._to_play

    @property
    def board(self) -> np.ndarray:
        """int8 ``(3, 3)``: 0 empty, 1 a stone of player 0 (X), 2 a stone of player 1 (O)."""
        cells = np.zeros(9, np.int8)
        for player in (0, 1):
            cells[[c for c in range(9) if self._stones[player] >> c & 1]] = player + 1
        return cells.reshape(3, 3)

    @property
    def done(self) -> bool:
        """Whether the game has ended (a win or a full board)."""
        return self._winner is not None

    def legal_actions(self) -> np.ndarray:
        """bool ``(9,)``: True on the empty cells, all False once the game ended."""
        if self.done:
            return np.zeros(9, bool)
        occupied = self._stones[0] | self._stones[1]
        return np.array([not occupied >> c & 1 for c in range(9)], bool)

    def _observation(self) -> np.ndarray:
        obs = np.zeros((3, 9), np.float32)
        mover, other = self._stones[self._to_play], self._stones[1 - self._to_play]
        for c in range(9):
            obs[0, c] = mover >> c & 1
            obs[1, c] = other >> c & 1
        obs[2] = 1.0 if self._to_play == 0 else 0.0
        return obs.reshape(3, 3, 3)

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"to_play": self._to_play, "action_mask": self.legal_actions()}
        if self._winner is not None:
            info["winner"] = self._winner
        return info

    # -- gymnasium API ---------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Empty board, player 0 (X) to move. The game has no randomness; ``seed`` only
        seeds ``self.np_random`` (gymnasium's convention)."""
        super().reset(seed=seed)
        self._stones = [0, 0]
        self._to_play = 0
        self._winner = None
        return self._observation(), self._info()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """The player to move puts a stone on cell ``action``; the reward is theirs."""
        if self._winner is not None:
            raise ValueError("TicTacToeEnv.step: the game is over; call reset() first")
        try:
            cell = int(action)
        except (TypeError, ValueError):
            raise ValueError(f"TicTacToeEnv.step: action must be an integer cell 0..8, got {action!r}") from None
        if cell != action or not 0 <= cell < 9:
            raise ValueError(f"TicTacToeEnv.step: action must be an integer cell 0..8, got {action!r}")
        for player in (0, 1):
            if self._stones[player] >> cell & 1:
                raise ValueError(
                    f"TicTacToeEnv.step: illegal move {cell} (row {cell // 3}, column {cell % 3}) by player "
                    f"{self._to_play} ({_SYMBOLS[self._to_play]}): the cell holds {_SYMBOLS[player]}; "
                    f"legal moves: {np.flatnonzero(self.legal_actions()).tolist()}"
                )
        mover = self._to_play
        self._stones[mover] |= 1 << cell
        reward = 0.0
        if _has_line(self._stones[mover]):
            self._winner = mover
            reward = 1.0
        elif self._stones[0] | self._stones[1] == _FULL:
            self._winner = -1
        self._to_play = 1 - mover
        return self._observation(), reward, self._winner is not None, False, self._info()

    @staticmethod
    def symmetries() -> np.ndarray:
        """The 8 rotations and reflections of the board, as cell permutations ``(8, 9)``
        (the contract of :mod:`mpper.envs.symmetry`; the to-play plane is constant)."""
        return dihedral_symmetries(3)

    @staticmethod
    def evaluation_opponents(seed: int = 0) -> dict[str, AgentFn]:
        """The evaluator's opponents (the hook of :mod:`mpper.envs.two_player`), weakest
        first: ``"random"`` (:func:`random_agent`) and ``"perfect"`` (:func:`perfect_agent`,
        a random choice among the optimal moves), generators seeded from ``seed``."""
        return {"random": random_agent(seed), "perfect": perfect_agent(seed + 1)}

    def render(self) -> str | np.ndarray | None:
        """``"ansi"``: the board as text; ``"rgb_array"``: uint8 (96, 96, 3); None: nothing."""
        if self.render_mode == "ansi":
            board = self.board.reshape(-1)
            rows = [" ".join(".XO"[board[r * 3 + c]] for c in range(3)) for r in range(3)]
            if self._winner is None:
                status = f"{_SYMBOLS[self._to_play]} (player {self._to_play}) to play"
            elif self._winner == -1:
                status = "draw"
            else:
                status = f"{_SYMBOLS[self._winner]} (player {self._winner}) won"
            return "\n".join(rows + [status]) + "\n"
        if self.render_mode == "rgb_array":
            return _draw(self.board)
        return None


# --------------------------------------------------------------------------------------
# rgb_array rendering (numpy only)
# --------------------------------------------------------------------------------------

_CELL = 32  # pixels per cell
_LINE = 2  # grid line width


def _draw(board: np.ndarray) -> np.ndarray:
    """A white 96 x 96 board with grey grid lines, red crosses (X) and blue rings (O)."""
    size = 3 * _CELL
    img = np.full((size, size, 3), 255, np.uint8)
    for k in (1, 2):
        lo = k * _CELL - _LINE // 2
        img[lo : lo + _LINE, :] = 160
        img[:, lo : lo + _LINE] = 160
    yy, xx = np.mgrid[0:_CELL, 0:_CELL].astype(np.float32) + 0.5
    centre, margin = _CELL / 2, 7
    inside = (np.minimum(yy, xx) >= margin) & (np.maximum(yy, xx) <= _CELL - margin)
    cross = inside & ((np.abs(yy - xx) <= 1.5) | (np.abs(yy + xx - _CELL) <= 1.5))
    radius = np.hypot(yy - centre, xx - centre)
    ring = np.abs(radius - (centre - margin)) <= 1.5
    for r in range(3):
        for c in range(3):
            patch = img[r * _CELL : (r + 1) * _CELL, c * _CELL : (c + 1) * _CELL]
            if board[r, c] == 1:
                patch[cross] = (200, 30, 30)
            elif board[r, c] == 2:
                patch[ring] = (30, 60, 200)
    return img


# --------------------------------------------------------------------------------------
# Opponents
# --------------------------------------------------------------------------------------


def _bits(observation: np.ndarray) -> tuple[int, int]:
    """(mover's stones, opponent's stones) as 9-bit sets, from planes 0 and 1."""
    planes = np.asarray(observation).reshape(-1, 9)
    mine = sum(1 << c for c in range(9) if planes[0, c] > 0.5)
    theirs = sum(1 << c for c in range(9) if planes[1, c] > 0.5)
    if mine & theirs:
        raise ValueError("TicTacToe observation: a cell holds stones of both players")
    return mine, theirs


@functools.cache
def _negamax(mine: int, theirs: int) -> int:
    """Score of the position for the player to move (``mine``), the opponent (``theirs``)
    having just moved: > 0 a forced win, 0 a draw, < 0 a forced loss. A win or loss
    scores 1 + the number of cells still empty when it happens, so that sooner wins and
    later losses score better. Cached: each of the 5478 reachable positions once."""
    if _has_line(theirs):
        return -(1 + 9 - (mine | theirs).bit_count())
    occupied = mine | theirs
    if occupied == _FULL:
        return 0
    return max(-_negamax(theirs, mine | 1 << c) for c in range(9) if not occupied >> c & 1)


def position_scores(observation: np.ndarray) -> np.ndarray:
    """int64 ``(9,)``: the negamax score (see :func:`perfect_player`) of each legal move
    for the player to move, from their point of view; illegal moves hold a very negative
    number (-100). ``observation`` is the env's (planes 0, 1: mover's and opponent's
    stones); the game must not be over."""
    mine, theirs = _bits(observation)
    occupied = mine | theirs
    if _has_line(mine) or _has_line(theirs) or occupied == _FULL:
        raise ValueError("TicTacToe: the game is over in this position; there is no move to score")
    return np.array([-_negamax(theirs, mine | 1 << c) if not occupied >> c & 1 else -100 for c in range(9)], np.int64)


def reachable_positions() -> np.ndarray:
    """float32 ``(4520, 3, 3, 3)``: every position reachable from the empty board in
    which the game is not over, as the env observes it (planes: the mover's stones, the
    opponent's, the to-play plane), each once, in depth-first order from the empty board.
    (Of the 5,478 reachable positions, 958 are finished games.)"""
    seen: set[tuple[int, int]] = set()
    order: list[tuple[int, int]] = []
    stack = [(0, 0)]  # (stones of the player to move, of the other)
    while stack:
        mine, theirs = stack.pop()
        if (mine, theirs) in seen:
            continue
        seen.add((mine, theirs))
        occupied = mine | theirs
        if _has_line(theirs) or occupied == _FULL:
            continue
        order.append((mine, theirs))
        stack.extend((theirs, mine | 1 << c) for c in range(8, -1, -1) if not occupied >> c & 1)
    obs = np.zeros((len(order), 3, 9), np.float32)
    for i, (mine, theirs) in enumerate(order):
        for c in range(9):
            obs[i, 0, c] = mine >> c & 1
            obs[i, 1, c] = theirs >> c & 1
        obs[i, 2] = 1.0 if (mine | theirs).bit_count() % 2 == 0 else 0.0  # X (player 0) moves on even counts
    return obs.reshape(-1, 3, 3, 3)


def position_value(observation: np.ndarray) -> int:
    """Game-theoretic value of the position for the player to move: +1 (forced win),
    0 (draw with best play) or -1 (forced loss); of a finished game, its result for the
    player who would move next (-1 lost, 0 drawn)."""
    mine, theirs = _bits(observation)
    return int(np.sign(_negamax(mine, theirs)))


def optimal_actions(observation: np.ndarray) -> np.ndarray:
    """bool ``(9,)``: the moves :func:`perfect_player` chooses among (best score: the best
    result, then the fastest win or slowest loss)."""
    scores = position_scores(observation)
    return scores == scores.max()


def perfect_player(observation: np.ndarray, mask: np.ndarray, rng: np.random.Generator | None = None) -> int:
    """A move that keeps the best game-theoretic result for the player to move.

    Args:
        observation: the env's observation ``(3, 3, 3)`` (planes 0, 1: the mover's and
            the opponent's stones; plane 2 is not read).
        mask: bool ``(9,)``, the legal moves; must be the empty cells of ``observation``
            (a mismatch means the observation is from the wrong point of view or stale).
        rng: None: the lowest-index optimal move (deterministic); a generator: one of the
            optimal moves, uniformly.
    """
    mine, theirs = _bits(observation)
    empty = np.array([not (mine | theirs) >> c & 1 for c in range(9)])
    if not np.array_equal(np.asarray(mask, bool), empty):
        raise ValueError(f"perfect_player: the mask {np.asarray(mask, bool).astype(int).tolist()} is not the set "
                         f"of empty cells {empty.astype(int).tolist()} of the observation")  # fmt: skip
    best = np.flatnonzero(optimal_actions(observation))
    return int(best[0] if rng is None else rng.choice(best))


def random_player(observation: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> int:
    """A legal move drawn uniformly from ``mask`` (bool ``(9,)``); the observation is not read."""
    legal = np.flatnonzero(np.asarray(mask, bool))
    if legal.size == 0:
        raise ValueError("random_player: no legal move in the mask")
    return int(rng.choice(legal))


def random_agent(seed: int | None = None) -> AgentFn:
    """``random_player`` as an arena agent ``(observation, mask, to_play) -> action``,
    with its own generator seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    return lambda observation, mask, to_play: random_player(observation, mask, rng)


def perfect_agent(seed: int | None = None, randomize: bool = True) -> AgentFn:
    """``perfect_player`` as an arena agent; ``randomize``: a uniform choice among the
    optimal moves (generator seeded by ``seed``), else always the lowest-index one."""
    rng = np.random.default_rng(seed) if randomize else None
    return lambda observation, mask, to_play: perfect_player(observation, mask, rng)


if ENV_ID not in gym.envs.registry:  # re-importing (or reloading) the module must not warn
    gym.register(id=ENV_ID, entry_point="mpper.envs.tictactoe:TicTacToeEnv")
