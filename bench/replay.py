"""Replay benchmark: mpper against cpprb and tianshou.

One run measures, with the libraries interleaved (every repetition visits every
library, in a rotating order, so machine noise hits all alike):

* single process, CartPole-sized transitions (obs 4 x float32, int action, float32
  reward, done) at each capacity, buffers filled first: add a chunk of 500, sample
  64 / 256 / 1024 with importance weights (alpha 0.6, beta 0.4), update 256
  priorities, and a learner step (sample 256 + update 256). ``mpper`` samples
  transitions, as the peers return them (observation, action, reward, next observation,
  done: ``NStepTargets(n=1)``), and the ratios are taken on it; ``mpper raw rows`` is the
  same buffer sampled without targets (``targets=None``: the stored rows only, no next
  observation).
  ``numpy floor`` gathers observation, action and reward rows from plain numpy arrays
  at fresh uniform random indices (no tree, no weights): the cost of the rows alone;
* mpper's MuZero batch: 128 positions, unroll 10, td 50, from 500 episodes of 200-500
  steps;
* multi-process, spawn start method: 1 learner process alone, then with 4 writer
  processes paced to 100k transitions/s in all, then unpaced; mpper (writers attach
  to ``buf.handle``) beside ``cpprb.MPPrioritizedReplayBuffer``. Every child warms up
  (one add, or 20 learner steps) before the clock starts: a fresh process's first mpper
  call loads the numba kernels. Ctrl-C stops the children, joins them and closes every
  buffer.

Times are per call: median with (min-max) over the repetitions. Ratios are
mpper / peer on the medians (below 1: mpper is faster).

Usage::

    python bench/replay.py                      # capacities 1e5 and 1e6, 7 reps, 10 s runs
    python bench/replay.py --quick              # smoke run: 1e5 only, 3 reps, 2 s runs
    python bench/replay.py --reps 11 --capacities 1e6 --out bench/results/replay.json

Chunks: an mpper chunk is one episode of 500 rows (``add_episode``), which holds 499
transitions (the last row is the final observation). cpprb adds 500 transitions in one
``add`` call; tianshou's ``PrioritizedReplayBuffer.add`` takes one transition per call,
so its chunk is ``buffer.update(staging)`` from a 500-transition staging buffer (its
bulk path). Peers store ``next_obs`` explicitly; mpper stores each observation once and
gathers the next one at sample time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

OBS_SHAPE = (4,)
CHUNK = 500  # rows per add
ALPHA, BETA = 0.6, 0.4
SAMPLE_SIZES = (64, 256, 1024)
UPDATE_SIZE = 256
N_DATA = 8  # distinct pre-generated chunks / priority arrays, used in rotation
UPDATE_POOL = 128  # sampled index batches the "update" operation cycles through (cold cache)
PEER_HINT = "pip install -e .[bench]"

MUZERO_EPISODES = 500
MUZERO_BATCH = 128
MUZERO_KWARGS = dict(num_unroll_steps=10, td_steps=50, discount=0.997, num_actions=2,
                     stacked_observations=0)  # fmt: skip

MP_WRITERS = 4
MP_PACED_RATE = 100_000  # transitions/s, all writers together
MP_BATCH = 256

CPPRB_ENV = {
    "obs": {"shape": OBS_SHAPE, "dtype": np.float32},
    "act": {"dtype": np.int64},
    "rew": {"dtype": np.float32},
    "next_obs": {"shape": OBS_SHAPE, "dtype": np.float32},
    "done": {"dtype": np.float32},
}


# ---- timing -------------------------------------------------------------------------
def per_call_seconds(fn, number: int) -> float:
    """Call ``fn()`` ``number`` times; return the seconds per call."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def calls_for(fn, target_s: float) -> int:
    """How many calls of ``fn`` make one repetition of about ``target_s`` seconds."""
    fn()  # warm up: numba compilation, first-touch of memory
    n, spent = 1, per_call_seconds(fn, 1)
    while spent * n < target_s / 5 and n < 1 << 16:
        n *= 4
        spent = per_call_seconds(fn, n)
    return max(1, min(1 << 18, round(target_s / max(spent, 1e-9))))


def summarize(samples: list[float]) -> dict:
    a = np.asarray(samples, dtype=np.float64)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "samples": [float(x) for x in a]}  # fmt: skip


# ---- data ---------------------------------------------------------------------------
def make_chunks(seed: int, count: int = N_DATA) -> list[dict]:
    """``count`` chunks of CartPole-sized data: 501 observations, so that the 500 rows
    of an mpper episode and the 500 transitions of a peer chunk come from the same
    arrays. Also a raw priority per transition."""
    rng = np.random.default_rng(seed)
    chunks = []
    for _ in range(count):
        obs = rng.standard_normal((CHUNK + 1, *OBS_SHAPE)).astype(np.float32)
        act = rng.integers(0, 2, CHUNK + 1).astype(np.int64)
        rew = np.ones(CHUNK + 1, np.float32)
        done = np.zeros(CHUNK, np.float32)
        done[-1] = 1.0
        chunks.append({
            "obs": obs, "act": act, "rew": rew, "done": done,
            "priorities": rng.uniform(0.01, 1.0, CHUNK),
        })  # fmt: skip
    return chunks


def peer_transitions(chunk: dict) -> dict:
    """The chunk as 500 transitions (o_t, a_t, r_{t+1}, o_{t+1}, done)."""
    return {"obs": chunk["obs"][:-1], "act": chunk["act"][1:], "rew": chunk["rew"][1:],
            "next_obs": chunk["obs"][1:], "done": chunk["done"]}  # fmt: skip


def mpper_episode(chunk: dict) -> dict:
    """The chunk as one mpper episode of 500 rows (row i: o_i, a_{i-1}, r_i)."""
    action = chunk["act"][:CHUNK].copy()
    reward = chunk["rew"][:CHUNK].copy()
    action[0], reward[0] = 0, 0.0
    return {"observation": chunk["obs"][:CHUNK], "action": action, "reward": reward}


def make_update_priorities(seed: int, size: int = UPDATE_SIZE) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.01, 1.0, size) for _ in range(N_DATA)]


class Rotation:
    """Cycles through a list (pre-generated data, so no generation cost is timed)."""

    def __init__(self, items: list):
        self.items, self.i = items, 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


# ---- optional libraries ---------------------------------------------------------------
def import_libraries() -> dict:
    """Import what is installed; one clear line for each library that is not."""
    found = {}
    try:
        import mpper  # noqa: F401
        from mpper import ReplayBuffer  # noqa: F401

        found["mpper"] = mpper
    except ImportError as exc:
        print(f"mpper not importable ({exc}): its rows are skipped (pip install -e .)")
    try:
        import cpprb

        found["cpprb"] = cpprb
    except ImportError:
        print(f"cpprb not installed: its rows are skipped ({PEER_HINT})")
    try:
        import tianshou.data

        found["tianshou"] = tianshou
    except ImportError:
        print(f"tianshou not installed: its rows are skipped ({PEER_HINT})")
    return found


# ---- single-process adapters: one method per measured operation --------------------------
class MpperBench:
    """mpper sampled as the peers sample: one-step transitions (observation, action,
    reward, next observation, done) built by ``NStepTargets(n=1)``."""

    name = "mpper"

    def __init__(self, capacity: int, chunks: list[dict], seed: int):
        from mpper import ReplayBuffer
        from mpper.algos.dqn.targets import NStepTargets, dqn_schema

        self.buf = ReplayBuffer.create(dqn_schema(OBS_SHAPE), capacity=capacity, alpha=ALPHA)
        self.rng = np.random.default_rng(seed)
        self.episodes = Rotation([mpper_episode(c) for c in chunks])
        self.prios = Rotation(make_update_priorities(seed))
        self.targets = NStepTargets(n=1, gamma=0.99)
        for i in range(-(-capacity // CHUNK)):  # fill: every slot written once
            c = chunks[i % len(chunks)]
            self.buf.add_episode(mpper_episode(c), priorities=c["priorities"][: CHUNK - 1])
        self.prepare_update()

    def add(self):
        self.buf.add_episode(self.episodes.next())

    def sample(self, batch_size: int):
        return self.buf.sample(batch_size, BETA, targets=self.targets, rng=self.rng)

    def prepare_update(self):
        self.pending = Rotation([self.buf.sample(UPDATE_SIZE, BETA, rng=self.rng)
                                 for _ in range(UPDATE_POOL)])  # fmt: skip

    def update(self):
        b = self.pending.next()
        self.buf.update_priorities(b.indices, b.generations, self.prios.next())

    def learner_step(self):
        b = self.buf.sample(UPDATE_SIZE, BETA, targets=self.targets, rng=self.rng)
        self.buf.update_priorities(b.indices, b.generations, self.prios.next())

    def check(self, batch_size: int) -> None:
        b = self.sample(batch_size)
        assert b.indices.shape == b.weights.shape == (batch_size,), "mpper: batch shapes"
        assert np.all(b.weights > 0) and np.all(b.weights <= 1.0 + 1e-6), "mpper: weights"
        if self.targets is not None:
            assert {"observation", "next_observation", "action", "reward", "done"} <= set(b.data), "mpper: fields"

    def close(self):
        self.buf.close()


class MpperRawRowsBench(MpperBench):
    """The same buffer as ``MpperBench``, sampled without targets: each stored row as it
    is (observation, the action that led to it, its reward), no next observation."""

    name = "mpper raw rows"

    def __init__(self, transitions: MpperBench):
        self.buf, self.rng, self.prios = transitions.buf, np.random.default_rng(1), transitions.prios
        self.targets = None

    add = update = prepare_update = None  # measured once, on the transitions adapter

    def close(self):
        pass  # the transitions adapter owns the buffer


class CpprbBench:
    name = "cpprb"

    def __init__(self, capacity: int, chunks: list[dict], seed: int):
        from cpprb import PrioritizedReplayBuffer

        self.buf = PrioritizedReplayBuffer(capacity, CPPRB_ENV, alpha=ALPHA)
        self.transitions = Rotation([peer_transitions(c) for c in chunks])
        self.prios = Rotation(make_update_priorities(seed))
        for i in range(-(-capacity // CHUNK)):
            c = chunks[i % len(chunks)]
            self.buf.add(**peer_transitions(c), priorities=c["priorities"])
        self.prepare_update()

    def add(self):
        self.buf.add(**self.transitions.next())

    def sample(self, batch_size: int):
        return self.buf.sample(batch_size, BETA)

    def prepare_update(self):
        # a copy: cpprb's "indexes" is a view of memory that a later sample() frees
        self.pending = Rotation([self.buf.sample(UPDATE_SIZE, BETA)["indexes"].copy()
                                 for _ in range(UPDATE_POOL)])  # fmt: skip

    def update(self):
        self.buf.update_priorities(self.pending.next(), self.prios.next())

    def learner_step(self):
        b = self.buf.sample(UPDATE_SIZE, BETA)
        self.buf.update_priorities(b["indexes"], self.prios.next())

    def check(self, batch_size: int) -> None:
        b = self.sample(batch_size)
        assert b["weights"].shape == (batch_size,) and b["obs"].shape == (batch_size, *OBS_SHAPE)

    def close(self):
        self.buf = None


class TianshouBench:
    name = "tianshou"

    def __init__(self, capacity: int, chunks: list[dict], seed: int):
        from tianshou.data import PrioritizedReplayBuffer

        self.buf = PrioritizedReplayBuffer(capacity, alpha=ALPHA, beta=BETA)
        self.staging = Rotation([self._staging(c) for c in chunks])
        self.prios = Rotation(make_update_priorities(seed))
        np.random.seed(seed)  # tianshou samples with the global numpy generator
        for i in range(-(-capacity // CHUNK)):
            c = chunks[i % len(chunks)]
            where = self.buf.update(self.staging.items[i % len(chunks)])
            self.buf.update_weight(where, c["priorities"])
        self.prepare_update()

    @staticmethod
    def _staging(chunk: dict):
        """A 500-transition buffer: tianshou's bulk insert is ``buffer.update(other)``."""
        from tianshou.data import Batch, ReplayBuffer

        staging = ReplayBuffer(CHUNK)
        t = peer_transitions(chunk)
        for i in range(CHUNK):
            staging.add(Batch(obs=t["obs"][i], act=t["act"][i], rew=t["rew"][i],
                              terminated=bool(t["done"][i]), truncated=False,
                              obs_next=t["next_obs"][i]))  # fmt: skip
        return staging

    def add(self):
        self.buf.update(self.staging.next())

    def sample(self, batch_size: int):
        return self.buf.sample(batch_size)  # (Batch with .weight, indices)

    def prepare_update(self):
        self.pending = Rotation([self.buf.sample_indices(UPDATE_SIZE) for _ in range(UPDATE_POOL)])

    def update(self):
        self.buf.update_weight(self.pending.next(), self.prios.next())

    def learner_step(self):
        batch, indices = self.buf.sample(UPDATE_SIZE)
        self.buf.update_weight(indices, self.prios.next())

    def check(self, batch_size: int) -> None:
        batch, indices = self.sample(batch_size)
        assert batch.weight.shape == (batch_size,) and batch.obs.shape == (batch_size, *OBS_SHAPE)

    def close(self):
        self.buf = None


class NumpyFloor:
    """Gathering rows from plain numpy arrays at fresh uniform random indices: what
    any sampler pays for the rows alone (cache misses included), with no tree at all."""

    name = "numpy floor"

    def __init__(self, capacity: int, chunks: list[dict], seed: int):
        self.rng = np.random.default_rng(seed)
        self.capacity = capacity
        self.obs = self.rng.standard_normal((capacity, *OBS_SHAPE)).astype(np.float32)
        self.act = self.rng.integers(0, 2, capacity)
        self.rew = np.ones(capacity, np.float32)

    add = update = prepare_update = learner_step = None

    def sample(self, batch_size: int):
        idx = self.rng.integers(0, self.capacity, batch_size)
        return self.obs[idx], self.act[idx], self.rew[idx]

    def check(self, batch_size: int) -> None:
        pass

    def close(self):
        pass


def single_process_ops() -> dict:
    """Operation name -> (method name, argument); one function per measured operation."""
    ops = {f"add {CHUNK}": ("add", None)}
    for b in SAMPLE_SIZES:
        ops[f"sample {b}"] = ("sample", b)
    ops[f"update {UPDATE_SIZE}"] = ("update", None)
    ops[f"learner step (sample {UPDATE_SIZE} + update {UPDATE_SIZE})"] = ("learner_step", None)
    return ops


def bound_op(bench, method: str, arg):
    fn = getattr(bench, method, None)
    if fn is None:
        return None
    return (lambda: fn(arg)) if arg is not None else fn


def bench_single_process(capacity: int, libs: dict, reps: int, target_s: float) -> dict:
    """All operations at one capacity; returns {op: {library: summary}}."""
    chunks = make_chunks(seed=0)
    benches = []
    try:
        if "mpper" in libs:
            transitions = MpperBench(capacity, chunks, seed=1)
            benches += [transitions, MpperRawRowsBench(transitions)]
        if "cpprb" in libs:
            benches.append(CpprbBench(capacity, chunks, seed=2))
        if "tianshou" in libs:
            benches.append(TianshouBench(capacity, chunks, seed=3))
        benches.append(NumpyFloor(capacity, chunks, seed=4))
        for bench in benches:
            for b in SAMPLE_SIZES:
                bench.check(b)

        ops = single_process_ops()
        by_name = {bench.name: bench for bench in benches}
        fns = {}  # (operation, library) -> zero-argument callable
        for op, (method, arg) in ops.items():
            for bench in benches:
                fn = bound_op(bench, method, arg)
                if fn is not None:
                    fns[op, bench.name] = fn
        numbers = {key: calls_for(fn, target_s) for key, fn in fns.items()}
        samples: dict = {key: [] for key in fns}
        for rep in range(reps):
            for op in ops:
                names = [name for (o, name) in fns if o == op]
                shift = rep % len(names)  # rotate who goes first
                for name in names[shift:] + names[:shift]:
                    if ops[op][0] == "update":
                        by_name[name].prepare_update()  # fresh indices (adds evicted some)
                    samples[op, name].append(per_call_seconds(fns[op, name], numbers[op, name]))
            print(f"  capacity {capacity:.0e}: repetition {rep + 1}/{reps} done", file=sys.stderr)
        out: dict = {}
        for (op, name), s in samples.items():
            out.setdefault(op, {})[name] = summarize(s) | {"calls_per_rep": numbers[(op, name)]}
        return out
    finally:
        for bench in benches:
            bench.close()


# ---- MuZero batch ---------------------------------------------------------------------
def muzero_episode(rng: np.random.Generator, moves: int) -> dict:
    """A CartPole-like MuZero episode of ``moves`` moves (``moves + 1`` rows)."""
    rows = moves + 1
    visits = rng.random((rows, 2)).astype(np.float32)
    visits /= visits.sum(axis=1, keepdims=True)
    visits[-1] = 0.0
    action = rng.integers(0, 2, rows)
    reward = np.ones(rows, np.float32)
    root_value = rng.uniform(0, 100, rows).astype(np.float32)
    action[0], reward[0], root_value[-1] = 0, 0.0, 0.0
    return {
        "observation": rng.standard_normal((rows, *OBS_SHAPE)).astype(np.float32),
        "action": action, "reward": reward, "to_play": np.zeros(rows, np.int8),
        "root_value": root_value, "child_visits": visits,
    }  # fmt: skip


def bench_muzero(reps: int, target_s: float) -> dict:
    from mpper import ReplayBuffer
    from mpper.algos.muzero.targets import MuZeroTargets, muzero_schema

    rng = np.random.default_rng(5)
    moves = rng.integers(200, 501, MUZERO_EPISODES)
    buf = ReplayBuffer.create(muzero_schema(OBS_SHAPE, 2), capacity=int((moves + 1).sum()), alpha=ALPHA)
    try:
        for t in moves:
            buf.add_episode(muzero_episode(rng, int(t)), priorities=rng.uniform(0.01, 1.0, int(t)))
        targets = MuZeroTargets(**MUZERO_KWARGS)
        srng = np.random.default_rng(6)

        def muzero_batch():
            return buf.sample(MUZERO_BATCH, BETA, targets=targets, rng=srng)

        b = muzero_batch()
        k1 = MUZERO_KWARGS["num_unroll_steps"] + 1
        assert b.data["target_policy"].shape == (MUZERO_BATCH, k1, 2), "mpper: MuZero batch shape"
        number = calls_for(muzero_batch, target_s)
        s = [per_call_seconds(muzero_batch, number) for _ in range(reps)]
        return summarize(s) | {"calls_per_rep": number, "episodes": MUZERO_EPISODES,
                               "positions": int(moves.sum()), **MUZERO_KWARGS}  # fmt: skip
    finally:
        buf.close()


# ---- multi-process ----------------------------------------------------------------------
def _learner_loop(step, duration: float, stop) -> dict:
    """Run ``step()`` for ``duration`` seconds; steps/s and latency percentiles."""
    lat = []
    t_start = time.perf_counter()
    t_end = t_start + duration
    while True:
        t0 = time.perf_counter()
        if t0 >= t_end or (len(lat) % 64 == 63 and stop.is_set()):
            break
        step()
        lat.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_start
    a = np.asarray(lat) if lat else np.zeros(1)
    return {"steps": len(lat), "elapsed_s": elapsed, "steps_per_s": len(lat) / elapsed,
            "p50_ms": float(np.percentile(a, 50) * 1e3), "p99_ms": float(np.percentile(a, 99) * 1e3),
            "max_ms": float(a.max() * 1e3)}  # fmt: skip


def _writer_loop(add, transitions_per_add: int, rate: float | None, duration: float, stop) -> dict:
    """Call ``add()`` for ``duration`` s, paced to ``rate`` transitions/s (None: flat out)."""
    period = CHUNK / rate if rate else 0.0
    adds = 0
    t_start = time.perf_counter()
    t_end, next_t = t_start + duration, t_start
    while True:
        now = time.perf_counter()
        if now >= t_end or (adds % 16 == 15 and stop.is_set()):
            break
        if period:
            if next_t > now:
                time.sleep(min(next_t - now, t_end - now))
                if time.perf_counter() >= t_end:
                    break
            next_t = max(next_t + period, time.perf_counter() - 0.25)  # no long catch-up bursts
        add()
        adds += 1
    elapsed = time.perf_counter() - t_start
    return {"adds": adds, "transitions": adds * transitions_per_add, "elapsed_s": elapsed,
            "transitions_per_s": adds * transitions_per_add / elapsed}  # fmt: skip


def _mpper_roles(shared, role: str, seed: int):
    """(operation, closer, transitions per add) for an mpper child process."""
    from mpper import ReplayBuffer

    buf = ReplayBuffer.attach(shared)
    if role == "learner":
        from mpper.algos.dqn.targets import NStepTargets

        rng = np.random.default_rng(seed)
        prios = Rotation(make_update_priorities(seed, MP_BATCH))
        transitions = NStepTargets(n=1, gamma=0.99)  # what cpprb's learner gets: next_obs and done too

        def step():
            b = buf.sample(MP_BATCH, BETA, targets=transitions, rng=rng)
            buf.update_priorities(b.indices, b.generations, prios.next())

        return step, buf.close, None
    episodes = Rotation([mpper_episode(c) for c in make_chunks(seed, 4)])
    return (lambda: buf.add_episode(episodes.next())), buf.close, CHUNK - 1


def _cpprb_roles(shared, role: str, seed: int):
    """(operation, closer, transitions per add) for a cpprb child process."""
    rb = shared
    if role == "learner":
        prios = Rotation(make_update_priorities(seed, MP_BATCH))

        def step():
            b = rb.sample(MP_BATCH, BETA)
            rb.update_priorities(b["indexes"], prios.next())

        return step, (lambda: None), None
    transitions = Rotation([peer_transitions(c) for c in make_chunks(seed, 4)])
    return (lambda: rb.add(**transitions.next())), (lambda: None), CHUNK


def mp_child(lib: str, role: str, index: int, shared, rate, duration: float,
             messages, start, stop) -> None:  # fmt: skip
    """Entry point of every benchmark child process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us through `stop`
    close = None
    try:
        roles = _mpper_roles if lib == "mpper" else _cpprb_roles
        op, close, per_add = roles(shared, role, seed=100 + index)
        for _ in range(20 if role == "learner" else 1):  # warm-up: numba kernels, page faults
            op()
        messages.put(("ready", role, index, None))
        if not start.wait(timeout=300) or stop.is_set():
            return
        if role == "learner":
            result = _learner_loop(op, duration, stop)
        else:
            result = _writer_loop(op, per_add, rate, duration, stop)
        messages.put(("result", role, index, result))
    except BaseException:
        messages.put(("error", role, index, traceback.format_exc()))
    finally:
        if close is not None:
            close()


def run_mp_config(ctx, lib: str, shared, writers: int, total_rate, duration: float) -> dict:
    """One learner plus ``writers`` writers on a filled buffer; every child is joined."""
    messages, start, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    rate = total_rate / writers if (total_rate and writers) else None
    roles = [("learner", 0)] + [("writer", i + 1) for i in range(writers)]
    procs = [ctx.Process(target=mp_child, name=f"bench-{lib}-{role}-{i}",
                         args=(lib, role, i, shared, rate, duration, messages, start, stop))
             for role, i in roles]  # fmt: skip
    results: dict = {"writers": []}
    try:
        for p in procs:
            p.start()
        for _ in _collect(messages, procs, len(procs), timeout=300):
            pass  # wait until every child has attached and warmed up
        start.set()
        for kind, role, i, payload in _collect(messages, procs, len(procs), timeout=duration + 120):
            if role == "learner":
                results["learner"] = payload
            else:
                results["writers"].append(payload)
    finally:
        stop.set()
        start.set()  # children still waiting for the start see `stop` and leave
        for p in procs:
            p.join(timeout=15)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        messages.close()
        messages.join_thread()
    results["transitions_per_s_in"] = sum(w["transitions_per_s"] for w in results["writers"])
    return results


def _collect(messages, procs, count: int, timeout: float):
    """Yield ``count`` messages; raise on a child's error, a dead child or the timeout."""
    deadline = time.monotonic() + timeout
    got = 0
    while got < count:
        try:
            kind, role, i, payload = messages.get(timeout=1.0)
        except queue.Empty:
            dead = [p.name for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"benchmark child(ren) died: {dead}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"benchmark children did not answer within {timeout:.0f} s")
            continue
        if kind == "error":
            raise RuntimeError(f"{role} {i} failed:\n{payload}")
        got += 1
        yield kind, role, i, payload


def bench_multiprocess(capacity: int, libs: dict, duration: float, reps: int) -> dict:
    """Learner alone, with paced writers, with unpaced writers, ``reps`` times over:
    every repetition runs every configuration for every library in turn, so slow
    phases of a noisy machine hit all of them; medians are reported."""
    ctx = mp.get_context("spawn")
    configs = {
        "learner alone": (0, None),
        f"{MP_WRITERS} writers paced to {MP_PACED_RATE // 1000}k/s": (MP_WRITERS, MP_PACED_RATE),
        f"{MP_WRITERS} writers unpaced": (MP_WRITERS, None),
    }
    chunks = make_chunks(seed=7)
    shared: dict = {}
    closers = []
    try:
        if "mpper" in libs:
            from mpper import ReplayBuffer
            from mpper.algos.dqn.targets import dqn_schema

            buf = ReplayBuffer.create(dqn_schema(OBS_SHAPE), capacity=capacity, alpha=ALPHA)
            closers.append(buf.close)
            for i in range(-(-capacity // CHUNK)):
                c = chunks[i % len(chunks)]
                buf.add_episode(mpper_episode(c), priorities=c["priorities"][: CHUNK - 1])
            shared["mpper"] = buf.handle
        if "cpprb" in libs:
            from cpprb import MPPrioritizedReplayBuffer

            rb = MPPrioritizedReplayBuffer(capacity, CPPRB_ENV, alpha=ALPHA, ctx=ctx)
            for i in range(-(-capacity // CHUNK)):
                c = chunks[i % len(chunks)]
                rb.add(**peer_transitions(c), priorities=c["priorities"])
            shared["cpprb"] = rb
        runs: dict = {}
        for rep in range(reps):
            for name, (writers, rate) in configs.items():
                for lib in shared:
                    print(f"  multi-process {rep + 1}/{reps}: {lib}, {name} ({duration:g} s)", file=sys.stderr)
                    before = dict(buf.counters) if lib == "mpper" else None
                    r = run_mp_config(ctx, lib, shared[lib], writers, rate, duration)
                    if before is not None:  # what mpper counted during the run
                        r["mpper_counters"] = {k: int(v) - int(before.get(k, 0)) for k, v in buf.counters.items()}
                    runs.setdefault(name, {}).setdefault(lib, []).append(r)
        out: dict = {name: {lib: _summarize_runs(rs) for lib, rs in per_lib.items()} for name, per_lib in runs.items()}
        for name in configs:  # ratios of medians against the learner alone
            for lib, r in out[name].items():
                alone = out["learner alone"][lib]["learner"]["steps_per_s"]
                r["learner_vs_alone"] = r["learner"]["steps_per_s"] / alone
        return out
    finally:
        shared.clear()  # drops the cpprb buffer (freed with its shared arena)
        for close in closers:
            close()


def _summarize_runs(rs: list[dict]) -> dict:
    """Medians over repetitions (min-max of learner steps/s kept beside)."""
    steps = [r["learner"]["steps_per_s"] for r in rs]
    learner = {key: float(np.median([r["learner"][key] for r in rs])) for key in ("steps_per_s", "p50_ms", "p99_ms")}
    learner |= {"steps_per_s_min": min(steps), "steps_per_s_max": max(steps),
                "max_ms": max(r["learner"]["max_ms"] for r in rs)}  # fmt: skip
    return {"learner": learner, "transitions_per_s_in": float(np.median([r["transitions_per_s_in"] for r in rs])),
            "runs": rs}  # fmt: skip


# ---- report -----------------------------------------------------------------------------
def ms(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median'] * 1e3:.4f} ({s['min'] * 1e3:.4f}-{s['max'] * 1e3:.4f})"


def ratio(a: dict | None, b: dict | None) -> str:
    return f"{a['median'] / b['median']:.2f}" if a and b else "-"


def markdown(report: dict) -> str:
    libs = ["mpper", "mpper raw rows", "cpprb", "tianshou", "numpy floor"]
    lines = [
        "# Replay benchmark",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']['summary']}  ",
        f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}",
        "",
        f"## Single process: ms per call, median (min-max) over {report['reps']} repetitions",
        "",
        "Ratios are mpper / peer on the medians: mpper sampling transitions as the peers do (observation, "
        "action, reward, next observation, done); in brackets: mpper's raw rows.",
        "",
        "| capacity | operation | " + " | ".join(libs) + " | mpper/cpprb | mpper/tianshou |",
        "|---|---|" + "---|" * (len(libs) + 2),
    ]
    for cap, ops in report["single_process"].items():
        for op, res in ops.items():
            cells = [ms(res.get(lib)) for lib in libs]
            ratios = []
            for peer in ("cpprb", "tianshou"):
                r = ratio(res.get("mpper"), res.get(peer))
                if res.get("mpper raw rows") and res.get(peer):
                    r += f" ({ratio(res['mpper raw rows'], res[peer])})"
                ratios.append(r)
            lines.append(f"| {float(cap):.0e} | {op} | " + " | ".join(cells + ratios) + " |")
    if report.get("muzero"):
        m = report["muzero"]
        lines += ["", "## mpper MuZero batch", "",
                  "| operation | mpper, ms per call |", "|---|---|",
                  f"| {MUZERO_BATCH} positions, unroll {m['num_unroll_steps']}, td {m['td_steps']}, "
                  f"from {m['episodes']} episodes of 200-500 steps | {ms(m)} |"]  # fmt: skip
    if report.get("multiprocess"):
        mpr = report["multiprocess"]
        lines += ["", f"## Multi-process: capacity {mpr['capacity']:.0e}, {mpr['duration_s']:g} s per run, "
                  f"spawn, 1 learner (sample {MP_BATCH} + update {MP_BATCH}) + writers of {CHUNK}-row chunks", "",
                  f"Medians over {mpr.get('reps', 1)} repetitions (learner steps/s: median (min-max)).", "",
                  "| run | library | transitions/s in | learner steps/s | vs learner alone "
                  "| step p50 ms | step p99 ms | step max ms |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, per_lib in mpr["results"].items():
            for lib, r in per_lib.items():
                ln = r["learner"]
                lines.append(f"| {name} | {lib} | {r['transitions_per_s_in']:,.0f} | {ln['steps_per_s']:,.0f} "
                             f"({ln['steps_per_s_min']:,.0f}-{ln['steps_per_s_max']:,.0f}) "
                             f"| {r['learner_vs_alone']:.0%} | {ln['p50_ms']:.3f} | {ln['p99_ms']:.3f} "
                             f"| {ln['max_ms']:.1f} |")  # fmt: skip
    if report.get("targets"):
        lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
        for t in report["targets"]:
            lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def check_targets(report: dict) -> list[dict]:
    """The replay targets, evaluated on this run's numbers (where measured)."""
    out = []
    sp = report["single_process"]
    if sp:
        cap = max(sp, key=float)
        note = "" if float(cap) == 1e6 else f" (at {float(cap):.0e}; the target is for 1e6)"
        for op, label in ((f"learner step (sample {UPDATE_SIZE} + update {UPDATE_SIZE})", "learner step"),
                          ("sample 1024", "sample 1024")):  # fmt: skip
            res = sp[cap][op]
            peers = [res[p]["median"] for p in ("cpprb", "tianshou") if p in res]
            if "mpper" in res and peers:
                m = res["mpper"]["median"]
                out.append({"target": f"{label}{note}: mpper <= 0.5 x fastest peer",
                            "measured": f"{m * 1e3:.4f} ms vs {min(peers) * 1e3:.4f} ms "
                                        f"({m / min(peers):.2f} x)",
                            "met": m <= 0.5 * min(peers)})  # fmt: skip
    if report.get("muzero"):
        m = report["muzero"]["median"]
        out.append({"target": "MuZero batch <= 0.25 ms", "measured": f"{m * 1e3:.4f} ms", "met": m <= 0.25e-3})
    mpr = report.get("multiprocess")
    if mpr:
        paced = next((v for k, v in mpr["results"].items() if "paced to" in k), {})
        note = "" if mpr["capacity"] == 1e6 else f" (at {mpr['capacity']:.0e}, {mpr['duration_s']:g} s)"
        if "mpper" in paced:
            r = paced["mpper"]
            out.append({"target": f"paced writers{note}: mpper learner >= 80 % of alone",
                        "measured": f"{r['learner_vs_alone']:.0%}", "met": r["learner_vs_alone"] >= 0.8})
            out.append({"target": f"paced writers{note}: mpper learner p99 < 5 ms",
                        "measured": f"{r['learner']['p99_ms']:.3f} ms", "met": r["learner"]["p99_ms"] < 5.0})
    return out


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}  # fmt: skip
    info["summary"] = f"{info['cpus']} x {cpu or 'unknown CPU'}, {info['platform']}, Python {info['python']}"
    return info


def versions(libs: dict) -> dict:
    """Versions of numpy, numba and every library measured in this run."""
    from importlib.metadata import PackageNotFoundError, version

    v = {"numpy": np.__version__}
    for name in ("numba", *libs):
        try:
            v[name] = version(name)
        except PackageNotFoundError:
            v[name] = getattr(libs.get(name), "__version__", "unknown") + " (not installed: checkout)"
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="mpper replay benchmark")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 3 reps, capacity 1e5 only, 2 s multi-process runs")  # fmt: skip
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 7, quick 3)")
    ap.add_argument("--capacities", default=None,
                    help="comma-separated, e.g. 1e5,1e6 (default 1e5,1e6; quick 1e5)")  # fmt: skip
    ap.add_argument("--mp-seconds", type=float, default=None, help="seconds per multi-process run (10; quick 2)")
    ap.add_argument("--mp-reps", type=int, default=None, help="repetitions of the multi-process runs (3; quick 1)")
    ap.add_argument("--skip-mp", action="store_true", help="no multi-process runs")
    ap.add_argument("--skip-single", action="store_true", help="no single-process or MuZero-batch runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "replay.json"))
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    caps_text = args.capacities or ("1e5" if args.quick else "1e5,1e6")
    capacities = [int(float(c)) for c in caps_text.split(",") if c.strip()]
    duration = args.mp_seconds or (2.0 if args.quick else 10.0)
    mp_reps = args.mp_reps or (1 if args.quick else 3)
    target_s = 0.02 if args.quick else 0.1  # seconds per timed block

    libs = import_libraries()
    report: dict = {
        "command": " ".join(["python", "bench/replay.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(), "versions": versions(libs), "reps": reps,
        "capacities": capacities, "single_process": {}, "muzero": None, "multiprocess": None,
    }  # fmt: skip
    for cap in [] if args.skip_single else capacities:
        print(f"single process, capacity {cap:.0e}", file=sys.stderr)
        report["single_process"][str(cap)] = bench_single_process(cap, libs, reps, target_s)
    if "mpper" in libs and not args.skip_single:
        print("MuZero batch", file=sys.stderr)
        report["muzero"] = bench_muzero(reps, target_s)
    mp_libs = {k: v for k, v in libs.items() if k in ("mpper", "cpprb")}
    if mp_libs and not args.skip_mp:
        cap = max(capacities)
        report["multiprocess"] = {"capacity": cap, "duration_s": duration, "writers": MP_WRITERS,
                                  "paced_rate": MP_PACED_RATE, "reps": mp_reps,
                                  "results": bench_multiprocess(cap, mp_libs, duration, mp_reps)}  # fmt: skip
    report["targets"] = check_targets(report)

    print(markdown(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nraw numbers: {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # children are joined and buffers closed by the finally blocks
        print("interrupted: every benchmark process joined, every buffer closed", file=sys.stderr)
        sys.exit(130)
