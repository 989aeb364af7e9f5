"""Self-play's stored episodes: what a MuZero worker hands to the replay buffer, from real
CartPole envs and a real (random) network."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from mpper.algos.configs import default_config
from mpper.algos.muzero.config import NetworkConfig
from mpper.algos.muzero.networks import make_network, support_to_scalar
from mpper.algos.muzero.player import BatchedPlayer
from mpper.config import Config, EnvConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import seed_reference as ref  # noqa: E402

TIME_LIMIT = 12


def make_config() -> Config:
    c = default_config("muzero")
    return dataclasses.replace(
        c,
        env=EnvConfig(id="CartPole-v1", max_episode_steps=TIME_LIMIT),
        network=NetworkConfig(kind="fc", encoding_size=8, hidden=[16], support_size=5),
        mcts=dataclasses.replace(c.mcts, num_simulations=4),
        muzero=dataclasses.replace(c.muzero, td_steps=5, stacked_observations=0),
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


def play_until_games_end(config: Config, games: int, seed: int) -> tuple[list, torch.nn.Module]:
    """Everything one player of 3 real CartPole envs returns until ``games`` games
    ended, and the (random) network it played with."""
    torch.manual_seed(0)
    net = make_network(config.network, (4,), 2).eval()
    envs = [gym.make("CartPole-v1") for _ in range(3)]
    player = BatchedPlayer(config, envs, net, explore=True, seed=seed)
    returned = []
    while sum(ep.ends_game for ep in returned) < games:
        returned += player.step()
    return returned, net


def test_game_segments_are_the_whole_game_cut_into_pieces():
    """With ``muzero.game_segment_length`` L, self-play returns each game as pieces of L
    moves that, joined at the shared row, are the very game a player without segments
    plays from the same seed (same moves, search statistics and rewards); only the last
    piece ends the game, the others are truncated (they bootstrap) and store the
    network's value of their last observation, and ``game_return`` / ``game_moves`` of
    the last piece count the whole game."""
    length = 7
    whole = make_config()
    whole = dataclasses.replace(whole, env=EnvConfig(id="CartPole-v1"),
                                muzero=dataclasses.replace(whole.muzero, game_segment_length=None))
    cut = dataclasses.replace(whole, muzero=dataclasses.replace(whole.muzero, game_segment_length=length))
    games, _ = play_until_games_end(whole, 6, seed=11)
    pieces, net = play_until_games_end(cut, 6, seed=11)
    assert all(ep.ends_game for ep in games)

    # Group the pieces into games, in the order the games ended, by following each
    # piece's first row back to the piece that ended there.
    open_by_end: dict[tuple, list] = {}
    joined = []
    for ep in pieces:
        key = (ep.first_move, ep.observation[0].tobytes())
        chain = open_by_end.pop(key, []) + [ep]
        if ep.ends_game:
            joined.append(chain)
        else:
            open_by_end[(ep.game_moves, ep.observation[-1].tobytes())] = chain
    assert len(joined) >= 6 and any(len(chain) > 2 for chain in joined)

    by_first_obs = {ep.observation[0].tobytes(): ep for ep in games}
    for chain in joined:
        game = by_first_obs[chain[0].observation[0].tobytes()]
        assert chain[0].first_move == 0 and chain[0].reward_before == 0.0
        for before, after in zip(chain, chain[1:]):
            assert before.moves == length and not before.ends_game and not before.terminated
            assert after.first_move == before.game_moves and after.reward_before == before.game_return
            np.testing.assert_array_equal(after.observation[0], before.observation[-1])
            with torch.no_grad():  # the piece's row T: the network's value, as for a time limit
                logits = net.initial_inference(torch.from_numpy(before.observation[-1][None])).value_logits
            expected = float(support_to_scalar(logits, whole.network.support_size)[0])
            assert expected != 0.0 and np.isclose(before.final_value, expected, rtol=1e-5, atol=1e-6)
        last = chain[-1]
        assert last.ends_game and last.terminated == game.terminated
        assert last.game_moves == game.moves and last.game_return == game.total_reward
        actions = [a for ep in chain for a in ep.action[1:]]
        rewards = [r for ep in chain for r in ep.reward[1:]]
        visits = np.vstack([v for ep in chain for v in ep.child_visits])
        root_values = [v for ep in chain for v in ep.root_value]
        assert actions == game.action[1:] and rewards == game.reward[1:]
        np.testing.assert_array_equal(visits, np.vstack(game.child_visits))
        np.testing.assert_array_equal(root_values, game.root_value)


def test_game_segments_are_not_cut_in_greedy_play():
    """Evaluation (explore False) plays whole games whatever game_segment_length says."""
    config = make_config()
    config = dataclasses.replace(config, env=EnvConfig(id="CartPole-v1"),
                                 muzero=dataclasses.replace(config.muzero, game_segment_length=3))
    torch.manual_seed(0)
    net = make_network(config.network, (4,), 2).eval()
    player = BatchedPlayer(config, [gym.make("CartPole-v1") for _ in range(2)], net, explore=False, seed=0)
    ended = []
    while len(ended) < 4:
        ended += player.step()
    assert all(ep.ends_game and ep.first_move == 0 for ep in ended)
    assert max(ep.moves for ep in ended) > 3
