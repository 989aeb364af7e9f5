"""A sum tree over float64 priorities, for proportional prioritized sampling.

Layout: a flat float64 array ``tree`` of ``2 * P`` entries where ``P`` is the smallest
power of two >= ``capacity``. ``tree[1]`` is the root (the total mass), node ``i`` has
children ``2i`` and ``2i + 1``, and leaf ``k`` lives at ``tree[P + k]``. Leaves
``capacity .. P-1`` are padding and stay exactly 0; ``tree[0]`` is unused.

Why recompute and not add deltas: easy-rl's PER-DQN notebook updates ancestors by adding
``p_new - p_old``, so rounding errors pile up with every update and the root drifts away
from the sum of the leaves without bound. Here every update recomputes each touched
ancestor as ``left + right`` from its two children. Each internal node is then always
the correctly rounded sum of its children, whatever the history, so the root differs
from the exact sum of the leaves by at most ``depth * eps * total`` (depth <= 64,
eps = 2.2e-16: a relative error below 1.5e-14). That is the documented drift bound;
it holds by construction, so no periodic rebuild is needed. ``rebuild()`` recomputes
every internal node from the leaves; the replay buffer calls it when it loads a
snapshot, whose file holds only the leaves.

Why numba: the walk visits ``depth`` levels (21 at a million leaves). Done with
vectorised numpy, each level costs several array calls, which put sampling 256 plus
updating 256 at 1e6 leaves above the replay benchmark's target (``bench/sumtree_numpy.py``
measures both; docs/experiments/runtime.md has the figures). The numba kernels below
are the only implementation. They still walk level by level for the whole batch: all
B descents advance one level together, so the cache misses of different samples
overlap instead of queueing one behind the other.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["SumTree", "descend", "set_leaves"]


@numba.njit(cache=True, nogil=True)
def set_leaves(tree, leaf_base, indices, values):
    """Write ``values`` into the leaves ``indices`` and recompute their ancestors.

    Duplicate indices: the last value wins (like numpy assignment). Parents are
    recomputed level by level for the whole batch; recomputing a parent twice is
    harmless because its children are already final.
    """
    n = indices.shape[0]
    nodes = np.empty(n, np.int64)
    for j in range(n):
        node = leaf_base + indices[j]
        tree[node] = values[j]
        nodes[j] = node
    while leaf_base > 1:
        leaf_base >>= 1
        for j in range(n):
            node = nodes[j] >> 1
            nodes[j] = node
            tree[node] = tree[2 * node] + tree[2 * node + 1]


@numba.njit(cache=True, nogil=True)
def _set_range(tree, leaf_base, start, values):
    """Write a contiguous run of leaves ``start .. start+len(values)-1``: O(len + depth)."""
    lo = leaf_base + start
    hi = lo + values.shape[0] - 1
    for j in range(values.shape[0]):
        tree[lo + j] = values[j]
    while lo > 1:
        lo >>= 1
        hi >>= 1
        for node in range(lo, hi + 1):
            tree[node] = tree[2 * node] + tree[2 * node + 1]


@numba.njit(cache=True, nogil=True)
def descend(tree, leaf_base, targets, out):
    """Find, for each prefix-sum target, the leaf whose cumulative range holds it.

    Rounding guard: go right only when the target is >= the left mass *and* the right
    subtree has mass; otherwise go left, clamping the target to the left mass. By
    induction every node on the path has positive mass, so the leaf reached is never a
    0 leaf (empty, evicted or padding), even when a target sits on a slice edge or
    rounding pushes it past the total. The inner loop has no branches (selects only),
    so LLVM can vectorise it (``bench/kernels.py`` times it beside the if/else form).
    """
    n = targets.shape[0]
    for j in range(n):
        out[j] = 1
    node_base = 1
    while node_base < leaf_base:
        for j in range(n):
            left = 2 * out[j]
            left_mass = tree[left]
            v = targets[j]
            right = (v >= left_mass) & (tree[left + 1] > 0.0)
            targets[j] = (v - left_mass) if right else min(v, left_mass)
            out[j] = left + right
        node_base <<= 1
    for j in range(n):
        out[j] -= leaf_base


def _check_priorities(priorities: np.ndarray) -> np.ndarray:
    """Return ``priorities`` as float64; raise ValueError naming bad positions."""
    p = np.asarray(priorities, dtype=np.float64)
    bad = ~np.isfinite(p) | (p < 0)
    if bad.any():
        where = np.flatnonzero(bad)
        shown = ", ".join(f"[{i}]={p.flat[i]!r}" for i in where[:8])
        more = f" and {where.size - 8} more" if where.size > 8 else ""
        raise ValueError(
            f"priorities must be finite and >= 0; bad at positions {shown}{more} "
            f"(of a batch of {p.size}); nothing was written"
        )
    return p


class SumTree:
    """Binary sum tree of ``capacity`` float64 leaves.

    Args:
        capacity: number of leaves (any integer >= 1).
        storage: optional float64 array of shape ``(SumTree.storage_size(capacity),)``
            to live in (for example a view into shared memory). Its content is used as
            is: pass zeros for an empty tree, or call ``rebuild()`` after filling leaves.

    Not thread- or process-safe by itself: the replay buffer guards it with its lock.
    """

    def __init__(self, capacity: int, storage: np.ndarray | None = None) -> None:
        capacity = int(capacity)
        if capacity < 1:
            raise ValueError(f"SumTree capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._leaf_base = 1 << (capacity - 1).bit_length()  # P, the padded leaf count
        size = self.storage_size(capacity)
        if storage is None:
            storage = np.zeros(size, dtype=np.float64)
        elif storage.dtype != np.float64 or storage.shape != (size,):
            raise ValueError(
                f"SumTree storage must be float64 of shape ({size},), "
                f"got {storage.dtype} {storage.shape}"
            )
        self.tree = storage

    @staticmethod
    def storage_size(capacity: int) -> int:
        """Length of the flat float64 array a tree of ``capacity`` leaves needs."""
        return 2 * (1 << (int(capacity) - 1).bit_length())

    # ---- reading -------------------------------------------------------------------
    @property
    def total(self) -> float:
        """Sum of all leaves (the root)."""
        return float(self.tree[1])  # with capacity 1 the root is the only leaf

    @property
    def leaves(self) -> np.ndarray:
        """View of the ``capacity`` leaves (do not write through it; use ``set``)."""
        return self.tree[self._leaf_base : self._leaf_base + self.capacity]

    def get(self, indices: np.ndarray) -> np.ndarray:
        """Leaf priorities at ``indices`` (shape of ``indices``), float64."""
        idx = self._check_indices(indices)
        return self.tree[self._leaf_base + idx]

    # ---- writing -------------------------------------------------------------------
    def set(self, indices: np.ndarray, priorities: np.ndarray | float) -> None:
        """Set leaves ``indices`` to ``priorities`` (broadcast), updating ancestors.

        Raises ValueError (and changes nothing) if a priority is NaN, inf or negative,
        IndexError if an index is outside ``[0, capacity)``.
        """
        idx = self._check_indices(indices).ravel()
        p = _check_priorities(np.broadcast_to(priorities, idx.shape)).ravel()
        if idx.size:
            set_leaves(self.tree, self._leaf_base, np.ascontiguousarray(idx), np.ascontiguousarray(p))

    def set_range(self, start: int, priorities: np.ndarray, check: bool = True) -> None:
        """Set the contiguous leaves ``start .. start + len(priorities) - 1``.
        ``check=False``: the caller has checked that they are finite and >= 0."""
        p = _check_priorities(priorities).ravel() if check else np.asarray(priorities, np.float64).ravel()
        if start < 0 or start + p.size > self.capacity:
            raise IndexError(
                f"leaf range [{start}, {start + p.size}) outside [0, {self.capacity})"
            )
        if p.size:
            _set_range(self.tree, self._leaf_base, int(start), np.ascontiguousarray(p))

    def rebuild(self) -> None:
        """Recompute every internal node from the leaves (after writing leaves directly)."""
        tree, base = self.tree, self._leaf_base
        _check_priorities(tree[base : base + self.capacity])
        tree[base + self.capacity : 2 * base] = 0.0
        while base > 1:
            half = base >> 1
            np.add(tree[base : 2 * base : 2], tree[base + 1 : 2 * base : 2], out=tree[half:base])
            base = half

    # ---- sampling ------------------------------------------------------------------
    def find_prefix_sum(self, targets: np.ndarray) -> np.ndarray:
        """Leaf index whose cumulative range holds each target (targets in [0, total)).

        Never returns a 0 leaf; requires ``total > 0``.
        """
        if not self.tree[1] > 0.0:
            raise ValueError("cannot sample from a sum tree whose total is 0")
        work = np.array(targets, dtype=np.float64, copy=True).ravel()
        out = np.empty(work.size, dtype=np.int64)
        descend(self.tree, self._leaf_base, work, out)
        return out

    def sample(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """Stratified sampling: one uniform draw inside each of ``batch_size`` equal
        slices of the total mass. Returns leaf indices, shape ``(batch_size,)``."""
        u = rng.random(batch_size)
        return self.find_prefix_sum(self.stratified_targets(u, self.total))

    @staticmethod
    def stratified_targets(u: np.ndarray, total: float) -> np.ndarray:
        """Map uniforms ``u`` (shape (B,), in [0, 1)) to one target per slice of ``total``."""
        b = u.shape[0]
        return (np.arange(b, dtype=np.float64) + u) * (total / b)

    # ---- helpers -------------------------------------------------------------------
    def _check_indices(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"leaf indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            bad = idx[(idx < 0) | (idx >= self.capacity)]
            raise IndexError(f"leaf indices {bad[:8].tolist()} outside [0, {self.capacity})")
        return idx

    def __len__(self) -> int:
        return self.capacity

    def __repr__(self) -> str:
        return f"SumTree(capacity={self.capacity}, total={self.total:.6g})"
