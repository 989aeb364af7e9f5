"""Config conveniences: configs that extend a base, shipped names that never load a local
file, other libraries' key names answered with mpper's, ``training.env_steps`` (the
config side; the runs are in test_env_steps.py), and ``--help-config`` within 100 columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import train  # noqa: F401 (a fixture: a stand-in runtime that records its calls)

from mpper import cli
from mpper.algos.configs import config_from_dict, load_config, load_run_config
from mpper.config import ConfigError, config_to_dict
from mpper.config_files import resolve_bases

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "mpper" / "configs"


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def config_error(path: Path, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


# ---- "base" ------------------------------------------------------------------------------------


def test_a_config_extends_a_shipped_one_key_by_key(tmp_path):
    path = write(tmp_path / "mine.json", {"base": "cartpole", "mcts": {"num_simulations": 7},
                                          "env": {"kwargs": {"sutton_barto_reward": True}}})  # fmt: skip
    mine, cartpole = load_config(path), load_config(SHIPPED / "cartpole.json")
    assert mine.mcts.num_simulations == 7 and mine.env.kwargs == {"sutton_barto_reward": True}
    assert mine.mcts.pb_c_init == cartpole.mcts.pb_c_init and mine.env.id == "CartPole-v1"
    whole = config_to_dict(mine)  # what a run writes as config.json: every key, no base
    assert "base" not in whole and whole["training"] == config_to_dict(cartpole)["training"]
    assert load_config(write(tmp_path / "again.json", whole)) == mine


def test_a_relative_base_is_read_beside_the_file_that_names_it_and_chains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not where the files are
    write(tmp_path / "cfg" / "common.json", {"base": "cartpole_dqn", "training": {"batch_size": 16, "lr_init": 0.001}})
    write(tmp_path / "cfg" / "sub" / "mine.json", {"base": "../common.json", "training": {"batch_size": 8}})
    mine = load_config(Path("cfg/sub/mine.json"))
    assert (mine.algorithm, mine.training.batch_size, mine.training.lr_init) == ("dqn", 8, 0.001)
    assert mine.dqn == load_config(SHIPPED / "cartpole_dqn.json").dqn


def test_an_object_from_python_extends_a_base_read_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "common.json", {"base": "cartpole", "training": {"batch_size": 16}})
    data, origins = resolve_bases({"base": "./common.json", "training": {"lr_init": 0.5}}, "<python>")
    config = config_from_dict(data, "<python>", origins=origins, check_env=False)
    assert (config.training.batch_size, config.training.lr_init, config.mcts.num_simulations) == (16, 0.5, 25)
    assert origins["training.batch_size"] == str(tmp_path / "common.json") and "training.lr_init" not in origins
    assert origins["mcts.num_simulations"] == "cartpole"


def test_a_bad_value_names_the_base_file_that_set_it(tmp_path):
    write(tmp_path / "base.json", {"training": {"batch_size": 0}})
    path = write(tmp_path / "mine.json", {"base": "./base.json", "training": {"lr_init": 0.1}})
    assert config_error(path) == f"{tmp_path / 'base.json'}: training.batch_size: expected an integer in [1, 65536], got 0"
    write(tmp_path / "fixed.json", {"base": "./base.json", "training": {"batch_size": 4}})
    assert load_config(tmp_path / "fixed.json", check_env=False).training.batch_size == 4


def test_cycles_and_missing_bases_are_one_line(tmp_path):
    write(tmp_path / "a.json", {"base": "b.json"})
    write(tmp_path / "b.json", {"base": "./a.json"})
    assert config_error(tmp_path / "a.json").endswith(f"base: a cycle of bases ({tmp_path / 'a.json'} -> "
                                                     f"{tmp_path / 'b.json'} -> ./a.json)")  # fmt: skip
    write(tmp_path / "self.json", {"base": "self.json"})
    assert "a cycle of bases" in config_error(tmp_path / "self.json")
    message = config_error(write(tmp_path / "gone.json", {"base": "missing.json"}))
    assert message == f"{tmp_path / 'gone.json'}: base {tmp_path / 'missing.json'}: no such file"
    message = config_error(write(tmp_path / "name.json", {"base": "cartpol"}))
    assert message.startswith(f"{tmp_path / 'name.json'}: base: cartpol: mpper ships no config of that name (shipped: ")
    assert "cartpole, cartpole_cql, cartpole_dqn" in message
    message = config_error(write(tmp_path / "num.json", {"base": 3}))
    assert message.startswith(f"{tmp_path / 'num.json'}: base: expected the name of a shipped config or a path")


def test_a_run_directory_config_names_no_base(tmp_path):
    """A received config.json is a whole config: a base there would make mpper read
    another file (anywhere on the machine); it is refused before that file is opened."""
    write(tmp_path / "elsewhere.json", {"training": {"batch_size": 3}})
    write(tmp_path / "run" / "config.json", {"base": str(tmp_path / "elsewhere.json")})
    with pytest.raises(ConfigError, match=r"config.json: base: a run directory's config.json is a whole config"):
        load_run_config(tmp_path / "run")


# ---- shipped names ---------------------------------------------------------------------------


def test_a_file_named_like_a_shipped_config_is_not_loaded(tmp_path, monkeypatch, capsys, train):
    """A file named ``cartpole`` in the current directory, whose env.id would run a shell
    command: ``--config cartpole`` is the shipped config, and a line says so."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "cartpole").write_text(json.dumps({"env": {"id": "subprocess:run",
                                                           "kwargs": {"args": f"touch {marker}", "shell": True}}}))  # fmt: skip
    assert cli.main(["--config", "cartpole", "--workers", "0", "--run-dir", str(tmp_path / "run")]) == 0
    assert train.calls[0]["config"] == load_config(SHIPPED / "cartpole.json", workers=0)
    assert not marker.exists()
    err = capsys.readouterr().err
    assert err == ("mpper: --config cartpole: the shipped config 'cartpole', not the file ./cartpole in this "
                   "directory; to use that file, name it as a path: --config ./cartpole\n")


@pytest.mark.parametrize("given", ["./mine", "mine.json", "sub/../mine.json"])
def test_a_local_file_is_used_when_named_as_a_path(tmp_path, monkeypatch, capsys, train, given):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    data = {"base": "cartpole", "training": {"batch_size": 7}}
    for name in ("mine", "mine.json"):
        write(tmp_path / name, data)
    assert cli.main(["--config", given, "--workers", "0", "--run-dir", str(tmp_path / "run")]) == 0
    assert train.calls[0]["config"].training.batch_size == 7
    assert capsys.readouterr().err == ""


def test_a_bare_name_is_never_a_local_file(tmp_path, monkeypatch, capsys, train):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "mine", {"training": {"batch_size": 7}})
    assert cli.main(["--config", "mine"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config mine: mpper ships no config of that name")
    assert err.endswith("a file is named as a path: ./mine or mine.json\n") and not train.calls


# ---- other libraries' names ---------------------------------------------------------------------


@pytest.mark.parametrize("data,expected", [
    ({"training": {"learning_rate": 1e-3}}, "training.learning_rate: unknown key (did you mean training.lr_init? "),
    ({"total_timesteps": 100000}, "total_timesteps: unknown key (did you mean training.env_steps? "),
    ({"training": {"gamma": 0.99}}, "training.gamma: unknown key (did you mean mcts.discount? "),
    ({"algorithm": "dqn", "training": {"gamma": 0.99}}, "training.gamma: unknown key (did you mean dqn.gamma? "),
    ({"replay": {"buffer_size": 1000}}, "replay.buffer_size: unknown key (did you mean replay.capacity? "),
    ({"replay": {"batch_size": 64}}, "replay.batch_size: unknown key (did you mean training.batch_size?)"),
    ({"runtime": {"n_envs": 4}}, "runtime.n_envs: unknown key (did you mean runtime.envs_per_worker? "),
    ({"seed": 1}, "seed: unknown key (did you mean runtime.seed? "),
    ({"training": {"learning_starts": 1000}}, "unknown key (did you mean training.min_buffer_steps? "),
    ({"algorithm": "dqn", "dqn": {"target_network_frequency": 500}}, "(did you mean dqn.target_update_interval? "),
    ({"algorithm": "dqn", "training": {"exploration_final_eps": 0.05}}, "(did you mean dqn.epsilon_end? "),
    ({"training": {"max_grad_norm": 10}}, "(did you mean training.grad_clip? "),
])  # fmt: skip
def test_other_libraries_names_get_mpper_s_key(data, expected):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "x.json")
    assert str(err.value).startswith("x.json: ") and expected in str(err.value)


def test_other_libraries_names_through_set_and_the_command_line(capsys, train):
    assert cli.main(["--config", "cartpole", "--set", "training.learning_rate=0.001"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set training.learning_rate=0.001: training.learning_rate: unknown key (did you "
                          "mean training.lr_init? mpper's name for the initial learning rate")  # fmt: skip
    assert err.count("\n") == 1 and not train.calls


# ---- training.env_steps -------------------------------------------------------------------------


def test_env_steps_flag_and_key(tmp_path, capsys, train):
    assert load_config(SHIPPED / "cartpole.json").training.env_steps is None
    assert cli.main(["--config", "cartpole", "--env-steps", "20000", "--run-dir", str(tmp_path / "run")]) == 0
    assert train.calls[0]["config"].training.env_steps == 20000
    assert cli.main(["--config", "cartpole", "--env-steps", "100"]) == 2
    assert capsys.readouterr().err == ("error: --env-steps: training.env_steps: must be >= training.min_buffer_steps "
                                       "(500), got 100: the run would stop before learning starts\n")
    assert cli.main(["--config", "cartpole", "--env-steps", "0"]) == 2
    assert "training.env_steps: expected an integer in [1, 1e15] or null, got 0" in capsys.readouterr().err


# ---- --help-config --------------------------------------------------------------------------------


def test_help_config_fits_100_columns(capsys, train):
    assert cli.main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "\ntraining.env_steps  int | null  default null  allowed in [1, 1e15]\n" in out
    assert not train.calls
