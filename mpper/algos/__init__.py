"""Algorithms: each one a folder behind one :class:`~mpper.algos.base.Algorithm` entry in
:mod:`mpper.algos.registry`. They import the replay core, the envs and the config, never
the runtime that runs them."""
