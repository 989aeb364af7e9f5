"""Reanalyse: refresh the stored values of whole episodes with the latest weights.

muzero-general's ``Reanalyse`` actor with ``use_last_model_value``: it repeatedly draws
episodes uniformly from the replay buffer, runs the newest network's initial inference
on the stacked observations of every row ``0 .. T`` and stores the predicted values as
``reanalysed_value`` (row T, the final observation, is what the targets of an episode
cut by a time limit bootstrap from), which the value targets then use in place of the
(older) MCTS root values. Unlike muzero-general's, it works on a batch of episodes with one
inference, and a write is guarded by generations: values computed for an episode that
was evicted or rewritten since it was read are dropped, never written into its
successor's rows.

:class:`Reanalyser` does the work (usable in one process, in turns with self-play and
learning, for ``--workers 0``); :func:`run_reanalyser` is the child-process entry point.
"""

from __future__ import annotations

import numpy as np
import torch

from ...replay.buffer import ReplayBuffer
from ..base import WeightSource
from .networks import make_network, support_to_scalar
from .targets import stacked_observations

__all__ = ["Reanalyser"]

NAME = "reanalyser"
_REPORT_INTERVAL_S = 1.0


class Reanalyser:
    """Recomputes ``reanalysed_value`` for batches of stored episodes.

    Args:
        config: the run's :class:`~mpper.config.Config` (network, stacking, batch size).
        buf: the replay buffer (attached or owned); needs a ``reanalysed_value`` field.
        store: the weight store the learner publishes to.
        max_positions: positions per forward pass (bounds memory for long episodes).
    """

    def __init__(self, config, buf: ReplayBuffer, store: WeightSource, max_positions: int = 4096) -> None:
        if "reanalysed_value" not in buf.fields:
            raise KeyError("reanalyse needs a buffer whose schema has a 'reanalysed_value' field")
        self.buf = buf
        self.store = store
        self.batch_episodes = int(config.reanalyse.batch_episodes)
        self.num_stacked = int(config.muzero.stacked_observations)
        self.support_size = int(config.network.support_size)
        self.max_positions = int(max_positions)
        obs_shape = tuple(buf.fields["observation"].shape[1:])
        self.num_actions = int(buf.fields["child_visits"].shape[1])
        self.network = make_network(config.network, obs_shape, self.num_actions, self.num_stacked)
        self.network.eval()
        self._flat = np.empty(self.network.num_flat_weights(), np.float32)
        if store.handle.num_weights != self._flat.shape[0]:
            raise ValueError(f"the weight store holds {store.handle.num_weights} parameters, "
                             f"the network has {self._flat.shape[0]}")  # fmt: skip
        self.version = 0  # weights version loaded into self.network (0: none yet)
        self.rng = np.random.default_rng([int(config.runtime.seed), 0x5EA])
        self.episodes = 0  # episodes whose values were stored
        self.dropped = 0  # episodes rewritten between read and store (or during the read)

    def refresh_weights(self) -> bool:
        """Copy the latest weights if the store's version changed; whether it did."""
        if self.store.version == self.version:
            return False
        version, _ = self.store.read_into(self._flat)
        self.network.set_flat_weights(self._flat)
        self.version = version
        return True

    @torch.inference_mode()
    def values(self, observations: np.ndarray) -> np.ndarray:
        """The network's scalar values for a batch of (stacked) observations, float32."""
        out = []
        for lo in range(0, observations.shape[0], self.max_positions):
            x = torch.from_numpy(np.ascontiguousarray(observations[lo : lo + self.max_positions]))
            logits = self.network.initial_inference(x).value_logits
            out.append(support_to_scalar(logits, self.support_size).numpy())
        return np.concatenate(out).astype(np.float32, copy=False)

    def step(self) -> tuple[int, int]:
        """Reanalyse one batch of episodes; returns (stored, dropped). Needs weights
        (``refresh_weights`` after the first publication); (0, 0) on an empty buffer."""
        if self.version < 1:
            raise RuntimeError("Reanalyser.step: no weights loaded yet (store.version is 0)")
        refs = self.buf.sample_episodes(self.batch_episodes, rng=self.rng)
        kept, stacks, dropped = [], [], 0
        for ref in refs:
            rows = self.buf.read_episode(ref, names=("observation", "action"))
            if rows is None:  # evicted before or during the read
                dropped += 1
                continue
            pos = np.arange(ref.rows)  # every row, the final observation's included
            stacks.append(stacked_observations(rows["observation"], rows["action"], pos, pos,
                                               self.num_stacked, self.num_actions))  # fmt: skip
            kept.append(ref)
        stored = 0
        if kept:
            values = self.values(np.concatenate(stacks))
            bounds = np.cumsum([0] + [ref.rows for ref in kept])
            for ref, lo, hi in zip(kept, bounds[:-1], bounds[1:]):
                if self.buf.store_reanalysed_values(ref, values[lo:hi]):
                    stored += 1
                else:  # rewritten since it was read: generation rule
                    dropped += 1
        self.episodes += stored
        self.dropped += dropped
        return stored, dropped
