"""The main job end to end: `python run.py` as a user runs it, on CPU, small and short."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mpper import ReplayBuffer, shm
from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of
from mpper.envs import env_spec, make_env

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--set", "training.min_buffer_steps=200", "--set", "training.batch_size=32",
    "--set", "mcts.num_simulations=6", "--set", "runtime.envs_per_worker=4",
    "--set", "replay.capacity=20000", "--set", "runtime.evaluation_interval_s=1",
    "--set", "runtime.evaluation_episodes=2", "--set", "runtime.log_interval_s=1",
    "--set", "training.publish_interval=5", "--set", "env.max_episode_steps=100",
]  # fmt: skip


def run_args(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "run.py", "--config", "configs/cartpole.json", "--device", "cpu",
            "--run-dir", str(run_dir), *SMALL, *extra]  # fmt: skip


def complete_lines(path: Path) -> list[str]:
    """The lines of a file another process is appending to, without a last partial one."""
    return [line for line in path.read_text().split("\n")[:-1] if line]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def check_outputs(run_dir: Path) -> dict:
    """Everything a finished run leaves behind loads, and nothing is left running."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["event"] == "end"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["training"]["batch_size"] == 32
    # the final checkpoint: the learner's last step, the weights it published last, the
    # run's config, and a network of the run's shape with finite weights
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["training_step"] == records[-1]["learner"]["training_step"]
    assert ckpt["extra"]["weights_version"] == records[-1]["weights_version"]
    assert ckpt["extra"]["config"] == config
    cfg = load_config(run_dir / "config.json")
    spec = env_spec(cfg.env)
    algorithm_of(cfg).make_network(cfg, spec.observation_shape, spec.num_actions).load_state_dict(ckpt["network"])  # strict
    assert all(torch.isfinite(t).all() for t in ckpt["network"].values())
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        counters = snap.counters
    assert_no_process_left(run_dir)
    return {"records": records, "checkpoint": ckpt, "counters": counters}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_workers_train_and_everything_is_saved(tmp_path, capsys, trained_run):
    run_dir = tmp_path / "run"
    # samples-per-insert keeps the learner in step with self-play (and is exercised)
    # (and the workers yield the CPU: runtime.selfplay_niceness)
    args = run_args(run_dir, "--workers", "2", "--max-train-steps", "60", "--set", "training.samples_per_insert=4",
                    "--set", "runtime.selfplay_niceness=3")  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        offsets, expected = workers_niceness_against_the_learner(run_dir, proc, raised=3, workers=2)
        stdout, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert offsets == [expected, expected]
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "training finished (60 steps)" in stdout
    out = check_outputs(run_dir)
    c = out["counters"]
    assert c["games"] > 0 and c["steps"] >= 200  # the buffer filled past min_buffer_steps
    assert c["samples"] >= 60 * 32  # the learner trained on it
    assert c["priority_updates_applied"] > 0  # and wrote priorities back
    assert c["reanalysed_episodes"] > 0  # the reanalyser stored values
    last = out["records"][-1]
    assert last["learner"]["training_step"] == 60
    assert last["weights_version"] >= 60 // 5
    # the workers played with weights published after the first ones
    assert max(last["worker_weights_versions"].values()) > 1
    assert any(r["event"] == "evaluation" for r in out["records"])
    # One Run for both schedulers: a --workers 0 run (trained_run) writes the same files
    # and records with the same keys for each event
    def kinds(run) -> tuple[set, dict]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        keys = {}
        for r in records:
            keys.setdefault(r["event"], set()).update(r)
        return {p.name for p in run.iterdir()}, keys

    files, keys = kinds(run_dir)
    inline_files, inline_keys = kinds(trained_run)
    assert files == inline_files and set(keys) == set(inline_keys) == {"progress", "evaluation", "end"}
    assert keys == inline_keys
    assert set(json.loads((trained_run / "episodes.jsonl").read_text().splitlines()[0])) == set(
        json.loads((run_dir / "episodes.jsonl").read_text().splitlines()[0]))
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        leaves = snap.priorities(np.arange(snap.capacity))
        assert np.isfinite(snap.fields["reanalysed_value"]).any()
    assert len(np.unique(leaves[leaves > 0])) > 10  # priorities differ: they were updated
    # --evaluate judges the saved agent, the run's best weights (best.pt), and writes evaluation.json
    from mpper.cli import main

    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert main(["--evaluate", str(run_dir), "--episodes", "2", "--seed", "1"]) == 0
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    assert evaluation["episodes"] == 2 and evaluation["checkpoint"] == str(run_dir / "best.pt")
    assert evaluation["training_step"] == best["training_step"]
    # the returns are those of best.pt's network playing greedily with seed 1
    # (CartPole: reward 1 per move, episodes cut at 100 moves)
    returns = greedy_returns(run_dir / "best.pt", run_dir, episodes=2, seed=1)
    assert evaluation["returns"] == returns
    assert all(1 <= r <= 100 for r in returns)
    assert evaluation["return"]["min"] == min(returns) and evaluation["return"]["max"] == max(returns)
    # without best.pt, the learner's last weights
    (run_dir / "best.pt").unlink()
    assert main(["--evaluate", str(run_dir), "--episodes", "1"]) == 0
    assert json.loads((run_dir / "evaluation.json").read_text())["training_step"] == 60
    (run_dir / "checkpoint.pt").rename(run_dir / "moved.pt")
    capsys.readouterr()
    assert main(["--evaluate", str(run_dir)]) == 2  # missing checkpoint: one clear line naming it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.pt" in err[0]
    assert main(["--evaluate", str(run_dir), "--checkpoint", str(run_dir / "moved.pt"), "--episodes", "1"]) == 0
    # TensorBoard (the dev extra installs it): every metrics.jsonl record, read back
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    records = out["records"]
    assert_same_series(scalars["buffer/positions"], [(r["env_steps"], r["buffer_positions"]) for r in records])
    trained = [(r["env_steps"], r["learner"]["total_loss"]) for r in records if "total_loss" in r["learner"]]
    assert trained and scalars["learner/training_step"][-1] == (records[-1]["env_steps"], 60.0)
    assert_same_series(scalars["learner/total_loss"], trained)
    # one point per evaluation (every record repeats the latest evaluation; only its own record logs it)
    evaluated = [(r["env_steps"], r["evaluation"]["mean_return"]) for r in records if r["event"] == "evaluation"]
    assert evaluated
    assert_same_series(scalars["evaluation/mean_return"], evaluated)


def niceness(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    except (FileNotFoundError, ProcessLookupError):
        return None


def workers_niceness_against_the_learner(run_dir: Path, proc: subprocess.Popen, raised: int, workers: int,
                                         timeout: float = 60) -> tuple[list[int], int]:  # fmt: skip
    """Each worker's niceness minus the learner's, and the offset expected (``raised``, or
    less where the learner's niceness is within ``raised`` of the ceiling 19), once all
    ``workers`` are listed in ``processes.json`` (the supervisor rewrites it as it starts
    each child) and every one shows it (they change their own as they start), or
    ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pids = json.loads((run_dir / "processes.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pids = {}
        learner = niceness(pids["learner"]) if "learner" in pids else None
        nicenesses = [niceness(pid) for name, pid in sorted(pids.items()) if name.startswith("worker")]
        if learner is not None and len(nicenesses) == workers and None not in nicenesses:
            offsets, expected = [w - learner for w in nicenesses], min(raised, 19 - learner)
            if all(o == expected for o in offsets) or time.monotonic() > deadline:
                return offsets, expected
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its workers were seen"
        time.sleep(0.02)


def assert_same_series(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same steps, and the same values to float32 precision (TensorBoard's)."""
    assert [step for step, _ in got] == [step for step, _ in expected]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in expected], rtol=1e-6)


def test_tensorboard_scalars_of_a_record_nested_groups_as_paths(tmp_path):
    """The run's TensorBoard log puts a metrics record's numbers against env steps: nested
    groups (a two-player evaluation's per-opponent results) as a/b/c tags; strings,
    lists, booleans and a missing self-play return are left out; the evaluation's
    figures only from an "evaluation" record."""
    from mpper.runtime.logs import TensorBoardLog

    log = TensorBoardLog(tmp_path / "tb", {"training": {"batch_size": 32}})
    record = {
        "event": "evaluation", "env_steps": 120, "buffer_positions": 100, "mean_selfplay_return": None,
        "learner": {"total_loss": 1.5, "training_step": 7, "device": "cpu", "state": "training"},
        "evaluation": {"mean_return": -0.25, "returns": [0, 1], "against": "perfect",
                       "opponents": {"random": {"first": {"wins": 3, "draws": 1}}, "perfect": {"games": 4}}},
        "reanalyse": {"episodes": 2, "busy": True},
    }  # fmt: skip
    log.write(record)
    log.write({**record, "event": "progress", "env_steps": 150, "buffer_positions": 130, "mean_selfplay_return": 9.5})
    log.close()
    assert tensorboard_scalars(tmp_path / "tb") == {
        "buffer/positions": [(120, 100.0), (150, 130.0)],
        "selfplay/mean_return": [(150, 9.5)],
        "learner/total_loss": [(120, 1.5), (150, 1.5)],
        "learner/training_step": [(120, 7.0), (150, 7.0)],
        "evaluation/mean_return": [(120, -0.25)],
        "evaluation/opponents/random/first/wins": [(120, 3.0)],
        "evaluation/opponents/random/first/draws": [(120, 1.0)],
        "evaluation/opponents/perfect/games": [(120, 4.0)],
        "reanalyse/episodes": [(120, 2.0), (150, 2.0)],
    }


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in the event files under ``logdir``,
    read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def greedy_returns(checkpoint: Path, run_dir: Path, episodes: int, seed: int) -> list[float]:
    """The returns of ``episodes`` greedy episodes of the checkpoint's network, played
    here with mpper.runtime.evaluation.play_greedy (what --evaluate should report)."""
    from mpper.checkpoint import load_checkpoint
    from mpper.runtime.evaluation import play_greedy

    cfg = load_config(run_dir / "config.json")
    spec = env_spec(cfg.env)
    network = algorithm_of(cfg).make_network(cfg, spec.observation_shape, spec.num_actions)
    network.load_state_dict(load_checkpoint(checkpoint)["network"])
    network.eval()
    envs = [make_env(cfg.env) for _ in range(episodes)]
    try:
        return [float(ep.total_reward) for ep in play_greedy(cfg, envs, network, seed)]
    finally:
        for env in envs:
            env.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_dead_learner_stops_the_run_with_its_error_and_a_final_snapshot(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(run_args(run_dir, "--workers", "1", "--max-train-steps", "100000"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until_training(proc, run_dir)
        os.kill(json.loads((run_dir / "processes.json").read_text())["learner"], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert "run stopped: learner died (killed by SIGKILL)" in stderr
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        assert snap.counters["games"] > 0  # the final snapshot holds what was played
    assert not segments_of(proc.pid)  # the supervisor unlinked its segments
    assert_no_process_left(run_dir)


def segments_of(pid: int) -> list[str]:
    """The mpper segments that process ``pid`` created (other test sessions may run
    beside this one, with segments of their own)."""
    return [name for name in shm.mpper_segments() if shm.owner_pid(name) == pid]


def assert_no_process_left(run_dir: Path, within: float = 30.0) -> None:
    """Every process of ``processes.json`` (supervisor and children) is gone (polled for
    up to ``within`` seconds: they exit at once, but a loaded machine may be slow to)."""
    pids = json.loads((run_dir / "processes.json").read_text())
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {name: pid for name, pid in pids.items() if alive(pid)}, "a process outlived the run"


def training_step(run_dir: Path) -> int:
    """The learner's latest training step in metrics.jsonl (0 before the first)."""
    return max((json.loads(x)["learner"].get("training_step", 0) for x in complete_lines(run_dir / "metrics.jsonl")),
               default=0)  # fmt: skip


def assert_counters_match_the_episodes(snap: ReplayBuffer) -> None:
    """The shared counters agree with the episode table, and every stored episode is
    whole: a CartPole episode's rows after the first each carry reward 1 and (but the
    last) a visit distribution. A torn or half-copied episode would show zeros."""
    c, episodes = snap.counters, snap.episodes()
    assert c["episodes_evicted"] == 0  # nothing left the ring: every game played is there
    assert c["games"] == len(episodes) > 0
    assert c["steps"] == c["positions"] == len(snap) == sum(ep.rows - 1 for ep in episodes)
    for ep in episodes:
        rows = snap.read_episode(ep, ["reward", "child_visits", "root_value"])
        assert (rows["reward"][1:] == 1).all() and rows["reward"][0] == 0, ep
        np.testing.assert_allclose(rows["child_visits"][:-1].sum(axis=1), 1, rtol=1e-5, err_msg=str(ep))
        assert np.isfinite(rows["root_value"]).all()
    slots = np.concatenate([np.arange(ep.start, ep.start + ep.rows - 1) for ep in episodes])
    leaves = snap.priorities(np.arange(snap.capacity))
    assert (leaves[slots] > 0).all() and np.count_nonzero(leaves) == slots.size  # only stored positions sample


def wait_until_training(proc: subprocess.Popen, run_dir: Path, steps: int = 5, timeout: float = 150) -> None:
    """Block until the run's metrics show ``steps`` training steps (the learner trains)."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.5)
        if metrics.exists():
            lines = [json.loads(x) for x in complete_lines(metrics)]
            if any(r["learner"].get("training_step", 0) >= steps for r in lines):
                return


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_worker_is_restarted_and_sigterm_stops_the_run_with_a_final_checkpoint_and_snapshot(tmp_path):
    """A training `python run.py --workers 2`: a worker SIGKILLed mid-episode is restarted
    and training goes on; then SIGTERM: exit code 143, a checkpoint and a buffer snapshot
    written after the signal (the learner's last step, every game played), the end record,
    and nothing left: no process of the run (children, forkserver, resource tracker) and no
    shared-memory segment of any of them. (Ctrl-C's stop, exit 130, is
    tests/runtime/test_shutdown.py's and tests/runtime/test_inference.py's.)"""
    from test_faults import forkserver_of

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(run_args(run_dir, "--workers", "2", "--max-train-steps", "100000"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until_training(proc, run_dir)
        pids = json.loads((run_dir / "processes.json").read_text())
        helpers = forkserver_of(pids["supervisor"])
        assert helpers and segments_of(proc.pid)  # while it runs: the forkserver, the segments
        os.kill(pids["worker-0"], signal.SIGKILL)  # a worker killed mid-episode
        deadline = time.monotonic() + 60
        while json.loads((run_dir / "processes.json").read_text())["worker-0"] == pids["worker-0"]:
            assert time.monotonic() < deadline, "the killed worker was not restarted"
            assert proc.poll() is None
            time.sleep(0.2)
        pids = json.loads((run_dir / "processes.json").read_text())  # the restarted worker-0 among them
        restarted_at = training_step(run_dir)
        while training_step(run_dir) < restarted_at + 5:  # training goes on after the restart
            assert time.monotonic() < deadline, "training stopped after the worker was restarted"
            assert proc.poll() is None
            time.sleep(0.2)
        trained_before = training_step(run_dir)
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        # a hang, not a slow machine, is what fails: TimeoutExpired after a generous bound
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stdout[-2000:] + stderr[-4000:]
    assert "worker-0 died (killed by SIGKILL)" in stderr and "restarting worker-0" in stderr
    assert "terminated" in stdout and "run stopped" not in stderr
    out = check_outputs(run_dir)  # the end record; the checkpoint is the learner's last step
    ckpt = out["checkpoint"]
    assert ckpt["training_step"] >= max(trained_before, 5) and ckpt["extra"]["time"] >= signalled
    manifest = json.loads((run_dir / "buffer" / "manifest.json").read_text())
    assert manifest["created_unix"] >= signalled  # the final snapshot, not an earlier one
    # The killed worker's partial episode never became sampleable, and the counters add
    # up: games and steps are exactly what the final snapshot's episode table holds.
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:  # every checksum verified
        assert_counters_match_the_episodes(snap)
        games = snap.counters["games"]
    assert out["records"][-1]["games"] == games
    # Each episode is reported after it is stored; the SIGKILL may have lost the reports
    # of the (at most envs_per_worker = 4) episodes the worker stored in its last move.
    reported = len(complete_lines(run_dir / "episodes.jsonl"))
    assert games - 4 <= reported <= games
    assert_no_process_left(run_dir)
    assert not segments_of(proc.pid)  # the supervisor unlinked its segments
    assert not [p for p in helpers if alive(p)], "the forkserver or the resource tracker outlived the run"
    assert not [name for pid in pids.values() for name in segments_of(pid)], "a segment of the run is left"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_game_segments_are_stored_as_played_and_whole_games_reported(tmp_path):
    """``muzero.game_segment_length`` 4 with a real worker process: the buffer holds
    pieces of at most 4 moves, the last of each game terminated (but where the 100-move
    time limit cut the game) and the others cut, each cut piece going on in a stored
    piece that starts where it ended (but the last of the 4 games in play at the end);
    episodes.jsonl reports whole games only, longer than a piece."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(run_args(run_dir, "--workers", "1", "--max-train-steps", "30",
                                   "--set", "muzero.game_segment_length=4"),
                          cwd=ROOT, capture_output=True, text=True, timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    games = [json.loads(line) for line in complete_lines(run_dir / "episodes.jsonl")]
    assert games and max(g["length"] for g in games) > 4
    assert all(g["return"] == g["length"] for g in games)  # CartPole: 1 per move, whole games
    with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
        pieces = snap.episodes()
        observations = [snap.read_episode(ep, ["observation"])["observation"] for ep in pieces]
        assert max(ep.rows - 1 for ep in pieces) == 4 and len(pieces) > len(games)
        ends = {o[-1].tobytes() for o, ep in zip(observations, pieces) if not ep.terminated}
        starts = {o[0].tobytes() for o in observations}
        timed_out = sum(g["length"] == 100 for g in games)
        assert len(ends & starts) >= len(ends) - 4 - timed_out
        assert sum(ep.terminated for ep in pieces) >= len(games) - timed_out
        assert sum(g["length"] for g in games) <= snap.counters["steps"]  # games in play are not reported


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_workers_zero_takes_turns_in_one_process_and_is_repeatable(tmp_path):
    """--workers 0: self-play, learning and reanalyse (full: every reanalysed episode
    searched again) in turns, no child process; the same seed gives the same weights,
    bit for bit."""
    ckpts = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        proc = subprocess.run(run_args(run_dir, "--workers", "0", "--max-train-steps", "20", "--seed", "3",
                                       "--set", "training.samples_per_insert=4",
                                       "--set", "reanalyse.search_fraction=1.0"),
                              cwd=ROOT, capture_output=True, text=True, timeout=200)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert "training finished (20 steps)" in proc.stdout
        assert list(json.loads((run_dir / "processes.json").read_text())) == ["supervisor"]
        ckpts.append(torch.load(run_dir / "checkpoint.pt", weights_only=True))
        with ReplayBuffer.load(run_dir / "buffer", mmap=True) as snap:
            c = snap.counters
            assert c["samples"] == 20 * 32 and c["priority_updates_applied"] > 0 and c["games"] > 0
            assert np.isfinite(snap.fields["reanalysed_value"]).any()
            assert np.isfinite(snap.fields["reanalysed_policy"]).all(axis=1).any()
        reanalysed = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["reanalyse"]
        assert reanalysed["searched_episodes"] == reanalysed["episodes"] > 0
    a, b = (ck["network"] for ck in ckpts)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
