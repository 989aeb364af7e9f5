"""StopRequests with real signals sent to this process: where a Ctrl-C or SIGTERM raises
(at ``check`` and inside ``obeying`` blocks), where it only waits for the next of those,
and the three Ctrl-Cs of a stop (stop, acknowledged, quit at once)."""

from __future__ import annotations

import queue
import signal
import threading

import pytest

from mpper.runtime.procs import ForcedStop, StopRequests


def ctrl_c() -> None:
    signal.raise_signal(signal.SIGINT)  # the Python handler runs before this returns


def test_outside_an_obeying_block_a_ctrl_c_waits_for_the_next_check(capfd):
    with StopRequests() as signals:
        ctrl_c()  # no exception here: this could be the middle of a library call
        assert signals.stopping and not signals.forced
        with pytest.raises(KeyboardInterrupt):
            signals.check()
        signals.check()  # raised once
    assert "mpper: Ctrl-C: stopping; the final checkpoint and buffer snapshot are being written" in capfd.readouterr().err


def test_inside_an_obeying_block_a_signal_raises_at_once_and_one_waiting_raises_on_entry():
    with StopRequests() as signals:
        with pytest.raises(KeyboardInterrupt):
            with signals.obeying():
                ctrl_c()
                pytest.fail("the Ctrl-C did not raise inside the block")
        signals.check()  # nothing left waiting
    with StopRequests() as signals:
        ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            with signals.obeying():
                pytest.fail("the block was entered with a stop waiting")
        with signals.obeying():  # the block is usable again, and nothing waits
            pass


def test_sigterm_asks_for_exit_code_143():
    with StopRequests() as signals:
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(SystemExit) as raised:
            signals.check()
    assert raised.value.code == 143


def test_during_the_shutdown_the_second_signal_is_acknowledged_and_the_third_forces(capfd):
    with StopRequests() as signals:
        ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            signals.check()
        signals.begin_shutdown()
        with signals.obeying():
            ctrl_c()  # acknowledged, not obeyed
        assert not signals.forced
        with pytest.raises(ForcedStop):
            with signals.obeying():
                ctrl_c()
                pytest.fail("the forcing Ctrl-C did not raise inside the block")
        assert signals.forced
        ctrl_c()  # later ones change nothing
        signals.check()
        with signals.obeying():
            pass
    err = capfd.readouterr().err
    assert "mpper: Ctrl-C: still stopping: writing the final checkpoint" in err
    assert "mpper: Ctrl-C: quitting at once; the final checkpoint and buffer snapshot are lost" in err
    assert err.count("mpper: Ctrl-C") == 3


def test_a_forcing_signal_outside_a_block_is_kept_and_a_waiting_stop_is_dropped_by_the_shutdown():
    with StopRequests() as signals:
        ctrl_c()  # the run was about to end by itself: its shutdown makes this stop moot
        signals.begin_shutdown()
        signals.check()
        ctrl_c()
        ctrl_c()  # forces, outside any block: kept
        assert signals.forced
        signals.begin_shutdown()  # a second call keeps it too
        with pytest.raises(ForcedStop):
            with signals.obeying():
                pytest.fail("the block was entered with a forced stop waiting")


def test_a_run_that_ends_by_itself_acknowledges_the_first_signal_and_obeys_the_second():
    with StopRequests() as signals:
        signals.begin_shutdown()
        with signals.obeying():
            ctrl_c()
        assert not signals.forced
        with pytest.raises(ForcedStop):
            with signals.obeying():
                ctrl_c()


def test_handlers_are_restored_and_a_thread_other_than_the_main_one_installs_none():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopRequests():
        assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT]
    assert {s: signal.getsignal(s) for s in before} == before
    seen = queue.Queue()

    def in_thread() -> None:
        with StopRequests():
            seen.put({s: signal.getsignal(s) for s in before})

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen.get_nowait() == before


def test_a_queue_fed_to_a_waiting_thread_keeps_working_through_the_signals_of_a_stop():
    """The main thread feeds a ``queue.Queue`` to a thread that waits on it with a long
    timeout (as TensorBoard's writer does, up to 120 s) while the three signals of a stop
    land mid-``put``: none raises there (an exception between ``Condition.notify``'s wake-up
    and its bookkeeping leaves a stale waiter that eats the next wake-up, CPython
    gh-92530), so every item still reaches the thread at once."""
    items: queue.Queue = queue.Queue()
    received: queue.Queue = queue.Queue()

    def consume() -> None:
        while (item := items.get(timeout=120)) is not None:
            received.put(item)

    class SignalOnNotify(threading.Condition):
        """The queue's "not empty" condition, with a Ctrl-C landing in every notify."""

        armed = True

        def notify(self, n: int = 1) -> None:
            for waiter in list(self._waiters)[:n]:  # noqa: SLF001 - the window of gh-92530
                waiter.release()
                if self.armed:
                    ctrl_c()
                self._waiters.remove(waiter)  # noqa: SLF001

    items.not_empty = SignalOnNotify(items.mutex)
    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    with StopRequests() as signals:
        for step in range(4):
            items.put(step)  # the stop, its acknowledgement, the forcing one, one ignored
            assert received.get(timeout=10) == step
        assert signals.forced
        with pytest.raises(ForcedStop):
            signals.check()
    SignalOnNotify.armed = False
    items.put(None)
    thread.join(timeout=10)
    assert not thread.is_alive()
