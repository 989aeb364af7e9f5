"""Memory to save and load a large image snapshot: private memory against the snapshot's size.

Fills a buffer of Atari-sized frames ((1, 84, 84) uint8, DQN's schema: one frame, an action
and a reward per step) up to ``--gb`` GB of shared memory, saves it with ``buf.save`` and loads
it back both ways: ``ReplayBuffer.load`` (a live buffer: the data is copied into a new
shared-memory segment, which is the buffer, and into nothing else) and
``ReplayBuffer.load(mmap=True)`` (read-only, what ``--inspect`` and ``--evaluate
--on-snapshot`` use: the files are mapped, nothing copied). Each phase runs in its own
process, which samples its ``/proc/self/status`` every 10 ms; reported per phase:

- peak ``RssAnon``: private memory (heap, numpy temporaries). The claim: this stays far
  below the snapshot's size, so saving or loading a 10 GB snapshot does not need another
  10 GB of RAM;
- peak ``RssShmem``: the shared segment's pages this process touched (the buffer itself);
- peak ``RssFile``: pages of the snapshot's files mapped and read (page cache the kernel can
  drop, not memory the process owns);
- wall seconds, and GB/s of snapshot written or read (checksums included).

Usage::

    python bench/snapshot_memory.py --gb 10 --dir /tmp/snapmem
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mpper import ReplayBuffer  # noqa: E402
from mpper.algos.dqn.targets import dqn_schema  # noqa: E402

FRAME = (1, 84, 84)
EPISODE_ROWS = 2_000


class PeakMemory:
    """Peaks of RssAnon, RssShmem and RssFile (bytes) of this process, sampled every 10 ms."""

    KEYS = ("RssAnon", "RssShmem", "RssFile")

    def __init__(self) -> None:
        self.peak = dict.fromkeys(self.KEYS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in PeakMemory.KEYS:
                out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for key, value in self.now().items():
                self.peak[key] = max(self.peak[key], value)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for key, value in self.now().items():
            self.peak[key] = max(self.peak[key], value)


def capacity_for(gb: float) -> int:
    row = int(np.prod(FRAME)) + 8 + 4  # frame, int64 action, float32 reward
    return int(gb * 1e9 // row) // EPISODE_ROWS * EPISODE_ROWS


def phase_save(gb: float, path: Path) -> dict:
    """Fill a new buffer (frames of every episode distinct) and save it."""
    capacity = capacity_for(gb)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, (EPISODE_ROWS, *FRAME), dtype=np.uint8)
    with ReplayBuffer.create(dqn_schema(FRAME, "uint8"), capacity, alpha=0.6) as buf:
        for e in range(capacity // EPISODE_ROWS):
            buf.add_episode({"observation": block + np.uint8(e % 256), "action": np.full(EPISODE_ROWS, e % 6),
                             "reward": np.zeros(EPISODE_ROWS, np.float32)},
                            priorities=rng.uniform(0.1, 2.0, EPISODE_ROWS - 1))  # fmt: skip
        segment = sum(a.nbytes for a in buf.fields.values())
        before = PeakMemory.now()
        t0 = time.monotonic()
        with PeakMemory() as peak:
            buf.save(path)
        wall = time.monotonic() - t0
    return {"phase": "save", "wall_s": wall, "segment_bytes": segment, "before": before, "peak": peak.peak,
            "positions": capacity}  # fmt: skip


def phase_load(path: Path, mmap: bool) -> dict:
    before = PeakMemory.now()
    t0 = time.monotonic()
    with PeakMemory() as peak:
        buf = ReplayBuffer.load(path, mmap=mmap)
        try:
            positions = len(buf)
            frame = np.asarray(buf.fields["observation"][positions // 2]).copy()
        finally:
            buf.close()
    wall = time.monotonic() - t0
    expect = (np.random.default_rng(0).integers(0, 256, (EPISODE_ROWS, *FRAME), dtype=np.uint8)
              + np.uint8((positions // 2) // EPISODE_ROWS % 256))[(positions // 2) % EPISODE_ROWS]  # fmt: skip
    if not np.array_equal(frame, expect):
        raise SystemExit(f"{path}: a loaded frame differs from the one saved")
    return {"phase": "load (mmap)" if mmap else "load", "wall_s": wall, "before": before, "peak": peak.peak,
            "positions": positions}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=10.0, help="GB of frames in the buffer")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mpper-snapshot-memory"))
    ap.add_argument("--phase", choices=("save", "load", "load-mmap"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    snap = args.dir / "snapshot"
    if args.phase is not None:
        out = {"save": lambda: phase_save(args.gb, snap), "load": lambda: phase_load(snap, False),
               "load-mmap": lambda: phase_load(snap, True)}[args.phase]()  # fmt: skip
        print(json.dumps(out))
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    rows = []
    try:
        for phase in ("save", "load", "load-mmap"):
            proc = subprocess.run([sys.executable, __file__, "--gb", str(args.gb), "--dir", str(args.dir),
                                   "--phase", phase], capture_output=True, text=True)  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"phase {phase} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        size = sum(f.stat().st_size for f in snap.iterdir())
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    gb = 1e9
    print(f"# Snapshot memory: `python bench/snapshot_memory.py --gb {args.gb:g}` ({time.strftime('%Y-%m-%d')})\n")
    print(f"{rows[0]['positions']:,} stored steps of {FRAME} uint8 frames; shared segment "
          f"{rows[0]['segment_bytes'] / gb:.2f} GB; snapshot on disk {size / gb:.2f} GB.\n")
    print("| phase | wall s | GB/s | peak RssAnon GB (before) | peak RssShmem GB | peak RssFile GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        p, b = r["peak"], r["before"]
        print(f"| {r['phase']} | {r['wall_s']:.1f} | {size / gb / r['wall_s']:.2f} | {p['RssAnon'] / gb:.3f} "
              f"({b['RssAnon'] / gb:.3f}) | {p['RssShmem'] / gb:.2f} | {p['RssFile'] / gb:.2f} |")  # fmt: skip
    worst = max(r["peak"]["RssAnon"] - r["before"]["RssAnon"] for r in rows)
    print(f"\nlargest private memory a phase added to its process: {worst / gb:.3f} GB = {worst / size:.2%} of the "
          "snapshot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
