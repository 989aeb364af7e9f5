"""DQN with prioritized replay on mpper's runtime (easy-rl's PER-DQN, done Ape-X style).

The same processes as MuZero: self-play workers act (epsilon-greedy instead of a
search) and store whole episodes in the shared buffer; the learner samples n-step
transitions with importance weights, trains, and writes ``|TD|`` priorities back.
``"algorithm": "dqn"`` selects this module's pieces; everything else (buffer, rate
control, weight store, supervisor, checkpoints, snapshots) is shared.

Read top-down:

1. ``QNetwork``: a torso (flatten, MinAtar's conv or the Nature CNN), an MLP and a
   ``Q(s, .)`` head, optionally dueling.
2. Exploration: ``apex_epsilons`` (Ape-X's constant epsilon per actor) and
   ``decayed_epsilon`` (easy-rl's PER-DQN notebook's exponential schedule).
3. ``td_errors``: n-step TD errors of stored rows; the actors' initial priorities.
4. ``EpsilonGreedyPlayer``: K environments stepped together, one batched forward pass
   per step; finished episodes come back in the buffer's row layout.
5. ``DQNTrainer``: one update on a batch from ``NStepTargets``: double DQN, Huber or
   MSE loss weighted by the importance weights, gradient clipping, a target network that
   is a real copy (hard or soft updates), and the new raw priorities; for offline runs
   the CQL(H) penalty (``dqn.cql_alpha``) or behaviour cloning (``dqn.objective`` "bc").

Row layout (``mpper.algos.dqn.targets.dqn_schema``): an episode of T moves is T + 1 rows; row i
holds o_i, the action a_{i-1} that led to it and the reward r_i it brought (row 0: 0).
Gymnasium's ``terminated`` and ``truncated`` stay apart: a terminated episode's last
transition does not bootstrap, a time-limit truncation does (from o_T, which is stored).

Shapes: B is the batch, A the number of actions, K the envs of one player.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...replay.buffer import Batch
from ..base import EpisodeRows, FlatWeights, Trainer, as_stored
from .config import DQNRunConfig
from .targets import NStepTargets, stack_frames, stacked_frames_shape

__all__ = [
    "DQNTrainer",
    "conv_torso",
    "make_q_network",
    "EpsilonGreedyPlayer",
    "QNetwork",
    "apex_epsilons",
    "decayed_epsilon",
    "td_errors",
]


# --------------------------------------------------------------------------------------
# 1. The Q-network
# --------------------------------------------------------------------------------------


def conv_torso(kind: str, observation_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """The convolutional layers of a Q-network and the size of their flattened output,
    for (C, H, W) observations.

    ``"minatar"``: the MinAtar paper's network (Young and Tian 2019), one 3x3 conv of 16
    channels, stride 1, ReLU. ``"nature"``: the Nature DQN (Mnih et al. 2015), 32 8x8
    stride 4, 64 4x4 stride 2, 64 3x3 stride 1, ReLU, on pixels scaled by 1/255.
    """
    if len(observation_shape) != 3:
        raise ValueError(f'dqn.torso "{kind}" needs (C, H, W) image observations, got shape {observation_shape}')
    channels = observation_shape[0]
    if kind == "minatar":
        torso = nn.Sequential(nn.Conv2d(channels, 16, 3, 1), nn.ReLU(), nn.Flatten())
    elif kind == "nature":
        torso = nn.Sequential(
            _Scale(1 / 255), nn.Conv2d(channels, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(),
        )  # fmt: skip
    else:
        raise ValueError(f'dqn.torso must be "mlp", "minatar" or "nature", got {kind!r}')
    try:
        with torch.no_grad():
            size = int(torso(torch.zeros(1, *observation_shape)).shape[1])
    except RuntimeError:  # a kernel larger than what is left of the image
        size = 0
    if size < 1:
        raise ValueError(f'dqn.torso "{kind}": observations of shape {observation_shape} are too small for its convolutions')
    return torso, size


class _Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class QNetwork(FlatWeights, nn.Module):
    """``Q(s, .)``: (B, *observation_shape) -> (B, A).

    The torso: ``"mlp"`` flattens the observation; ``"minatar"`` and ``"nature"`` are
    :func:`conv_torso`'s. Then a ReLU MLP with the widths ``hidden`` (easy-rl's
    notebook's three-layer MLP is ``[256, 256]``; MinAtar's ``[128]``, Nature's
    ``[512]``). Dueling (Wang et al. 2016): the last hidden layer feeds a value stream
    ``V(s)`` and an advantage stream ``A(s, a)``, combined as ``V + A - mean_a A`` so
    that V and A are identifiable.
    """

    def __init__(self, observation_shape: tuple[int, ...], num_actions: int, hidden: list[int], dueling: bool = False,
                 torso: str = "mlp"):  # fmt: skip
        super().__init__()
        self.observation_shape = tuple(observation_shape)
        self.num_actions = int(num_actions)
        self.dueling = bool(dueling)
        if torso == "mlp":
            self.torso: nn.Module = nn.Flatten()
            features = int(np.prod(self.observation_shape))
        else:
            self.torso, features = conv_torso(torso, self.observation_shape)
        sizes = [features, *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.advantage = nn.Linear(sizes[-1], num_actions)
        self.value = nn.Linear(sizes[-1], 1) if dueling else None

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        x = self.body(self.torso(observation.float()))
        if self.value is None:
            return self.advantage(x)
        adv = self.advantage(x)
        return self.value(x) + adv - adv.mean(dim=1, keepdim=True)


def make_q_network(config: DQNRunConfig, observation_shape: tuple[int, ...], num_actions: int) -> QNetwork:
    """The Q-network of a run's ``dqn`` section for an env's ``observation_shape``:
    ``torso``, ``hidden``, ``dueling``, over stacks of ``frame_stack`` frames."""
    d = config.dqn
    shape = stacked_frames_shape(observation_shape, d.frame_stack)
    return QNetwork(shape, num_actions, list(d.hidden), d.dueling, d.torso)


# --------------------------------------------------------------------------------------
# 2. Exploration
# --------------------------------------------------------------------------------------


def apex_epsilons(base: float, alpha: float, num_actors: int) -> np.ndarray:
    """Ape-X's constant epsilons ``eps_i = base ** (1 + i * alpha / (N - 1))``,
    i = 0 .. N-1 (Horgan et al. 2018: base 0.4, alpha 7). One actor: ``[base]``."""
    if num_actors == 1:
        return np.array([base], np.float64)
    i = np.arange(num_actors, dtype=np.float64)
    return base ** (1.0 + i * alpha / (num_actors - 1))


def decayed_epsilon(start: float, end: float, decay: float, steps: int) -> float:
    """easy-rl's PER-DQN notebook's schedule ``end + (start - end) * exp(-steps / decay)``; ``steps`` counts
    the actions the actor took before this one."""
    return end + (start - end) * math.exp(-steps / decay)


# --------------------------------------------------------------------------------------
# 3. TD errors of stored rows (the actors' initial priorities)
# --------------------------------------------------------------------------------------

TD_ERROR_CHUNK_ROWS = 256  # rows per forward pass of td_errors at most, a power of two (bounds the actor's memory)


@torch.no_grad()
def td_errors(network: QNetwork, arrays: dict[str, np.ndarray], terminated: bool, n_step: int, gamma: float,
              frame_stack: int = 1) -> np.ndarray:  # fmt: skip
    """``|R_t^(m) + gamma^m * max_a Q(s_{t+m}, a) * (1 - done) - Q(s_t, a_t)|`` for the T
    moves of one episode given as buffer rows (``observation`` (T+1, ...), ``action``
    and ``reward`` (T+1,)); float64 (T,).

    The targets come from the learner's own ``NStepTargets`` kernel (the episode's rows
    serve as a tiny ring), and the actor's network plays both roles: Ape-X's actors
    have no target network, and with one network double DQN's target is the max.
    """
    moves = arrays["observation"].shape[0] - 1
    slots = np.arange(moves, dtype=np.int64)
    t = NStepTargets(n_step, gamma, frame_stack).build(
        arrays, slots, slots, np.full(moves, moves), np.full(moves, terminated), None
    )  # fmt: skip
    chunks = []
    for lo in range(0, moves + 1, TD_ERROR_CHUNK_ROWS):
        # In chunks of at most TD_ERROR_CHUNK_ROWS, each padded (by repeating its final
        # row) to a power of two: one pass over a whole Atari episode (thousands of
        # stacked frames, as float32 and through the convolutions) would hold gigabytes
        # in the actor, and every new batch size makes the CPU backend keep more
        # per-shape state (an actor's RSS grew by gigabytes over thousands of episodes of
        # different lengths); powers of two make a few shapes at under 2x the rows.
        n = min(TD_ERROR_CHUNK_ROWS, moves + 1 - lo)
        rows = np.minimum(np.arange(lo, lo + (1 << (n - 1).bit_length()), dtype=np.int64), moves)
        stacks = stack_frames(arrays["observation"], rows, rows, frame_stack)
        chunks.append(network(torch.from_numpy(stacks)).double().numpy()[:n])
    q = np.concatenate(chunks)  # (T+1, A)
    q_sa = q[slots, t["action"]]
    nxt = slots + np.minimum(n_step, moves - slots)  # the rows of s_{t+m}
    bootstrap = np.where(t["done"], 0.0, q[nxt].max(axis=1))
    return np.abs(t["reward"] + t["discount"] * bootstrap - q_sa)


# --------------------------------------------------------------------------------------
# 4. Acting
# --------------------------------------------------------------------------------------


class DQNEpisode(EpisodeRows):
    """One episode as buffer rows: T moves, T + 1 rows (see the module docstring)."""

    def arrays(self) -> dict[str, np.ndarray]:
        """Rows for ``ReplayBuffer.add_episode`` with ``dqn_schema``: the common rows."""
        return self.rows()


class EpsilonGreedyPlayer:
    """Steps K environments with one batched forward pass per step.

    Args:
        config: the run config (``dqn`` section).
        envs: K gymnasium environments.
        network: a QNetwork on the CPU, in eval mode (the actor's copy of the weights).
        explore: epsilon-greedy as configured; without it, greedy (evaluation).
        seed: seeds the first reset of env k with ``seed + k``, and the action noise.
        actor_index / num_actors: this player's first env's index among all actors and
            their number (Ape-X: each env of each worker is one actor with its own
            constant epsilon).
    """

    def __init__(self, config: DQNRunConfig, envs: list, network: QNetwork, explore: bool, seed: int,
                 actor_index: int = 0, num_actors: int = 1) -> None:  # fmt: skip
        self.config = config.dqn
        self.replay = config.replay
        self.envs = envs
        self.network = network
        self.explore = explore
        self.num_actions = int(envs[0].action_space.n)
        self.rng = np.random.default_rng(seed)
        self.steps = 0  # actions taken by each env (the decay schedule's clock)
        d = self.config
        if explore and d.exploration == "apex":
            self.epsilons = apex_epsilons(d.apex_epsilon, d.apex_alpha, num_actors)[actor_index : actor_index + len(envs)]
        else:
            self.epsilons = np.zeros(len(envs))
        self.episodes = [self._reset(k, seed + k) for k in range(len(envs))]

    def _reset(self, k: int, seed: int | None = None) -> DQNEpisode:
        obs, _ = self.envs[k].reset(seed=seed)
        return DQNEpisode(observation=[as_stored(obs)])

    def current_epsilons(self) -> np.ndarray:
        """Epsilon of each env for the next step (K,)."""
        d = self.config
        if self.explore and d.exploration == "decay":
            return np.full(len(self.envs), decayed_epsilon(d.epsilon_start, d.epsilon_end, d.epsilon_decay, self.steps))
        return self.epsilons

    @torch.no_grad()
    def step(self, progress: float = 0.0, training_step: int = 0) -> list[DQNEpisode]:
        """Act and step every env once; returns the episodes that just ended (their
        envs are reset and play on). ``progress`` (share of training done) is unused:
        epsilon follows the actor's own clock; so is ``training_step`` (DQN's rows
        store no weights step)."""
        greedy = self.greedy_actions(np.stack([self.network_input(ep) for ep in self.episodes]))
        explore = self.rng.random(len(self.envs)) < self.current_epsilons()
        actions = np.where(explore, self.rng.integers(0, self.num_actions, len(self.envs)), greedy)
        self.steps += 1
        finished = []
        for k, (env, ep) in enumerate(zip(self.envs, self.episodes)):
            obs, reward, terminated, truncated, _ = env.step(int(actions[k]))
            ep.observation.append(as_stored(obs))
            ep.action.append(int(actions[k]))
            ep.reward.append(float(reward))
            if terminated or truncated:
                ep.terminated = bool(terminated)  # truncated: the last transition bootstraps
                finished.append(ep)
                self.episodes[k] = self._reset(k)
        return finished

    @torch.no_grad()
    def greedy_actions(self, observations: np.ndarray, legal=None, to_play=None) -> np.ndarray:
        """The argmax-Q actions (N,) int64 of N network inputs ``observations``
        (N, *observation_shape) (stacked as the network expects); ``legal`` and
        ``to_play`` are not used (DQN plays one-player envs with every action legal)."""
        return self.network(torch.from_numpy(np.ascontiguousarray(observations))).argmax(dim=1).numpy()

    def stored(self, ep: DQNEpisode) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """(rows, raw priorities or None) to hand to ``ReplayBuffer.add_episode``:
        with ``replay.initial_priority`` "actor", Ape-X's initial priorities (|TD| with
        this actor's weights, clipped like the learner's: the buffer applies
        ``dqn.priority_clip`` to both); otherwise None (the buffer's own rule)."""
        arrays = ep.arrays()
        d = self.config
        if self.replay.initial_priority != "actor":
            return arrays, None
        return arrays, td_errors(self.network, arrays, ep.terminated, d.n_step, d.gamma, d.frame_stack)

    def network_input(self, ep: DQNEpisode) -> np.ndarray:
        """The stack of the episode's last ``dqn.frame_stack`` frames, built as the
        learner's batches build it (``stack_frames`` on the episode's own rows)."""
        k = self.config.frame_stack
        if k == 1:
            return ep.observation[-1]
        frames = np.stack(ep.observation[-k:])
        t = np.array([len(ep.observation) - 1])
        return stack_frames(frames, np.array([len(frames) - 1]), t, k)[0]


# --------------------------------------------------------------------------------------
# 5. The update
# --------------------------------------------------------------------------------------


class DQNTrainer(Trainer[DQNRunConfig]):
    """The online network (with its optimizer, step counter and learning-rate schedule:
    ``mpper.algos.base.Trainer``) and its target copy.

    ``train_step(batch)`` is one update on a batch sampled with ``NStepTargets``; it
    returns the metrics and the new raw priorities ``|TD|`` of the sampled transitions
    (the run's buffer adds ``priority_eps``, clips at ``dqn.priority_clip`` and applies
    ``alpha``, for new and updated items alike: ``mpper.runtime.run.create_buffer``).
    """

    def __init__(self, config: DQNRunConfig, network: QNetwork, device: torch.device):
        super().__init__(config, network, device)
        self.dqn = config.dqn
        # A real copy (easy-rl's notebook's target_net is the very same object as policy_net, so it
        # has no target network at all); it never receives gradients.
        self.target_network = copy.deepcopy(self.network).requires_grad_(False)

    def adopt_weights(self, flat: np.ndarray) -> None:
        """The published weights, in the online network and (as a fresh start) the target."""
        super().adopt_weights(flat)
        self.sync_target()

    @torch.no_grad()
    def sync_target(self) -> None:
        """Hard update: the target network becomes a copy of the online network."""
        self.target_network.load_state_dict(self.network.state_dict())

    @torch.no_grad()
    def _soft_update(self, tau: float) -> None:
        for target, online in zip(self.target_network.parameters(), self.network.parameters()):
            target.lerp_(online, tau)

    def train_step(self, batch: Batch) -> tuple[dict[str, float], np.ndarray]:
        """One optimizer step; returns (metrics, raw priorities (B,) float64).

        ``batch.data`` (from ``NStepTargets``): observation and next_observation
        (B, *obs), action (B,), reward (B,) the n-step return, discount (B,) gamma^m,
        done (B,) bool; ``batch.weights`` (B,) importance weights.

        Raises FloatingPointError, before the optimizer step, if the loss or the
        gradient norm is not finite (weights, optimizer and counter unchanged).
        """
        d = self.dqn
        for group in self.optimizer.param_groups:
            group["lr"] = lr = self.learning_rate()
        x = self._to_device({**batch.data, "weights": batch.weights})
        b = x["action"].shape[0]
        if d.objective == "bc":
            return self._behaviour_cloning_step(x, lr)

        # One forward pass of the online net over s_t and s_{t+m} together; the second
        # half only picks the next action (double DQN) and gets no gradient.
        q_both = self.network(torch.cat([x["observation"], x["next_observation"]]).float())
        q = q_both[:b]  # (B, A)
        q_sa = q.gather(1, x["action"][:, None]).squeeze(1)  # (B,)
        with torch.no_grad():
            q_target_next = self.target_network(x["next_observation"].float())  # (B, A)
            if d.double:
                next_action = q_both[b:].argmax(dim=1, keepdim=True)
                q_next = q_target_next.gather(1, next_action).squeeze(1)
            else:
                q_next = q_target_next.max(dim=1).values
            # done: the episode terminated inside the window, so nothing follows; a
            # time-limit truncation is not done and bootstraps from s_{t+m}.
            target = x["reward"] + x["discount"] * q_next * (~x["done"]).float()
        td = q_sa - target
        # The importance weights multiply each sample's loss once (easy-rl's notebook's
        # mean((w * delta)^2) squares them).
        if d.loss == "huber":
            per_sample = F.smooth_l1_loss(q_sa, target, reduction="none", beta=1.0)
        else:
            per_sample = td.pow(2)
        cql = None
        if d.cql_alpha > 0:
            # CQL(H): push Q down everywhere (a soft maximum) and up on the data's action
            cql = torch.logsumexp(q, dim=1) - q_sa
            per_sample = per_sample + d.cql_alpha * cql
        loss = (per_sample * x["weights"]).mean()

        grad_norm = self.backward(loss, clip_value=d.grad_clip_value)  # clipped as configured
        with torch.no_grad():
            priorities = td.detach().abs()
            stats = torch.stack([loss.detach(), q_sa.detach().mean(), grad_norm.to(loss.dtype)])
            host = torch.cat([stats, priorities.to(stats.dtype)]).to("cpu", torch.float64).numpy()
        total, mean_q, norm = (float(v) for v in host[:3])
        if not math.isfinite(total):
            raise FloatingPointError(f"non-finite loss at training step {self.training_step}")
        if not math.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm at training step {self.training_step}")
        self.optimizer.step()
        self.training_step += 1
        if d.target_update == "soft":
            self._soft_update(d.tau)
        elif self.training_step % d.target_update_interval == 0:
            self.sync_target()
        priorities = host[3:].copy()
        metrics = {
            "total_loss": total,
            "mean_q": mean_q,
            "mean_abs_td": float(priorities.mean()),
            "grad_norm": norm,
            "lr": lr,
            "training_step": self.training_step,
        }
        if cql is not None:
            metrics["cql_loss"] = float((cql.detach() * x["weights"]).mean())
        return metrics, priorities

    def _behaviour_cloning_step(self, x: dict[str, torch.Tensor], lr: float) -> tuple[dict[str, float], np.ndarray]:
        """``dqn.objective`` "bc": one step on the cross-entropy of softmax(Q(s, .)) against
        the stored action, weighted by the importance weights; priorities: each sample's
        cross-entropy. The target network is not used."""
        q = self.network(x["observation"].float())  # (B, A), read as logits
        per_sample = F.cross_entropy(q, x["action"], reduction="none")
        loss = (per_sample * x["weights"]).mean()
        grad_norm = self.backward(loss, clip_value=self.dqn.grad_clip_value)
        with torch.no_grad():
            agree = (q.argmax(dim=1) == x["action"]).float().mean()
            stats = torch.stack([loss.detach(), q.detach().mean(), grad_norm.to(loss.dtype), agree])
            host = torch.cat([stats, per_sample.detach().to(stats.dtype)]).to("cpu", torch.float64).numpy()
        total, mean_q, norm, accuracy = (float(v) for v in host[:4])
        if not (math.isfinite(total) and math.isfinite(norm)):
            raise FloatingPointError(f"non-finite loss or gradient norm at training step {self.training_step}")
        self.optimizer.step()
        self.training_step += 1
        metrics = {"total_loss": total, "mean_q": mean_q, "bc_accuracy": accuracy, "grad_norm": norm, "lr": lr,
                   "training_step": self.training_step}  # fmt: skip
        return metrics, host[4:].copy()

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Online and target networks, optimizer and step counter (weights_only-safe)."""
        return {**super().state_dict(), "target_network": self.target_network.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "target_network" not in state:
            raise ValueError(f"DQN trainer state is missing ['target_network']; has {sorted(state)}")
        super().load_state_dict(state)
        self.target_network.load_state_dict(state["target_network"])
