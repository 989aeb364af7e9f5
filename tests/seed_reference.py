"""Plain, loop-by-loop reference for muzero-general's training targets.

Used by tests/algos/muzero/test_targets.py as the oracle for the vectorised targets that
``mpper.ReplayBuffer.sample`` builds.  It is written for clarity, not speed:
one episode, one position, Python loops, float64 arithmetic.

An episode is a dict of numpy arrays in the row layout of docs/replay_api.md
(muzero-general's GameHistory layout).  An episode of T moves has L = T + 1 rows:

    observation   (T+1, *obs_shape)  o_0 .. o_T
    action        (T+1,)             row i: the action a_{i-1} that led to o_i (row 0: 0)
    reward        (T+1,)             row i: reward received on arriving at o_i (row 0: 0)
    to_play       (T+1,)             player to move at o_i
    root_value    (T,) or (T+1,)     search value at o_i; row T: the value of the final
                                     observation, read only for a truncated episode
    child_visits  (T,) or (T+1, A)   search policy at o_i; row T (if present) is never read
    reanalysed_value (optional)      same length as root_value, NaN = not reanalysed
    reanalysed_policy (optional)     like child_visits, a row of NaN = not searched again

T is taken from the action array: T = len(action) - 1.

Correspondence with muzero-general (seed: /work/shared/seeds/
muzero_general_replay_buffer.py.txt):
    len(game_history.root_values)     == T
    len(game_history.action_history)  == T + 1
    reward_history, to_play_history, observation_history have T + 1 entries.

Two deliberate differences from muzero-general's replay buffer: it either has no
reanalysed values for a game or a whole array of them; here reanalysis is per
slot (NaN = not reanalysed), so the bootstrap value at slot j is the
reanalysed value at j when it is not NaN, else the root value at j (and the policy
target at i the reanalysed policy at i where one is stored: EfficientZero's reanalyse,
which muzero-general lacks). And it treats
every episode end as terminal; here an episode cut by a time limit (``terminated``
False) bootstraps from the value of its final observation (row T) wherever the
n-step window reaches the end.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "episode_length",
    "bootstrap_value",
    "compute_target_value",
    "policy_target",
    "make_target",
    "gradient_scale",
    "get_stacked_observations",
    "nstep_transition",
]


def episode_length(ep) -> int:
    """Number of moves T of an episode (it has T + 1 rows)."""
    return len(ep["action"]) - 1


def bootstrap_value(ep, j: int) -> float:
    """Value used to bootstrap at slot j: reanalysed where stored (not NaN), else root."""
    rean = ep.get("reanalysed_value")
    if rean is not None:
        r = float(rean[j])
        if not math.isnan(r):
            return r
    return float(ep["root_value"][j])


def policy_target(ep, i: int) -> np.ndarray:
    """Policy target at position i: the reanalysed policy where one is stored (no NaN
    in the row), else the self-play search's child_visits."""
    rean = ep.get("reanalysed_policy")
    if rean is not None and not np.isnan(rean[i]).any():
        return rean[i]
    return ep["child_visits"][i]


def compute_target_value(ep, index: int, td_steps: int, discount: float, terminated: bool = True) -> float:
    """n-step value target at position `index`, as muzero-general's ReplayBuffer.compute_target_value.

    value = (+/-) v[index + td_steps] * discount**td_steps      if index + td_steps < T,
            (+/-) v[T] * discount**(T - index)                  else if truncated (not
                                                                `terminated`), else 0
          + sum_i (+/-) reward[index + 1 + i] * discount**i     for the rewards that exist
    The bootstrap value is negated when to_play at the bootstrap slot differs from to_play
    at `index`; reward index+1+i is negated when to_play[index + i] differs from
    to_play[index] (the seed compares with index + i, not index + 1 + i; kept as is).
    """
    T = episode_length(ep)
    to_play = ep["to_play"]
    reward = ep["reward"]

    bootstrap_index = index + td_steps
    if bootstrap_index < T:
        v = bootstrap_value(ep, bootstrap_index)
        if to_play[bootstrap_index] != to_play[index]:
            v = -v
        value = v * discount**td_steps
    elif not terminated and index <= T:
        # cut by a time limit: the final observation's value stands for the rest
        v = bootstrap_value(ep, T)
        if to_play[T] != to_play[index]:
            v = -v
        value = v * discount ** (T - index)
    else:
        # past the end (or exactly at the final observation): no bootstrap
        value = 0.0

    # The seed iterates over reward_history[index + 1 : bootstrap_index + 1]; the slice is
    # cut at the end of the episode (reward has T + 1 entries, so the last usable row is T).
    for i in range(td_steps):
        j = index + 1 + i
        if j > T:
            break
        r = float(reward[j])
        if to_play[index] != to_play[index + i]:
            r = -r
        value += r * discount**i
    return float(value)


def make_target(ep, state_index: int, num_unroll_steps: int, td_steps: int,
                discount: float, num_actions: int, terminated: bool = True):
    """Targets for the unroll starting at `state_index`, as muzero-general's make_target.

    Returns (values, rewards, policies, actions) as numpy arrays of shapes
    (K+1,), (K+1,), (K+1, A), (K+1,) with K = num_unroll_steps.  For unroll slots past
    the final observation (index > T) muzero-general draws a random action; here the
    action is -1 there, so that callers can skip it (and check the range instead).
    """
    T = episode_length(ep)
    values, rewards, policies, actions = [], [], [], []
    uniform = [1.0 / num_actions] * num_actions
    for current_index in range(state_index, state_index + num_unroll_steps + 1):
        value = compute_target_value(ep, current_index, td_steps, discount, terminated)
        if current_index < T:
            values.append(value)
            rewards.append(float(ep["reward"][current_index]))
            policies.append([float(p) for p in policy_target(ep, current_index)])
            actions.append(int(ep["action"][current_index]))
        elif current_index == T:
            # final observation: value 0 (terminated) or its own value (truncated), the
            # reward that led there, uniform policy
            values.append(0.0 if terminated else value)
            rewards.append(float(ep["reward"][current_index]))
            policies.append(list(uniform))
            actions.append(int(ep["action"][current_index]))
        else:
            # absorbing states past the end of the game
            values.append(0.0)
            rewards.append(0.0)
            policies.append(list(uniform))
            actions.append(-1)  # random in the seed
    return (
        np.array(values, dtype=np.float64),
        np.array(rewards, dtype=np.float64),
        np.array(policies, dtype=np.float64).reshape(num_unroll_steps + 1, num_actions),
        np.array(actions, dtype=np.int64),
    )


def gradient_scale(T: int, state_index: int, num_unroll_steps: int) -> np.ndarray:
    """muzero-general's gradient scale: min(K, len(action_history) - t), repeated K+1 times.

    len(action_history) is T + 1 in the row layout.
    """
    scale = min(num_unroll_steps, (T + 1) - state_index)
    return np.array([scale] * (num_unroll_steps + 1), dtype=np.float64)


def get_stacked_observations(ep, index: int, num_stacked: int, num_actions: int) -> np.ndarray:
    """muzero-general's GameHistory.get_stacked_observations(index, num_stacked, action_space_size).

    Verified against muzero-general's self_play.py (GameHistory, the 3-argument version that
    divides the action plane by action_space_size):
      * index is first taken modulo len(observation_history) (a no-op for 0 <= index <= T);
      * start from a copy of observation[index];
      * for past_observation_index in reversed(range(index - num_stacked, index)), i.e.
        index-1 down to index-num_stacked, concatenate along axis 0:
          - if past >= 0: observation[past] followed by the plane
            [ones_like(stacked[0]) * action_history[past + 1] / action_space_size]
          - else: zeros_like(observation[index]) followed by [zeros_like(stacked[0])];
      * `stacked[0]` is the first sub-array of the current observation along axis 0, so the
        plane has shape obs_shape[1:] (a single scalar for 1-D observations, giving one extra
        element); output shape (C + N * (C + 1), *obs_shape[1:]).
    Older muzero-general versions (2-argument signature) did not divide by action_space_size;
    the seed's get_batch calls the 3-argument version, which is the one reproduced here.
    Computed in float64.
    """
    observation = ep["observation"]
    action = ep["action"]
    n_rows = len(observation)
    index = index % n_rows

    current = np.array(observation[index], dtype=np.float64)
    plane_shape = current.shape[1:]
    parts = [current]
    past = index - 1
    while past >= index - num_stacked:
        if past >= 0:
            obs_p = np.array(observation[past], dtype=np.float64)
            plane = np.ones(plane_shape, dtype=np.float64) * float(action[past + 1]) / num_actions
        else:
            obs_p = np.zeros(current.shape, dtype=np.float64)
            plane = np.zeros(plane_shape, dtype=np.float64)
        parts.append(obs_p)
        parts.append(plane[np.newaxis, ...])
        past -= 1
    return np.concatenate(parts, axis=0)


def nstep_transition(ep, t: int, n: int, gamma: float, terminated: bool):
    """DQN n-step transition from position t (0 <= t < T) in the row layout.

    s_t = observation[t], a_t = action[t + 1] (the action taken at o_t),
    m = min(n, T - t), R = sum_{i<m} gamma**i * reward[t + 1 + i], discount = gamma**m,
    s' = observation[t + m], done = terminated and t + m == T.
    Returns a dict with keys observation, action, reward, discount, next_observation, done.
    """
    T = episode_length(ep)
    if not 0 <= t < T:
        raise ValueError(f"position {t} is not sampleable in an episode of {T} moves")
    m = min(n, T - t)
    ret = 0.0
    for i in range(m):
        ret += gamma**i * float(ep["reward"][t + 1 + i])
    return {
        "observation": np.array(ep["observation"][t], dtype=np.float64),
        "action": int(ep["action"][t + 1]),
        "reward": ret,
        "discount": gamma**m,
        "next_observation": np.array(ep["observation"][t + m], dtype=np.float64),
        "done": bool(terminated and t + m == T),
    }
