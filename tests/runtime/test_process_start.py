"""What a child process finds loaded when it starts, and what the supervisor never loads.

Children are forks of the forkserver (``mpper.runtime.procs.process_context``), which
loads once what every child would otherwise load for itself (``mpper.runtime.preload``):
the process mains and the replay buffer's compiled kernels, and not torch's compiler
(``torch._dynamo``, which no mpper process needs: ``mpper.algos.optim``). A process that
only creates and reads a buffer (the supervisor) loads no kernel at all.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a forkserver and a fresh interpreter: seconds each


def _what_is_loaded(results) -> None:
    """A child's main: report what was already there when it began."""
    from mpper.replay import kernels

    results.put({
        "torch._dynamo": "torch._dynamo" in sys.modules,
        "apply_update": len(kernels.apply_update.signatures),
        "draw": len(kernels.draw_kernel.signatures),
    })  # fmt: skip


def test_a_child_starts_with_the_buffer_kernels_loaded_and_without_torchs_compiler():
    from mpper.runtime.procs import process_context

    ctx = process_context()
    assert ctx.get_start_method() == "forkserver"
    results = ctx.Queue()
    proc = ctx.Process(target=_what_is_loaded, args=(results,))
    proc.start()
    try:
        loaded = results.get(timeout=120)
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    assert not loaded["torch._dynamo"]
    assert loaded["apply_update"] >= 1 and loaded["draw"] >= 1


def test_a_process_that_only_creates_and_reads_a_buffer_loads_no_kernel():
    """The supervisor creates the buffer, reads its counters and snapshots it; the
    kernels (and numba's compiler, ~65 MiB) are loaded by the first write."""
    code = """
import numpy as np
from mpper.algos.dqn.targets import dqn_schema
from mpper.replay import buffer as b, kernels as k
buf = b.ReplayBuffer.create(dqn_schema((4,)), capacity=64)
try:
    loaded = [len(k.apply_update.signatures), len(k.draw_kernel.signatures)]
    print(*loaded, buf.counters["steps"], len(buf))
    buf.add_episode({"observation": np.zeros((3, 4), np.float32), "action": np.zeros(3, np.int64),
                     "reward": np.ones(3, np.float32)}, priorities=np.ones(2))
    print(len(k.apply_update.signatures), len(k.draw_kernel.signatures), buf.counters["steps"], len(buf))
finally:
    buf.close()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    created, written = (line.split() for line in out.stdout.splitlines())
    assert created == ["0", "0", "0", "0"]
    assert written == ["1", "1", "2", "2"]  # the episode's 2 moves


def _denormal_arithmetic(results, init: bool) -> None:
    """A child's main: 1e-39 (below float32's smallest normal number) times 2, after
    ``child_init`` as every mpper process starts, or without it."""
    import torch

    from mpper.runtime.procs import child_init

    if init:
        child_init(1)
    results.put(float(torch.tensor([1e-39], dtype=torch.float32).mul(2.0)[0]))


def test_a_child_flushes_denormal_floats_to_zero():
    """Denormals make CPU arithmetic many times slower (weights that weight decay drives
    towards zero become denormal as training goes on); every process flushes them."""
    from mpper.runtime.procs import process_context

    ctx = process_context()
    got = {}
    for init in (False, True):
        results = ctx.Queue()
        proc = ctx.Process(target=_denormal_arithmetic, args=(results, init))
        proc.start()
        try:
            got[init] = results.get(timeout=120)
        finally:
            proc.join(30)
        assert proc.exitcode == 0
    assert got[False] == pytest.approx(2e-39, rel=1e-3)  # torch's default: denormals computed
    assert got[True] == 0.0


def test_in_process_the_callers_floating_point_state_is_left_alone_or_put_back():
    """A test (or any caller) running a child's entry point in its own process keeps
    torch's default; the serial runner flushes for the length of its run only."""
    import torch

    from mpper.runtime.procs import child_init, torch_configured

    def doubled_denormal() -> float:
        return float(torch.tensor([1e-39], dtype=torch.float32).mul(2.0)[0])

    child_init(1)
    assert doubled_denormal() > 0
    with torch_configured(1):
        assert doubled_denormal() == 0.0
    assert doubled_denormal() > 0
