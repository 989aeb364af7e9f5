"""Crafted snapshots against every public way to load one: 0 crashes, 0 hangs, 0 memory
over budget, 0 tracebacks, 0 broken snapshots accepted.

Three real snapshots come from three short real runs (``run.py --workers 0``: MuZero on
CartPole, DQN on CartPole, MuZero on TicTacToe, two players; capacity 256, the ring
wrapped). Each case copies one of them and applies one mutation of
``bench/snapshot_mutations.py`` that keeps every checksum valid (the files it edits are
re-hashed), so that what is tested is the loader's deeper checks. Each case is loaded,
in a child process forked from this preloaded interpreter, through:

- ``ReplayBuffer.load(mmap=True)`` (``mpper.load_snapshot``, notebooks);
- ``ReplayBuffer.load(mmap=False, num_actions=...)`` (what ``--resume`` loads);
- ``--inspect`` (``mpper.tools.inspect_snapshot.inspect_main``, its exit code and stderr);
- for one case in ``--on-snapshot-every``, ``--evaluate RUN --on-snapshot`` (its main, in
  a child of its own with the run's config.json and checkpoint.pt).

A load that succeeds is used: sampled (with the algorithm's targets when the schema is
the run's), summarised as ``--inspect`` does, and (the shared-memory one) given a new
episode and saved and loaded again; and it is judged by an oracle independent of the
loader (``snapshot_mutations.oracle``, on ``mpper.replay.consistency``).

Outcomes per load: ``refused`` (a SnapshotError of one line, or exit code 2 with one
``error:`` line), ``loaded`` (allowed only for a mutation that may keep the snapshot
valid, and when the oracle finds nothing), ``accepted`` (a violation loaded: a failure),
``crash`` (the child died of a signal or exited without its report), ``hang`` (a load
ran over ``--timeout`` seconds; the child is killed), ``memory`` (the child's peak RSS
over budget), ``traceback`` (any other exception, or a refusal of more than one line).

Memory budget, per load: how far the child's peak resident set rises during that load
(``VmHWM``, reset through ``/proc/self/clear_refs`` just before the load, minus
``VmRSS`` then; read right after the load; it counts the pages shared with this
interpreter as they are touched) must stay within the baseline, the largest such rise
of 3 children loading the unmutated snapshot the same way, plus 2x the mutated
snapshot's size on disk (allocated bytes: a sparse file counts what it holds, not what
it claims), plus ``--allowance-kib`` (default 1 MiB: another path through the
interpreter touches other pages of code and heap; the largest excess without the
allowance is reported). A case over budget is measured once more in a fresh child and
counts as ``memory`` only if it is over again: a load that allocates by what it reads is
over every time, while pages of this interpreter that the kernel reclaimed under memory
pressure (other processes on the machine) and a load faults back in are not. ``ReplayBuffer.load``'s peak is
read when it returns, before the buffer is used; ``--inspect``'s and
``--on-snapshot``'s cover the whole command.

Exit code 1 on any crash, hang, memory, traceback or accepted outcome. Usage::

    python bench/snapshot_fuzz.py --cases 10000 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from snapshot_mutations import MUTATIONS, Base, mutate, oracle  # noqa: E402

from mpper import ReplayBuffer, SnapshotError, shm  # noqa: E402
from mpper.algos.configs import load_run_config  # noqa: E402
from mpper.algos.registry import algorithm_of  # noqa: E402
from mpper.replay.episode_ring import ID, ROWS, START, STATE, TERMINATED, WRITE_POS  # noqa: E402
from mpper.replay.schema import normalize_schema  # noqa: E402
from mpper.tools.evaluate_snapshot import evaluate_snapshot_main  # noqa: E402
from mpper.tools.inspect_snapshot import inspect_main, snapshot_stats  # noqa: E402

RUNS = {  # base name -> (shipped config, extra --set)
    "muzero": ("cartpole", ["env.max_episode_steps=60"]),
    "dqn": ("cartpole_dqn", ["env.max_episode_steps=60"]),
    "tictactoe": ("tictactoe", []),
}
ENTRIES = ("mmap", "shm", "inspect")
OUTCOMES = ("refused", "loaded", "accepted", "crash", "hang", "memory", "traceback")
FAILURES = ("accepted", "crash", "hang", "memory", "traceback")


# ---- the real snapshots ---------------------------------------------------------------------------
def make_bases(work: Path) -> list[Base]:
    bases = []
    for name, (config, sets) in RUNS.items():
        run_dir = work / "runs" / name
        if not (run_dir / "buffer" / "manifest.json").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            cmd = [sys.executable, str(ROOT / "run.py"), "--config", config, "--workers", "0", "--run-dir", str(run_dir)]
            for s in ["replay.capacity=256", "training.min_buffer_steps=64", "training.batch_size=32",
                      "training.env_steps=400", "runtime.time_limit_s=120", *sets]:  # fmt: skip
                cmd += ["--set", s]
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        snap = run_dir / "buffer"
        manifest = json.loads((snap / "manifest.json").read_text())
        with ReplayBuffer.load(snap, mmap=True) as buf:
            table, ring = np.array(buf._episodes), np.array(buf._ring_state)
            head, nxt = int(ring[2]), int(ring[1])
            episodes = [tuple(int(v) for v in table[i % table.shape[0]][[ID, START, ROWS, STATE, TERMINATED]])
                        for i in range(head, nxt)]  # fmt: skip
            capacity = buf.capacity
        spec_actions = _num_actions(run_dir)
        bases.append(Base(name, snap, run_dir, spec_actions, capacity, manifest["schema"], episodes,
                          int(ring[WRITE_POS]), disk_bytes(snap)))  # fmt: skip
    return bases


def _num_actions(run_dir: Path) -> int:
    from mpper.envs import env_spec

    return env_spec(load_run_config(run_dir).env).num_actions


def disk_bytes(snap: Path) -> int:
    """Bytes the snapshot's regular files hold on disk (a sparse file: what is allocated)."""
    total = 0
    for p in snap.iterdir():
        st = os.lstat(p)
        if os.path.isfile(p) and not os.path.islink(p):
            total += min(st.st_size, st.st_blocks * 512)
    return total


# ---- what a child does ----------------------------------------------------------------------------
class Reporter:
    def __init__(self, fd: int):
        self.fd = fd

    def send(self, kind: str, **data) -> None:
        os.write(self.fd, (json.dumps({"kind": kind, **data}) + "\n").encode())


def _one_line(msg: str) -> bool:
    return bool(msg) and "\n" not in msg


def _use(buf, base: Base, mmap: bool, case_dir: Path) -> None:
    """What a user does with a loaded buffer: statistics, a sample with the run's targets,
    and (a live buffer) a new episode, a save and a load of that save."""
    snapshot_stats(buf)
    if len(buf) > 0:
        same_schema = tuple(buf.schema) == normalize_schema({f["name"]: (tuple(f["shape"]), f["dtype"],
                                                             float(f["fill"])) for f in base.fields})  # fmt: skip
        config = load_run_config(base.run_dir)
        targets = algorithm_of(config).make_targets(config, base.num_actions) if same_schema else None
        batch = buf.sample(16, 0.4, targets=targets, rng=np.random.default_rng(1))
        assert np.isfinite(batch.weights).all() and ((batch.indices >= 0) & (batch.indices < buf.capacity)).all()
    if not mmap:
        refs = buf.episodes()
        if refs:
            rows = buf.read_episode(refs[-1])
            buf.add_episode(rows, terminated=refs[-1].terminated)
        buf.save(case_dir / "again")
        ReplayBuffer.load(case_dir / "again", mmap=True, num_actions=base.num_actions).close()


def load_entry(snap: Path, base: Base, mmap: bool, case_dir: Path) -> dict:
    num_actions = None if mmap else base.num_actions
    reset_peak()
    try:
        buf = ReplayBuffer.load(snap, mmap=mmap, num_actions=num_actions)
    except SnapshotError as exc:
        msg = str(exc)
        return {"outcome": "refused" if _one_line(msg) else "traceback", "detail": msg[:300], "peak": peak_rss()}
    except Exception as exc:  # noqa: BLE001 - what the bench is looking for
        return {"outcome": "traceback", "detail": _exc_line(exc), "peak": peak_rss()}
    peak = peak_rss()  # the load's; what _use allocates (a numba kernel compiled for a new dtype) is not the load's
    with buf:
        problems = oracle(buf, num_actions)
        try:
            _use(buf, base, mmap, case_dir)
        except Exception as exc:  # noqa: BLE001
            return {"outcome": "traceback", "detail": "loaded, then in use: " + _exc_line(exc), "peak": peak}
    return {"outcome": "loaded", "problems": problems, "peak": peak}


def _exc_line(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}{where}"


def cli_entry(call, case_dir: Path, tag: str) -> dict:
    """Run a command-line main with stdout and stderr in files; its exit code and lines."""
    out, err = case_dir / f"{tag}.out", case_dir / f"{tag}.err"
    saved = os.dup(1), os.dup(2)
    reset_peak()
    with open(out, "w") as fo, open(err, "w") as fe:
        os.dup2(fo.fileno(), 1)
        os.dup2(fe.fileno(), 2)
        try:
            rc = call()
        except BaseException as exc:  # noqa: BLE001
            rc, detail = None, _exc_line(exc)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    peak = peak_rss()
    lines = [line for line in err.read_text(errors="replace").splitlines() if line.strip()]
    if rc is None:
        return {"outcome": "traceback", "detail": detail, "peak": peak}
    if rc == 2 and len(lines) == 1 and lines[0].startswith("error: "):
        return {"outcome": "refused", "detail": lines[0][:300], "peak": peak}
    if rc == 0:
        return {"outcome": "loaded", "problems": [], "detail": " | ".join(lines)[:300], "peak": peak}
    return {"outcome": "traceback", "detail": f"exit {rc}: " + " | ".join(lines)[-300:], "peak": peak}


def child_loads(report: Reporter, snap: Path, base: Base, case_dir: Path) -> None:
    for entry in ENTRIES:
        report.send("start", entry=entry)
        if entry == "inspect":
            result = cli_entry(lambda: inspect_main(str(snap), False), case_dir, "inspect")
        else:
            result = load_entry(snap, base, entry == "mmap", case_dir)
        report.send("result", entry=entry, **result)


def child_on_snapshot(report: Reporter, snap: Path, base: Base, case_dir: Path) -> None:
    import torch

    torch.set_num_threads(1)
    run = case_dir / "run"
    run.mkdir()
    for name in ("config.json", "checkpoint.pt"):
        shutil.copy(base.run_dir / name, run / name)
    report.send("start", entry="on-snapshot")
    result = cli_entry(lambda: evaluate_snapshot_main(str(run), str(snap), None), case_dir, "evaluate")
    if result["outcome"] == "loaded":  # the buffer it evaluated, judged as the others
        try:
            with ReplayBuffer.load(snap, mmap=True, verify=False, num_actions=base.num_actions) as buf:
                result["problems"] = oracle(buf, base.num_actions)
        except SnapshotError as exc:
            result["problems"] = [f"the loader refuses what --on-snapshot evaluated: {exc}"]
    report.send("result", entry="on-snapshot", **result)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


_start_rss = 0


def reset_peak() -> None:
    """The peak resident set starts again at what this process holds now (kept)."""
    global _start_rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    _start_rss = _status("VmRSS")


def peak_rss() -> int:
    """Bytes: how far this process's peak resident set (VmHWM) rose since ``reset_peak``."""
    return _status("VmHWM") - _start_rss


def fork_child(target, snap: Path, base: Base, case_dir: Path) -> tuple[int, int]:
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports on the pipe, never returns
        code = 0
        try:
            os.close(r)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            target(Reporter(w), snap, base, case_dir)
            Reporter(w).send("done")
        except BaseException as exc:  # noqa: BLE001 - a bug of the bench itself, reported as such
            try:
                Reporter(w).send("bench-error", detail=_exc_line(exc))
            finally:
                code = 3
        os._exit(code)
    os.close(w)
    os.set_blocking(r, False)
    return pid, r


# ---- the parent: cases, children, the table -------------------------------------------------------
class Running:
    def __init__(self, case: dict, pid: int, fd: int):
        self.case, self.pid, self.fd = case, pid, fd
        self.started = self.entry_started = time.monotonic()
        self.entry = None
        self.buffer = b""
        self.results: dict[str, dict] = {}
        self.killed = False
        self.bench_error = None


def read_reports(run: Running) -> None:
    try:
        while chunk := os.read(run.fd, 65536):
            run.buffer += chunk
    except BlockingIOError:
        pass
    *lines, run.buffer = run.buffer.split(b"\n")
    for line in lines:
        msg = json.loads(line)
        if msg["kind"] == "start":
            run.entry, run.entry_started = msg["entry"], time.monotonic()
        elif msg["kind"] == "result":
            run.results[msg["entry"]] = msg
            run.entry = None
        elif msg["kind"] == "bench-error":
            run.bench_error = msg["detail"]


def judge(run: Running, status: int, entries: tuple, timeout: float) -> dict[str, dict]:
    """Each entry's outcome (with detail and peak) from the child's reports and exit status:
    the first entry without a result is the one the child hung or died in; the entries
    after it did not run."""
    out = {}
    mmap = run.results.get("mmap", {})
    for entry in entries:
        if entry not in run.results:
            if run.killed:
                out[entry] = {"outcome": "hang", "detail": f"over {timeout:g} s"}
            elif run.bench_error:
                out[entry] = {"outcome": "bench-error", "detail": run.bench_error}
            else:
                how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
                out[entry] = {"outcome": "crash", "detail": how}
            break
        r = run.results[entry]
        outcome, detail = r["outcome"], r.get("detail", "")
        if outcome == "loaded":
            problems = list(r.get("problems") or [])
            if entry == "inspect":  # judged by what the same load in this child found
                if mmap.get("outcome") != "loaded":
                    problems.append("--inspect loaded what ReplayBuffer.load(mmap=True) refused")
                problems += mmap.get("problems") or []
            if run.case["expect"] == "refuse" or problems:
                outcome, detail = "accepted", "; ".join(problems) or f"{run.case['kind']} must be refused"
        budget = run.case["budgets"][entry]
        if outcome in ("refused", "loaded") and r["peak"] > budget:
            outcome, detail = "memory", f"RSS rose by {r['peak'] / 2**20:.2f} MiB, over the budget {budget / 2**20:.2f} MiB"
        out[entry] = {"outcome": outcome, "detail": detail, "peak": r["peak"]}
    return out


def remove_segments_of(pid: int) -> None:
    for name in shm.mpper_segments():
        if shm.owner_pid(name) == pid:
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
            except FileNotFoundError:
                pass


class Pool:
    """At most ``workers`` children at a time; each report lands in ``done``."""

    def __init__(self, workers: int, timeout: float):
        self.workers, self.timeout = workers, timeout
        self.running: dict[int, Running] = {}
        self.done: list[tuple[dict, dict]] = []  # (case, {entry: result})

    def submit(self, case: dict, target, base: Base) -> None:
        while len(self.running) >= self.workers:
            self.poll()
        pid, fd = fork_child(target, Path(case["snap"]), base, Path(case["dir"]))
        self.running[pid] = Running(case, pid, fd)

    def poll(self, wait: float = 0.02) -> None:
        fds = [r.fd for r in self.running.values()]
        if fds:
            select.select(fds, [], [], wait)
        now = time.monotonic()
        for run in list(self.running.values()):
            read_reports(run)
            if not run.killed and now - run.entry_started > self.timeout:
                os.kill(run.pid, signal.SIGKILL)
                run.killed = True
            pid, status, usage = os.wait4(run.pid, os.WNOHANG)
            if pid == 0:
                continue
            read_reports(run)
            os.close(run.fd)
            remove_segments_of(run.pid)
            del self.running[run.pid]
            self.done.append((run.case, judge(run, status, run.case["entries"], self.timeout)))

    def drain(self) -> None:
        while self.running:
            self.poll()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--start", type=int, default=0, help="the first case's number (a case is its number and --seed)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds one load may take (then: hang)")
    ap.add_argument("--on-snapshot-every", type=int, default=25, help="--on-snapshot for one case in N")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mpper_snapshot_fuzz"))
    ap.add_argument("--kinds", default="", help="comma-separated mutation kinds (default: all)")
    ap.add_argument("--allowance-kib", type=int, default=1024,
                    help="added to each memory budget: pages of code and heap that another path through the "
                         "interpreter touches, not data (the largest excess without it is reported)")  # fmt: skip
    args = ap.parse_args()
    allowance = args.allowance_kib << 10
    started = time.monotonic()
    work = args.dir
    work.mkdir(parents=True, exist_ok=True)
    cases_dir = work / "cases"
    shutil.rmtree(cases_dir, ignore_errors=True)
    cases_dir.mkdir()
    failures_dir = work / "failures"
    shutil.rmtree(failures_dir, ignore_errors=True)
    bases = make_bases(work)
    kinds = [k for k in args.kinds.split(",") if k] or list(MUTATIONS)

    # warm up here (numba compiles its kernels once, in this process, before any fork)
    for base in bases:
        with ReplayBuffer.load(base.snapshot, mmap=True) as buf:
            _use(buf, base, True, cases_dir)

    pool = Pool(args.workers, args.timeout)
    # baselines: the unmutated snapshot, 3 times per base and kind of child
    baseline = {}
    for base in bases:
        for target, tag in ((child_loads, "loads"), (child_on_snapshot, "on-snapshot")):
            for k in range(3):
                d = cases_dir / f"baseline-{base.name}-{tag}-{k}"
                d.mkdir()
                shutil.copytree(base.snapshot, d / "snapshot")
                entries = ENTRIES if tag == "loads" else ("on-snapshot",)
                case = {"i": -1, "kind": "unmutated", "expect": "any", "base": base.name, "dir": str(d),
                        "snap": str(d / "snapshot"), "entries": entries, "budgets": dict.fromkeys(entries, 1 << 62)}  # fmt: skip
                pool.submit(case, target, base)
    pool.drain()
    for case, results in pool.done:
        bad = {e: r for e, r in results.items() if r["outcome"] != "loaded"}
        if bad:
            print(f"the unmutated {case['base']} snapshot does not load cleanly: {bad}", file=sys.stderr)
            return 1
        for entry, r in results.items():
            baseline[case["base"], entry] = max(baseline.get((case["base"], entry), 0), r["peak"])
        shutil.rmtree(case["dir"], ignore_errors=True)
    pool.done.clear()
    print(f"baseline rise of the peak RSS (MiB) in each load of the unmutated snapshots (largest of 3); budget = baseline + 2x "
          f"the mutated snapshot's bytes on disk + {args.allowance_kib} KiB: " + ", ".join(
              f"{b} {e} {v / 2**20:.2f}" for (b, e), v in sorted(baseline.items())))  # fmt: skip
    print("base snapshots: " + ", ".join(f"{b.name} {b.disk_bytes / 1024:.0f} KiB ({len(b.episodes)} episodes, "
                                           f"capacity {b.capacity})" for b in bases))  # fmt: skip
    sys.stdout.flush()

    table = defaultdict(Counter)  # kind -> outcome counts (per load)
    cases_per_kind = Counter()
    entry_totals = defaultdict(Counter)
    examples = defaultdict(list)
    excess: dict = Counter(max=-(1 << 62))  # peak - (baseline + 2x size): the largest, and how many over 0
    worst = [""]  # where the largest was
    remeasured = []  # cases over the memory budget once, measured again
    kept = 0

    def collect():
        nonlocal kept
        done, pool.done = pool.done, []
        for case, results in done:
            if not case.get("retry") and any(r["outcome"] == "memory" for r in results.values()):
                # measured again in a fresh child: a load that allocates by its input is over again,
                # pages the kernel took back from this interpreter under memory pressure are not
                remeasured.append(case["i"])
                pool.submit({**case, "retry": True}, child_loads if "mmap" in case["entries"] else child_on_snapshot,
                            bases[case["base_index"]])  # fmt: skip
                continue
            cases_per_kind[case["kind"]] += "mmap" in case["entries"]
            failed = False
            for entry, r in results.items():
                if "peak" in r:
                    strict = r["peak"] - baseline[case["base"], entry] - case["disk"] * 2
                    if strict > excess["max"]:
                        excess["max"], worst[0] = strict, f"case {case['i']} ({case['kind']}, {case['base']}, {entry})"
                    excess["over strict"] += strict > 0
                table[case["kind"]][r["outcome"]] += 1
                entry_totals[entry][r["outcome"]] += 1
                if r["outcome"] not in ("refused", "loaded"):
                    failed = True
                    if len(examples[(case["kind"], r["outcome"])]) < 3:
                        examples[(case["kind"], r["outcome"])].append(
                            f"case {case['i']} ({case['base']}, {entry}): {r['detail']}")
            if failed and kept < 200:
                kept += 1
                failures_dir.mkdir(exist_ok=True)
                keep = failures_dir / Path(case["dir"]).name
                subprocess.run(["cp", "-a", "--sparse=always", case["dir"], str(keep)], check=False)
                (keep / "case.json").write_text(json.dumps({**case, "results": results}, indent=1))
            shutil.rmtree(case["dir"], ignore_errors=True)

    for i in range(args.start, args.start + args.cases):
        rng = np.random.default_rng([args.seed, i])
        base = bases[i % len(bases)]
        kind = kinds[(i // len(bases)) % len(kinds)]  # every kind on every base in turn
        d = cases_dir / f"case-{i}"
        d.mkdir()
        snap = d / "snapshot"
        shutil.copytree(base.snapshot, snap)
        try:
            kind, expect = mutate(kind, rng, snap, base)
        except Exception as exc:  # noqa: BLE001 - a bug of a mutation: reported, the run goes on
            table[kind]["bench-error"] += 1
            examples[(kind, "bench-error")].append(f"case {i}: mutation failed: {_exc_line(exc)}")
            shutil.rmtree(d, ignore_errors=True)
            continue
        size = disk_bytes(snap)
        case = {"i": i, "kind": kind, "expect": expect, "base": base.name, "base_index": i % len(bases), "dir": str(d),
                "snap": str(snap), "entries": ENTRIES, "disk": size,
                "budgets": {e: baseline[base.name, e] + 2 * size + allowance for e in ENTRIES}}  # fmt: skip
        pool.submit(case, child_loads, base)
        if args.on_snapshot_every and i % args.on_snapshot_every == 0:
            # the same mutation (the same seed) in a copy of its own, for --on-snapshot
            d2 = cases_dir / f"case-{i}-eval"
            d2.mkdir()
            shutil.copytree(base.snapshot, d2 / "snapshot")
            mutate(kind, np.random.default_rng([args.seed, i]), d2 / "snapshot", base)
            size = disk_bytes(d2 / "snapshot")
            case2 = {**case, "dir": str(d2), "snap": str(d2 / "snapshot"), "entries": ("on-snapshot",), "disk": size,
                     "budgets": {"on-snapshot": baseline[base.name, "on-snapshot"] + 2 * size + allowance}}  # fmt: skip
            pool.submit(case2, child_on_snapshot, base)
        if len(pool.done) > 50:
            collect()
        if i and i % 500 == 0:
            print(f"... {i} cases, {time.monotonic() - started:.0f} s", flush=True)
    while pool.running or pool.done:
        pool.drain()
        collect()
    excess["remeasured"] = len(remeasured)
    if remeasured:
        print(f"over the memory budget once and measured again in a fresh child: cases {remeasured}")
    elapsed = time.monotonic() - started
    excess["where"] = worst[0]
    return report(args, table, cases_per_kind, entry_totals, examples, excess, elapsed)


def report(args, table, cases_per_kind, entry_totals, examples, excess, elapsed) -> int:
    cols = list(OUTCOMES) + (["bench-error"] if any(t["bench-error"] for t in table.values()) else [])
    width = max(len(k) for k in table) + 2
    print(f"\n{'mutation':<{width}}{'cases':>7}{'loads':>7}" + "".join(f"{c:>11}" for c in cols))
    total = Counter()
    for kind in sorted(table):
        counts = table[kind]
        loads = sum(counts.values())
        total.update(counts)
        print(f"{kind:<{width}}{cases_per_kind[kind]:>7}{loads:>7}" + "".join(f"{counts[c]:>11}" for c in cols))
    print(f"{'total':<{width}}{sum(cases_per_kind.values()):>7}{sum(total.values()):>7}"
          + "".join(f"{total[c]:>11}" for c in cols))  # fmt: skip
    print("\nper entry: " + "; ".join(f"{e}: " + ", ".join(f"{c} {n}" for c, n in sorted(cnt.items()))
                                      for e, cnt in entry_totals.items()))  # fmt: skip
    for (kind, outcome), lines in sorted(examples.items()):
        for line in lines:
            print(f"  {outcome} [{kind}] {line}")
    failed = sum(total[c] for c in FAILURES) + total["bench-error"]
    print(f"\n{sum(cases_per_kind.values())} cases, {sum(total.values())} loads in {elapsed / 60:.1f} min "
          f"({args.workers} workers, timeout {args.timeout:g} s per load, --on-snapshot for 1 case in "
          f"{args.on_snapshot_every}); memory budget per load: the rise of the peak RSS in that load of the unmutated "
          f"snapshot + 2x the mutated snapshot's bytes on disk + {args.allowance_kib} KiB; without the allowance "
          f"{excess['over strict']} loads went over, by at most {excess['max'] / 1024:.0f} KiB ({excess['where']}); "
          f"{excess['remeasured']} cases over budget once were measured again; failures (accepted, "
          f"crash, hang, memory, traceback): {failed}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
