"""``--workers 0``: self-play, learning, reanalyse and evaluation take turns in one process.

For debugging (one stack, a debugger works, no spawn) and for runs that must be exactly
repeatable: with the same seed, the same episodes, batches and weights come out. The
pieces are the ones the processes use (``BatchedPlayer``, ``MuZeroTrainer``,
``Reanalyser``, the same buffer and weight store); only the scheduling differs:

    repeat: one move in each of K envs  ->  training steps while the samples-per-insert
            ratio allows (one per move without a ratio)  ->  publish weights every
            checkpoint_interval steps  ->  one reanalyse batch per new weight version
            ->  every evaluation_interval_s, a greedy evaluation
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .config import Config, config_to_dict
from .envs import make_env, run_env_spec
from .learner import (beta_schedule, load_checkpoint, make_targets, make_trainer, pick_device, save_checkpoint,
                      save_network_checkpoint)  # fmt: skip
from .networks import make_model
from .rate import can_sample
from .reanalyse import Reanalyser
from .replay_buffer import ReplayBuffer
from .runtime import create_buffer, solved_text, write_json_atomic
from .selfplay import best_checkpoint_extra, best_so_far, evaluate, make_player
from .procs import ForcedStop, StopRequests
from .weights import WeightStore

__all__ = ["train_inline"]


def train_inline(config: Config, run_dir: Path, resume: Path | None = None) -> int:
    """Train in this process only; returns the exit code (0 done, 130 Ctrl-C)."""
    cfg = config
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    write_json_atomic(run_dir / "processes.json", {"supervisor": os.getpid()})
    torch.manual_seed(cfg.runtime.seed)
    torch.set_num_threads(max(1, cfg.runtime.torch_threads))
    spec = run_env_spec(cfg)
    snapshot = run_dir / "buffer"
    with StopRequests() as signals:
        code, reason = _train(cfg, run_dir, resume, spec, snapshot, signals)
    print(f"mpper: {reason}; run directory {run_dir}")
    return code


def _train(cfg: Config, run_dir: Path, resume: Path | None, spec, snapshot: Path,
           signals: StopRequests) -> tuple[int, str]:  # fmt: skip
    """The run of :func:`train_inline`, under its signal handling; returns (exit code, reason)."""
    t = cfg.training
    buf = store = None
    code, reason = 0, ""
    try:
        if resume is not None and snapshot.exists():
            buf = ReplayBuffer.load(snapshot, num_actions=spec.num_actions)
        else:
            buf = create_buffer(cfg, spec)
        device = pick_device(cfg.runtime.device)
        network = make_model(cfg, spec.observation_shape, spec.num_actions)
        trainer = make_trainer(cfg, network.to(device), device)
        if resume is not None and (run_dir / "checkpoint.pt").exists():
            trainer.load_state_dict(load_checkpoint(run_dir / "checkpoint.pt"))
        acting = make_model(cfg, spec.observation_shape, spec.num_actions).eval()
        store = WeightStore.create(acting.num_flat_weights())

        def publish() -> None:
            flat = trainer.published_network.get_flat_weights()
            acting.set_flat_weights(flat)
            store.publish(flat, trainer.training_step)

        publish()
        seed = cfg.runtime.seed * 1_000_003
        player = make_player(cfg, [make_env(cfg.env) for _ in range(cfg.runtime.envs_per_worker)], acting,
                             explore=True, seed=seed)  # fmt: skip
        reanalyser = Reanalyser(cfg, buf, store) if cfg.runtime.reanalyse and cfg.algorithm == "muzero" else None
        targets = make_targets(cfg, spec.num_actions)
        rng = np.random.default_rng([cfg.runtime.seed, 0x1EA2])
        metrics_file = open(run_dir / "metrics.jsonl", "a")
        bar = tqdm(total=t.training_steps, desc="train (in-process)", unit="step", disable=not sys.stdout.isatty())
        started = last_eval = last_log = time.monotonic()
        evaluation: dict = {}
        best = best_so_far(run_dir)
        losses: dict = {}
        try:
            while trainer.training_step < t.training_steps:
                progress = trainer.training_step / t.training_steps
                for ep in player.step(progress):
                    arrays, priorities = player.stored(ep)
                    buf.add_episode(arrays, priorities, ep.terminated)
                while _may_train(buf, cfg) and trainer.training_step < t.training_steps:
                    batch = buf.sample(t.batch_size, beta_schedule(cfg, trainer.training_step), targets=targets, rng=rng)
                    losses, priorities = trainer.train_step(batch)
                    trainer.update_average()
                    buf.update_priorities(batch.indices, batch.generations, priorities)
                    if trainer.training_step % t.checkpoint_interval == 0:
                        publish()
                        if reanalyser is not None:
                            reanalyser.refresh_weights()
                            reanalyser.step()
                    if t.samples_per_insert is None:
                        break  # one step per move
                now = time.monotonic()
                if now - last_eval >= cfg.runtime.evaluation_interval_s:
                    last_eval = now
                    evaluation = _evaluate(cfg, acting, seed + 999_983, trainer.training_step)
                    if evaluation["mean_return"] >= best:  # as the evaluator process: keep the best weights
                        best = evaluation["mean_return"]
                        save_network_checkpoint(run_dir / "best.pt", acting, trainer.training_step,
                                                best_checkpoint_extra(evaluation))  # fmt: skip
                    solve = cfg.runtime.solve_return
                    if solve is not None and evaluation["mean_return"] >= solve:
                        reason = f"solved: {solved_text(evaluation)} >= {solve:g}"
                        break
                if now - last_log >= cfg.runtime.log_interval_s:
                    last_log = now
                    record = {"event": "progress", "time_s": round(now - started, 3), "unix_time": round(time.time(), 3),
                              "env_steps": buf.counters["steps"], "counters": buf.counters, "learner": losses,
                              "evaluation": evaluation}  # fmt: skip
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if cfg.runtime.max_episodes is not None and buf.counters["games"] >= cfg.runtime.max_episodes:
                    reason = f"{buf.counters['games']} self-play episodes played (max_episodes)"
                    break
                if cfg.runtime.time_limit_s is not None and now - started >= cfg.runtime.time_limit_s:
                    reason = f"time limit of {cfg.runtime.time_limit_s:g} s reached"
                    break
                bar.n = trainer.training_step
                bar.refresh()
            reason = reason or f"training finished ({t.training_steps} steps)"
        except KeyboardInterrupt:
            code, reason = 130, "interrupted (Ctrl-C)"
        except SystemExit as exc:  # SIGTERM (StopRequests)
            code, reason = 143, f"terminated (exit {exc.code})"
        finally:
            signals.begin_shutdown()  # further Ctrl-Cs are acknowledged; the next one forces
            try:
                bar.close()
                save_checkpoint(run_dir / "checkpoint.pt", trainer, extra={"config": config_to_dict(cfg)})
                buf.save(snapshot, extra={"config": config_to_dict(cfg)})
                metrics_file.write(json.dumps({"event": "end", "time_s": round(time.monotonic() - started, 3),
                                               "unix_time": round(time.time(), 3), "counters": buf.counters,
                                               "learner": losses, "evaluation": evaluation}) + "\n")  # fmt: skip
            except ForcedStop:
                code = code or 130
                reason = f"{reason}; quit at once (Ctrl-C): final checkpoint and snapshot may be missing"
            metrics_file.close()
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


def _evaluate(cfg: Config, network, seed: int, training_step: int) -> dict:
    """One evaluation as the evaluator process runs it (``mpper.selfplay.evaluate``:
    greedy episodes, or games against the opponents of a two-player env)."""
    return {"training_step": training_step, **evaluate(cfg, network, seed)}
