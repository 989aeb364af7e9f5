"""Where a run's CPU goes: CPU seconds of each process of one ``run.py`` run, by role.

Runs ``python run.py ARGS...`` (with ``--run-dir`` set to a temporary directory unless
given), samples the CPU time of every process of its tree every 0.2 s (a process's last
0.2 s before it exits may be missed), and names each one from the run's
``processes.json`` (supervisor, learner, worker-N, evaluator, reanalyser); the rest are
the forkserver and multiprocessing's resource tracker.

Usage::

    python bench/cpu_by_process.py --config configs/cartpole_dqn.json --workers 2 --seed 5
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proctree  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    shown = " ".join(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if "--run-dir" in argv:
            run_dir = Path(argv[argv.index("--run-dir") + 1])
        else:
            run_dir = Path(tmp) / "run"
            argv = [*argv, "--run-dir", str(run_dir)]
        cmd = [sys.executable, "run.py", *argv]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seen: dict[int, float] = {}
        while proc.poll() is None:
            for pid, cpu in proctree.tree_cpu(proc.pid).items():
                seen[pid] = max(seen.get(pid, 0.0), cpu)
            time.sleep(0.2)
        wall = time.monotonic() - started
        if proc.returncode != 0:
            print(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr.read()[-3000:]}", file=sys.stderr)
            return 1
        roles = {pid: name for name, pid in json.loads((run_dir / "processes.json").read_text()).items()}
        roles.setdefault(proc.pid, "supervisor")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    last = records[-1]
    step = (last.get("learner") or {}).get("training_step", 0)
    print(f"`python bench/cpu_by_process.py {shown}`: {wall:.1f} s wall, {sum(seen.values()):.1f} CPU s, "
          f"{last['env_steps']:,} env steps, {step:,} training steps\n")  # fmt: skip
    print("| process | CPU s | share of the wall time |")
    print("|---|---|---|")
    for pid, cpu in sorted(seen.items(), key=lambda kv: -kv[1]):
        print(f"| {roles.get(pid, 'forkserver / resource tracker')} | {cpu:.1f} | {cpu / wall:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
