"""Vectorised-numpy sum tree, timed beside ``mpper.SumTree`` (numba).

This is the evidence for mpper's numba dependency: a pure-numpy tree with the same
layout, the same checks and the same rounding guard as ``mpper/replay/sum_tree.py``
walks the tree level by level for the whole batch (all B descents advance one level
together; updates recompute the parents level by level). Each level still costs several numpy calls, and at 1e6 leaves there are 20
levels.

Usage::

    python bench/sumtree_numpy.py                  # capacity 1e6, batch 256
    python bench/sumtree_numpy.py --capacity 100000 --reps 7 --out bench/results/sumtree.json

Prints per-call times (median and min-max over repetitions) for sample 256, update 256
and sample + update, for both trees, and the ratio numpy / mpper.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))


class NumpySumTree:
    """Binary sum tree of ``capacity`` float64 leaves, vectorised numpy only.

    Same layout as ``mpper.SumTree``: ``tree`` has ``2 * P`` entries (``P`` the smallest
    power of two >= capacity), ``tree[1]`` is the root, node ``i`` has children ``2i``
    and ``2i + 1``, leaf ``k`` is ``tree[P + k]``. No Python loop over batch items; one
    loop over the tree levels.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.leaf_base = 1 << (self.capacity - 1).bit_length()
        self.depth = self.leaf_base.bit_length() - 1
        self.tree = np.zeros(2 * self.leaf_base, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def get(self, indices: np.ndarray) -> np.ndarray:
        return self.tree[self.leaf_base + self._check_indices(indices)]

    def set(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Write leaves, then recompute their ancestors level by level.

        Duplicate indices need no ``np.unique``: a parent recomputed twice from children
        that are already final gets the same value both times.
        """
        idx = self._check_indices(indices)
        p = np.asarray(priorities, dtype=np.float64)
        bad = ~np.isfinite(p) | (p < 0)
        if bad.any():
            raise ValueError(f"bad priorities at positions {np.flatnonzero(bad)[:8].tolist()}")
        tree = self.tree
        node = idx + self.leaf_base
        tree[node] = p
        for _ in range(self.depth):
            node >>= 1
            left = node << 1
            tree[node] = tree[left] + tree[left + 1]

    def sample(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """Stratified sampling (one draw per equal slice of the mass): leaf indices."""
        total = self.tree[1]
        if not total > 0.0:
            raise ValueError("cannot sample from a sum tree whose total is 0")
        target = (np.arange(batch_size, dtype=np.float64) + rng.random(batch_size)) * (
            total / batch_size
        )
        return self.find_prefix_sum(target)

    def find_prefix_sum(self, target: np.ndarray) -> np.ndarray:
        """Same rounding guard as mpper: go right only into a subtree with mass."""
        tree = self.tree
        node = np.ones(target.shape[0], dtype=np.int64)
        for _ in range(self.depth):
            left = node << 1
            left_mass = tree[left]
            right_mass = tree[left + 1]
            go_right = (target >= left_mass) & (right_mass > 0.0)
            target = np.where(go_right, target - left_mass, np.minimum(target, left_mass))
            node = left + go_right
        return node - self.leaf_base

    def _check_indices(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            raise IndexError(f"leaf indices outside [0, {self.capacity})")
        return idx


# ---- timing -------------------------------------------------------------------------
def per_call_seconds(fn, number: int) -> float:
    """Run ``fn()`` ``number`` times; return seconds per call."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def calibrate(fn, target_s: float = 0.05) -> int:
    """Number of calls so that one repetition takes about ``target_s`` seconds."""
    fn()  # warm up (numba compile, caches)
    n = 1
    while True:
        t = per_call_seconds(fn, n) * n
        if t >= target_s / 4 or n >= 1 << 20:
            return max(1, int(n * target_s / max(t, 1e-9)))
        n *= 4


def summary(samples: list[float]) -> dict:
    a = np.asarray(samples)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()), "samples": a.tolist()}


def fmt_ms(s: dict) -> str:
    return f"{s['median'] * 1e3:.4f} ({s['min'] * 1e3:.4f}-{s['max'] * 1e3:.4f})"


def check_same_answers(a, b, capacity: int, rng: np.random.Generator) -> None:
    """Both trees hold the same leaves and return the same samples for the same draws."""
    idx = rng.integers(0, capacity, 4096)
    p = rng.random(4096)
    a.set(idx, p)
    b.set(idx, p)
    assert np.allclose(a.total, b.total, rtol=1e-12), (a.total, b.total)
    u = np.random.default_rng(7)
    ia = a.sample(1024, np.random.default_rng(7))
    ib = b.sample(1024, u)
    assert np.array_equal(ia, ib), "numpy and mpper trees disagree on the same draws"


def load_mpper_sumtree():
    """``mpper.SumTree``, or None (with a message) when mpper is not importable."""
    try:
        from mpper import SumTree
    except ImportError as exc:
        print(f"mpper.SumTree not importable ({exc}); timing the numpy tree alone")
        return None
    return SumTree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity", type=float, default=1e6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None, help="optional JSON output path")
    args = ap.parse_args(argv)
    capacity, batch = int(args.capacity), args.batch

    SumTree = load_mpper_sumtree()

    rng = np.random.default_rng(0)
    leaves = rng.random(capacity) + 0.01
    trees = {"numpy": NumpySumTree(capacity)}
    if SumTree is not None:
        trees["mpper"] = SumTree(capacity)
    for tree in trees.values():  # fill every leaf (the full-buffer case)
        tree.set(np.arange(capacity), leaves)
    if SumTree is not None:
        check_same_answers(trees["numpy"], trees["mpper"], capacity, np.random.default_rng(1))

    pool = 1024  # distinct update batches, cycled: most leaves touched are not in cache
    upd_idx = [rng.integers(0, capacity, batch) for _ in range(pool)]
    upd_p = [rng.random(batch) + 0.01 for _ in range(pool)]

    def ops(tree):
        srng = np.random.default_rng(2)
        k = [0]

        def sample():
            tree.sample(batch, srng)

        def update():
            i = k[0] = (k[0] + 1) % pool
            tree.set(upd_idx[i], upd_p[i])

        def step():
            idx = tree.sample(batch, srng)
            tree.set(idx, upd_p[0])

        return {f"sample {batch}": sample, f"update {batch}": update, f"sample {batch} + update {batch}": step}

    fns = {name: ops(tree) for name, tree in trees.items()}
    numbers = {(lib, op): calibrate(fn) for lib, d in fns.items() for op, fn in d.items()}
    results: dict = {lib: {op: [] for op in d} for lib, d in fns.items()}
    for _ in range(args.reps):  # interleave the trees in every repetition
        for op in fns["numpy"]:
            for lib in fns:
                results[lib][op].append(per_call_seconds(fns[lib][op], numbers[(lib, op)]))
    stats = {lib: {op: summary(v) for op, v in d.items()} for lib, d in results.items()}

    print(f"\nSum tree, capacity {capacity:.0e}, batch {batch}, {args.reps} repetitions, "
          f"ms per call: median (min-max)\n")
    has_mpper = "mpper" in stats
    print("| operation | numpy (vectorised) |" + (" mpper (numba) | numpy / mpper |" if has_mpper else ""))
    print("|---|---|" + ("---|---|" if has_mpper else ""))
    for op in stats["numpy"]:
        row = f"| {op} | {fmt_ms(stats['numpy'][op])} |"
        if has_mpper:
            ratio = stats["numpy"][op]["median"] / stats["mpper"][op]["median"]
            row += f" {fmt_ms(stats['mpper'][op])} | {ratio:.1f}x |"
        print(row)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "capacity": capacity, "batch": batch, "reps": args.reps,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": sys.version.split()[0], "numpy": np.__version__},
            "results": stats,
        }, indent=1))
        print(f"\nraw numbers: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
