"""Soak test: a long run with a full, churning buffer; does any process grow, does the
learner wait for the buffer's lock?

Runs ``python run.py --workers N --config configs/cartpole.json`` (MuZero) for
``--minutes`` with a replay capacity small enough that the ring is full within the first
minutes (``--capacity``; the run never stops early: ``solve_return`` is null and the
step limit out of reach). Every ``--interval`` seconds it reads, for the supervisor and
each child listed in the run's ``processes.json``:

- ``VmRSS`` from ``/proc/PID/status``, and
- ``Pss`` from ``/proc/PID/smaps_rollup``: shared-memory pages count in full in the RSS
  of every process that touched them, the proportional set size splits them between
  the processes that map them.

Once the buffer is full (the first evicted episode, ``counters.episodes_evicted > 0`` in
``metrics.jsonl``), each process's growth is its largest value after that point against
its value at that point, in percent (target: no process grows by more than 5 %). A
restarted child (new pid) gets a row of its own.

The learner's waits for the buffer's lock (``update_priorities``, its only locked
operation) come from its own metrics report: ``lock_wait_hist_us`` (counts per log2
microsecond bin, always on) and ``lock_wait_max_us``.

Prints Markdown tables and writes ``bench/results/soak-<timestamp>.json`` (every
sample). Usage::

    python bench/soak.py                     # 8 workers, 10 minutes, capacity 20000
    python bench/soak.py --minutes 1 --capacity 3000   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGET_GROWTH_PCT = 5.0


def memory_kib(pid: int) -> dict | None:
    """``{"rss": VmRSS, "pss": Pss}`` in KiB, or None if the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None

    def field(text: str, name: str) -> int | None:
        for line in text.splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])  # "VmRSS:   123456 kB"
        return None

    rss, pss = field(status, "VmRSS"), field(rollup, "Pss")
    return None if rss is None or pss is None else {"rss": rss, "pss": pss}


def last_record(metrics: Path) -> dict:
    """The newest complete line of a metrics.jsonl that another process appends to."""
    if not metrics.exists():
        return {}
    lines = [line for line in metrics.read_text().split("\n")[:-1] if line]
    return json.loads(lines[-1]) if lines else {}


def sample(run_dir: Path, started: float) -> dict:
    try:
        pids = json.loads((run_dir / "processes.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        pids = {}
    record = last_record(run_dir / "metrics.jsonl")
    counters = record.get("counters", {})
    procs = {}
    for role, pid in pids.items():
        mem = memory_kib(pid)
        if mem is not None:
            procs[f"{role}:{pid}"] = {"role": role, "pid": pid, **mem}
    return {
        "t": round(time.monotonic() - started, 1),
        "positions": record.get("buffer_positions"),
        "evicted": counters.get("episodes_evicted", 0),
        "env_steps": counters.get("steps"),
        "training_step": record.get("learner", {}).get("training_step"),
        "processes": procs,
    }


def growth(samples: list[dict], fill_index: int) -> list[dict]:
    """Per process: its value at the fill (or its first sample after, if it started
    later), its largest value from then on, and the growth between them in %."""
    rows = {}
    for s in samples[fill_index:]:
        for key, p in s["processes"].items():
            row = rows.setdefault(key, {"role": p["role"], "pid": p["pid"], "since_s": s["t"],
                                        "rss_at_fill": p["rss"], "pss_at_fill": p["pss"], "rss_max": 0, "pss_max": 0})
            row["rss_max"] = max(row["rss_max"], p["rss"])
            row["pss_max"] = max(row["pss_max"], p["pss"])
    for row in rows.values():
        row["rss_growth_pct"] = 100.0 * (row["rss_max"] - row["rss_at_fill"]) / row["rss_at_fill"]
        row["pss_growth_pct"] = 100.0 * (row["pss_max"] - row["pss_at_fill"]) / row["pss_at_fill"]
    order = {"supervisor": 0, "learner": 1, "reanalyser": 2, "evaluator": 3}
    return sorted(rows.values(), key=lambda r: (order.get(r["role"], 4), r["role"], r["since_s"]))


def bin_label(i: int) -> str:
    return "< 1 us" if i == 0 else f"{2 ** (i - 1)}-{2 ** i} us"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--capacity", type=int, default=20_000, help="replay.capacity (small: the ring fills early)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--config", default="configs/cartpole.json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = RESULTS / f"soak-{stamp}"
    shutil.rmtree(run_dir, ignore_errors=True)
    seconds = args.minutes * 60
    cmd = [sys.executable, "run.py", "--config", args.config, "--workers", str(args.workers), "--device", "cpu",
           "--seed", str(args.seed), "--run-dir", str(run_dir), "--time-limit", str(seconds),
           "--max-train-steps", str(10**9), "--set", f"replay.capacity={args.capacity}",
           "--set", f"training.min_buffer_steps={min(500, args.capacity)}", "--set", "runtime.solve_return=null"]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    log = open(RESULTS / f"soak-{stamp}.log", "w")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    samples = []
    try:
        next_at = started
        while proc.poll() is None:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += args.interval
            if proc.poll() is not None:
                break
            s = sample(run_dir, started)
            samples.append(s)
            total = {k: sum(p[k] for p in s["processes"].values()) // 1024 for k in ("rss", "pss")}
            print(f"[{s['t']:6.0f}s] positions {s['positions']} evicted {s['evicted']} step {s['training_step']} "
                  f"| {len(s['processes'])} processes, RSS {total['rss']} MiB, PSS {total['pss']} MiB", flush=True)
    except KeyboardInterrupt:
        proc.send_signal(2)
    finally:
        proc.wait()
        log.close()

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    end = records[-1]
    learner = next((r["learner"] for r in reversed(records) if "lock_wait_hist_us" in r.get("learner", {})), {})
    fill_index = next((i for i, s in enumerate(samples) if s["evicted"] > 0), None)
    rows = growth(samples, fill_index) if fill_index is not None else []
    result = {
        "command": cmd[1:], "exit_code": proc.returncode, "workers": args.workers, "minutes": args.minutes,
        "capacity": args.capacity, "interval_s": args.interval,
        "fill_s": samples[fill_index]["t"] if fill_index is not None else None,
        "end": {"time_s": end["time_s"], "counters": end["counters"],
                "training_step": end["learner"].get("training_step")},
        "growth": rows, "max_rss_growth_pct": max((r["rss_growth_pct"] for r in rows), default=None),
        "max_pss_growth_pct": max((r["pss_growth_pct"] for r in rows), default=None),
        "lock_wait_hist_us": learner.get("lock_wait_hist_us"), "lock_wait_max_us": learner.get("lock_wait_max_us"),
        "samples": samples,
    }  # fmt: skip
    out = RESULTS / f"soak-{stamp}.json"
    out.write_text(json.dumps(result, indent=1))

    c = end["counters"]
    print(f"\n### Soak: --workers {args.workers}, {args.minutes:g} min, capacity {args.capacity} "
          f"(exit code {proc.returncode})\n")
    print("| buffer full at | env steps | training steps | games | episodes evicted | samples |")
    print("|---|---|---|---|---|---|")
    fill = f"{result['fill_s']:.0f} s" if result["fill_s"] is not None else "never"
    print(f"| {fill} | {c['steps']:,} | {result['end']['training_step'] or 0:,} | {c['games']:,} "
          f"| {c['episodes_evicted']:,} | {c['samples']:,} |")
    if rows:
        print("\nMemory from the fill to the end (MiB; growth = max after the fill vs at the fill):\n")
        print("| process | pid | from s | RSS at fill | RSS max | RSS growth | PSS at fill | PSS max | PSS growth |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['role']} | {r['pid']} | {r['since_s']:.0f} | {r['rss_at_fill'] / 1024:.1f} "
                  f"| {r['rss_max'] / 1024:.1f} | {r['rss_growth_pct']:+.1f} % | {r['pss_at_fill'] / 1024:.1f} "
                  f"| {r['pss_max'] / 1024:.1f} | {r['pss_growth_pct']:+.1f} % |")
        worst = max(rows, key=lambda r: r["rss_growth_pct"])
        met = result["max_rss_growth_pct"] <= TARGET_GROWTH_PCT
        print(f"\nLargest RSS growth: {worst['role']} {worst['rss_growth_pct']:+.1f} % "
              f"(target <= {TARGET_GROWTH_PCT:g} %: {'met' if met else 'NOT met'}); "
              f"largest PSS growth {result['max_pss_growth_pct']:+.1f} %")
    else:
        print("\nThe buffer never filled: no growth figures (a smaller --capacity or more --minutes).")
    hist = result["lock_wait_hist_us"]
    if hist:
        n = sum(hist)
        print(f"\nLearner's waits for the buffer lock ({n:,} acquisitions, max {result['lock_wait_max_us']:.0f} us):\n")
        print("| wait | count | share |")
        print("|---|---|---|")
        for i, count in enumerate(hist):
            if count:
                print(f"| {bin_label(i)} | {count:,} | {count / n:.3%} |")
    print(f"\nwritten: {out}")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
