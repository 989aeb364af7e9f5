"""Learner throughput: training steps/s and the share of the
learner's time spent waiting for data (sampling and target building included).

Runs the real learner process (``mpper.runtime.children.run_learner``) with the network and
targets of ``--config`` on a shared buffer filled beforehand (no self-play running, no rate
limiter, so any wait is the buffer's), and reads the learner's own once-a-second reports.
Also counts the torch operator calls of one training step (``torch.profiler``, in this
process), a figure independent of the load.

The buffer: for ``configs/cartpole.json`` (the default), 400 CartPole-shaped episodes of
random numbers; for any other config, ``--fill-moves`` moves played in the config's own
env by its own player with a freshly initialised network (exploring, as a worker does), so
image configs train on real frames, stored once and stacked at sample time.

Usage::

    python bench/learner.py [--seconds 20] [--batch-size 128 1024] [--device cpu]
    python bench/learner.py --config configs/minatar_breakout_dqn.json --batch-size 32 256
    python bench/learner.py --config configs/atari_pong.json --batch-size 256 --fill-moves 3000
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
from mpper.algos.muzero.targets import muzero_schema  # noqa: E402
from mpper.algos.registry import algorithm_of  # noqa: E402
from mpper.envs import env_spec, make_env  # noqa: E402
from mpper.runtime.children import run_learner  # noqa: E402
from mpper.runtime.procs import StopSignal  # noqa: E402
from mpper.runtime.run import create_buffer  # noqa: E402
from mpper.runtime.setup import RunSetup  # noqa: E402
from mpper.runtime.weights import WeightStore  # noqa: E402

CARTPOLE = ROOT / "configs" / "cartpole.json"


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


def fill_by_play(config, buf: ReplayBuffer, moves: int, seed: int = 0) -> None:
    """Store at least ``moves`` moves played in ``config``'s env by its algorithm's
    player, exploring, with a freshly initialised network."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(config.runtime.torch_threads)  # as a worker
    algorithm, spec = algorithm_of(config), env_spec(config.env)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions).eval()  # as a worker's
    envs = [make_env(config.env) for _ in range(config.runtime.envs_per_worker)]
    player = algorithm.make_player(config, envs, network, explore=True, seed=seed)
    try:
        while buf.counters["steps"] < moves:
            for episode in player.step(0.0):
                arrays, priorities = player.stored(episode)
                buf.add_episode(arrays, priorities=priorities, terminated=episode.terminated)
    finally:
        for env in envs:
            env.close()


def bench_config(path: Path, overrides, batch_size: int, device: str = "cpu"):
    """``path`` with ``overrides``, the batch size, no rate limit and no checkpoints."""
    config = load_config(path, overrides, check_env=False)
    return dataclasses.replace(
        config,
        training=dataclasses.replace(config.training, batch_size=batch_size, samples_per_insert=None,
                                     min_buffer_steps=batch_size, training_steps=10**9),
        runtime=dataclasses.replace(config.runtime, device=device, checkpoint_interval_s=1e9),
    )  # fmt: skip


def filled_buffer(config, path: Path, fill_moves: int) -> ReplayBuffer:
    """The buffer the learner trains from (see the module docstring); the caller closes it."""
    if path == CARTPOLE:
        buf = ReplayBuffer.create(muzero_schema((4,), 2), 100_000, alpha=0.5)
        fill(buf, 400, np.random.default_rng(0))
        return buf
    capacity = max(min(config.replay.capacity, 4 * fill_moves), fill_moves + 10_000)
    buf = create_buffer(dataclasses.replace(config, replay=dataclasses.replace(config.replay, capacity=capacity)),
                        env_spec(config.env))  # fmt: skip
    try:
        fill_by_play(config, buf, fill_moves)
    except BaseException:
        buf.close()
        raise
    return buf


def measure(config, buf: ReplayBuffer, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as run_dir:
        setup = RunSetup.create(config, run_dir)
        store = WeightStore.create(setup.make_network().num_flat_weights())
        stop, reports = StopSignal(ctx), ctx.Queue()
        proc = ctx.Process(target=run_learner, args=(setup, buf.handle, store.handle, stop, reports))
        proc.start()
        samples = []
        try:
            deadline = None
            while deadline is None or time.monotonic() < deadline:
                try:
                    kind, _, payload = reports.get(timeout=120)
                except queue.Empty:
                    raise RuntimeError("the learner sent no report for 120 s") from None
                if kind == "error":
                    raise RuntimeError(payload["traceback"])
                if payload.get("state") == "training":
                    if deadline is None:  # the first report covers start-up: skip it
                        window_start = time.monotonic()
                        deadline = window_start + seconds
                        continue
                    samples.append(payload)
        finally:
            stop.set()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
            store.close()
    return {
        "steps_per_s": statistics.median(s["steps_per_s"] for s in samples),
        "wait_fraction": statistics.median(s["wait_fraction"] for s in samples),
        "reports": len(samples),
        # the time.monotonic() span the figures cover (a GPU sampler's window: not the start-up)
        "window": (window_start, time.monotonic()),
    }


def ops_per_step(config, buf: ReplayBuffer, steps: int = 10) -> float:
    """torch operator calls (``aten::``) per training step, counted with
    ``torch.profiler`` in this process on one batch: a figure that, unlike steps/s,
    does not depend on what else the machine is doing."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    # the eager step's operators (a captured or compiled step launches one graph)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, capture="off", precision="fp32"))
    algorithm, spec = algorithm_of(config), env_spec(config.env)
    trainer = algorithm.make_trainer(config, algorithm.make_network(config, spec.observation_shape, spec.num_actions),
                                     torch.device("cpu"))  # fmt: skip
    batch = buf.sample(config.training.batch_size, 1.0, algorithm.make_targets(config, spec.num_actions),
                       np.random.default_rng(1))  # fmt: skip
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
    ap.add_argument("--config", type=Path, default=CARTPOLE)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override (repeatable)")
    ap.add_argument("--fill-moves", type=int, default=5_000, help="moves played into the buffer (not CartPole)")
    args = ap.parse_args()
    sets = "".join(f" --set {o}" for o in args.overrides)
    config_arg = "" if args.config.resolve() == CARTPOLE else f" --config {args.config}"
    print(f"# Learner throughput: `python bench/learner.py{config_arg}{sets} --seconds {args.seconds:g} "
          f"--device {args.device}` ({time.strftime('%Y-%m-%d')})\n")
    print("| batch | training steps/s | samples/s | waiting for data (share of time) | torch ops per step |")
    print("|---|---|---|---|---|")
    path = args.config.resolve()
    with filled_buffer(bench_config(path, args.overrides, 1), path, args.fill_moves) as buf:
        for b in args.batch_size:
            config = bench_config(path, args.overrides, b, args.device)
            r = measure(config, buf, args.seconds)
            print(f"| {b} | {r['steps_per_s']:.1f} | {r['steps_per_s'] * b:,.0f} | {r['wait_fraction']:.2%} "
                  f"| {ops_per_step(config, buf):,.0f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
