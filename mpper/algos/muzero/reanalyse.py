"""Reanalyse: refresh the stored targets of whole episodes with the latest weights.

muzero-general's ``Reanalyse`` actor with ``use_last_model_value``: it repeatedly draws
episodes uniformly from the replay buffer, runs the newest network's initial inference
on the stacked observations of every row ``0 .. T`` and stores the predicted values as
``reanalysed_value`` (row T, the final observation, is what the targets of an episode
cut by a time limit bootstrap from), which the value targets then use in place of the
(older) MCTS root values. Unlike muzero-general's, it works on a batch of episodes with one
inference, and a write is guarded by generations: values computed for an episode that
was evicted or rewritten since it was read are dropped, never written into its
successor's rows.

With ``reanalyse.search_fraction`` > 0 that share of the episodes is searched again
(EfficientZero's and LightZero's reanalyse, MuZero Reanalyze): the run's search
(``mcts.kind``, ``reanalyse.num_simulations``, self-play's root noise) over all T
positions of the episode at once, with the legal actions and players stored with them;
its policy targets go to ``reanalysed_policy``, which the learner's policy targets then
use in place of the self-play search's, and its root values to ``reanalysed_value``.

:class:`Reanalyser` does the work (usable in one process, in turns with self-play and
learning, for ``--workers 0``); :func:`run_reanalyser` is the child-process entry point.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ...envs.spec import make_env
from ...envs.two_player import is_two_player
from ...replay.buffer import ReplayBuffer
from ..base import WeightSource
from .networks import make_network, support_to_scalar
from .search import make_search
from .targets import stacked_observations

__all__ = ["Reanalyser"]

NAME = "reanalyser"
_REPORT_INTERVAL_S = 1.0


_SEARCH_FIELDS = ("to_play", "legal_actions", "reanalysed_policy")


class Reanalyser:
    """Recomputes ``reanalysed_value`` (and, for ``reanalyse.search_fraction`` of the
    episodes, ``reanalysed_policy``) for batches of stored episodes.

    Args:
        config: the run's :class:`~mpper.config.Config` (network, stacking, batch size,
            search).
        buf: the replay buffer (attached or owned); needs a ``reanalysed_value`` field,
            and to search: ``to_play``, ``legal_actions`` and ``reanalysed_policy``.
        store: the weight store the learner publishes to.
        max_positions: positions per forward pass (bounds memory for long episodes).
        max_search_positions: roots per batched search (bounds the trees' memory:
            hidden states of ``num_simulations + 1`` nodes per root).
        two_player: whether the env's players alternate (the search's sign rule); None:
            asked of one env made from ``config.env`` (only when searching).
    """

    def __init__(self, config, buf: ReplayBuffer, store: WeightSource, max_positions: int = 4096,
                 max_search_positions: int = 256, two_player: bool | None = None) -> None:  # fmt: skip
        if "reanalysed_value" not in buf.fields:
            raise KeyError("reanalyse needs a buffer whose schema has a 'reanalysed_value' field")
        self.search_fraction = float(config.reanalyse.search_fraction)
        missing = [name for name in _SEARCH_FIELDS if name not in buf.fields]
        if self.search_fraction > 0 and missing:
            raise KeyError(f"reanalyse.search_fraction {self.search_fraction} needs a buffer whose schema has the "
                           f"fields {list(_SEARCH_FIELDS)}; missing {missing}")  # fmt: skip
        self.buf = buf
        self.store = store
        self.batch_episodes = int(config.reanalyse.batch_episodes)
        self.num_stacked = int(config.muzero.stacked_observations)
        self.support_size = int(config.network.support_size)
        self.max_positions = int(max_positions)
        self.max_search_positions = int(max_search_positions)
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
        self.search = None
        if self.search_fraction > 0:
            simulations = config.reanalyse.num_simulations or config.mcts.num_simulations
            if two_player is None:
                env = make_env(config.env)
                two_player = is_two_player(env)
                env.close()
            mcts = dataclasses.replace(config.mcts, num_simulations=int(simulations))
            self.search = make_search(self.num_actions, mcts, self.support_size, two_player=bool(two_player))
        self.episodes = 0  # episodes whose values were stored
        self.searched = 0  # of those, episodes whose policies (and values) came from a new search
        self.positions_searched = 0  # positions of the searched episodes
        self.dropped = 0  # episodes rewritten between read and store (or during the read)

    def stats(self) -> dict[str, int]:
        """What the reports and metrics.jsonl show of this reanalyser."""
        return {"episodes": self.episodes, "dropped": self.dropped, "weights_version": self.version,
                "searched_episodes": self.searched, "positions_searched": self.positions_searched}  # fmt: skip

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

    def search_positions(self, observations: np.ndarray, legal: np.ndarray, to_play: np.ndarray):
        """One search per position with the current weights: (root values (N,) float32,
        policy targets (N, A) float32), ``max_search_positions`` roots per batched search."""
        values, policies = [], []
        for lo in range(0, observations.shape[0], self.max_search_positions):
            hi = lo + self.max_search_positions
            result = self.search.run(self.network, observations[lo:hi], legal[lo:hi], to_play[lo:hi],
                                     add_exploration_noise=True, rng=self.rng)  # fmt: skip
            values.append(result.root_values)
            policies.append(result.policy_target)
        return np.concatenate(values).astype(np.float32), np.concatenate(policies).astype(np.float32)

    def step(self) -> tuple[int, int]:
        """Reanalyse one batch of episodes; returns (stored, dropped). Needs weights
        (``refresh_weights`` after the first publication); (0, 0) on an empty buffer."""
        if self.version < 1:
            raise RuntimeError("Reanalyser.step: no weights loaded yet (store.version is 0)")
        refs = self.buf.sample_episodes(self.batch_episodes, rng=self.rng)
        searching = self.rng.random(len(refs)) < self.search_fraction
        names = ("observation", "action") + (("to_play", "legal_actions") if searching.any() else ())
        kept, stacks, dropped, searched = [], [], 0, []
        for ref, search in zip(refs, searching):
            rows = self.buf.read_episode(ref, names=names)
            if rows is None:  # evicted before or during the read
                dropped += 1
                continue
            pos = np.arange(ref.rows)  # every row, the final observation's included
            stacks.append(stacked_observations(rows["observation"], rows["action"], pos, pos,
                                               self.num_stacked, self.num_actions))  # fmt: skip
            kept.append(ref)
            searched.append(rows if search else None)
        stored = 0
        if kept:
            values = self.values(np.concatenate(stacks))
            bounds = np.cumsum([0] + [ref.rows for ref in kept])
            policies = self._search_episodes(kept, stacks, searched, values, bounds)
            for ref, lo, hi, policy in zip(kept, bounds[:-1], bounds[1:], policies):
                if self.buf.store_reanalysed_values(ref, values[lo:hi], policy):
                    stored += 1
                    self.searched += policy is not None
                    self.positions_searched += 0 if policy is None else ref.rows - 1
                else:  # rewritten since it was read: generation rule
                    dropped += 1
        self.episodes += stored
        self.dropped += dropped
        return stored, dropped

    def _search_episodes(self, kept, stacks, searched, values, bounds) -> list:
        """Search the positions 0 .. T-1 of the episodes to search (all of them in one
        batched search); their root values replace theirs in ``values``. Returns the
        policy targets (T, A) per kept episode, None for one not searched."""
        chosen = [j for j, rows in enumerate(searched) if rows is not None]
        if not chosen:
            return [None] * len(kept)
        moves = [kept[j].rows - 1 for j in chosen]
        root_values, targets = self.search_positions(
            np.concatenate([stacks[j][:-1] for j in chosen]),
            np.concatenate([searched[j]["legal_actions"][:-1] for j in chosen]),
            np.concatenate([searched[j]["to_play"][:-1] for j in chosen]),
        )  # fmt: skip
        policies = [None] * len(kept)
        offsets = np.cumsum([0] + moves)
        for j, lo, hi in zip(chosen, offsets[:-1], offsets[1:]):
            values[bounds[j] : bounds[j] + (hi - lo)] = root_values[lo:hi]
            policies[j] = targets[lo:hi]
        return policies
