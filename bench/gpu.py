"""The whole GPU check in one command: the learner, self-play, how busy the GPU is, and a
Pong run with every process running; one table on stdout, ``gpu.json`` and ``gpu.md`` in
``--out`` (both rewritten after every row, so a run cut short keeps what it measured).

Sections, in this order by default (each row is skipped, with the reason, once
``--budget-s`` would be overrun by it):

1. tests: the CUDA tests under pytest (the captured step against the eager one, the
   reanalyser on CUDA, ...): their counts, and their output in ``cuda_tests.log``.
2. learner: training steps/s of the real learner process (``bench/learner.py``'s
   ``measure``) on a buffer filled by the config's own player, at ``--batch-size``, for
   each ``training.capture`` / ``training.precision`` on CUDA and for CartPole on the CPU;
   the one-off capture (or compile) time, timed in this process on one batch; the GPU's
   busy share while the row ran.
3. run: ``run.py --config configs/atari_pong.json --workers 12 --device cuda --time-limit T``;
   training steps/s, env steps/s, the learner's data-wait share (from the run's
   ``metrics.jsonl``) and the GPU's busy share.
4. selfplay: agent steps/s and simulations/s per config from ``bench/selfplay.py``
   (inference in each worker, or in one server process).
5. cartpole: ``bench/solve_cartpole.py`` with ``--device auto`` against ``--device cpu``.
6. compile: the learner rows with ``training.capture: "compile"`` (the largest one-off
   cost, so last).

A failed row keeps its traceback (or its stderr) in ``gpu.json``.

The GPU's busy share is the fraction of time a kernel was running, sampled about twice a
second (NVML through ``pynvml`` when installed, else ``nvidia-smi --query-gpu``).

Packages the machine lacks (gymnasium, ale-py, MinAtar): wheels in ``.whl/`` at the
repository's root are installed first into ``/tmp/site`` (``pip --no-index --no-deps
--target``), which goes on ``sys.path`` and on the subprocesses' ``PYTHONPATH``
(docs/gpu.md gives the download command).

Usage::

    python bench/gpu.py --out bench/results/gpu              # on the GPU machine, < 8 minutes
    python bench/gpu.py --quick --out /tmp/gpu-quick         # the CPU smoke test, about a minute
    python bench/gpu.py --sections learner --learner-configs atari_pong   # one section, one config
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/site")
CONFIGS = ROOT / "configs"


# ---- setup -----------------------------------------------------------------------------------


def install_wheels(wheels: Path = ROOT / ".whl", site: Path = SITE, unless_importable: str | None = "gymnasium") -> str:
    """Install ``wheels/*.whl`` into ``site`` and put it first on this process's path
    (``child_env`` puts it on the children's), unless ``unless_importable`` imports here
    already (a machine with its own packages keeps them); returns what was done, one line."""
    if unless_importable is not None and importlib.util.find_spec(unless_importable) is not None:
        return f"{unless_importable} is installed: no wheels installed"
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return f"no wheels in {wheels}"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                           str(site), *map(str, files)], capture_output=True, text=True)  # fmt: skip
    how = f"installed {len(files)} wheels from {wheels} into {site}"
    if proc.returncode != 0:
        # no pip (or it refused): a wheel is a zip of what goes on the path, so unpack it there
        reason = (proc.stderr.strip().splitlines() or [""])[-1]
        try:
            for file in files:
                with zipfile.ZipFile(file) as whl:
                    whl.extractall(site)
        except (OSError, zipfile.BadZipFile) as exc:
            return f"pip install of {len(files)} wheels failed ({reason}), and unpacking them too ({exc})"
        how = f"unpacked {len(files)} wheels from {wheels} into {site} (pip: {reason})"
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return how


def child_env(site: Path = SITE) -> dict:
    """The environment of a subprocess: this repository first on PYTHONPATH, then ``site``
    where :func:`install_wheels` put it on this process's path."""
    parts = [str(ROOT), *([str(site)] if str(site) in sys.path else []), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in parts if p)}


class GpuSampler:
    """The GPU's busy share (percent of time a kernel ran), sampled in a thread; ``mean(t0,
    t1)`` over a window of ``time.monotonic()``. ``source`` says how, or why there is none."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.samples: list[tuple[float, float]] = []  # (time.monotonic(), busy %)
        self.unix_times: list[float] = []  # time.time() of each sample (a run's metrics.jsonl clock)
        self.stop = threading.Event()
        self.interval_s = interval_s
        self.read = self._nvml() or self._nvidia_smi()
        self.thread: threading.Thread | None = None
        if self.read is not None:
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()

    def _nvml(self):
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            return None
        self.source = "NVML (pynvml)"
        return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    def _nvidia_smi(self):
        if shutil.which("nvidia-smi") is None:
            self.source = "none: neither pynvml nor nvidia-smi"
            return None

        def read() -> float:
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                  "--id=0"], capture_output=True, text=True, timeout=10).stdout  # fmt: skip
            return float(out.strip().splitlines()[0])

        try:
            read()
        except Exception as exc:
            self.source = f"none: nvidia-smi failed ({exc})"
            return None
        self.source = "nvidia-smi --query-gpu=utilization.gpu"
        return read

    def _loop(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                value = self.read()
                self.samples.append((time.monotonic(), value))
                self.unix_times.append(time.time())
            except Exception:  # a missed sample is only a missed sample
                pass

    def mean(self, t0: float, t1: float) -> float | None:
        values = [v for t, v in self.samples if t0 <= t <= t1]
        return round(statistics.fmean(values), 1) if values else None

    def mean_unix(self, t0: float, t1: float) -> float | None:
        """``mean`` over a window of ``time.time()``."""
        values = [v for (_, v), t in zip(list(self.samples), list(self.unix_times)) if t0 <= t <= t1]
        return round(statistics.fmean(values), 1) if values else None

    def close(self) -> None:
        self.stop.set()


@dataclasses.dataclass
class Report:
    """What the run measured so far, written to ``out`` after every row."""

    out: Path
    started: float
    budget_s: float
    data: dict = dataclasses.field(default_factory=dict)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def fits(self, estimate_s: float) -> bool:
        return self.elapsed() + estimate_s <= self.budget_s

    def add(self, section: str, row: dict) -> None:
        self.data.setdefault(section, []).append(row)
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        (self.out / "gpu.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "gpu.md").write_text(markdown(self.data))


def show(value, fmt: str = "{:,.1f}") -> str:
    if value is None:
        return "-"
    return fmt.format(value) if isinstance(value, int | float) else str(value)


def markdown(data: dict) -> str:
    """The results as Markdown tables (the docs/gpu.md layout)."""
    lines = [f"# GPU check: `python bench/gpu.py{data.get('args', '')}` ({data.get('date', '')})", ""]
    for key in ("device", "torch", "cpus", "wheels", "gpu_sampler"):
        lines.append(f"- {key}: {data.get(key, '-')}")
    lines += ["", "## Learner", "",
              "| config | batch | device | capture | precision | steps/s | samples/s | waiting for data | "
              "capture/compile s | GPU busy % | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data.get("learner", []):
        samples = r["steps_per_s"] * r["batch"] if r.get("steps_per_s") is not None else None
        wait = show(r.get("wait_fraction"), "{:.1%}")
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['device']} | {r['capture']} | {r['precision']} | "
            f"{show(r.get('steps_per_s'))} | {show(samples, '{:,.0f}')} | {wait} | "
            f"{show(r.get('capture_s'), '{:.2f}')} | {show(r.get('gpu_busy'))} | {r.get('note', '')} |"
        )
    lines += ["", "## Self-play", "", "| config | workers | inference | device | agent steps/s | simulations/s | "
              "GPU busy % | note |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data.get("selfplay", []):
        lines.append(
            f"| {r.get('config', '-')} | {r.get('workers', '-')} | {r.get('inference', '-')} | "
            f"{r.get('device', '-')} | {show(r.get('agent_steps_per_s'))} | "
            f"{show(r.get('simulations_per_s'))} | {show(r.get('gpu_busy'))} | {r.get('note', '')} |"
        )
    lines += ["", "## A run with every process", "", "| command | training steps/s | env steps/s | "
              "learner waiting for data | GPU busy % | note |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in data.get("run", []):
        lines.append(
            f"| `{r.get('command', '-')}` | {show(r.get('training_steps_per_s'))} | "
            f"{show(r.get('env_steps_per_s'))} | {show(r.get('wait_fraction'), '{:.1%}')} | "
            f"{show(r.get('gpu_busy'))} | {r.get('note', '')} |"
        )
    lines += ["", "## CUDA tests", "", "| command | result | s | note |", "|---|---|---|---|"]
    for r in data.get("tests", []):
        lines.append(f"| `{r.get('command', '-')}` | {r.get('summary', '-')} | {show(r.get('seconds'))} | "
                     f"{r.get('note', '')} |")  # fmt: skip
    lines += ["", "## CartPole by --device", "", "| command | solved | median wall s | note |", "|---|---|---|---|"]
    for r in data.get("cartpole", []):
        solved = f"{r['solved']}/{r['seeds']}" if "solved" in r else "-"
        lines.append(f"| `{r.get('command', '-')}` | {solved} | {show(r.get('median_wall_s'))} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


# ---- 1. the learner ----------------------------------------------------------------------------


def capture_seconds(config, buf) -> float | None:
    """The one-off cost of the captured (or compiled) step, timed here on one batch."""
    import numpy as np
    import torch

    from mpper.algos.registry import algorithm_of
    from mpper.envs import env_spec

    algorithm, spec = algorithm_of(config), env_spec(config.env)
    torch.manual_seed(0)
    trainer = algorithm.make_trainer(config, algorithm.make_network(config, spec.observation_shape, spec.num_actions),
                                     torch.device(config.runtime.device))  # fmt: skip
    targets = trainer.learner_targets(algorithm.make_targets(config, spec.num_actions))  # as the learner samples
    batch = buf.sample(config.training.batch_size, 1.0, targets, np.random.default_rng(0))
    trainer.train_step(batch)
    static = getattr(trainer, "static", None)
    seconds = None if static is None else static.capture_seconds
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds


def learner_rows(quick: bool, batch: int, cartpole_batch: int) -> list[tuple[str, int, str, str, str]]:
    """(config, batch, device, capture, precision), the most telling first."""
    if quick:
        return [
            ("cartpole", cartpole_batch, "cpu", "off", "fp32"),
            ("cartpole", cartpole_batch, "cpu", "static", "fp32"),
        ]
    rows = []
    for name in ("atari_pong", "minatar_breakout"):
        rows += [(name, batch, "cuda", "off", "fp32"), (name, batch, "cuda", "cuda_graph", "fp32"),
                 (name, batch, "cuda", "cuda_graph", "bf16")]  # fmt: skip
    # CartPole: what --device auto picks on a GPU machine against the CPU
    return rows + [
        ("cartpole", cartpole_batch, "cuda", "cuda_graph", "fp32"),
        ("cartpole", cartpole_batch, "cpu", "off", "fp32"),
    ]


def compile_rows(quick: bool, batch: int, cartpole_batch: int) -> list[tuple[str, int, str, str, str]]:
    """The torch.compile rows, last: their one-off cost is the largest."""
    if quick:
        return []
    return [("minatar_breakout", batch, "cuda", "compile", "fp32"), ("cartpole", cartpole_batch, "cuda", "compile", "fp32"),
            ("atari_pong", batch, "cuda", "compile", "fp32")]  # fmt: skip


def learner_section(report: Report, sampler: GpuSampler, args) -> None:
    learner_rows_section(report, sampler, args, learner_rows(args.quick, args.batch_size, args.cartpole_batch))


def compile_section(report: Report, sampler: GpuSampler, args) -> None:
    learner_rows_section(report, sampler, args, compile_rows(args.quick, args.batch_size, args.cartpole_batch))


def learner_rows_section(report: Report, sampler: GpuSampler, args, rows) -> None:
    rows = [row for row in rows if row[0] in args.learner_configs.split(",")]
    sys.path.insert(0, str(ROOT / "bench"))
    import learner as learner_bench  # bench/learner.py: the learner process and its buffers

    buffers: dict = {}
    try:
        for name, batch, device, capture, precision in rows:
            row = {"config": name, "batch": batch, "device": device, "capture": capture, "precision": precision}
            estimate = args.learner_seconds + (150 if capture == "compile" else 25)
            if not report.fits(estimate + (0 if name in buffers else 40)):
                report.add("learner", {**row, "note": f"skipped: the budget of {args.budget_s:g} s"})
                continue
            path = (CONFIGS / f"{name}.json").resolve()
            overrides = [f"training.capture={capture}", f"training.precision={precision}"]
            try:
                if name not in buffers:
                    fill_config = learner_bench.bench_config(path, ["runtime.torch_threads=4"], 1)
                    t0 = time.monotonic()
                    buffers[name] = learner_bench.filled_buffer(fill_config, path, args.fill_moves)
                    report.data.setdefault("fill_s", {})[name] = round(time.monotonic() - t0, 1)
                config = learner_bench.bench_config(path, overrides, batch, device)
                if capture != "off":
                    row["capture_s"] = capture_seconds(config, buffers[name])
                result = learner_bench.measure(config, buffers[name], args.learner_seconds)
                row.update(steps_per_s=result["steps_per_s"], wait_fraction=result["wait_fraction"],
                           gpu_busy=sampler.mean(*result["window"]) if device == "cuda" else None)  # fmt: skip
            except Exception as exc:  # one row's failure is its note (the traceback in gpu.json); the check goes on
                row["note"] = f"failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}"
                row["error"] = traceback.format_exc()[-6000:]
            report.add("learner", row)
            print(markdown_row({k: v for k, v in row.items() if k != "error"}), flush=True)
    finally:
        for buf in buffers.values():
            buf.close()


def markdown_row(row: dict) -> str:
    return " | ".join(f"{k}={show(v) if isinstance(v, float) else v}" for k, v in row.items())


# Self-play and the run store whole games, and a Pong game lasts minutes at the start of
# training: without a cap on training games, nothing is stored (or counted) for that long.
SHORT_GAMES = {"atari_pong": ["env.training_max_episode_steps=200"]}


# ---- 2. self-play ---------------------------------------------------------------------------------


def selfplay_section(report: Report, sampler: GpuSampler, args) -> None:
    script = ROOT / "bench" / "selfplay.py"
    if not script.is_file():
        report.add("selfplay", {"note": "not run: bench/selfplay.py is absent"})
        print("self-play: not run: bench/selfplay.py is absent", flush=True)
        return
    if args.quick:
        rows = [("cartpole", 1, "worker", "cpu"), ("cartpole", 1, "server", "cpu")]
    else:
        rows = [(name, args.workers, inference, "cuda") for name in ("atari_pong", "minatar_breakout")
                for inference in ("worker", "server")]  # fmt: skip
    for name, workers, inference, device in rows:
        row: dict = {"config": name, "workers": workers, "inference": inference, "device": device}
        if not report.fits(args.selfplay_seconds + 45):
            report.add("selfplay", {**row, "note": f"skipped: the budget of {args.budget_s:g} s"})
            continue
        out = report.out / f"selfplay_{name}_{inference}.json"
        sets = [arg for override in SHORT_GAMES.get(name, []) for arg in ("--set", override)]
        command = [sys.executable, str(script), "--config", str(CONFIGS / f"{name}.json"), "--workers", str(workers),
                   "--selfplay-inference", inference, "--device", device, "--seconds", f"{args.selfplay_seconds:g}",
                   "--json", str(out), *sets, *(["--warmup", "0"] if args.quick else [])]  # fmt: skip
        if sets:
            row["overrides"] = SHORT_GAMES[name]
        try:
            proc = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                                  timeout=args.selfplay_seconds + 180)  # fmt: skip
            if proc.returncode != 0:
                tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
                row["note"] = f"failed (exit {proc.returncode}): {tail[0]}"
                row["error"] = (proc.stderr or proc.stdout)[-6000:]
            else:
                result = json.loads(out.read_text())
                row.update(selfplay_figures(result))
                row["raw"] = result
                if device == "cuda":  # over the measured window, not the workers' start-up
                    row["gpu_busy"] = sampler.mean(*result["results"][0]["window"])
        except (subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
            row["note"] = f"failed: {type(exc).__name__}: {exc}"
        report.add("selfplay", row)
        print(markdown_row({k: v for k, v in row.items() if k not in ("raw", "error")}), flush=True)


def selfplay_figures(result: dict) -> dict:
    """Agent steps/s, simulations/s and rows per network call of the one row of
    bench/selfplay.py's JSON (``{"results": [{...}]}``)."""
    (row,) = result["results"]
    return {k: row[k] for k in ("agent_steps_per_s", "simulations_per_s", "rows_per_call")}


# ---- 3. a run with every process ---------------------------------------------------------------


def read_records(metrics_path: Path) -> list[dict]:
    """A run's ``metrics.jsonl`` records, without a last line cut by a stop or a kill."""
    records = []
    for line in metrics_path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def run_figures(metrics_path: Path) -> dict:
    """Training steps/s (once learning started), env steps/s (whole run) and the learner's
    mean data-wait share, from a run's ``metrics.jsonl``."""
    records = read_records(metrics_path)
    timed = [r for r in records if "time_s" in r]
    if len(timed) < 2:
        return {"note": f"{len(timed)} records in {metrics_path}"}
    figures: dict = {"records": len(timed)}
    span = timed[-1]["time_s"] - timed[0]["time_s"]
    if span > 0:
        figures["env_steps_per_s"] = (timed[-1].get("env_steps", 0) - timed[0].get("env_steps", 0)) / span
    learning = [r for r in timed if (r.get("learner") or {}).get("training_step", 0) > 0]
    if len(learning) >= 2 and learning[-1]["time_s"] > learning[0]["time_s"]:
        steps = learning[-1]["learner"]["training_step"] - learning[0]["learner"]["training_step"]
        figures["training_steps_per_s"] = steps / (learning[-1]["time_s"] - learning[0]["time_s"])
        if "unix_time" in learning[0]:
            figures["learning_window"] = (learning[0]["unix_time"], learning[-1]["unix_time"])
        waits = [r["learner"]["wait_fraction"] for r in learning if "wait_fraction" in r["learner"]]
        if waits:
            figures["wait_fraction"] = statistics.fmean(waits)
    return figures


QUICK_RUN_STEPS = 400  # --quick: the run's training steps, over several of the learner's reports (one a second)


def run_section(report: Report, sampler: GpuSampler, args) -> None:
    name, workers, device = ("cartpole", 1, "cpu") if args.quick else ("atari_pong", args.workers, "cuda")
    row: dict = {}
    if not report.fits(args.run_seconds + 30):
        report.add("run", {"note": f"skipped: the budget of {args.budget_s:g} s"})
        return
    run_dir = report.out / f"run_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    # --quick: a run bounded by its training steps, which ends whatever the machine's speed
    # (a few seconds of wall time may not reach the first training step on a loaded CPU)
    bound = ["--max-train-steps", str(QUICK_RUN_STEPS), "--time-limit", "200", "--set", "runtime.log_interval_s=0.2",
             "--set", "runtime.solve_return=null"] if args.quick else ["--time-limit", f"{args.run_seconds:g}"]  # fmt: skip
    shown = f"python run.py --config configs/{name}.json --workers {workers} --device {device} {' '.join(bound)}"
    sets = [arg for override in SHORT_GAMES.get(name, []) for arg in ("--set", override)]
    shown += "".join(f" --set {override}" for override in SHORT_GAMES.get(name, []))
    command = [sys.executable, "run.py", "--config", str(CONFIGS / f"{name}.json"), "--workers", str(workers),
               "--device", device, *bound, "--run-dir", str(run_dir), *sets]  # fmt: skip
    row["command"] = shown
    t0 = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                              timeout=args.run_seconds + 240)  # fmt: skip
        (report.out / f"run_{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            row["note"] = f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}"
        if (run_dir / "metrics.jsonl").is_file():
            row.update(run_figures(run_dir / "metrics.jsonl"))
    except (subprocess.TimeoutExpired, OSError) as exc:
        row["note"] = f"failed: {type(exc).__name__}: {exc}"
    window = row.pop("learning_window", None)
    if device == "cuda":  # while the learner trained, where it did; else the whole run
        row["gpu_busy"] = sampler.mean_unix(*window) if window else sampler.mean(t0, time.monotonic())
    report.add("run", row)
    print(markdown_row(row), flush=True)


# ---- 4. the CUDA tests, and CartPole by --device ------------------------------------------------

CUDA_TESTS = (  # every test that runs only where torch sees a CUDA device, or checks what "auto" picks there
    "tests/runtime/test_cuda_graph.py",
    "tests/runtime/test_cuda.py",
    "tests/algos/muzero/test_reanalyse.py::test_a_reanalyser_on_cuda_stores_what_one_on_the_cpu_does",
    "tests/runtime/test_env_steps.py::test_the_final_evaluation_searches_on_cuda_only_where_there_is_one_and_a_search",
    "tests/test_config.py::test_cuda_check_uses_torch",
)


def tests_section(report: Report, sampler: GpuSampler, args) -> None:
    """The CUDA tests under pytest: the counts from its last line, its output in ``cuda_tests.log``."""
    row: dict = {"command": "python -m pytest -q " + " ".join(CUDA_TESTS)}
    if not report.fits(args.tests_seconds):
        report.add("tests", {**row, "note": f"skipped: the budget of {args.budget_s:g} s"})
        return
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *CUDA_TESTS]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                              timeout=args.tests_seconds)  # fmt: skip
        output = proc.stdout + proc.stderr
        row.update(exit_code=proc.returncode, summary=(proc.stdout.strip().splitlines() or [""])[-1])
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        row["note"] = f"stopped at --tests-seconds {args.tests_seconds:g}"
    row["seconds"] = round(time.monotonic() - t0, 1)
    report.out.mkdir(parents=True, exist_ok=True)
    (report.out / "cuda_tests.log").write_text(output)
    report.add("tests", row)
    print(markdown_row(row), flush=True)


def cartpole_section(report: Report, sampler: GpuSampler, args) -> None:
    """``bench/solve_cartpole.py`` with ``--device auto`` (what a user gets on a GPU machine)
    against ``--device cpu``: seeds solved and the median wall time to the solve."""
    for device in ("auto", "cpu"):
        row: dict = {"device": device, "seeds": len(args.cartpole_seeds)}
        estimate = 30 * len(args.cartpole_seeds)
        if not report.fits(estimate):
            report.add("cartpole", {**row, "note": f"skipped: the budget of {args.budget_s:g} s"})
            continue
        tag = f"gpu_cartpole_{device}"
        command = [sys.executable, "bench/solve_cartpole.py", "--seeds", *map(str, args.cartpole_seeds), "--workers",
                   "8", "--device", device, "--time-limit", "90", "--verify-episodes", "0", "--tag", tag]  # fmt: skip
        row["command"] = "python " + " ".join(command[1:])
        try:
            proc = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                                  timeout=120 * len(args.cartpole_seeds))  # fmt: skip
            if proc.returncode != 0:
                row["note"] = f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}"
            results = json.loads((ROOT / "bench" / "results" / f"{tag}_solve.json").read_text())["results"]
            walls = [r["wall_s"] if r["solved"] else float("inf") for r in results]
            row.update(solved=sum(r["solved"] for r in results), median_wall_s=statistics.median(walls),
                       wall_s=walls)  # fmt: skip
        except (subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
            row["note"] = f"failed: {type(exc).__name__}: {exc}"
        report.add("cartpole", row)
        print(markdown_row(row), flush=True)


# ---- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu", help="where gpu.json and gpu.md go")
    ap.add_argument("--quick", action="store_true", help="the CPU smoke test: CartPole only, a few seconds each")
    ap.add_argument("--budget-s", type=float, default=450.0, help="rows that would end past this are skipped")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--cartpole-batch", type=int, default=256)
    ap.add_argument("--learner-seconds", type=float, default=5.0)
    ap.add_argument("--fill-moves", type=int, default=600, help="moves played into each image config's buffer")
    ap.add_argument("--workers", type=int, default=12, help="self-play workers (self-play section and the run)")
    ap.add_argument("--selfplay-seconds", type=float, default=8.0)
    ap.add_argument("--run-seconds", type=float, default=90.0, help="the run's --time-limit (--quick: 400 steps)")
    ap.add_argument("--tests-seconds", type=float, default=300.0, help="the CUDA tests' time limit")
    ap.add_argument("--cartpole-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--learner-configs", default="atari_pong,minatar_breakout,cartpole",
                    help="comma-separated: the configs of the learner and compile rows")  # fmt: skip
    ap.add_argument("--sections", default=None, help="comma-separated, in this order (default: all; --quick: "
                    "learner,run,selfplay)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.sections is None:
        args.sections = "learner,run,selfplay" if args.quick else "tests,learner,run,selfplay,cartpole,compile"
    if args.quick:
        args.learner_seconds, args.selfplay_seconds = min(args.learner_seconds, 0.5), min(args.selfplay_seconds, 1.0)
        args.run_seconds, args.cartpole_batch, args.workers = min(args.run_seconds, 6.0), 64, 1
    report = Report(args.out, time.monotonic(), args.budget_s)
    report.data.update(args=" " + " ".join(sys.argv[1:] if argv is None else argv), date=time.strftime("%Y-%m-%d"),
                       wheels=install_wheels(), cpus=os.cpu_count())  # fmt: skip
    import torch

    report.data["torch"] = torch.__version__
    report.data["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    if not args.quick and not torch.cuda.is_available():
        print("error: no CUDA device (torch.cuda.is_available() is false); --quick runs on the CPU", file=sys.stderr)
        return 2
    sampler = GpuSampler()
    report.data["gpu_sampler"] = sampler.source
    report.save()
    sections = {
        "learner": learner_section,
        "run": run_section,
        "selfplay": selfplay_section,
        "compile": compile_section,
        "tests": tests_section,
        "cartpole": cartpole_section,
    }
    try:
        for name in args.sections.split(","):
            if name not in sections:
                print(f"error: --sections: unknown section {name!r} ({', '.join(sections)})", file=sys.stderr)
                return 2
            print(f"# {name} ({report.elapsed():.0f} s in)", flush=True)
            sections[name](report, sampler, args)
    finally:
        sampler.close()
        report.save()
    print()
    print(markdown(report.data))
    print(f"written: {args.out / 'gpu.json'}, {args.out / 'gpu.md'} ({report.elapsed():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
