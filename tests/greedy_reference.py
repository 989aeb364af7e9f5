"""Plain greedy CartPole play, the reference of the evaluation tests: one env at a time,
reset with the episode's seed, the action the argmax of a Q-network's output."""

from __future__ import annotations

import gymnasium as gym
import torch

from mpper.algos.dqn.dqn import QNetwork


def plain_returns(network: QNetwork, seeds) -> list[float]:
    """Greedy CartPole-v1 returns, one episode per seed, by a plain loop."""
    out = []
    for seed in seeds:
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                action = int(network(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total, done = total + reward, terminated or truncated
        out.append(total)
    return out


def network_where(condition, first_seed: int, episodes: int) -> tuple[QNetwork, list[float]]:
    """The first of a fixed series of random Q-networks (4 inputs, 2 actions, 16 hidden)
    whose greedy returns on seeds ``first_seed .. first_seed + episodes - 1`` satisfy
    ``condition``, with those returns."""
    for k in range(500):
        torch.manual_seed(k)
        network = QNetwork((4,), 2, [16]).eval()
        returns = plain_returns(network, range(first_seed, first_seed + episodes))
        if condition(returns):
            return network, returns
    raise AssertionError("no network of the series meets the condition")
