"""Self-play throughput of one config: agent steps/s (moves stored) and simulations/s of the
whole box, with the network in each worker or served by the inference process.

Runs the real self-play processes (``mpper.runtime.children.run_selfplay``, and with
``--selfplay-inference server`` ``mpper.runtime.inference.run_inference``) against a
shared buffer, with no learner: the weights are a freshly initialised network's,
published once; no samples-per-insert ratio holds the workers back. After ``--warmup``
seconds (and the first stored episode), the moves stored during ``--seconds`` seconds
give the agent steps/s; each move of each env is one search of ``mcts.num_simulations``
simulations, which gives the simulations/s. With the server, the rows its network
calls took on average say how well the batches span the workers (at most workers x
envs). Moves are counted as stored, a whole episode (or a game segment,
``muzero.game_segment_length``) at a time, so a window should hold many episodes: cap
long games with ``--set env.max_episode_steps=N``.

``--device`` is the inference process's device (``runtime.device``); the workers' own
networks stay on the CPU, as in a run.

Usage::

    python bench/selfplay.py --workers 2 --selfplay-inference worker server --seconds 20
    python bench/selfplay.py --config configs/atari_pong.json --workers 16 --selfplay-inference server \\
        --device cuda --set mcts.num_simulations=16 --seconds 60 --json selfplay.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mpper.algos.configs import load_config  # noqa: E402
from mpper.runtime.children import run_selfplay  # noqa: E402
from mpper.runtime.inference import InferenceSlots, run_inference  # noqa: E402
from mpper.runtime.procs import StopSignal, process_context  # noqa: E402
from mpper.runtime.run import create_buffer  # noqa: E402
from mpper.runtime.setup import RunSetup, Seeds  # noqa: E402
from mpper.runtime.weights import WeightStore  # noqa: E402

CARTPOLE = ROOT / "configs" / "cartpole.json"
_START_TIMEOUT_S = 300.0  # for the first stored episode (process start, numba's first compile)


def bench_config(path: Path, overrides, workers: int, inference: str, device: str):
    """``path`` with ``overrides``, ``workers`` workers, the inference path, the device,
    and no samples-per-insert ratio."""
    config = load_config(path, overrides, check_env=False)
    return dataclasses.replace(
        config,
        training=dataclasses.replace(config.training, samples_per_insert=None),
        runtime=dataclasses.replace(config.runtime, workers=workers, selfplay_inference=inference, device=device,
                                    lockstep=False, ray_address=None),
    )  # fmt: skip


def measure(config, seconds: float, warmup: float) -> dict:
    """Run the self-play processes of ``config``; the figures of the measured window."""
    import torch

    ctx = process_context()
    rt = config.runtime
    with tempfile.TemporaryDirectory() as run_dir:
        setup = RunSetup.create(config, run_dir)
        torch.manual_seed(rt.seed)
        network = setup.make_network()
        buf = create_buffer(config, setup.spec, ctx)
        store = WeightStore.create(network.num_flat_weights())
        store.publish(network.get_flat_weights(), 0)
        stop, reports = StopSignal(ctx), ctx.Queue()
        slots = InferenceSlots.for_run(setup, ctx) if rt.selfplay_inference == "server" else None
        served = {} if slots is None else {"inference_handle": slots.handle}
        procs = []
        try:
            if slots is not None:
                procs.append(ctx.Process(target=run_inference, kwargs={
                    "setup": setup, "weight_handle": store.handle, "stop": stop, "reports": reports, **served}))  # fmt: skip
            for i in range(rt.workers):
                procs.append(ctx.Process(target=run_selfplay, kwargs={
                    "setup": setup, "worker_id": i, "buffer_handle": buf.handle, "weight_handle": store.handle,
                    "stop": stop, "reports": reports, "seed": Seeds(rt.seed).worker(i), **served}))  # fmt: skip
            for p in procs:
                p.start()
            started = time.monotonic()
            _wait(lambda: buf.counters["steps"] > 0, started + _START_TIMEOUT_S, reports, procs, "the first episode")
            _wait(lambda: False, time.monotonic() + warmup, reports, procs, None)
            t0, moves0 = time.monotonic(), buf.counters["steps"]
            calls0 = slots.calls() if slots is not None else (0, 0)
            _wait(lambda: False, t0 + seconds, reports, procs, None)
            elapsed, moves = time.monotonic() - t0, buf.counters["steps"] - moves0
            calls, rows = (np.subtract(slots.calls(), calls0) if slots is not None else (0, 0))
        finally:
            stop.set()
            for p in procs:
                if p.pid is not None:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
                        p.join()
            for obj in (slots, store, buf):
                if obj is not None:
                    obj.close()
    sims = config.mcts.num_simulations
    return {
        "config": str(config.env.id), "workers": rt.workers, "envs_per_worker": rt.envs_per_worker,
        "selfplay_inference": rt.selfplay_inference,
        "device": rt.device if rt.selfplay_inference == "server" else "cpu", "num_simulations": sims,
        "seconds": round(elapsed, 3), "window": (t0, t0 + elapsed),  # time.monotonic(): the same clock in every process
        "moves": int(moves), "agent_steps_per_s": moves / elapsed,
        "simulations_per_s": moves * sims / elapsed,
        # the inference process's network calls in the window, and the rows one took on average
        "network_calls": int(calls), "rows_per_call": rows / calls if calls else None,
    }  # fmt: skip


def _wait(done, deadline: float, reports, procs, what: str | None) -> None:
    """Until ``done()`` or ``deadline`` (an error when ``what`` was awaited), reading the
    children's reports (a traceback is raised here) and watching that they live."""
    while not done():
        if time.monotonic() >= deadline:
            if what is None:
                return
            raise RuntimeError(f"no {what} within {_START_TIMEOUT_S:g} s")
        try:
            kind, source, payload = reports.get(timeout=0.2)
        except queue.Empty:
            kind = None
        if kind == "error":
            raise RuntimeError(f"{source} failed:\n{payload['traceback']}")
        dead = [p.name for p in procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CARTPOLE)
    ap.add_argument("--workers", type=int, nargs="+", default=[2])
    ap.add_argument("--selfplay-inference", nargs="+", choices=("worker", "server"), default=["worker", "server"])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the inference process's device")
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds played after the first episode, not measured")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override (repeatable)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda: torch.cuda.is_available() is false", file=sys.stderr)
            return 2
    sets = "".join(f" --set {o}" for o in args.overrides)
    shown = args.config.resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    workers = " ".join(map(str, args.workers))
    print(f"# Self-play throughput: `python bench/selfplay.py --config {shown}{sets} --workers {workers} "
          f"--device {args.device} --seconds {args.seconds:g}` ({time.strftime('%Y-%m-%d')})\n")
    print("| workers | inference | device | agent steps/s | simulations/s | rows per network call |")
    print("|---|---|---|---|---|---|")
    results = []
    for workers in args.workers:
        for inference in args.selfplay_inference:
            config = bench_config(args.config.resolve(), args.overrides, workers, inference, args.device)
            r = measure(config, args.seconds, args.warmup)
            results.append(r)
            device = args.device if inference == "server" else "cpu"
            rows = "-" if r["rows_per_call"] is None else f"{r['rows_per_call']:.1f}"
            print(f"| {workers} | {inference} | {device} | {r['agent_steps_per_s']:,.1f} "
                  f"| {r['simulations_per_s']:,.0f} | {rows} |", flush=True)  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"command": sys.argv, "date": time.strftime("%Y-%m-%d"), "results": results},
                                        indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
