"""The Python API a user scripts with: ``mpper.train`` (the command line's checks, lock and
runtime), the run it returns, ``mpper.load(...).act`` for MuZero and DQN, ``--evaluate``
judging the best weights, and a script without a ``__main__`` guard."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import mpper
from mpper.api import _is_main_test
from mpper.runtime.rundir import live_run_pid

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = ROOT / "configs" / "cartpole.json"
CARTPOLE_DQN = ROOT / "configs" / "cartpole_dqn.json"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


# ---- DQN from a dict, and a second run into a live run's directory ----------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dqn_run_from_a_dict_gives_an_agent_with_valid_actions(tmp_path):
    config = json.loads(CARTPOLE_DQN.read_text())
    with contextlib.redirect_stdout(io.StringIO()):
        run = mpper.train(config, workers=1, device="cpu", max_train_steps=60, time_limit=200,
                          run_dir=tmp_path / "dqn",
                          overrides={"training.min_buffer_steps": 64, "replay.capacity": 5000,
                                     "runtime.evaluation_interval_s": 0.5, "runtime.evaluation_episodes": 2})  # fmt: skip
    assert run.config["algorithm"] == "dqn" and run.metrics[-1]["learner"]["training_step"] == 60
    agent = run.agent("last")
    assert agent.checkpoint == run.dir / "checkpoint.pt" and agent.training_step == 60
    env = gym.make("CartPole-v1")
    observation, _ = env.reset(seed=1)
    for _ in range(20):
        action = agent.act(observation)
        assert isinstance(action, int) and env.action_space.contains(action)
        observation, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            observation, _ = env.reset()
    # argmax Q of the network, one observation at a time or as a batch
    batch = np.stack([env.reset(seed=s)[0] for s in range(5)])
    import torch

    with torch.no_grad():
        expected = agent.network(torch.as_tensor(batch)).argmax(1).numpy()
    np.testing.assert_array_equal(agent.act(batch), expected)
    assert [agent.act(o) for o in batch] == expected.tolist()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_train_into_a_live_runs_directory_is_refused(tmp_path):
    run_dir = tmp_path / "live"
    args = [sys.executable, "run.py", "--config", str(CARTPOLE_DQN), "--workers", "0", "--device", "cpu",
            "--run-dir", str(run_dir), "--time-limit", "240", "--set", "training.min_buffer_steps=64"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 200
        while live_run_pid(run_dir) is None:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run never took its directory's lock"
            time.sleep(0.2)
        with pytest.raises(mpper.LaunchError) as refused:
            mpper.train(str(CARTPOLE_DQN), workers=0, run_dir=run_dir)
        message = str(refused.value)
        assert "\n" not in message
        assert f"--run-dir {run_dir}: a run is still writing there (pid {proc.pid} holds" in message, message
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)


# ---- mistakes: one clear exception, nothing written ------------------------------------------
@pytest.mark.parametrize("config, overrides, error, fragment", [
    ({"algorithm": "muzero", "training": {"learning_rate": 0.1}}, {}, mpper.ConfigError, "learning_rate"),
    (str(CARTPOLE), {"training.batch_size": 0}, mpper.ConfigError, "--set training.batch_size=0"),
    (str(CARTPOLE), ["replay.capacity=lots"], mpper.ConfigError, "--set replay.capacity=lots"),
    ("no_such_config", {}, mpper.ConfigError, "mpper ships no config of that name"),
])  # fmt: skip
def test_a_config_mistake_is_one_line_and_starts_nothing(tmp_path, config, overrides, error, fragment):
    run_dir = tmp_path / "run"
    with pytest.raises(error) as raised:
        mpper.train(config, overrides=overrides, run_dir=run_dir, workers=2)
    assert isinstance(raised.value, ValueError)
    assert fragment in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
    assert not run_dir.exists()


def test_load_refuses_a_directory_without_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run directory with a config.json there"):
        mpper.load(tmp_path)


# ---- a script without `if __name__ == "__main__":` ---------------------------------------------
UNGUARDED = """
import mpper

run = mpper.train({config!r}, workers=1, device="cpu", max_train_steps=30, run_dir={run_dir!r})
print("trained", run.dir)
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_script_without_a_main_guard_is_refused_in_one_line(tmp_path):
    """Its children would import it again and train again: refused before anything starts."""
    script = tmp_path / "train_unguarded.py"
    run_dir = tmp_path / "run"
    script.write_text(UNGUARDED.format(config=str(CARTPOLE_DQN), run_dir=str(run_dir)))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=150)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (f"error: mpper.train: called at the top level of {script}:4, which each of the run's child "
                        'processes imports again: put the call under `if __name__ == "__main__":` '
                        "(or train with workers=0)")  # fmt: skip
    assert not run_dir.exists()


@pytest.mark.parametrize("source, guarded", [
    ('if __name__ == "__main__": pass', True),
    ("if '__main__' == __name__: pass", True),
    ('if __name__ == "__main__" and True: pass', True),
    ('if __name__ != "__main__": pass', False),
    ("if True: pass", False),
])  # fmt: skip
def test_what_counts_as_a_main_guard(source, guarded):
    import ast

    assert _is_main_test(ast.parse(source).body[0].test) is guarded


def test_stopping_children_whose_start_failed_does_not_raise(tmp_path):
    """A child whose process could not start (here: arguments that do not pickle) has
    nothing to wait for: the shutdown goes on, and the start's own error is what the run
    reports."""
    from mpper.algos.configs import load_config
    from mpper.runtime.children import run_selfplay
    from mpper.runtime.setup import RunSetup
    from mpper.runtime.supervisor import Child, Supervisor

    supervisor = Supervisor(RunSetup.create(load_config(CARTPOLE, workers=1, device="cpu"), tmp_path / "run"))
    with pytest.raises(Exception, match="pickle"):
        supervisor._add(Child("worker-0", run_selfplay, {"unpicklable": lambda: None}))
    assert supervisor.children["worker-0"].process is None
    supervisor._stop_children()  # no "can only join a started process"
    assert supervisor._alive(supervisor.children["worker-0"]) is False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_agent_whose_network_sees_past_frames_acts_as_the_evaluator_plays(tmp_path):
    """dqn.frame_stack 2: the agent keeps the episode's frames itself, and one episode of
    ``act`` takes the actions the evaluator's greedy player takes from the same reset."""
    from mpper.envs import make_env
    from mpper.runtime.evaluation import play_greedy

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run = mpper.train(str(CARTPOLE_DQN), workers=0, device="cpu", max_train_steps=30, run_dir=tmp_path / "run",
                          overrides={"dqn.frame_stack": 2, "training.min_buffer_steps": 64, "replay.capacity": 5000,
                                     "runtime.evaluation_interval_s": 1000})  # fmt: skip
    last = printed.getvalue().strip().splitlines()[-1]
    assert last.startswith(f"mpper: training finished (30 steps); run directory {run.dir}; best weights")
    (run.dir / "best.pt").unlink()  # a run stopped before its first evaluation has none
    agent = run.agent()
    assert agent.sees_past and agent.checkpoint == run.dir / "checkpoint.pt"  # no best.pt: the checkpoint
    [played] = play_greedy(agent.config, [make_env(agent.config.env)], agent.network, seed=7)
    env = make_env(agent.config.env)
    for _ in range(2):  # reset() starts the second episode afresh
        agent.reset()
        observation, _ = env.reset(seed=7)
        actions = []
        for _ in range(played.moves):
            actions.append(agent.act(observation))
            observation, *_ = env.step(actions[-1])
        assert actions == played.action[1:]
    with pytest.raises(ValueError, match="give one observation at a time"):
        agent.act(np.zeros((2, 4), np.float32))


def test_a_two_player_agent_plays_a_legal_move_for_the_side_to_move(tmp_path):
    """TicTacToe: ``act`` takes the env's action mask and the player to move, and plays
    only legal moves (a fresh network's weights, saved as a run would save them)."""
    import torch

    from mpper.algos.configs import load_config
    from mpper.algos.registry import algorithm_of
    from mpper.checkpoint import save_network_checkpoint
    from mpper.config import config_to_dict
    from mpper.envs.tictactoe import TicTacToeEnv

    config = load_config(ROOT / "configs" / "tictactoe.json", ["mcts.num_simulations=8"])
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(config)))
    torch.manual_seed(0)
    network = algorithm_of(config).make_network(config, (3, 3, 3), 9)
    save_network_checkpoint(tmp_path / "checkpoint.pt", network, 7)
    agent = mpper.load(tmp_path)
    assert agent.checkpoint == tmp_path / "checkpoint.pt" and agent.training_step == 7
    env = TicTacToeEnv()
    observation, info = env.reset(seed=0)
    done, moves = False, 0
    while not done:
        mask = info["action_mask"]
        action = agent.act(observation, action_mask=mask, to_play=info["to_play"])
        assert mask[action], (action, mask)
        observation, _, terminated, truncated, info = env.step(action)
        done, moves = terminated or truncated, moves + 1
    assert 5 <= moves <= 9


def test_playing_in_the_callers_process_uses_the_runs_torch_threads_and_gives_the_callers_back(tmp_path, monkeypatch):
    """``act``, ``--evaluate`` and ``--collect`` play in the caller's process: every layer
    the network runs there runs on the run's ``runtime.torch_threads`` (as its evaluator
    plays), and the caller's own count is back afterwards, however many it had."""
    import torch

    from mpper.algos.configs import load_config
    from mpper.algos.registry import algorithm_of
    from mpper.checkpoint import save_network_checkpoint
    from mpper.config import config_to_dict
    from mpper.tools import collect, evaluate

    config = load_config(CARTPOLE, ["mcts.num_simulations=4", "env.max_episode_steps=12", "runtime.envs_per_worker=2"])
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(config)))
    torch.manual_seed(0)
    save_network_checkpoint(tmp_path / "checkpoint.pt", algorithm_of(config).make_network(config, (4,), 2), 3)
    seen: list[int] = []

    def counted(network):
        for module in network.modules():
            module.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        return network

    for module in (evaluate, collect):
        real = module.load_network
        monkeypatch.setattr(module, "load_network", lambda *a, real=real: counted(real(*a)))
    callers = torch.get_num_threads()
    try:
        for caller, run_threads in ((3, 1), (1, 2)):
            torch.set_num_threads(caller)
            threads = [f"runtime.torch_threads={run_threads}"]
            agent = mpper.load(tmp_path, threads)  # its network comes through evaluate.load_network, hooked
            seen.clear()
            agent.act(np.zeros((5, 4), np.float32))
            assert seen and set(seen) == {run_threads} and torch.get_num_threads() == caller
            collected = tmp_path / f"collected-{caller}"
            for play in (lambda: evaluate.evaluate_run(tmp_path, episodes=2, overrides=threads),
                         lambda: collect.collect(tmp_path, 20, 0.1, collected, overrides=threads)):  # fmt: skip
                seen.clear()
                play()
                assert seen and set(seen) == {run_threads} and torch.get_num_threads() == caller
    finally:
        torch.set_num_threads(callers)
