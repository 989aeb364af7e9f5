"""Sampled MuZero's reanalyse: the stored targets of whole episodes refreshed with the
newest weights, as MuZero's reanalyser does: batches of episodes drawn uniformly, the
network's value of every row 0 .. T stored as ``reanalysed_value`` (muzero-general's
``use_last_model_value``); for ``sampled_reanalyse.search_fraction`` of them, a new search
of every position 0 .. T-1 (the run's search, with self-play's root noise), whose root
values replace those values and whose root samples and policy targets are stored as
``reanalysed_actions`` and ``reanalysed_policy`` (EfficientZero's reanalyse). A write is
dropped when the episode was evicted or rewritten since it was read (the buffer's
generation rule)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ...replay.buffer import ReplayBuffer
from ..base import WeightSource
from ..muzero_family import support_to_scalar
from .config import SampledMuZeroRunConfig
from .networks import make_network
from .search import SampledSearch
from .targets import REANALYSE_COUNTERS

# roots per batched search: bounds the trees' memory (hidden states of num_simulations + 1 nodes each)
_ROOTS_PER_SEARCH = 256

__all__ = ["SampledReanalyser"]


class SampledReanalyser:
    """``refresh_weights()``, ``step() -> (stored, dropped)`` and ``stats()`` (the runtime's
    reanalyser contract) over ``buf`` with the weights ``store`` publishes."""

    def __init__(self, config: SampledMuZeroRunConfig, buf: ReplayBuffer, store: WeightSource) -> None:
        self.buf = buf
        self.store = store
        self.batch_episodes = int(config.sampled_reanalyse.batch_episodes)
        self.support_size = int(config.sampled_network.support_size)
        obs_shape = tuple(buf.fields["observation"].shape[1:])
        action_dim = int(buf.fields["action"].shape[1])
        self.network = make_network(config.sampled_network, obs_shape, action_dim).eval()
        self._flat = np.empty(self.network.num_flat_weights(), np.float32)
        if store.handle.num_weights != self._flat.shape[0]:
            raise ValueError(f"the weight store holds {store.handle.num_weights} parameters, "
                             f"the network has {self._flat.shape[0]}")  # fmt: skip
        self.version = 0
        self.rng = np.random.default_rng([int(config.runtime.seed), 0x5EA])
        self.episodes = 0
        self.dropped = 0
        self.searched = 0  # episodes whose policies (and values) came from a new search
        self.search_fraction = float(config.sampled_reanalyse.search_fraction)
        simulations = config.sampled_reanalyse.num_simulations or config.sampled_mcts.num_simulations
        mcts = dataclasses.replace(config.sampled_mcts, num_simulations=int(simulations))
        self.search = SampledSearch(mcts, action_dim, self.support_size)

    def stats(self) -> dict[str, int]:
        return {"episodes": self.episodes, "dropped": self.dropped, "weights_version": self.version,
                "searched_episodes": self.searched}  # fmt: skip

    def refresh_weights(self) -> bool:
        """Copy the latest weights if the store's version changed; whether it did."""
        if self.store.version == self.version:
            return False
        version, _ = self.store.read_into(self._flat)
        self.network.set_flat_weights(self._flat)
        self.version = version
        return True

    @torch.inference_mode()
    def step(self) -> tuple[int, int]:
        """Reanalyse one batch of episodes; (stored, dropped)."""
        if self.version < 1:
            raise RuntimeError("SampledReanalyser.step: no weights loaded yet (store.version is 0)")
        stored = dropped = 0
        refs = self.buf.sample_episodes(self.batch_episodes, rng=self.rng)
        for ref, search in zip(refs, self.rng.random(len(refs)) < self.search_fraction):
            rows = self.buf.read_episode(ref, names=("observation",))
            if rows is None:
                dropped += 1
                continue
            observations = np.asarray(rows["observation"], np.float32)
            logits = self.network.initial_inference(torch.from_numpy(observations))
            values = support_to_scalar(logits.value_logits, self.support_size).numpy().astype(np.float32)
            new = {"reanalysed_value": values}
            if search:
                new.update(self.search_positions(observations[:-1], values))
            if self.buf.rewrite_rows(ref, new, counters=REANALYSE_COUNTERS):
                stored += 1
                self.searched += bool(search)
            else:
                dropped += 1
        self.episodes += stored
        self.dropped += dropped
        return stored, dropped

    def search_positions(self, observations: np.ndarray, values: np.ndarray) -> dict[str, np.ndarray]:
        """A new search of each of T positions ``observations`` (T, *obs), with self-play's
        root noise: ``reanalysed_policy`` (T, K) and ``reanalysed_actions`` (T, K, A); their
        root values replace ``values[:T]`` in place."""
        policies, actions = [], []
        for lo in range(0, len(observations), _ROOTS_PER_SEARCH):
            result = self.search.run(self.network, observations[lo : lo + _ROOTS_PER_SEARCH], True, self.rng)
            values[lo : lo + len(result.root_values)] = result.root_values
            policies.append(result.policy_target)
            actions.append(result.actions)
        return {"reanalysed_policy": np.concatenate(policies).astype(np.float32),
                "reanalysed_actions": np.concatenate(actions).astype(np.float32)}  # fmt: skip
