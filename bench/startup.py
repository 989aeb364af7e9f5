"""How fast a run starts, and how much memory its processes hold.

For each checkout in ``--roots`` (default: this one; name an older checkout beside it to
compare two versions, their runs interleaved), runs ``python run.py --config CONFIG
--workers N`` ``--repeats`` times (after one unmeasured run per checkout, which fills
numba's cache there), each stopped after ``--seconds`` (``--time-limit``; no solve stop), with a progress record every 0.1 s (``runtime.log_interval_s``; the
supervisor writes one about every 0.2 s, as it reads its queue for up to 0.2 s between
them). From the run's ``metrics.jsonl``, in seconds after the launch of ``run.py``:

- *supervisor start*: the run's clock starts (interpreter, imports, config checks done);
- *first evaluation*: the evaluator's first result (children started, first weights read);
- *first batch*: the first record whose buffer counter ``samples`` is above 0, the
  learner's first training batch (to within the ~0.2 s between records).

What the forkserver loads once for every child (``mpper/runtime/preload.py``), timed step
by step in a fresh interpreter: the modules every child imports, a DQN learner's
optimizer built and stepped once (``torch.optim``'s would import ``torch._dynamo``;
``mpper.algos.optim``'s imports nothing) and the buffer's compiled kernels; CPU seconds
and resident memory after each step.

And ``--memory-at`` seconds after the launch, each process's private memory (USS:
``Private_Clean + Private_Dirty`` of ``/proc/PID/smaps_rollup``) and its PSS (shared
pages divided among the processes that map them), by role (``processes.json``; the rest
are the forkserver and multiprocessing's resource tracker), and the sum over the run.

Usage::

    python bench/startup.py --config configs/cartpole_dqn.json --workers 2 --repeats 3
    python bench/startup.py --roots . /path/to/older/checkout --repeats 3
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proctree  # noqa: E402


def memory_by_process(root_pid: int) -> dict[int, tuple[float, float]]:
    """(USS MiB, PSS MiB) of ``root_pid`` and its descendants, by pid."""
    out = {}
    for pid in proctree.tree_cpu(root_pid):
        try:
            fields = {}
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0])  # kB
        except (OSError, ValueError, IndexError):
            continue
        out[pid] = ((fields["Private_Clean"] + fields["Private_Dirty"]) / 1024, fields["Pss"] / 1024)
    return out


_PRELOAD_STEPS = """
import json, resource, sys, time
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
steps = []
def step(name, t0):
    steps.append((name, time.process_time() - t0, rss_mib()))
t0 = time.process_time()
import mpper.algos.dqn.dqn, mpper.algos.muzero.reanalyse, mpper.runtime.children
step("python, torch, numba and mpper's process mains", t0)
t0 = time.process_time()
import torch
from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of
config = load_config("configs/cartpole_dqn.json")
trainer = algorithm_of(config).make_trainer(config, algorithm_of(config).make_network(config, (4,), 2),
                                            torch.device("cpu"))
sum(p.sum() for p in trainer.network.parameters()).backward()
trainer.optimizer.step()
step("a DQN learner built, one optimizer step" + (" (torch._dynamo imported)" if "torch._dynamo" in sys.modules
                                                  else ""), t0)
t0 = time.process_time()
from mpper.replay.buffer import warm_kernels
warm_kernels()
step("the buffer's compiled kernels, from numba's on-disk cache", t0)
print(json.dumps(steps))
"""


def preload_costs(root: Path) -> list[tuple[str, float, float]]:
    """(step, CPU s, RSS MiB after it) of the forkserver's preload, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _PRELOAD_STEPS], cwd=root, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def one_run(root: Path, config: str, workers: int, seconds: float, memory_at: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "run.py", "--config", config, "--workers", str(workers), "--run-dir", str(run_dir),
               "--time-limit", str(seconds), "--set", "runtime.solve_return=null",
               "--set", "runtime.log_interval_s=0.1"]  # fmt: skip
        launched = time.time()
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        memory, roles = {}, {}
        try:
            while proc.poll() is None:
                due = time.time() - launched >= memory_at
                if due and not memory and (run_dir / "processes.json").exists():  # the children have started
                    roles = {pid: name for name, pid in json.loads((run_dir / "processes.json").read_text()).items()}
                    roles[proc.pid] = "supervisor"
                    memory = memory_by_process(proc.pid)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:  # this script failed: stop the run as Ctrl-C would, then wait for it
                proc.send_signal(signal.SIGINT)
                proc.wait(60)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} (in {root}) exited with {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    if not memory:
        raise RuntimeError(f"the run ended before --memory-at {memory_at} s; raise --seconds")
    start = records[0]["unix_time"] - records[0]["time_s"] - launched
    first_eval = next(r["unix_time"] for r in records if r["event"] == "evaluation") - launched
    first_batch = next((r["unix_time"] for r in records if r["counters"]["samples"] > 0), float("nan")) - launched
    by_role: dict[str, list[tuple[float, float]]] = {}
    for pid, usage in memory.items():
        role = roles.get(pid, "forkserver, resource tracker")
        by_role.setdefault(role.rstrip("0123456789").rstrip("-") if role.startswith("worker-") else role, []).append(usage)
    return {"supervisor_start": start, "first_evaluation": first_eval, "first_batch": first_batch,
            "memory": by_role}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roots", nargs="+", default=[str(ROOT)], help="checkouts to run (run.py in each)")
    ap.add_argument("--config", default="configs/cartpole_dqn.json")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="each run's --time-limit")
    ap.add_argument("--memory-at", type=float, default=25.0, help="seconds after launch to read the memory")
    args = ap.parse_args()
    roots = [Path(r).resolve() for r in args.roots]
    results: dict[Path, list[dict]] = {r: [] for r in roots}
    for root in roots:  # unmeasured: a checkout's first run compiles numba's kernels into its cache
        one_run(root, args.config, args.workers, min(args.seconds, 10.0), min(args.memory_at, 5.0))
    for _ in range(args.repeats):
        for root in roots:  # interleaved, so that the machine's mood hits every checkout alike
            results[root].append(one_run(root, args.config, args.workers, args.seconds, args.memory_at))

    print(f"`python bench/startup.py --config {args.config} --workers {args.workers} --repeats {args.repeats}` "
          f"({time.strftime('%Y-%m-%d')}); seconds after the launch of run.py, each run's figure\n")  # fmt: skip
    print("| checkout | supervisor start | first evaluation | first batch (learner) |")
    print("|---|---|---|---|")
    for root, runs in results.items():
        cells = [", ".join(f"{r[key]:.1f}" for r in runs) for key in ("supervisor_start", "first_evaluation",
                                                                        "first_batch")]  # fmt: skip
        print(f"| {_describe(root)} | " + " | ".join(cells) + " |")
    print("\nWhat the forkserver loads, step by step in a fresh interpreter (this checkout's code, median of "
          "3)\n")  # fmt: skip
    print("| step | CPU s | resident MiB after it |")
    print("|---|---|---|")
    costs = [preload_costs(ROOT) for _ in range(3)]
    for i, (name, _, _) in enumerate(costs[0]):
        cpu = statistics.median(c[i][1] for c in costs)
        rss = statistics.median(c[i][2] for c in costs)
        print(f"| {name} | {cpu:.2f} | {rss:,.0f} |")
    print(f"\nMemory {args.memory_at:.0f} s after the launch, MiB: the range over the runs and over the processes "
          "of a role; the whole run's PSS: the median over the runs\n")  # fmt: skip
    print("| checkout | role | private (USS) | PSS |")
    print("|---|---|---|---|")
    for root, runs in results.items():
        for role in sorted(runs[0]["memory"]):
            uss = [u for r in runs for u, _ in r["memory"].get(role, [])]
            pss = [p for r in runs for _, p in r["memory"].get(role, [])]
            print(f"| {_describe(root)} | {role} | {_range(uss)} | {_range(pss)} |")
        totals = [sum(p for usages in r["memory"].values() for _, p in usages) for r in runs]
        print(f"| {_describe(root)} | whole run (PSS sum) | | {statistics.median(totals):,.0f} |")
    return 0


def _describe(root: Path) -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        rev = "?"
    return f"{root.name} ({rev})"


def _range(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


if __name__ == "__main__":
    sys.exit(main())
