"""Two compiled kernels of the replay buffer beside the plainer forms they replaced.

- **Sum-tree descent**: ``mpper.replay.sum_tree.descend`` (the inner loop selects, it
  never branches, so LLVM can vectorise it across the batch) against the same walk
  written with ``if``/``else`` (below), both numba-compiled alike, on a tree of
  ``--leaves`` random priorities, for a batch of ``--batch`` targets.
- **Row gather**: ``mpper.replay.targets.gather_rows`` (a compiled loop) against numpy's
  fancy indexing ``field[rows]``, on the fields of a real shared buffer (the MuZero
  CartPole schema: each field is a strided view of the per-slot records), for
  ``--batch`` random rows of a full buffer of ``--capacity`` slots.

Each figure is the median over ``--repeats`` rounds of the time per call (each round
times both forms, alternating which goes first); the ratio is plain over compiled.

Usage::

    python bench/kernels.py [--leaves 1000000] [--capacity 100000] [--batch 256] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mpper import ReplayBuffer  # noqa: E402
from mpper.algos.muzero.targets import muzero_schema  # noqa: E402
from mpper.replay.sum_tree import SumTree, descend  # noqa: E402
from mpper.replay.targets import gather_rows  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner import fill  # noqa: E402  (bench/learner.py)


@numba.njit(cache=True, nogil=True)
def descend_if_else(tree, leaf_base, targets, out):
    """``descend`` with the rounding guard written as a branch (the same leaves)."""
    n = targets.shape[0]
    for j in range(n):
        out[j] = 1
    node_base = 1
    while node_base < leaf_base:
        for j in range(n):
            left = 2 * out[j]
            left_mass = tree[left]
            v = targets[j]
            if v >= left_mass and tree[left + 1] > 0.0:
                targets[j] = v - left_mass
                out[j] = left + 1
            else:
                targets[j] = min(v, left_mass)
                out[j] = left
        node_base <<= 1
    for j in range(n):
        out[j] -= leaf_base


def per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def compare(name: str, plain, compiled, repeats: int, calls: int) -> None:
    plain(), compiled()  # load / compile
    times = {"plain": [], "compiled": []}
    for i in range(repeats):
        order = [("plain", plain), ("compiled", compiled)]
        for label, fn in order if i % 2 == 0 else reversed(order):
            times[label].append(per_call(fn, calls))
    p, c = statistics.median(times["plain"]), statistics.median(times["compiled"])
    print(f"| {name} | {p * 1e6:,.1f} | {c * 1e6:,.1f} | {p / c:.2f}x |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", type=int, default=1_000_000)
    ap.add_argument("--capacity", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)

    print(f"`python bench/kernels.py --leaves {args.leaves} --capacity {args.capacity} --batch {args.batch} "
          f"--repeats {args.repeats}` ({time.strftime('%Y-%m-%d')}); microseconds per call, median of the rounds\n")  # fmt: skip
    print("| kernel | plain form | mpper's | plain / mpper's |")
    print("|---|---|---|---|")

    tree = SumTree(args.leaves)
    tree.set_range(0, rng.uniform(0.1, 10.0, args.leaves))
    targets = rng.uniform(0.0, tree.total, args.batch)
    out_a, out_b = np.empty(args.batch, np.int64), np.empty(args.batch, np.int64)
    descend_if_else(tree.tree, tree._leaf_base, targets.copy(), out_a)
    descend(tree.tree, tree._leaf_base, targets.copy(), out_b)
    assert np.array_equal(out_a, out_b), "the two descents disagree"
    work = np.empty_like(targets)

    def plain_descent():
        work[:] = targets
        descend_if_else(tree.tree, tree._leaf_base, work, out_a)

    def branchless_descent():
        work[:] = targets
        descend(tree.tree, tree._leaf_base, work, out_b)

    compare(f"sum-tree descent, {args.leaves:,} leaves, batch {args.batch}", plain_descent, branchless_descent,
            args.repeats, 2000)  # fmt: skip

    buf = ReplayBuffer.create(muzero_schema((4,), 2), args.capacity)
    try:
        while len(buf) < args.capacity - 600:
            fill(buf, 1, rng)  # CartPole-shaped MuZero episodes of 20-500 moves
        rows = rng.integers(0, args.capacity, args.batch)
        for name in ("observation", "action", "child_visits"):
            field = buf.fields[name]
            assert np.array_equal(gather_rows(field, rows), field[rows]), name
            compare(f"gather of `{name}` {field.shape[1:]} {field.dtype}, batch {args.batch}",
                    lambda f=field: f[rows], lambda f=field: gather_rows(f, rows), args.repeats, 5000)  # fmt: skip
    finally:
        buf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
