"""Sampled MuZero's reanalyse: the stored values of whole episodes refreshed with the
newest weights (muzero-general's ``use_last_model_value``), as MuZero's reanalyser does
without a new search: batches of episodes drawn uniformly, the network's value of every
row 0 .. T stored as ``reanalysed_value``, a write dropped when the episode was evicted or
rewritten since it was read (the buffer's generation rule)."""

from __future__ import annotations

import numpy as np
import torch

from ...replay.buffer import ReplayBuffer
from ..base import WeightSource
from .config import SampledMuZeroRunConfig
from .networks import make_network, support_to_scalar
from .targets import REANALYSE_COUNTERS

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

    def stats(self) -> dict[str, int]:
        return {"episodes": self.episodes, "dropped": self.dropped, "weights_version": self.version}

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
        for ref in self.buf.sample_episodes(self.batch_episodes, rng=self.rng):
            rows = self.buf.read_episode(ref, names=("observation",))
            if rows is None:
                dropped += 1
                continue
            logits = self.network.initial_inference(torch.from_numpy(np.asarray(rows["observation"], np.float32)))
            values = support_to_scalar(logits.value_logits, self.support_size).numpy().astype(np.float32)
            if self.buf.rewrite_rows(ref, {"reanalysed_value": values}, counters=REANALYSE_COUNTERS):
                stored += 1
            else:
                dropped += 1
        self.episodes += stored
        self.dropped += dropped
        return stored, dropped
