"""Learner throughput: training steps/s and the share of the
learner's time spent waiting for data (sampling and target building included).

Runs the real learner process (``mpper.runtime.learner.run_learner``) on a shared buffer filled
with CartPole-shaped episodes (no self-play, no rate limiter, so any wait is the
buffer's), with the network and batch of ``configs/cartpole.json``, and reads the
learner's own once-a-second reports. Also counts the torch operator calls of one
training step (``torch.profiler``, in this process), a figure independent of the load.

Usage::

    python bench/learner.py [--seconds 20] [--batch-size 128 1024] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mpper import ReplayBuffer  # noqa: E402
from mpper.algos.configs import load_config  # noqa: E402
from mpper.algos.muzero.networks import make_network  # noqa: E402
from mpper.algos.muzero.targets import muzero_schema  # noqa: E402
from mpper.algos.registry import algorithm_of  # noqa: E402
from mpper.runtime.learner import run_learner  # noqa: E402
from mpper.runtime.procs import StopSignal  # noqa: E402
from mpper.runtime.weights import WeightStore  # noqa: E402


def fill(buf: ReplayBuffer, episodes: int, rng: np.random.Generator) -> None:
    for _ in range(episodes):
        t = int(rng.integers(20, 500))
        buf.add_episode({
            "observation": rng.standard_normal((t + 1, 4)).astype(np.float32),
            "action": rng.integers(0, 2, t + 1),
            "reward": np.ones(t + 1, np.float32),
            "root_value": rng.uniform(0, 100, t + 1).astype(np.float32),
            "child_visits": rng.dirichlet([1, 1], t + 1).astype(np.float32),
        }, priorities=rng.uniform(0.1, 10, t))  # fmt: skip


def measure(batch_size: int, seconds: float, device: str) -> dict:
    config = load_config(ROOT / "configs" / "cartpole.json", check_env=False)
    config = dataclasses.replace(
        config,
        training=dataclasses.replace(config.training, batch_size=batch_size, samples_per_insert=None,
                                     min_buffer_steps=batch_size, training_steps=10**9),
        runtime=dataclasses.replace(config.runtime, device=device, checkpoint_interval_s=1e9),
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as run_dir, \
            ReplayBuffer.create(muzero_schema((4,), 2), 100_000, alpha=0.5) as buf, \
            WeightStore.create(make_network(config.network, (4,), 2).num_flat_weights()) as store:  # fmt: skip
        fill(buf, 400, rng)
        stop, reports = StopSignal(ctx), ctx.Queue()
        proc = ctx.Process(target=run_learner, args=(config, buf.handle, store.handle, stop, reports, run_dir))
        proc.start()
        samples = []
        try:
            deadline = None
            while deadline is None or time.monotonic() < deadline:
                try:
                    kind, _, payload = reports.get(timeout=60)
                except queue.Empty:
                    raise RuntimeError("the learner sent no report for 60 s") from None
                if kind == "error":
                    raise RuntimeError(payload["traceback"])
                if payload.get("state") == "training":
                    if deadline is None:  # the first report covers start-up: skip it
                        deadline = time.monotonic() + seconds
                        continue
                    samples.append(payload)
        finally:
            stop.set()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return {
        "batch_size": batch_size,
        "steps_per_s": statistics.median(s["steps_per_s"] for s in samples),
        "wait_fraction": statistics.median(s["wait_fraction"] for s in samples),
        "reports": len(samples),
    }


def ops_per_step(batch_size: int, steps: int = 10) -> float:
    """torch operator calls (``aten::``) per MuZero training step, counted with
    ``torch.profiler`` in this process on one batch: a figure that, unlike steps/s,
    does not depend on what else the machine is doing."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    config = load_config(ROOT / "configs" / "cartpole.json", check_env=False)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, batch_size=batch_size))
    with ReplayBuffer.create(muzero_schema((4,), 2), 100_000, alpha=0.5) as buf:
        fill(buf, 50, np.random.default_rng(0))
        trainer = algorithm_of(config).make_trainer(config, make_network(config.network, (4,), 2), torch.device("cpu"))
        batch = buf.sample(batch_size, 1.0, algorithm_of(config).make_targets(config, 2), np.random.default_rng(1))
        trainer.train_step(batch)  # first call: allocations and lazy set-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                trainer.train_step(batch)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    print(f"# Learner throughput: `python bench/learner.py --seconds {args.seconds:g} --device {args.device}`\n")
    print("| batch | training steps/s | waiting for data (share of time) | torch ops per step |")
    print("|---|---|---|---|")
    for b in args.batch_size:
        r = measure(b, args.seconds, args.device)
        print(f"| {b} | {r['steps_per_s']:.1f} | {r['wait_fraction']:.2%} | {ops_per_step(b):,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
