"""Runs whose roles take turns on one schedule: ``--workers 0``, and lockstep runs
(``runtime.lockstep``) at any worker count.

The roles are the ones the processes run (``runtime/roles.py``: self-play turns, learner
steps, evaluation rounds, the checkpoint), on the same buffer and weight store, and the
run writes what a run with processes writes (:class:`~mpper.runtime.run.Run`); only the
schedule differs. One round:

    self-play   every stream plays its moves with the weights of the round's start; the
                episodes that ended are stored in stream order
    learning    training steps while the samples-per-insert ratio allows them (without
                a ratio: one step per stream move); weights published every
                training.publish_interval steps, one reanalyse batch after each publication
    evaluation  free-running: every runtime.evaluation_interval_s;
                lockstep: every runtime.evaluation_interval_steps training steps;
                asked after every training step too, so that a turn of many steps
                passes none by, and a solving evaluation ends the turn there
    the run     records, checkpoint and snapshot when due; the stop rules

``--workers 0`` without lockstep plays one stream (``worker-0``, one move per round) in this
process. A **lockstep** run plays ``runtime.lockstep_streams`` streams of
``runtime.envs_per_worker`` envs, ``runtime.lockstep_moves`` moves each per round, each with
its own seed; with ``--workers N`` they are spread over N stream-host processes (stream
``s`` on host ``s mod N``), without, they are played here. Nothing the schedule does
depends on the machine's speed, so the seed decides the run: the same config gives the
same episodes in the same order, the same batches, losses and weights at any worker count
(the time limit excepted, which stops it wherever it is).
"""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..replay.buffer import ReplayBuffer
from .procs import ForcedStop, StopRequests, StopSignal, child_process, process_context, torch_configured
from .progress import ProgressFigures, ProgressLine
from .rate import RateLimiter
from .roles import BufferSink, Evaluation, LatestWeights, Learner, SelfPlay, StoredEpisode, selfplay_envs
from .run import Run, end_text, selfplay_over, start_buffer
from .setup import RunSetup
from .weights import WeightStore

__all__ = ["StreamHostLost", "play_streams", "run_stream_host", "stream_name", "train_in_turns"]

_HOST_JOIN_TIMEOUT_S = 10.0


def stream_name(setup: RunSetup, stream: int) -> str:
    """What a stream's episodes are logged as: ``worker-0`` in a free-running ``--workers 0``
    run (its one stream), ``stream-<s>`` in a lockstep run."""
    return f"stream-{stream}" if setup.config.runtime.lockstep else f"worker-{stream}"


def _streams(setup: RunSetup, ids: list[int], weights) -> list[SelfPlay]:
    config = setup.config
    k = config.runtime.envs_per_worker
    return [SelfPlay(setup, stream_name(setup, s), selfplay_envs(config, stream_name(setup, s), k), weights,
                     setup.seeds.worker(s), worker_id=s) for s in ids]  # fmt: skip


def play_streams(streams: list[SelfPlay], moves: int) -> list[list[StoredEpisode]]:
    """``moves`` self-play turns of each stream in order; the episodes each one ended."""
    played = []
    for selfplay in streams:
        ended: list[StoredEpisode] = []
        for _ in range(moves):
            selfplay.turn(ended.append)
        played.append(ended)
    return played


def run_stream_host(setup: RunSetup, host: int, stream_ids: list[int], weight_handle, commands, results, stop) -> None:
    """A lockstep run's stream-host process: for each ``moves`` read from ``commands``,
    play that many moves of each of its streams with the weights published now and put
    ``("played", name, {stream: [StoredEpisode, ...]})`` on ``results``; None ends it."""
    name = f"host-{host}"
    with child_process(name, setup.config, results, stop, weight_handle=weight_handle) as (_, store):
        weights = LatestWeights(setup, store)
        streams = _streams(setup, stream_ids, weights)
        while not stop.is_set():
            try:
                moves = commands.get(timeout=0.1)
            except queue.Empty:
                continue
            if moves is None:
                return
            played = play_streams(streams, moves)
            results.put(("played", name, dict(zip(stream_ids, played))))


class StreamHostLost(RuntimeError):
    """A lockstep run's stream host failed or died mid-round: the schedule cannot go on."""


class _StreamHosts:
    """The stream-host processes of a lockstep run with workers: started, asked to play
    a round, stopped."""

    def __init__(self, setup: RunSetup, store: WeightStore, stop: StopSignal, signals: StopRequests) -> None:
        streams = setup.config.runtime.lockstep_streams
        hosts = min(setup.config.runtime.workers, streams)
        self.signals = signals
        ctx = process_context()
        self.results = ctx.Queue()
        self.processes, self.commands = [], []
        for h in range(hosts):
            commands = ctx.Queue()
            ids = list(range(h, streams, hosts))
            process = ctx.Process(target=run_stream_host, name=f"mpper-host-{h}", daemon=False,
                                  kwargs={"setup": setup, "host": h, "stream_ids": ids,
                                          "weight_handle": store.handle, "commands": commands,
                                          "results": self.results, "stop": stop})  # fmt: skip
            process.start()
            self.processes.append(process)
            self.commands.append(commands)

    def pids(self) -> dict[str, int]:
        return {f"host-{h}": p.pid for h, p in enumerate(self.processes)}

    def play(self, moves: int) -> list[list[StoredEpisode]]:
        for commands in self.commands:
            commands.put(moves)
        played: dict[int, list] = {}
        waiting = len(self.processes)
        while waiting:
            self.signals.check()
            try:
                kind, name, payload = self.results.get(timeout=0.2)
            except queue.Empty:
                dead = [f"{p.name.removeprefix('mpper-')} ({_exit_text(p.exitcode)})"
                        for p in self.processes if not p.is_alive()]  # fmt: skip
                if dead:
                    raise StreamHostLost(f"lockstep stream host {', '.join(dead)} ended mid-round; a lockstep run "
                                       "cannot go on without it")  # fmt: skip
                continue
            if kind == "error":
                lines = payload["traceback"].strip().splitlines()
                print(f"mpper: {name} failed:\n{payload['traceback']}", file=sys.stderr)
                raise StreamHostLost(f"{name} failed: {lines[-1] if lines else 'error'}")
            played.update(payload)
            waiting -= 1
        return [played[s] for s in sorted(played)]

    def stop(self) -> None:
        for commands in self.commands:
            try:
                commands.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + _HOST_JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for q in (*self.commands, self.results):
            q.cancel_join_thread()
            q.close()


def _exit_text(code: int | None) -> str:
    return "still running" if code is None else f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


@dataclass
class _Schedule:
    """How many streams, moves per round, and when to evaluate."""

    streams: int
    moves: int
    lockstep: bool
    evaluation_interval_steps: int | None
    evaluation_interval_s: float

    @classmethod
    def of(cls, setup: RunSetup) -> _Schedule:
        rt = setup.config.runtime
        if rt.lockstep:
            return cls(rt.lockstep_streams, rt.lockstep_moves, True, rt.evaluation_interval_steps,
                       rt.evaluation_interval_s)  # fmt: skip
        return cls(1, 1, False, None, rt.evaluation_interval_s)


def train_in_turns(setup: RunSetup) -> int:
    """Train on the turns schedule (see the module docstring); returns the exit code (0
    done, 1 a failure, 130 Ctrl-C, 143 SIGTERM)."""
    config = setup.config
    run = Run(config, setup.run_dir.root, setup.offline.steps if setup.offline is not None else 0)
    run.start()
    run.write_processes({})
    try:
        with torch_configured(config.runtime.torch_threads), StopRequests() as signals:
            turns = _Turns(setup, run, signals)
            code, reason = turns.train()
    finally:
        run.finish()
    print(end_text(reason, setup.run_dir.root, turns.final))
    return code


class _Turns:
    def __init__(self, setup: RunSetup, run: Run, signals: StopRequests) -> None:
        self.setup, self.config, self.run, self.signals = setup, setup.config, run, signals
        self.schedule = _Schedule.of(setup)
        self.buf: ReplayBuffer | None = None
        self.store: WeightStore | None = None
        self.hosts: _StreamHosts | None = None
        self.stop: StopSignal | None = None
        self.final: dict | None = None  # the final evaluation (runtime.final_evaluation_episodes)

    def train(self) -> tuple[int, str]:
        code, reason = 0, ""
        try:
            code, reason = self._train()
        finally:
            if self.hosts is not None and self.stop is not None:
                self.stop.set()
                self.hosts.stop()
            for obj in (self.buf, self.store):
                if obj is not None:
                    obj.close()
        return code, reason

    def _train(self) -> tuple[int, str]:
        setup, cfg, run, t = self.setup, self.config, self.run, self.config.training
        self.buf = buf = start_buffer(setup)  # resumed, filled from an offline run's snapshots, or new
        self.store = store = WeightStore.create(setup.make_network().num_flat_weights())
        learner = Learner(setup, buf, store)
        run.announce()
        weights = LatestWeights(setup, store)
        play: Callable[[int], list[list[StoredEpisode]]]
        if not setup.selfplay:  # offline: the buffer holds all the data there is; the rounds only learn
            play = lambda moves: []  # noqa: E731
        elif self.schedule.lockstep and cfg.runtime.workers > 0:
            self.stop = StopSignal(process_context())
            self.hosts = _StreamHosts(setup, store, self.stop, self.signals)
            run.write_processes(self.hosts.pids())
            play = self.hosts.play
        else:
            streams = _streams(setup, list(range(self.schedule.streams)), weights)
            play = lambda moves: play_streams(streams, moves)  # noqa: E731
        reanalyser = None
        if setup.algorithm.make_reanalyser is not None and setup.algorithm.reanalyses(cfg):
            reanalyser = setup.algorithm.make_reanalyser(cfg, buf, store)
        rate = RateLimiter.from_config(t, None)
        sink = BufferSink(buf, None, None, lambda source, report: run.episode(source, report, buf.counters["steps"]))
        evaluation = Evaluation(setup, store)
        status = ProgressLine()  # stderr: rewritten on a terminal, a plain line per log interval otherwise
        # free-running: a first evaluation after the first round, as the evaluator process starts with one
        last_eval_time, last_eval_step = -float("inf"), learner.training_step
        last_checkpoint = time.monotonic()
        # the schedule's clock without its evaluations: each evaluation says how long the run trained for its weights
        started, evaluating_s = time.monotonic(), 0.0

        def figures() -> ProgressFigures:
            c = buf.counters
            return ProgressFigures(
                elapsed_s=run.elapsed(), training_step=learner.training_step, env_steps=c["steps"],
                buffer_fill=len(buf) / buf.capacity, evaluation=run.evaluation,
                loss=learner.metrics.get("total_loss"),
                learner_state="training" if learner.metrics else "waiting_for_data",
                budgets=run.budgets(learner.training_step, c["steps"]))  # fmt: skip

        def record(event: str) -> None:
            reanalysed = reanalyser.stats() if reanalyser is not None else {}
            learner_figures = {**learner.metrics, "training_step": learner.training_step,
                               "priority_updates_applied": learner.priorities_applied,
                               "priority_updates_dropped": learner.priorities_dropped}  # fmt: skip
            run.record(event, buf, learner_figures, reanalysed, store.version, {"self-play": weights.version})

        def evaluate_if_due() -> None:
            nonlocal last_eval_time, last_eval_step, evaluating_s
            if not self._evaluation_due(learner.training_step, last_eval_step, last_eval_time):
                return
            last_eval_time, last_eval_step = time.monotonic(), learner.training_step
            training_s = last_eval_time - started - evaluating_s
            weights.refresh()
            with self.signals.obeying():  # the longest call of a turn; its own envs, nothing shared
                result = evaluation.round(weights.network, weights.training_step, weights.version)
            if result is not None:  # None only when stopped first, which this round never is
                run.evaluated({**result, "training_s": round(training_s, 3)})
            record("evaluation")
            with self.signals.obeying():
                evaluation.film(weights.network, weights.training_step)
            evaluating_s += time.monotonic() - last_eval_time

        code, reason, playing = 0, "", True
        try:
            while not learner.done:
                self.signals.check()  # a Ctrl-C or SIGTERM stops the run here, never inside a buffer write
                # training.after_env_steps "train": past the env-step budget only the learner's turns remain
                if playing and selfplay_over(t, buf.counters["steps"]):
                    playing = False
                    status.clear()
                    print(f"mpper: self-play ended at {buf.counters['steps']} env steps (training.env_steps "
                          f"{t.env_steps}); the learner trains on to {t.training_steps} steps", file=sys.stderr)
                for ended in play(self.schedule.moves) if playing else ():
                    for episode in ended:
                        sink(episode)
                quota = self.schedule.streams * self.schedule.moves  # steps per round without a ratio
                while not learner.done and quota > 0:
                    c = buf.counters
                    if not rate.can_sample(c["steps"], c["samples"]):
                        break
                    learner.step(learner.sample())
                    if self.schedule.lockstep:
                        run.training_step(learner.training_step, learner.metrics)
                    if reanalyser is not None and learner.published_at == learner.training_step:
                        reanalyser.refresh_weights()
                        reanalyser.step()
                    if not rate.enabled or selfplay_over(t, c["steps"]):  # unpaced: a round's worth of steps
                        quota -= 1
                    # within the turn: one round's episodes may allow thousands of steps (64 envs
                    # ending 500-move games at once), which would otherwise pass evaluations by
                    evaluate_if_due()
                    if run.solving is not None:  # solved: no step past the evaluation that said so
                        break
                evaluate_if_due()
                if time.monotonic() - last_checkpoint >= cfg.runtime.checkpoint_interval_s:
                    last_checkpoint = time.monotonic()
                    self._write("checkpoint", learner.checkpoint, final=False)
                log = run.progress_due()
                if log:
                    record("progress")
                status.update(figures(), log=log)
                reason = run.stop_reason(buf.counters["steps"]) or ""
                if reason:
                    break
            reason = reason or f"training finished ({t.training_steps} steps)"
        except (KeyboardInterrupt, ForcedStop):  # ForcedStop: three Ctrl-Cs within one turn
            code, reason = 130, "interrupted (Ctrl-C)"
        except SystemExit as exc:  # SIGTERM (StopRequests)
            code, reason = 143, f"terminated (exit {exc.code})"
        except StreamHostLost as exc:
            print(f"mpper: run stopped: {exc}", file=sys.stderr)
            code, reason = 1, str(exc)
        finally:
            self.signals.begin_shutdown()  # further Ctrl-Cs are acknowledged; the next one forces
            status.finish(figures())
            try:
                with self.signals.obeying():  # atomic writes: cut midway, the previous files stay whole
                    learner.publish()
                    lost = [why for why in (self._write("checkpoint", learner.checkpoint),
                                            self._write("buffer snapshot", lambda: run.snapshot(buf))) if why]
                    if lost:
                        code, reason = code or 1, f"{reason}, but {'; '.join(lost)}"
                    if code == 0 and cfg.runtime.final_evaluation_episodes:  # the run ended on its own
                        weights.refresh()
                        final = evaluation.final(weights.network, weights.training_step, buf.counters["steps"])
                        if final is not None:
                            self.final = final
                            run.final_evaluated(final)
                            record("final_evaluation")
                record("end")
            except ForcedStop:
                pass
            if self.signals.forced:
                code = code or 130
                reason = f"{reason}; quit at once (Ctrl-C): final checkpoint and snapshot may be missing"
        return code, reason

    def _evaluation_due(self, step: int, last_step: int, last_time: float) -> bool:
        every = self.schedule.evaluation_interval_steps
        if every is not None:  # lockstep
            return step // every > last_step // every
        return time.monotonic() - last_time >= self.schedule.evaluation_interval_s

    def _write(self, what: str, write, final: bool = True) -> str | None:
        """Write the checkpoint or the snapshot; on a full disk, one line (the previous
        file stays whole) and, for the final one, why it is lost."""
        try:
            write()
        except OSError as exc:
            if final:
                why = f"the final {what} was not written ({exc.strerror or exc}); the previous one, if any, is unchanged"
            else:
                why = f"{what} not written ({exc.strerror or exc}); the previous one is unchanged; training goes on"
            print(f"mpper: {why}", file=sys.stderr)
            return why if final else None
        return None

