"""Two versions of the replay buffer in one process, timed in alternation.

A change to the buffer's hot path (its lock, above all) costs a microsecond or two per
call, less than the drift of a shared machine between two runs of ``bench/replay.py``.
Here both versions live in one process: an older checkout's package, renamed
``mpper_old``, beside this one; both buffers are filled alike (capacity 1e5, CartPole-sized
DQN rows, episodes of 500 rows), and each round times every operation on both, the order
flipped each round. Reported: median (p25-p75) in microseconds per call, and the median
of the per-round ratios new / old.

Usage (``abc24f1``: the commit to compare against)::

    mkdir -p /tmp/old && git archive abc24f1 mpper | tar -x -C /tmp/old && mv /tmp/old/mpper /tmp/old/mpper_old
    PYTHONPATH=/tmp/old:. python bench/buffer_ab.py 30
"""
from __future__ import annotations

import importlib
import sys
import time

import numpy as np

CAPACITY, CHUNK, UPDATE, BATCH = 100_000, 500, 256, 256
CALLS = {"add 500": 200, "update 256": 500, "sample 256 (no lock)": 300, "lock round trip": 20000}


def setup(package: str):
    """A filled buffer of ``package`` and its operations: {name: zero-argument callable}."""
    buffer_module = importlib.import_module(package + ".replay.buffer")
    targets = importlib.import_module(package + ".algos.dqn.targets")
    buf = buffer_module.ReplayBuffer.create(targets.dqn_schema((4,)), capacity=CAPACITY, alpha=0.6)
    rng = np.random.default_rng(0)
    fields = {f.name: f for f in buf.schema if f.name in ("observation", "reward")}
    episodes = [{n: rng.random((CHUNK, *f.shape)).astype(f.dtype) for n, f in fields.items()} for _ in range(8)]
    priorities = [rng.random(CHUNK - 1) + 0.1 for _ in range(8)]
    for i in range(CAPACITY // CHUNK + 1):
        buf.add_episode(episodes[i % 8], priorities=priorities[i % 8])
    pending = [buf.sample(UPDATE, 0.4, rng=rng) for _ in range(64)]
    new_priorities = [rng.random(UPDATE) for _ in range(8)]
    turn = [0]

    def add():
        turn[0] += 1
        buf.add_episode(episodes[turn[0] % 8])

    def update():
        turn[0] += 1
        batch = pending[turn[0] % 64]
        buf.update_priorities(batch.indices, batch.generations, new_priorities[turn[0] % 8])

    def sample():
        buf.sample(BATCH, 0.4, rng=rng)

    def lock():
        with buf._locked:
            pass

    return buf, {"add 500": add, "update 256": update, "sample 256 (no lock)": sample, "lock round trip": lock}


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1000


def quartiles(a: np.ndarray, digits: int = 3) -> str:
    return f"{np.median(a):.{digits}f} ({np.percentile(a, 25):.{digits}f}-{np.percentile(a, 75):.{digits}f})"


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    old_buf, old = setup("mpper_old")
    new_buf, new = setup("mpper")
    try:
        times = {op: {"old": [], "new": []} for op in CALLS}
        for r in range(rounds):
            for op, calls in CALLS.items():
                pair = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
                for name, ops in pair:
                    times[op][name].append(per_call_us(ops[op], calls))
        print(f"{rounds} rounds, mpper_old and mpper alternating (order flipped each round); us per call")
        print("| operation | mpper_old | mpper | mpper / mpper_old (per-round ratios) |")
        print("|---|---|---|---|")
        for op, t in times.items():
            o, n = np.array(t["old"]), np.array(t["new"])
            print(f"| {op} | {quartiles(o)} | {quartiles(n)} | {quartiles(n / o, 2)} |")
    finally:
        old_buf.close()
        new_buf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
