"""ReplayBuffer in one process: ring placement, eviction, priorities, weights, errors."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from mpper import COUNTERS, ReplayBuffer
from mpper.algos.dqn.targets import dqn_schema
from mpper.replay.episode_ring import PUBLISHED, START, STATE
from mpper.replay.schema import Schema

SCHEMA = {**dqn_schema((2,)), "tag": ((2,), "int64")}  # tag = (episode id, position)


def episode(ep_id: int, rows: int) -> dict:
    tag = np.stack([np.full(rows, ep_id), np.arange(rows)], axis=1)
    return {
        "observation": np.column_stack([np.full(rows, ep_id, np.float32), np.arange(rows, dtype=np.float32)]),
        "action": np.arange(rows) % 3,
        "reward": np.ones(rows, np.float32),
        "tag": tag,
    }


def stored_episodes(buf) -> dict[int, tuple[int, int]]:
    """{episode tag id: (start slot, rows)} of the published episodes."""
    out = {}
    for ref in buf.episodes():
        tags = buf.fields["tag"][ref.start : ref.start + ref.rows]
        assert (tags[:, 0] == tags[0, 0]).all() and (tags[:, 1] == np.arange(ref.rows)).all()
        out[int(tags[0, 0])] = (ref.start, ref.rows)
    return out


@pytest.fixture
def buf():
    b = ReplayBuffer.create(SCHEMA, 20, alpha=1.0, priority_eps=0.0)
    yield b
    b.close()


def test_contiguous_slots_wrap_and_whole_episode_eviction(buf):
    assert buf.add_episode(episode(0, 6))
    assert buf.add_episode(episode(1, 6))
    assert buf.add_episode(episode(2, 6))
    assert stored_episodes(buf) == {0: (0, 6), 1: (6, 6), 2: (12, 6)}
    # 6 more rows do not fit before the end (18 + 6 > 20): wrap to slot 0, leave the
    # 2-slot tail unused, evict episode 0 (overlapped) whole
    assert buf.add_episode(episode(3, 6))
    assert stored_episodes(buf) == {1: (6, 6), 2: (12, 6), 3: (0, 6)}
    # 7 rows at slot 6 overlap episode 1 (6..11) and the first slot of episode 2 (12..17):
    # both go, whole, and nothing of them can be sampled any more
    assert buf.add_episode(episode(4, 7))
    assert stored_episodes(buf) == {3: (0, 6), 4: (6, 7)}
    assert buf.priorities(np.arange(13, 20)).sum() == 0.0
    c = buf.counters
    assert c["games"] == 5 and c["steps"] == 5 * 5 + 1 and c["episodes_evicted"] == 3
    assert len(buf) == 5 + 6 == c["positions"]
    # only positions (not the final row of each episode) are sampleable
    assert np.array_equal(np.flatnonzero(buf.priorities(np.arange(20))), [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11])
    batch = buf.sample(2000, beta=1.0, rng=np.random.default_rng(0))
    tags = batch.data["tag"]
    assert set(tags[:, 0].tolist()) == {3, 4}
    assert (tags[:, 1] < np.where(tags[:, 0] == 3, 5, 6)).all()


def test_episode_longer_than_capacity_and_bad_episodes(buf):
    with pytest.raises(ValueError, match="longer than the capacity 20"):
        buf.add_episode(episode(0, 21))
    with pytest.raises(ValueError, match="at least 2 rows"):
        buf.add_episode(episode(0, 1))
    with pytest.raises(ValueError, match="unknown field"):
        buf.add_episode({**episode(0, 3), "bogus": np.zeros(3)})
    with pytest.raises(ValueError, match="'observation' has shape"):
        buf.add_episode({**episode(0, 3), "observation": np.zeros((3, 5))})
    with pytest.raises(ValueError, match="rows"):
        buf.add_episode({**episode(0, 3), "reward": np.zeros(4)})
    with pytest.raises(ValueError, match="cannot be stored"):
        buf.add_episode({**episode(0, 3), "action": np.zeros(3, np.float64)})
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        buf.add_episode(episode(0, 3), priorities=np.ones(3))
    with pytest.raises(ValueError, match="finite"):
        buf.add_episode(episode(0, 3), priorities=np.array([1.0, np.nan]))
    assert buf.counters["games"] == 0 and len(buf) == 0
    with pytest.raises(ValueError, match="no sampleable"):
        buf.sample(4)
    # a capacity-sized episode fits exactly
    assert buf.add_episode(episode(9, 20))
    assert stored_episodes(buf) == {9: (0, 20)}


def test_missing_fields_get_their_fill_value():
    b = ReplayBuffer.create({"x": ((), "float32", float("nan")), "y": ((), "int8")}, 10)
    try:
        b.add_episode({"y": np.ones(4, np.int8)})
        assert np.isnan(b.fields["x"][:4]).all() and (b.fields["y"][:4] == 1).all()
    finally:
        b.close()


def test_initial_priority_is_max_seen_or_configured():
    b = ReplayBuffer.create(SCHEMA, 50, alpha=1.0, priority_eps=0.0)
    try:
        b.add_episode(episode(0, 3))
        assert b.priorities(np.arange(2)).tolist() == [1.0, 1.0]  # max starts at 1
        b.add_episode(episode(1, 3), priorities=np.array([0.5, 7.0]))
        b.add_episode(episode(2, 3))
        assert b.priorities(np.arange(6, 8)).tolist() == [7.0, 7.0]
        batch = b.sample(8, rng=np.random.default_rng(1))
        b.update_priorities(batch.indices, batch.generations, np.full(8, 30.0))
        b.add_episode(episode(3, 3))
        assert b.priorities(np.arange(9, 11)).tolist() == [30.0, 30.0]
    finally:
        b.close()
    b = ReplayBuffer.create(SCHEMA, 50, alpha=0.5, priority_eps=0.01, priority_clip=1.0, initial_priority=4.0)
    try:
        b.add_episode(episode(0, 3))
        # (min(4 + 0.01, 1)) ** 0.5 = 1: easy-rl's clip at abs_err_upper applied to new items too
        assert b.priorities(np.arange(2)).tolist() == [1.0, 1.0]
        b.add_episode(episode(1, 3), priorities=np.array([0.0, 0.15]))
        np.testing.assert_allclose(b.priorities(np.arange(3, 5)), [0.01**0.5, 0.16**0.5])
    finally:
        b.close()


raw_priorities = st.lists(st.floats(0, 100, allow_nan=False, allow_infinity=False), min_size=9, max_size=9)


@settings(max_examples=60, deadline=None)
@given(raw=raw_priorities, eps=st.floats(0, 2), clip=st.one_of(st.none(), st.floats(0.01, 50)),
       alpha=st.sampled_from([0.0, 0.5, 0.6, 1.0]))  # fmt: skip
def test_leaves_are_eps_added_then_clipped_then_raised_to_alpha(raw, eps, clip, alpha):
    """A raw priority p becomes the leaf ``min(p + eps, clip) ** alpha``, the same for an
    episode's priorities given to ``add_episode`` and for ``update_priorities``: eps is
    added first, so a clipped priority is exactly ``clip ** alpha``."""
    p = np.array(raw)
    expected = np.array([min(x + eps, np.inf if clip is None else clip) ** alpha for x in raw])
    b = ReplayBuffer.create(SCHEMA, 40, alpha=alpha, priority_eps=eps, priority_clip=clip)
    try:
        b.add_episode(episode(0, 10), priorities=p)
        np.testing.assert_allclose(b.priorities(np.arange(9)), expected, rtol=1e-12)
        b.add_episode(episode(1, 10), priorities=np.zeros(9))
        slots = np.arange(10, 19)
        assert b.update_priorities(slots, b._generation[slots], p) == (9, 0)
        np.testing.assert_allclose(b.priorities(slots), expected, rtol=1e-12)
    finally:
        b.close()


def test_a_priority_above_the_clip_is_the_clip_whatever_eps():
    b = ReplayBuffer.create(SCHEMA, 40, alpha=1.0, priority_eps=0.5, priority_clip=1.0)
    try:
        b.add_episode(episode(0, 4), priorities=np.array([0.2, 0.9, 3.0]))
        np.testing.assert_allclose(b.priorities(np.arange(3)), [0.7, 1.0, 1.0], rtol=1e-12)
        b.add_episode(episode(1, 4), priorities=np.zeros(3))
        slots = np.arange(4, 7)
        assert b.update_priorities(slots, b._generation[slots], np.array([0.2, 0.9, 3.0])) == (3, 0)
        np.testing.assert_allclose(b.priorities(slots), [0.7, 1.0, 1.0], rtol=1e-12)
    finally:
        b.close()


def test_stale_updates_are_dropped_and_live_ones_apply(buf):
    for i in range(3):
        buf.add_episode(episode(i, 6))
    batch = buf.sample(64, rng=np.random.default_rng(0))
    # overwrite every slot of every sampled episode
    for i in range(3, 7):
        buf.add_episode(episode(i, 6))
    assert not (np.isin(batch.data["tag"][:, 0], list(stored_episodes(buf)))).any()
    tree_now = buf._tree.tree.copy()
    applied, dropped = buf.update_priorities(batch.indices, batch.generations, np.full(64, 5.0))
    assert (applied, dropped) == (0, 64)
    np.testing.assert_array_equal(buf._tree.tree, tree_now)
    assert buf.counters["priority_updates_dropped"] == 64
    # a live slot raised to 1e8 dominates the next samples
    batch = buf.sample(8, rng=np.random.default_rng(1))
    target = batch.indices[:1]
    assert buf.update_priorities(target, batch.generations[:1], np.array([1e8])) == (1, 0)
    nxt = buf.sample(1000, rng=np.random.default_rng(2))
    assert (nxt.indices == target[0]).mean() > 0.99


def test_update_cannot_make_a_final_row_sampleable(buf):
    buf.add_episode(episode(0, 5))
    final = np.array([4])
    applied, dropped = buf.update_priorities(final, buf._generation[final], np.array([100.0]))
    assert (applied, dropped) == (0, 1) and buf.priorities(final)[0] == 0.0


@pytest.mark.parametrize("alpha, wrong_alpha", [(0.0, 1.0), (0.6, 1.0), (1.0, 0.5)])
def test_sampling_frequencies_follow_p_alpha(alpha, wrong_alpha):
    """Chi-square of >= 200k draws against p_i^alpha / sum over positions (fixed seed),
    and against p_i^wrong_alpha, which the same draws must reject."""
    rng = np.random.default_rng(99)
    b = ReplayBuffer.create(SCHEMA, 400, alpha=alpha, priority_eps=0.0)
    try:
        raw = {}
        for i in range(20):
            rows = int(rng.integers(2, 30))
            p = rng.random(rows - 1) * 10
            b.add_episode(episode(i, rows), priorities=p)
            raw[i] = p
        live = {k: v for k, v in raw.items() if k in stored_episodes(b)}
        slots = np.concatenate([np.arange(s, s + r - 1) for s, r in stored_episodes(b).values()])
        probs = np.concatenate([live[k] for k in stored_episodes(b)]) ** alpha
        probs /= probs.sum()
        draws = np.concatenate([b.sample(2000, rng=rng).indices for _ in range(100)])
        counts = np.array([(draws == s).sum() for s in slots])
        assert counts.sum() == draws.size  # nothing outside the published positions
        assert chisquare(counts, probs * draws.size).pvalue > 1e-3
        # the test can fail: against another exponent
        wrong = np.concatenate([live[k] for k in stored_episodes(b)]) ** wrong_alpha
        assert chisquare(counts, wrong / wrong.sum() * draws.size).pvalue < 1e-6
    finally:
        b.close()


def test_importance_weights_match_formula():
    rng = np.random.default_rng(3)
    b = ReplayBuffer.create(SCHEMA, 300, alpha=0.7, priority_eps=1e-3)
    try:
        for i in range(10):
            b.add_episode(episode(i, 20), priorities=rng.random(19) * 5)
        for beta in (0.0, 0.4, 1.0):
            batch = b.sample(64, beta=beta, rng=rng)
            leaves = b.priorities(batch.indices)
            p = leaves / b.total_priority
            np.testing.assert_allclose(batch.probabilities, p, rtol=1e-12)
            w = (len(b) * p) ** -beta
            np.testing.assert_allclose(batch.weights, w / w.max(), rtol=1e-6)
            assert batch.weights.max() == pytest.approx(1.0)
    finally:
        b.close()


def test_stratified_batches_cover_the_mass():
    """One draw per slice: with equal priorities a batch of size N hits every slot once."""
    b = ReplayBuffer.create(SCHEMA, 200, alpha=1.0, priority_eps=0.0)
    try:
        b.add_episode(episode(0, 101), priorities=np.ones(100))
        batch = b.sample(100, rng=np.random.default_rng(0))
        assert sorted(batch.indices.tolist()) == list(range(100))
    finally:
        b.close()


def test_batches_are_stratified_over_unequal_priorities():
    """One draw per equal slice of the mass, with priorities over six orders of magnitude."""
    from test_sum_tree import assert_one_draw_per_slice

    rng = np.random.default_rng(4)
    b = ReplayBuffer.create(SCHEMA, 400, alpha=0.8, priority_eps=0.0)
    try:
        for i in range(12):
            rows = int(rng.integers(2, 40))
            b.add_episode(episode(i, rows), priorities=10.0 ** rng.uniform(-3, 3, rows - 1))
        leaves = b.priorities(np.arange(b.capacity))
        for batch_size in (1, 7, 64, 1000):
            assert_one_draw_per_slice(leaves, b.sample(batch_size, rng=rng).indices)
    finally:
        b.close()


def test_rewritten_rows_follow_the_generation_rule_and_count_in_the_schemas_counters():
    schema = Schema({**dqn_schema((2,)), "value": ((), "float32", float("nan"))}, counters=("rewritten", "stale"))
    b = ReplayBuffer.create(schema, 30)
    try:
        for i in range(3):
            b.add_episode({"observation": np.zeros((8, 2)), "reward": np.zeros(8)})
        refs = b.sample_episodes(5, rng=np.random.default_rng(0))
        assert len(refs) == 3 and len({r.episode_id for r in refs}) == 3
        first = min(refs, key=lambda r: r.episode_id)
        assert b.rewrite_rows(first, {"value": np.arange(7.0), "reward": np.full(3, 2.0)}, counters=("rewritten", "stale"))
        np.testing.assert_array_equal(b.fields["value"][first.start : first.start + 7], np.arange(7.0))
        assert np.isnan(b.fields["value"][first.start + 7])  # a row not given: untouched
        np.testing.assert_array_equal(b.fields["reward"][first.start : first.start + 4], [2, 2, 2, 0])
        b.add_episode({"observation": np.zeros((8, 2))})
        b.add_episode({"observation": np.zeros((8, 2))})  # wraps, evicts the first episode
        assert not b.rewrite_rows(first, {"value": np.ones(7)}, counters=("rewritten", "stale"))
        assert b.read_episode(first) is None
        assert b.rewrite_rows(b.episodes()[-1], {"value": np.ones(8)})  # no counters: counted nowhere
        c = b.counters
        assert (c["rewritten"], c["stale"]) == (1, 1)
        assert list(c)[: len(COUNTERS) + 2] == [*COUNTERS, "rewritten", "stale"]
    finally:
        b.close()


@pytest.mark.parametrize("rows, counters, match", [
    ({"nope": np.ones(3)}, None, "unknown field 'nope'"),
    ({"value": np.ones(9)}, None, r"shape \(9,\), expected \(n, \*\(\)\) with 1 <= n <= 8"),
    ({"value": np.ones((3, 2))}, None, "shape"),
    ({"value": np.zeros(0)}, None, "shape"),
    ({"value": np.array([1.0, np.inf])}, None, "'value' for episode 0 must be finite"),
    ({"value": np.array([1e300])}, None, "must be finite"),  # finite in float64, not once stored as float32
    ({"action": np.ones(3)}, None, "dtype float64 cannot be stored as int64"),
    ({"value": np.ones(3)}, ("rewritten", "nope"), "two of the buffer's counters"),
])  # fmt: skip
def test_a_rewrite_with_bad_rows_or_counters_is_refused_before_anything_is_written(rows, counters, match):
    schema = Schema({**dqn_schema((2,)), "value": ((), "float32", float("nan"))}, counters=("rewritten",))
    with ReplayBuffer.create(schema, 30) as b:
        b.add_episode({"observation": np.zeros((8, 2)), "action": np.arange(8)})
        before = {name: b.fields[name].copy() for name in b.fields}
        with pytest.raises(ValueError, match=match):
            b.rewrite_rows(b.episodes()[0], rows, counters=counters)
        for name, arr in before.items():
            np.testing.assert_array_equal(b.fields[name], arr)
        assert b.counters["rewritten"] == 0 and b._ring.journal[0] == 0


def test_schema_counters_are_checked_and_shared_with_attached_buffers():
    with pytest.raises(ValueError, match="counter name 'games' is one of the buffer's own"):
        ReplayBuffer.create(Schema(SCHEMA, counters=("games",)), 30)
    with pytest.raises(ValueError, match="at most 8 extra counters fit the buffer, got 9"):
        ReplayBuffer.create(Schema(SCHEMA, counters=[f"c{i}" for i in range(9)]), 30)
    with pytest.raises(ValueError, match="must be distinct"):
        ReplayBuffer.create(SCHEMA, 30, counters=("a", "a"))
    with pytest.raises(ValueError, match="must be an identifier"):
        ReplayBuffer.create(SCHEMA, 30, counters=("two words",))
    with ReplayBuffer.create(Schema(SCHEMA, counters=("a",)), 30, counters=("b",)) as b:
        other = ReplayBuffer.attach(pickle.loads(pickle.dumps(b.handle)))
        b.add_episode(episode(0, 5))
        assert other.rewrite_rows(other.episodes()[0], {"reward": np.ones(4)}, counters=("b", "a"))
        assert b.counters["a"] == 0 and b.counters["b"] == 1 and other.counters == b.counters
        other.close()
    assert "reanalysed_episodes" not in COUNTERS  # the buffer's own counters name no algorithm


def test_episode_table_smaller_than_ring_evicts_by_count():
    b = ReplayBuffer.create(SCHEMA, 100, max_episodes=3)
    try:
        for i in range(5):
            b.add_episode(episode(i, 3))
        assert sorted(stored_episodes(b)) == [2, 3, 4]
        assert len(b) == 6
    finally:
        b.close()


def test_counters_are_named_and_shared():
    b = ReplayBuffer.create(SCHEMA, 100)
    try:
        other = ReplayBuffer.attach(b.handle)  # same process, second mapping
        b.add_episode(episode(0, 5))
        other.add_episode(episode(1, 5))
        assert set(COUNTERS) <= set(b.counters)
        assert b.counters == other.counters and b.counters["games"] == 2
        other.close()
        assert b.counters["games"] == 2  # the reader's close did not unlink
    finally:
        b.close()


def test_abandoned_copy_becomes_a_hole():
    b = ReplayBuffer.create(SCHEMA, 100)
    try:
        b.add_episode(episode(0, 5))

        bad = episode(1, 5)
        bad["tag"] = np.zeros((5, 2), np.int64)
        original = b.fields["tag"]

        class Exploding:
            """Field array that fails mid-copy, like a writer crashing."""

            def __setitem__(self, key, value):
                raise RuntimeError("copy failed")

        b.fields["tag"] = Exploding()
        with pytest.raises(RuntimeError):
            b.add_episode(bad)
        b.fields["tag"] = original
        assert b.counters["episodes_abandoned"] == 1 and len(b) == 4
        table = b._episodes
        assert (table[:, STATE] == PUBLISHED).sum() == 1 and table[0, START] == 0
        for i in range(2, 40):  # the hole is passed over and reclaimed like any episode
            assert b.add_episode(episode(i, 5))
    finally:
        b.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(capacity=1), "capacity"),
        (dict(alpha=-1), "alpha"),
        (dict(priority_eps=-1), "priority_eps"),
        (dict(priority_clip=0), "priority_clip"),
        (dict(initial_priority="min"), "initial_priority"),
        (dict(schema={"_x": ((), "float32")}), "identifier"),
        (dict(schema={"x": ((), "object")}), "dtype"),
        (dict(schema={"x": ((0,), "float32")}), ">= 1"),
        (dict(schema={"x": ((), "int64", float("nan"))}), "NaN"),
    ],
)
def test_bad_construction_arguments(kwargs, message):
    args = {"schema": SCHEMA, "capacity": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        ReplayBuffer.create(args.pop("schema"), args.pop("capacity"), **args)


def test_rows_unsampleable_when_drawn_are_drawn_again(buf):
    """Sampling takes no lock: the descent can meet a slot a writer has just made odd
    (reserved or evicted) before its leaves are zeroed. Such rows are drawn again."""
    for i in range(3):
        buf.add_episode(episode(i, 6))
    buf._generation[6:12] += 1  # episode 1 mid-eviction, leaves still > 0
    batch = buf.sample(3000, rng=np.random.default_rng(0))
    assert not ((batch.indices >= 6) & (batch.indices < 12)).any()
    assert set(batch.data["tag"][:, 0].tolist()) == {0, 2}
    assert (batch.generations % 2 == 0).all()


def test_rows_rewritten_while_gathering_are_drawn_again(buf):
    """A writer that reserves slots while the sampler gathers them: the seqlock check
    after the gather notices and those rows are drawn and gathered again."""
    for i in range(3):
        buf.add_episode(episode(i, 6))

    class RacingWriter:
        """Raw rows, but the first gather is overtaken by a writer on episode 0."""

        calls = 0

        def build(self, fields, slots, pos, moves, terminated, rng, training_step=None):
            out = {name: arr[slots] for name, arr in fields.items()}
            if self.calls == 0:
                buf._generation[0:6] += 1  # the writer's reservation, after our gather
            self.calls += 1
            return out

    racing = RacingWriter()
    batch = buf.sample(300, rng=np.random.default_rng(0), targets=racing)
    assert racing.calls == 2  # one redraw round
    assert buf.counters["torn_rows_redrawn"] > 0
    assert not (batch.indices < 6).any()
    assert set(batch.data["tag"][:, 0].tolist()) == {1, 2}
    # the slots' data and the rows returned agree: nothing torn was kept
    np.testing.assert_array_equal(batch.data["tag"], buf.fields["tag"][batch.indices])


@pytest.mark.parametrize("seed", range(5))
def test_unrolled_priority_updates_match_a_plain_loop(seed):
    """(B, M) priorities: column k goes to the position k moves after the sampled one,
    only within the same episode (never its final row, never the next episode), and a
    sampled row whose episode was rewritten changes nothing. Checked against a plain
    per-slot dictionary of what each leaf must hold."""
    rng = np.random.default_rng(seed)
    b = ReplayBuffer.create(SCHEMA, 64, alpha=0.5, priority_eps=0.01)
    try:
        lengths = rng.integers(2, 12, size=8)  # rows per episode (T + 1)
        for i, rows in enumerate(lengths):
            b.add_episode(episode(i, int(rows)), priorities=np.full(int(rows) - 1, 0.3))
        expected = {s: float(b.priorities(np.array([s]))[0]) for s in range(64)}
        for _ in range(4):
            batch = b.sample(16, beta=1.0, rng=rng)
            m = int(rng.integers(1, 6))
            new = rng.uniform(0, 5, size=(16, m))
            stale = rng.random(16) < 0.2  # pretend these were sampled from older contents
            gens = np.where(stale, batch.generations + 2, batch.generations)
            applied, dropped = b.update_priorities(batch.indices, gens, new)
            assert (applied, dropped) == (16 - stale.sum(), stale.sum())
            for j, s in enumerate(batch.indices):
                if stale[j]:
                    continue
                ep_id, t = b.fields["tag"][s]
                T = lengths[ep_id] - 1
                for k in range(m):
                    if t + k < T:
                        assert tuple(b.fields["tag"][s + k]) == (ep_id, t + k)
                        expected[int(s + k)] = (new[j, k] + 0.01) ** 0.5
            got = b.priorities(np.arange(64))
            np.testing.assert_allclose(got, [expected[s] for s in range(64)], rtol=1e-12)
            # the tree's total is the sum of its leaves after these writes
            assert b._tree.total == pytest.approx(got.sum(), rel=1e-12)
    finally:
        b.close()
