"""Which flags each mode of the command line takes: a flag the user gave that does not
apply to the mode is refused in one line (argparse defaults never count as given); every
flag the README documents is accepted in its mode; ``--version``; the program name in
``--help``; ``mpper sweep``'s own flag and config mistakes (one line, exit 2, nothing run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import mpper
from mpper import cli

ROOT = Path(__file__).resolve().parents[1]

# mode -> the flags that select it, and one foreign flag with what it is refused for
MODES = {
    "training runs": (["--config", "cartpole"], ["--episodes", "3"]),
    "--resume": (["--resume", "RUN"], ["--checkpoint", "x.pt"]),
    "--evaluate": (["--evaluate", "RUN"], ["--workers", "3"]),
    "--evaluate --on-snapshot": (["--evaluate", "RUN", "--on-snapshot", "SNAP"], ["--episodes", "3"]),
    "--plot": (["--plot", "RUN"], ["--workers", "3"]),
    "--inspect": (["--inspect", "SNAP"], ["--max-train-steps", "5"]),
    "--help-config": (["--help-config"], ["--json"]),
    "--offline": (["--offline", "SNAP"], ["--episodes", "3"]),
    "--collect": (["--collect", "RUN"], ["--workers", "3"]),
}


def run_main(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_modes_table_covers_every_mode_and_every_flag():
    assert set(cli.MODE_FLAGS) == set(MODES) | {"sweep"}
    assert set(cli.MODES) == set(MODES)  # main hands each mode but sweep to its function
    dests = {a.dest for a in cli.build_parser()._actions if a.option_strings} - {"help", "version"}
    assert dests == set().union(*cli.MODE_FLAGS.values()), "a flag that no mode takes, or a mode taking no flag"


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_refuses_a_foreign_flag_in_one_line(mode, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written anywhere
    selecting, foreign = MODES[mode]
    assert cli.mode_of(set(cli.given_flags(selecting))) == mode
    rc, out, err = run_main(selecting + foreign, capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {foreign[0]} does not apply to {mode} (it applies to "), err
    assert list(tmp_path.iterdir()) == []


def test_the_refusal_names_where_the_flag_applies(capsys):
    assert run_main(["--plot", "RUN", "--workers", "3"], capsys)[2] == (
        "error: --workers does not apply to --plot (it applies to training runs and mpper sweep)\n")
    assert "(it applies to --inspect)" in run_main(["--evaluate", "RUN", "--json"], capsys)[2]
    assert "(it applies to --evaluate)" in run_main(["--config", "cartpole", "--render", "gif", "x.gif"], capsys)[2]


def test_argparse_defaults_do_not_count_as_given_but_typed_flags_do(capsys):
    # --episodes has a default (10) and --set one ([]): neither is "given" to --plot or --inspect
    assert cli.given_flags(["--plot", "RUN"]) == ["plot"]
    assert cli.given_flags(["--evaluate", "R", "--episodes", "10", "--set", "a.b=1"]) == ["evaluate", "episodes",
                                                                                            "overrides"]  # fmt: skip
    # typed, even with the default's value, it is refused where it does not apply
    rc, _, err = run_main(["--inspect", "SNAP", "--episodes", "10"], capsys)
    assert rc == 2 and "--episodes does not apply to --inspect" in err


def readme_commands() -> list[list[str]]:
    """Every command line of README.md (``python run.py ...``, ``mpper ...``), in code blocks
    and inline code, as its flags (``--x``; ``sweep`` first for a sweep)."""
    commands = []
    command = r"(?:python run\.py|(?:^[ \t]*|`)mpper)((?: +(?:sweep|\[?--[\w-]+|[^\s`#\[-][^\s`#]*\]?))+)"
    for match in re.finditer(command, (ROOT / "README.md").read_text(), re.MULTILINE):
        tokens = match.group(1).split()
        flags = [t.strip("[]").split("=")[0] for t in tokens if t.strip("[").startswith("--")]
        if flags:
            commands.append((["sweep"] if tokens[0] == "sweep" else []) + flags)
    return commands


def test_every_flag_the_readme_documents_applies_in_its_mode():
    commands = readme_commands()
    assert len(commands) >= 6, commands  # the README's command lines were found
    parser, sweep_parser = cli.build_parser(), cli.build_sweep_parser()
    main_dests = {o: a.dest for a in parser._actions for o in a.option_strings}
    sweep_options = {o for a in sweep_parser._actions for o in a.option_strings}
    for flags in commands:
        if flags[0] == "sweep":
            assert set(flags[1:]) <= sweep_options, flags
            continue
        assert set(flags) <= set(main_dests), flags
        given = [main_dests[f] for f in flags if main_dests[f] not in ("help", "version")]
        assert cli.foreign_flag(parser, given, cli.mode_of(set(given))) is None, flags


@pytest.mark.parametrize("argv", [
    ["--evaluate", "RUN", "--episodes", "3", "--checkpoint", "best.pt", "--seed", "1", "--set", "a.b=1"],
    ["--evaluate", "RUN", "--on-snapshot", "SNAP", "--checkpoint", "c.pt", "--set", "a.b=1"],
    ["--resume", "RUN", "--workers", "2", "--device", "cpu", "--max-train-steps", "9", "--time-limit", "5",
     "--run-dir", "D", "--config", "cartpole", "--seed", "2", "--set", "a.b=1", "--ray", "auto"],
    ["--inspect", "SNAP", "--json"],
], ids=["evaluate", "on-snapshot", "resume", "inspect"])  # fmt: skip
def test_each_mode_takes_all_its_flags(argv):
    given = cli.given_flags(argv)
    assert cli.foreign_flag(cli.build_parser(), given, cli.mode_of(set(given))) is None


def test_version_prints_the_package_version(capsys):
    rc, out, err = run_main(["--version"], capsys)
    assert rc == 0 and out == f"mpper {mpper.__version__}\n" == "mpper 0.1.0\n" and err == ""


@pytest.mark.parametrize("script,prog", [("/usr/local/bin/mpper", "mpper"), ("run.py", "run.py"),
                                         ("-c", "mpper")])  # fmt: skip
def test_help_names_the_program_invoked(capsys, monkeypatch, script, prog):
    monkeypatch.setattr(sys, "argv", [script])
    rc, out, _ = run_main(["--help"], capsys)
    assert rc == 0 and out.startswith(f"usage: {prog} ") and f"{prog} sweep --help" in out
    rc, out, _ = run_main(["sweep", "--help"], capsys)
    assert rc == 0 and out.startswith(f"usage: {prog} sweep ") and "--parallel" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_py_help_and_version_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "run.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=100,
                          check=False)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("usage: run.py "), proc.stderr
    proc = subprocess.run([sys.executable, "run.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=100, check=False)  # fmt: skip
    assert (proc.returncode, proc.stdout) == (0, "mpper 0.1.0\n"), proc.stderr


SWEEP_MISTAKES = [
    (["--seeds", "0"], "error: --seeds: expected an integer >= 1, got 0"),
    (["--parallel", "0"], "error: --parallel: expected an integer >= 1, got 0"),
    (["--first-seed", "-1"], "error: --first-seed: the seeds must lie in [0, 4294967295], got -1 to 3"),
    (["--seed", "3"], "error: --seed does not apply to mpper sweep (it applies to training runs, --evaluate and "
                      "--collect); "
                      "a sweep takes --seeds N and --first-seed S"),
    (["--run-dir", "D"], "does not apply to mpper sweep (it applies to training runs); a sweep takes --sweep-dir"),
    (["--plot", "RUN"], "error: --plot does not apply to mpper sweep (it applies to --plot)"),
    (["--bogus"], "error: sweep: unrecognized arguments: --bogus"),
    (["--set", "training.batchsize=64"], "did you mean training.batch_size?"),
    (["--workers", "-1"], "--workers: runtime.workers: expected an integer in [0, 4096], got -1"),
]


@pytest.mark.parametrize("extra,fragment", SWEEP_MISTAKES, ids=[m[0][0] + m[0][-1] for m in SWEEP_MISTAKES])
def test_sweep_mistakes_are_one_line_and_start_nothing(extra, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mpper"])
    rc, out, err = run_main(["sweep", "--config", "cartpole", *extra], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and fragment in err, err
    assert list(tmp_path.iterdir()) == []


def test_sweep_refuses_a_config_mistake_and_a_used_sweep_dir(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_main(["sweep", "--config", "no_such_config"], capsys)
    assert rc == 2 and "--config no_such_config: mpper ships no config of that name" in err
    (tmp_path / "old" / "seed-1").mkdir(parents=True)
    rc, out, err = run_main(["sweep", "--config", "cartpole", "--sweep-dir", "old", "--seeds", "2"], capsys)
    assert rc == 2 and out == "" and err == "error: --sweep-dir old: holds seed-1 from an earlier sweep; choose " \
                                            "another directory\n"
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["seed-1"]
