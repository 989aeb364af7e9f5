"""Every number a config can hold keeps what it sizes or indexes in bounds: a value that
would overflow an index in a compiled kernel or ask for an absurd allocation is refused
by the config check, in one line naming the key, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpper.algos.configs import ALGORITHM_CONFIGS, load_config
from mpper.config import ConfigError, field_specs
from mpper.config.fields import Range

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = ROOT / "mpper" / "configs" / "cartpole.json"
INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("key", ["muzero.td_steps", "muzero.num_unroll_steps", "muzero.stacked_observations",
                                 "mcts.num_simulations", "network.support_size"])  # fmt: skip
def test_an_int64_sized_value_is_refused_naming_the_key_and_its_range(key):
    with pytest.raises(ConfigError, match=rf"{key}: .*in \[\d+, \d+\]") as info:
        load_config(CARTPOLE, [f"{key}={INT64_MAX}"])
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_td_steps_that_overflowed_the_target_kernel_is_one_line_and_exit_2(tmp_path):
    """``muzero.td_steps: 2^63 - 1`` used to reach the target kernel, whose index
    ``t + td_steps`` overflowed (SIGSEGV, exit 139)."""
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "--config", str(CARTPOLE), "--workers", "0",
                             "--set", f"muzero.td_steps={INT64_MAX}", "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "muzero.td_steps" in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_every_integer_key_has_an_upper_bound():
    unbounded = [spec.key for spec in field_specs(ALGORITHM_CONFIGS)
                 if int in spec.types and float not in spec.types
                 and not (isinstance(spec.allowed, Range) and spec.allowed.hi is not None)]  # fmt: skip
    assert unbounded == []


@pytest.mark.parametrize("widths, message", [
    ([16, 2**40], r"network.hidden\[1\]: expected an integer in \[1, 65536\], got 1099511627776"),
    ([8] * 65, r"network.hidden: expected at most 64 widths, got 65"),
])  # fmt: skip
def test_layer_widths_are_bounded(widths, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CARTPOLE, [f"network.hidden={widths}"])


@pytest.mark.parametrize("text, message", [
    ("{\"training\": {\"batch_size\": " + "9" * 5000 + "}}", r"invalid JSON: a number of more than 4,300 digits$"),
    ("{\"training\": " + "[" * 100_000 + "]" * 100_000 + "}", r"invalid JSON: nested too deeply$"),
    ("{\"runtime\": {\"time_limit_s\": NaN}}", r"runtime.time_limit_s: expected a number > 0 or null, got NaN$"),
    ("{\"runtime\": {\"time_limit_s\": -Infinity}}", r"runtime.time_limit_s: .* got -Infinity$"),
])  # fmt: skip
def test_numbers_json_cannot_hold_are_one_line(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_an_override_too_long_to_read_is_named_in_short():
    with pytest.raises(ConfigError, match=r"^--set training.batch_size=9{60}\.\.\. \(5,020 characters\): ") as info:
        load_config(CARTPOLE, ["training.batch_size=" + "9" * 5000])
    assert len(str(info.value)) < 400


def test_an_episode_longer_than_the_ring_is_refused_before_the_run_starts():
    """CartPole-v1 episodes last up to 500 moves (501 rows): a ring of 100 rows could never
    store one. Refused up front, naming both figures; MuZero's game segments, stored in
    pieces, fit; so does a time limit that the ring holds."""
    from mpper.algos.registry import run_env_spec
    from mpper.runtime.resources import check_fits

    small = ["replay.capacity=100", "training.min_buffer_steps=50", "training.batch_size=16"]
    config = load_config(CARTPOLE, small)
    with pytest.raises(ConfigError, match=r"can last 500 moves, stored as 501 rows, but replay.capacity is 100"):
        check_fits(config, run_env_spec(config))
    for fits in (["muzero.game_segment_length=50"], ["env.max_episode_steps=99"]):
        config = load_config(CARTPOLE, small + fits)
        check_fits(config, run_env_spec(config))
    dqn = load_config(ROOT / "mpper" / "configs" / "cartpole_dqn.json", small)
    with pytest.raises(ConfigError, match=r"stored as 501 rows, but replay.capacity is 100"):
        check_fits(dqn, run_env_spec(dqn))


@pytest.mark.parametrize("size", [100_000, [84, 0], "84", [84, 84, 84]])
def test_an_atari_screen_size_is_checked_before_frames_of_that_size_are_allocated(size):
    """gymnasium's AtariPreprocessing allocates its frame buffers at the screen size as it
    is built (100,000: 9.3 GiB); the side is checked first."""
    from mpper.algos.registry import run_env_spec

    config = load_config(ROOT / "mpper" / "configs" / "atari_pong.json",
                         [f"env.preprocessing_kwargs={{\"screen_size\": {json.dumps(size)}}}"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"env.preprocessing_kwargs.screen_size: expected an integer or a "
                                          r"\[width, height\] pair in \[1, 1024\]"):  # fmt: skip
        run_env_spec(config)
