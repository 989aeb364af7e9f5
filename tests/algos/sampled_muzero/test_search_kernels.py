"""Sampled MuZero's compiled search against the plain loop version of the same rules
(``python_search_reference.py``): from the same seeds, on random networks, both kinds of
search give the same samples, priors, visit counts, policy targets, values and chosen samples,
to the last bit; and the kernels' building blocks against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from python_search_reference import ReferenceSampledSearch, reference_sampled_prior

from mpper.algos.configs import config_from_dict
from mpper.algos.sampled_muzero.gumbel import numpy_sum
from mpper.algos.sampled_muzero.networks import make_network
from mpper.algos.sampled_muzero.search import SampledSearch, corrected_priors, sampled_prior

FIELDS = ["actions", "distinct", "prior", "visit_counts", "policy_target", "root_values", "root_predicted_values"]


@pytest.mark.parametrize("count", [*range(0, 20), 127, 128, 129, 200, 1024, 5000])
def test_the_kernels_sum_is_numpys_to_the_last_bit(count):
    x = np.random.default_rng(count).exponential(size=count + 7)
    assert numpy_sum(x, 3, count) == x[3 : 3 + count].sum()


def test_repeated_samples_share_one_prior_as_the_np_unique_version_gives_it():
    rng = np.random.default_rng(4)
    # 2-D actions from a few values (many repeats, some equal in one coordinate only), 0.0 beside -0.0
    actions = rng.choice([-0.5, 0.0, 0.5], size=(6, 9, 2))
    actions[0, 1] = [-0.0, 0.5]
    actions[0, 2] = [0.0, 0.5]
    log_pi, log_beta = rng.normal(size=(6, 9)), rng.normal(size=(6, 9))
    prior, distinct = corrected_priors(actions, log_pi, log_beta)
    assert not distinct[0, 2] and distinct.sum() < distinct.size
    for t in range(6):
        expected_prior, expected_distinct = reference_sampled_prior(actions[t], log_pi[t], log_beta[t])
        np.testing.assert_array_equal(distinct[t], expected_distinct)
        np.testing.assert_array_equal(prior[t], expected_prior)
        single = sampled_prior(actions[t], log_pi[t], log_beta[t])
        np.testing.assert_array_equal(single[0], expected_prior)
        np.testing.assert_array_equal(single[1], expected_distinct)


CASES = [  # kind, gumbel_q_bounds, K, action dims, explore, wide policy (many samples saturate: repeats)
    ("puct", "node", 12, 1, True, False),
    ("puct", "node", 12, 2, False, True),
    ("puct", "node", 5, 1, True, True),
    ("puct", "node", 150, 3, True, False),
    ("gumbel", "node", 12, 1, True, False),
    ("gumbel", "node", 12, 2, False, True),
    ("gumbel", "tree", 12, 2, True, True),
    ("gumbel", "tree", 5, 1, False, False),
    ("gumbel", "node", 150, 3, True, False),
]


@pytest.mark.parametrize("kind, bounds, k, action_dim, explore, wide", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_compiled_search_gives_the_plain_loop_searchs_result(kind, bounds, k, action_dim, explore, wide, seed):
    sims = 10 if k > 100 else 20
    config = config_from_dict({"algorithm": "sampled_muzero", "env": {"id": "Pendulum-v1"}}, "x.json", [
        f"sampled_mcts.kind={kind}", f"sampled_mcts.gumbel_q_bounds={bounds}", f"sampled_mcts.num_sampled_actions={k}",
        f"sampled_mcts.num_simulations={sims}", "sampled_mcts.max_num_considered_actions=8",
        "sampled_mcts.root_sampling_temperature=1.5", "sampled_network.hidden=[32]", "sampled_network.encoding_size=8",
    ])  # fmt: skip
    torch.manual_seed(seed)
    network = make_network(config.sampled_network, (3,), action_dim).eval()
    if wide:  # mean past the edge, log std at its bound: many samples saturate at the Box's corner and repeat
        torch.nn.init.constant_(network.policy_net[-1].bias, 8.0)
    observations = np.random.default_rng(seed).normal(size=(24, 3)).astype(np.float32)
    args = (config.sampled_mcts, action_dim, config.sampled_network.support_size)
    rng, reference_rng = np.random.default_rng(seed), np.random.default_rng(seed)
    got = SampledSearch(*args).run(network, observations, explore, rng)
    expected = ReferenceSampledSearch(*args).run(network, observations, explore, reference_rng)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(expected, field), err_msg=field)
    if kind == "gumbel":
        np.testing.assert_array_equal(got.chosen, expected.chosen)
    else:
        assert got.chosen is None and expected.chosen is None
    assert rng.random() == reference_rng.random()  # the generator was used alike
    assert len({tuple(v) for v in got.visit_counts}) > 1  # the roots' searches differ
    if wide:
        assert not got.distinct.all()  # repeats were there to handle
