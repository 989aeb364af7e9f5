"""bench/gpu.py: its figures out of a run's records and bench/selfplay.py's JSON, the
wheel install, and ``--quick`` end to end on the CPU (the GPU check's smoke test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402


def test_run_figures_come_from_the_records_once_learning_started(tmp_path):
    records = [
        {"event": "evaluation", "time_s": 0.0, "env_steps": 0, "learner": {}},
        {"event": "progress", "time_s": 5.0, "env_steps": 500, "learner": {"training_step": 10, "wait_fraction": 0.5}},
        {"event": "progress", "time_s": 10.0, "env_steps": 1000, "learner": {"training_step": 110, "wait_fraction": 0.1}},
        {"event": "end", "time_s": 20.0, "env_steps": 2000, "learner": {"training_step": 310, "wait_fraction": 0.3}},
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"event": "cut sh')
    figures = gpu.run_figures(path)
    assert figures["env_steps_per_s"] == pytest.approx(100.0)  # 2000 steps in 20 s
    assert figures["training_steps_per_s"] == pytest.approx(20.0)  # 300 steps from 5 s to 20 s
    assert figures["wait_fraction"] == pytest.approx(0.3)
    assert figures["records"] == 4
    path.write_text(json.dumps(records[0]) + "\n")
    assert "1 records" in gpu.run_figures(path)["note"]


def test_selfplay_figures_are_read_from_bench_selfplays_json():
    result = {"command": [], "results": [{"workers": 12, "agent_steps_per_s": 1500.5, "simulations_per_s": 24008.0,
                                          "rows_per_call": 31.5, "moves": 9000}]}  # fmt: skip
    expected = {"agent_steps_per_s": 1500.5, "simulations_per_s": 24008.0, "rows_per_call": 31.5}
    assert gpu.selfplay_figures(result) == expected
    with pytest.raises(KeyError):
        gpu.selfplay_figures({"results": [{"seconds": 3}]})


def test_no_wheel_folder_installs_nothing_and_the_children_see_the_repository(tmp_path):
    assert gpu.install_wheels(tmp_path / "absent", tmp_path / "site", None) == f"no wheels in {tmp_path / 'absent'}"
    # where the packages are there already (here: gymnasium), the wheels are left alone
    assert gpu.install_wheels(tmp_path / "absent", tmp_path / "site") == "gymnasium is installed: no wheels installed"
    assert gpu.child_env(tmp_path / "site")["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_wheels_are_installed_offline_and_put_on_the_path(tmp_path, monkeypatch):
    """A wheel in the folder (built here: one module) is installed without the index and
    imports, here and in a child process."""
    wheels, site = tmp_path / ".whl", tmp_path / "site"
    wheels.mkdir()
    name = "mpper_probe_wheel"
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheels / f"{name}-1.0-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
        whl.writestr(f"{dist}/RECORD", "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu.install_wheels(wheels, site, None) == f"installed 1 wheels from {wheels} into {site}"
    assert sys.path[0] == str(site) and (site / f"{name}.py").is_file()
    proc = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.VALUE)"], capture_output=True,
                          text=True, timeout=60, env=gpu.child_env(site))  # fmt: skip
    assert proc.stdout.strip() == "42", proc.stderr
    # a Python without pip: the wheels are unpacked onto the path instead
    other = tmp_path / "other"
    monkeypatch.setattr(gpu.sys, "executable", str(tmp_path / "python-without-pip"))
    (tmp_path / "python-without-pip").write_text("#!/bin/sh\necho 'No module named pip' >&2\nexit 1\n")
    (tmp_path / "python-without-pip").chmod(0o755)
    assert gpu.install_wheels(wheels, other, None).startswith(
        f"unpacked 1 wheels from {wheels} into {other} (pip: No module"
    )
    assert (other / f"{name}.py").read_text() == "VALUE = 42\n" and sys.path[0] == str(other)


def test_the_markdown_has_a_row_per_measurement_and_a_dash_for_none():
    data = {"learner": [{"config": "cartpole", "batch": 64, "device": "cpu", "capture": "static", "precision": "fp32",
                         "steps_per_s": 100.0, "wait_fraction": 0.25, "capture_s": None}],
            "selfplay": [{"note": "not run: bench/selfplay.py is absent"}], "run": []}  # fmt: skip
    text = gpu.markdown(data)
    assert "| cartpole | 64 | cpu | static | fp32 | 100.0 | 6,400 | 25.0% | - | - |  |" in text
    assert "not run: bench/selfplay.py is absent" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_runs_every_section_on_the_cpu(tmp_path):
    """``bench/gpu.py --quick``: the CartPole learner eager and static on the CPU, self-play
    through bench/selfplay.py with the network in the worker and served, and a short run
    with every process, into gpu.json and gpu.md."""
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=850, env=gpu.child_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu.json").read_text())
    learner = {(r["device"], r["capture"]): r for r in data["learner"]}
    assert set(learner) == {("cpu", "off"), ("cpu", "static")}
    for row in learner.values():
        assert row["config"] == "cartpole" and "note" not in row, row
        assert row["steps_per_s"] > 0 and 0 <= row["wait_fraction"] <= 1
    worker, served = data["selfplay"]
    assert (worker["inference"], served["inference"]) == ("worker", "server")
    for row in (worker, served):
        assert "note" not in row and row["agent_steps_per_s"] > 0, row
        assert row["simulations_per_s"] == pytest.approx(25 * row["agent_steps_per_s"])  # cartpole: 25 simulations
    # one worker of 8 envs: the server's calls hold at most its 8 rows; the worker's own has none to count
    assert worker["rows_per_call"] is None and 1 <= served["rows_per_call"] <= 8
    (run,) = data["run"]
    assert run["command"].startswith("python run.py --config configs/cartpole.json --workers 1 --device cpu")
    assert run["training_steps_per_s"] > 0 and run["env_steps_per_s"] > 0 and 0 <= run["wait_fraction"] <= 1, run
    text = (out / "gpu.md").read_text()
    assert "## Learner" in text and "## Self-play" in text and "## A run with every process" in text
    assert "| cartpole | 64 | cpu | static | fp32 |" in text
    assert "written:" in proc.stdout
