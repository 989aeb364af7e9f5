"""``--workers 0``: self-play, learning, reanalyse and evaluation take turns in one process.

For debugging (one stack, a debugger works, no spawn) and for runs that must be exactly
repeatable: with the same seed, the same episodes, batches and weights come out. The
pieces are the ones the processes use (the algorithm's player, trainer and reanalyser,
the same buffer and weight store) and the run writes what a run with processes writes
(:class:`~mpper.runtime.run.Run`: the same records, files, stop rules and seeds); only
the scheduling differs:

    repeat: one move in each of K envs  ->  training steps while the samples-per-insert
            ratio allows (one per move without a ratio)  ->  publish weights every
            publish_interval steps  ->  one reanalyse batch per new weight version
            ->  every evaluation_interval_s, a greedy evaluation
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..algos.registry import algorithm_of, run_env_spec
from ..checkpoint import load_checkpoint, save_checkpoint
from ..config import Config, config_to_dict
from ..envs import make_env
from ..replay.buffer import ReplayBuffer
from .evaluator import PeriodicVideo, evaluate, evaluation_bar
from .learner import beta_schedule, pick_device
from .procs import ForcedStop, StopRequests
from .progress import ProgressFigures, ProgressLine
from .rate import can_sample
from .run import BestCheckpoint, Run, create_buffer, end_text
from .weights import WeightStore

__all__ = ["train_inline"]

WORKER = "worker-0"  # the name its self-play episodes carry in episodes.jsonl


def train_inline(config: Config, run_dir: Path, resume: Path | None = None) -> int:
    """Train in this process only; returns the exit code (0 done, 130 Ctrl-C, 143 SIGTERM)."""
    run = Run(config, run_dir)
    run.start()
    run.write_processes({})
    torch.manual_seed(config.runtime.seed)
    torch.set_num_threads(max(1, config.runtime.torch_threads))
    try:
        spec = run_env_spec(config)
        with StopRequests() as signals:
            code, reason = _train(config, run, resume, spec, signals)
    finally:
        run.finish()
    print(end_text(reason, run_dir))
    return code


def _train(cfg: Config, run: Run, resume: Path | None, spec, signals: StopRequests) -> tuple[int, str]:
    """The run of :func:`train_inline`, under its signal handling; returns (exit code, reason)."""
    t = cfg.training
    run_dir, snapshot = run.run_dir, run.run_dir / "buffer"
    buf = store = None
    code, reason = 0, ""
    try:
        if resume is not None and snapshot.exists():
            buf = ReplayBuffer.load(snapshot, num_actions=spec.num_actions)
        else:
            buf = create_buffer(cfg, spec)
        device = pick_device(cfg.runtime.device)
        algorithm = algorithm_of(cfg)
        network = algorithm.make_network(cfg, spec.observation_shape, spec.num_actions)
        trainer = algorithm.make_trainer(cfg, network.to(device), device)
        if resume is not None and (run_dir / "checkpoint.pt").exists():
            trainer.load_state_dict(load_checkpoint(run_dir / "checkpoint.pt"))
        acting = algorithm.make_network(cfg, spec.observation_shape, spec.num_actions).eval()
        store = WeightStore.create(acting.num_flat_weights())

        def publish() -> None:
            flat = trainer.published_network.get_flat_weights()
            acting.set_flat_weights(flat)
            store.publish(flat, trainer.training_step)

        publish()
        run.announce()
        envs = [make_env(cfg.env) for _ in range(cfg.runtime.envs_per_worker)]
        player = algorithm.make_player(cfg, envs, acting, explore=True, seed=run.seeds.worker(0))
        reanalyse = algorithm.make_reanalyser is not None and algorithm.reanalyses(cfg)
        reanalyser = algorithm.make_reanalyser(cfg, buf, store) if reanalyse else None
        targets = algorithm.make_targets(cfg, spec.num_actions)
        rng = np.random.default_rng([cfg.runtime.seed, 0x1EA2])
        status = ProgressLine()  # stderr: rewritten on a terminal, a plain line per log interval otherwise
        last_eval, evaluations = time.monotonic(), 0
        best = BestCheckpoint(run_dir)
        video = PeriodicVideo(cfg, run_dir)
        losses: dict = {}

        def figures() -> ProgressFigures:
            c = buf.counters
            return ProgressFigures(
                elapsed_s=run.elapsed(), training_step=trainer.training_step, env_steps=c["steps"],
                buffer_fill=len(buf) / buf.capacity, evaluation=run.evaluation, loss=losses.get("total_loss"),
                learner_state="training" if losses else "waiting_for_data",
                budgets=run.budgets(trainer.training_step, c["steps"]))  # fmt: skip

        def record(event: str) -> None:
            reanalysed = reanalyser.stats() if reanalyser is not None else {}
            run.record(event, buf, {**losses, "training_step": trainer.training_step}, reanalysed, store.version,
                       {WORKER: store.version})  # fmt: skip

        try:
            while trainer.training_step < t.training_steps:
                signals.check()  # a Ctrl-C or SIGTERM stops the run here, never inside a buffer write
                progress = trainer.training_step / t.training_steps
                for ep in player.step(progress):
                    ended = time.monotonic()
                    arrays, priorities = player.stored(ep)
                    buf.add_episode(arrays, priorities, ep.terminated)
                    if not ep.ends_game:
                        continue
                    run.episode(WORKER, {"return": ep.game_return, "length": ep.game_moves,
                                         "weights_version": store.version, "insert_wait_s": 0.0,
                                         "store_latency_s": round(time.monotonic() - ended, 6)},
                                buf.counters["steps"])  # fmt: skip
                while _may_train(buf, cfg) and trainer.training_step < t.training_steps:
                    batch = buf.sample(t.batch_size, beta_schedule(cfg, trainer.training_step), targets=targets, rng=rng)
                    losses, priorities = trainer.train_step(batch)
                    trainer.update_average()
                    buf.update_priorities(batch.indices, batch.generations, priorities)
                    if trainer.training_step % t.publish_interval == 0:
                        publish()
                        if reanalyser is not None:
                            reanalyser.refresh_weights()
                            reanalyser.step()
                    if t.samples_per_insert is None:
                        break  # one step per move
                if time.monotonic() - last_eval >= cfg.runtime.evaluation_interval_s:
                    last_eval = time.monotonic()
                    must_reach = evaluation_bar(cfg, best.best)
                    with signals.obeying():  # the longest call of a turn; its own envs, nothing shared
                        evaluation = {"training_step": trainer.training_step,
                                      **evaluate(cfg, acting, run.seeds.evaluation(evaluations), must_reach=must_reach)}  # fmt: skip
                    best.offer(acting, trainer.training_step, evaluation)
                    run.evaluated({**evaluation, "best_mean_return": best.best, "weights_version": store.version})
                    record("evaluation")
                    with signals.obeying():
                        video.after_evaluation(acting, trainer.training_step, run.seeds.evaluation(evaluations))
                    evaluations += 1
                log = run.progress_due()
                if log:
                    record("progress")
                c = buf.counters
                status.update(figures(), log=log)
                reason = run.stop_reason(c["steps"]) or ""
                if reason:
                    break
            reason = reason or f"training finished ({t.training_steps} steps)"
        except (KeyboardInterrupt, ForcedStop):  # ForcedStop: three Ctrl-Cs within one turn
            code, reason = 130, "interrupted (Ctrl-C)"
        except SystemExit as exc:  # SIGTERM (StopRequests)
            code, reason = 143, f"terminated (exit {exc.code})"
        finally:
            signals.begin_shutdown()  # further Ctrl-Cs are acknowledged; the next one forces
            status.finish(figures())
            try:
                with signals.obeying():  # atomic writes: cut midway, the previous files stay whole
                    lost = []
                    for what, write in (("checkpoint", lambda: save_checkpoint(
                            run_dir / "checkpoint.pt", trainer, extra={"config": config_to_dict(cfg)})),
                            ("buffer snapshot", lambda: run.snapshot(buf))):  # fmt: skip
                        try:
                            write()
                        except OSError as exc:  # a full disk: the previous file stays whole
                            lost.append(f"the final {what} was not written ({exc.strerror or exc}); the previous "
                                        f"one, if any, is unchanged")  # fmt: skip
                            print(f"mpper: {lost[-1]}", file=sys.stderr)
                    if lost:
                        code, reason = code or 1, f"{reason}, but {'; '.join(lost)}"
                record("end")
            except ForcedStop:
                pass
            if signals.forced:
                code = code or 130
                reason = f"{reason}; quit at once (Ctrl-C): final checkpoint and snapshot may be missing"
    finally:
        for obj in (buf, store):
            if obj is not None:
                obj.close()
    return code, reason


def _may_train(buf: ReplayBuffer, cfg: Config) -> bool:
    """The learner's turn: enough data, and within the samples-per-insert ratio."""
    t, c = cfg.training, buf.counters
    return can_sample(c["steps"], c["samples"], t.samples_per_insert, t.samples_per_insert_tolerance,
                      t.min_buffer_steps, t.batch_size)  # fmt: skip
