"""RateLimiter: the wait/no-wait table, and real producer/consumer processes on it."""

import multiprocessing as mp
import pickle
import threading
import time

import pytest

from mpper.runtime.rate import RateLimiter, Wait

CTX = mp.get_context("spawn")


def limiter(spi=2.0, tol=0.5, min_size=10, batch=4):
    return RateLimiter(spi, tol, min_size, batch, CTX)


# ---- single process: the decisions ------------------------------------------------------


@pytest.mark.parametrize(
    "inserted, sampled, can_sample, can_insert",
    [
        (0, 0, False, True),  # below min_size: learner waits, writers never do
        (9, 0, False, True),
        (10, 0, True, False),  # min_size reached: 4 <= 2*10*1.5; 20 > (0+4)*1.5
        (10, 26, True, True),  # 30 <= 30; 20 <= 45
        (10, 27, False, True),  # 31 > 30
        (10, 10, True, True),  # 20 <= (10+4)*1.5 = 21
        (11, 10, True, False),  # 22 > 21
        (100, 128, True, False),  # 200 > 198
        (100, 129, True, False),  # 200 > 199.5
        (100, 130, True, True),  # 200 <= 201
        (100, 296, True, True),  # 300 <= 300
        (100, 297, False, True),
    ],
)
def test_decision_table(inserted, sampled, can_sample, can_insert):
    lim = limiter()
    assert lim.can_sample(inserted, sampled) is can_sample
    assert lim.can_insert(inserted, sampled) is can_insert
    start = time.monotonic()
    res = lim.wait_to_sample(lambda: inserted, lambda: sampled, timeout=0.05)
    assert res.waited is (not can_sample)
    res = lim.wait_to_insert(inserted, sampled, timeout=0.05)  # plain numbers work too
    assert res.waited is (not can_insert)
    assert time.monotonic() - start < 10.0  # two 0.05 s timeouts, not a wait without end


def test_never_both_blocked():
    """The insert side's one-batch slack rules out a deadlock for any counters."""
    for spi in (0.01, 0.5, 1.0, 3.0, 64.0):
        for tol in (0.0, 0.1, 1.0):
            lim = RateLimiter(spi, tol, 50, 32, CTX)
            for inserted in range(0, 400, 7):
                for sampled in range(0, 4000, 13):
                    assert lim.can_sample(inserted, sampled) or lim.can_insert(inserted, sampled), (spi, tol, inserted, sampled)  # fmt: skip


def test_off_waits_only_for_min_size():
    lim = RateLimiter(None, 0.2, 10, 4, CTX)
    assert not lim.enabled
    assert not lim.can_sample(9, 0) and lim.can_sample(10, 10**9)
    assert lim.can_insert(10**9, 0)
    assert lim.wait_to_insert(10**9, 0) == Wait(False, 0.0)


def test_past_the_insert_budget_sampling_no_longer_waits_for_the_ratio():
    """With an insert budget (self-play ends there), below it the ratio holds exactly as
    without one; from it on, sampling waits for nothing but min_size."""
    plain, budgeted = RateLimiter(2.0, 0.5, 10, 4, CTX), RateLimiter(2.0, 0.5, 10, 4, CTX, insert_budget=60)
    for inserted in range(0, 120, 3):
        for sampled in range(0, 2000, 11):
            expected = plain.can_sample(inserted, sampled) or inserted >= 60
            assert budgeted.can_sample(inserted, sampled) is expected, (inserted, sampled)
            assert budgeted.can_insert(inserted, sampled) is plain.can_insert(inserted, sampled)
    assert budgeted.wait_to_sample(60, 10**9, timeout=0.05) == Wait(False, 0.0)
    assert RateLimiter(2.0, 0.5, 100, 4, CTX, insert_budget=60).can_sample(80, 0) is False  # min_size still holds


def test_from_config_paces_by_the_replay_ratio_and_takes_the_budget_only_when_training_goes_on():
    from mpper.algos.configs import config_from_dict

    def built(training):
        return RateLimiter.from_config(config_from_dict({"training": training}, check_env=False).training, CTX)

    lim = built({"replay_ratio": 0.25, "batch_size": 32, "env_steps": 1000, "after_env_steps": "train"})
    assert (lim.samples_per_insert, lim.batch_size, lim.insert_budget) == (8.0, 32, 1000)
    assert built({"samples_per_insert": 8.0, "env_steps": 1000}).insert_budget is None  # "stop": the run ends there
    assert built({}).samples_per_insert is None


def test_rejects_bad_arguments():
    for args in [(0, 0.1, 1, 1), (-1, 0.1, 1, 1), (1, -0.1, 1, 1), (1, 0.1, -1, 1), (1, 0.1, 1, 0)]:
        with pytest.raises(ValueError):
            RateLimiter(*args, CTX)


def test_timeout_and_notify_wake_a_waiter():
    lim = limiter()
    start = time.monotonic()
    res = lim.wait_to_sample(0, 0, timeout=0.15)
    # bounds far from the timeout, so that a loaded machine's late wake-up does not fail it
    assert res.waited and 0.14 <= res.seconds < 10.0 and time.monotonic() - start < 10.0

    count = [0]
    lim = RateLimiter(1.0, 0.0, 1, 1, CTX, poll_s=60.0)  # a long poll: only notify can wake it before it
    out = []
    t = threading.Thread(target=lambda: out.append(lim.wait_to_sample(lambda: count[0], 0)))
    t.start()
    time.sleep(0.1)
    count[0] = 1
    woke = time.monotonic()
    lim.notify()
    t.join(40.0)
    assert not t.is_alive() and out[0].waited
    assert time.monotonic() - woke < 40.0


def test_from_config_and_pickle_guard():
    from mpper.config import TrainingConfig

    lim = RateLimiter.from_config(TrainingConfig(samples_per_insert=4.0, min_buffer_steps=200, batch_size=32), CTX)
    assert (lim.samples_per_insert, lim.min_size, lim.batch_size, lim.tolerance) == (4.0, 200, 32, 0.2)
    with pytest.raises(RuntimeError):  # only travels as a Process argument, like any mp lock
        pickle.dumps(lim)


# ---- two real processes ---------------------------------------------------------------


def producer(lim, inserted, sampled, stop, episode, delay, out):
    waits = 0
    while not stop.is_set():
        res = lim.wait_to_insert(lambda: inserted.value, lambda: sampled.value, stop)
        if stop.is_set():
            break
        waits += res.waited
        inserted.value += episode
        lim.notify()
        if delay:
            time.sleep(delay)
    out.put(("producer", waits))


def consumer(lim, inserted, sampled, stop, delay, out):
    waits = 0
    worst = 0.0  # largest S / (r I (1 + tol)) right after a sample: must stay <= 1
    while not stop.is_set():
        res = lim.wait_to_sample(lambda: inserted.value, lambda: sampled.value, stop)
        if stop.is_set():
            break
        waits += res.waited
        sampled.value += lim.batch_size
        worst = max(worst, sampled.value / (lim.samples_per_insert * inserted.value * (1 + lim.tolerance)))
        lim.notify()
        if delay:
            time.sleep(delay)
    out.put(("consumer", waits, worst))


@pytest.mark.slow
@pytest.mark.parametrize("producer_delay, consumer_delay", [(0.0, 0.002), (0.002, 0.0)])
def test_two_processes_keep_the_ratio(producer_delay, consumer_delay):
    spi, tol, min_size, batch, episode = 2.0, 0.25, 40, 8, 10
    lim = RateLimiter(spi, tol, min_size, batch, CTX)
    inserted, sampled = CTX.RawValue("q", 0), CTX.RawValue("q", 0)
    stop, out = CTX.Event(), CTX.Queue()
    procs = [
        CTX.Process(target=producer, args=(lim, inserted, sampled, stop, episode, producer_delay, out)),
        CTX.Process(target=consumer, args=(lim, inserted, sampled, stop, consumer_delay, out)),
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 20.0  # spawn start-up on a loaded machine
        while sampled.value < 200 * batch and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        lim.notify()
        for p in procs:
            p.join(5.0)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
    assert not alive, "a side did not exit on stop"
    results = {m[0]: m[1:] for m in (out.get(timeout=5), out.get(timeout=5))}
    I, S = inserted.value, sampled.value
    assert S >= 200 * batch, "no progress: deadlock?"
    # the learner never runs ahead of the ratio (checked after every sample) ...
    assert results["consumer"][1] <= 1.0
    # ... and the actors run ahead by at most the tolerance, one batch and one episode
    assert spi * (I - episode) <= (S + batch) * (1 + tol)
    ratio = S / I
    assert spi / (1 + tol) * 0.9 <= ratio <= spi * (1 + tol)
    if producer_delay:  # the learner is the fast side: it is the one held back
        assert results["consumer"][0] > 0
    else:
        assert results["producer"][0] > 0


def blocked_sampler(lim, stop, out):
    out.put(("waiting", time.monotonic()))
    res = lim.wait_to_sample(0, 0, stop)  # below min_size forever
    out.put(("returned", time.monotonic(), res.waited))


@pytest.mark.slow
def test_stop_wakes_a_blocked_process():
    lim = limiter()
    stop, out = CTX.Event(), CTX.Queue()
    p = CTX.Process(target=blocked_sampler, args=(lim, stop, out))
    p.start()
    try:
        assert out.get(timeout=20)[0] == "waiting"
        time.sleep(0.3)
        assert p.is_alive()
        set_at = time.monotonic()
        stop.set()  # no notify: the periodic wake-up alone must notice it
        kind, returned_at, waited = out.get(timeout=5)
        assert kind == "returned" and waited
        assert returned_at - set_at < 0.3
        p.join(5)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def _wait_forever(limiter, stop, ready) -> None:
    ready.set()
    limiter.wait_to_sample(0, 0, stop)  # nothing inserted: blocks until stop


@pytest.mark.timeout(60)
def test_a_waiter_killed_while_waiting_blocks_nobody():
    """multiprocessing.Condition.notify waits for every sleeper to wake: one killed
    while asleep would hang it for ever. The limiter's doorbells and the stop flag must
    not: kill a blocked waiter, then notify and stop."""
    import os
    import signal as sig
    import time

    from mpper.runtime.procs import StopSignal

    limiter = RateLimiter(2.0, 0.1, 10, 4, CTX)
    stop = StopSignal(CTX)
    ready = CTX.Event()
    proc = CTX.Process(target=_wait_forever, args=(limiter, stop, ready))
    proc.start()
    assert ready.wait(30)
    time.sleep(0.3)  # it is inside the wait now
    os.kill(proc.pid, sig.SIGKILL)
    proc.join(10)
    t0 = time.monotonic()
    for _ in range(10):
        limiter.notify()
    stop.set()
    assert time.monotonic() - t0 < 20.0  # notify does not block on the dead waiter's lock
    assert limiter.wait_to_sample(0, 0, stop).waited  # returns at once: stop is set
