"""Two-player training end to end: the batched arena, the evaluator's games against the
env's opponents (in a real ``--workers 2`` run and in ``--workers 0``), the one-line
errors for a broken two-player env and for DQN on one, and the move-based temperature
threshold of self-play. Everything on the real TicTacToe env and real networks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import mpper  # noqa: F401  (registers mpper/TicTacToe-v0)
from mpper import cli
from mpper.algos.configs import load_config
from mpper.algos.muzero.arena import (
    MCTSAgent,
    evaluate_against_opponents,
    mcts_agent,
    play_games,
    play_match,
    play_match_batched,
)
from mpper.algos.muzero.mcts import BatchedMCTS
from mpper.algos.muzero.player import BatchedPlayer
from mpper.algos.registry import algorithm_of
from mpper.envs.tictactoe import TicTacToeEnv, perfect_agent, random_agent
from mpper.envs.two_player import evaluation_opponents
from mpper.runtime.evaluation import evaluate

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
TICTACTOE = ROOT / "configs" / "tictactoe.json"


def network_for(config, seed: int = 0):
    torch.manual_seed(seed)
    return algorithm_of(config).make_network(config, (3, 3, 3), 9).eval()


class Recorder(gym.Wrapper):
    """Appends every action played in the env to ``log``."""

    def __init__(self, env, log: list):
        super().__init__(env)
        self.log = log

    def step(self, action):
        self.log.append(int(action))
        return self.env.step(action)


def assert_evaluation_adds_up(ev: dict, games: int) -> None:
    """A two-player evaluation's figures agree: per opponent ``games`` games, half (rounded
    up) as the first player, the score is (wins - losses) / games, and the headline
    ``returns`` are the +1 / 0 / -1 results against the last opponent, perfect, whom
    nobody beats."""
    assert list(ev["opponents"]) == ["random", "perfect"] and ev["against"] == "perfect"
    for r in ev["opponents"].values():
        assert r["games"] == games
        assert sum(r["first"].values()) == (games + 1) // 2 and sum(r["second"].values()) == games // 2
        wins, losses = (r["first"][k] + r["second"][k] for k in ("wins", "losses"))
        assert r["score"] == pytest.approx((wins - losses) / games)
    perfect = ev["opponents"]["perfect"]
    assert perfect["first"]["wins"] == perfect["second"]["wins"] == 0
    draws = perfect["first"]["draws"] + perfect["second"]["draws"]
    assert sorted(ev["returns"]) == [-1.0] * (games - draws) + [0.0] * draws
    assert ev["mean_return"] == pytest.approx(perfect["score"])


# --------------------------------------------------------------------------------------
# Batched arena
# --------------------------------------------------------------------------------------


def test_batched_games_equal_single_games_move_for_move(monkeypatch):
    """Deterministic agent (lowest-index ties) and per-game seeded random opponents:
    the batched path plays exactly the games the one-at-a-time path plays, with one
    search per round instead of one per move."""
    config = load_config(TICTACTOE, ["mcts.num_simulations=8"])
    network = network_for(config)
    games = 10
    for first in (True, False):
        single_moves, single_scores = [], []
        for g in range(games):
            log: list = []
            agent = mcts_agent(config, network, tie_break="first")
            res = play_match(lambda: Recorder(TicTacToeEnv(), log), lambda o, m, p: agent(o, m, p), random_agent(g),
                             agent_first=first, games=1, seed=g)  # fmt: skip
            single_moves.append(log)
            single_scores.append(res["wins"] - res["losses"])
        logs: list[list] = [[] for _ in range(games)]
        made = iter(range(games))
        runs = []
        original = BatchedMCTS.run
        monkeypatch.setattr(BatchedMCTS, "run", lambda self, *a, **k: runs.append(len(a[1])) or original(self, *a, **k))
        scores = play_games(lambda: Recorder(TicTacToeEnv(), logs[next(made)]), MCTSAgent(config, network, 0, "first"),
                            [random_agent(g) for g in range(games)], [first] * games, list(range(games)))  # fmt: skip
        monkeypatch.setattr(BatchedMCTS, "run", original)
        assert logs == single_moves
        assert [int(np.sign(s)) for s in scores] == single_scores
        assert len(runs) <= 5 and (runs[0] == games or not first)  # one search per round, not per move
        assert sum(runs) == sum((len(m) + (1 if first else 0)) // 2 for m in single_moves)


def test_play_match_uses_the_batched_path_for_an_mcts_agent_with_the_same_results():
    config = load_config(TICTACTOE, ["mcts.num_simulations=8"])
    network = network_for(config, 1)
    for first in (True, False):
        agent = mcts_agent(config, network, tie_break="first")
        single = play_match(TicTacToeEnv, lambda o, m, p: agent(o, m, p), perfect_agent(randomize=False),
                            agent_first=first, games=3, seed=0)  # fmt: skip
        batched = play_match(TicTacToeEnv, mcts_agent(config, network, tie_break="first"),
                             perfect_agent(randomize=False), agent_first=first, games=3, seed=0)  # fmt: skip
        assert batched == single and sum(batched.values()) == 3 and batched["wins"] == 0
        same = play_match_batched(config, network, perfect_agent(randomize=False), 3, first, 0, tie_break="first")
        assert same == single
    res = play_match_batched(config, network, random_agent(3), 9, True, 0)  # random ties, random opponent
    assert sum(res.values()) == 9
    with pytest.raises(ValueError, match=r"opponent_fn \(player 1\) chose illegal action 4"):
        play_match(TicTacToeEnv, mcts_agent(config, network), lambda o, m, p: 4, agent_first=True, games=2, seed=0)


def test_stacked_observations_play_batched_but_not_one_position_at_a_time():
    config = load_config(TICTACTOE, ["mcts.num_simulations=4", "muzero.stacked_observations=2",
                                    "muzero.symmetry_augmentation=false"])
    network = network_for(config)
    agent = MCTSAgent(config, network)
    res = play_match(TicTacToeEnv, agent, random_agent(0), agent_first=False, games=3, seed=0)
    assert sum(res.values()) == 3
    with pytest.raises(ValueError, match="stacked_observations = 2"):
        agent(np.zeros((3, 3, 3), np.float32), np.ones(9, bool), 0)


# --------------------------------------------------------------------------------------
# Evaluation against the env's opponents
# --------------------------------------------------------------------------------------


def test_evaluation_opponents_hook_and_default():
    opponents = evaluation_opponents(TicTacToeEnv(), seed=3)
    assert list(opponents) == ["random", "perfect"]  # weakest first: the headline is the last

    class NoHook(TicTacToeEnv):
        evaluation_opponents = None

    (name, agent), = evaluation_opponents(NoHook(), seed=0).items()  # fmt: skip
    assert name == "random"
    assert play_match(NoHook, perfect_agent(0), agent, agent_first=True, games=5, seed=0)["losses"] == 0

    class Empty(TicTacToeEnv):
        def evaluation_opponents(self, seed):
            return {}

    with pytest.raises(ValueError, match="returned no opponent"):
        evaluation_opponents(Empty())


def test_evaluation_report_per_opponent_and_side():
    config = load_config(TICTACTOE, ["mcts.num_simulations=6", "runtime.evaluation_episodes=5"])
    network = network_for(config)
    report = evaluate(config, network, seed=0)
    assert report["against"] == "perfect" and list(report["opponents"]) == ["random", "perfect"]
    for r in report["opponents"].values():
        assert r["games"] == 5
        assert sum(r["first"].values()) == 3 and sum(r["second"].values()) == 2  # ceil(5 / 2) first
    perfect = report["opponents"]["perfect"]
    assert perfect["first"]["wins"] == perfect["second"]["wins"] == 0
    losses = perfect["first"]["losses"] + perfect["second"]["losses"]
    assert report["mean_return"] == perfect["score"] == -losses / 5
    assert len(report["returns"]) == 5 and np.mean(report["returns"]) == report["mean_return"]
    assert evaluate(config, network, seed=0) == report  # repeatable for a seed

    class Stop:
        def is_set(self):
            return True

    assert evaluate_against_opponents(config, network, {"r": random_agent(0)}, 2, 0, stop=Stop()) is None


@pytest.mark.slow
def test_inline_run_evaluates_against_the_opponents_and_stops_on_solve_return(tmp_path, capsys):
    """--workers 0: the evaluation is the games against random and perfect, and
    solve_return reads the score against perfect (-1 is always reached)."""
    run_dir = tmp_path / "run"
    rc = cli.main(["--config", str(TICTACTOE), "--workers", "0", "--device", "cpu", "--run-dir", str(run_dir),
                   "--set", "training.min_buffer_steps=64", "--set", "training.batch_size=16",
                   "--set", "mcts.num_simulations=4", "--set", "runtime.envs_per_worker=4",
                   "--set", "runtime.evaluation_interval_s=0.5", "--set", "runtime.evaluation_episodes=4",
                   "--set", "runtime.solve_return=-1", "--set", "reanalyse.enabled=false",
                   "--set", "replay.capacity=2000", "--max-train-steps", "2000", "--time-limit", "40"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "solved: mean score -" in out and "against perfect >= -1" in out, out
    end = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert_evaluation_adds_up(end["evaluation"], games=4)
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert best["extra"]["against"] == "perfect" and "opponents" in best["extra"]
    # --evaluate on a two-player run plays the same opponents, both sides
    capsys.readouterr()
    assert cli.main(["--evaluate", str(run_dir), "--episodes", "6", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "vs random: as first W/D/L" in out and "vs perfect:" in out
    ev = json.loads((run_dir / "evaluation.json").read_text())
    assert ev["games_per_opponent"] == 6
    assert_evaluation_adds_up(ev, games=6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_worker_run_writes_per_opponent_evaluations(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "run.py", "--config", str(TICTACTOE), "--device", "cpu", "--workers", "2",
            "--run-dir", str(run_dir), "--time-limit", "60", "--max-train-steps", "100000",
            "--set", "training.min_buffer_steps=64", "--set", "training.batch_size=16",
            "--set", "mcts.num_simulations=4", "--set", "runtime.envs_per_worker=4",
            "--set", "replay.capacity=2000", "--set", "runtime.evaluation_interval_s=1",
            "--set", "runtime.evaluation_episodes=6", "--set", "runtime.solve_return=-1",
            "--set", "reanalyse.enabled=false"]  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "solved: mean score" in proc.stdout and "against perfect" in proc.stdout, proc.stdout[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if r["event"] == "evaluation"]
    assert evaluations
    for record in evaluations:
        ev = record["evaluation"]
        assert_evaluation_adds_up(ev, games=6)
        assert ev["best_mean_return"] >= ev["mean_return"]
    assert (run_dir / "best.pt").exists()


# --------------------------------------------------------------------------------------
# Errors before anything starts
# --------------------------------------------------------------------------------------


class NoMask(gym.Wrapper):
    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, {k: v for k, v in info.items() if k != "action_mask"}


@pytest.fixture
def train(monkeypatch):
    """A stand-in ``mpper.runtime.supervisor`` that records whether training was started."""
    calls = []
    module = types.ModuleType("mpper.runtime.supervisor")
    module.train = lambda setup: calls.append(setup) or 0
    monkeypatch.setitem(sys.modules, "mpper.runtime.supervisor", module)
    return calls


def test_broken_two_player_env_is_one_line_and_exit_code_2(tmp_path, capsys, train):
    env_id = "mpper-test/NoMaskCli-v0"
    gym.register(id=env_id, entry_point=lambda: NoMask(TicTacToeEnv()))
    try:
        rc = cli.main(["--config", str(TICTACTOE), "--set", f"env.id={env_id}", "--run-dir", str(tmp_path / "run")])
    finally:
        del gym.envs.registry[env_id]
    err = capsys.readouterr().err
    assert rc == 2 and train == [] and not (tmp_path / "run").exists()
    assert err.count("\n") == 1 and err.startswith(f"error: two-player env '{env_id}': info returned by reset()")
    assert "has no 'action_mask'" in err


def _forkservers_tagged(tag: str) -> list[int]:
    """Live forkservers whose environment holds ``tag`` (multiprocessing's resource
    tracker, which leaves by itself once its parent is gone, is not counted)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if (entry.isdigit() and tag.encode() in Path(f"/proc/{entry}/environ").read_bytes()
                    and b"forkserver" in Path(f"/proc/{entry}/cmdline").read_bytes()):  # fmt: skip
                if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_dqn_on_a_two_player_env_is_refused_in_one_line_and_leaves_no_process(tmp_path):
    """Refused after the forkserver was booted (the two-player check imports torch, which
    the forkserver's imports overlap): the forkserver is stopped with the command, not
    left to finish its imports."""
    run_dir = tmp_path / "run"
    tag = f"MPPER_TEST_TAG_{os.getpid()}_{time.monotonic_ns()}"
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: a pipe would wait for every holder
        returncode = subprocess.run([sys.executable, "run.py", "--config", "configs/cartpole_dqn.json", "--set",
                                     "env.id=mpper/TicTacToe-v0", "--run-dir", str(run_dir)], cwd=ROOT,
                                    stdout=stdout, stderr=stderr, timeout=60, env={**os.environ, tag: "1"}).returncode  # fmt: skip
    left = _forkservers_tagged(tag)
    stderr = err.read_text()
    assert returncode == 2 and out.read_text() == "" and not run_dir.exists()
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith('error: algorithm: "dqn" cannot train the two-player env \'mpper/TicTacToe-v0\'')
    assert 'use "muzero"' in stderr
    assert left == [], f"the refused run's forkserver is still alive: {left}"


# --------------------------------------------------------------------------------------
# Move-based temperature threshold
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_temperature_threshold_moves_makes_later_selfplay_moves_greedy(monkeypatch):
    """Exploring at T = 1: moves 0 and 1 of each game are sampled from the visit counts,
    from move 2 on each action is a most visited one. (muzero-general samples one move
    fewer: its ``len(action_history) < temperature_threshold`` counts the placeholder
    action of the first row. mpper's N counts moves, as AlphaZero's "the first 30
    moves"; move N - 1 must still be sampled.)"""
    threshold = 2
    config = load_config(TICTACTOE, ["mcts.num_simulations=16", "mcts.temperature_schedule=[[0, 1.0]]",
                                     f"mcts.temperature_threshold_moves={threshold}"])  # fmt: skip
    logs: list[list] = [[] for _ in range(8)]
    player = BatchedPlayer(config, [Recorder(TicTacToeEnv(), logs[k]) for k in range(8)], network_for(config),
                           explore=True, seed=0)  # fmt: skip
    searches = []
    original = player.mcts.run
    monkeypatch.setattr(player.mcts, "run", lambda *a, **k: searches.append(original(*a, **k)) or searches[-1])
    greedy_checked, sampled_not_argmax, last_sampled_not_argmax = 0, 0, 0
    for _ in range(30):
        moves = [ep.moves for ep in player.episodes]
        player.step(0.0)
        visits = searches[-1].visit_counts
        for k in range(8):
            action = logs[k][-1]
            is_argmax = visits[k, action] == visits[k].max()
            if moves[k] >= threshold:
                assert is_argmax, (k, moves[k], visits[k], action)
                greedy_checked += 1
            else:
                sampled_not_argmax += not is_argmax
                last_sampled_not_argmax += moves[k] == threshold - 1 and not is_argmax
    assert greedy_checked > 50 and sampled_not_argmax > 0  # before the threshold, T = 1 did sample
    assert last_sampled_not_argmax > 0  # ... move N - 1 too


def test_temperature_threshold_moves_config():
    assert load_config(TICTACTOE).mcts.temperature_threshold_moves is None
    assert load_config(TICTACTOE, ["mcts.temperature_threshold_moves=6"]).mcts.temperature_threshold_moves == 6
    with pytest.raises(ValueError, match=r"mcts.temperature_threshold_moves: expected an integer in \[1, 1000000\] or null, got 0"):
        load_config(TICTACTOE, ["mcts.temperature_threshold_moves=0"])
