"""The supervisor: one run of mpper from start to clean stop.

The main process creates the shared replay buffer and weight store, spawns the
processes (N self-play workers, one learner, one reanalyser, one evaluator), watches
them, shows progress, writes ``metrics.jsonl`` and buffer snapshots, and stops
everything on success, on error and on Ctrl-C / SIGTERM:

    main ──creates──> ReplayBuffer (shm) + WeightStore (shm) + StopSignal + report queue
      ├─ run_selfplay  x N   play K envs with batched MCTS, add episodes
      ├─ run_inference       (runtime.selfplay_inference: "server") the workers' network, batched
      ├─ run_learner         sample, train, update priorities, publish weights, checkpoint
      ├─ run_reanalyser      refresh stored values with the latest weights
      └─ run_evaluator       greedy episodes with the latest weights -> mean return

With ``runtime.ray_address`` the N self-play workers are Ray actors instead
(``runtime/remote.py``), polled in the same loop; the rest is unchanged.

Children only attach to shared memory; the supervisor owns and unlinks it. Children
ignore SIGINT, so Ctrl-C reaches the supervisor alone, which sets the stop signal,
joins every child, writes the final snapshot and unlinks the segments; a Ctrl-C during
that is acknowledged, and only the one after it quits at once (``procs.StopRequests``). A child whose
supervisor was killed sees the stop signal set (its parent is gone) and exits.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import shm
from ..checkpoint import CheckpointError, load_checkpoint
from ..replay.buffer import ReplayBuffer
from .children import run_evaluator, run_learner, run_reanalyser, run_selfplay
from .inference import InferenceSlots, run_inference, serves_selfplay
from .procs import ForcedStop, StopRequests, StopSignal, forkserver_pid, process_context
from .progress import ProgressFigures, ProgressLine
from .rate import RateLimiter
from .roles import Evaluation, LatestWeights
from .run import Run, end_text, selfplay_over, start_buffer
from .setup import RunSetup
from .turns import train_in_turns
from .weights import WeightStore

__all__ = ["train", "Supervisor"]

_JOIN_TIMEOUT_S = 10.0
_LEARNER_JOIN_TIMEOUT_S = 60.0


def train(setup: RunSetup) -> int:
    """Run training as ``setup.config`` says; returns the process exit code."""
    if threading.current_thread() is threading.main_thread():
        # A shell starts background jobs with SIGINT ignored, and Python keeps it so;
        # `kill -INT` must still stop a run cleanly, as Ctrl-C does.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Segments of runs that were SIGKILLed (their owner could not unlink them); a live
    # run's segments are told apart by the lock their owner holds on each.
    removed = shm.remove_stale_segments()
    if removed:
        print(f"mpper: removed {len(removed)} shared-memory segment(s) left by dead runs", file=sys.stderr)
    rt = setup.config.runtime
    if rt.workers == 0 or rt.lockstep:
        return train_in_turns(setup)
    if rt.ray_address is None:
        return Supervisor(setup).run()
    from .remote import connect, disconnect  # the ray extra: imported only here

    connected = connect(rt.ray_address)  # ClusterError: before anything starts
    try:
        return Supervisor(setup).run()
    finally:
        if connected:
            disconnect()


@dataclass
class Child:
    """A spawned process and how to start it again."""

    name: str
    target: object  # the process main (``run_learner``, ``run_selfplay``, ...)
    kwargs: dict  # its keyword arguments (picklable: handles, config, signals, seed)
    process: Any = None  # its multiprocessing Process, once started
    restarts: int = 0
    essential: bool = False  # its death stops the run (the learner)
    last_error: str = ""  # the last line of the last traceback it reported
    stopped_by_force: str = ""  # how the shutdown stopped it, when it did not stop by itself


class Supervisor:
    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        self.config = config = setup.config
        self.run_dir = run_dir = setup.run_dir.root
        self.ctx = process_context()
        self.children: dict[str, Child] = {}
        self.buffer: ReplayBuffer | None = None
        self.store: WeightStore | None = None
        self.inference: InferenceSlots | None = None  # the workers' inference slots, when a server serves them
        self.run_files = Run(config, run_dir, setup.offline.steps if setup.offline is not None else 0)
        self.error: str | None = None
        self.finished_reason = ""
        # latest figures, for the progress line and metrics.jsonl
        self.learner: dict = {}
        self.reanalyse: dict = {}
        self.worker_weights: dict[str, int] = {}  # weight version each worker last played with
        self.signals = StopRequests()  # replaced by the live one in run()
        # The forkserver died: multiprocessing then reports every child as exited (code
        # 255), though they run on, orphaned. Their pids are watched directly instead.
        self.forkserver_lost = False
        self.remote: Any = None  # with runtime.ray_address: the self-play actors (remote.RaySelfPlay)
        self.snapshot_lost: str | None = None  # why the final snapshot was not written
        self.ended_on_its_own = False  # a budget, the time limit or a solve ended it (not an error or a signal)
        self.selfplay_ended = False  # training.after_env_steps "train": the env-step budget ended self-play
        self.final: dict | None = None  # the final evaluation (runtime.final_evaluation_episodes)

    @property
    def _buf(self) -> ReplayBuffer:
        """The shared buffer (made by ``_start``, before anything that reads it)."""
        assert self.buffer is not None
        return self.buffer

    @property
    def _store(self) -> WeightStore:
        assert self.store is not None
        return self.store

    # ---- lifecycle ------------------------------------------------------------------
    def run(self) -> int:
        code = 1
        with StopRequests() as self.signals:
            try:
                self._start()
                code = self._supervise()
                self.ended_on_its_own = code == 0
            except KeyboardInterrupt:  # raised at a loop turn (StopRequests.check), never mid-call
                self.finished_reason = "interrupted (Ctrl-C)"
                code = 130
            except SystemExit as exc:  # SIGTERM (mpper.runtime.procs.StopRequests)
                self.finished_reason = f"terminated (exit {exc.code})"
                code = 143
            except ForcedStop:  # all three Ctrl-Cs came before the loop's next turn
                self.finished_reason = "interrupted (Ctrl-C)"
                code = 130
            finally:
                self._shutdown()
        missing = self._missing_final_checkpoint()
        if missing:
            self.finished_reason = f"{self.finished_reason or 'stopped'}, but {missing}"
            code = code or 1  # a run that lost its final weights did not finish
        if self.snapshot_lost:
            self.finished_reason = f"{self.finished_reason or 'stopped'}, but the final {self.snapshot_lost}"
            code = code or 1  # nor did one whose buffer was not saved
        if self.signals.forced:
            code = code or 130
        if self.error:
            print(f"mpper: run stopped: {self.error}", file=sys.stderr)
        print(end_text(self.finished_reason or "stopped", self.run_dir, self.final))
        return code

    def _missing_final_checkpoint(self) -> str | None:
        """Why ``checkpoint.pt`` does not hold the learner's final weights, or None when
        it does (the learner writes them on its way out, and only then exits with 0)."""
        learner = self.children.get("learner")
        if learner is None or learner.process is None:
            return None
        code = learner.process.exitcode
        if learner.stopped_by_force:
            how = f"the learner {learner.stopped_by_force}"
        elif self.forkserver_lost:
            how = "the learner's exit status is unknown (its forkserver died)"
        elif code is not None and code < 0:
            how = f"the learner was {_describe_exit(code)}"
        else:  # 0: it wrote them on its way out; > 0: its own error, reported (it saves what it can first)
            return None
        return f"the final checkpoint is missing: {how}; {_checkpoint_held(self.setup.run_dir.checkpoint)}"

    def _start(self) -> None:
        setup, cfg = self.setup, self.config
        self.run_files.start()
        self.buffer = start_buffer(setup, self.ctx)  # resumed, filled from an offline run's snapshots, or new
        # The learner publishes the first weights (roles.Learner); everyone else waits for them.
        self.store = WeightStore.create(setup.make_network().num_flat_weights())
        self.stop = StopSignal(self.ctx)
        self.reports = self.ctx.Queue()
        self.rate = self._rate_limiter()
        if serves_selfplay(setup):
            self.inference = InferenceSlots.for_run(setup, self.ctx)
        self.run_files.announce()
        self._spawn_all()
        if cfg.runtime.ray_address is not None:
            from .remote import RaySelfPlay

            self.remote = RaySelfPlay(setup, self._buf, self._store)
            self.remote.start()

    def _rate_limiter(self):
        if self.config.training.paced_samples_per_insert is None:
            return None
        # Remote episodes are written by a process that cannot ring the learner's doorbell;
        # a learner waiting for them re-checks the counters every 10 ms rather than 100.
        poll_s = 0.1 if self.config.runtime.ray_address is None else 0.01
        return RateLimiter.from_config(self.config.training, self.ctx, poll_s)

    def _spawn_all(self) -> None:
        setup, cfg = self.setup, self.config
        shared = {"setup": setup, "stop": self.stop, "reports": self.reports}
        handles = {"buffer_handle": self._buf.handle, "weight_handle": self._store.handle}
        self._add(Child("learner", run_learner, {**shared, **handles, "rate": self.rate}, essential=True))
        served = {}
        if self.inference is not None:  # restarted like a worker when it dies; its workers wait for it
            served = {"inference_handle": self.inference.handle}
            self._add(Child("inference", run_inference, {**shared, "weight_handle": self._store.handle, **served}))
        # Ray actors play instead of local workers; an offline run plays not at all
        for i in range(cfg.runtime.workers if cfg.runtime.ray_address is None and setup.selfplay else 0):
            seed = self.run_files.seeds.worker(i)
            self._add(Child(f"worker-{i}", run_selfplay, {**shared, **handles, "worker_id": i, "seed": seed,
                                                          "rate": self.rate, **served}))  # fmt: skip
        if setup.algorithm.make_reanalyser is not None and setup.algorithm.reanalyses(cfg):
            self._add(Child("reanalyser", run_reanalyser, {**shared, **handles}))
        self._add(Child("evaluator", run_evaluator, {**shared, "weight_handle": self._store.handle}))

    def _add(self, child: Child) -> None:
        self.children[child.name] = child
        self._launch(child)

    def _launch(self, child: Child) -> None:
        process = self.ctx.Process(target=child.target, kwargs=child.kwargs, name=f"mpper-{child.name}", daemon=False)
        process.start()  # may raise (no forkserver, no memory...): then the child keeps no process to stop
        child.process = process
        # which pid plays which role, for people (and tests) looking at a live run
        self.run_files.write_processes({name: c.process.pid for name, c in self.children.items()
                                        if c.process is not None and c.process.pid is not None})

    # ---- supervision ----------------------------------------------------------------
    def _supervise(self) -> int:
        progress = ProgressLine()  # stderr: rewritten on a terminal, a plain line per log interval otherwise
        last_snapshot = time.monotonic()
        try:
            while True:
                self.signals.check()  # a Ctrl-C or SIGTERM stops the run here, between two turns
                self._drain_reports()
                if self.error:
                    return 1
                exit_code = self._check_children()
                if exit_code is None and self.remote is not None:
                    exit_code = self._check_remote()
                if exit_code is not None:
                    return exit_code
                now = time.monotonic()
                log = self.run_files.progress_due()
                progress.update(self._figures(), log=log)
                if log:
                    self._write_metrics()
                interval = self.config.replay.snapshot_interval_s
                if interval and now - last_snapshot >= interval:
                    last_snapshot = now
                    progress.clear()  # the snapshot's line goes below the progress line, not into it
                    try:
                        self.run_files.snapshot(self._buf)
                    except Exception as exc:  # disk full...: training goes on, the previous snapshot stays
                        print(f"mpper: {_snapshot_failed(self.setup.run_dir.buffer, exc)}", file=sys.stderr)
                if not self.selfplay_ended and selfplay_over(self.config.training, self._buf.counters["steps"]):
                    self._end_selfplay(progress)
                reason = self.run_files.stop_reason(self._buf.counters["steps"])
                if reason is not None:
                    self.finished_reason = reason
                    return 0
        finally:
            self._write_metrics()
            progress.finish(self._figures())

    def _end_selfplay(self, progress: ProgressLine) -> None:
        """The env-step budget reached with ``training.after_env_steps`` "train": the
        workers stop on their own (:func:`~mpper.runtime.run.selfplay_over`), Ray actors
        are stopped here, and the learner trains on."""
        self.selfplay_ended = True
        self._stop_remote(_JOIN_TIMEOUT_S)
        progress.clear()
        t = self.config.training
        print(f"mpper: self-play ended at {self._buf.counters['steps']} env steps (training.env_steps {t.env_steps}); "
              f"the learner trains on to {t.training_steps} steps", file=sys.stderr, flush=True)  # fmt: skip

    def _drain_reports(self) -> None:
        deadline = time.monotonic() + 0.2
        while True:
            try:
                kind, source, payload = self.reports.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if kind == "metrics":
                self.learner = payload
            elif kind == "episode":
                self._on_episode(source, payload)
            elif kind == "eval":
                self.run_files.evaluated(payload)
                self._write_metrics(event="evaluation")
            elif kind == "reanalyse":
                self.reanalyse = payload
            elif kind == "error":
                self._on_child_error(source, payload["traceback"])

    def _on_episode(self, source: str, payload: dict) -> None:
        self.worker_weights[source] = payload["weights_version"]
        self.run_files.episode(source, payload, self._buf.counters["steps"])

    def _check_remote(self) -> int | None:
        """The Ray self-play actors: their episode reports, and a dead actor restarted (up
        to the limit) as a dead local worker is."""
        from .remote import ClusterError

        try:
            events = self.remote.poll()
        except ClusterError as exc:  # the ingest actor died: no episode can reach the buffer
            self.error = str(exc)
            return 1
        for _, source, payload in events.reports:
            self._on_episode(source, payload)
        if events.placements is not None:
            self.run_files.write_ray_actors(events.placements)
        limit = self.config.runtime.max_worker_restarts
        for name, why, tb in events.failures:
            if tb:
                print(f"mpper: {name} failed:\n{tb}", file=sys.stderr)
            print(f"mpper: {name} {why}", file=sys.stderr)
            restarts = self.remote.workers[name].restarts
            if restarts >= limit:
                self.error = f"{name} ended {restarts + 1} times (max_worker_restarts={limit}); last: {why}"
                return 1
            print(f"mpper: restarting {name} ({restarts + 1}/{limit})", file=sys.stderr)
            self.remote.restart(name)
        return None

    def _on_child_error(self, name: str, tb: str) -> None:
        print(f"mpper: {name} failed:\n{tb}", file=sys.stderr)
        child = self.children.get(name)
        if child is not None:
            child.last_error = tb.strip().splitlines()[-1] if tb.strip() else ""
            if child.essential:
                self.error = f"{name} failed: {child.last_error}"

    def _check_children(self) -> int | None:
        """Restart dead workers (up to the limit); an exited learner ends the run, and so
        does the death of the forkserver (the children are then still running, but
        multiprocessing can no longer tell their state)."""
        for child in list(self.children.values()):
            proc = child.process
            if proc.is_alive():
                continue
            proc.join()
            code = proc.exitcode
            if self._forkserver_died():
                running = [f"{c.name} (pid {c.process.pid})" for c in self.children.values() if self._alive(c)]
                self.error = (f"the forkserver (pid {forkserver_pid()}) that starts and watches mpper's processes "
                              f"died; still running, now stopped: {', '.join(running) or 'none'}")  # fmt: skip
                return 1
            if child.essential:
                if code == 0:
                    self.finished_reason = f"training finished ({self.config.training.training_steps} steps)"
                    return 0
                self.error = self.error or f"{child.name} died ({_describe_exit(code)})"
                return 1
            if code == 0 and (self.stop.is_set() or selfplay_over(self.config.training, self._buf.counters["steps"])):
                continue  # stopped, or a worker whose self-play ended with the env-step budget
            print(f"mpper: {child.name} died ({_describe_exit(code)})", file=sys.stderr)
            if child.restarts >= self.config.runtime.max_worker_restarts:
                self._drain_reports()  # its last traceback may still be in the queue
                self.error = (f"{child.name} died {child.restarts + 1} times "
                              f"(max_worker_restarts={self.config.runtime.max_worker_restarts})")  # fmt: skip
                if child.last_error:
                    self.error += f"; last error: {child.last_error}"
                return 1
            child.last_error = ""
            child.restarts += 1
            if "worker_id" in child.kwargs:  # a fresh seed, so it does not replay the crash
                child.kwargs["seed"] = self.run_files.seeds.worker(child.kwargs["worker_id"], child.restarts)
            print(f"mpper: restarting {child.name} ({child.restarts}/{self.config.runtime.max_worker_restarts})",
                  file=sys.stderr)  # fmt: skip
            self._launch(child)
        return None

    def _figures(self) -> ProgressFigures:
        """The progress line's figures now."""
        c = self._buf.counters
        step = int(self.learner.get("training_step", 0))
        return ProgressFigures(
            elapsed_s=self.run_files.elapsed(), training_step=step, env_steps=c["steps"],
            buffer_fill=len(self._buf) / self._buf.capacity, evaluation=self.run_files.evaluation,
            loss=self.learner.get("total_loss"), learner_state=self.learner.get("state", ""),
            budgets=self.run_files.budgets(step, c["steps"]),
        )  # fmt: skip

    def _write_metrics(self, event: str = "progress") -> None:
        if self.buffer is None or self.store is None:
            return
        self.run_files.record(event, self.buffer, self.learner, self.reanalyse, self.store.version, self.worker_weights)

    def _forkserver_died(self) -> bool:
        """Whether the forkserver this run's children came from is gone (remembered)."""
        if not self.forkserver_lost and self.ctx.get_start_method() == "forkserver":
            pid = forkserver_pid()
            self.forkserver_lost = pid is not None and not shm.pid_alive(pid)
        return self.forkserver_lost

    def _alive(self, child: Child) -> bool:
        """Whether the child's process still runs (by its pid once the forkserver is gone)."""
        proc = child.process
        if not _started(child):
            return False
        if self.forkserver_lost:
            return shm.pid_alive(proc.pid)
        return proc.is_alive()

    def _wait_for(self, child: Child, timeout: float) -> None:
        if not self.forkserver_lost:
            child.process.join(timeout)
            return
        deadline = time.monotonic() + timeout
        while self._alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _force_stop(self, child: Child, sig: int) -> None:
        try:
            os.kill(child.process.pid, sig)
        except ProcessLookupError:
            pass

    # ---- stopping -------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Stop every child, join it, final snapshot, unlink shared memory. Runs on
        success, error, Ctrl-C and SIGTERM. Signal-safe from its first line: a signal
        raises nothing outside the ``obeying`` blocks of :meth:`_stop_cleanly`, further
        Ctrl-Cs are acknowledged, and the one that forces (``ForcedStop``) skips to
        killing the children and unlinking the segments, wherever it lands."""
        self.signals.begin_shutdown()
        try:
            if not self.signals.forced:
                self._stop_cleanly()
        except ForcedStop:
            pass
        if self.signals.forced:
            self._quit_at_once()
        self._release()

    def _stop_cleanly(self) -> None:
        """Children stopped in order (the learner writes its final checkpoint), their
        last reports read, the final snapshot and the "end" record written. The waits
        for the children and the snapshot's write are where the forcing Ctrl-C cuts in
        (``ForcedStop``); the rest takes moments."""
        if hasattr(self, "stop"):
            self.stop.set()
            if self.rate is not None:
                self.rate.notify()
        self._stop_remote(_JOIN_TIMEOUT_S)  # Ray's own calls: bounded, and not to be cut midway
        with self.signals.obeying():
            self._stop_children()
        if hasattr(self, "reports"):
            try:
                self._drain_reports()
            except Exception:
                pass
        if self.buffer is not None:
            try:
                with self.signals.obeying():
                    self.run_files.snapshot(self.buffer)
            except Exception as exc:  # disk full...: the previous snapshot stays whole
                self.snapshot_lost = _snapshot_failed(self.setup.run_dir.buffer, exc)
                print(f"mpper: final {self.snapshot_lost}", file=sys.stderr)
        self.signals.check()  # a forcing Ctrl-C that came between the two
        if self.ended_on_its_own and self.config.runtime.final_evaluation_episodes and self.store is not None:
            with self.signals.obeying():  # its own envs and a copy of the weights: a Ctrl-C may cut it
                self._final_evaluation()
        self._write_metrics(event="end")

    def _final_evaluation(self) -> None:
        """The final weights' greedy episodes, played here once every child has stopped."""
        weights = LatestWeights(self.setup, self._store)
        weights.refresh()
        steps = self._buf.counters["steps"]
        final = Evaluation(self.setup, self._store).final(weights.network, weights.training_step, steps)
        if final is not None:
            self.final = final
            self.run_files.final_evaluated(final)
            self._write_metrics(event="final_evaluation")

    def _quit_at_once(self) -> None:
        """After the Ctrl-C that forces: kill every child still running, write nothing."""
        self.finished_reason = (f"{self.finished_reason or 'stopped'}; quit at once (Ctrl-C): final checkpoint "
                                "and snapshot not written")  # fmt: skip
        if hasattr(self, "stop"):
            self.stop.set()
        self._stop_remote(0.0)
        for child in self.children.values():
            if self._alive(child):
                child.stopped_by_force = "was killed by the Ctrl-C that quits at once"
                self._force_stop(child, signal.SIGKILL)
                self._wait_for(child, 10.0)

    def _stop_children(self) -> None:
        """Once the stop signal is set: give each child its time to exit, then terminate
        (and kill) the ones still running."""
        self._forkserver_died()
        started = time.monotonic()
        for child in self.children.values():
            if _started(child):
                self._wait_for(child, max(0.1, started + self._join_limit(child) - time.monotonic()))
        for child in self.children.values():
            if self._alive(child):
                print(f"mpper: {child.name} did not stop in time; terminating it", file=sys.stderr)
                child.stopped_by_force = f"did not stop within {self._join_limit(child):g} s and was stopped by force"
                self._force_stop(child, signal.SIGTERM)
                self._wait_for(child, 3.0)
                if self._alive(child):
                    self._force_stop(child, signal.SIGKILL)
                    self._wait_for(child, 10.0)
        for child in self.children.values():
            if _started(child) and not self.forkserver_lost:
                child.process.join(0.1)  # collect the exit code

    def _stop_remote(self, timeout: float) -> None:
        """Stop the Ray actors (asked, then killed after ``timeout`` seconds); their last
        episodes are logged."""
        remote, self.remote = self.remote, None
        if remote is None:
            return
        try:
            for _, source, payload in remote.stop(timeout):
                self._on_episode(source, payload)
        except Exception as exc:  # the cluster is gone: nothing of it is left to stop
            print(f"mpper: stopping the Ray actors: {type(exc).__name__}: {exc}", file=sys.stderr)

    @staticmethod
    def _join_limit(child: Child) -> float:
        # The learner writes the final checkpoint on its way out: on a loaded machine that
        # can take longer than the others' plain exit.
        return _LEARNER_JOIN_TIMEOUT_S if child.essential else _JOIN_TIMEOUT_S

    def _release(self) -> None:
        """Close the files, unlink the shared memory, close the report queue (quick
        steps, each guarded so that the next still runs)."""
        try:
            self.run_files.finish()
        except Exception:
            pass
        for obj in (self.buffer, self.store, self.inference):
            if obj is not None:
                obj.close()
        if hasattr(self, "reports"):
            self.reports.close()
            self.reports.join_thread()


def _started(child: Child) -> bool:
    """Whether the child has a process that was started (one whose start raised, or that
    was never made, has nothing to wait for, join or kill)."""
    return child.process is not None and child.process.pid is not None


def _snapshot_failed(path: Path, exc: BaseException) -> str:
    """One line for a snapshot that could not be written (the save is atomic, so the
    previous snapshot at ``path``, if any, is still whole)."""
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    kept = "the previous snapshot there is unchanged" if path.exists() else "there is no earlier snapshot"
    return f"buffer snapshot not written to {path} ({' '.join(what.splitlines())}); {kept}"


def _checkpoint_held(path: Path) -> str:
    """What ``path`` holds now, for the message about a missing final checkpoint."""
    if not path.exists():
        return f"there is no {path.name}"
    try:
        step = int(load_checkpoint(path)["training_step"])
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return f"{path.name} does not load"
    return f"{path.name} holds the weights of training step {step}, an earlier checkpoint"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
