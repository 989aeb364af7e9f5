"""One run from a config to its end, as the command line and the Python API start it.

:func:`launch` is the one path: read and check the config (a file, a shipped config's
name or a dict), check the run directory, boot the forkserver, check the env and the
sizes against this machine, check what ``resume`` will load, claim the run directory
(:mod:`mpper.runtime.rundir`) and only then import the runtime and train. Every refusal
is an exception whose message is one line: :class:`~mpper.config.ConfigError` for the
config, :class:`LaunchError` for everything else found before any child process starts.
``python run.py`` prints it as ``error: ...`` (exit code 2); ``mpper.train`` raises it.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .algos.configs import config_from_dict, load_config
from .config import MAX_SEED, Config, flag_overrides
from .config_files import config_name_path, is_bare_name, shipped_configs

__all__ = ["LaunchError", "default_run_dir", "launch", "resolve_config", "shipped_configs"]


class LaunchError(ValueError):
    """A run that may not or cannot start (its run directory, this machine, what it would
    resume), said in one line; nothing was started."""


def resolve_config(name: str) -> Path:
    """``--config``: the name of a shipped config (``cartpole`` is ``mpper/configs/cartpole.json``,
    which works after ``pip install`` outside a clone), or a path to a JSON file (``./cartpole``,
    ``cartpole.json``, anything with a slash). A bare name is always the shipped config, even
    when a file of that name exists here (a file someone left in a directory never runs as a
    shipped name); a line on stderr says so when both exist. ConfigError, naming the shipped
    configs, for a bare name mpper does not ship."""
    path = config_name_path(name)
    if is_bare_name(name) and Path(name).exists():
        print(f"mpper: --config {name}: the shipped config {name!r}, not the file ./{name} in this directory; "
              f"to use that file, name it as a path: --config ./{name}", file=sys.stderr)  # fmt: skip
    return path


def default_run_dir(config_path: str | Path, now: _dt.datetime | None = None, root: str | Path = "runs") -> Path:
    """``runs/<config-name>/<timestamp>/``, with a ``-2``, ``-3``... suffix if it exists."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / Path(config_path).stem / stamp
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{stamp}-{n}")
    return run_dir


def launch(config: str | Path | Mapping[str, Any] | None, overrides: Iterable[str] = (), *,
           run_dir: str | Path | None = None, resume: str | Path | None = None, workers: int | None = None,
           device: str | None = None, seed: int | None = None, training_steps: int | None = None,
           env_steps: int | None = None, time_limit_s: float | None = None, ray_address: str | None = None,
           check: Callable[[Config], None] | None = None,
           offline: Sequence[str | Path] | None = None) -> tuple[int, Path]:  # fmt: skip
    """Check everything, claim the run directory, train; returns ``(exit code, run dir)``.

    ``config``: a JSON file, a shipped config's name, or a dict of the file's content
    (None with ``resume``: ``RUN_DIR/config.json``). ``overrides``: ``--set`` strings
    (``"training.batch_size=64"``). The keyword arguments are the command line's flags
    (``--workers`` ... ``--ray``; None: the config's value). ``run_dir`` defaults to
    ``RUN_DIR`` with ``resume``, else ``runs/<config-name>/<timestamp>/``. ``check(config)``
    runs on the checked config before anything else is checked or started (it raises
    LaunchError to refuse). ``offline``: snapshot directories to learn from with no
    self-play (``--offline``; :func:`_offline_config`). Raises ConfigError or LaunchError
    (one line) for a run that cannot start; exceptions of the run itself propagate.
    """
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise LaunchError(f"--seed: expected an integer in [0, {MAX_SEED}], got {seed}")
    resume = None if resume is None else Path(resume)
    if resume is not None and not resume.is_dir():
        raise LaunchError(f"--resume {resume}: no such run directory")
    flags: dict[str, Any] = {"workers": workers, "device": device, "seed": seed, "training_steps": training_steps,
                             "env_steps": env_steps, "time_limit_s": time_limit_s,
                             "ray_address": ray_address}  # fmt: skip
    if isinstance(config, Mapping):
        config_path = "config"  # names the default run directory runs/config/<timestamp>/
        checked = config_from_dict(dict(config), "the config dict", overrides, flags=flag_overrides(**flags))
    elif config is not None:
        config_path = str(resolve_config(str(config)))
        checked = load_config(config_path, overrides, **flags)
    elif resume is not None:
        config_path = str(resume / "config.json")
        # a run directory's config.json may come from someone else: it names no code to run
        checked = load_config(config_path, overrides, env_factory_from_file=False, **flags)
        if _received_ray_address(checked, ray_address, overrides):
            address = checked.runtime.ray_address
            raise LaunchError(f"--resume {resume}: its config.json sets runtime.ray_address {json.dumps(address)}; "
                              f"mpper connects to no address a run directory names: repeat it with --ray {address} "
                              f"to use it, or --set runtime.ray_address=null to run the workers here")  # fmt: skip
    else:
        raise LaunchError("--config PATH is required (or --resume RUN_DIR); see --help")
    data = None
    if offline is not None:
        if resume is not None:
            raise LaunchError("--offline starts a new run from snapshots; it does not --resume one")
        checked, data = _offline_config(checked, offline, overrides, flags, config, config_path)
    if check is not None:
        check(checked)
    _check_extras(checked)
    _check_lockstep(checked)

    from .runtime.rundir import RunDirError, check_run_dir

    if run_dir is not None:
        where, flag = Path(run_dir), "--run-dir"
    elif resume is not None:
        where, flag = resume, "--resume"
    else:
        where, flag = default_run_dir(config_path), "run directory"
    try:  # a live run there, a finished run (without --resume), a file, no write access
        check_run_dir(where, flag, resume is not None)
    except RunDirError as e:
        raise LaunchError(str(e)) from None

    stop_server = None
    if checked.runtime.workers > 0:
        # Children will be forked from a server: boot it now, so that its imports run beside
        # ours (torch, from the checks below on). A check below that refuses the run stops
        # it at once: it has started no child, and would otherwise finish its imports first.
        from .runtime.procs import start_process_server, stop_process_server

        start_process_server()
        stop_server = stop_process_server
    try:
        code = _checked_train(checked, where, flag, resume, data)
    except LaunchError:
        if stop_server is not None:
            stop_server()
        raise
    return code, where


def _offline_config(checked: Config, offline: Sequence[str | Path], overrides: Iterable[str], flags: dict,
                    config: Any, config_path: str):  # fmt: skip
    """An offline run's config and snapshots: the snapshots read and checked (checksums
    included), the config loaded again with the offline overrides
    (:func:`~mpper.algos.configs.offline_overrides`, and ``replay.capacity`` raised to
    the rows the snapshots hold) before the user's, and what does not apply refused."""
    from .algos.configs import offline_overrides
    from .runtime.offline import OfflineError, check_env, read_sources

    if checked.runtime.ray_address is not None:
        raise LaunchError("--offline: an offline run plays no self-play; --ray (runtime.ray_address) does not apply")
    try:
        data = read_sources(list(offline))
    except OfflineError as e:
        raise LaunchError(str(e)) from None
    first = list(offline_overrides(checked.algorithm))
    if checked.replay.capacity < data.rows:
        first.append(f"replay.capacity={data.rows}")
    every = [*first, *overrides]
    if isinstance(config, Mapping):
        checked = config_from_dict(dict(config), "the config dict", every, flags=flag_overrides(**flags))
    else:
        checked = load_config(config_path, every, **flags)
    try:
        check_env(data, checked)
    except OfflineError as e:
        raise LaunchError(str(e)) from None
    t = checked.training
    for key, value in (("training.samples_per_insert", t.samples_per_insert), ("training.env_steps", t.env_steps)):
        if value is not None:
            raise LaunchError(f"{key} does not apply to --offline runs (they store no new env steps): drop it")
    if checked.replay.capacity < data.rows:
        raise LaunchError(f"--offline: replay.capacity {checked.replay.capacity} is smaller than the {data.rows} rows "
                          f"the snapshots hold: drop that override, or raise it")  # fmt: skip
    if t.min_buffer_steps > data.steps:
        raise LaunchError(f"--offline: the snapshots hold {data.steps} env steps, fewer than training.min_buffer_steps "
                          f"{t.min_buffer_steps}: learning would never start; --set training.min_buffer_steps="
                          f"{t.batch_size}")  # fmt: skip
    return checked, data


def _checked_train(config: Config, run_dir: Path, flag: str, resume: Path | None, offline=None) -> int:
    """The checks that need the env and torch, the run directory's lock, and the run
    (``offline``: an offline run's :class:`~mpper.runtime.offline.OfflineData`)."""
    from .algos.registry import run_env_spec
    from .checkpoint import CheckpointError
    from .extras import MissingExtraError
    from .replay.snapshot import SnapshotError
    from .runtime.resources import check_fits
    from .runtime.rundir import RunDir, RunDirError, claim_run_dir
    from .safe_files import ReceivedFileError
    from .shm import SharedMemoryRoomError

    try:  # the env itself: kwargs it rejects, a broken two-player contract, an algorithm that cannot train it
        spec = run_env_spec(config)
        check_fits(config, spec)  # the sizes against /dev/shm and this machine's memory
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if resume is not None:
        problem = _check_resume(resume, config, spec)
        if problem:
            raise LaunchError(problem)
    if offline is not None:
        from .algos.registry import algorithm_of
        from .runtime.offline import OfflineError, check_sources

        schema = algorithm_of(config).run_schema(config, spec)
        try:
            check_sources(offline, config, spec, schema)
        except OfflineError as e:
            raise LaunchError(str(e)) from None
    try:  # held until the run ends: no second run writes into run_dir meanwhile
        lock = claim_run_dir(run_dir, flag, resume is not None)
    except RunDirError as e:
        raise LaunchError(str(e)) from None
    with lock:
        runtime = importlib.import_module("mpper.runtime.supervisor")  # only now: config errors never need it
        from .runtime.setup import RunSetup

        try:
            rc = runtime.train(RunSetup(config, spec, RunDir(run_dir), resume is not None, offline))
        except (SharedMemoryRoomError, SnapshotError, CheckpointError, MissingExtraError, ConnectionError,
                ReceivedFileError) as e:  # fmt: skip
            # raised while the run sets up, before any child starts (/dev/shm too small for
            # the buffer; a resumed snapshot whose checksums do not match; --ray without the
            # ray extra, or a cluster that cannot be reached: runtime.remote.ClusterError; wandb
            # that cannot start a run: runtime.logs.WandbLog; a run-dir file to append to that
            # is a link, FIFO or device)
            raise LaunchError(" ".join(str(e).splitlines())) from e
    return rc if isinstance(rc, int) else 0


def _check_lockstep(config: Config) -> None:
    """LaunchError for a lockstep run asked to use Ray: its streams play in local processes."""
    if config.runtime.lockstep and config.runtime.ray_address is not None:
        raise LaunchError("runtime.lockstep: a lockstep run plays its self-play streams in local processes; it "
                          "does not run with --ray (runtime.ray_address): drop one of them")  # fmt: skip


def _received_ray_address(config: Config, ray_address: str | None, overrides: Iterable[str]) -> bool:
    """Whether ``config.runtime.ray_address`` came from the file alone: neither ``--ray``
    (``ray_address``) nor ``--set runtime.ray_address=...`` names it."""
    if config.runtime.ray_address is None or ray_address is not None:
        return False
    return not any(o.partition("=")[0].strip() == "runtime.ray_address" for o in overrides)


def _check_extras(config: Config) -> None:
    """LaunchError when the config asks for an optional package that is not installed."""
    from .extras import installed

    if config.runtime.wandb_project is not None and not installed("wandb"):
        raise LaunchError("runtime.wandb_project needs wandb, which is not installed; install it with: "
                          "pip install -e .[wandb]")  # fmt: skip
    if config.runtime.video_every_evaluations is not None and not installed("imageio_ffmpeg"):
        raise LaunchError("runtime.video_every_evaluations needs imageio-ffmpeg, which is not installed; install it "
                          "with: pip install -e .[video]")  # fmt: skip


def _check_resume(run_dir: Path, config, spec) -> str | None:
    """What ``--resume`` will load, opened before anything starts: the checkpoint (with
    ``torch.load(weights_only=True)``, its tensors checked against the network of
    ``config``) and the snapshot (memory-mapped; structure checked, checksums left to
    the run's own load), whose replay settings ``config`` must repeat: a resumed buffer
    keeps its capacity, alpha, priority_eps and initial_priority, so an override of
    one is refused rather than recorded in config.json and ignored. Returns the
    problem, or None."""
    import torch

    from .algos.registry import algorithm_of, load_run_checkpoint
    from .checkpoint import CheckpointError, load_network_weights
    from .replay.buffer import ReplayBuffer
    from .replay.schema import normalize_schema
    from .replay.snapshot import SnapshotError
    from .runtime.rundir import LOCK_NAME, RunDirError, live_run_pid
    from .safe_files import refuse_link
    from .tools.evaluate_snapshot import SnapshotMismatchError, check_schema

    try:
        live = live_run_pid(run_dir)
    except RunDirError as e:  # a lock file that is a FIFO, device or link
        return f"--resume {run_dir}: {e}"
    if live is not None:
        return (f"--resume {run_dir}: a run is still writing there (pid {live} holds {run_dir / LOCK_NAME}); "
                "stop it first")
    checkpoint = run_dir / "checkpoint.pt"
    if not os.path.lexists(checkpoint):
        return f"--resume {run_dir}: no checkpoint.pt to resume from (the run stopped before its first checkpoint)"
    try:
        state = load_run_checkpoint(checkpoint, config, spec)  # within what a checkpoint of this network holds
        network = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions)
        for entry in ("network", "online_network"):  # online_network: the trained weights beside an average
            if entry in state:
                load_network_weights(network, state[entry], checkpoint, entry)
    except (CheckpointError, OSError) as e:
        return f"--resume {run_dir}: {e}"
    try:  # the optimizer's state and the rest, as the learner will load them
        algorithm_of(config).make_trainer(config, network, torch.device("cpu")).load_state_dict(state)
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
        detail = " ".join(str(e).split()) or type(e).__name__
        return f"--resume {run_dir}: {checkpoint}: the trainer's state does not load ({type(e).__name__}: {detail})"
    snapshot = run_dir / "buffer"
    if not os.path.lexists(snapshot):
        # weights without data: the run was killed before its first snapshot; say so and go on
        print(f"mpper: --resume {run_dir}: no buffer snapshot; resuming the weights with an empty buffer",
              file=sys.stderr)  # fmt: skip
    else:
        try:
            refuse_link(snapshot)  # its files are opened as regular files of their own, the directory too
            with ReplayBuffer.load(snapshot, mmap=True, verify=False, num_actions=spec.num_actions) as buf:
                stored = {"capacity": buf.capacity, "alpha": buf.alpha, "priority_eps": buf.priority_eps,
                          "initial_priority": buf.initial_priority}  # fmt: skip
                # the fields the run's buffer stores, as --on-snapshot checks them: another dtype or
                # shape would be copied into the new buffer's arrays, converted or broadcast, silently
                expected = algorithm_of(config).run_schema(config, spec)
                check_schema(snapshot, run_dir, buf.schema, normalize_schema(expected),
                             getattr(expected, "optional", ()))  # fmt: skip
        except (SnapshotError, SnapshotMismatchError, OSError) as e:
            return f"--resume {run_dir}: {e}"
        for key, value in stored.items():
            wanted = config.replay.buffer_initial_priority if key == "initial_priority" else getattr(config.replay, key)
            if wanted != value:
                return (f"--resume {run_dir}: replay.{key} is {json.dumps(wanted)} but the buffer snapshot holds "
                        f"{json.dumps(value)} ({snapshot}); a resumed run keeps its buffer's replay.capacity, "
                        f"alpha, priority_eps and initial_priority: drop that override, or start a new run "
                        f"in another --run-dir")  # fmt: skip
    return None
