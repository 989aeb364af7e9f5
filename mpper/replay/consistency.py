"""What a consistent buffer is, checked (``problems``) and partly restored (``restore_leaves``).

A buffer is consistent when:

- every resident episode (ids ``HEAD_ID .. NEXT_ID - 1``) has its own table row, lies
  inside the ring, and is FREE (a hole), RESERVED or PUBLISHED;
- a published episode's slots all have even generations and its own packed info, and
  its final row's leaf is 0 (a final observation is never a sampled position);
- a reserved episode's slots all have odd generations;
- every leaf outside the positions of published episodes is 0 (nothing else can be drawn);
- every internal node of the sum tree is exactly the sum of its two children;
- ``NUM_POSITIONS`` equals the positions of the published episodes.

The buffer's repair after a lock holder's death (``ReplayBuffer._repair``) ends in this
state; the tests check it with ``problems``. Call both with the buffer's lock held.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from .episode_ring import (
    FREE,
    HEAD_ID,
    ID,
    J_EPISODE,
    J_OP,
    NEXT_ID,
    NUM_POSITIONS,
    OP_NAMES,
    PUBLISHED,
    RESERVED,
    ROWS,
    START,
    STATE,
    TERMINATED,
    pack_info,
)

__all__ = ["problems", "repair", "repair_after_death", "repair_after_error", "restore_leaves", "sampleable_mask"]


def sampleable_mask(buf) -> np.ndarray:
    """(capacity,) bool: the slots that are positions (not final rows) of published episodes."""
    mask = np.zeros(buf.capacity, np.bool_)
    table, ring = buf._episodes, buf._ring_state
    for episode_id in range(int(ring[HEAD_ID]), int(ring[NEXT_ID])):
        row = table[episode_id % table.shape[0]]
        if row[STATE] == PUBLISHED and 0 <= row[START] and 2 <= row[ROWS] and row[START] + row[ROWS] <= buf.capacity:
            mask[row[START] : row[START] + row[ROWS] - 1] = True
    return mask


def restore_leaves(buf) -> list[str]:
    """Zero the leaves outside published positions; returns what it did (nothing: [])."""
    leaves = buf._tree.leaves
    stray = np.flatnonzero(~sampleable_mask(buf) & (leaves != 0))
    if stray.size == 0:
        return []
    leaves[stray] = 0.0
    return [f"{stray.size} stray leaves zeroed"]


def problems(buf) -> list[str]:
    """Every way the buffer departs from the rules of the module docstring (empty: none)."""
    out = []
    table, ring, cap = buf._episodes, buf._ring_state, buf.capacity
    gen, info = buf._generation, buf._info
    head, nxt = int(ring[HEAD_ID]), int(ring[NEXT_ID])
    if not 0 <= nxt - head <= table.shape[0]:
        return [f"ring: {nxt - head} resident episodes for a table of {table.shape[0]} rows"]
    positions = 0
    for episode_id in range(head, nxt):
        row = table[episode_id % table.shape[0]]
        start, rows, state = int(row[START]), int(row[ROWS]), int(row[STATE])
        name = f"episode {episode_id}"
        if row[ID] != episode_id:
            out.append(f"{name}: its table row holds episode {int(row[ID])}")
            continue
        if not (0 <= start and 2 <= rows and start + rows <= cap):
            out.append(f"{name}: slots {start}..{start + rows - 1} outside the ring of {cap}")
            continue
        g = gen[start : start + rows]
        if state == PUBLISHED:
            positions += rows - 1
            if (g & 1).any():
                out.append(f"{name}: published with odd generations (unsampleable slots)")
            if not np.array_equal(info[start : start + rows], pack_info(rows, bool(row[TERMINATED]))):
                out.append(f"{name}: slot info does not match its table row")
            if buf._tree.leaves[start + rows - 1] != 0:
                out.append(f"{name}: its final row has a priority")
        elif state == RESERVED:
            if not (g & 1).all():
                out.append(f"{name}: reserved with even generations (sampleable before publication)")
        elif state != FREE:
            out.append(f"{name}: unknown state {state}")
    stray = np.flatnonzero(~sampleable_mask(buf) & (buf._tree.leaves != 0))
    if stray.size:
        out.append(f"{stray.size} leaves outside published positions are not 0 (first: slot {int(stray[0])})")
    tree, base = buf._tree.tree, buf._tree._leaf_base
    nodes = np.arange(1, base)
    wrong = nodes[tree[nodes] != tree[2 * nodes] + tree[2 * nodes + 1]]
    if wrong.size:
        out.append(f"sum tree: {wrong.size} internal nodes are not the sum of their children (first: node {wrong[0]})")
    if int(ring[NUM_POSITIONS]) != positions:
        out.append(f"NUM_POSITIONS is {int(ring[NUM_POSITIONS])}, the published episodes hold {positions}")
    return out


def repair(buf) -> tuple[str, str]:
    """Repair ``buf`` from its ring's journal (lock held; see ``EpisodeRing.repair``), zero
    stray leaves and rebuild the sum tree from its leaves. Returns (what the lock holder
    was doing, what was repaired), as phrases for the one line the buffer prints."""
    journal = buf._ring.journal
    op, episode_id = int(journal[J_OP]), int(journal[J_EPISODE])
    if op in OP_NAMES:
        doing = f"while {OP_NAMES[op]}" + (f" {episode_id}" if "episode" in OP_NAMES[op] else "")
    else:
        doing = "while reading"
    done = buf._ring.repair()
    done += restore_leaves(buf)
    buf._tree.rebuild()
    return doing, "; ".join(done + ["sum tree rebuilt from its leaves"])


def repair_after_death(buf, dead_pid: int) -> None:
    """``repair``, called with the lock held when its previous holder died holding it,
    and the one line on stderr that says so."""
    doing, done = repair(buf)
    who = f"process {dead_pid}" if dead_pid > 0 else "a process"
    print(f"mpper: {who} died holding the replay buffer's lock ({doing}); process {os.getpid()} repaired it: "
          f"{done}", file=sys.stderr, flush=True)  # fmt: skip


def repair_after_error(buf) -> None:
    """An exception left a critical section of this process half-way (its journal entry
    still open): finish it as a dead holder's would be, before the lock goes."""
    if buf._ring is not None and buf._ring.journal[J_OP] != 0:
        doing, done = repair(buf)
        print(f"mpper: an error stopped process {os.getpid()} inside the replay buffer's lock ({doing}); "
              f"repaired: {done}", file=sys.stderr, flush=True)  # fmt: skip
