"""TicTacToe, the two-player contract check, the reference opponents and the arena.

Everything runs on the real env (raw, or through ``gymnasium.make``); the contract-check
cases wrap it in tiny wrappers that break one thing each. The last test trains for a few
steps with ``python run.py --config configs/tictactoe.json --workers 2`` and plays the
saved checkpoint against both opponents.
"""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import mpper  # noqa: F401  (registers mpper/TicTacToe-v0)
from mpper import ReplayBuffer
from mpper.algos.configs import load_config
from mpper.algos.muzero.arena import load_mcts_agent, mcts_agent, play_match
from mpper.algos.muzero.networks import make_network
from mpper.algos.muzero.targets import MuZeroTargets
from mpper.config import EnvConfig
from mpper.envs import env_spec, make_env
from mpper.envs.tictactoe import (
    ENV_ID,
    LINES,
    TicTacToeEnv,
    _negamax,
    optimal_actions,
    perfect_agent,
    perfect_player,
    position_scores,
    position_value,
    random_agent,
    random_player,
    reachable_positions,
)
from mpper.envs.two_player import check_two_player_env
from mpper.runtime.evaluation import play_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import seed_reference as ref  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def play(env, moves):
    """Reset, then play ``moves``; one (obs, reward, terminated, truncated, info) per
    position, the first one (after reset) with reward 0."""
    obs, info = env.reset(seed=0)
    out = [(obs, 0.0, False, False, info)]
    for a in moves:
        out.append(env.step(a))
    return out


def board_from(obs: np.ndarray, to_play: int) -> np.ndarray:
    """The board (0 empty, 1 X, 2 O) that an observation shows, given who is to move."""
    board = np.zeros((3, 3), np.int8)
    board[obs[0] == 1] = to_play + 1
    board[obs[1] == 1] = 2 - to_play
    return board


# --------------------------------------------------------------------------------------
# The env
# --------------------------------------------------------------------------------------


def winning_sequence(line: tuple[int, int, int], winner: int) -> list[int]:
    """Moves in which ``winner`` completes ``line`` with their third stone and the loser
    never completes one (loser's stones: the first cells off the line that make no line)."""
    off = [c for c in range(9) if c not in line]
    loser_moves = 3 if winner == 1 else 2
    fill = next(combo for combo in itertools.combinations(off, loser_moves)
                if not any(set(ln) <= set(combo) for ln in LINES))  # fmt: skip
    moves: list[int] = []
    w, lo = list(line), list(fill)
    for turn in range(5 if winner == 0 else 6):
        moves.append((w if turn % 2 == winner else lo).pop(0))
    return moves


@pytest.mark.parametrize("winner", [0, 1])
@pytest.mark.parametrize("line", LINES, ids=[f"line{i}" for i in range(8)])
def test_every_line_wins_for_both_players(line, winner):
    env = gym.make(ENV_ID, render_mode="ansi")
    moves = winning_sequence(line, winner)
    steps = play(env, moves)
    for obs, reward, terminated, truncated, info in steps[1:-1]:
        assert reward == 0.0 and not terminated and not truncated and "winner" not in info
    _, reward, terminated, truncated, info = steps[-1]
    assert reward == 1.0 and terminated and not truncated  # +1 to the player who just moved
    assert info["winner"] == winner and info["to_play"] == 1 - winner
    assert not info["action_mask"].any()  # nothing is legal after the end
    board = env.unwrapped.board.reshape(-1)
    assert all(board[c] == winner + 1 for c in line)
    assert env.render().splitlines()[-1] == f"{'XO'[winner]} (player {winner}) won"
    with pytest.raises(ValueError, match="game is over"):
        env.step(int(np.flatnonzero(board == 0)[0]))


def test_draw():
    env = TicTacToeEnv(render_mode="ansi")
    moves = [0, 1, 2, 4, 3, 5, 7, 6, 8]  # X O X / X O O / O X X
    steps = play(env, moves)
    assert all(s[1] == 0.0 and not s[2] for s in steps[1:-1])
    _, reward, terminated, truncated, info = steps[-1]
    assert reward == 0.0 and terminated and not truncated and info["winner"] == -1
    np.testing.assert_array_equal(env.board, [[1, 2, 1], [1, 2, 2], [2, 1, 1]])
    assert env.render().splitlines()[-1] == "draw"


def test_illegal_moves_raise_clear_errors():
    env = gym.make(ENV_ID)
    env.reset(seed=0)
    env.step(4)
    with pytest.raises(ValueError, match=r"illegal move 4 \(row 1, column 1\) by player 1 \(O\): the cell holds X"):
        env.step(4)
    for bad in (9, -1, 2.5, "a"):
        with pytest.raises(ValueError, match="integer cell 0..8"):
            env.step(bad)
    obs, _, terminated, _, info = env.step(np.int64(0))  # a numpy integer is fine; the errors changed nothing
    assert not terminated and info["to_play"] == 0 and obs[0].sum() == obs[1].sum() == 1


def test_to_play_alternates_mask_and_observation_planes():
    env = gym.make(ENV_ID)
    rng = np.random.default_rng(0)
    for game in range(30):
        obs, info = env.reset(seed=game)
        assert env.observation_space.contains(obs) and obs.dtype == np.float32 and obs.shape == (3, 3, 3)
        expected_player, terminated = 0, False
        while not terminated:
            board = env.unwrapped.board
            assert info["to_play"] == expected_player == env.unwrapped.to_play
            assert info["action_mask"].dtype == np.bool_ and info["action_mask"].shape == (9,)
            np.testing.assert_array_equal(info["action_mask"], board.reshape(-1) == 0)
            # plane 0: the mover's stones; plane 1: the opponent's; plane 2: ones iff player 0 moves
            np.testing.assert_array_equal(board_from(obs, info["to_play"]), board)
            np.testing.assert_array_equal(obs[2], np.full((3, 3), 1.0 if expected_player == 0 else 0.0))
            obs, _, terminated, _, info = env.step(random_player(obs, info["action_mask"], rng))
            expected_player = 1 - expected_player
        assert info["to_play"] == expected_player  # after the end: who would move next


def test_registered_id_factory_and_config():
    assert ENV_ID in gym.envs.registry
    for env_id in (ENV_ID, "mpper.envs.tictactoe:TicTacToeEnv"):
        env = make_env(EnvConfig(id=env_id))
        assert env.unwrapped.two_player is True
        spec = env_spec(EnvConfig(id=env_id))  # includes the contract check
        assert (spec.observation_shape, spec.num_actions) == ((3, 3, 3), 9)
    check_env(gym.make(ENV_ID).unwrapped)  # gymnasium's own checks (spaces, seeding, determinism, render modes)
    config = load_config(ROOT / "configs" / "tictactoe.json")
    assert config.env.id == ENV_ID and config.network.kind == "residual"
    # A fresh interpreter that imports only the config module: mpper's __init__ registers
    # the id before the config is validated.
    code = "from mpper.algos.configs import load_config; print(load_config('configs/tictactoe.json').env.id)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == ENV_ID, proc.stderr


def test_render_modes():
    env = gym.make(ENV_ID, render_mode="rgb_array")
    env.reset(seed=0)
    empty = env.render()
    assert empty.shape == (96, 96, 3) and empty.dtype == np.uint8
    env.step(0)  # X top left
    env.step(8)  # O bottom right
    img = env.render()
    x_cell, o_cell, free_cell = img[:32, :32], img[64:, 64:], img[:32, 64:]
    assert (x_cell[..., 0] > x_cell[..., 2]).any() and (o_cell[..., 2] > o_cell[..., 0]).any()
    np.testing.assert_array_equal(free_cell, empty[:32, 64:])
    text = TicTacToeEnv(render_mode="ansi")
    text.reset()
    text.step(4)
    assert text.render() == ". . .\n. X .\n. . .\nO (player 1) to play\n"
    assert TicTacToeEnv().render() is None
    with pytest.raises(ValueError, match="render_mode"):
        TicTacToeEnv(render_mode="human")


# --------------------------------------------------------------------------------------
# The contract check
# --------------------------------------------------------------------------------------


class EditInfo(gym.Wrapper):
    """Passes ``info`` through ``edit(info, after_step, terminal)`` at reset and step."""

    def __init__(self, env, edit):
        super().__init__(env)
        self.edit = edit

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, self.edit(dict(info), False, False)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, self.edit(dict(info), True, terminated)


def _without(key):
    return lambda info, after_step, terminal: {k: v for k, v in info.items() if k != key}


def _with(key, value, only_after_step=False):
    def edit(info, after_step, terminal):
        if after_step or not only_after_step:
            info[key] = value(info) if callable(value) else value
        return info

    return edit


BROKEN = {
    "no to_play": (_without("to_play"), r"reset\(\) has no 'to_play'"),
    "to_play 2": (_with("to_play", 2), r"'to_play' must be the int 0 or 1, got 2"),
    "to_play str": (_with("to_play", "0"), r"'to_play' must be the int 0 or 1, got '0'"),
    "to_play bool": (_with("to_play", True), r"'to_play' must be the int 0 or 1, got True"),
    "no mask": (_without("action_mask"), r"has no 'action_mask'"),
    "mask list": (_with("action_mask", lambda i: i["action_mask"].tolist()), r"numpy bool array .* got a list"),
    "mask int": (_with("action_mask", lambda i: i["action_mask"].astype(np.int8)), r"dtype bool, got int8"),
    "mask shape": (_with("action_mask", lambda i: i["action_mask"].reshape(3, 3)), r"shape \(9,\) .* got \(3, 3\)"),
    "mask empty": (_with("action_mask", np.zeros(9, bool)), r"all False in a state that is not terminal"),
    "bad after step": (_with("to_play", -1, only_after_step=True), r"step\(0\): 'to_play'"),
    "info not dict": (lambda info, after_step, terminal: None, r"is a NoneType, not a dict"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_contract_check_names_what_is_wrong(case):
    edit, message = BROKEN[case]
    with pytest.raises(ValueError, match=r"two-player env 'TicTacToeEnv': info returned by .*" + message):
        check_two_player_env(EditInfo(TicTacToeEnv(), edit))


@pytest.fixture
def broken_env_id():
    env_id = "mpper-test/NoMask-v0"
    gym.register(id=env_id, entry_point=lambda: EditInfo(TicTacToeEnv(), _without("action_mask")))
    try:
        yield env_id
    finally:
        del gym.envs.registry[env_id]


def test_env_spec_runs_the_check_for_two_player_envs_only(broken_env_id):
    check_two_player_env(gym.make(ENV_ID))  # the real env passes
    with pytest.raises(ValueError, match=r"two-player env 'mpper-test/NoMask-v0': .* no 'action_mask'"):
        env_spec(EnvConfig(id=broken_env_id))
    env_spec(EnvConfig(id="CartPole-v1"))  # one player: no info contract, no check
    with pytest.raises(ValueError, match="two_player is not true"):
        check_two_player_env(gym.make("CartPole-v1"))


# --------------------------------------------------------------------------------------
# The opponents
# --------------------------------------------------------------------------------------


def test_solver_visits_every_reachable_position_and_knows_the_basics():
    _negamax.cache_clear()
    empty = np.zeros((3, 3, 3), np.float32)
    assert position_value(empty) == 0  # TicTacToe is a draw
    assert _negamax.cache_info().currsize == 5478  # every reachable position, once
    np.testing.assert_array_equal(position_scores(empty), np.zeros(9))  # every opening draws

    def position(moves):
        obs, _, _, _, info = play(TicTacToeEnv(), moves)[-1]
        return obs, info["action_mask"]

    obs, mask = position([0, 3, 1, 4])  # X (0, 1) to move wins at 2 at once
    assert position_value(obs) == 1 and np.flatnonzero(optimal_actions(obs)).tolist() == [2]
    obs, mask = position([0, 3, 1, 4, 8])  # O (3, 4) to move: its own win at 5 beats blocking 2
    assert perfect_player(obs, mask) == 5
    obs, mask = position([0, 4])  # the centre answers a corner: a draw
    assert position_value(obs) == 0
    obs, mask = position([4, 1, 0, 8, 6])  # X threatens 2 and 3: O is lost, and delays it
    assert position_value(obs) == -1 and perfect_player(obs, mask) in (2, 3)
    with pytest.raises(ValueError, match="not the set of empty cells"):
        perfect_player(obs, np.ones(9, bool))
    with pytest.raises(ValueError, match="game is over"):
        position_scores(position(winning_sequence(LINES[0], 0))[0])


def test_reachable_positions_are_the_4520_unfinished_positions_as_the_env_shows_them():
    positions = reachable_positions()
    assert positions.shape == (4520, 3, 3, 3)  # 5478 reachable, 958 of them finished
    assert len({p.tobytes() for p in positions}) == 4520
    # every position the env shows in random games is among them, with its to-play plane
    known = {p.tobytes() for p in positions}
    rng = np.random.default_rng(0)
    for _ in range(200):
        env = TicTacToeEnv()
        obs, info = env.reset()
        while not env.done:
            assert obs.tobytes() in known
            obs, _, _, _, info = env.step(int(rng.choice(np.flatnonzero(info["action_mask"]))))
    for p in positions:  # none is finished: the solver scores a move in each
        assert position_scores(p).max() > -100


def all_games(env, sides):
    """Every game from the empty board, side ``p`` choosing ``sides[p]``: "perfect"
    takes each optimal move in turn, "random" each legal move. Yields (winner, moves)."""

    def walk(env, obs, info, moves):
        if "winner" in info:
            yield info["winner"], moves
            return
        mover = info["to_play"]
        if sides[mover] == "perfect":
            choices = np.flatnonzero(optimal_actions(obs))
            assert perfect_player(obs, info["action_mask"]) in choices
        else:
            choices = np.flatnonzero(info["action_mask"])
        for a in choices:
            child = copy.deepcopy(env)
            obs2, _, _, _, info2 = child.step(int(a))
            yield from walk(child, obs2, info2, moves + [int(a)])

    obs, info = env.reset(seed=0)
    yield from walk(env, obs, info, [])


@pytest.mark.slow
def test_perfect_never_loses_to_itself_with_any_choice_of_optimal_moves():
    results = [winner for winner, _ in all_games(TicTacToeEnv(), ("perfect", "perfect"))]
    assert len(results) > 1000 and set(results) == {-1}  # every game a draw


@pytest.mark.slow
@pytest.mark.parametrize("perfect_side", [0, 1])
def test_perfect_never_loses_to_any_random_play(perfect_side):
    sides = ["random", "random"]
    sides[perfect_side] = "perfect"
    outcomes = {-1: 0, 0: 0, 1: 0}
    for winner, moves in all_games(TicTacToeEnv(), sides):
        assert winner != 1 - perfect_side, f"perfect player {perfect_side} lost: moves {moves}"
        outcomes[winner] += 1
    assert outcomes[perfect_side] > 0 and outcomes[-1] > 0  # wins and draws, never a loss


def test_arena_random_vs_random_has_all_outcomes_and_perfect_never_loses():
    for first in (True, False):
        res = play_match(TicTacToeEnv, random_agent(1), random_agent(2), agent_first=first, games=300, seed=0)
        assert sum(res.values()) == 300 and min(res.values()) > 0, res
        res = play_match(TicTacToeEnv, perfect_agent(3), random_agent(4), agent_first=first, games=100, seed=0)
        assert sum(res.values()) == 100 and res["losses"] == 0 and res["wins"] > 50, res
        res = play_match(lambda: gym.make(ENV_ID), perfect_agent(5), perfect_agent(6, randomize=False),
                         agent_first=first, games=20, seed=0)  # fmt: skip
        assert res == {"wins": 0, "draws": 20, "losses": 0}
    with pytest.raises(ValueError, match=r"opponent_fn \(player 1\) chose illegal action 4"):
        play_match(TicTacToeEnv, lambda o, m, p: 4, lambda o, m, p: 4, agent_first=True, games=1, seed=0)


# --------------------------------------------------------------------------------------
# Targets of two-player episodes
# --------------------------------------------------------------------------------------


def build_targets(ep, num_unroll_steps, td_steps, discount):
    """MuZeroTargets on the episode's own rows (as the learner's batches), every position."""
    moves = len(ep["action"]) - 1
    slots = np.arange(moves, dtype=np.int64)
    targets = MuZeroTargets(num_unroll_steps, td_steps, discount, 9)
    return targets.build(ep, slots, slots, np.full(moves, moves), np.ones(moves, bool), np.random.default_rng(0))


def test_targets_of_a_tictactoe_game_flip_signs_between_the_players():
    # X: 4, 0, 6, then 3 wins (column 0, 3, 6); O: 1, 8, 2 (blocks the diagonal 2-4-6).
    moves = [4, 1, 0, 8, 6, 2, 3]
    env = TicTacToeEnv()
    steps = play(env, moves)
    assert steps[-1][4]["winner"] == 0
    T = len(moves)
    visits = np.random.default_rng(0).random((T + 1, 9)).astype(np.float32)
    visits[T] = 0
    ep = {
        "observation": np.stack([s[0] for s in steps]),
        "action": np.array([0] + moves, np.int64),
        "reward": np.array([0.0] + [s[1] for s in steps[1:]], np.float32),
        "to_play": np.array([0] + [s[4]["to_play"] for s in steps[1:]], np.int8),
        "root_value": np.array([0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, 0.0], np.float32),
        "child_visits": visits,
    }
    np.testing.assert_array_equal(ep["reward"], [0, 0, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(ep["to_play"], [0, 1, 0, 1, 0, 1, 0, 1])
    # td 20 reaches the end from everywhere, discount 1: +1 where X (the winner) is to move, -1 where O is.
    out = build_targets(ep, 0, 20, 1.0)
    np.testing.assert_allclose(out["target_value"][:, 0], [1, -1, 1, -1, 1, -1, 1])
    # td 2: the root value two plies on (same player: no flip), else the final +1 seen by each side.
    out = build_targets(ep, 0, 2, 1.0)
    np.testing.assert_allclose(out["target_value"][:, 0], [0.3, -0.4, 0.5, -0.6, 0.7, -1.0, 1.0], rtol=1e-6)
    # and every target of every unroll, against the muzero-general reference
    for td, K, discount in [(20, 5, 1.0), (2, 5, 1.0), (3, 5, 0.9)]:
        out = build_targets(ep, K, td, discount)
        for t in range(T):
            values, rewards, policies, actions = ref.make_target(ep, t, K, td, discount, 9)
            np.testing.assert_allclose(out["target_value"][t], values, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(out["target_reward"][t], rewards)
            np.testing.assert_allclose(out["target_policy"][t], policies, rtol=1e-6)
            known = actions >= 0
            np.testing.assert_array_equal(out["actions"][t][known], actions[known])


def test_selfplay_records_a_tictactoe_game_for_the_contract():
    """BatchedPlayer (greedy) on the real env with an untrained network: legal moves only,
    to_play alternating, and value targets of +-1 by the game's result."""
    config = load_config(ROOT / "configs" / "tictactoe.json", ["mcts.num_simulations=8"])
    network = make_network(config.network, (3, 3, 3), 9).eval()
    episodes = play_greedy(config, [TicTacToeEnv() for _ in range(4)], network, seed=0)
    for ep in episodes:
        arrays = ep.arrays(9)
        T = ep.moves
        np.testing.assert_array_equal(arrays["to_play"], np.arange(T + 1) % 2)
        assert ep.terminated and set(arrays["reward"][:-1]) <= {0.0}
        for t in range(T + 1):  # the legal moves the search had: the empty cells (row T: all, no move)
            empty = np.ones(9, bool)
            empty[arrays["action"][1 : t + 1]] = False
            np.testing.assert_array_equal(arrays["legal_actions"][t], empty if t < T else np.ones(9, bool))
        value = build_targets(arrays, 0, 20, 1.0)["target_value"][:, 0]
        if arrays["reward"][-1] == 1.0:  # the last mover, player (T - 1) % 2, won
            winner = (T - 1) % 2
            np.testing.assert_allclose(value, np.where(np.arange(T) % 2 == winner, 1.0, -1.0))
        else:
            assert T == 9 and not value.any()


# --------------------------------------------------------------------------------------
# Training, then the arena with the checkpoint
# --------------------------------------------------------------------------------------

SMALL = [
    "--set", "training.min_buffer_steps=100", "--set", "training.batch_size=32",
    "--set", "mcts.num_simulations=8", "--set", "runtime.envs_per_worker=4",
    "--set", "replay.capacity=5000", "--set", "runtime.evaluation_interval_s=2",
    "--set", "runtime.evaluation_episodes=2", "--set", "training.publish_interval=5",
]  # fmt: skip


class GameLog(gym.Wrapper):
    """Appends each game's moves (a new list at every reset) to ``games``, shared by
    the envs of games played together."""

    def __init__(self, env, games: list):
        super().__init__(env)
        self.games = games
        self.moves: list[int] = []

    def reset(self, **kwargs):
        self.moves = []
        self.games.append(self.moves)
        return self.env.reset(**kwargs)

    def step(self, action):
        self.moves.append(int(action))
        return self.env.step(action)


def replayed_results(games: list[list[int]], agent_first: bool) -> dict[str, int]:
    """Replay each logged game on a fresh env: every move legal, the game over exactly at
    its last move; the agent's wins, draws and losses by the final reward."""
    results = {"wins": 0, "draws": 0, "losses": 0}
    agent_side = 0 if agent_first else 1
    env = TicTacToeEnv()
    for moves in games:
        _, info = env.reset(seed=0)
        assert 5 <= len(moves) <= 9, moves
        for k, action in enumerate(moves):
            assert info["action_mask"][action], (moves, k)
            mover = info["to_play"]
            _, reward, terminated, truncated, info = env.step(action)
            assert terminated == (k == len(moves) - 1) and not truncated, (moves, k)
        if reward == 1.0:
            results["wins" if mover == agent_side else "losses"] += 1
        else:
            assert reward == 0.0 and len(moves) == 9  # a draw fills the board
            results["draws"] += 1
    return results


def assert_stored_games_replay(snapshot: Path) -> int:
    """Every episode of the snapshot is a real TicTacToe game: replaying its actions on
    the env gives its stored observations, rewards and players to move, and it ends
    terminated. Returns the number of episodes."""
    env = TicTacToeEnv()
    with ReplayBuffer.load(snapshot, mmap=True) as snap:
        refs = snap.episodes()
        assert refs
        f = snap.fields
        for ref in refs:
            rows = slice(ref.start, ref.start + ref.rows)
            obs, action, reward, to_play = f["observation"][rows], f["action"][rows], f["reward"][rows], f["to_play"][rows]
            o, info = env.reset(seed=0)
            np.testing.assert_array_equal(obs[0], o)
            assert to_play[0] == info["to_play"]
            for t in range(1, ref.rows):
                o, r, terminated, _, info = env.step(int(action[t]))
                np.testing.assert_array_equal(obs[t], o)
                assert (reward[t], to_play[t], terminated) == (r, info["to_play"], t == ref.rows - 1), (ref, t)
            assert ref.terminated
        return len(refs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_workers_train_on_tictactoe_then_play_the_checkpoint(tmp_path):
    """A short --workers 2 run: the self-play games it stored replay move for move on
    the env, and its checkpoint plays whole legal games against random and perfect,
    whose replayed outcomes are the reported results (never a win against perfect)."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "run.py", "--config", "configs/tictactoe.json", "--device", "cpu", "--workers", "2",
            "--max-train-steps", "20", "--time-limit", "90", "--run-dir", str(run_dir), *SMALL]  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "training finished (20 steps)" in proc.stdout
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "end" and last["learner"]["training_step"] == 20
    stored = assert_stored_games_replay(run_dir / "buffer")
    assert 0 < stored <= last["counters"]["games"]

    agent, config = load_mcts_agent(run_dir, seed=0)
    assert config.mcts.num_simulations == 8
    for first in (True, False):
        for opponent in (random_agent(7), perfect_agent(8)):
            games: list = []
            res = play_match(lambda: GameLog(TicTacToeEnv(), games), agent, opponent, agent_first=first, games=4, seed=0)
            assert len(games) == 4 and res == replayed_results(games, first)
        assert res["wins"] == 0  # nobody beats the perfect player


def test_mcts_agent_plays_legal_moves_and_refuses_stacked_observations():
    config = load_config(ROOT / "configs" / "tictactoe.json", ["mcts.num_simulations=4"])
    network = make_network(config.network, (3, 3, 3), 9)
    agent = mcts_agent(config, network, seed=0)
    assert not network.training  # put in eval mode for the search
    games: list = []
    res = play_match(lambda: GameLog(TicTacToeEnv(), games), agent, random_agent(0), agent_first=False, games=3, seed=0)
    assert len(games) == 3 and res == replayed_results(games, agent_first=False)
    stacked = load_config(ROOT / "configs" / "tictactoe.json", ["muzero.stacked_observations=1", "muzero.symmetry_augmentation=false"])
    with pytest.raises(ValueError, match="stacked_observations"):
        mcts_agent(stacked, make_network(stacked.network, (3, 3, 3), 9, 1))
