"""Custom environments: the three forms of ``env.id`` (a registered id, ``module:callable``,
gymnasium's ``module:EnvId``), modules found from the current directory, received run
directories that may not name either importing form, the one-line refusal of each
unsupported space, and the example of docs/custom_envs.md trained end to end from an
empty directory with the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from mpper import cli
from mpper.algos.configs import config_from_dict, load_config, load_run_config
from mpper.algos.registry import run_env_spec
from mpper.config import ConfigError
from mpper.env_ids import env_id_form
from mpper.envs import env_spec, make_env

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "custom_envs.md"


def doc_file(name: str) -> str:
    """The fenced block of docs/custom_envs.md whose info string names ``name``."""
    found = re.findall(rf"```\w+ {re.escape(name)}\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(found) == 1, name
    return found[0]


@pytest.fixture
def example_dir(tmp_path, monkeypatch):
    """An empty directory holding the doc's myenv.py and corridor.json, as the current
    directory; the module name is made unique so that no other test's import is reused."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # what mpper adds goes away with the test
    (tmp_path / "myenv.py").write_text(doc_file("myenv.py"))
    (tmp_path / "corridor.json").write_text(doc_file("corridor.json"))
    yield tmp_path
    for name in [m for m in sys.modules if m == "myenv"]:
        del sys.modules[name]


def test_the_forms_are_told_apart_by_what_follows_the_colon():
    assert env_id_form("CartPole-v1").kind == "registered"
    assert env_id_form("mpper/TicTacToe-v0").kind == "registered"
    assert env_id_form("myenv:make_corridor") == ("factory", "myenv", "make_corridor")
    assert env_id_form("pkg.envs:factories.make") == ("factory", "pkg.envs", "factories.make")
    assert env_id_form("myenv:Corridor-v0") == ("module_id", "myenv", "Corridor-v0")
    assert env_id_form("pkg:ns/Thing-v3") == ("module_id", "pkg", "ns/Thing-v3")
    assert not env_id_form("CartPole-v1").imports and env_id_form("myenv:Corridor-v0").imports


def test_a_module_in_the_current_directory_is_found_in_both_forms(example_dir):
    """The doc's myenv.py, with the current directory not on sys.path beforehand (as
    under the installed ``mpper`` script)."""
    sys.path[:] = [p for p in sys.path if p not in ("", str(example_dir))]
    for env_id in ("myenv:make_corridor", "myenv:Corridor-v0"):
        config = config_from_dict({"env": {"id": env_id, "kwargs": {"length": 4}}})
        spec = run_env_spec(config)
        assert (spec.observation_shape, spec.num_actions, spec.observation_dtype) == ((4,), 2, np.float32)
        env = make_env(config.env)
        observation, _ = env.reset(seed=0)
        assert observation.tolist() == [1.0, 0.0, 0.0, 0.0]
        assert [env.step(1)[2] for _ in range(3)] == [False, False, True]
    assert str(example_dir) in sys.path


def test_a_package_that_registers_its_ids_on_import(tmp_path, monkeypatch):
    """gymnasium's "pkg:Env-v0": importing the user's package registers the id (here a
    namespaced one); mpper imports it in every process that makes the env."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    pkg = tmp_path / "cfgtest_gridpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import gymnasium as gym
        gym.register("cfgtest/Grid-v2", entry_point="gymnasium.envs.classic_control:CartPoleEnv")
    """))
    config = config_from_dict({"env": {"id": "cfgtest_gridpkg:cfgtest/Grid-v2"}})
    assert env_spec(config.env).observation_shape == (4,)
    assert "cfgtest/Grid-v2" in gym.envs.registry


def test_a_module_that_cannot_be_found_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for env_id in ("cfgtest_nowhere:make", "cfgtest_nowhere:Thing-v0"):
        with pytest.raises(ConfigError) as err:
            config_from_dict({"env": {"id": env_id}}, "c.json")
        message = str(err.value)
        assert message.startswith(f'c.json: env.id: module "cfgtest_nowhere" of {env_id!r} cannot be found')
        assert f"current directory ({tmp_path})" in message and "PYTHONPATH" in message


@pytest.mark.parametrize("env_id", ["cfgtest_marker:CartPole-v1x", "cfgtest_marker:make"])
def test_a_run_directory_may_not_name_either_importing_form(tmp_path, monkeypatch, env_id):
    """A received config.json naming ``pkg:Env-v0`` is refused as ``module:callable`` is,
    before the package is even located (finding it can import a parent package): the
    module, which would leave a marker file, never runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "cfgtest_marker.py").write_text("open('ran', 'w').close()\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"env": {"id": env_id}}))
    with pytest.raises(ConfigError, match=rf'env.id: "{re.escape(env_id)}" names Python code to import; '):
        load_run_config(run_dir)
    assert not (tmp_path / "ran").exists() and "cfgtest_marker" not in sys.modules


class SpaceEnv(gym.Env):
    def __init__(self, observation_space, action_space):
        self.observation_space, self.action_space = observation_space, action_space

    def reset(self, *, seed=None, options=None):
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, True, False, {}


BOX = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
UNSUPPORTED = {
    "unbounded_box_actions": (BOX, gym.spaces.Box(-np.inf, np.inf, (1,)), "has an infinite or non-finite bound"),
    "integer_box_actions": (BOX, gym.spaces.Box(0, 3, (2,), np.int64), "not a float one"),
    "multidiscrete_actions": (BOX, gym.spaces.MultiDiscrete([2, 3]), "MultiDiscrete([2 3]) is neither Discrete nor"),
    "actions_from_one": (BOX, gym.spaces.Discrete(3, start=1), "Discrete(3, start=1) starts at 1"),
    "discrete_observations": (gym.spaces.Discrete(5), gym.spaces.Discrete(2), "FlattenObservation"),
    "dict_observations": (gym.spaces.Dict({"a": BOX}), gym.spaces.Discrete(2), "is not a Box; gymnasium.wrappers"),
    "multibinary_observations": (gym.spaces.MultiBinary(3), gym.spaces.Discrete(2), "MultiBinary(3) is not a Box"),
    "scalar_observations": (gym.spaces.Box(-1.0, 1.0, (), np.float32), gym.spaces.Discrete(2), "give it shape (1,)"),
    "empty_observations": (gym.spaces.Box(-1.0, 1.0, (0,), np.float32), gym.spaces.Discrete(2), "no element"),
}


def make_space_env(case: str) -> SpaceEnv:
    if case == "supported":
        return SpaceEnv(gym.spaces.Box(0, 255, (2, 3, 4, 5), np.uint8), gym.spaces.Discrete(1))
    return SpaceEnv(*UNSUPPORTED[case][:2])


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_each_unsupported_space_is_one_line_saying_what_is_supported(case, capsys, tmp_path):
    """Through the command line: exit 2, one line naming the env, the space and what mpper
    supports; nothing started or written."""
    argv = ["--config", "cartpole", "--workers", "0", "--run-dir", str(tmp_path / "run"),
            "--set", "env.id=test_custom_envs:make_space_env", "--set", f"env.kwargs.case={case}"]  # fmt: skip
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("error: env 'test_custom_envs:make_space_env': its ")
    assert UNSUPPORTED[case][2] in err
    assert err.rstrip().endswith('mpper supports a Discrete(n) action space starting at 0 or a bounded float Box '
                                 'action space ("algorithm": "sampled_muzero"), and a Box observation space of at '
                                 'least one element with a bool, integer or float dtype')  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_a_supported_space_of_any_shape_passes():
    config = config_from_dict({"env": {"id": "test_custom_envs:make_space_env", "kwargs": {"case": "supported"}}})
    spec = env_spec(config.env)
    assert (spec.observation_shape, spec.observation_dtype, spec.num_actions) == ((2, 3, 4, 5), np.uint8, 1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_documented_example_trains_from_its_own_directory(example_dir):
    """docs/custom_envs.md's myenv.py and corridor.json, alone in a directory, trained with
    the command line from there (``python run.py``, whose own directory, not the current
    one, is on sys.path), with a worker process that must find myenv too. Shortened by
    flags; the run's config.json is the whole resolved config."""
    run_dir = example_dir / "run"
    argv = [sys.executable, str(ROOT / "run.py"), "--config", "corridor.json", "--workers", "1", "--device", "cpu",
            "--run-dir", str(run_dir), "--max-train-steps", "40", "--time-limit", "200",
            "--set", "mcts.num_simulations=4", "--set", "runtime.envs_per_worker=2",
            "--set", "training.min_buffer_steps=64", "--set", "training.batch_size=16",
            "--set", "runtime.evaluation_episodes=2", "--set", "runtime.evaluation_interval_s=1"]  # fmt: skip
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(argv, cwd=example_dir, env=env, capture_output=True, text=True, timeout=380, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert episodes and all(e["worker"] == "worker-0" for e in episodes)
    assert all(-0.5 <= e["return"] <= 0.96 + 1e-6 for e in episodes)
    written = json.loads((run_dir / "config.json").read_text())
    assert "base" not in written and written["env"]["id"] == "myenv:make_corridor"
    assert written["mcts"]["pb_c_init"] == 1.25 and written["runtime"]["solve_return"] == 0.9  # base, then the diff
    assert load_config(example_dir / "corridor.json").runtime.max_episode_return == 1.0
    assert (run_dir / "checkpoint.pt").is_file()
