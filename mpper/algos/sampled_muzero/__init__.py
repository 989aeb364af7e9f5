"""Sampled MuZero (Hubert et al. 2021, "Learning and Planning in Complex Action Spaces")
for continuous (bounded Box) action spaces.

Read in this order: ``networks`` (representation, dynamics over action vectors,
prediction with a tanh-squashed Gaussian policy), ``search`` (pUCT over K sampled actions
per node, the sampled-policy correction), ``player`` (self-play and greedy play),
``targets`` (the stored rows: float actions, the K root samples and their visit shares),
``trainer`` (the paper's policy loss over the sampled actions), ``reanalyse`` (stored values
refreshed), ``snapshot_eval``.
"""

