"""Self-play on a Ray cluster, while the buffer stays in this machine's shared memory.

With ``runtime.ray_address`` (``--ray ADDRESS``) the N self-play workers are Ray actors,
placed anywhere in the cluster; everything else is as without Ray: the buffer and the
weight store are segments of this machine, and the learner, the reanalyser and the
evaluator are the supervisor's local processes.

    this machine (runs run.py, a node of the cluster)        any node of the cluster
    supervisor ── ray.put(weights), once per version ───────> SelfPlayActor x N (K envs each)
      │ learner, reanalyser, evaluator: local processes         │ whole episodes, at most
      └ EpisodeIngest (Ray actor pinned to this node) <─────────┘ one in flight per actor
          samples-per-insert wait, then add_episode into the shared buffer

- **Weights**: when the weight store's version changes, the supervisor puts the flat
  float32 weights into Ray's object store once and offers the reference to every actor;
  an actor fetches it (once per node: Ray caches objects per node) only when it moves to
  that version, and a version it never took is never sent.
- **Episodes**: an actor sends each finished episode whole (the rows its player stores,
  as numpy arrays) in one call to the ingest actor, and waits for that call to finish
  before it sends the next: each actor has at most one episode in flight, so the object
  store never queues more than N episodes. The ingest actor waits as a local worker
  does (``RateLimiter.wait_to_insert``) before writing, which is how the
  samples-per-insert ratio holds remote actors back: their calls do not return.
- **Locks**: the ingest actor is a process of this machine that multiprocessing did not
  start; it attaches the buffer through ``BufferHandle.portable()`` (the writers' lock
  is a mutex inside the segment, shared by mapping it).
- **Faults**: an actor whose ``run`` raised (an env error: its traceback comes back) or
  whose process or node died is reported by :meth:`RaySelfPlay.poll` and restarted by
  the supervisor up to ``runtime.max_worker_restarts``, as a local worker. An episode is
  one call: it is stored whole or not at all. The ingest actor's death stops the run.
- **Stopping**: :meth:`RaySelfPlay.stop` asks every actor to stop, waits, kills those
  still running, then stops and kills the ingest actor; the supervisor then disconnects
  (``ray.shutdown``) if it connected.

This module imports ``ray``; nothing else in mpper does, so without ``ray_address`` Ray
is never imported.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..extras import require
from ..replay.buffer import BufferHandle, ReplayBuffer
from .procs import child_init
from .rate import RateLimiter
from .roles import BufferSink, SelfPlay, StoredEpisode, selfplay_envs
from .setup import RunSetup

ray = require("ray", "Ray", "ray", "runtime.ray_address (--ray)")
from ray.exceptions import RayActorError, RayTaskError  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

__all__ = ["ClusterError", "EpisodeIngest", "RaySelfPlay", "SelfPlayActor", "connect", "disconnect"]

_CONNECT_TIMEOUT_S = 5.0
_OFFER_POLL_S = 0.01  # how often the supervisor's weights thread looks for a new version
_NAMESPACE = "mpper"


class ClusterError(ConnectionError):
    """The Ray cluster cannot be reached or used; the message is one line saying why."""


# ---- connecting ---------------------------------------------------------------------------


def connect(address: str) -> bool:
    """Join the Ray cluster at ``address`` as its driver ("host:port" of its head, or
    "auto"); True when this call connected, False when this process already was.

    A "host:port" is probed first (:func:`_probe_head`, ``_CONNECT_TIMEOUT_S``): ``ray.init``
    would otherwise retry an unreachable address, or wait on a port that is not a Ray
    head's, for minutes. Raises :class:`ClusterError`."""
    if ray.is_initialized():
        return False
    if address != "auto":
        _probe_head(address)
    try:
        ray.init(address=address, namespace=_NAMESPACE, log_to_driver=False, configure_logging=True,
                 logging_level="warning")  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(f"cannot join the Ray cluster at {address}: {first}") from None
    return True


# A Ray head's address is its GCS, a gRPC server: HTTP/2 without TLS, which answers a
# client's connection preface with a SETTINGS frame (RFC 9113, 3.4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS
_HTTP2_SETTINGS = 4  # the frame type byte (the fourth of a frame header)


def _probe_head(address: str) -> None:
    """ClusterError unless a server at ``address`` ("host:port") accepts a TCP connection
    and answers an HTTP/2 preface as gRPC does, each within ``_CONNECT_TIMEOUT_S``. The
    message says what answered: nothing, a closed connection, or the first bytes of
    something that is not gRPC."""
    host, port = address.rsplit(":", 1)
    hint = "start it with `ray start --head` on this machine, or give the head's host:port"
    try:
        sock = socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S)
    except OSError as exc:
        raise ClusterError(f"cannot reach the Ray cluster at {address} ({exc.strerror or exc}); {hint}") from None
    with sock:
        try:
            sock.sendall(_HTTP2_PREFACE)
            reply = sock.recv(64)
        except socket.timeout:
            raise ClusterError(f"{address} accepted a TCP connection but answered nothing within "
                               f"{_CONNECT_TIMEOUT_S:g} s: not a Ray head (its GCS answers as a gRPC server); "
                               f"{hint}") from None  # fmt: skip
        except OSError as exc:
            raise ClusterError(f"{address} accepted a TCP connection, then failed ({exc.strerror or exc}): "
                               f"not a Ray head; {hint}") from None  # fmt: skip
    if not reply:
        raise ClusterError(f"{address} accepted a TCP connection and closed it without answering: not a Ray head; "
                           f"{hint}")  # fmt: skip
    if len(reply) < 9 or reply[3] != _HTTP2_SETTINGS:
        raise ClusterError(f"{address} answered {reply[:24]!r}, not as a gRPC server: not a Ray head; {hint}")


def disconnect() -> None:
    """Leave the cluster (Ray then stops this driver's leftover workers)."""
    if ray.is_initialized():
        ray.shutdown()


# ---- the actors -----------------------------------------------------------------------------


class EpisodeIngest:
    """The Ray actor, pinned to the buffer's node, through which remote episodes enter the
    shared buffer (a :class:`~mpper.runtime.roles.BufferSink`, as a local worker's).
    Calls run in a thread pool (``max_concurrency``): ``add`` may wait for the
    samples-per-insert ratio while ``drain`` and ``stop`` still answer; writes are one at
    a time."""

    def __init__(self, buffer_handle: BufferHandle, training) -> None:
        self.buffer = ReplayBuffer.attach(buffer_handle)
        rate = None
        if training.paced_samples_per_insert is not None:
            # No doorbells (the learner's cannot be shared with a process multiprocessing did
            # not start): a waiting add re-checks the shared counters every 10 ms.
            rate = RateLimiter.from_config(training, None, poll_s=0.01)
        self._write = threading.Lock()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._reports: list[tuple[str, str, dict]] = []
        self._sink = BufferSink(self.buffer, rate, self._stop, self._deliver)
        self._stats = {"episodes": 0, "rows": 0, "bytes": 0, "write_s": 0.0, "wait_s": 0.0}

    def _deliver(self, source: str, report: dict) -> None:
        with self._lock:
            self._reports.append(("episode", source, report))

    def add(self, episode: StoredEpisode) -> bool:
        """Store one episode; False when the ingest is stopping and it was not stored."""
        with self._write:
            if self._stop.is_set():
                return False
            t0 = time.monotonic()
            waited = self._sink(episode)
            if waited is None:  # stopped while waiting for the ratio: not stored
                return False
            write_s = time.monotonic() - t0 - waited
        nbytes = sum(a.nbytes for a in episode.arrays.values())
        nbytes += 0 if episode.priorities is None else episode.priorities.nbytes
        with self._lock:
            s = self._stats
            s["episodes"] += 1
            s["rows"] += len(next(iter(episode.arrays.values())))
            s["bytes"] += nbytes
            s["write_s"] += write_s
            s["wait_s"] += waited
        return True

    def drain(self) -> tuple[list[tuple[str, str, dict]], dict]:
        """The episode reports since the last drain, and the running totals (episodes,
        rows, bytes of rows received, seconds writing, seconds waiting for the ratio)."""
        with self._lock:
            reports, self._reports = self._reports, []
            return reports, dict(self._stats)

    def stop(self) -> None:
        """Refuse further episodes; a waiting ``add`` returns without storing."""
        self._stop.set()

    def close(self) -> None:
        """Stop and detach from the buffer (after the last write)."""
        self._stop.set()
        with self._write:
            self.buffer.close()


class OfferedWeights:
    """The newest weights a self-play actor was offered (what ``LatestWeights`` is to a
    local worker): :meth:`refresh` fetches them from Ray's object store when the offered
    version is new."""

    def __init__(self, setup: RunSetup) -> None:
        self.network = setup.make_network().eval()
        self.version = 0
        self.training_step = 0
        self.offered: tuple[int, int, Any] | None = None

    def refresh(self) -> bool:
        offered = self.offered
        if offered is None or offered[0] == self.version:
            return False
        version, step, ref = offered
        self.network.set_flat_weights(ray.get(ref))
        self.version, self.training_step = version, step
        return True


class SelfPlayActor:
    """One self-play worker as a Ray actor: the :class:`~mpper.runtime.roles.SelfPlay`
    turn on K envs with the newest weights it was offered, each finished episode sent
    whole to the ingest actor. ``run`` is the worker's loop (it returns when stopped,
    raises an env's error); ``offer_weights`` and ``stop`` are answered meanwhile
    (``max_concurrency=2``)."""

    def __init__(self, name: str, setup: RunSetup, seed: int, worker_id: int, ingest) -> None:
        child_init(setup.config.runtime.torch_threads, own_process=True)
        torch.manual_seed(seed)
        self.name, self.setup, self.seed, self.worker_id, self.ingest = name, setup, seed, worker_id, ingest
        self.envs = selfplay_envs(setup.config, name, setup.config.runtime.envs_per_worker)
        self.weights = OfferedWeights(setup)
        self._stop = threading.Event()
        self._in_flight = None
        self._sent = 0

    def offer_weights(self, version: int, training_step: int, boxed_ref: list) -> None:
        """The newest weights: ``boxed_ref[0]`` is their object reference (in a list, so
        that Ray hands over the reference and the actor fetches only what it uses)."""
        self.weights.offered = (version, training_step, boxed_ref[0])

    def stop(self) -> None:
        self._stop.set()

    def where(self) -> dict:
        """Where this actor runs: its node's id and IP address, its pid there and its
        niceness (Ray starts workers at 15 unless its ``worker_niceness`` says otherwise)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "nice": os.getpriority(os.PRIO_PROCESS, 0)}  # fmt: skip

    def _finish_in_flight(self) -> None:
        """Wait for the last episode's ``add`` to return (backpressure); its errors raise here."""
        ref, self._in_flight = self._in_flight, None
        while ref is not None:
            ready, _ = ray.wait([ref], timeout=0.1)
            if ready:
                ray.get(ref)
                return

    def _send(self, episode: StoredEpisode) -> None:
        """The sink: at most one episode in flight per actor."""
        self._finish_in_flight()
        self._in_flight = self.ingest.add.remote(episode)
        self._sent += 1

    def run(self) -> int:
        """Play until stopped; returns the number of episodes sent."""
        while not self.weights.refresh():
            if self._stop.wait(0.05):
                return 0
        selfplay = SelfPlay(self.setup, self.name, self.envs, self.weights, self.seed, self.worker_id)
        while not self._stop.is_set():
            selfplay.turn(self._send)
        self._finish_in_flight()
        return self._sent


# ---- the supervisor's side --------------------------------------------------------------------


@dataclass
class RemoteWorker:
    """A self-play actor, its running ``run`` call and how often it was restarted."""

    name: str
    worker_id: int
    actor: Any = None
    run_ref: Any = None
    restarts: int = 0
    where_ref: Any = None  # the pending answer of the actor's ``where``


@dataclass
class RemoteEvents:
    """What :meth:`RaySelfPlay.poll` saw since the last poll."""

    reports: list[tuple[str, str, dict]]  # ("episode", worker name, payload), as a local worker's reports
    failures: list[tuple[str, str, str]]  # (worker name, why its actor ended, its traceback or "")
    placements: dict[str, dict] | None  # worker name -> where its actor runs; None when unchanged


class RaySelfPlay:
    """The supervisor's handle on the remote self-play: starts the ingest actor and one
    actor per worker, collects episode reports, reports dead actors, restarts and stops
    them. Every method returns at once (nothing here waits on an actor except
    :meth:`stop`). A thread offers each new weight version to the actors as soon as the
    learner publishes it (the weight store is looked at every 10 ms), as local workers
    see it at their next move."""

    def __init__(self, setup: RunSetup, buffer: ReplayBuffer, store) -> None:
        self.setup = setup
        self.config = setup.config
        self.seeds = setup.seeds
        self.buffer = buffer
        self.store = store
        self.workers: dict[str, RemoteWorker] = {}
        self.ingest: Any = None  # the EpisodeIngest actor's handle
        self._drain_ref = None
        self._version = 0
        self._step = 0
        self._weights_ref = None
        self._flat: np.ndarray | None = None
        self.placements: dict[str, dict] = {}
        self._placements_changed = False
        self._lock = threading.Lock()  # the weights thread and the supervisor's thread: actors, versions
        self._stop_offering = threading.Event()
        self._offer_thread: threading.Thread | None = None
        self._offer_error: BaseException | None = None

    def start(self) -> None:
        """The ingest actor on this node, then the N self-play actors."""
        here = ray.get_runtime_context().get_node_id()
        workers = self.config.runtime.workers
        self.ingest = ray.remote(EpisodeIngest).options(
            num_cpus=0, max_concurrency=workers + 4, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        ).remote(self._handle().portable(), self.config.training)  # fmt: skip
        with self._lock:
            for i in range(workers):
                worker = RemoteWorker(f"ray-worker-{i}", i)
                self.workers[worker.name] = worker
                self._launch(worker)
        self._offer_thread = threading.Thread(target=self._offer_loop, name="mpper-ray-weights", daemon=True)
        self._offer_thread.start()

    def _handle(self) -> BufferHandle:
        handle = self.buffer.handle
        assert handle is not None  # the supervisor's buffer is shared
        return handle

    def _launch(self, worker: RemoteWorker) -> None:  # with self._lock
        rt = self.config.runtime
        seed = self.seeds.worker(worker.worker_id, worker.restarts)
        worker.actor = ray.remote(SelfPlayActor).options(
            num_cpus=rt.ray_actor_cpus, resources=dict(rt.ray_actor_resources), max_concurrency=2, max_restarts=0,
        ).remote(worker.name, self.setup, seed, worker.worker_id, self.ingest)  # fmt: skip
        if self._weights_ref is not None:
            worker.actor.offer_weights.remote(self._version, self._step, [self._weights_ref])
        worker.run_ref = worker.actor.run.remote()
        worker.where_ref = worker.actor.where.remote()

    def restart(self, name: str) -> None:
        """Start a new actor (a fresh seed) for the worker ``name`` that died."""
        with self._lock:
            worker = self.workers[name]
            worker.restarts += 1
            self._launch(worker)

    def poll(self) -> RemoteEvents:
        """The episode reports the ingest collected, the workers whose actor ended and
        where the actors run (when that changed). Raises :class:`ClusterError` when the
        ingest actor died or weights could not be offered."""
        if self._offer_error is not None:
            raise ClusterError(f"offering weights to the actors failed: {_first_line(self._offer_error)}")
        reports = self._drain()
        failures = []
        running = {w.run_ref: w for w in self.workers.values() if w.run_ref is not None}
        if running:
            done, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
            for ref in done:
                worker = running[ref]
                worker.run_ref = None
                failures.append((worker.name, *_why_it_ended(ref)))
        for worker in self.workers.values():
            if worker.where_ref is not None and ray.wait([worker.where_ref], timeout=0)[0]:
                try:
                    self.placements[worker.name] = {**ray.get(worker.where_ref), "restarts": worker.restarts}
                    self._placements_changed = True
                except (RayActorError, RayTaskError):  # it died first: the failure says so
                    pass
                worker.where_ref = None
        placements, self._placements_changed = (dict(self.placements) if self._placements_changed else None), False
        return RemoteEvents(reports, failures, placements)

    def _offer_loop(self) -> None:
        while not self._stop_offering.wait(_OFFER_POLL_S):
            try:
                self._offer_weights()
            except Exception as exc:  # the supervisor's next poll reports it
                self._offer_error = exc
                return

    def _offer_weights(self) -> None:
        if self.store.version == self._version:
            return
        if self._flat is None:
            self._flat = np.empty(self.store.handle.num_weights, np.float32)
        version, step = self.store.read_into(self._flat)
        ref = ray.put(self._flat)  # one object per version; the previous is freed once no actor holds it
        with self._lock:
            self._version, self._step, self._weights_ref = version, step, ref
            for worker in self.workers.values():
                if worker.run_ref is not None:
                    worker.actor.offer_weights.remote(version, step, [ref])

    def _drain(self) -> list[tuple[str, str, dict]]:
        reports: list[tuple[str, str, dict]] = []
        if self._drain_ref is not None:
            ready, _ = ray.wait([self._drain_ref], timeout=0)
            if not ready:
                return reports
            try:
                reports, _ = ray.get(self._drain_ref)
            except RayActorError as exc:
                raise ClusterError(f"the episode ingest actor died: {_first_line(exc)}") from None
        self._drain_ref = self.ingest.drain.remote()
        return reports

    def stop(self, timeout: float = 10.0) -> list[tuple[str, str, dict]]:
        """Stop every actor (asked first, killed after ``timeout`` seconds), then the
        ingest actor; returns the episode reports it still held."""
        self._stop_offering.set()
        if self._offer_thread is not None:
            self._offer_thread.join(timeout)
        if self.ingest is not None:
            try:
                self.ingest.stop.remote()  # a waiting add returns, so the actors can finish
            except Exception:
                pass
        running = [w for w in self.workers.values() if w.run_ref is not None]
        for worker in running:
            try:
                worker.actor.stop.remote()
            except Exception:
                pass
        if running:
            ray.wait([w.run_ref for w in running], num_returns=len(running), timeout=timeout)
        for worker in self.workers.values():
            if worker.actor is not None:
                ray.kill(worker.actor, no_restart=True)
                worker.actor = worker.run_ref = None
        reports: list[tuple[str, str, dict]] = []
        if self.ingest is not None:
            try:
                reports, _ = ray.get(self.ingest.drain.remote(), timeout=timeout)
                ray.get(self.ingest.close.remote(), timeout=timeout)
            except Exception:
                pass
            ray.kill(self.ingest, no_restart=True)
            self.ingest = None
        return reports


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _why_it_ended(ref) -> tuple[str, str]:
    """Why an actor's ``run`` call ended: ``(summary, traceback or "")``."""
    try:
        sent = ray.get(ref)
    except RayTaskError as exc:  # run raised (an env error, say); the actor's traceback comes with it
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        return (f"failed: {lines[-1].strip()}" if lines else "failed"), str(exc)
    except RayActorError as exc:  # its process or its node died
        return f"died (its actor or its node was lost: {_first_line(exc)})", ""
    return f"stopped by itself after sending {sent} episodes", ""
