"""Self-play's stored episodes: what a MuZero worker hands to the replay buffer, from real
CartPole envs and a real (random) network."""

from __future__ import annotations

import dataclasses
import os
import sys

import gymnasium as gym
import numpy as np
import torch

from mpper.algos.configs import default_config
from mpper.algos.muzero.config import NetworkConfig
from mpper.algos.muzero.networks import make_network, support_to_scalar
from mpper.algos.muzero.player import BatchedPlayer
from mpper.config import Config, EnvConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed_reference as ref  # noqa: E402

TIME_LIMIT = 12


def make_config() -> Config:
    c = default_config("muzero")
    return dataclasses.replace(
        c,
        env=EnvConfig(id="CartPole-v1", max_episode_steps=TIME_LIMIT),
        sections={**c.sections, "network": NetworkConfig(kind="fc", encoding_size=8, hidden=[16], support_size=5),
                  "mcts": dataclasses.replace(c.mcts, num_simulations=4),
                  "muzero": dataclasses.replace(c.muzero, td_steps=5, stacked_observations=0)},
    )  # fmt: skip


def test_truncated_episodes_store_the_final_value_and_bootstrap_their_priorities():
    """An episode cut by the time limit stores the network's value of its final
    observation on row T (what its value targets bootstrap from), and its initial
    priorities use those targets; a terminated episode stores 0 there."""
    config = make_config()
    torch.manual_seed(0)
    net = make_network(config.network, (4,), 2).eval()
    envs = [gym.wrappers.TimeLimit(gym.make("CartPole-v1").unwrapped, TIME_LIMIT) for _ in range(6)]
    player = BatchedPlayer(config, envs, net, explore=True, seed=3)
    finished = []
    while not ({True, False} <= {ep.terminated for ep in finished}):
        finished += player.step()
    for ep in finished:
        arrays, priorities = player.stored(ep)
        T = ep.moves
        if ep.terminated:
            assert arrays["root_value"][T] == 0.0
        else:
            assert T == TIME_LIMIT
            with torch.no_grad():
                logits = net.initial_inference(torch.from_numpy(arrays["observation"][T : T + 1])).value_logits
            expected = float(support_to_scalar(logits, config.network.support_size)[0])
            assert expected != 0.0 and np.isclose(arrays["root_value"][T], expected, rtol=1e-5, atol=1e-6)
        # priorities: |root value - n-step target| with the episode's own ending rule
        episode = {k: arrays[k] for k in ("action", "reward", "to_play", "root_value")}
        targets = [ref.compute_target_value(episode, t, config.muzero.td_steps, config.mcts.discount,
                                            terminated=ep.terminated) for t in range(T)]  # fmt: skip
        np.testing.assert_allclose(priorities, np.abs(arrays["root_value"][:T] - np.array(targets)),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
