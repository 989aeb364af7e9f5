"""WeightStore: versions, consistent reads under concurrent publishing, ownership."""

import multiprocessing as mp
import time

import numpy as np
import pytest

from mpper import shm
from mpper.runtime.weights import WeightStore

CTX = mp.get_context("spawn")


def test_publish_and_read():
    with WeightStore.create(1000) as store:
        out = np.empty(1000, np.float32)
        assert store.version == 0
        assert store.publish(np.arange(1000), training_step=7) == 1
        assert store.read_into(out) == (1, 7)
        np.testing.assert_array_equal(out, np.arange(1000, dtype=np.float32))
        with pytest.raises(ValueError, match="expected 1000"):
            store.publish(np.zeros(999), 8)
        assert store.version == 1


def publisher(handle, stop, max_seconds: float) -> None:
    """Publish versions 1, 2, ... until ``stop`` is set (the reader has seen enough)."""
    store = WeightStore.attach(handle)
    deadline, value = time.monotonic() + max_seconds, 0
    while not stop.is_set() and time.monotonic() < deadline:
        value += 1
        store.publish(np.full(handle.num_weights, value, np.float32), training_step=value)
        # A short pause, as between a learner's publications: back to back, a reader
        # copying 800 KB rarely finds a quiet moment on a loaded machine (it retries, so
        # reads stay whole, but few of them finish).
        time.sleep(0.0002)
    store.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_reads_are_never_torn_while_another_process_publishes():
    """Every read sees one publication whole: all parameters equal, and equal to the step.
    Bounded by counts, not time: the reader reads until it has seen 50 versions published
    while it read, however slowly either process runs."""
    with WeightStore.create(200_000) as store:
        stop = CTX.Event()
        proc = CTX.Process(target=publisher, args=(store.handle, stop, 90.0))
        proc.start()
        out = np.empty(200_000, np.float32)
        versions = set()
        try:
            while len(versions) < 50 and proc.is_alive():
                version, step = store.read_into(out)
                if version:
                    assert out.min() == out.max() == step
                    versions.add(version)
        finally:
            stop.set()
            proc.join(30)
        assert proc.exitcode == 0
        assert len(versions) >= 50  # it really read while the other process wrote


def test_reader_close_keeps_segment_owner_close_removes_it():
    store = WeightStore.create(10)
    reader = WeightStore.attach(store.handle)
    reader.close()
    assert store.handle.segment in shm.mpper_segments()
    store.publish(np.ones(10), 1)
    store.close()
    assert store.handle.segment not in shm.mpper_segments()
