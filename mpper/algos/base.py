"""What every algorithm provides, and the pieces they share.

An algorithm is one :class:`Algorithm` object (``mpper.algos.muzero.ALGORITHM``,
``mpper.algos.dqn.ALGORITHM``) listed in :mod:`mpper.algos.registry`; the runtime asks
it for everything that differs between algorithms and never compares algorithm names:

- ``schema``: the fields one stored row holds (the replay buffer's layout);
- ``make_network``: the model the learner trains and the players act with;
- ``make_player``: the game loop of a self-play worker or of the evaluator
  (:class:`Player`);
- ``make_targets``: what the learner samples (a :class:`~mpper.replay.targets.TargetBuilder`);
- ``make_trainer``: one update per batch (a :class:`Trainer`);
- ``make_reanalyser`` (optional): work for an extra process that refreshes stored data
  with the newest weights (MuZero's reanalyse);
- ``evaluate_snapshot``: held-out statistics of a network on a stored buffer;
- ``play_against`` (optional): games against an env's opponents, which is what
  training on two-player games needs.

:class:`Trainer` (optimizer, lr schedule, gradient clipping, moving average, checkpoint
state), :class:`FlatWeights` (one float32 vector of every parameter, what the weight store
carries) and :class:`EpisodeRows` (an episode's observation, action and reward rows) are
the shared parts of trainers, networks and players.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..checkpoint import load_network_weights
from ..config import Config
from ..envs.spec import EnvSpec
from ..replay.buffer import Batch, ReplayBuffer
from ..replay.positions import Positions
from .optim import SGD, Adam

__all__ = ["Algorithm", "EpisodeRows", "Finished", "FlatWeights", "Player", "Trainer", "WeightSource", "as_stored"]

# An algorithm's config class (``mpper/algos/<name>/config.py``: a Config with its own
# sections as typed fields); its functions take that class, the runtime passes a Config.
C = TypeVar("C", bound=Config)
N = TypeVar("N", bound=torch.nn.Module)


class Player(Protocol):
    """K environments played together by one process (a self-play worker or the
    evaluator). ``episodes``: the K running games; ``step(progress, training_step)``
    (the share of training done, and the learner's step of the weights the network holds,
    which a schema may store per row) plays one move in each and returns the episodes to
    store: the games that ended and, where the
    algorithm stores a long game in pieces (MuZero's ``muzero.game_segment_length``), the
    pieces of games that go on (``ends_game`` False; ``game_return`` and ``game_moves``
    count the whole game to the piece's end); ``stored(episode)`` gives the rows to
    store (schema fields, ``T + 1`` rows) and their initial priorities (``T``);
    ``network_input(episode)`` and ``greedy_actions(observations)`` see and choose as the
    player does without exploring, for observations it did not play itself."""

    episodes: list

    def step(self, progress: float = 0.0, training_step: int = 0) -> list: ...

    def stored(self, episode) -> tuple[dict[str, np.ndarray], np.ndarray | None]: ...

    def network_input(self, episode) -> np.ndarray:
        """What the network sees at the episode's last observation (past ones stacked in
        when the algorithm's config says so)."""
        ...

    def greedy_actions(self, observations: np.ndarray, legal: np.ndarray | None = None,
                       to_play: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """The actions (N,) the player takes without exploring, as the evaluator plays,
        for N network inputs (N, *observation_shape); ``legal`` (N, A) bool and
        ``to_play`` (N,) int when the env gives them (``mpper.load(...).act``)."""
        ...


def as_stored(observation) -> np.ndarray:
    """An env's observation as episodes keep it and the buffer stores it: float
    observations as float32 (the schema's dtype for float spaces), bool and integer
    images (MinAtar's planes, Atari frames) in their own dtype, one byte per value; the
    networks see float32 (the targets convert at sample time, the players at inference)."""
    observation = np.asarray(observation)
    return observation.astype(np.float32) if observation.dtype.kind == "f" else observation


@dataclass
class EpisodeRows:
    """The rows every algorithm stores for one episode, in muzero-general's GameHistory
    layout: T moves are T + 1 rows; row i holds the observation o_i, the action a_{i-1}
    that led to it and the reward r_i received on arriving there (row 0: action 0, reward
    0). An algorithm's episode adds its own fields (MuZero: to_play and the search's
    statistics). ``terminated``: the env ended the episode (False: cut by a time limit,
    or a piece of a game that goes on, whose last transition bootstraps).

    A game stored in pieces: each piece is an ``EpisodeRows`` whose row 0 is the last row
    of the piece before (``first_move`` and ``reward_before`` say where in the game it
    starts), and only the last has ``ends_game``."""

    observation: list = field(default_factory=list)  # o_0 .. o_T
    action: list = field(default_factory=lambda: [0])  # a_{i-1} on row i (row 0: 0)
    reward: list = field(default_factory=lambda: [0.0])  # r_i on row i (row 0: 0)
    terminated: bool = False
    ends_game: bool = True  # False: a piece of a game that goes on
    first_move: int = 0  # the game's move number at row 0
    reward_before: float = 0.0  # what the game earned before row 0

    @property
    def moves(self) -> int:
        return len(self.observation) - 1

    @property
    def total_reward(self) -> float:
        """The reward of this episode's rows (of a piece: the piece's only)."""
        return float(sum(self.reward))

    @property
    def game_moves(self) -> int:
        """Moves of the whole game up to this episode's last row."""
        return self.first_move + self.moves

    @property
    def game_return(self) -> float:
        """The whole game's reward up to this episode's last row."""
        return self.reward_before + self.total_reward

    def rows(self) -> dict[str, np.ndarray]:
        """``observation`` (T + 1, *obs) as :func:`as_stored` keeps it, ``action`` (T + 1,)
        int64, ``reward`` (T + 1,) float32: the fields of every algorithm's schema."""
        return {
            "observation": np.stack(self.observation),
            "action": np.asarray(self.action, np.int64),
            "reward": np.asarray(self.reward, np.float32),
        }


class WeightSource(Protocol):
    """Where the newest published weights are read (``mpper.runtime.weights.WeightStore``):
    ``version`` (0 before the first publication), ``handle.num_weights`` and
    ``read_into(flat) -> (version, training_step)``."""

    version: int
    handle: Any  # what a child attaches (WeightStoreHandle): ``num_weights``, the length of the flat vector

    def read_into(self, out: np.ndarray) -> tuple[int, int]: ...


@dataclass
class Finished:
    """An update whose results reached the host: its batch, its metrics and the new raw
    priorities of the batch's positions (what :meth:`Trainer.submit` returns)."""

    batch: Batch
    metrics: dict[str, float]
    priorities: np.ndarray


@dataclass(frozen=True)
class Algorithm(Generic[C]):
    """One algorithm, as the runtime and the tools see it (see the module docstring);
    ``C`` is its config class, which its functions take.

    Shapes: ``observation_shape`` is one env observation's shape, ``num_actions`` the
    size of the discrete action space (of a continuous one: the action vector's length).
    """

    name: str
    schema: Callable[[Sequence[int], int, Any], dict]  # (observation_shape, num_actions, dtype) -> schema
    make_network: Callable[[C, tuple, int], FlatWeights]  # a torch module with flat weights
    make_player: Callable[..., Player]  # (config, envs, network, explore, seed, worker_id) -> Player
    make_targets: Callable[[C, int], Any]  # (config, num_actions) -> TargetBuilder
    make_trainer: Callable[[C, Any, torch.device], Trainer]  # (config, network of make_network, device)
    evaluate_snapshot: Callable[..., dict]  # (SnapshotRun) -> {"table": [...], ...}
    # (config, buf, weights) -> object with refresh_weights(), step() and stats() (a dict of
    # numbers for the reports, with "episodes" stored so far)
    make_reanalyser: Callable[..., Any] | None = None
    # whether a run of this config starts the reanalyser (make_reanalyser's process)
    reanalyses: Callable[[C], bool] = lambda config: False
    # whether the learner sees positions through the env's board symmetries (the run
    # checks, before it starts, that the env declares them)
    augments_symmetries: Callable[[C], bool] = lambda config: False
    # bytes one worker's player holds beside the network: (config, env spec, model on the
    # meta device) -> int (MuZero: its search trees); for the memory check before a run
    player_bytes: Callable[..., int] | None = None
    # Two-player games: (config, network, opponents {name: AgentFn, weakest first}, games,
    # seed, stop=None) -> {"mean_return", "returns", "against", "opponents"} or None when
    # stopped (``mpper.algos.muzero.arena.evaluate_against_opponents``). An algorithm
    # without it cannot train a two-player env.
    play_against: Callable[..., dict | None] | None = None
    # The cap on raw priorities, new and updated alike (DQN's dqn.priority_clip): config -> cap or None
    priority_clip: Callable[[C], float | None] = lambda config: None
    # (config, moves) -> the most moves one stored piece of an episode of that many moves
    # holds (MuZero's game segments store long games in pieces); a piece of T moves takes
    # T + 1 rows of the buffer
    stored_moves: Callable[[C, int], int] = lambda config, moves: moves
    # config -> the most hidden states one search keeps per root (MuZero: num_simulations + 1),
    # for an algorithm whose self-play network the inference server can serve
    # (``runtime/inference.py``: ``initial_inference``/``recurrent_inference`` returning value,
    # reward and policy logits and a hidden state); None: its workers run their network themselves
    search_nodes: Callable[[C], int] | None = None
    # config -> why a run of this config cannot train a two-player env (one line), or None
    two_player_refusal: Callable[[C], str | None] = lambda config: None
    # (config, observation_shape, num_actions, dtype) -> schema, for an algorithm whose rows
    # depend on its config (Sampled MuZero: K root samples per row); None: ``schema``
    config_schema: Callable[..., dict] | None = None
    # whether it trains a bounded Box action space (then ``num_actions`` is the action
    # vector's length A) instead of a Discrete one
    continuous_actions: bool = False
    description: str = ""

    def run_schema(self, config: C, spec: EnvSpec) -> dict:
        """The schema of a run of ``config`` on an env like ``spec``."""
        if self.config_schema is not None:
            return self.config_schema(config, spec.observation_shape, spec.num_actions, spec.observation_dtype)
        return self.schema(spec.observation_shape, spec.num_actions, spec.observation_dtype)

    @property
    def two_player(self) -> bool:
        """Whether it trains on two-player games (and evaluates against opponents)."""
        return self.play_against is not None


class Trainer(Generic[C]):
    """What every algorithm's trainer (of config class ``C``) has: the network on its
    device, its optimizer, the training-step counter, the learning-rate schedule, host ->
    device copies of a batch, and the state a checkpoint holds. Subclasses define
    ``train_step(batch) -> (metrics, raw priorities)``: ``mpper.algos.muzero.trainer.MuZeroTrainer``,
    ``mpper.algos.dqn.dqn.DQNTrainer``.
    """

    network: FlatWeights

    def __init__(self, config: C, network: FlatWeights, device: torch.device):
        self.config = config
        self.train_config = t = config.training
        self.device = torch.device(device)
        self.network = network.to(self.device)
        self.network.train()
        self.training_step = 0  # completed updates; the lr of the next one depends on it
        self.lr_drop_step: int | None = None  # the step training.lr_drop_factor took effect (training.lr_drop_return)
        params = list(self.network.parameters())
        # mpper's Adam and SGD (optim.py): torch.optim's arithmetic and checkpoint format,
        # without its torch.compile hooks (whose import would delay every learner's start)
        self.optimizer: Adam | SGD | torch.optim.Optimizer
        if t.optimizer == "adam":
            self.optimizer = Adam(params, lr=t.lr_init, weight_decay=t.weight_decay)
        elif t.optimizer == "sgd":
            self.optimizer = SGD(params, lr=t.lr_init, momentum=t.momentum, weight_decay=t.weight_decay)
        else:
            raise ValueError(f'training.optimizer must be "adam" or "sgd", got {t.optimizer!r}')
        # Polyak averaging (training.ema_decay): the weights the run publishes -- self-play
        # acts with them, the evaluator judges them, checkpoint.pt's "network" holds them --
        # are an exponential moving average of the trained ones, which smooths the noise of
        # single SGD steps (on TicTacToe it made no measurable difference: docs/experiments/tictactoe.md).
        self.averaged: AveragedModel | None = None
        if t.ema_decay is not None:
            self.averaged = AveragedModel(self.network, multi_avg_fn=get_ema_multi_avg_fn(t.ema_decay),
                                          use_buffers=True)  # fmt: skip
        # CUDA only: pinned host copies of the batch arrays, reused every step, and the
        # event that says the last copies out of them have finished (see _to_device).
        self._pinned: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    @property
    def published_network(self) -> FlatWeights:
        """The network everyone acts with: the moving average when ``ema_decay`` is set,
        else the trained network itself."""
        if self.averaged is None or int(self.averaged.n_averaged) == 0:  # nothing averaged yet
            return self.network
        return cast(FlatWeights, self.averaged.module)  # a copy of self.network

    def update_average(self) -> None:
        """Fold the trained weights into the moving average; call after each
        ``train_step`` (no-op without ``ema_decay``). The first call copies them."""
        if self.averaged is not None:
            self.averaged.update_parameters(self.network)

    def learning_rate(self, step: int | None = None) -> float:
        """``lr_init * lr_decay_rate ** (step / lr_decay_steps)`` (muzero-general's
        ``update_lr``), for ``step`` completed updates (default: now), times
        ``lr_drop_factor`` from the step :meth:`drop_learning_rate` was called on.

        With ``lr_warmup_steps`` W, update ``step + 1`` of the first W runs at
        ``lr_init * (step + 1) / W`` and the decay counts from W (EfficientZero's
        ``adjust_lr``, whose first update runs at 0); with ``lr_decay_staircase`` the
        exponent is whole: ``floor((step - W) / lr_decay_steps)``."""
        t = self.train_config
        step = self.training_step if step is None else step
        if step < t.lr_warmup_steps:
            lr = t.lr_init * (step + 1) / t.lr_warmup_steps
        else:
            decays = (step - t.lr_warmup_steps) / t.lr_decay_steps
            lr = t.lr_init * t.lr_decay_rate ** (math.floor(decays) if t.lr_decay_staircase else decays)
        if self.lr_drop_step is not None and step >= self.lr_drop_step:
            lr *= t.lr_drop_factor
        return lr

    def drop_learning_rate(self) -> None:
        """From the next update on, the learning rate is multiplied by ``training.lr_drop_factor``
        (once: an evaluation reached ``training.lr_drop_return``)."""
        if self.lr_drop_step is None:
            self.lr_drop_step = self.training_step

    # ---- gradients -------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, clip_value: float | None = None) -> torch.Tensor:
        """The gradients of ``loss`` in the network's parameters, each element clipped to
        ``[-clip_value, clip_value]`` when given, then all of them scaled to a total L2
        norm of at most ``training.grad_clip`` when set; returns the total norm before
        that scaling (a 0-d tensor; the caller checks it is finite).

        The arithmetic of ``torch.nn.utils.clip_grad_norm_`` (coefficient
        ``grad_clip / (norm + 1e-6)``, at most 1) in a few tensor ops: torch's version
        sorts the gradients by device and dtype in Python on every call, a cost that
        counts in a step of a small network. All parameters share one device.
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in self.network.parameters() if p.grad is not None]
        if clip_value is not None:
            for g in grads:
                g.clamp_(-clip_value, clip_value)
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
        max_norm = self.train_config.grad_clip
        if max_norm is not None:
            coefficient = (max_norm / (norm + 1e-6)).clamp_(max=1.0)
            for g in grads:
                g.mul_(coefficient)
        return norm

    # ---- host -> device ---------------------------------------------------------------
    def _to_device(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """numpy arrays -> tensors on the device.

        CPU: ``torch.from_numpy`` views, no copy at all. CUDA: each array is copied into
        a persistent page-locked (pinned) host tensor, from which the copy to the GPU
        runs asynchronously (``non_blocking``) and overlaps with the work queued before
        it. A pinned tensor is overwritten only after the previous step's copy out of it
        has finished (the event), never while the GPU may still be reading it.
        """
        if self.device.type != "cuda":
            return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
        if self._copied is not None:
            self._copied.synchronize()
        out = {}
        for key, value in arrays.items():
            host = torch.from_numpy(np.ascontiguousarray(value))
            pinned = self._pinned.get(key)
            if pinned is None or pinned.shape != host.shape or pinned.dtype != host.dtype:
                pinned = self._pinned[key] = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            pinned.copy_(host)
            out[key] = pinned.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Network, optimizer and step counter: tensors, numbers, strings, lists and
        dicts only, so that ``torch.load(weights_only=True)`` reads it back."""
        # "network" is always what the run published (evaluation, --evaluate and the
        # arena read it); with a moving average the trained weights go to "online_network".
        state = {
            "network": self.published_network.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "training_step": int(self.training_step),
        }
        if self.lr_drop_step is not None:
            state["lr_drop_step"] = int(self.lr_drop_step)
        if self.averaged is not None:
            state["online_network"] = self.network.state_dict()
            state["averaged_updates"] = int(self.averaged.n_averaged)
        return state

    def train_step(self, batch: Batch) -> tuple[dict[str, float], np.ndarray]:
        """One update on ``batch``; returns the metrics and the new raw priorities of the
        sampled positions (each algorithm's trainer defines it)."""
        raise NotImplementedError

    def submit(self, batch: Batch) -> list[Finished]:
        """Start one update on ``batch``; returns the updates whose results reached the host
        since the last call, oldest first. Here the update is ``train_step``, done at once;
        a trainer that runs ahead of the host (MuZero's static step on a GPU) returns an
        update one call late, and :meth:`drain` gives the last one."""
        metrics, priorities = self.train_step(batch)
        return [Finished(batch, metrics, priorities)]

    def drain(self) -> list[Finished]:
        """Wait for every update started and return those :meth:`submit` has not returned."""
        return []

    def learner_targets(self, targets):
        """The target builder the learner samples with, given the algorithm's
        (``make_targets``): a trainer may want its batches in another form."""
        return targets

    def _group_overrides(self) -> dict:
        """What a loaded optimizer state's param groups take from this run, not from the
        file: nothing for mpper's optimizers, which take only the hyperparameters (a
        ``torch.optim`` one, the static step's, overrides its kernel choices)."""
        return {}

    def adopt_weights(self, flat: np.ndarray) -> None:
        """Start from published weights (the supervisor's first ones, a flat float32
        vector): the trained network takes them; a subclass copies them wherever else
        they must be (DQN: its target network)."""
        self.network.set_flat_weights(flat)

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (or a checkpoint holding it). A checkpoint
        written without ``ema_decay`` starts the average afresh from its weights."""
        missing = [k for k in ("network", "optimizer", "training_step") if k not in state]
        if missing:
            raise ValueError(f"trainer state is missing {missing}; has {sorted(state)}")
        online = state.get("online_network", state["network"])
        self.network.load_state_dict(online)  # copies onto the network's device
        # This run's choice of kernel wins over the checkpoint's (a static step's capturable
        # Adam resuming an eager run's checkpoint, or the other way round).
        optimizer_state = dict(state["optimizer"])
        optimizer_state["param_groups"] = [{**g, **self._group_overrides()} for g in optimizer_state["param_groups"]]
        self.optimizer.load_state_dict(optimizer_state)  # moves the state to the params' device
        # torch checks the groups' sizes, not the moments' shapes: a mismatch would fail at
        # the first step, deep in the kernel
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                for name, value in self.optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                        raise ValueError(f"optimizer state {name!r} has shape {tuple(value.shape)} for a weight of "
                                         f"shape {tuple(param.shape)}")  # fmt: skip
        self.training_step = int(state["training_step"])
        self.lr_drop_step = int(state["lr_drop_step"]) if "lr_drop_step" in state else None
        if self.averaged is not None:
            self.averaged.module.load_state_dict(state["network"])
            self.averaged.n_averaged.fill_(int(state.get("averaged_updates", 0)))


class FlatWeights(torch.nn.Module):
    """Flat float32 weights of an ``nn.Module`` for the shared-memory WeightStore: the
    learner publishes ``get_flat_weights()``, actors ``set_flat_weights`` on their copy
    (a mixin of the algorithms' networks)."""

    def num_flat_weights(self) -> int:
        """Length of ``get_flat_weights()``: every parameter and buffer (BatchNorm
        running statistics and counters included)."""
        return sum(t.numel() for t in self.state_dict().values())

    def get_flat_weights(self) -> np.ndarray:
        """All parameters and buffers, in ``state_dict`` order, as one float32 vector.
        Integer buffers (BatchNorm's ``num_batches_tracked``) are stored as float32,
        exact up to 2**24."""
        tensors = [t.detach().reshape(-1).to("cpu", torch.float32) for t in self.state_dict().values()]
        return torch.cat(tensors).numpy()

    @torch.no_grad()
    def set_flat_weights(self, flat: np.ndarray) -> None:
        """Load a vector made by ``get_flat_weights`` (same architecture) in place."""
        flat = np.asarray(flat)
        expected = self.num_flat_weights()
        if flat.shape != (expected,):
            raise ValueError(f"set_flat_weights: expected a vector of {expected} values, got shape {flat.shape}")
        source = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        tensors = list(self.state_dict().values())  # state_dict tensors share storage with the module
        if tensors and tensors[0].device != source.device:
            source = source.to(tensors[0].device)  # one host -> device copy, not one per tensor
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            tensor.copy_(source[offset : offset + n].view(tensor.shape))  # copy_ casts dtype and device
            offset += n


@dataclass
class SnapshotRun(Generic[C]):
    """Everything a per-algorithm evaluator needs.

    ``checkpoint``: the dict ``load_checkpoint`` returned (``"network"`` state dict on
    the CPU, ``"training_step"``, ...). ``buffer``: the snapshot, read-only. ``advance(n)``:
    call after each batch with the number of positions done (the progress bar).
    """

    config: C
    spec: EnvSpec
    checkpoint: dict
    checkpoint_path: Path
    buffer: ReplayBuffer
    positions: Positions
    batch_size: int
    advance: Callable[[int], None]

    def load_weights(self, network: N) -> N:
        """``network`` with the checkpoint's weights, in eval mode; CheckpointError (one
        line) when they do not fit the network the run's config describes."""
        load_network_weights(network, self.checkpoint["network"], self.checkpoint_path)
        return network.eval()
