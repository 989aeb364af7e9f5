"""One run: what a run writes to its directory and when it stops, the same whether the
supervisor drives it (``--workers N``: the figures come from child processes) or the
in-process scheduler (``--workers 0``).

- At the start: ``config.json`` and ``processes.json`` (which pid plays which role);
  with Ray, ``ray_actors.json`` (where each self-play actor runs).
- ``metrics.jsonl``: one JSON record per line, ``event`` one of ``"progress"`` (every
  ``runtime.log_interval_s``), ``"evaluation"`` (each evaluation) and ``"end"``; every
  record has the same keys (:meth:`Run.record`). ``metrics.csv``: the same records in
  the fixed columns of ``runtime/logs.py``'s ``CSV_COLUMNS``. TensorBoard
  (``tensorboard/``, when its package is installed) and Weights & Biases (with
  ``runtime.wandb_project``) get the same numbers and the whole config; the evaluation's
  figures go to the CSV, TensorBoard and wandb once per evaluation, with its record.
- ``episodes.jsonl``: one line per self-play episode.
- ``buffer/``: the snapshot (:meth:`Run.snapshot`), ``best.pt``: the weights of the best
  evaluation so far (:class:`BestCheckpoint`).
- Stop rules (:meth:`Run.stop_reason`): ``runtime.time_limit_s``, ``training.env_steps``
  (the buffer's env-step counter), ``runtime.max_episodes``, ``runtime.solve_return``; the
  training-step budget is the learner's. With ``training.after_env_steps`` "train", the
  env-step budget ends self-play only (:func:`selfplay_over`) and the learner's budget ends
  the run. :meth:`Run.budgets` lists the ones with a (done, total) for the progress line's
  time left.
- ``final_evaluation.json`` (with ``runtime.final_evaluation_episodes``): the greedy
  episodes of the final weights, once the run ended on its own (:meth:`Run.final_evaluated`).
- Seeds (:class:`Seeds`): which stream each worker, restart and evaluation round uses.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from ..algos.registry import algorithm_of
from ..atomic import write_json_atomic
from ..checkpoint import load_checkpoint, save_network_checkpoint
from ..config import Config, config_to_dict
from ..replay.buffer import ReplayBuffer
from ..safe_files import open_append
from .logs import MetricsCsv, TensorBoardLog, WandbLog, open_tensorboard, open_wandb
from .offline import fill_buffer, write_record
from .progress import Budget, startup_line
from .setup import Seeds

__all__ = ["BestCheckpoint", "Run", "Seeds", "best_weights_text", "create_buffer", "end_text", "final_text",
           "selfplay_over", "solved_text", "start_buffer"]  # fmt: skip


def create_buffer(cfg: Config, spec, mp_context=None) -> ReplayBuffer:
    """A new replay buffer for the run: the algorithm's schema and ``cfg.replay``'s
    parameters. The algorithm's priority clip (DQN's ``priority_clip``) is the buffer's,
    so that the leaves of new episodes (whatever ``initial_priority`` gives them, "max"
    included) and of updated priorities obey the same clip."""
    algorithm = algorithm_of(cfg)
    schema = algorithm.run_schema(cfg, spec)
    r = cfg.replay
    return ReplayBuffer.create(schema, r.capacity, alpha=r.alpha, priority_eps=r.priority_eps,
                               priority_clip=algorithm.priority_clip(cfg), initial_priority=r.buffer_initial_priority,
                               mp_context=mp_context)  # fmt: skip


def start_buffer(setup, mp_context=None) -> ReplayBuffer:
    """The buffer a run starts with (``setup``: its :class:`~mpper.runtime.setup.RunSetup`):
    its snapshot when it resumes one; for an offline run a new buffer filled from its
    snapshots (:func:`mpper.runtime.offline.fill_buffer`), with ``offline.json`` written
    beside; else a new, empty one. A fill that fails closes (and unlinks) the buffer."""
    snapshot = setup.resume_snapshot
    if snapshot is not None:  # an older snapshot may lack the schema's optional fields: they get their fill
        spec = setup.spec
        schema = algorithm_of(setup.config).run_schema(setup.config, spec)
        optional = {name: schema[name] for name in getattr(schema, "optional", ())}
        return ReplayBuffer.load(snapshot, num_actions=spec.num_actions, mp_context=mp_context, add_fields=optional)
    buf = create_buffer(setup.config, setup.spec, mp_context)
    if setup.offline is not None:
        try:
            fill_buffer(buf, setup.offline)
            write_record(setup.run_dir.root, setup.offline)
        except BaseException:
            buf.close()
            raise
    return buf


class BestCheckpoint:
    """``run_dir/best.pt``: the weights with the best evaluation so far (the latest among
    equals). DQN often learns and then collapses; ``--evaluate --checkpoint best.pt``
    judges the best agent a run produced. A resumed run keeps its best."""

    def __init__(self, run_dir: str | Path | None) -> None:
        self.path = Path(run_dir) / "best.pt" if run_dir is not None else None
        self.best = self._stored()

    def _stored(self) -> float:
        if self.path is None or not os.path.lexists(self.path):
            return -np.inf
        try:  # a regular file of the run directory only (load_checkpoint): no link, FIFO or device
            return float(load_checkpoint(self.path)["extra"]["mean_return"])
        except Exception:  # unreadable: the next evaluation replaces it
            return -np.inf

    def offer(self, network: torch.nn.Module, training_step: int, evaluation: dict) -> bool:
        """Keep ``network`` if ``evaluation["mean_return"]`` is at least the best so far;
        whether it was kept."""
        mean = evaluation.get("mean_return")  # none when the evaluation stopped early
        if self.path is None or mean is None or mean < self.best:
            return False
        self.best = mean
        keys = ("mean_return", "returns", "against", "opponents")
        save_network_checkpoint(self.path, network, training_step, {k: evaluation[k] for k in keys if k in evaluation})
        return True


class Run:
    """The files of a run directory and its stop rules (see the module docstring).

    Driver protocol: :meth:`start` once; :meth:`record` with the latest figures whenever
    it has them (``event="progress"`` at most every ``runtime.log_interval_s`` through
    :meth:`progress_due`); :meth:`episode` per self-play episode; :meth:`stop_reason`
    each turn; :meth:`finish` once, last.
    """

    def __init__(self, config: Config, run_dir: Path, dataset_steps: int = 0) -> None:
        self.config = config
        self.dataset_steps = dataset_steps  # steps an offline run loaded from snapshots, before any self-play
        self.run_dir = Path(run_dir)
        self.seeds = Seeds(config.runtime.seed)
        self.started = time.monotonic()
        self.recent_returns: deque = deque(maxlen=100)
        self.games = 0  # self-play games ended (episode() calls)
        self.evaluation: dict = {}
        self.solving: dict | None = None  # the first evaluation at runtime.solve_return
        self._last_progress = self.started
        self._metrics: TextIO | None = None
        self._episodes: TextIO | None = None
        self._csv: MetricsCsv | None = None
        self._tensorboard: TensorBoardLog | None = None
        self._wandb: WandbLog | None = None
        self._metrics_lost = False  # a write failed (a full disk): said once

    # ---- files ------------------------------------------------------------------------
    def start(self) -> None:
        """Write ``config.json``; open ``metrics.jsonl``, ``metrics.csv``, ``episodes.jsonl``,
        TensorBoard (one line on stderr when its package is missing) and wandb (with
        ``runtime.wandb_project``; MissingExtraError when wandb is not installed)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = config_to_dict(self.config)
        write_json_atomic(self.run_dir / "config.json", config, indent=2)
        self._wandb = open_wandb(self.config.runtime.wandb_project, self.run_dir, config)
        # appended to, never through a link (ReceivedFileError): the directory may have been received
        self._metrics = open_append(self.run_dir / "metrics.jsonl")
        self._csv = MetricsCsv(self.run_dir / "metrics.csv")
        self._episodes = open_append(self.run_dir / "episodes.jsonl", line_buffered=True)
        self._tensorboard = open_tensorboard(self.run_dir / "tensorboard", config)

    def announce(self) -> None:
        """The start-up line on stderr: the run directory and, with TensorBoard on, the
        command to watch it (once the run is set up: a refusal before it stays one line)."""
        print(startup_line(self.run_dir, self._tensorboard is not None), file=sys.stderr, flush=True)

    def write_processes(self, pids: dict[str, int]) -> None:
        """``processes.json``: the supervisor's pid and each child's, by role."""
        write_json_atomic(self.run_dir / "processes.json", {"supervisor": os.getpid(), **pids})

    def write_ray_actors(self, placements: dict[str, dict]) -> None:
        """``ray_actors.json`` (with ``runtime.ray_address``): where each self-play actor
        runs, ``{worker: {"node_id", "node_ip", "pid", "nice", "restarts"}}``."""
        write_json_atomic(self.run_dir / "ray_actors.json", placements)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def progress_due(self) -> bool:
        """Whether a progress record is due (every ``runtime.log_interval_s``)."""
        now = time.monotonic()
        if now - self._last_progress < self.config.runtime.log_interval_s:
            return False
        self._last_progress = now
        return True

    def record(self, event: str, buffer: ReplayBuffer, learner: dict, reanalyse: dict, weights_version: int,
               worker_weights: dict[str, int]) -> None:  # fmt: skip
        """One ``metrics.jsonl`` record (and its numbers to TensorBoard): ``event``, wall
        time, the buffer's counters, and the latest figures of the learner, the
        evaluation (:meth:`evaluated`), the reanalyser and the weights each worker plays."""
        if self._metrics is None or self._metrics.closed:
            return
        c = buffer.counters
        record = {
            "event": event,
            "time_s": round(self.elapsed(), 3),
            "unix_time": round(time.time(), 3),  # to line the run up with other logs
            "env_steps": c["steps"],
            # where they came from: an offline run's snapshots, and self-play (an offline run: 0)
            "dataset_env_steps": self.dataset_steps,
            "selfplay_env_steps": c["steps"] - self.dataset_steps,
            "games": c["games"],
            "buffer_positions": len(buffer),
            "mean_selfplay_return": float(np.mean(self.recent_returns)) if self.recent_returns else None,
            "counters": c,
            "learner": learner,
            "evaluation": self.evaluation,
            "reanalyse": reanalyse,
            "weights_version": weights_version,
            "worker_weights_versions": worker_weights,
        }
        try:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
            if self._csv is not None:
                self._csv.write(record)
        except OSError as exc:  # a full disk: the run goes on; said once, not at every record
            if not self._metrics_lost:
                self._metrics_lost = True
                print(f"mpper: metrics not written to {self.run_dir} ({exc.strerror or exc}); the run goes on",
                      file=sys.stderr)  # fmt: skip
        if self._tensorboard is not None:
            self._tensorboard.write(record)
        if self._wandb is not None:
            self._wandb.write(record)

    def training_step(self, step: int, metrics: dict) -> None:
        """A lockstep run's record of one training step: ``{"event": "train_step",
        "training_step", ...its losses}`` in ``metrics.jsonl`` alone (no wall time: two runs
        of one lockstep config write the same lines)."""
        if self._metrics is None or self._metrics.closed:
            return
        try:
            self._metrics.write(json.dumps({"event": "train_step", "training_step": step, **metrics}) + "\n")
        except OSError:  # a full disk: said once by record()
            self._metrics_lost = True

    def evaluated(self, evaluation: dict) -> None:
        """The latest evaluation (``training_step``, ``mean_return``, ...), for the
        records and the solve rule. The first one at ``runtime.solve_return`` is kept for
        the solve rule: evaluations can arrive faster than :meth:`stop_reason` is asked
        (one that fails fast right after one that passed), and a later one must not hide it."""
        self.evaluation = evaluation
        solve = self.config.runtime.solve_return
        if self.solving is None and solve is not None and evaluation.get("mean_return", -np.inf) >= solve:
            self.solving = evaluation

    def episode(self, source: str, payload: dict, env_steps: int) -> None:
        """One self-play episode (``return``, ``length``, ``weights_version``, ...) of
        ``source`` (a worker's name): a line of ``episodes.jsonl``."""
        self.games += 1
        self.recent_returns.append(payload["return"])
        if self._episodes is None or self._episodes.closed:
            return
        line = {"time_s": round(self.elapsed(), 3), "worker": source, "env_steps": env_steps, **payload}
        try:
            self._episodes.write(json.dumps(line) + "\n")
        except OSError as exc:  # a full disk: as for the metrics
            if not self._metrics_lost:
                self._metrics_lost = True
                print(f"mpper: episodes.jsonl not written in {self.run_dir} ({exc.strerror or exc}); the run goes on",
                      file=sys.stderr)  # fmt: skip

    def final_evaluated(self, evaluation: dict) -> None:
        """The final evaluation (:meth:`~mpper.runtime.roles.Evaluation.final`): the latest
        evaluation of the records from now on, and ``final_evaluation.json``."""
        self.evaluation = evaluation
        write_json_atomic(self.run_dir / "final_evaluation.json", evaluation, indent=2)

    def snapshot(self, buffer: ReplayBuffer) -> None:
        """The buffer's snapshot at ``run_dir/buffer`` (atomic: the previous one stays
        whole until the new one is)."""
        t0 = time.monotonic()
        buffer.save(self.run_dir / "buffer", extra={"config": config_to_dict(self.config)})
        print(f"mpper: buffer snapshot written in {time.monotonic() - t0:.1f} s", file=sys.stderr)

    def finish(self) -> None:
        for f in (self._metrics, self._episodes, self._csv, self._tensorboard, self._wandb):
            if f is None:
                continue
            try:  # each one closed, whatever the one before did
                f.close()
            except Exception as exc:
                print(f"mpper: closing {type(f).__name__}: {type(exc).__name__}: {exc}", file=sys.stderr)

    # ---- stop rules -------------------------------------------------------------------
    def budgets(self, training_step: int, env_steps: int) -> list[Budget]:
        """The stops that count toward a total, for the progress line's time left: the
        training steps, ``training.env_steps`` (``env_steps``: the env steps stored so far)
        and the time limit (one :class:`~mpper.runtime.progress.Budget` per rule)."""
        budgets = [Budget("training steps", training_step, self.config.training.training_steps, "training_steps")]
        if self.config.training.env_steps is not None:
            budgets.append(Budget("env steps", env_steps, self.config.training.env_steps, "env_steps"))
        if self.config.runtime.time_limit_s is not None:
            budgets.append(Budget("time limit", self.elapsed(), self.config.runtime.time_limit_s, "seconds"))
        return budgets

    def stop_reason(self, env_steps: int) -> str | None:
        """Why the run should stop now (time limit, ``training.env_steps`` reached by
        ``env_steps``, the buffer's env-step counter, ``max_episodes`` self-play games
        ended (:meth:`episode` calls), an evaluation reached ``solve_return``), or None."""
        rt = self.config.runtime
        if rt.time_limit_s is not None and self.elapsed() >= rt.time_limit_s:
            return f"time limit of {rt.time_limit_s:g} s reached"
        budget = self.config.training.env_steps
        if budget is not None and env_steps >= budget and self.config.training.after_env_steps == "stop":
            return f"env-step budget reached: {env_steps} env steps stored (training.env_steps {budget})"
        if rt.max_episodes is not None and self.games >= rt.max_episodes:
            return f"{self.games} self-play episodes played (max_episodes)"
        if self.solving is not None:
            solve, ev = rt.solve_return, self.solving
            return f"solved: {solved_text(ev)} >= {solve:g} at training step {ev['training_step']}"
        return None


def selfplay_over(training, env_steps: int) -> bool:
    """Whether self-play has ended while the learner goes on: ``training.after_env_steps``
    is "train" and ``env_steps`` (stored so far) reached ``training.env_steps``. Every
    scheduler asks this before it plays; the rate limiter stops pacing the learner there."""
    budget = training.env_steps
    return training.after_env_steps == "train" and budget is not None and env_steps >= budget


def end_text(reason: str, run_dir: Path, final: dict | None = None) -> str:
    """The run's last line: why it stopped, its directory, its final evaluation (``final``,
    with ``runtime.final_evaluation_episodes``) and its best weights (``best.pt``, what
    ``--evaluate`` and ``mpper.load`` judge the run by) with the evaluation they scored."""
    result = f"{final_text(final)}; " if final is not None else ""
    return f"mpper: {reason}; run directory {run_dir}; {result}{best_weights_text(Path(run_dir) / 'best.pt')}"


def final_text(final: dict) -> str:
    """``final evaluation: mean greedy return 20.5 over 32 episodes (training step 100000,
    100004 env steps)``; for a two-player env, the mean score against its strongest opponent."""
    if "against" in final:
        what = f"mean score {final['mean_return']:+.2f} against {final['against']}"
    else:
        what = f"mean greedy return {final['mean_return']:g} over {final['episodes']} episodes"
    return f"final evaluation: {what} (training step {final['training_step']}, {final['env_steps']} env steps)"


def best_weights_text(path: Path) -> str:
    """``best.pt``'s path, the mean return it scored and its training step; or that the
    run has none (it stopped before a whole evaluation)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        extra, step = state["extra"], int(state["training_step"])
        mean = float(extra["mean_return"])
    except FileNotFoundError:
        return "no best.pt (no evaluation finished)"
    except Exception:  # unreadable: say so rather than fail the run's last line
        return f"best weights {path} (unreadable)"
    if "against" in extra:
        scored = f"mean score {mean:+.2f} against {extra['against']}"
    else:
        scored = f"mean greedy return {mean:g} over {len(extra.get('returns', ())) or '?'} episodes"
    return f"best weights {path} ({scored} at training step {step})"


def solved_text(evaluation: dict) -> str:
    """What reached ``runtime.solve_return``: the mean greedy return, or for a two-player
    env the mean score against the strongest opponent."""
    if "against" in evaluation:
        return f"mean score {evaluation['mean_return']:+.2f} against {evaluation['against']}"
    if "confirmation" in evaluation:
        return f"mean greedy return {evaluation['mean_return']:.1f} over {len(evaluation['returns'])} episodes"
    return f"mean greedy return {evaluation['mean_return']:.1f}"
