"""Board symmetries as data augmentation for the MuZero learner.

A board game often looks the same after a rotation or a reflection of the board: the
TicTacToe position with X in a corner is, up to symmetry, the position with X in any
other corner. AlphaGo Zero trained on a random one of the 8 dihedral transformations of
each sampled position; mpper does the same (MuZero's ``muzero.symmetry_augmentation``) for
envs that declare their symmetries, so that a position seen once in self-play teaches
the network its 8 images, and a rare line of play (what a random opponent does) is
less rare.

The contract, for an env whose actions are the cells of its board:

* ``env.unwrapped.symmetries()`` (a method, staticmethod or classmethod) returns an int
  array ``src`` of shape ``(G, A)``: row ``g`` is a permutation of the ``A`` cells, as a
  gather index: the board transformed by ``g`` holds at cell ``c`` what the original
  board holds at cell ``src[g, c]``;
* observations have shape ``(C, *board)`` with ``prod(board) == A``: planes over the
  same cells as the actions (a plane that is constant, such as TicTacToe's to-play
  plane, is left as it is by any permutation).

Then, for a sampled position and its unroll targets, one transformation ``g`` maps
every plane ``obs[:, c] <- obs[:, src[g, c]]``, every policy target the same way, and
every action ``a`` to the cell where the transformed board puts it, ``inv[g, a]``
(``src[g, inv[g, a]] == a``). Values and rewards do not change: a symmetry of the game
keeps its outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

__all__ = ["SymmetryAugmented", "check_symmetries", "dihedral_symmetries", "env_symmetries"]


def dihedral_symmetries(n: int) -> np.ndarray:
    """int64 ``(8, n*n)``: the 8 rotations and reflections of an ``n x n`` board
    (row-major cells), as gather indices; row 0 is the identity."""
    if n < 1:
        raise ValueError(f"dihedral_symmetries: n must be >= 1, got {n}")
    cells = np.arange(n * n).reshape(n, n)
    images = []
    for k in range(4):
        rotated = np.rot90(cells, k)
        images.append(rotated.reshape(-1))
        images.append(np.fliplr(rotated).reshape(-1))
    return np.stack(images).astype(np.int64)


def check_symmetries(src: Any, observation_shape: tuple[int, ...], num_actions: int, where: str) -> np.ndarray:
    """``src`` as an int64 ``(G, A)`` array, after checking the contract of this module;
    ``ValueError`` naming ``where`` (the env) otherwise."""
    arr = np.asarray(src)
    if arr.ndim != 2 or arr.shape[1] != num_actions or arr.shape[0] < 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{where}: symmetries() must return an int array of shape (G, {num_actions}) "
                         f"(a cell permutation per row), got {arr.dtype} {arr.shape}")  # fmt: skip
    expected = np.arange(num_actions)
    for g, row in enumerate(arr):
        if not np.array_equal(np.sort(row), expected):
            raise ValueError(f"{where}: symmetries() row {g} is not a permutation of the {num_actions} cells: "
                             f"{row.tolist()}")  # fmt: skip
    if len(observation_shape) < 2 or int(np.prod(observation_shape[1:])) != num_actions:
        raise ValueError(f"{where}: symmetry augmentation needs observations of shape (C, *board) with "
                         f"{num_actions} board cells (one per action), got {observation_shape}")  # fmt: skip
    return arr.astype(np.int64)


def env_symmetries(env, observation_shape: tuple[int, ...], num_actions: int, where: str) -> np.ndarray:
    """The checked ``(G, A)`` symmetries that ``env.unwrapped.symmetries()`` declares;
    ``ValueError`` when it declares none."""
    declare = getattr(env.unwrapped, "symmetries", None)
    if not callable(declare):
        raise ValueError(f"{where}: symmetry augmentation is on, but the env declares no symmetries "
                         "(env.unwrapped.symmetries(); see mpper.envs.symmetry)")  # fmt: skip
    return check_symmetries(declare(), observation_shape, num_actions, where)


@dataclass(frozen=True, eq=False)  # eq=False: an ndarray field has no truth value
class SymmetryAugmented:
    """Targets (``MuZeroTargets``) of a batch, each position seen through a random one of
    the ``symmetries`` (``(G, A)`` gather indices, see the module docstring).

    ``build`` draws ``g`` per sampled position (uniformly, from the generator the
    buffer passes) after the inner targets are built, and transforms the observation
    ``(B, C, *board)``, the actions ``(B, K+1)`` and the policy targets ``(B, K+1, A)``
    of that position with it (and the next observations ``(B, K, C, *board)`` where
    the targets have them); values, rewards and gradient scales are unchanged.
    """

    inner: Any
    symmetries: np.ndarray  # (G, A) int64

    @cached_property
    def inverse(self) -> np.ndarray:
        """``(G, A)``: ``inverse[g, a]`` is the cell where transformation g puts cell a."""
        inv = np.empty_like(self.symmetries)
        rows = np.arange(self.symmetries.shape[0])[:, None]
        inv[rows, self.symmetries] = np.arange(self.symmetries.shape[1])[None, :]
        return inv

    def build(self, fields, slots, pos, moves, terminated, rng, training_step=None) -> dict[str, np.ndarray]:
        out = self.inner.build(fields, slots, pos, moves, terminated, rng, training_step=training_step)
        batch = slots.shape[0]
        g = rng.integers(self.symmetries.shape[0], size=batch)
        src = self.symmetries[g]  # (B, A)
        obs = out["observation"]
        flat = obs.reshape(batch, obs.shape[1], -1)  # (B, C, A)
        out["observation"] = np.take_along_axis(flat, src[:, None, :], axis=2).reshape(obs.shape)
        if "next_observation" in out:  # (B, K, C, *board): the same transformation for every k
            nxt = out["next_observation"]
            flat = nxt.reshape(batch, nxt.shape[1], nxt.shape[2], -1)
            out["next_observation"] = np.take_along_axis(flat, src[:, None, None, :], axis=3).reshape(nxt.shape)
        out["target_policy"] = np.take_along_axis(out["target_policy"], src[:, None, :], axis=2)
        out["actions"] = np.take_along_axis(self.inverse[g], out["actions"], axis=1)
        return out
