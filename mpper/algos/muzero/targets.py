"""MuZero's stored rows and the unroll targets built from them at sample time.

Episode layout (muzero-general's GameHistory, one row per observation): an episode of
``T`` moves is ``T + 1`` rows; row ``i`` holds observation ``o_i``, the action
``a_{i-1}`` that led to it and the reward ``r_i`` received on arriving (row 0 holds
placeholders), the player to move at ``o_i`` and the search statistics at ``o_i``.
A sampled position is a slot ``s`` with position ``t = s - start`` in ``0 .. T-1``.
The loops over the batch run in numba kernels; nothing loops over batch items in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

from ...replay.schema import Schema
from ...replay.targets import gather_rows

__all__ = ["REANALYSE_COUNTERS", "WEIGHTS_STEP", "MuZeroTargets", "latest_stacked_observation", "muzero_schema",
           "stacked_observations", "value_prefix_targets"]

# The buffer counters MuZero's schema declares: reanalysed episodes stored, and dropped
# (rewritten since they were read).
REANALYSE_COUNTERS = ("reanalysed_episodes", "reanalysed_dropped")
# The field of the training step of the weights that searched a row (the off-policy
# correction's T_st), and what the kernel reads where a buffer has none (the correction off).
WEIGHTS_STEP = "weights_step"
_NO_STEPS = np.zeros(1, np.int64)


@numba.njit(cache=True, nogil=True)
def _signed_reward(reward, to_play, start, j, player):
    """r_j seen by ``player``: negated when the mover at j - 1 was the other player."""
    r = reward[start + j]
    return r if to_play[start + j - 1] == player else -r


@numba.njit(cache=True, nogil=True)
def _muzero_kernel(
    slots, pos, moves, terminated, root_value, reanalysed, use_reanalysed, reward, to_play, child_visits,
    reanalysed_policy, use_reanalysed_policy, action, num_unroll_steps, td_steps, discount,
    off_policy, weights_step, training_step, age_window, random_uniform,
    out_value, out_reward, out_policy, out_action, out_scale, out_mask, out_policy_mask,
):  # fmt: skip
    """Per sampled position and unroll step k = 0..K: muzero-general's ``make_target``.

    For index ``i = t + k`` of an episode with T moves:
      i <  T: value = compute_target_value(i), reward r_i, policy pi_i, action a_i
      i == T: value 0 (terminated) or v_T (truncated), reward r_T, uniform policy, action a_T
      i >  T: value 0, reward 0, uniform policy, random action (absorbing state)
    compute_target_value(i) = sum_{j=i+1}^{min(i+td, T)} discount^(j-i-1) * (+/-) r_j
                              + discount^td * (+/-) v_{i+td}    if i + td < T
                              + discount^(T-i) * (+/-) v_T      if i + td >= T and the
                                                                episode was truncated
    with the sign of r_j flipped when the player who moved at j - 1 is not the player to
    move at i, that of v when the player to move at the bootstrap row is not, and v the
    reanalysed value where one is stored, else the root value; pi_i the reanalysed policy
    where one is stored (a search with newer weights), else the self-play search's
    child_visits. Players are 0 and 1 (one- or two-player games).

    The truncated case departs from muzero-general, which treats every episode end as
    terminal: an episode cut by a time limit (CartPole at 500 moves), or a piece of a
    game that goes on (``muzero.game_segment_length``), did not end in an absorbing
    state, and a target that ignores everything after the cut teaches the last
    ``td_steps`` positions that the pole falls. Row T's value (the network's value of
    the final observation, refreshed by the reanalyser) stands in for the rest, and the
    unroll stops at the cut: ``out_mask`` (value and reward) is 0 for i > T and
    ``out_policy_mask`` for i >= T, where nothing was recorded (1 everywhere else,
    and for terminated episodes, whose absorbing targets are muzero-general's).

    The reward sums of consecutive unroll steps share all but two terms, so they are
    computed once at the last index and then backwards with
    A(i) = r_{i+1} + discount * A(i+1) - discount^td * r_{i+1+td}: O(td + K) per
    position instead of O(td * K). A is kept from the view of the player p0 to move at
    t and turned to the view of the player at i at the end.

    With ``off_policy`` (EfficientZero's off-policy correction) ``td`` above is, for all
    K + 1 unroll steps of position t, the horizon
    l = clip(td_steps - floor((training_step - weights_step[t]) / age_window), 1, td_steps):
    ``weights_step[t]`` the training step of the weights that searched o_t, ``age_window``
    tau * T_total in training steps (float). Without it, td = td_steps.
    """
    batch = slots.shape[0]
    num_actions = out_policy.shape[2]
    uniform = 1.0 / num_actions
    sums = np.empty(num_unroll_steps + 1)
    for b in range(batch):
        t = pos[b]
        big_t = moves[b]
        start = slots[b] - t
        td = td_steps
        if off_policy:  # data searched long ago trusts fewer of its rewards (older policy's moves)
            horizon = td_steps - np.floor((training_step - weights_step[slots[b]]) / age_window)
            if horizon < td_steps:  # compared as floats: no integer conversion of a huge age
                td = 1 if horizon <= 1.0 else int(horizon)
        discount_td = discount**td
        p0 = to_play[start + t]
        scale = min(num_unroll_steps, big_t + 1 - t)
        v_end = 0.0  # the bootstrap value of row T (truncated episodes only)
        if not terminated[b]:
            v_end = root_value[start + big_t]
            if use_reanalysed:
                rv = reanalysed[start + big_t]
                if rv == rv:
                    v_end = rv
        # reward sums A(i) for i = t .. last (positions before the episode's end)
        last = min(t + num_unroll_steps, big_t - 1)
        acc = 0.0
        g = 1.0
        for j in range(last + 1, min(last + td, big_t) + 1):
            acc += g * _signed_reward(reward, to_play, start, j, p0)
            g *= discount
        sums[last - t] = acc
        for i in range(last - 1, t - 1, -1):
            acc = _signed_reward(reward, to_play, start, i + 1, p0) + discount * acc
            if i + 1 + td <= big_t:
                acc -= discount_td * _signed_reward(reward, to_play, start, i + 1 + td, p0)
            sums[i - t] = acc
        for k in range(num_unroll_steps + 1):
            i = t + k
            out_scale[b, k] = scale
            out_mask[b, k] = 1.0 if terminated[b] or i <= big_t else 0.0
            out_policy_mask[b, k] = 1.0 if terminated[b] or i < big_t else 0.0
            if i < big_t:
                player = to_play[start + i]
                value = sums[k] if player == p0 else -sums[k]
                boot = i + td
                if boot < big_t:
                    v = root_value[start + boot]
                    if use_reanalysed:
                        rv = reanalysed[start + boot]
                        if rv == rv:  # not NaN: a reanalysed value is stored
                            v = rv
                    value += (v if to_play[start + boot] == player else -v) * discount_td
                elif not terminated[b]:
                    v = v_end if to_play[start + big_t] == player else -v_end
                    value += v * discount ** (big_t - i)
                out_value[b, k] = value
                out_reward[b, k] = reward[start + i]
                # A reanalysed policy where one is stored: no NaN in the row (every entry
                # checked, since the reanalyser may be writing the row's first one now).
                fresh = use_reanalysed_policy
                if fresh:
                    for a in range(num_actions):
                        p = reanalysed_policy[start + i, a]
                        if p != p:
                            fresh = False
                            break
                for a in range(num_actions):
                    out_policy[b, k, a] = reanalysed_policy[start + i, a] if fresh else child_visits[start + i, a]
                out_action[b, k] = action[start + i]
            else:
                out_value[b, k] = 0.0
                for a in range(num_actions):
                    out_policy[b, k, a] = uniform
                if i == big_t:
                    if not terminated[b]:  # the value of o_T, seen by the player to move there
                        out_value[b, k] = v_end
                    out_reward[b, k] = reward[start + i]
                    out_action[b, k] = action[start + i]
                else:
                    out_reward[b, k] = 0.0
                    out_action[b, k] = min(int(random_uniform[b, k] * num_actions), num_actions - 1)


def value_prefix_targets(target_reward: np.ndarray, lstm_horizon_len: int) -> np.ndarray:
    """EfficientZero's value-prefix targets from the reward targets (B, K+1) of the unroll
    (column k: the reward of the k-th action; column 0, before any action, is left as
    it is and not trained): column k >= 1 becomes the sum of the rewards of steps
    ``j0 + 1 .. k``, where ``j0`` is the last multiple of ``lstm_horizon_len`` below k, the
    step after which the LSTM was last reset. Past an episode's end the rewards are 0,
    so the sum holds until the next reset. A new array, same dtype."""
    prefix = np.array(target_reward, copy=True)
    for k in range(2, prefix.shape[1]):  # a loop over unroll depth, not over the batch
        if (k - 1) % lstm_horizon_len != 0:
            prefix[:, k] += prefix[:, k - 1]
    return prefix


def stacked_observations(
    observation: np.ndarray, action: np.ndarray, slots: np.ndarray, pos: np.ndarray,
    num_stacked: int, num_actions: int,
) -> np.ndarray:  # fmt: skip
    """muzero-general's ``get_stacked_observations`` for a batch, float32.

    Output channels (axis 1): the current observation, then for each past p = t-1 ..
    t-num_stacked the observation o_p followed by one plane filled with
    ``a_{p+1} / num_actions`` (the action taken at p); zeros before the episode start.
    For observations of shape (C, ...) the result is (B, C + num_stacked * (C + 1), ...).
    """
    current = gather_rows(observation, slots).astype(np.float32, copy=False)
    if num_stacked == 0:
        return current
    batch = slots.shape[0]
    channels = observation.shape[1]
    rest = observation.shape[2:]
    out = np.zeros((batch, channels + num_stacked * (channels + 1), *rest), np.float32)
    out[:, :channels] = current
    for s in range(1, num_stacked + 1):  # a loop over stack depth, not over the batch
        valid = pos >= s
        past = np.where(valid, slots - s, slots)
        base = channels + (s - 1) * (channels + 1)
        out[:, base : base + channels] = observation[past] * valid.reshape((-1,) + (1,) * (1 + len(rest)))
        took = np.where(valid, slots - s + 1, slots)  # row of a_p, the action taken at p
        plane = action[took].astype(np.float32) / num_actions * valid
        out[:, base + channels] = plane.reshape((-1,) + (1,) * len(rest))
    return out


def latest_stacked_observation(observations: list, actions: list, num_stacked: int, num_actions: int) -> np.ndarray:
    """The network input at the last of an episode's rows, :func:`stacked_observations`
    of row t for ``observations`` o_0 .. o_t and ``actions`` in row layout (``actions[i]``
    is a_{i-1}, row 0: 0), both t + 1 long. Only the last ``num_stacked + 1`` rows are
    read, so that a move late in a long game costs what the first does."""
    t = len(observations) - 1
    start = max(0, t - num_stacked)
    row = np.array([t - start])  # row t in the window, with every row of the window before it valid
    return stacked_observations(np.stack(observations[start:]), np.asarray(actions[start:], np.int64), row, row,
                                num_stacked, num_actions)[0]  # fmt: skip


@dataclass(frozen=True)
class MuZeroTargets:
    """muzero-general's targets (``make_target``, ``compute_target_value``, gradient
    scale, ``get_stacked_observations``) for a batch of sampled positions.

    Needs the fields observation, action, reward, to_play, root_value, child_visits;
    uses reanalysed_value and reanalysed_policy where the schema has them. Returns, with K = num_unroll_steps:
    observation (B, *stacked) float32, actions (B, K+1) int64, target_value,
    target_reward, gradient_scale (B, K+1) float32, target_policy (B, K+1, A) float32,
    target_mask and policy_mask (B, K+1) float32: 0 for the unroll steps past the cut
    of a truncated episode, whose targets are not to be trained on (see the kernel).

    With ``value_prefix_horizon`` (EfficientZero's value prefix, ``muzero.value_prefix``),
    target_reward holds the value prefixes instead (:func:`value_prefix_targets`).

    With ``next_observations`` (the consistency loss) also next_observation
    (B, K, *stacked) float32, the (stacked) observation ``o_{t+k}`` for k = 1..K, and
    next_observation_mask (B, K) float32: 1 where ``t + k <= T`` (the observation
    exists; row T is the episode's last), 0 past the end, where next_observation
    repeats ``o_T`` and is to be ignored.

    With ``off_policy_correction`` (EfficientZero, Ye et al. 2021, sec. 4.3 and its
    appendix): the value targets of a sampled position t bootstrap after
    l = clip(k - floor((T_current - T_st) / (tau * T_total)), 1, k) moves instead of
    k = ``td_steps``, with T_current the ``training_step`` passed to ``build`` (the
    learner's completed updates), T_st the ``weights_step`` field at t (the training step
    of the weights that searched o_t), T_total ``total_training_steps`` and tau
    ``auto_td_steps_ratio``; the same l for all K + 1 unroll steps, as EfficientZero. The
    bootstrap value at t + l is the stored one (reanalysed where refreshed), as for k.
    Age is measured in training steps, as the paper defines it; EfficientZero's code
    measures it in buffer transitions (the transitions stored since the game's, divided
    by tau * T_total) and clips l to [1, 5] whatever k is.
    """

    num_unroll_steps: int
    td_steps: int
    discount: float
    num_actions: int
    stacked_observations: int = 0
    next_observations: bool = False
    # The observations as the rows they are stacked from, for a learner that stacks them
    # on its device (``MuZeroTrainer.stack_frames``): see ``_add_frames``.
    stack_on_device: bool = False
    off_policy_correction: bool = False
    total_training_steps: int = 1  # T_total (training.training_steps)
    auto_td_steps_ratio: float = 0.3  # tau
    value_prefix_horizon: int | None = None  # muzero.lstm_horizon_len with muzero.value_prefix

    def __post_init__(self):
        if self.num_unroll_steps < 0 or self.td_steps < 1 or self.num_actions < 1:
            raise ValueError(
                f"MuZeroTargets needs num_unroll_steps >= 0, td_steps >= 1, num_actions >= 1; got {self}"
            )
        if self.off_policy_correction and not (self.total_training_steps >= 1 and self.auto_td_steps_ratio > 0):
            raise ValueError(f"MuZeroTargets' off-policy correction needs total_training_steps >= 1 and "
                             f"auto_td_steps_ratio > 0; got {self}")  # fmt: skip

    def build(self, fields, slots, pos, moves, terminated, rng, training_step: int | None = None):
        """``training_step``: the learner's completed updates, T_current of the
        off-policy correction (needed with it; ignored without)."""
        k1 = self.num_unroll_steps + 1
        batch = slots.shape[0]
        reanalysed = fields.get("reanalysed_value")
        reanalysed_policy = fields.get("reanalysed_policy")
        out = {
            "target_value": np.empty((batch, k1), np.float32),
            "target_reward": np.empty((batch, k1), np.float32),
            "target_policy": np.empty((batch, k1, self.num_actions), np.float32),
            "actions": np.empty((batch, k1), np.int64),
            "gradient_scale": np.empty((batch, k1), np.float32),
            "target_mask": np.empty((batch, k1), np.float32),
            "policy_mask": np.empty((batch, k1), np.float32),
        }
        weights_step = fields.get(WEIGHTS_STEP)
        if self.off_policy_correction and (training_step is None or weights_step is None):
            raise ValueError("MuZeroTargets' off-policy correction needs the learner's training_step and a "
                             "weights_step field")  # fmt: skip
        _muzero_kernel(
            slots, pos, moves, np.asarray(terminated, np.bool_), fields["root_value"],
            fields["root_value"] if reanalysed is None else reanalysed, reanalysed is not None,
            fields["reward"], fields["to_play"], fields["child_visits"],
            fields["child_visits"] if reanalysed_policy is None else reanalysed_policy, reanalysed_policy is not None,
            fields["action"],
            self.num_unroll_steps, self.td_steps, float(self.discount),
            self.off_policy_correction, _NO_STEPS if weights_step is None else weights_step,
            int(training_step or 0), float(self.auto_td_steps_ratio * self.total_training_steps),
            rng.random((batch, k1)),
            out["target_value"], out["target_reward"], out["target_policy"], out["actions"],
            out["gradient_scale"], out["target_mask"], out["policy_mask"],
        )  # fmt: skip
        if self.value_prefix_horizon is not None:
            out["target_reward"] = value_prefix_targets(out["target_reward"], self.value_prefix_horizon)
        if self.stack_on_device:
            self._add_frames(out, fields, slots, pos, np.asarray(moves))
            return out
        out["observation"] = stacked_observations(
            fields["observation"], fields["action"], slots, pos, self.stacked_observations, self.num_actions
        )
        if self.next_observations:
            self._add_next_observations(out, fields, slots, pos, np.asarray(moves))
        return out

    def _add_frames(self, out, fields, slots, pos, moves) -> None:
        """Instead of the stacked observations (float32, ``stacked_observations + 1`` rows
        each, ``K + 1`` of them with the consistency loss), the rows they are made of, in
        the stored dtype, each once: with n = stacked_observations and K' = K with
        ``next_observations`` (else 0), the window of rows t - n .. t + K' of each sampled
        position t, clamped into its episode (rows 0 .. T):

        frames (B, n + 1 + K', *obs) stored dtype, frame_actions (B, n + 1 + K') int64 (the
        action column of those rows: a_{r-1} on row r), frame_position (B,) int64 (t) and
        frame_ahead (B, K') int64 (min(k, T - t) for k = 1..K', the row of o_{t+k} past the
        end being T), and with ``next_observations`` next_observation_mask (B, K) as
        ``_add_next_observations`` gives it. ``MuZeroTrainer.stack_frames`` makes the same
        observation and next_observation of them."""
        n = self.stacked_observations
        k = self.num_unroll_steps if self.next_observations else 0
        offsets = np.arange(-n, k + 1)
        # an episode's rows are contiguous in the ring: row r of the episode is slot - pos + r
        ahead_rows = np.clip(offsets[None, :], -pos[:, None], (moves - pos)[:, None])  # (B, W)
        rows = slots[:, None] + ahead_rows
        out["frames"] = fields["observation"][rows]
        out["frame_actions"] = fields["action"][rows].astype(np.int64, copy=False)
        out["frame_position"] = pos.astype(np.int64)
        steps = np.arange(1, k + 1)
        out["frame_ahead"] = (np.minimum(pos[:, None] + steps[None, :], moves[:, None]) - pos[:, None]).astype(np.int64)
        if self.next_observations:
            out["next_observation_mask"] = (pos[:, None] + steps[None, :] <= moves[:, None]).astype(np.float32)

    def _add_next_observations(self, out, fields, slots, pos, moves) -> None:
        """``o_{t+k}`` for k = 1..K (an episode's rows are contiguous in the ring, so the
        row of ``o_{t+k}`` is slot + k), clamped to row T past the episode's end."""
        k = self.num_unroll_steps
        batch = slots.shape[0]
        rows = []
        steps = np.arange(1, k + 1)
        ahead = np.minimum(pos[:, None] + steps[None, :], moves[:, None]) - pos[:, None]  # (B, K), <= T - t
        for j in range(k):  # a loop over unroll depth, not over the batch
            rows.append(stacked_observations(
                fields["observation"], fields["action"], slots + ahead[:, j], pos + ahead[:, j],
                self.stacked_observations, self.num_actions,
            ))  # fmt: skip
        shape = out["observation"].shape[1:]
        out["next_observation"] = np.stack(rows, 1) if rows else np.empty((batch, 0, *shape), np.float32)
        out["next_observation_mask"] = (pos[:, None] + steps[None, :] <= moves[:, None]).astype(np.float32)


def muzero_schema(observation_shape: Sequence[int], num_actions: int, observation_dtype="float32") -> Schema:
    """Fields MuZero self-play stores per row (see ``mpper.replay.targets`` for the layout),
    and the reanalyser's counters."""
    fields = {
        "observation": (tuple(observation_shape), observation_dtype),
        "action": ((), "int64"),
        "reward": ((), "float32"),
        "to_play": ((), "int8"),
        "root_value": ((), "float32"),
        "child_visits": ((num_actions,), "float32"),
        "legal_actions": ((num_actions,), "bool", 1.0),  # the mask the search had (row T: all)
        "reanalysed_value": ((), "float32", float("nan")),  # NaN: not reanalysed yet
        "reanalysed_policy": ((num_actions,), "float32", float("nan")),  # NaN: not searched again yet
        # the training step of the weights that searched o_i (row T: those of the last move);
        # T_st of the off-policy correction. 0 in snapshots written before it was stored.
        WEIGHTS_STEP: ((), "int64", 0.0),
    }
    return Schema(fields, counters=REANALYSE_COUNTERS, optional=(WEIGHTS_STEP,))
