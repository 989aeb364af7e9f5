"""The Atari 100k protocol (configs/atari100k_*.json): EfficientZero's env settings, and the
training-only ones (``env.episodic_life``, ``env.clip_rewards``) on self-play's envs alone.

The training env is checked against the plain game made from the same config and driven
by the same actions (the no-op each lost life's reset takes included): same frames, same
lives, rewards the sign of the game's, a life loss terminal for the learner while the
emulator runs on, and a real restart only at game over.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from mpper import cli
from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of
from mpper.envs.atari import NOOP, EpisodicLife, SignReward
from mpper.envs.spec import env_spec, make_env
from mpper.runtime.roles import evaluation_envs, selfplay_envs

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
GAMES = {"atari100k_pong": 6, "atari100k_breakout": 4, "atari100k_boxing": 18}


def config_for(name: str, *overrides: str):
    return load_config(CONFIGS / f"{name}.json", overrides)


def iter_wrappers(env: gym.Env):
    """The wrappers of ``env``, outermost first."""
    while isinstance(env, gym.Wrapper):
        yield env
        env = env.env


def wrappers(env: gym.Env) -> list[type]:
    return [type(wrapper) for wrapper in iter_wrappers(env)]


def frame_number(env: gym.Env) -> int:
    return int(env.unwrapped.ale.getEpisodeFrameNumber())


def play_training_games(env: gym.Env, seed: int, games: int, rng: np.random.Generator) -> dict:
    """Random play on the training env until ``games`` games have ended; what happened,
    step by step, with every action the emulator received (the resets' no-ops included)."""
    obs, _ = env.reset(seed=seed)
    log: dict = {"actions": [], "frames": [obs], "rewards": [], "lives": [], "ends": [], "emulator_frames": [],
                 "restarts": {}}
    while True:
        action = int(rng.integers(env.action_space.n))
        obs, reward, terminated, truncated, info = env.step(action)
        log["actions"].append(action)
        log["frames"].append(obs)
        log["rewards"].append(reward)
        log["lives"].append(env.unwrapped.ale.lives())
        if not (terminated or truncated):
            log["ends"].append(None)
            continue
        log["ends"].append("game over" if info["game_over"] else "life lost")
        if info["game_over"]:
            games -= 1
            if games == 0:
                return log
        before = frame_number(env)
        obs, _ = env.reset()
        after = frame_number(env)
        log["emulator_frames"].append((info["game_over"], before, after))
        if info["game_over"]:  # a new game: its first frame, after the action that ended the last
            log["restarts"][len(log["actions"]) - 1] = obs
        else:  # the reset stepped one no-op: replayed as an action of its own
            log["actions"].append(NOOP)
            log["frames"].append(obs)
            log["rewards"].append(None)
            log["lives"].append(env.unwrapped.ale.lives())
            log["ends"].append("reset")


# ---- the episodic-life wrapper against the plain game -----------------------------------------


def test_a_lost_life_ends_the_training_episode_but_not_the_game():
    """Breakout (5 lives), two whole games of random play on self-play's env, replayed on
    the evaluation env: identical frames throughout, so the emulator never restarted
    within a game; every life lost ended a training episode (terminated), lives fell by
    one per episode, and the plain game ended only at game over, where both restart."""
    config = config_for("atari100k_breakout")
    training = make_env(config.env, training=True)
    assert wrappers(training)[:2] == [SignReward, EpisodicLife]
    log = play_training_games(training, seed=7, games=2, rng=np.random.default_rng(0))
    ends = log["ends"]
    assert ends.count("game over") == 2 and ends.count("life lost") == 8  # 4 lives lost before each game over
    # within a game the emulator's frame counter runs on across the training episodes;
    # the game over's reset restarts it (1-30 no-op frames)
    for game_over, before, after in log["emulator_frames"]:
        assert (after < before and 1 <= after <= 30) if game_over else after == before + 4
    lost = [log["lives"][i] for i, end in enumerate(ends) if end == "life lost"]
    assert lost == [4, 3, 2, 1] * 2

    plain = make_env(config.env)
    obs, _ = plain.reset(seed=7)
    np.testing.assert_array_equal(obs, log["frames"][0])
    plain_ends = []
    for i, action in enumerate(log["actions"]):
        obs, reward, terminated, truncated, _ = plain.step(action)
        np.testing.assert_array_equal(obs, log["frames"][i + 1])
        assert plain.unwrapped.ale.lives() == log["lives"][i]
        if log["rewards"][i] is not None:
            assert log["rewards"][i] == np.sign(reward)
        plain_ends.append(terminated or truncated)
        if terminated or truncated:
            assert ends[i] == "game over"
            if i in log["restarts"]:
                obs, _ = plain.reset()  # the same no-op count: both draw from generators seeded alike
                np.testing.assert_array_equal(obs, log["restarts"][i])
    assert sum(plain_ends) == 2


def test_the_frame_limit_counts_whole_games_across_lives():
    """env.kwargs.max_num_frames_per_episode (108,000 in the protocol; 300 here) is the
    emulator's count since the game began, so training episodes split by lost lives
    share one limit: the game is cut (truncated, a game over) 300 frames in, and the
    next reset starts a new game."""
    config = config_for("atari100k_breakout",
                        'env.kwargs={"repeat_action_probability": 0.0, "max_num_frames_per_episode": 300}')
    env = make_env(config.env, training=True)
    env.reset(seed=3)
    rng = np.random.default_rng(1)
    episodes, steps = [], 0
    while True:
        _, _, terminated, truncated, info = env.step(int(rng.integers(4)))
        steps += 1
        if terminated or truncated:
            episodes.append((terminated, truncated, info["game_over"], frame_number(env)))
            if info["game_over"]:
                break
            env.reset()
    assert len(episodes) >= 2  # at least one life lost before the limit
    assert episodes[-1][1:] == (True, True, 300)
    assert all(terminated and not truncated and not over for terminated, truncated, over, _ in episodes[:-1])
    env.reset()
    assert frame_number(env) <= 30 and env.unwrapped.ale.lives() == 5


def test_training_games_are_cut_at_their_move_limit_counted_over_lives():
    """env.training_max_episode_steps (3,000 in the protocol; 80 here) counts a whole game's
    moves, the no-op of each lost life's reset included: the training episodes of one game
    add up to 80 moves, the last truncated as a game over; the evaluation env, driven by
    the same actions, plays on."""
    config = config_for("atari100k_breakout", "env.training_max_episode_steps=80")
    env, plain = make_env(config.env, training=True), make_env(config.env)
    env.reset(seed=3)
    plain.reset(seed=3)
    rng = np.random.default_rng(5)
    episodes, moves = [], 0
    while True:
        action = int(rng.integers(4))
        _, _, terminated, truncated, info = env.step(action)
        assert not any(plain.step(action)[2:4])
        moves += 1
        if terminated or truncated:
            episodes.append((terminated, truncated, info["game_over"]))
            if info["game_over"]:
                break
            env.reset()
            moves += 1  # the reset's no-op
            assert not any(plain.step(NOOP)[2:4])
    assert moves == 80 and len(episodes) >= 2 and episodes[-1] == (False, True, True)
    assert all(e == (True, False, False) for e in episodes[:-1])
    env.reset()
    assert env.unwrapped.ale.lives() == 5 and frame_number(env) <= 30


def test_a_seeded_reset_starts_a_new_game_even_after_a_lost_life():
    env = make_env(config_for("atari100k_breakout").env, training=True)
    first, _ = env.reset(seed=11)
    rng = np.random.default_rng(2)
    while True:
        *_, terminated, _, info = env.step(int(rng.integers(4)))
        if terminated:
            assert not info["game_over"]
            break
    again, _ = env.reset(seed=11)
    np.testing.assert_array_equal(again, first)
    assert env.unwrapped.ale.lives() == 5


def test_training_rewards_are_signs_and_evaluation_rewards_the_score():
    """Ms. Pac-Man scores 10 a dot: self-play's env sees +1, the evaluation env 10."""
    config = config_for("atari100k_pong", "env.id=ALE/MsPacman-v5")
    training, plain = make_env(config.env, training=True), make_env(config.env)
    training.reset(seed=4)
    plain.reset(seed=4)
    rng = np.random.default_rng(3)
    clipped, raw = [], []
    for _ in range(150):
        action = int(rng.integers(9))
        clipped.append(training.step(action)[1])
        raw.append(plain.step(action)[1])
    assert max(raw) >= 10 and set(clipped) <= {0.0, 1.0}
    assert clipped == [float(np.sign(r)) for r in raw]


# ---- which envs carry the training-only settings ----------------------------------------------


def test_only_selfplay_envs_carry_the_training_only_settings():
    config = config_for("atari100k_breakout")
    selfplay = selfplay_envs(config, "worker-0", 2)
    evaluation = evaluation_envs(config, "evaluator", 2)
    for env in selfplay:
        assert {EpisodicLife, SignReward, gym.wrappers.TimeLimit} <= set(wrappers(env))
    for env in [*evaluation, make_env(config.env)]:
        assert not {EpisodicLife, SignReward, gym.wrappers.TimeLimit} & set(wrappers(env))
    # an evaluation env plays through a lost life: not terminated until the game is over
    env = evaluation[0]
    env.reset(seed=5)
    rng = np.random.default_rng(4)
    lives = 5
    while lives == 5:
        *_, terminated, truncated, _ = env.step(int(rng.integers(4)))
        lives = env.unwrapped.ale.lives()
        assert not (terminated or truncated)
    assert lives == 4
    # configs without the keys: self-play's env is the plain one
    plain = config_for("atari_pong")
    assert not plain.env.episodic_life and not plain.env.clip_rewards and plain.env.training_max_episode_steps is None
    assert env_spec(plain.env).max_episode_steps is None  # Atari's own limit counts frames
    assert not {EpisodicLife, SignReward} & set(wrappers(selfplay_envs(plain, "worker-0", 1)[0]))


# ---- the protocol's settings in the envs the configs make -------------------------------------


@pytest.mark.parametrize("name", sorted(GAMES))
def test_each_atari100k_config_builds_its_env_and_network(name):
    """96 x 96 RGB frames, channels first; 4 frames (the current one and 3 past, with their
    actions as planes) into a downsampling residual network of EfficientZero's sizes."""
    config = config_for(name)
    spec = env_spec(config.env)
    assert spec.observation_shape == (3, 96, 96) and spec.observation_dtype == np.uint8
    assert spec.num_actions == GAMES[name]
    assert config.env.episodic_life and config.env.clip_rewards
    assert config.muzero.stacked_observations == 3 and config.mcts.num_simulations == 50
    assert spec.max_episode_steps == 3000  # self-play's games (the ring holds them whole)
    assert config.training.env_steps == 100_000 and config.training.batch_size == 256
    network = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions)
    assert network.observation_shape == (3 + 3 * 4, 96, 96)
    with torch.no_grad():
        out = network.initial_inference(torch.zeros((2, *network.observation_shape)))
    assert out.hidden_state.shape[:2] == (2, 64) and out.hidden_state.shape[2:] == (6, 6)
    assert out.policy_logits.shape == (2, spec.num_actions)


def test_no_op_starts_sticky_actions_frame_skip_and_frame_limit_are_the_protocols():
    config = config_for("atari100k_pong")
    env = make_env(config.env, training=True)
    ale = env.unwrapped.ale
    assert ale.getFloat("repeat_action_probability") == 0.0  # the NoFrameskip-v4 games EfficientZero plays
    assert ale.getInt("max_num_frames_per_episode") == 108_000  # 27,000 agent steps
    pre = next(e for e in iter_wrappers(env) if isinstance(e, gym.wrappers.AtariPreprocessing))
    assert (pre.noop_max, pre.frame_skip, pre.screen_size, pre.grayscale_obs) == (30, 4, (96, 96), False)
    starts = set()
    for seed in range(8):
        env.reset(seed=seed)
        starts.add(frame_number(env))
    assert len(starts) > 2 and all(1 <= s <= 30 for s in starts)  # 1 to 30 no-op frames, drawn per game
    # the emulator's env steps one frame, the agent's step four (AtariPreprocessing's skip, max-pooled)
    before = frame_number(env)
    env.unwrapped.step(0)
    env.step(2)
    assert frame_number(env) == before + 1 + 4


# ---- bad values -------------------------------------------------------------------------------


@pytest.mark.parametrize("override, fragment", [
    ("env.episodic_life=true", "env.episodic_life needs an Arcade Learning Environment game (env.unwrapped.ale "
                               "with lives()); CartPoleEnv has none"),
    ("env.clip_rewards=sometimes", "env.clip_rewards: expected true or false"),
    ("training.lr_warmup_steps=-1", "training.lr_warmup_steps: expected an integer in [0, "),
])  # fmt: skip
def test_bad_training_only_settings_stop_the_command_line_in_one_line(tmp_path, capsys, override, fragment):
    run_dir = tmp_path / "run"
    code = cli.main(["--config", str(CONFIGS / "cartpole.json"), "--run-dir", str(run_dir), "--device", "cpu",
                     "--workers", "0", "--set", override])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err
    assert not run_dir.exists()


# ---- the learning rate schedule ---------------------------------------------------------------


def efficientzero_lr(step: int, lr_init: float, warm_steps: int, rate: float, decay_steps: int) -> float:
    """EfficientZero's ``adjust_lr`` (core/train.py), for update number ``step`` counted
    from 0: a linear warm-up, then a decay in whole steps."""
    if step < warm_steps:
        return lr_init * step / warm_steps
    return lr_init * rate ** ((step - warm_steps) // decay_steps)


def test_the_learning_rate_warms_up_then_decays_in_steps_as_efficientzero():
    config = config_for("atari100k_pong")
    t = config.training
    assert (t.optimizer, t.lr_init, t.lr_warmup_steps, t.lr_decay_rate, t.lr_decay_steps) == ("sgd", 0.2, 1000, 0.1,
                                                                                                100_000)
    algorithm = algorithm_of(config)
    small = config_for("atari100k_pong", "network.encoding_size=4", "network.hidden=[4]", "network.projection_size=8",
                       "network.support_size=2")  # fmt: skip
    trainer = algorithm.make_trainer(small, algorithm.make_network(small, (3, 96, 96), 6), torch.device("cpu"))
    # mpper's update n runs at EfficientZero's lr for its update n (both counted from 1 after warm-up)
    for step in [0, 1, 499, 999, 1000, 1001, 50_000, 100_999, 101_000, 119_999]:
        ours = trainer.learning_rate(step)
        assert ours == pytest.approx(efficientzero_lr(step + 1 if step < 1000 else step, 0.2, 1000, 0.1, 100_000))
    assert trainer.learning_rate(0) == pytest.approx(0.2 / 1000) and trainer.learning_rate(100_999) == 0.2
    assert trainer.learning_rate(101_000) == pytest.approx(0.02)
    smooth = config_for("atari100k_pong", "training.lr_decay_staircase=false", "training.lr_warmup_steps=0",
                        "network.encoding_size=4", "network.hidden=[4]", "network.projection_size=8",
                        "network.support_size=2")  # fmt: skip
    smooth_trainer = algorithm.make_trainer(smooth, algorithm.make_network(smooth, (3, 96, 96), 6), torch.device("cpu"))
    assert smooth_trainer.learning_rate(50_000) == pytest.approx(0.2 * 0.1**0.5)


# ---- the ring must hold the longest training episode -----------------------------------------
# (A short Pong run of this config, trained on its stored 96 x 96 RGB frames to its final
# evaluation, is tests/test_bench_atari100k.py's: bench/atari100k.py --quick.)


def test_a_training_move_limit_the_ring_cannot_hold_is_refused_before_anything_starts(tmp_path, capsys):
    """The protocol's own training move limit, 3,000 moves, does not fit a ring of 2,000
    rows: exit 2, one line, no run directory."""
    argv = ["--config", str(CONFIGS / "atari100k_pong.json"), "--workers", "1", "--device", "cpu",
            "--run-dir", str(tmp_path / "refused"), "--max-train-steps", "4", "--set", "replay.capacity=2000",
            "--set", "env.training_max_episode_steps=3000"]  # fmt: skip
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert ("an episode of env.id 'ALE/Pong-v5' can last 3,000 moves, stored as 3,001 rows, but replay.capacity is "
            "2,000: raise replay.capacity, or lower env.training_max_episode_steps") in err
    assert not (tmp_path / "refused").exists()
