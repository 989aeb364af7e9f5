"""Command line: every config mistake is one line on stderr and exit code 2 with nothing
started; --help and --help-config; the resolved config and run dir handed to
``mpper.runtime.supervisor.train`` (a stub installed in sys.modules by the test, never a file)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mpper import cli
from mpper import config as cfg
from mpper.algos.configs import field_specs, load_config
from mpper.algos.registry import algorithm_of
from mpper.checkpoint import save_checkpoint
from mpper.config import config_to_dict

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = ROOT / "configs" / "cartpole.json"
FLAGS = ["--config", "--workers", "--device", "--seed", "--run-dir", "--max-train-steps", "--time-limit",
         "--resume", "--set", "--help-config", "--help"]  # fmt: skip


class TrainStub:
    def __init__(self, rc=0):
        self.calls = []
        self.rc = rc

    def __call__(self, setup):
        run_dir = setup.run_dir.root
        self.calls.append({"config": setup.config, "run_dir": run_dir, "resume": run_dir if setup.resume else None})
        return self.rc


@pytest.fixture
def train(monkeypatch):
    """A stand-in ``mpper.runtime.supervisor`` whose ``train`` records its calls."""
    stub = TrainStub()
    module = types.ModuleType("mpper.runtime.supervisor")
    module.train = stub
    monkeypatch.setitem(sys.modules, "mpper.runtime.supervisor", module)
    return stub


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(cfg.schema, "_cuda_available", lambda: False)


def base_config() -> dict:
    return json.loads(CARTPOLE.read_text())


def _set(section, key, value):
    def mutate(d):
        d[section][key] = value
    return mutate


def _top(key, value):
    def mutate(d):
        d[key] = value
    return mutate


# (id, config: mutation of cartpole.json | raw file text | None for a missing file,
#  extra argv, fragments the one error line must contain; "{cfg}" is the config path)
MISTAKES = [
    ("unknown-key", _set("training", "batch_sise", 64), [],
     ["{cfg}: training.batch_sise: unknown key", "did you mean training.batch_size?"]),
    ("unknown-section", _top("trainig", {}), [], ["{cfg}: trainig: unknown section", "did you mean training?"]),
    ("key-in-wrong-section", _set("mcts", "td_steps", 5), [], ["{cfg}: mcts.td_steps", "did you mean muzero.td_steps?"]),
    ("key-moved-to-algorithm-section", _set("training", "td_steps", 5), [],
     ["{cfg}: training.td_steps: renamed to muzero.td_steps (same meaning)"]),
    ("section-of-another-algorithm", _top("dqn", {}), [], ['{cfg}: dqn: a section of algorithm "dqn", not of "muzero"']),
    ("unknown-top-level-key", _top("seed", 1), [], ["{cfg}: seed: unknown key", "did you mean runtime.seed?"]),
    ("string-for-int", _set("training", "batch_size", "128"), [], ['{cfg}: training.batch_size: expected an integer in [1, 65536], got "128"']),
    ("bool-for-int", _set("runtime", "workers", True), [], ["{cfg}: runtime.workers: expected an integer in [0, 4096], got true"]),
    ("float-for-int", _set("replay", "capacity", 1e5), [], ["{cfg}: replay.capacity: expected an integer", "got 100000.0"]),
    ("string-for-float", _set("training", "lr_init", "0.02"), [], ['{cfg}: training.lr_init: expected a number > 0, got "0.02"']),
    ("negative-size", _set("training", "batch_size", -3), [], ["{cfg}: training.batch_size: expected an integer in [1, 65536], got -3"]),
    ("zero-simulations", _set("mcts", "num_simulations", 0), [], ["{cfg}: mcts.num_simulations: expected an integer in [1, 100000], got 0"]),
    ("zero-envs-per-worker", _set("runtime", "envs_per_worker", 0), [], ["{cfg}: runtime.envs_per_worker: expected an integer in [1, 65536]"]),
    ("negative-workers", _set("runtime", "workers", -2), [], ["{cfg}: runtime.workers: expected an integer in [0, 4096], got -2"]),
    ("zero-support", _set("network", "support_size", 0), [], ["{cfg}: network.support_size: expected an integer in [1, 10000]"]),
    ("batch-over-min-buffer", _set("training", "batch_size", 1000), [],
     ["{cfg}: training.batch_size: must be <= training.min_buffer_steps (500), got 1000"]),
    ("min-buffer-over-capacity", _set("replay", "capacity", 300), [],
     ["{cfg}: training.min_buffer_steps: must be <= replay.capacity (300), got 500"]),
    ("td-steps-zero", _set("muzero", "td_steps", 0), [], ["{cfg}: muzero.td_steps: expected an integer in [1, 1000000], got 0"]),
    ("probability-over-1", _set("mcts", "root_exploration_fraction", 1.5), [],
     ["{cfg}: mcts.root_exploration_fraction: expected a number in [0, 1], got 1.5"]),
    ("discount-zero", _set("mcts", "discount", 0), [], ["{cfg}: mcts.discount: expected a number in (0, 1], got 0"]),
    ("discount-over-1", _set("mcts", "discount", 1.2), [], ["{cfg}: mcts.discount: expected a number in (0, 1], got 1.2"]),
    ("beta-over-1", _set("replay", "beta", 2), [], ["{cfg}: replay.beta: expected a number in [0, 1], got 2"]),
    ("negative-lr", _set("training", "lr_init", -0.1), [], ["{cfg}: training.lr_init: expected a number > 0, got -0.1"]),
    ("grad-clip-zero", _set("training", "grad_clip", 0), [], ["{cfg}: training.grad_clip: expected a number > 0 or null, got 0"]),
    ("negative-seed", _set("runtime", "seed", -1), [], ["{cfg}: runtime.seed: expected an integer in [0, 4294967295], got -1"]),
    ("nan", '{"mcts": {"discount": NaN}}', [], ["{cfg}: mcts.discount: expected a number in (0, 1], got NaN"]),
    ("unknown-env-id", _set("env", "id", "CartPole-v9"), [],
     ['{cfg}: env.id: "CartPole-v9" is not a registered gymnasium id', 'did you mean "CartPole-v1"?', "module:callable"]),
    ("malformed-env-id", _set("env", "id", "cart pole"), [], ["{cfg}: env.id: ", "not a registered gymnasium id"]),
    ("env-factory-module-missing", _set("env", "id", "no_such_module_xyz:make_env"), [],
     ['{cfg}: env.id: module "no_such_module_xyz"', "cannot be found"]),
    ("env-kwargs-not-object", _set("env", "kwargs", "render"), [], ['{cfg}: env.kwargs: expected an object, got "render"']),
    ("unknown-algorithm", _top("algorithm", "alphazero"), [], ['{cfg}: algorithm: expected one of "muzero", "dqn", "sampled_muzero", got "alphazero"']),
    ("unknown-network-kind", _set("network", "kind", "mlp"), [], ['{cfg}: network.kind: expected one of "fc", "residual", got "mlp"']),
    ("unknown-optimizer", _set("training", "optimizer", "rmsprop"), [], ['{cfg}: training.optimizer: expected one of "adam", "sgd"']),
    ("unknown-device", _set("runtime", "device", "tpu"), [], ['{cfg}: runtime.device: expected one of "auto", "cpu", "cuda", got "tpu"']),
    ("cuda-not-there", _set("runtime", "device", "cuda"), [], ['{cfg}: runtime.device: "cuda" but torch.cuda.is_available() is false']),
    ("cuda-flag-not-there", None, ["--device", "cuda"], ['--device: runtime.device: "cuda" but torch.cuda.is_available() is false']),
    ("schedule-unsorted", _set("mcts", "temperature_schedule", [[0, 1], [0.75, 0.5], [0.5, 0.25]]), [],
     ["{cfg}: mcts.temperature_schedule[2][0]: fractions must increase"]),
    ("schedule-fraction-over-1", _set("mcts", "temperature_schedule", [[0, 1], [1.5, 0.5]]), [],
     ["{cfg}: mcts.temperature_schedule[1][0]: expected a fraction of training in [0, 1], got 1.5"]),
    ("hidden-zero-width", _set("network", "hidden", [16, 0]), [], ["{cfg}: network.hidden[1]: expected an integer in [1, 65536], got 0"]),
    ("hidden-not-a-list", _set("network", "hidden", 16), [], ["{cfg}: network.hidden: expected a list of at most 64 integers in [1, 65536], got 16"]),
    ("initial-priority", _set("replay", "initial_priority", "min"), [], ['{cfg}: replay.initial_priority: expected "actor", "max" or a number >= 0']),
    ("section-not-object", _top("training", [1, 2]), [], ["{cfg}: training: expected an object (a section of keys), got [1, 2]"]),
    ("top-level-not-object", "[1, 2, 3]", [], ["{cfg}: expected a JSON object at the top level, got a list"]),
    ("missing-file", "MISSING", [], ["{cfg}: no such file"]),
    ("bad-json", '{\n  "training": {"batch_size": 64,}\n}', [], ["{cfg}: invalid JSON at line 2, column 33"]),
    ("empty-file", "", [], ["{cfg}: the file is empty"]),
    ("duplicate-key", '{"runtime": {"workers": 2, "workers": 4}}', [], ["{cfg}: runtime.workers: duplicate key"]),
    ("set-unknown-key", None, ["--set", "training.batchsize=64"],
     ["--set training.batchsize=64: training.batchsize: unknown key", "did you mean training.batch_size?"]),
    ("set-no-equals", None, ["--set", "training.batch_size"], ["--set training.batch_size: expected section.key=value"]),
    ("set-wrong-type", None, ["--set", "reanalyse.enabled=maybe"], ['--set reanalyse.enabled=maybe: reanalyse.enabled: expected true or false, got "maybe"']),
    ("set-out-of-range", None, ["--set", "mcts.discount=1.5"], ["--set mcts.discount=1.5: mcts.discount: expected a number in (0, 1]"]),
    ("workers-flag-negative", None, ["--workers", "-1"], ["--workers: runtime.workers: expected an integer in [0, 4096], got -1"]),
    ("max-train-steps-zero", None, ["--max-train-steps", "0"], ["--max-train-steps: training.training_steps: expected an integer in [1, 1e15], got 0"]),
    ("time-limit-negative", None, ["--time-limit", "-5"], ["--time-limit: runtime.time_limit_s: expected a number > 0 or null, got -5.0"]),
]
assert len({m[0] for m in MISTAKES}) == len(MISTAKES) >= 20


@pytest.mark.parametrize("config,extra,fragments", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_config_mistake_is_one_line_and_exit_code_2(tmp_path, capsys, train, no_cuda, config, extra, fragments):
    path = tmp_path / "bad.json"
    if config is None:
        path.write_text(json.dumps(base_config()))
    elif config == "MISSING":
        pass
    elif isinstance(config, str):
        path.write_text(config)
    else:
        data = base_config()
        config(data)
        path.write_text(json.dumps(data))
    rc = cli.main(["--config", str(path), *extra])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    for frag in fragments:
        assert frag.replace("{cfg}", str(path)) in lines[0]
    assert train.calls == []  # nothing started


@pytest.mark.parametrize(
    "argv,fragment",
    [
        ([], "--config PATH is required"),
        (["--config", "x.json", "--workers", "many"], "argument --workers: invalid int value: 'many'"),
        (["--config", "x.json", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--config", "x.json", "--time-limit", "soon"], "argument --time-limit: invalid float value"),
        (["--config", "x.json", "--bogus"], "unrecognized arguments: --bogus"),
        (["--config"], "argument --config: expected one argument"),
        (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: no such run directory"),
    ],
)
def test_usage_mistakes_are_one_line_and_exit_code_2(capsys, train, argv, fragment):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err
    assert train.calls == []


def test_help_documents_every_flag(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in out, flag
    for action in cli.build_parser()._actions:
        for opt in action.option_strings:
            assert opt in out
        assert action.help, action.option_strings
    assert "auto,cpu,cuda" in out


def test_help_config_lists_every_key_and_starts_nothing(capsys, train):
    assert cli.main(["--help-config"]) == 0
    out = capsys.readouterr().out
    for spec in field_specs():
        assert f"\n{spec.key} " in out
    assert train.calls == []


def test_train_gets_the_resolved_config_and_run_dir(tmp_path, capsys, train):
    run_dir = tmp_path / "run"
    rc = cli.main(["--config", str(CARTPOLE), "--workers", "2", "--device", "cpu", "--seed", "7",
                   "--max-train-steps", "100", "--time-limit", "30", "--run-dir", str(run_dir),
                   "--set", "training.batch_size=64", "--set", "env.kwargs.sutton_barto_reward=true"])  # fmt: skip
    assert rc == 0
    assert capsys.readouterr().err == ""
    (call,) = train.calls
    c = call["config"]
    assert isinstance(c, cfg.Config)
    assert (c.runtime.workers, c.runtime.device, c.runtime.seed) == (2, "cpu", 7)
    assert (c.training.training_steps, c.runtime.time_limit_s, c.training.batch_size) == (100, 30.0, 64)
    assert c.env.kwargs == {"sutton_barto_reward": True}
    assert call["run_dir"] == run_dir and isinstance(call["run_dir"], Path)
    assert call["resume"] is None
    # everything else is exactly the file
    expected = load_config(CARTPOLE, ["training.batch_size=64", "env.kwargs.sutton_barto_reward=true"],
                           workers=2, device="cpu", seed=7, training_steps=100, time_limit_s=30)  # fmt: skip
    assert c == expected


def test_default_run_dir_is_runs_config_name_timestamp(tmp_path, monkeypatch, train):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--config", str(CARTPOLE)]) == 0
    run_dir = train.calls[0]["run_dir"]
    assert run_dir.parent == Path("runs") / "cartpole"
    assert re.fullmatch(r"\d{8}-\d{6}", run_dir.name)
    # claimed before the run starts: the directory holds only its lock so far
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]
    assert cli.main(["--config", str(CARTPOLE)]) == 0
    second = train.calls[1]["run_dir"]
    assert second != run_dir and second.parent == run_dir.parent


def test_resume_reads_the_run_config_and_continues_in_place(tmp_path, train):
    run = tmp_path / "runs" / "cartpole" / "20250101-000000"
    run.mkdir(parents=True)
    saved = load_config(CARTPOLE, ["training.batch_size=32"])
    (run / "config.json").write_text(json.dumps(config_to_dict(saved)))
    import torch


    # --resume needs a trainer's checkpoint for the network of the config (CartPole: 4 inputs, 2 actions)
    algorithm = algorithm_of(saved)
    trainer = algorithm.make_trainer(saved, algorithm.make_network(saved, (4,), 2), torch.device("cpu"))
    save_checkpoint(run / "checkpoint.pt", trainer)
    assert cli.main(["--resume", str(run), "--time-limit", "60"]) == 0
    call = train.calls[-1]
    assert call["resume"] == run and call["run_dir"] == run
    assert call["config"].training.batch_size == 32 and call["config"].runtime.time_limit_s == 60.0


def test_resume_with_a_broken_run_config_names_it(tmp_path, capsys, train):
    run = tmp_path / "run"
    run.mkdir()
    assert cli.main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {run / 'config.json'}: no such file\n"
    assert train.calls == []


def test_train_return_code_is_the_exit_code(monkeypatch, tmp_path):
    stub = TrainStub(rc=3)
    module = types.ModuleType("mpper.runtime.supervisor")
    module.train = stub
    monkeypatch.setitem(sys.modules, "mpper.runtime.supervisor", module)
    assert cli.main(["--config", str(CARTPOLE), "--run-dir", str(tmp_path / "r")]) == 3


def test_run_py_entry_point_exits_2_on_a_bad_config(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"training": {"batch_size": 0}}')
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--config", str(bad)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == f"error: {bad}: training.batch_size: expected an integer in [1, 65536], got 0\n"


def test_config_by_name_is_the_shipped_file_from_any_directory(tmp_path, monkeypatch, train):
    """``--config cartpole`` works outside a clone (after ``pip install``): it is the
    packaged ``mpper/configs/cartpole.json``, the file ``configs/cartpole.json`` links to."""
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert cli.main(["--config", "cartpole", "--run-dir", str(tmp_path / "run")]) == 0
    assert train.calls[0]["config"] == load_config(CARTPOLE)
    assert cli.resolve_config("cartpole").resolve() == CARTPOLE.resolve()
    assert {"cartpole", "cartpole_dqn", "cartpole_dqn_easyrl", "tictactoe"} <= set(cli.shipped_configs())


def test_unknown_config_name_is_one_line_naming_the_shipped_ones(tmp_path, monkeypatch, capsys, train):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--config", "cartpol"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config cartpol: mpper ships no config of that name (shipped: ")
    assert "cartpole, cartpole_cql, cartpole_dqn" in err and err.count("\n") == 1
    assert err.endswith("a file is named as a path: ./cartpol or cartpol.json\n")
    assert not train.calls


def test_mpper_console_script_is_the_cli(tmp_path):
    """setup.cfg installs ``mpper`` as ``mpper.cli:console``, which exits with main()'s code."""
    setup = (ROOT / "setup.cfg").read_text()
    assert re.search(r"console_scripts =\s*\n\s*mpper = mpper\.cli:console\n", setup)
    bad = tmp_path / "bad.json"
    bad.write_text('{"training": {"batch_size": 0}}')
    proc = subprocess.run([sys.executable, "-c", "from mpper.cli import console; console()", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 2 and proc.stderr == f"error: {bad}: training.batch_size: expected an integer in [1, 65536], got 0\n"
