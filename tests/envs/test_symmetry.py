"""Board-symmetry augmentation (mpper.envs.symmetry): the dihedral group, that a symmetry of
TicTacToe commutes with the real env's rules, that the augmented targets of a real
buffer are the plain targets seen through the drawn symmetry, and the clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mpper  # noqa: F401  (registers mpper/TicTacToe-v0)
from mpper import cli
from mpper.algos.configs import load_config
from mpper.algos.muzero.targets import MuZeroTargets, muzero_schema
from mpper.algos.registry import algorithm_of
from mpper.config import ConfigError
from mpper.envs.symmetry import SymmetryAugmented, check_symmetries, dihedral_symmetries
from mpper.envs.tictactoe import TicTacToeEnv, position_value
from mpper.replay.buffer import ReplayBuffer

ROOT = Path(__file__).resolve().parents[2]


def transform_obs(obs: np.ndarray, src: np.ndarray) -> np.ndarray:
    """The plain-loop reference: cell c of the new board holds cell src[c] of the old."""
    flat = obs.reshape(obs.shape[0], -1)
    out = np.empty_like(flat)
    for c in range(flat.shape[1]):
        out[:, c] = flat[:, src[c]]
    return out.reshape(obs.shape)


def test_dihedral_symmetries_are_the_8_distinct_board_maps_and_a_group():
    d = dihedral_symmetries(3)
    assert d.shape == (8, 9)
    np.testing.assert_array_equal(d[0], np.arange(9))
    assert len({tuple(r) for r in d}) == 8
    members = {tuple(r) for r in d}
    for a in d:
        for b in d:
            assert tuple(a[b]) in members  # closed under composition
    # rotations keep the centre; the 4 corners map to corners
    assert (d[:, 4] == 4).all()
    assert all(set(r[[0, 2, 6, 8]]) == {0, 2, 6, 8} for r in d)
    # a 4x4 board: 8 distinct maps too (no fixed centre cell)
    assert len({tuple(r) for r in dihedral_symmetries(4)}) == 8


def test_a_symmetry_commutes_with_the_tictactoe_rules():
    """Play random legal games; the same game with every move mapped through inverse[g]
    gives, at every step, the transformed observation, the same reward, the same
    to_play and the transformed legal mask; game values are invariant."""
    d = dihedral_symmetries(3)
    inverse = SymmetryAugmented(None, d).inverse
    rng = np.random.default_rng(0)
    for _ in range(60):
        g = int(rng.integers(8))
        env, image = TicTacToeEnv(), TicTacToeEnv()
        obs, info = env.reset()
        obs2, info2 = image.reset()
        while True:
            np.testing.assert_array_equal(obs2, transform_obs(obs, d[g]))
            np.testing.assert_array_equal(info2["action_mask"], info["action_mask"][d[g]])
            assert info2["to_play"] == info["to_play"]
            if env.done:
                break
            assert position_value(obs2) == position_value(obs)
            a = int(rng.choice(np.flatnonzero(info["action_mask"])))
            obs, r, term, _, info = env.step(a)
            obs2, r2, term2, _, info2 = image.step(int(inverse[g, a]))
            assert (r2, term2) == (r, term)


def tictactoe_buffer(games: int = 40, seed: int = 0) -> ReplayBuffer:
    """A real buffer of random TicTacToe games with random visit distributions."""
    rng = np.random.default_rng(seed)
    buf = ReplayBuffer.create(muzero_schema((3, 3, 3), 9), capacity=games * 10, alpha=0.6)
    for _ in range(games):
        env = TicTacToeEnv()
        obs, info = env.reset()
        rows = {"observation": [obs], "action": [0], "reward": [0.0], "to_play": [0]}
        while not env.done:
            a = int(rng.choice(np.flatnonzero(info["action_mask"])))
            obs, r, _, _, info = env.step(a)
            for k, v in (("observation", obs), ("action", a), ("reward", r), ("to_play", info["to_play"])):
                rows[k].append(v)
        n = len(rows["action"])
        visits = rng.random((n, 9)).astype(np.float32)
        visits[-1] = 0
        arrays = {k: np.asarray(v) for k, v in rows.items()}
        arrays["child_visits"] = visits / np.maximum(visits.sum(1, keepdims=True), 1e-9)
        arrays["root_value"] = rng.uniform(-1, 1, n).astype(np.float32)
        buf.add_episode(arrays)
    return buf


@pytest.mark.parametrize("next_observations", [False, True])
def test_augmented_targets_are_the_plain_targets_seen_through_the_drawn_symmetry(next_observations):
    buf = tictactoe_buffer()
    try:
        inner = MuZeroTargets(num_unroll_steps=5, td_steps=20, discount=1.0, num_actions=9,
                              next_observations=next_observations)
        aug = SymmetryAugmented(inner, dihedral_symmetries(3))
        batch = 256
        got = buf.sample(batch, beta=1.0, targets=aug, rng=np.random.default_rng(7))
        # The same draw and inner build with an identical generator, then the symmetries
        # the wrapper drew next from it.
        rng = np.random.default_rng(7)
        plain = buf.sample(batch, beta=1.0, targets=inner, rng=rng)
        g = rng.integers(8, size=batch)
        np.testing.assert_array_equal(got.indices, plain.indices)
        assert len(set(g.tolist())) == 8
        d, inverse = dihedral_symmetries(3), aug.inverse
        for b in range(batch):
            np.testing.assert_array_equal(got.data["observation"][b], transform_obs(plain.data["observation"][b], d[g[b]]))
            for k in range(6):
                np.testing.assert_array_equal(got.data["target_policy"][b, k], plain.data["target_policy"][b, k][d[g[b]]])
                assert got.data["actions"][b, k] == inverse[g[b], plain.data["actions"][b, k]]
            if next_observations:  # the consistency loss's targets: the same board map at every step
                for k in range(5):
                    np.testing.assert_array_equal(got.data["next_observation"][b, k],
                                                  transform_obs(plain.data["next_observation"][b, k], d[g[b]]))
        for key in ("target_value", "target_reward", "gradient_scale") + (("next_observation_mask",) if next_observations else ()):
            np.testing.assert_array_equal(got.data[key], plain.data[key])
        np.testing.assert_array_equal(got.weights, plain.weights)
    finally:
        buf.close()


def test_the_tictactoe_config_trains_through_the_symmetries():
    config = load_config(ROOT / "configs" / "tictactoe.json")
    assert config.muzero.symmetry_augmentation
    targets = algorithm_of(config).make_targets(config, 9)
    assert isinstance(targets, SymmetryAugmented)
    np.testing.assert_array_equal(targets.symmetries, dihedral_symmetries(3))
    off = load_config(ROOT / "configs" / "tictactoe.json", ["muzero.symmetry_augmentation=false"])
    assert isinstance(algorithm_of(off).make_targets(off, 9), MuZeroTargets)


@pytest.mark.parametrize(
    "src, shape, match",
    [
        (np.zeros((2, 9), np.int64), (3, 3, 3), "row 0 is not a permutation"),
        (np.tile(np.arange(9), (2, 1)).astype(float), (3, 3, 3), "int array of shape"),
        (np.arange(8)[None], (3, 3, 3), r"shape \(G, 9\)"),
        (dihedral_symmetries(3), (27,), "observations of shape"),
        (dihedral_symmetries(3), (3, 2, 2), "9 board cells"),
    ],
)
def test_malformed_symmetries_are_refused_with_the_env_named(src, shape, match):
    with pytest.raises(ValueError, match=match) as err:
        check_symmetries(src, shape, 9, "env 'x'")
    assert "env 'x'" in str(err.value)


def test_the_config_refuses_augmentation_with_dqn_or_stacking():
    with pytest.raises(ConfigError, match='muzero: a section of algorithm "muzero", not of "dqn"'):
        load_config(ROOT / "configs" / "cartpole_dqn.json", ["muzero.symmetry_augmentation=true"], check_env=False)
    with pytest.raises(ConfigError, match="needs muzero.stacked_observations 0 .*, got 2"):
        load_config(ROOT / "configs" / "tictactoe.json", ["muzero.stacked_observations=2"])


def test_a_run_on_an_env_without_symmetries_stops_before_it_starts(tmp_path, capsys):
    code = cli.main(["--config", str(ROOT / "configs" / "cartpole.json"), "--workers", "0", "--run-dir",
                     str(tmp_path / "run"), "--set", "muzero.symmetry_augmentation=true"])  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: env 'CartPole-v1': symmetry augmentation is on, but the env declares no symmetries "
        "(env.unwrapped.symmetries(); see mpper.envs.symmetry)"
    )
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_rows_redrawn_after_a_torn_read_get_one_symmetry_each(monkeypatch):
    """The buffer rebuilds torn rows with a second ``build`` call and merges them: every
    row of the batch, redrawn or not, must be its own slot's position seen through one
    symmetry (observation, policy target and next action agree on it)."""
    import mpper.replay.buffer as rb

    real, calls = rb.find_torn, []

    def tear_ten_rows_once(*args):
        calls.append(1)
        return np.arange(10) if len(calls) == 1 else real(*args)

    monkeypatch.setattr(rb, "find_torn", tear_ten_rows_once)
    buf = tictactoe_buffer()
    try:
        aug = SymmetryAugmented(MuZeroTargets(num_unroll_steps=1, td_steps=20, discount=1.0, num_actions=9),
                                dihedral_symmetries(3))  # fmt: skip
        batch = buf.sample(64, beta=1.0, targets=aug, rng=np.random.default_rng(3))
        assert len(calls) == 2 and buf.counters["torn_rows_redrawn"] == 10
        d, inverse = dihedral_symmetries(3), aug.inverse
        fields = buf.fields
        for b, slot in enumerate(batch.indices):
            fits = [g for g in range(8)
                    if np.array_equal(batch.data["observation"][b], transform_obs(fields["observation"][slot], d[g]))
                    and np.allclose(batch.data["target_policy"][b, 0], fields["child_visits"][slot][d[g]])
                    and batch.data["actions"][b, 1] == inverse[g, fields["action"][slot + 1]]]  # fmt: skip
            assert fits, f"row {b} (slot {slot}) is no symmetry of its own position"
    finally:
        buf.close()
