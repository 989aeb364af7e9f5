"""Memory of an image run: shared-memory bytes per stored step against one frame, and
each process's resident memory against the buffer's capacity.

For each ``--capacities`` value C, runs ``python run.py --config CONFIG --workers W
--time-limit S --set replay.capacity=C`` and, every second while it runs, reads
``/proc/PID/status`` of each process the run lists in ``processes.json``: ``RssAnon``
(private memory: what must not grow with the capacity) and ``RssShmem`` (pages of the
shared segment this process has touched: what the stored data costs). The peak of each
over the run is reported. The segment's size comes from ``/dev/shm`` while the run holds
it; bytes per stored step = segment size / C, against the frame's own bytes (its shape
times its dtype's size) plus the scalars each step stores. Throughput beside it: env
steps stored and training steps per second of the run (from its last metrics record).

Beside it, what muzero-general would keep for the same steps (computed from its code:
``GameHistory.observation_history`` holds each observation as a float32 array; its
Atari config's observations are (3, 96, 96)).

Usage::

    python bench/image_memory.py --config configs/atari_pong_dqn.json \\
        --capacities 20000 200000 --seconds 180 1200 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpper.algos.configs import load_config  # noqa: E402
from mpper.algos.registry import algorithm_of  # noqa: E402
from mpper.envs import env_spec  # noqa: E402

MUZERO_GENERAL_ATARI_OBSERVATION = (3, 96, 96)  # games/atari.py: observation_shape


def status_kib(pid: int) -> dict[str, int]:
    """RssAnon and RssShmem of ``pid`` in KiB (empty once it has exited)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def segment_size(pids: list[int]) -> int | None:
    """Bytes of the largest /dev/shm file the run's processes map (the buffer)."""
    sizes = []
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if path.startswith("/dev/shm/") and os.path.exists(path):
                sizes.append(os.path.getsize(path))
    return max(sizes) if sizes else None


def run_capacity(capacity: int, seconds: float, args, out_dir: Path) -> dict:
    run_dir = out_dir / f"capacity-{capacity}"
    cmd = [sys.executable, "run.py", "--config", args.config, "--workers", str(args.workers), "--device", "cpu",
           "--run-dir", str(run_dir), "--time-limit", str(seconds), "--set", f"replay.capacity={capacity}",
           "--set", "runtime.evaluation_interval_s=1e9"]  # fmt: skip
    for override in args.set:
        cmd += ["--set", override]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[str, dict[str, int]] = {}
    segment = None
    while proc.poll() is None:
        time.sleep(1.0)
        try:
            pids = json.loads((run_dir / "processes.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        for name, pid in pids.items():
            for key, kib in status_kib(pid).items():
                role = peaks.setdefault(name, {})
                role[key] = max(role.get(key, 0), kib)
        segment = segment_size(list(pids.values())) or segment
    stderr = proc.stderr.read()
    if proc.returncode != 0:
        raise SystemExit(f"capacity {capacity}: run.py exited {proc.returncode}:\n{stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    end = records[-1]
    return {"capacity": capacity, "segment_bytes": segment, "env_steps": end["env_steps"],
            "positions": end["counters"]["positions"], "training_steps": end["learner"].get("training_step") or 0,
            "run_s": end["time_s"], "peaks_kib": peaks, "seconds": seconds}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/cartpole_dqn.json")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed on to run.py")
    ap.add_argument("--capacities", type=int, nargs="+", default=[20_000, 200_000])
    ap.add_argument("--seconds", type=float, nargs="+", default=[120.0],
                    help="time limit of each run: one value for all, or one per capacity")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "image_memory"))
    args = ap.parse_args()

    config = load_config(args.config, args.set)
    spec = env_spec(config.env)
    schema = algorithm_of(config).schema(spec.observation_shape, spec.num_actions, spec.observation_dtype)
    frame_bytes = int(np.prod(spec.observation_shape)) * np.dtype(spec.observation_dtype).itemsize
    scalar_bytes = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                       for name, (shape, dtype, *_) in schema.items() if name != "observation")  # fmt: skip
    mzg_bytes = int(np.prod(MUZERO_GENERAL_ATARI_OBSERVATION)) * 4
    same_frame_as_float32 = int(np.prod(spec.observation_shape)) * 4
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"frame {spec.observation_shape} {np.dtype(spec.observation_dtype).name}: {frame_bytes:,} B; "
          f"other fields per step: {scalar_bytes} B", flush=True)  # fmt: skip
    if len(args.seconds) not in (1, len(args.capacities)):
        raise SystemExit("--seconds: give one value, or one per --capacities value")
    seconds = args.seconds * len(args.capacities) if len(args.seconds) == 1 else args.seconds
    rows = [run_capacity(c, s, args, out_dir) for c, s in zip(args.capacities, seconds)]
    print(f"\n`python bench/image_memory.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')})")
    print("\n| capacity | run s | segment bytes per step | x (frame + fields) | env steps stored | env steps/s "
          "| training steps/s | worker RssAnon MiB (max) | learner RssAnon MiB | learner RssShmem MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_step = r["segment_bytes"] / r["capacity"] if r["segment_bytes"] else float("nan")
        workers = [v.get("RssAnon", 0) for k, v in r["peaks_kib"].items() if k.startswith("worker")]
        learner = r["peaks_kib"].get("learner", {})
        print(f"| {r['capacity']:,} | {r['run_s']:.0f} | {per_step:,.0f} | {per_step / (frame_bytes + scalar_bytes):.3f} "
              f"| {r['env_steps']:,} | {r['env_steps'] / r['run_s']:.1f} | {r['training_steps'] / r['run_s']:.2f} "
              f"| {max(workers, default=0) / 1024:.0f} | {learner.get('RssAnon', 0) / 1024:.0f} "
              f"| {learner.get('RssShmem', 0) / 1024:.0f} |")  # fmt: skip
    print(f"\nmuzero-general keeps each observation as float32: {mzg_bytes:,} B per step for its Atari "
          f"config's (3, 96, 96) observations, {same_frame_as_float32:,} B for this frame "
          f"({same_frame_as_float32 / frame_bytes:.0f}x mpper's {frame_bytes:,} B)")  # fmt: skip
    (out_dir / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
