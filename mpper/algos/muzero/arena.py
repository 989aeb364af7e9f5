"""Matches between two agents in a two-player env (the contract of :mod:`mpper.envs.two_player`).

An agent is a function ``(observation, mask, to_play) -> action``: the env's observation
of the player to move, its bool legal-action mask ``(A,)`` and that player's number
(0 or 1). :func:`play_match` plays games between two of them and counts the results
from the first one's side. :func:`mcts_agent` turns a MuZero network into an agent
(an :class:`MCTSAgent`) that plays greedily with the batched search (no noise, the most
visited move), as the evaluator does; :func:`load_mcts_agent` builds one from a run
directory's checkpoint. Reference opponents for TicTacToe are in :mod:`mpper.envs.tictactoe`
(``random_agent``, ``perfect_agent``).

Batched play: when the agent is an :class:`MCTSAgent`, :func:`play_match` plays all its
games together, and every move of the agent, in every game where it is to move, comes
from ONE search (the ``run`` of ``mcts.kind``'s search over those games' roots); the opponent is asked
game by game. :func:`play_match_batched` is the same from a config and a network.
:func:`evaluate_against_opponents` is what the evaluator runs for a two-player env: a
number of games against each opponent the env provides (half as first player, half as
second), all in one batch.

Example::

    from mpper.algos.muzero.arena import load_mcts_agent, play_match
    from mpper.envs.tictactoe import TicTacToeEnv, perfect_agent

    agent, _ = load_mcts_agent("runs/tictactoe/20250101-120000")
    play_match(TicTacToeEnv, agent, perfect_agent(seed=0), agent_first=True, games=50, seed=0)
    # {'wins': 0, 'draws': 50, 'losses': 0}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import gymnasium as gym
import numpy as np

from ...checkpoint import checkpoint_budget, load_checkpoint, load_network_weights
from ...config import load_run_config
from ...envs.spec import env_spec, make_env
from ...envs.two_player import AgentFn
from .config import CONFIG, MuZeroRunConfig
from .mcts import select_action
from .networks import MuZeroNetwork, make_network
from .search import make_search
from .targets import latest_stacked_observation

__all__ = [
    "AgentFn",
    "MCTSAgent",
    "evaluate_against_opponents",
    "load_mcts_agent",
    "mcts_agent",
    "play_match",
    "play_match_batched",
]

RESULTS = ("wins", "draws", "losses")


class MCTSAgent:
    """A greedy MuZero agent: one search of ``config.mcts.num_simulations`` simulations
    per move, no root noise, the most visited move.

    Callable as an :data:`AgentFn` (one search per call), and batched:
    :meth:`act_batch` searches the positions of many games in one search ``run``.
    ``tie_break``: ``"random"`` draws among the most visited moves (generator seeded by
    ``seed``; what the evaluator does), ``"first"`` takes the lowest index (deterministic).
    The network is put in eval mode (BatchNorm must use its running statistics).
    """

    def __init__(self, config: MuZeroRunConfig, network: MuZeroNetwork, seed: int = 0,
                 tie_break: str = "random") -> None:
        if tie_break not in ("random", "first"):
            raise ValueError(f'MCTSAgent: tie_break must be "random" or "first", got {tie_break!r}')
        self.config = config
        self.network = network.eval()
        self.num_actions = int(network.num_actions)
        self.stacked = int(config.muzero.stacked_observations)
        self.search = make_search(self.num_actions, config.mcts, config.network.support_size, two_player=True)
        self.rng = np.random.default_rng(seed)
        self.tie_break = tie_break

    def act_batch(self, inputs: np.ndarray, masks: np.ndarray, to_play: np.ndarray) -> np.ndarray:
        """Actions (K,) for K positions: ``inputs`` (K, ...) the network inputs (stacked
        as ``muzero.stacked_observations`` says), ``masks`` (K, A) bool, ``to_play`` (K,)."""
        result = self.search.run(self.network, np.asarray(inputs, np.float32), np.asarray(masks, bool),
                                 np.asarray(to_play, np.int64), False, self.rng)  # fmt: skip
        if result.actions is not None:  # Gumbel, without noise: its greedy choice (no ties to break)
            return result.actions
        if self.tie_break == "first":
            return result.visit_counts.argmax(axis=1)
        return select_action(result.visit_counts, 0.0, self.rng)

    def network_input(self, observations: list, actions: list) -> np.ndarray:
        """The network input at the last of a game's ``observations`` (o_0 .. o_t), with
        ``actions`` (a_0 .. a_{t-1}) for the stacked planes; as self-play builds it."""
        if self.stacked == 0:
            return np.asarray(observations[-1], np.float32)
        return latest_stacked_observation(observations, [0, *actions], self.stacked, self.num_actions)

    def __call__(self, observation: np.ndarray, mask: np.ndarray, to_play: int) -> int:
        if self.stacked:
            raise ValueError(
                f"MCTSAgent: muzero.stacked_observations = {self.stacked}; called one position at a time, the "
                "agent sees no history: play it with play_match (batched, which keeps each game's history)"
            )
        return int(self.act_batch(np.asarray(observation)[None], np.asarray(mask, bool)[None], np.array([to_play]))[0])


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
        env_factory: makes the env, e.g. ``TicTacToeEnv`` or ``lambda: gym.make(id)``.
            Called once (the env is reset for each game) or, when the games are played
            batched, once per game; the envs are closed at the end.
        agent_fn, opponent_fn: ``(observation, mask, to_play) -> action``. Each is asked
            only when its side is to move, with ``info``'s ``action_mask`` and
            ``to_play``; an illegal answer raises ``ValueError`` naming the side. When
            ``agent_fn`` is an :class:`MCTSAgent` the games are played together and its
            moves in all of them come from one batched search per round (the results
            are those of playing them one by one when both sides are deterministic, e.g.
            ``tie_break="first"`` against ``perfect_agent(randomize=False)``).
        agent_first: the agent takes the side that moves first (``to_play`` at reset),
            else the other one.
        games: number of games (>= 0).
        seed: game ``g`` resets its env with ``seed + g``. The agents draw from their
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
    if isinstance(agent_fn, MCTSAgent):
        scores = play_games(env_factory, agent_fn, [opponent_fn] * games, [agent_first] * games,
                            [seed + g for g in range(games)])  # fmt: skip
        assert scores is not None  # None only when stopped, and no stop was given
        return _count(scores)
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
                _check_legal(action, mask, is_agent, mover, g)
                obs, reward, terminated, truncated, info = env.step(action)
                score += float(reward) if is_agent else -float(reward)
                if terminated or truncated:
                    break
            results[_result(score)] += 1
    finally:
        env.close()
    return results


def play_match_batched(config: MuZeroRunConfig, network: MuZeroNetwork, opponent: AgentFn, games: int,
                       agent_first: bool, seed: int, env_factory: Callable[[], gym.Env] | None = None,
                       tie_break: str = "random") -> dict[str, int]:  # fmt: skip
    """:func:`play_match` of a greedy :class:`MCTSAgent` (``network``, generator seeded
    by ``seed``) against ``opponent``, all ``games`` games together, in ``config.env``
    (or the envs ``env_factory`` makes)."""
    if games < 0:
        raise ValueError(f"play_match_batched: games must be >= 0, got {games}")
    agent = MCTSAgent(config, network, seed, tie_break)
    factory = env_factory if env_factory is not None else (lambda: make_env(config.env))
    return play_match(factory, agent, opponent, agent_first, games, seed)


def play_games(
    env_factory: Callable[[], gym.Env],
    agent: MCTSAgent,
    opponents: Sequence[AgentFn],
    agent_first: Sequence[bool],
    seeds: Sequence[int],
    stop=None,
) -> list[float] | None:
    """Play one game per entry of ``opponents`` (with ``agent_first[g]`` and reset seed
    ``seeds[g]``), all together: each round, one search for every game where the agent is
    to move, then each opponent move game by game, one move per unfinished game.
    Returns each game's score for the agent (its rewards minus the opponent's), or None
    when ``stop`` (anything with ``is_set()``) was set first."""
    games = len(opponents)
    if not len(agent_first) == len(seeds) == games:
        raise ValueError("play_games: opponents, agent_first and seeds must have the same length")
    envs: list[gym.Env] = []
    try:
        envs = [env_factory() for _ in range(games)]
        observations: list[list[np.ndarray]] = []
        actions: list[list[int]] = [[] for _ in range(games)]
        infos, sides = [], []
        for g, env in enumerate(envs):
            obs, info = env.reset(seed=int(seeds[g]))
            observations.append([np.asarray(obs, np.float32)])
            infos.append(info)
            first = int(info["to_play"])
            sides.append(first if agent_first[g] else 1 - first)
        scores = [0.0] * games
        playing = set(range(games))
        while playing:
            if stop is not None and stop.is_set():
                return None
            mine = sorted(g for g in playing if int(infos[g]["to_play"]) == sides[g])
            chosen: dict[int, int] = {}
            if mine:
                picked = agent.act_batch(
                    np.stack([agent.network_input(observations[g], actions[g]) for g in mine]),
                    np.stack([np.asarray(infos[g]["action_mask"], bool) for g in mine]),
                    np.array([int(infos[g]["to_play"]) for g in mine]),
                )  # fmt: skip
                chosen = {g: int(a) for g, a in zip(mine, picked)}
            for g in sorted(playing):
                mover = int(infos[g]["to_play"])
                mask = np.asarray(infos[g]["action_mask"], bool)
                is_agent = g in chosen
                action = chosen[g] if is_agent else int(opponents[g](observations[g][-1], mask, mover))
                _check_legal(action, mask, is_agent, mover, g)
                obs, reward, terminated, truncated, infos[g] = envs[g].step(action)
                observations[g].append(np.asarray(obs, np.float32))
                actions[g].append(action)
                scores[g] += float(reward) if is_agent else -float(reward)
                if terminated or truncated:
                    playing.discard(g)
        return scores
    finally:
        for env in envs:
            env.close()


def evaluate_against_opponents(config: MuZeroRunConfig, network: MuZeroNetwork, opponents: dict[str, AgentFn],
                               games: int, seed: int, env_factory: Callable[[], gym.Env] | None = None,
                               stop=None) -> dict | None:  # fmt: skip
    """The two-player evaluation: ``games`` games of a greedy :class:`MCTSAgent` against
    each opponent, ``ceil(games / 2)`` of them as the first player and the rest as the
    second, every game of every opponent played in one batch (reset seeds ``seed + g``).

    ``opponents``: name -> agent, weakest first; the LAST one sets the headline:
    ``mean_return`` is the agent's mean score against it (win +1, draw 0, loss -1) and
    ``returns`` those games' scores, so that ``runtime.solve_return``, the progress bar
    and ``best.pt`` work as for one-player envs. Returns None when ``stop`` was set first,
    else::

        {"mean_return": float, "returns": [...], "against": name,
         "opponents": {name: {"first": {"wins": w, "draws": d, "losses": l},
                              "second": {...}, "games": n, "score": mean score}}}
    """
    if not opponents:
        raise ValueError("evaluate_against_opponents: no opponent")
    n_first = (games + 1) // 2
    plan = [(name, g < n_first) for name in opponents for g in range(games)]
    agent = MCTSAgent(config, network, seed)
    factory = env_factory if env_factory is not None else (lambda: make_env(config.env))
    scores = play_games(factory, agent, [opponents[name] for name, _ in plan], [first for _, first in plan],
                        [seed + g for g in range(len(plan))], stop)  # fmt: skip
    if scores is None:
        return None
    report: dict[str, dict] = {}
    for name in opponents:
        mine = [(first, s) for (n, first), s in zip(plan, scores) if n == name]
        report[name] = {
            "first": _count([s for first, s in mine if first]),
            "second": _count([s for first, s in mine if not first]),
            "games": len(mine),
            "score": float(np.mean([np.sign(s) for _, s in mine])) if mine else 0.0,
        }
    last = list(opponents)[-1]
    returns = [float(np.sign(s)) for (n, _), s in zip(plan, scores) if n == last]
    return {"mean_return": report[last]["score"], "returns": returns, "against": last, "opponents": report}


def mcts_agent(config: MuZeroRunConfig, network: MuZeroNetwork, seed: int = 0, tie_break: str = "random") -> MCTSAgent:
    """A greedy MuZero agent (:class:`MCTSAgent`): one search of
    ``config.mcts.num_simulations`` simulations per move, no root noise, the most visited
    move (ties at random, generator seeded by ``seed``; ``tie_break="first"``: the lowest
    index): how the evaluator and ``--evaluate`` play.

    Args:
        config: the run's config (``mcts``, ``network.support_size``).
        network: a ``MuZeroNetwork`` for this env; it is put in eval mode (BatchNorm
            must use its running statistics in the search).

    Needs ``muzero.stacked_observations == 0``: an agent called one position at a
    time sees only the current observation, not the game's history (the batched path
    of :func:`play_match`, which keeps each game's history, could stack them).
    """
    if config.muzero.stacked_observations:
        raise ValueError(
            f"mcts_agent: muzero.stacked_observations = {config.muzero.stacked_observations}; an arena agent "
            "sees only the current observation, so only 0 is supported"
        )
    return MCTSAgent(config, network, seed, tie_break)


def load_mcts_agent(run_dir: str | Path, checkpoint: str | Path | None = None, seed: int = 0,
                    tie_break: str = "random", overrides: Sequence[str] = (),
                    ) -> tuple[MCTSAgent, MuZeroRunConfig]:  # fmt: skip
    """:func:`mcts_agent` with the network of a run's checkpoint (default
    ``RUN_DIR/checkpoint.pt``) and the run's ``config.json`` (read with
    :func:`mpper.config.load_run_config` as a MuZero config, ``overrides`` applied); returns (agent, config)."""
    run_dir = Path(run_dir)
    # the one algorithm it may name: the config is MuZero's
    config = cast(MuZeroRunConfig, load_run_config(run_dir, overrides, algorithms={"muzero": CONFIG}))
    spec = env_spec(config.env)
    network = make_network(config.network, spec.observation_shape, spec.num_actions,
                           config.muzero.stacked_observations)  # fmt: skip
    state = load_checkpoint(Path(checkpoint) if checkpoint is not None else run_dir / "checkpoint.pt",
                            max_bytes=checkpoint_budget(network),
                            follow_links=checkpoint is not None)  # a path the caller named may be their link
    load_network_weights(network, state["network"], checkpoint if checkpoint is not None else run_dir / "checkpoint.pt")
    return mcts_agent(config, network, seed, tie_break), config


def _check_legal(action: int, mask: np.ndarray, is_agent: bool, mover: int, game: int) -> None:
    if not (0 <= action < mask.shape[0] and mask[action]):
        who = "agent_fn" if is_agent else "opponent_fn"
        raise ValueError(f"play_match: {who} (player {mover}) chose illegal action {action} in game {game}; "
                         f"legal: {np.flatnonzero(mask).tolist()}")  # fmt: skip


def _result(score: float) -> str:
    return "wins" if score > 0 else "losses" if score < 0 else "draws"


def _count(scores: Sequence[float]) -> dict[str, int]:
    out = dict.fromkeys(RESULTS, 0)
    for s in scores:
        out[_result(s)] += 1
    return out
