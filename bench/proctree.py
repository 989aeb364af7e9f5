"""Run a command and measure its whole process tree: wall seconds and CPU seconds.

mpper's children are forked by a forkserver, so ``RUSAGE_CHILDREN`` of the process
that launched ``run.py`` never sees them; the tree's CPU is sampled from ``/proc``
every 0.2 s instead (a process's last 0.2 s before it exits may be missed).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of ``root`` and all its descendants, by pid."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)  # ppid, utime + stime
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    return {pid: stats[pid][1] for pid in tree if pid in stats}


def run_measured(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float, float, float]:
    """Run ``cmd`` in ``cwd``; returns (result with its captured output, wall s, CPU s of
    the whole process tree, the ``time.time()`` at which it was launched)."""
    t0, launched = time.monotonic(), time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, float] = {}
    out_chunks = {}

    def drain(name, stream):
        out_chunks[name] = stream.read()

    threads = [threading.Thread(target=drain, args=(n, s)) for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for t in threads:
        t.start()
    while proc.poll() is None:
        for pid, cpu in tree_cpu(proc.pid).items():
            seen[pid] = max(seen.get(pid, 0.0), cpu)
        time.sleep(0.2)
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    result = subprocess.CompletedProcess(cmd, proc.returncode, out_chunks.get("out", ""), out_chunks.get("err", ""))
    return result, wall, sum(seen.values()), launched
