"""Matches between two agents in a two-player env (the contract of :mod:`mpper.two_player`).

An agent is a function ``(observation, mask, to_play) -> action``: the env's observation
of the player to move, its bool legal-action mask ``(A,)`` and that player's number
(0 or 1). :func:`play_match` plays games between two of them and counts the results
from the first one's side. :func:`mcts_agent` turns a MuZero network into an agent
that plays greedily with the batched search (no noise, the most visited move), as the
evaluator does; :func:`load_mcts_agent` builds one from a run directory's checkpoint.
Reference opponents for TicTacToe are in :mod:`mpper.tictactoe` (``random_agent``,
``perfect_agent``).

Example::

    from mpper.arena import load_mcts_agent, play_match
    from mpper.tictactoe import TicTacToeEnv, perfect_agent

    agent, _ = load_mcts_agent("runs/tictactoe/20250101-120000")
    play_match(TicTacToeEnv, agent, perfect_agent(seed=0), agent_first=True, games=50, seed=0)
    # {'wins': 0, 'draws': 50, 'losses': 0}
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np

from .config import Config, load_config
from .envs import env_spec
from .learner import load_checkpoint
from .mcts import BatchedMCTS, select_action
from .networks import MuZeroNetwork, make_network
from .two_player import AgentFn

__all__ = ["AgentFn", "load_mcts_agent", "mcts_agent", "play_match"]

def play_match(
    env_factory: Callable[[], gym.Env],
    agent_fn: AgentFn,
    opponent_fn: AgentFn,
    agent_first: bool,
    games: int,
    seed: int,
) -> dict[str, int]:
    """Play ``games`` games of ``agent_fn`` against ``opponent_fn``; the agent's results.

    Args:
        env_factory: makes the env (called once; the env is reset for each game and
            closed at the end), e.g. ``TicTacToeEnv`` or ``lambda: gym.make(id)``.
        agent_fn, opponent_fn: ``(observation, mask, to_play) -> action``. Each is asked
            only when its side is to move, with ``info``'s ``action_mask`` and
            ``to_play``; an illegal answer raises ``ValueError`` naming the side.
        agent_first: the agent takes the side that moves first (``to_play`` at reset),
            else the other one.
        games: number of games (>= 0).
        seed: game ``g`` resets the env with ``seed + g``. The agents draw from their
            own generators (e.g. ``random_agent(seed)``), not from this one.

    Returns:
        ``{"wins": w, "draws": d, "losses": l}`` from the agent's side, ``w + d + l ==
        games``. Each reward is credited to the player who moved (the contract); a game
        is a win when the agent's rewards sum to more than the opponent's, a loss when to
        less, else a draw (a truncated game included). In TicTacToe that is the result
        of the last move.
    """
    if games < 0:
        raise ValueError(f"play_match: games must be >= 0, got {games}")
    results = {"wins": 0, "draws": 0, "losses": 0}
    env = env_factory()
    try:
        for g in range(games):
            obs, info = env.reset(seed=seed + g)
            first = int(info["to_play"])
            agent_side = first if agent_first else 1 - first
            score = 0.0  # agent's rewards minus the opponent's
            while True:
                mover = int(info["to_play"])
                mask = np.asarray(info["action_mask"], bool)
                is_agent = mover == agent_side
                action = int((agent_fn if is_agent else opponent_fn)(obs, mask, mover))
                if not (0 <= action < mask.shape[0] and mask[action]):
                    who = "agent_fn" if is_agent else "opponent_fn"
                    raise ValueError(f"play_match: {who} (player {mover}) chose illegal action {action} in game {g}; "
                                     f"legal: {np.flatnonzero(mask).tolist()}")  # fmt: skip
                obs, reward, terminated, truncated, info = env.step(action)
                score += float(reward) if is_agent else -float(reward)
                if terminated or truncated:
                    break
            results["wins" if score > 0 else "losses" if score < 0 else "draws"] += 1
    finally:
        env.close()
    return results


def mcts_agent(config: Config, network: MuZeroNetwork, seed: int = 0) -> AgentFn:
    """A greedy MuZero agent: one search of ``config.mcts.num_simulations`` simulations
    per move, no root noise, the most visited move (ties at random, generator seeded by
    ``seed``): how the evaluator and ``--evaluate`` play.

    Args:
        config: the run's config (``mcts``, ``network.support_size``).
        network: a ``MuZeroNetwork`` for this env; it is put in eval mode (BatchNorm
            must use its running statistics in the search).

    Needs ``training.stacked_observations == 0``: an agent sees one observation at a
    time, not the game's history.
    """
    if config.training.stacked_observations:
        raise ValueError(
            f"mcts_agent: training.stacked_observations = {config.training.stacked_observations}; an arena agent "
            "sees only the current observation, so only 0 is supported"
        )
    network.eval()
    search = BatchedMCTS(int(network.num_actions), config.mcts, config.network.support_size, two_player=True)
    rng = np.random.default_rng(seed)

    def act(observation: np.ndarray, mask: np.ndarray, to_play: int) -> int:
        result = search.run(
            network, np.asarray(observation, np.float32)[None], np.asarray(mask, bool)[None],
            np.array([to_play]), False, rng,
        )  # fmt: skip
        return int(select_action(result.visit_counts, 0.0, rng)[0])

    return act


def load_mcts_agent(run_dir: str | Path, checkpoint: str | Path | None = None, seed: int = 0) -> tuple[AgentFn, Config]:
    """:func:`mcts_agent` with the network of a run's checkpoint (default
    ``RUN_DIR/checkpoint.pt``) and the run's ``config.json``; returns (agent, config)."""
    run_dir = Path(run_dir)
    config = load_config(run_dir / "config.json")
    state = load_checkpoint(Path(checkpoint) if checkpoint is not None else run_dir / "checkpoint.pt")
    spec = env_spec(config.env)
    network = make_network(config.network, spec.observation_shape, spec.num_actions,
                           config.training.stacked_observations)  # fmt: skip
    network.load_state_dict(state["network"])
    return mcts_agent(config, network, seed), config
