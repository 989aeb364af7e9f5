"""SumTree against brute force: prefix sums, sampling, zero leaves, bad input."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from mpper import SumTree


def brute_find(leaves: np.ndarray, target: float) -> int:
    """Leaf whose cumulative range [c_{k-1}, c_k) holds target (exact, by prefix sums)."""
    cum = np.cumsum(leaves)
    return int(np.searchsorted(cum, target, side="right"))


updates = st.lists(
    st.tuples(st.integers(0, 10_000), st.floats(0, 1e6, allow_nan=False, allow_infinity=False)),
    min_size=1,
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 300), ops=updates)
def test_tree_matches_brute_force_after_random_updates(capacity, ops):
    tree = SumTree(capacity)
    leaves = np.zeros(capacity)
    for index, value in ops:
        # mix single updates and batches with duplicates (last write wins, as numpy)
        idx = np.array([index % capacity, (index * 7) % capacity])
        vals = np.array([value, value / 3])
        tree.set(idx, vals)
        leaves[idx] = vals
    np.testing.assert_array_equal(tree.leaves, leaves)
    np.testing.assert_array_equal(tree.get(np.arange(capacity)), leaves)
    exact = math.fsum(leaves)
    assert abs(tree.total - exact) <= 64 * np.finfo(float).eps * exact
    # every internal node equals the sum of its children
    base = tree._leaf_base
    for node in range(1, base):
        assert tree.tree[node] == tree.tree[2 * node] + tree.tree[2 * node + 1]


# leaves with at least one positive: mostly zeros, tiny, huge and ordinary values
positive_leaves = st.lists(
    st.one_of(st.just(0.0), st.floats(1e-300, 1e-250), st.floats(1e-3, 1e6)), min_size=1, max_size=300
).filter(lambda xs: any(x > 0 for x in xs))


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(leaves=positive_leaves, fractions=st.lists(st.floats(0, 1), min_size=1, max_size=20))
def test_prefix_sum_finds_the_leaf_whose_range_holds_the_target(leaves, fractions):
    """The leaf found for target t is a positive leaf whose cumulative range
    [c_(k-1), c_k) holds t, up to the rounding of the sums (1e-9 of the total)."""
    leaves = np.array(leaves)
    tree = SumTree(leaves.size)
    tree.set(np.arange(leaves.size), leaves)
    targets = np.array(fractions) * tree.total * (1 - 1e-12)
    found = tree.find_prefix_sum(targets)
    cum = np.cumsum(leaves)
    tol = 1e-9 * cum[-1]
    for t, k in zip(targets, found):
        assert 0 <= k < leaves.size and leaves[k] > 0
        assert cum[k] - leaves[k] - tol <= t <= cum[k] + tol, (t, k, cum[k] - leaves[k], cum[k])


def assert_one_draw_per_slice(leaves: np.ndarray, draws: np.ndarray) -> None:
    """N draws are stratified when, sorted, the j-th one is a leaf whose cumulative range
    [c_(k-1), c_k) meets the slice [j, j + 1) * total / N, for every j: each of the N equal
    slices of the mass yielded exactly one draw (up to the rounding of the sums, 1e-9 of
    the total). Independent draws drift from their slices by about sqrt(N) slices."""
    n = draws.size
    cum = np.cumsum(leaves)
    total, tol = cum[-1], 1e-9 * cum[-1]
    k = np.sort(draws)
    j = np.arange(n)
    lo, hi = cum[k] - leaves[k], cum[k]  # the range of the leaf drawn j-th
    bad = (lo > (j + 1) * total / n + tol) | (hi < j * total / n - tol)
    assert not bad.any(), f"slices without their draw: {np.flatnonzero(bad)[:10].tolist()} of {n}"


@settings(max_examples=100, deadline=None)
@given(leaves=positive_leaves, batch=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_sample_is_stratified_one_draw_per_slice_of_the_mass(leaves, batch, seed):
    leaves = np.array(leaves)
    tree = SumTree(leaves.size)
    tree.set(np.arange(leaves.size), leaves)
    draws = tree.sample(batch, np.random.default_rng(seed))
    assert draws.shape == (batch,) and (leaves[draws] > 0).all()
    assert_one_draw_per_slice(leaves, draws)


@pytest.mark.parametrize("capacity", [1, 7, 64, 1000])
def test_sample_of_n_over_n_equal_leaves_hits_each_leaf_once(capacity):
    """Each of the N slices of the mass is one leaf: N draws are a permutation."""
    tree = SumTree(capacity)
    tree.set(np.arange(capacity), np.ones(capacity))
    for seed in range(5):
        assert sorted(tree.sample(capacity, np.random.default_rng(seed)).tolist()) == list(range(capacity))


@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(1, 200), seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 300))
def test_zero_leaves_never_sampled_even_on_slice_edges(capacity, seed, batch):
    rng = np.random.default_rng(seed)
    leaves = rng.random(capacity) * (rng.random(capacity) < 0.3)  # mostly zeros
    if leaves.sum() == 0:
        leaves[rng.integers(capacity)] = 1e-300  # a single tiny positive leaf
    tree = SumTree(capacity)
    tree.set(np.arange(capacity), leaves)
    # draws at exact slice edges, at the total and just past it (rounding)
    edges = np.concatenate([
        SumTree.stratified_targets(np.zeros(batch), tree.total),
        SumTree.stratified_targets(np.full(batch, np.nextafter(1.0, 0.0)), tree.total),
        [tree.total, tree.total * (1 + 1e-12), 0.0],
    ])  # fmt: skip
    found = tree.find_prefix_sum(edges)
    assert found.min() >= 0 and found.max() < capacity
    assert (leaves[found] > 0).all()
    found = tree.sample(batch, rng)
    assert (leaves[found] > 0).all()


def test_set_range_matches_set():
    rng = np.random.default_rng(1)
    a, b = SumTree(1000), SumTree(1000)
    for _ in range(200):
        start = int(rng.integers(0, 1000))
        n = int(rng.integers(1, 1000 - start + 1))
        vals = rng.random(n) * (rng.random() < 0.8)
        a.set_range(start, vals)
        b.set(np.arange(start, start + n), vals)
    np.testing.assert_array_equal(a.tree, b.tree)


def test_stratified_sampling_frequencies_chi_square():
    """Frequencies of >= 200k stratified draws against p_i / sum (fixed seed)."""
    rng = np.random.default_rng(12345)
    capacity = 97
    leaves = rng.random(capacity) ** 3
    leaves[::10] = 0.0
    tree = SumTree(capacity)
    tree.set(np.arange(capacity), leaves)
    draws = np.concatenate([tree.sample(1000, rng) for _ in range(250)])
    counts = np.bincount(draws, minlength=capacity)
    assert counts[leaves == 0].sum() == 0
    expected = leaves / leaves.sum() * draws.size
    live = expected > 0
    p = chisquare(counts[live], expected[live]).pvalue
    assert p > 1e-3, p
    # and the test can fail: the same counts against the uniform distribution
    uniform = np.full(live.sum(), draws.size / live.sum())
    assert chisquare(counts[live], uniform).pvalue < 1e-6


def test_drift_stays_bounded_over_many_updates():
    """Recomputing ancestors from children: the root never drifts from the leaves,
    unlike delta updates (shown by the seed's scheme, run alongside)."""
    rng = np.random.default_rng(7)
    capacity = 4096
    tree = SumTree(capacity)
    delta_root = 0.0
    leaves = np.zeros(capacity)
    for _ in range(300):
        idx = rng.integers(0, capacity, 256)
        vals = rng.random(256) * 10.0 ** rng.integers(-8, 8, 256)
        for i, v in zip(idx, vals):  # the seed's scheme: add the change
            delta_root += v - leaves[i]
            leaves[i] = v
        tree.set(idx, vals)
    exact = math.fsum(leaves)
    assert abs(tree.total - exact) <= 13 * np.finfo(float).eps * exact
    assert abs(delta_root - exact) > abs(tree.total - exact)  # the seed's drifted further


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0, -1e-300])
def test_bad_priority_raises_and_leaves_tree_unchanged(bad):
    tree = SumTree(10)
    tree.set(np.arange(10), np.arange(10.0))
    before = tree.tree.copy()
    with pytest.raises(ValueError, match=r"positions \[3\]=") as err:
        tree.set(np.array([1, 2, 5, 7]), np.array([1.0, 2.0, 3.0, bad]))
    assert "finite" in str(err.value)
    np.testing.assert_array_equal(tree.tree, before)
    with pytest.raises(ValueError):
        tree.set_range(0, np.array([1.0, bad]))
    np.testing.assert_array_equal(tree.tree, before)


def test_bad_indices_and_capacity():
    with pytest.raises(ValueError):
        SumTree(0)
    tree = SumTree(5)
    with pytest.raises(IndexError, match="outside"):
        tree.set(np.array([5]), np.array([1.0]))
    with pytest.raises(IndexError):
        tree.set(np.array([-1]), np.array([1.0]))
    with pytest.raises(TypeError):
        tree.get(np.array([0.5]))
    with pytest.raises(ValueError, match="total is 0"):
        tree.sample(4, np.random.default_rng(0))


def test_capacity_one_and_external_storage():
    tree = SumTree(1)
    tree.set(np.array([0]), np.array([2.5]))
    assert tree.total == 2.5
    assert tree.sample(5, np.random.default_rng(0)).tolist() == [0] * 5
    storage = np.zeros(SumTree.storage_size(6))
    t = SumTree(6, storage)
    t.set(np.arange(6), np.ones(6))
    assert storage[1] == 6.0  # it wrote into the array it was given
    storage[t._leaf_base + 2] = 5.0  # leaves written directly, then rebuilt
    t.rebuild()
    assert t.total == 10.0
    with pytest.raises(ValueError, match="storage"):
        SumTree(6, np.zeros(3))
