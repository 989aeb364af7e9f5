"""The inference server: one process owns the search network and evaluates the leaves of
every self-play worker's search in batches that span the workers.

With ``runtime.selfplay_inference`` "server" (or "auto" on a CUDA machine), a MuZero
run's workers keep no network. Each one's search talks to a :class:`ServedNetwork`,
which has the two calls the search makes (``initial_inference``,
``recurrent_inference``); it writes the request into the worker's own slot of one
shared-memory segment, rings the server's doorbell and waits on its own. The server
(:func:`run_inference`, the process; :class:`InferenceServer`, its loop) gathers the
pending requests of every slot, runs one batched initial inference and one batched
recurrent inference on its device, and scatters the logits back.

The segment (:class:`InferenceSlots`, created and unlinked by the supervisor)::

    header      int64 (8,)               generation, server pid, weights version, training step,
                                          network calls and the rows they took (counted over restarts)
    per slot s (one per worker, ``max_batch`` = runtime.envs_per_worker rows):
      control   int64 (slots, 8)          request seq, response seq, request generation,
                                          kind (initial / recurrent), rows, status
      obs       float32 (slots, B, *obs)  initial requests: the network inputs
      tokens    int64 (slots, B)          recurrent requests: the parents' hidden-state tokens
      actions   int64 (slots, B)          recurrent requests: the actions
      reward_tokens int64 (slots, B)      recurrent requests with a value prefix: the tokens of the
                                          LSTM states to start from, -1 for zeros (a reset)
      logits    float32 (slots, B, 2(2S+1) + A)  response: value | reward | policy logits
      out_tokens int64 (slots, B)         response: the tokens of the new hidden states

Hidden states stay on the server, in one tensor on its device, (slots, capacity,
*hidden_shape), ``capacity`` = rows x (nodes per search); a worker holds only *tokens*,
int64 positions in its slot's part of it, which its search stores and indexes as it
would hidden states (the search's tree is written once, for either). A network with
MuZero's value prefix (``muzero.value_prefix``) has an LSTM state per node too: the
server keeps it beside the hidden state, at the same position, and the worker's search
holds it as ``token + 1`` (int64 (B, 1)), so that the zeros it writes where the LSTM is
reset name the zero state (-1 in ``reward_tokens``). An initial
inference starts the slot's hidden states again at position 0; each recurrent one
appends. The other way, hidden states sent back and forth through the segment, costs
two host copies of (rows, *hidden_shape) per simulation and on a GPU a device sync
each way; kept on the device, the only per-simulation traffic is the logits.

Doorbells: the server sleeps on one ``multiprocessing.Semaphore`` that every request
releases; each slot has its own semaphore that the server releases after writing the
response. Sequence numbers, not the semaphores, say whether a response is there: a
semaphore left released for a worker that was killed mid-request only wakes its
restarted successor once, which finds no response of its own and waits on.

Failures. The server's ``generation`` counts server starts (0: none ready yet); a
request carries the generation it was sent to, and a server answers only its own. A
worker waiting for a response looks, every ``_POLL_S``, at the run's stop signal and
at the server's pid: if the server died, it waits for the restarted one (the
supervisor restarts it as it restarts a worker, up to ``runtime.max_worker_restarts``,
and past that stops the run, which sets the stop signal). Its hidden states died with
the old server, so a search under way is interrupted (:class:`SearchInterrupted`: the
worker plays that move again from its root, no env has stepped); an initial inference
is simply sent again. A worker killed mid-request costs the server nothing: it answers
the orphan request like any other, and the restarted worker claims the slot once no
request of the old one is pending.

Weights: the server copies new weights from the weight store between two batches, so
one search may see two weight versions (a worker's own network changes only between
moves); the header's version is what the workers report with their episodes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import shm as shm_mod
from .procs import child_process
from .roles import LatestWeights, pick_device
from .setup import RunSetup

__all__ = ["InferenceHandle", "InferenceServer", "InferenceSlots", "InferenceStopped", "SearchInterrupted",
           "ServedNetwork", "ServedOutput", "ServedPrefixOutput", "ServedWeights", "run_inference",
           "serves_selfplay"]  # fmt: skip

_GENERATION, _SERVER_PID, _VERSION, _STEP, _CALLS, _CALL_ROWS = range(6)
_REQ_SEQ, _RESP_SEQ, _REQ_GEN, _KIND, _ROWS, _STATUS = range(6)
_HEADER = _CONTROL = 8  # int64 fields reserved for the header and for each slot's control row
INITIAL, RECURRENT = 1, 2
_OK, _BAD_REQUEST = 0, 1
_POLL_S = 0.1  # how often a waiting worker looks at the stop signal and the server's pid
_BELL_S = 0.05  # how long the idle server sleeps on its doorbell before it looks at the stop signal


class InferenceStopped(Exception):
    """The run stopped while a worker waited for the server."""


class SearchInterrupted(Exception):
    """The server restarted during a search: the hidden states it kept are gone, and the
    search must start again from its root."""


class ServedOutput(NamedTuple):
    """What the search reads of a network's output (the fields of MuZero's
    ``NetworkOutput``, in its order), on the CPU; ``hidden_state`` is (B, 1) int64 tokens."""

    value_logits: torch.Tensor  # (B, 2S+1)
    reward_logits: torch.Tensor  # (B, 2S+1)
    policy_logits: torch.Tensor  # (B, A)
    hidden_state: torch.Tensor  # (B, 1) int64: positions in the server's hidden states of this slot


class ServedPrefixOutput(NamedTuple):
    """``ServedOutput`` of a network with a value prefix (MuZero's ``PrefixOutput``)."""

    value_logits: torch.Tensor  # (B, 2S+1)
    reward_logits: torch.Tensor  # (B, 2S+1): the value prefix
    policy_logits: torch.Tensor  # (B, A)
    hidden_state: torch.Tensor  # (B, 1) int64 tokens
    reward_state: torch.Tensor  # (B, 1) int64: token + 1 of the LSTM state on the server (0: zeros)


def serves_selfplay(setup: RunSetup) -> bool:
    """Whether this run's self-play workers use the inference server (``runtime.selfplay_inference``):
    "server": yes; "worker": no; "auto": when the algorithm's network can be served (MuZero),
    the learner's device resolves to CUDA, and the run has local worker processes. Only
    free-running runs with local workers can (the config's rules refuse "server" elsewhere)."""
    rt = setup.config.runtime
    local_workers = rt.workers > 0 and not rt.lockstep and rt.ray_address is None and setup.selfplay
    if not local_workers or setup.algorithm.search_nodes is None or rt.selfplay_inference == "worker":
        return False
    if rt.selfplay_inference == "server":
        return True
    return rt.device != "cpu" and torch.cuda.is_available()


@dataclass(frozen=True)
class InferenceHandle:
    """Picklable description of the inference segment and its doorbells (semaphores travel
    to children as process arguments)."""

    segment: str
    slots: int  # one per worker
    max_batch: int  # rows per request (the worker's envs)
    observation_shape: tuple[int, ...]  # the network's input, stacking included
    support_width: int  # 2S + 1
    num_actions: int
    capacity: int  # hidden states the server keeps per slot
    server_bell: Any
    worker_bells: tuple
    lstm_horizon_len: int | None = None  # the network's value prefix (MuZero's), None: none

    @property
    def logits_width(self) -> int:
        return 2 * self.support_width + self.num_actions


def _layout(handle: InferenceHandle) -> tuple[list[tuple[str, tuple, Any, int]], int]:
    """The segment's arrays as (name, shape, dtype, byte offset), each 64-byte aligned, and its size."""
    s, b = handle.slots, handle.max_batch
    specs = [("header", (_HEADER,), np.int64), ("control", (s, _CONTROL), np.int64),
             ("obs", (s, b, *handle.observation_shape), np.float32), ("tokens", (s, b), np.int64),
             ("actions", (s, b), np.int64), ("reward_tokens", (s, b), np.int64),
             ("logits", (s, b, handle.logits_width), np.float32),
             ("out_tokens", (s, b), np.int64)]  # fmt: skip
    layout: list[tuple[str, tuple, Any, int]] = []
    offset = 0
    for name, shape, dtype in specs:
        layout.append((name, shape, dtype, offset))
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        offset += -(-nbytes // 64) * 64
    return layout, offset


class InferenceSlots(shm_mod.SharedObject):
    """The inference segment: the header, and one request/response slot per worker."""

    def __init__(self, handle: InferenceHandle, segment, owner: bool) -> None:
        self.handle = handle
        self._segment = segment
        self._owner = owner
        arrays = {name: np.ndarray(shape, dtype, buffer=segment.buf, offset=offset)
                  for name, shape, dtype, offset in _layout(handle)[0]}  # fmt: skip
        self.header, self.control = arrays["header"], arrays["control"]
        self.obs, self.tokens, self.actions = arrays["obs"], arrays["tokens"], arrays["actions"]
        self.reward_tokens = arrays["reward_tokens"]
        self.logits, self.out_tokens = arrays["logits"], arrays["out_tokens"]

    @classmethod
    def create(cls, ctx, slots: int, max_batch: int, observation_shape, support_width: int, num_actions: int,
               capacity: int, lstm_horizon_len: int | None = None) -> "InferenceSlots":  # fmt: skip
        """Create and own the segment (all zero: no server yet) and the doorbells."""
        handle = InferenceHandle("", slots, max_batch, tuple(int(x) for x in observation_shape), support_width,
                                 num_actions, capacity, ctx.Semaphore(0),
                                 tuple(ctx.Semaphore(0) for _ in range(slots)), lstm_horizon_len)  # fmt: skip
        nbytes = _layout(handle)[1]
        segment = shm_mod.create(nbytes, "inference", what=f"the inference slots ({slots} workers)")
        return cls(dataclasses.replace(handle, segment=segment.name), segment, owner=True)

    @classmethod
    def for_run(cls, setup: RunSetup, ctx) -> "InferenceSlots":
        """The slots of a run: one per worker, requests of ``runtime.envs_per_worker`` rows,
        room for the hidden states of one search per slot."""
        network, rt = setup.make_network(), setup.config.runtime
        search_nodes = setup.algorithm.search_nodes
        if search_nodes is None:
            raise ValueError(f"{setup.algorithm.name}'s self-play network cannot be served by the inference process")
        return cls.create(ctx, rt.workers, rt.envs_per_worker, network.observation_shape, network.full_support_size,
                          network.num_actions, rt.envs_per_worker * search_nodes(setup.config),
                          getattr(network, "lstm_horizon_len", None))  # fmt: skip

    @classmethod
    def attach(cls, handle: InferenceHandle) -> "InferenceSlots":
        return cls(handle, shm_mod.attach(handle.segment), owner=False)

    @property
    def generation(self) -> int:
        """Server starts so far (0: no server has been ready yet)."""
        return int(self.header[_GENERATION])

    def calls(self) -> tuple[int, int]:
        """(network calls, rows they took) since the slots were made: their ratio is how
        many rows one batch spanned on average."""
        return int(self.header[_CALLS]), int(self.header[_CALL_ROWS])

    def server_alive(self) -> bool:
        return self.generation > 0 and shm_mod.pid_alive(int(self.header[_SERVER_PID]))

    def pending(self, slot: int, generation: int) -> bool:
        """Whether ``slot`` holds a request for server ``generation`` not answered yet."""
        control = self.control[slot]
        return bool(control[_REQ_SEQ] != control[_RESP_SEQ] and control[_REQ_GEN] == generation)

    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        segment, self._segment = self._segment, None
        if segment is not None:
            self.header = self.control = self.obs = self.tokens = self.actions = self.logits = self.out_tokens = None
            self.reward_tokens = None
            shm_mod.release(segment, unlink=self._owner)


# ---- the worker's side ---------------------------------------------------------------------------


class ServedNetwork:
    """What a worker's search sees instead of a network: ``initial_inference(obs)`` and
    ``recurrent_inference(tokens, actions)``, answered by the server through slot
    ``slot``; ``parameters()`` is empty, so the search keeps its trees on the CPU. With a
    value prefix (``lstm_horizon_len``, the served network's), ``recurrent_inference``
    takes and returns LSTM states as tokens (see the module docstring).

    ``stop``: the run's stop signal (``is_set()``); a wait it ends raises
    :class:`InferenceStopped`. A search under way when the server restarts raises
    :class:`SearchInterrupted` at its next recurrent inference.
    """

    def __init__(self, slots: InferenceSlots, slot: int, stop) -> None:
        self.slots, self.slot, self.stop = slots, slot, stop
        self.bell = slots.handle.worker_bells[slot]
        self.search_generation = -1  # the server generation that holds this slot's hidden states
        self.lstm_horizon_len = slots.handle.lstm_horizon_len  # what the search reads

    def parameters(self):
        return iter(())

    def eval(self) -> ServedNetwork:
        return self

    def initial_inference(self, observation: torch.Tensor) -> ServedOutput | ServedPrefixOutput:
        """Observations (B, *observation_shape) float32, B <= max_batch -> logits and the
        new hidden states' tokens (B, 1). Sent again to a restarted server."""
        obs = np.asarray(observation.detach().cpu(), dtype=np.float32)
        rows = self._rows(obs.shape[0])
        if obs.shape[1:] != self.slots.handle.observation_shape:
            raise ValueError(f"observations must be (B, {self.slots.handle.observation_shape}), got {obs.shape}")
        while True:
            generation = self._wait_for_server()
            self.slots.obs[self.slot, :rows] = obs
            if self._request(INITIAL, rows, generation):
                self.search_generation = generation
                return self._response(rows)

    def recurrent_inference(self, hidden_state: torch.Tensor, action: torch.Tensor,
                            reward_state: torch.Tensor | None = None) -> ServedOutput | ServedPrefixOutput:  # fmt: skip
        """Tokens (B, 1) or (B,) int64 from earlier calls of this search, actions (B,) int64 ->
        logits and the new hidden states' tokens (B, 1). With a value prefix, ``reward_state``
        (B, 1) int64 holds token + 1 of each parent's LSTM state (0 or None: zeros)."""
        tokens = np.asarray(hidden_state.detach().cpu(), dtype=np.int64).reshape(-1)
        rows = self._rows(tokens.shape[0])
        if self.search_generation != self.slots.generation or not self.slots.server_alive():
            self._wait_for_server()
            raise SearchInterrupted("the inference server restarted during the search")
        self.slots.tokens[self.slot, :rows] = tokens
        self.slots.actions[self.slot, :rows] = np.asarray(action.detach().cpu(), dtype=np.int64).reshape(-1)
        if reward_state is None:
            self.slots.reward_tokens[self.slot, :rows] = -1
        else:
            self.slots.reward_tokens[self.slot, :rows] = np.asarray(reward_state.cpu(), np.int64).reshape(-1) - 1
        if not self._request(RECURRENT, rows, self.search_generation):
            self._wait_for_server()
            raise SearchInterrupted("the inference server restarted during the search")
        return self._response(rows)

    def _rows(self, rows: int) -> int:
        if not 1 <= rows <= self.slots.handle.max_batch:
            raise ValueError(f"a request holds 1 to {self.slots.handle.max_batch} rows, got {rows}")
        return rows

    def _wait_for_server(self) -> int:
        """The generation of a live server (waiting for one to be ready, and for this slot's
        request of a former worker to be answered); InferenceStopped if the run stops first."""
        while True:
            generation = self.slots.generation
            if self.slots.server_alive() and not self.slots.pending(self.slot, generation):
                return generation
            if self.stop.is_set():
                raise InferenceStopped("the run stopped while waiting for the inference server")
            time.sleep(0.02)

    def _request(self, kind: int, rows: int, generation: int) -> bool:
        """Send the request written in the slot; True once answered, False if the server
        that was to answer it died (or a new one replaced it)."""
        control = self.slots.control[self.slot]
        control[_KIND], control[_ROWS], control[_REQ_GEN] = kind, rows, generation
        seq = int(control[_REQ_SEQ]) + 1
        control[_REQ_SEQ] = seq  # last: the request is whole once its sequence number moves
        self.slots.handle.server_bell.release()
        while True:
            self.bell.acquire(timeout=_POLL_S)
            if control[_RESP_SEQ] == seq:
                if control[_STATUS] != _OK:
                    raise RuntimeError(f"the inference server refused a request of {rows} rows (kind {kind}): "
                                       "tokens not of this search, or more hidden states than a search keeps")  # fmt: skip
                return True
            if self.stop.is_set():
                raise InferenceStopped("the run stopped while waiting for the inference server")
            if self.slots.generation != generation or not self.slots.server_alive():
                return False

    def _response(self, rows: int) -> ServedOutput | ServedPrefixOutput:
        logits = torch.from_numpy(self.slots.logits[self.slot, :rows].copy())
        width = self.slots.handle.support_width
        tokens = torch.from_numpy(self.slots.out_tokens[self.slot, :rows].copy())[:, None]
        if self.lstm_horizon_len is not None:  # the new LSTM states sit where the new hidden states do
            return ServedPrefixOutput(logits[:, :width], logits[:, width : 2 * width], logits[:, 2 * width :], tokens,
                                      tokens + 1)  # fmt: skip
        return ServedOutput(logits[:, :width], logits[:, width : 2 * width], logits[:, 2 * width :], tokens)


class ServedWeights:
    """A worker's weights as :class:`~mpper.runtime.roles.SelfPlay` reads them, when the
    server holds the network: ``network`` is the :class:`ServedNetwork`, ``version`` and
    ``training_step`` those the server serves now."""

    def __init__(self, slots: InferenceSlots, slot: int, stop) -> None:
        self.slots = slots
        self.network = ServedNetwork(slots, slot, stop)
        self.version = self.training_step = 0

    def refresh(self) -> bool:
        version = int(self.slots.header[_VERSION])
        changed = version != self.version
        self.version, self.training_step = version, int(self.slots.header[_STEP])
        return changed

    def wait_first(self, stop) -> bool:
        """Block until a server is ready (it waits for the first weights); False if stopped first."""
        while not self.slots.server_alive():
            if stop.wait(0.05):
                return False
        self.refresh()
        return True


# ---- the server's side ---------------------------------------------------------------------------


class InferenceServer:
    """The server's loop over one :class:`InferenceSlots`, with ``network`` (MuZero's
    inference interface) on ``device``. :meth:`start` announces it (a new generation);
    :meth:`serve_once` sleeps on the doorbell and answers every pending request."""

    def __init__(self, slots: InferenceSlots, network, device: torch.device) -> None:
        self.slots, self.network, self.device = slots, network, torch.device(device)
        handle = slots.handle
        probe = network.initial_inference(torch.zeros((1, *handle.observation_shape), device=self.device))
        self.hidden_shape = tuple(probe.hidden_state.shape[1:])
        self.hidden = torch.empty((handle.slots * handle.capacity, *self.hidden_shape),
                                  dtype=probe.hidden_state.dtype, device=self.device)  # fmt: skip
        # the value prefix's LSTM states, beside the hidden states (None: no value prefix)
        self.reward_states: torch.Tensor | None = None
        if getattr(probe, "reward_state", None) is not None:
            self.reward_states = torch.zeros((handle.slots * handle.capacity, *probe.reward_state.shape[1:]),
                                             dtype=probe.reward_state.dtype, device=self.device)  # fmt: skip
        self.filled = np.zeros(handle.slots, np.int64)  # hidden states held per slot
        self.generation = 0
        self.batches = self.requests = 0  # counted, for the tests and the benchmark
        self.largest_batch = 0  # the most rows one network call took

    def start(self, version: int, training_step: int) -> int:
        """Take over the slots: this process's pid, the weights, then a new generation (the
        workers' signal that it is ready); returns the generation."""
        header = self.slots.header
        header[_SERVER_PID] = os.getpid()
        self.set_weights_version(version, training_step)
        self.generation = int(header[_GENERATION]) + 1
        header[_GENERATION] = self.generation
        return self.generation

    def set_weights_version(self, version: int, training_step: int) -> None:
        self.slots.header[_STEP] = training_step
        self.slots.header[_VERSION] = version

    def pending(self) -> list[int]:
        """The slots holding a request for this server."""
        return [s for s in range(self.slots.handle.slots) if self.slots.pending(s, self.generation)]

    def serve_once(self, timeout: float = _BELL_S) -> int:
        """Wait up to ``timeout`` s for a request, then answer every pending one; returns how many."""
        bell = self.slots.handle.server_bell
        if bell.acquire(timeout=timeout):
            while bell.acquire(False):  # one pass answers them all
                pass
        return self.serve(self.pending())

    @torch.inference_mode()
    def serve(self, slots: list[int]) -> int:
        """Answer the requests of ``slots``: one batched initial and one batched recurrent
        inference across them; returns how many were answered."""
        control = self.slots.control
        seqs = {s: int(control[s, _REQ_SEQ]) for s in slots}  # what each answer will say it answers
        initial = [s for s in slots if control[s, _KIND] == INITIAL and self._valid(s, INITIAL)]
        recurrent = [s for s in slots if control[s, _KIND] == RECURRENT and self._valid(s, RECURRENT)]
        if initial:
            self._initial(initial)
        if recurrent:
            self._recurrent(recurrent)
        answered = set(initial) | set(recurrent)
        for s in slots:
            control[s, _STATUS] = _OK if s in answered else _BAD_REQUEST
            control[s, _RESP_SEQ] = seqs[s]
            self.slots.handle.worker_bells[s].release()
        self.requests += len(slots)
        return len(slots)

    def _valid(self, slot: int, kind: int) -> bool:
        rows, handle = int(self.slots.control[slot, _ROWS]), self.slots.handle
        if not 1 <= rows <= handle.max_batch:
            return False
        if kind == INITIAL:
            return True
        tokens = self.slots.tokens[slot, :rows]
        filled = self.filled[slot]
        if self.reward_states is not None:
            reward_tokens = self.slots.reward_tokens[slot, :rows]
            if reward_tokens.min() < -1 or reward_tokens.max() >= filled:
                return False
        return bool(tokens.min() >= 0 and tokens.max() < filled and filled + rows <= handle.capacity)

    def _rows(self, slots: list[int]) -> list[int]:
        return [int(self.slots.control[s, _ROWS]) for s in slots]

    def _initial(self, slots: list[int]) -> None:
        rows = self._rows(slots)
        obs = np.concatenate([self.slots.obs[s, :n] for s, n in zip(slots, rows)])
        out = self.network.initial_inference(torch.from_numpy(obs).to(self.device, non_blocking=True))
        capacity = self.slots.handle.capacity
        where = torch.as_tensor(np.concatenate([s * capacity + np.arange(n) for s, n in zip(slots, rows)]),
                                device=self.device)  # fmt: skip
        self.hidden[where] = out.hidden_state
        if self.reward_states is not None:
            self.reward_states[where] = out.reward_state
        for s, n in zip(slots, rows):
            self.filled[s] = n
        self._scatter(slots, rows, out, [np.arange(n) for n in rows])

    def _recurrent(self, slots: list[int]) -> None:
        rows = self._rows(slots)
        capacity = self.slots.handle.capacity
        parents = np.concatenate([s * capacity + self.slots.tokens[s, :n] for s, n in zip(slots, rows)])
        actions = np.concatenate([self.slots.actions[s, :n] for s, n in zip(slots, rows)])
        hidden = self.hidden[torch.as_tensor(parents, device=self.device)]
        if self.reward_states is None:
            out = self.network.recurrent_inference(hidden, torch.as_tensor(actions, device=self.device))
        else:  # the LSTM states named, zeros for -1
            reward_tokens = np.concatenate([self.slots.reward_tokens[s, :n] for s, n in zip(slots, rows)])
            starts = np.concatenate([np.full(n, s * capacity) for s, n in zip(slots, rows)])
            at = torch.as_tensor(starts + np.maximum(reward_tokens, 0), device=self.device)
            keep = torch.as_tensor(reward_tokens >= 0, device=self.device)
            states = self.reward_states[at] * keep.view(-1, *[1] * (self.reward_states.dim() - 1))
            out = self.network.recurrent_inference(hidden, torch.as_tensor(actions, device=self.device), states)
        new_tokens = [self.filled[s] + np.arange(n) for s, n in zip(slots, rows)]
        where = np.concatenate([s * capacity + t for s, t in zip(slots, new_tokens)])
        self.hidden[torch.as_tensor(where, device=self.device)] = out.hidden_state
        if self.reward_states is not None:
            self.reward_states[torch.as_tensor(where, device=self.device)] = out.reward_state
        for s, n in zip(slots, rows):
            self.filled[s] += n
        self._scatter(slots, rows, out, new_tokens)

    def _scatter(self, slots: list[int], rows: list[int], out, tokens: list[np.ndarray]) -> None:
        logits = torch.cat([out.value_logits, out.reward_logits, out.policy_logits], 1).float().cpu().numpy()
        start = 0
        for s, n, t in zip(slots, rows, tokens):
            self.slots.logits[s, :n] = logits[start : start + n]
            self.slots.out_tokens[s, :n] = t
            start += n
        self.batches += 1
        self.largest_batch = max(self.largest_batch, sum(rows))
        self.slots.header[_CALL_ROWS] += sum(rows)
        self.slots.header[_CALLS] += 1


def run_inference(setup: RunSetup, weight_handle, inference_handle: InferenceHandle, stop, reports) -> None:
    """The inference process: the network on the run's device (``runtime.device``: CUDA
    when "auto" finds it), new weights from the weight store between batches, requests
    answered until ``stop``."""
    name = "inference"
    config = setup.config
    with child_process(name, config, reports, stop, weight_handle=weight_handle) as (_, store):
        slots = InferenceSlots.attach(inference_handle)
        try:
            device = pick_device(config.runtime.device)
            weights = LatestWeights(setup, store)
            if not weights.wait_first(stop):
                return
            network = weights.network.to(device).eval()
            server = InferenceServer(slots, network, device)
            generation = server.start(weights.version, weights.training_step)
            if generation > 1:  # a restart: the workers' searches under way start again
                print(f"mpper: {name}: serving again (start {generation}) on {device}", file=sys.stderr, flush=True)
            while not stop.is_set():
                if weights.refresh():
                    server.set_weights_version(weights.version, weights.training_step)
                server.serve_once()
        finally:
            slots.close()
