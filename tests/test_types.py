"""The type checker: ``mypy`` (configured in pyproject.toml, ``[tool.mypy]``) finds no error
in the packages it checks, and sees an algorithm's config sections through the typed
config class (``config.mcts.num_simulations`` is an int, a misspelt key is an error)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def mypy(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m mypy ARGS`` in the repository root, which is where ``mpper`` is found."""
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_mypy_finds_no_error_in_the_checked_packages():
    out = mypy()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found" in out.stdout
    checked = int(out.stdout.rsplit(" in ", 1)[1].split()[0])
    assert checked >= 50  # every module but runtime/'s and replay/'s


@pytest.mark.slow
def test_an_algorithm_section_resolves_and_a_wrong_key_is_an_error(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        from mpper.algos.dqn.config import DQNRunConfig
        from mpper.algos.muzero.config import MuZeroRunConfig
        from mpper.config import Config


        def read(config: MuZeroRunConfig, dqn: DQNRunConfig, shared: Config) -> None:
            reveal_type(config.mcts.num_simulations)
            reveal_type(config.reanalyse.num_simulations)
            reveal_type(dqn.dqn.gamma)
            reveal_type(shared.training.batch_size)
            config.mcts.num_simulation
            shared.mcts
            dqn.mcts
    """))
    out = mypy("--config-file", str(ROOT / "pyproject.toml"), str(probe))
    # the file and line number dropped (mypy's cache may name the probe of an earlier run:
    # same module, same text); mypy 1 says "builtins.int" where mypy 2 says "int"
    lines = [ln.split(": ", 1)[1].replace("builtins.", "") for ln in out.stdout.splitlines()
             if ln.split(":", 1)[0].endswith("/probe.py")]  # fmt: skip
    assert lines == [
        'note: Revealed type is "int"',
        'note: Revealed type is "int | None"',
        'note: Revealed type is "float"',
        'note: Revealed type is "int"',
        'error: "MCTSConfig" has no attribute "num_simulation"; maybe "num_simulations"?  [attr-defined]',
        'error: "Config" has no attribute "mcts"  [attr-defined]',
        'error: "DQNRunConfig" has no attribute "mcts"  [attr-defined]',
    ], out.stdout + out.stderr
