"""Reanalyse: refresh the stored targets of whole episodes with the latest weights.

muzero-general's ``Reanalyse`` actor with ``use_last_model_value``: it repeatedly draws
episodes uniformly from the replay buffer, runs the newest network's initial inference
on the stacked observations of every row ``0 .. T`` and stores the predicted values as
``reanalysed_value`` (row T, the final observation, is what the targets of an episode
cut by a time limit bootstrap from), which the value targets then use in place of the
(older) MCTS root values. Unlike muzero-general's, it works on a batch of episodes, their
rows through the network together in passes of bounded input (``INPUT_BYTES_PER_PASS``:
the stacked float32 observations of a batch of Atari episodes run to gigabytes, so they are
built pass by pass, never for a whole batch at once), and a write is guarded by
generations: values computed for an episode that was evicted or rewritten since it was
read are dropped, never written into its successor's rows.

With ``reanalyse.search_fraction`` > 0 that share of the episodes is searched again
(EfficientZero's and LightZero's reanalyse, MuZero Reanalyze): the run's search
(``mcts.kind``, ``reanalyse.num_simulations``, self-play's root noise) over all T
positions of the episode, in batched searches of bounded input too, with the legal
actions and players stored with them; its policy targets go to ``reanalysed_policy``,
which the learner's policy targets then use in place of the self-play search's, and its
root values to ``reanalysed_value``.

:class:`Reanalyser` does the work (usable in one process, in turns with self-play and
learning, for ``--workers 0``); :func:`mpper.runtime.children.run_reanalyser` is the child-process entry point.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ...envs.spec import make_env
from ...envs.two_player import is_two_player
from ...replay.buffer import EpisodeRef, ReplayBuffer
from ..base import WeightSource
from .config import MuZeroRunConfig
from .networks import lstm_horizon, make_network, support_to_scalar
from .search import make_search
from .targets import REANALYSE_COUNTERS, stacked_observations

__all__ = ["Reanalyser", "store_reanalysed"]

NAME = "reanalyser"
_REPORT_INTERVAL_S = 1.0


_SEARCH_FIELDS = ("to_play", "legal_actions", "reanalysed_policy")
# Stacked float32 observations per network pass, in bytes: 4,096 CartPole rows, about 64
# rows of 84 x 84 Atari frames stacked with 4 past frames and actions (254 KiB a row), whose
# convolutions' activations are several times the input.
INPUT_BYTES_PER_PASS = 16 * 2**20


def store_reanalysed(buf: ReplayBuffer, ref: EpisodeRef, values: np.ndarray, policies: np.ndarray | None = None) -> bool:
    """Store fresh values for the T positions of ``ref``, or for all T + 1 rows (the
    final observation's value is what a truncated episode's targets bootstrap from), as
    ``reanalysed_value``, and, given ``policies`` (T, A), fresh policy targets for its T
    positions as ``reanalysed_policy``, if it is still the same episode (the buffer's
    generation rule); returns whether they were stored. Counted in the buffer's
    ``reanalysed_episodes`` or ``reanalysed_dropped``."""
    values = np.asarray(values, dtype=np.float32)
    if values.shape not in ((ref.rows - 1,), (ref.rows,)):
        raise ValueError(f"expected {ref.rows - 1} or {ref.rows} values for episode {ref.episode_id}, "
                         f"got {values.shape}")  # fmt: skip
    rows = {"reanalysed_value": values}
    if policies is not None:
        policies = np.asarray(policies, dtype=np.float32)
        if policies.shape[:1] != (ref.rows - 1,):
            raise ValueError(f"expected reanalysed policies for the {ref.rows - 1} positions of episode "
                             f"{ref.episode_id}, got shape {policies.shape}")  # fmt: skip
        rows["reanalysed_policy"] = policies
    return buf.rewrite_rows(ref, rows, counters=REANALYSE_COUNTERS)


class Reanalyser:
    """Recomputes ``reanalysed_value`` (and, for ``reanalyse.search_fraction`` of the
    episodes, ``reanalysed_policy``) for batches of stored episodes.

    Args:
        config: the run's :class:`~mpper.algos.muzero.config.MuZeroRunConfig` (network, stacking, batch size,
            search).
        buf: the replay buffer (attached or owned); needs a ``reanalysed_value`` field,
            and to search: ``to_play``, ``legal_actions`` and ``reanalysed_policy``.
        store: the weight store the learner publishes to.
        max_positions: positions per forward pass at most (fewer where their stacked
            observations would pass ``INPUT_BYTES_PER_PASS``: image episodes).
        max_search_positions: roots per batched search at most (bounds the trees'
            memory: hidden states of ``num_simulations + 1`` nodes per root; fewer
            for images, as for ``max_positions``).
        two_player: whether the env's players alternate (the search's sign rule); None:
            asked of one env made from ``config.env`` (only when searching).
        device: where the network runs its passes and searches; None: the learner's
            (``runtime.device``: "auto" is CUDA where torch sees it, else the CPU).
    """

    def __init__(self, config: MuZeroRunConfig, buf: ReplayBuffer, store: WeightSource, max_positions: int = 4096,
                 max_search_positions: int = 256, two_player: bool | None = None,
                 device: str | torch.device | None = None) -> None:  # fmt: skip
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
        obs_shape = tuple(buf.fields["observation"].shape[1:])
        channels = obs_shape[0] + self.num_stacked * (obs_shape[0] + 1)  # stacked_observations' layout
        row_bytes = 4 * channels * int(np.prod(obs_shape[1:], dtype=np.int64))
        self.positions_per_pass = max(1, min(int(max_positions), INPUT_BYTES_PER_PASS // row_bytes))
        self.roots_per_search = max(1, min(int(max_search_positions), INPUT_BYTES_PER_PASS // row_bytes))
        self.num_actions = int(buf.fields["child_visits"].shape[1])
        if device is None:
            device = "cuda" if config.runtime.device != "cpu" and torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.network = make_network(config.network, obs_shape, self.num_actions, self.num_stacked,
                                    lstm_horizon(config.muzero)).to(self.device)  # fmt: skip
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

    def _stacked_passes(self, episodes: list[dict], counts: list[int], per_pass: int):
        """The stacked observations of rows ``0 .. counts[j] - 1`` of each episode (its
        ``observation`` and ``action`` rows), in that order, ``per_pass`` rows at a
        time at most: (n, channels, ...) float32 arrays whose concatenation is all of
        them, built one pass at a time (an episode's stacks never exist whole)."""
        pieces, size = [], 0
        for rows, count in zip(episodes, counts):
            lo = 0
            while lo < count:
                hi = min(count, lo + per_pass - size)
                pos = np.arange(lo, hi)
                pieces.append(stacked_observations(rows["observation"], rows["action"], pos, pos,
                                                   self.num_stacked, self.num_actions))  # fmt: skip
                size, lo = size + hi - lo, hi
                if size == per_pass:
                    yield np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
                    pieces, size = [], 0
        if pieces:
            yield np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    @torch.inference_mode()
    def values(self, episodes: list[dict], counts: list[int]) -> np.ndarray:
        """The network's scalar values of rows ``0 .. counts[j] - 1`` of each episode,
        concatenated: float32 (sum(counts),)."""
        out = []
        for stacked in self._stacked_passes(episodes, counts, self.positions_per_pass):
            logits = self.network.initial_inference(torch.from_numpy(stacked).to(self.device)).value_logits
            out.append(support_to_scalar(logits, self.support_size).cpu().numpy())
        return np.concatenate(out).astype(np.float32, copy=False)

    def search_positions(self, episodes: list[dict], counts: list[int]):
        """One search per position ``0 .. counts[j] - 1`` of each episode (its
        ``observation``, ``action``, ``legal_actions`` and ``to_play`` rows) with the
        current weights, ``roots_per_search`` roots per batched search: (root values (N,)
        float32, policy targets (N, A) float32), N = sum(counts)."""
        legal = np.concatenate([rows["legal_actions"][:n] for rows, n in zip(episodes, counts)])
        to_play = np.concatenate([rows["to_play"][:n] for rows, n in zip(episodes, counts)])
        if self.search is None:
            raise RuntimeError("search_positions: no search (reanalyse.search_fraction is 0)")
        values: list[np.ndarray] = []
        policies: list[np.ndarray] = []
        lo = 0
        for stacked in self._stacked_passes(episodes, counts, self.roots_per_search):
            hi = lo + stacked.shape[0]
            result = self.search.run(self.network, stacked, legal[lo:hi], to_play[lo:hi], add_exploration_noise=True,
                                     rng=self.rng)  # fmt: skip
            values.append(result.root_values)
            policies.append(result.policy_target)
            lo = hi
        return np.concatenate(values).astype(np.float32), np.concatenate(policies).astype(np.float32)

    def step(self) -> tuple[int, int]:
        """Reanalyse one batch of episodes; returns (stored, dropped). Needs weights
        (``refresh_weights`` after the first publication); (0, 0) on an empty buffer."""
        if self.version < 1:
            raise RuntimeError("Reanalyser.step: no weights loaded yet (store.version is 0)")
        refs = self.buf.sample_episodes(self.batch_episodes, rng=self.rng)
        searching = self.rng.random(len(refs)) < self.search_fraction
        names = ("observation", "action") + (("to_play", "legal_actions") if searching.any() else ())
        kept, episodes, dropped, searched = [], [], 0, []
        for ref, search in zip(refs, searching):
            rows = self.buf.read_episode(ref, names=names)
            if rows is None:  # evicted before or during the read
                dropped += 1
                continue
            kept.append(ref)
            episodes.append(rows)
            searched.append(bool(search))
        stored = 0
        if kept:
            values = self.values(episodes, [ref.rows for ref in kept])  # every row, the final observation's included
            bounds = np.cumsum([0] + [ref.rows for ref in kept])
            policies = self._search_episodes(kept, episodes, searched, values, bounds)
            for ref, lo, hi, policy in zip(kept, bounds[:-1], bounds[1:], policies):
                if store_reanalysed(self.buf, ref, values[lo:hi], policy):
                    stored += 1
                    self.searched += policy is not None
                    self.positions_searched += 0 if policy is None else ref.rows - 1
                else:  # rewritten since it was read: generation rule
                    dropped += 1
        self.episodes += stored
        self.dropped += dropped
        return stored, dropped

    def _search_episodes(self, kept, episodes, searched, values, bounds) -> list:
        """Search the positions 0 .. T-1 of the episodes to search (together, in batched
        searches of ``roots_per_search``); their root values replace theirs in
        ``values``. Returns the policy targets (T, A) per kept episode, None for one not
        searched."""
        chosen = [j for j, search in enumerate(searched) if search]
        if not chosen:
            return [None] * len(kept)
        moves = [kept[j].rows - 1 for j in chosen]
        root_values, targets = self.search_positions([episodes[j] for j in chosen], moves)
        policies = [None] * len(kept)
        offsets = np.cumsum([0] + moves)
        for j, lo, hi in zip(chosen, offsets[:-1], offsets[1:]):
            values[bounds[j] : bounds[j] + (hi - lo)] = root_values[lo:hi]
            policies[j] = targets[lo:hi]
        return policies
