"""MuZero (Schrittwieser et al. 2020) with muzero-general's choices.

Read in this order: ``networks`` (representation, dynamics, prediction; value and
reward as distributions over a support), ``tree`` (the batched search: tree, simulation
loop, backup) and its policies ``mcts`` (pUCT) and ``gumbel`` (Gumbel MuZero), ``player``
(self-play and greedy play with the search), ``targets`` (the stored row layout and the
unroll targets built at sample time), ``trainer`` (the loss and one update),
``reanalyse`` (stored values refreshed with the newest weights), ``arena`` (two-player
evaluation), ``snapshot_eval`` (a network judged on stored data).
"""
