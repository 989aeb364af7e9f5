"""What a run logs besides metrics.jsonl, read back after one real short run with worker
processes: the start-up line and the progress lines on a piped stderr, metrics.csv,
TensorBoard's event file (one evaluation point per evaluation, the config as
hyperparameters), an offline Weights & Biases run and the periodic MP4 videos. Then the
one-line messages for a missing package."""

from __future__ import annotations

import csv
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from test_train_e2e import ROOT, run_args

from mpper.algos.configs import load_config
from mpper.cli import main
from mpper.runtime.logs import CSV_COLUMNS
from mpper.runtime.progress import LINE_WIDTH, startup_line
from mpper.runtime.run import Run, Seeds

pytestmark = pytest.mark.timeout(300)

PROGRESS = re.compile(r"^\d+:\d\d(:\d\d)? step \d+ \| ")


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A finished run: one worker, 60 training steps, an evaluation every second, wandb
    offline, stderr and stdout piped. Returns (run_dir, stderr,
    metrics.jsonl records)."""
    run_dir = tmp_path_factory.mktemp("logged") / "run"
    args = run_args(run_dir, "--workers", "1", "--max-train-steps", "60", "--seed", "2",
                    "--set", "training.samples_per_insert=4", "--set", "runtime.log_interval_s=0.5",
                    "--set", "runtime.wandb_project=mpper-tests")  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=250, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, proc.stderr, records


def evaluations(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "evaluation"]


@pytest.mark.slow
def test_the_start_up_line_comes_first_and_piped_progress_is_plain_lines(logged_run):
    run_dir, stderr, records = logged_run
    lines = stderr.split("\n")
    first = f"mpper: run directory {run_dir}; watch it with: tensorboard --logdir {run_dir}/tensorboard"
    assert lines.count(first) == 1
    assert not any(PROGRESS.match(line) for line in lines[: lines.index(first)])  # before the progress
    assert "\r" not in stderr and "\x1b" not in stderr  # no terminal control codes in a file
    progress = [line for line in lines if PROGRESS.match(line)]
    assert progress, stderr  # at least the run's last line, whatever the interval
    assert all(len(line) <= LINE_WIDTH and " | eval " in line and " | left " in line for line in progress)
    assert evaluations(records), records  # the evaluator plays the first weights at once
    assert re.search(r"\| eval -?\d", progress[-1]), progress  # the latest evaluation's return reaches the line
    assert re.match(r"^\d+:\d\d step 60 \| ", progress[-1]), progress  # the last line: where the run ended


def test_the_start_up_line_names_tensorboard_only_when_it_is_installed(tmp_path):
    assert startup_line(tmp_path / "r", False) == f"mpper: run directory {tmp_path / 'r'}"
    assert "tensorboard --logdir" in startup_line(tmp_path / "r", True)


@pytest.mark.slow
def test_metrics_csv_has_fixed_columns_and_one_evaluation_row_per_evaluation(logged_run):
    run_dir, _, records = logged_run
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert all(len(row) == len(CSV_COLUMNS) for row in rows[1:])
    table = [dict(zip(CSV_COLUMNS, row)) for row in rows[1:]]
    assert [row["event"] for row in table] == [r["event"] for r in records]
    assert [int(row["env_steps"]) for row in table] == [r["env_steps"] for r in records]
    evaluated = evaluations(records)
    assert evaluated and records[-1]["event"] == "end"
    with_return = [row for row in table if row["evaluation/mean_return"]]
    assert [row["event"] for row in with_return] == ["evaluation"] * len(evaluated)
    np.testing.assert_allclose([float(row["evaluation/mean_return"]) for row in with_return],
                               [r["evaluation"]["mean_return"] for r in evaluated])  # fmt: skip
    assert float(table[-1]["learner/training_step"]) == 60
    assert float(table[-1]["learner/total_loss"]) == pytest.approx(records[-1]["learner"]["total_loss"])


@pytest.mark.slow
def test_tensorboard_has_one_point_per_evaluation_and_the_config(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, records = logged_run
    (events,) = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("evaluation/mean_return")]
    evaluated = evaluations(records)
    assert [step for step, _ in points] == [r["env_steps"] for r in evaluated]
    np.testing.assert_allclose([v for _, v in points], [r["evaluation"]["mean_return"] for r in evaluated], rtol=1e-6)
    assert len(acc.Scalars("learner/total_loss")) == sum("total_loss" in r["learner"] for r in records)
    # the config: as hyperparameters (the HPARAMS tab) and as a text summary
    hparams = acc.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(hparams)
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(hparams["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["training.training_steps"].number_value == 60
    assert start.hparams["env.id"].string_value == "CartPole-v1"
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n")) == json.loads((run_dir / "config.json").read_text())


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline wandb run file (LevelDB log format: 32 KiB
    blocks of records, each with a 7-byte header: checksum, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@pytest.mark.slow
def test_wandb_offline_run_has_the_config_and_one_point_per_evaluation(logged_run):
    run_dir, _, records = logged_run
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    parsed = wandb_records(run_file)
    (run,) = [r.run for r in parsed if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["training"] == json.loads((run_dir / "config.json").read_text())["training"]
    assert run.project == "mpper-tests"
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in parsed if r.WhichOneof("record_type") == "history"]  # fmt: skip
    assert len(history) == len(records)
    evaluated = evaluations(records)
    logged = [(h["env_steps"], h["evaluation/mean_return"]) for h in history if "evaluation/mean_return" in h]
    assert logged == [(r["env_steps"], r["evaluation"]["mean_return"]) for r in evaluated]
    assert history[-1]["learner/training_step"] == 60


@pytest.mark.slow
def test_periodic_videos_are_written_during_the_run(tmp_path):
    """An in-process run (``--workers 0``), whose loop records each video before it goes
    on: with worker processes the run may end while the evaluator is still recording
    (a video the stop cuts short is not written), however fast the machine."""
    import imageio_ffmpeg

    run_dir = tmp_path / "run"
    args = run_args(run_dir, "--workers", "0", "--max-train-steps", "30", "--seed", "2",
                    "--set", "training.samples_per_insert=4", "--set", "runtime.evaluation_interval_s=1",
                    "--set", "runtime.video_every_evaluations=1")  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=250)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    videos = sorted((run_dir / "videos").iterdir())
    steps = {r["evaluation"]["training_step"] for r in evaluations(records)}
    assert videos and {int(v.stem) for v in videos} <= steps and all(v.suffix == ".mp4" for v in videos)
    reader = imageio_ffmpeg.read_frames(str(videos[0]))
    meta = reader.__next__()
    frames = [np.frombuffer(f, np.uint8).reshape(400, 600, 3) for f in reader]
    assert meta["size"] == (600, 400) and len(frames) >= 2  # CartPole's 600x400 frames, the reset and a move
    # its first frame is the reset of an evaluation round's seed (a later evaluation at the
    # same training step replaces the file, so which round is not known)
    seeds = Seeds(2)  # the run's --seed
    resets = []
    env = gym.make("CartPole-v1", render_mode="rgb_array")
    for round_ in range(len(evaluations(records)) + 1):
        env.reset(seed=seeds.evaluation(round_))
        resets.append(np.abs(frames[0].astype(int) - env.render()).mean())
    env.close()
    assert min(resets) < 2.0, resets  # H.264 is lossy: near, not equal


def test_a_missing_tensorboard_package_is_one_line_and_no_event_file(tmp_path, monkeypatch, capsys):
    # None in sys.modules makes `import tensorboard` raise ImportError, as if not installed
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    run = Run(load_config("configs/cartpole.json"), tmp_path / "run")
    run.start()
    run.finish()
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("mpper: TensorBoard off"), err
    assert "pip install -e .[tensorboard]" in err
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert (tmp_path / "run" / "metrics.csv").read_text().splitlines() == [",".join(CSV_COLUMNS)]


@pytest.mark.parametrize("key,module,extra", [("runtime.wandb_project=p", "wandb", "wandb"),
                                              ("runtime.video_every_evaluations=1", "imageio_ffmpeg", "video")])
def test_a_missing_wandb_or_video_package_is_one_line_before_the_run(tmp_path, monkeypatch, capsys, key, module,
                                                                     extra):  # fmt: skip
    monkeypatch.setitem(sys.modules, module, None)
    run_dir = tmp_path / "run"
    assert main(["--config", "cartpole", "--run-dir", str(run_dir), "--set", key]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"error: {key.split('=')[0]} needs")
    assert f"pip install -e .[{extra}]" in err
    assert not run_dir.exists()


@pytest.mark.slow
def test_an_in_process_run_logs_one_evaluation_point_per_evaluation_too(trained_run):
    """``--workers 0`` (the shared session run): the same CSV and TensorBoard rules."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    evaluated = evaluations(records)
    assert len(evaluated) >= 2 and len(records) > len(evaluated)
    with open(trained_run / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [row["event"] for row in table] == [r["event"] for r in records]
    assert [row["event"] for row in table if row["evaluation/mean_return"]] == ["evaluation"] * len(evaluated)
    (events,) = sorted((trained_run / "tensorboard").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("evaluation/mean_return")] == [r["env_steps"] for r in evaluated]


def test_an_env_that_cannot_draw_turns_the_videos_off_with_one_line(tmp_path, capsys):
    from mpper.algos.registry import algorithm_of
    from mpper.envs import env_spec
    from mpper.runtime.evaluation import PeriodicVideo

    # faulty_env:raising makes a walk that draws no frames (and takes no render_mode)
    config = load_config("configs/cartpole_dqn.json", ["env.id=faulty_env:raising",
                                                       "runtime.video_every_evaluations=1"])  # fmt: skip
    spec = env_spec(config.env)
    network = algorithm_of(config).make_network(config, spec.observation_shape, spec.num_actions)
    video = PeriodicVideo(config, tmp_path)
    video.after_evaluation(network, 5, seed=0)
    video.after_evaluation(network, 6, seed=0)  # off after the first: no second line
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("mpper: videos off (runtime.video_every_evaluations): "), err
    assert "render_mode" in err
    assert not (tmp_path / "videos").exists()


def test_wandb_that_cannot_start_a_run_is_one_line(tmp_path, monkeypatch):
    from mpper.runtime.logs import open_wandb

    # online, with no API key anywhere: wandb refuses before any network call
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ConnectionError) as caught:
        open_wandb("mpper-tests", tmp_path / "run", {"training": {}})
    message = str(caught.value)
    assert "\n" not in message and message.startswith("runtime.wandb_project 'mpper-tests': wandb could not start")
    assert "WANDB_MODE=offline" in message
