"""The replay buffer's compiled hot path: one call per sample draw, seqlock check and
priority update instead of some twenty numpy calls each.

The kernels read the slot records (``_generation``, ``_info``) and the sum tree of a
``ReplayBuffer`` (see its module docstring for the rules they follow). Compiled on
first use in a process (cached on disk), or up front by ``warm_kernels``.

``locked_update`` is a whole priority update in one call: it takes the buffer's robust
mutex itself (``pthread_mutex_trylock`` called from the compiled code, through the
addresses of ``RobustLock.kernel_calls``), journals, applies, counts and unlocks, so an
uncontended update pays no Python-level lock call at all. When the mutex is held it
returns at once having done nothing, and the caller takes the lock the slow way.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .. import shm as shm_mod
from .episode_ring import J_EPISODE, J_OP, JOURNAL_FIELDS, OP_NONE, OP_PRIORITIES, sampleable, unsampleable, write_info
from .layout import COUNTER_SLOTS, COUNTERS, record_dtype
from .sum_tree import SumTree, descend, set_leaves

__all__ = ["apply_update", "check_update", "draw_kernel", "empty_draw", "find_torn", "locked_update", "tear_update",
           "warm_kernels"]  # fmt: skip

_APPLIED, _DROPPED = COUNTERS.index("priority_updates_applied"), COUNTERS.index("priority_updates_dropped")
# kernel_calls entries: the mutex's address, then pthread_mutex_trylock's and pthread_mutex_unlock's
_MUTEX, _TRYLOCK, _UNLOCK = 0, 1, 2


@intrinsic
def _call_c(typingctx, function, argument):
    """``int function(void *argument)``, both given as addresses (int64)."""

    def codegen(context, builder, signature, args):
        address, arg = args
        pointer = ir.IntType(8).as_pointer()
        fn = builder.inttoptr(address, ir.FunctionType(ir.IntType(32), [pointer]).as_pointer())
        return builder.call(fn, [builder.inttoptr(arg, pointer)])

    return types.int32(types.int64, types.int64), codegen


@intrinsic
def _compiler_fence(typingctx):
    """Keep the compiler from moving memory writes across this point (a journal entry
    must be in memory before the first write it covers: a SIGKILL stops the process
    between any two instructions)."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst", "singlethread")
        return context.get_dummy_value()

    return types.none(), codegen


@numba.njit(cache=True, nogil=True)
def draw_kernel(tree, leaf_base, u, generation, info_of, out_slot, out_gen, out_info, out_prob, out_pos,
                 out_moves, out_term):  # fmt: skip
    """Stratified descent for B uniforms; per drawn slot its generation, packed info,
    P(i) and the unpacked position, T and termination. Runs without the lock, so a
    writer may change the tree meanwhile: returns the number of rows that turned out
    not sampleable (odd generation or a 0 leaf), which are marked with out_gen = -1 and
    drawn again by the caller. The caller re-checks generation and info after gathering."""
    total = tree[1]
    batch = u.shape[0]
    targets = np.empty(batch)
    for j in range(batch):
        targets[j] = (j + u[j]) * (total / batch)
    descend(tree, leaf_base, targets, out_slot)
    rejected = 0
    for j in range(batch):
        s = out_slot[j]
        g = generation[s]
        info = info_of[s]
        leaf = tree[leaf_base + s]
        out_info[j] = info
        out_pos[j] = info >> 32
        out_moves[j] = (info & 0xFFFFFFFF) >> 2
        out_term[j] = (info & 2) != 0
        out_prob[j] = leaf / total
        if (g & 1) or not leaf > 0.0:
            g = -1
            rejected += 1
        out_gen[j] = g
    return rejected


@numba.njit(cache=True, nogil=True)
def find_torn(generation, info_of, drawn, gen, info):
    """Rows whose slot's generation or info changed since they were drawn."""
    torn = np.empty(drawn.shape[0], np.int64)
    n = 0
    for j in range(drawn.shape[0]):
        s = drawn[j]
        if generation[s] != gen[j] or info_of[s] != info[j]:
            torn[n] = j
            n += 1
    return torn[:n]


@numba.njit(cache=True, nogil=True)
def check_update(capacity, indices, priorities):
    """-1 if all indices are in range and priorities (n, m) finite and >= 0, else the
    first bad row (checked before anything is written)."""
    for j in range(indices.shape[0]):
        if indices[j] < 0 or indices[j] >= capacity:
            return j
        for k in range(priorities.shape[1]):
            p = priorities[j, k]
            if not (p >= 0.0 and p < np.inf):
                return j
    return -1


@numba.njit(cache=True, nogil=True)
def apply_update(tree, leaf_base, generation, info_of, indices, gens, priorities, eps, clip, alpha):
    """For each sampled slot s whose generation is unchanged (published, not rewritten
    since: every slot of an episode changes generation together, so the whole episode is
    the same) and that is a position t of an episode of T moves, write
    ``min(p + eps, clip) ** alpha`` of ``priorities[j, k]`` (n, m) to slot s + k for
    each k < m with t + k < T (the positions that follow in the same episode; m = 1:
    the sampled position alone). Returns (rows applied, max p written)."""
    n, m = priorities.shape
    live_idx = np.empty(n * m, np.int64)
    live_leaf = np.empty(n * m)
    applied = 0
    written = 0
    top = 0.0
    for j in range(n):
        s = indices[j]
        info = info_of[s]
        t = info >> 32
        big_t = (info & 0xFFFFFFFF) >> 2
        if generation[s] == gens[j] and (gens[j] & 1) == 0 and t < big_t:
            applied += 1
            for k in range(min(m, big_t - t)):
                p = priorities[j, k]
                live_idx[written] = s + k
                live_leaf[written] = min(p + eps, clip) ** alpha
                written += 1
                top = max(top, p)
    set_leaves(tree, leaf_base, live_idx[:written], live_leaf[:written])
    return applied, top


@numba.njit(cache=True, nogil=True)
def locked_update(calls, pid, holder, journal, counters, max_priority, capacity, tree, leaf_base, generation,
                  info_of, indices, gens, priorities, eps, clip, alpha):  # fmt: skip
    """``update_priorities`` with the lock taken here. First ``check_update``: on a bad
    row, returns (that row, 0, 0) having done nothing. Then trylock; if it returns 0,
    record this process as the holder (``holder[0] = pid``), mark the journal,
    ``apply_update``, raise ``max_priority[0]`` to the largest raw priority written, count
    the rows applied and dropped, close the journal and unlock: returns (-1, 0, rows
    applied). When the trylock returns a nonzero code it does nothing and returns (-1,
    code, 0): ``EBUSY``, the mutex is held; ``EOWNERDEAD``, it is now held by this
    thread, its dead holder's damage not yet repaired (the caller repairs and updates
    with the lock it holds). (-1, -code, 0): the unlock failed."""
    bad = check_update(capacity, indices, priorities)
    if bad >= 0:
        return bad, 0, 0
    rc = _call_c(calls[_TRYLOCK], calls[_MUTEX])
    if rc != 0:
        return -1, rc, 0
    holder[0] = pid
    journal[J_EPISODE] = -1
    journal[J_OP] = OP_PRIORITIES
    _compiler_fence()
    applied, top = apply_update(tree, leaf_base, generation, info_of, indices, gens, priorities, eps, clip, alpha)
    if top > max_priority[0]:
        max_priority[0] = top
    counters[_APPLIED] += applied
    counters[_DROPPED] += indices.shape[0] - applied
    _compiler_fence()
    journal[J_OP] = OP_NONE
    holder[0] = 0
    rc = _call_c(calls[_UNLOCK], calls[_MUTEX])
    if rc != 0:
        return -1, -rc, 0
    return -1, 0, applied


def tear_update(tree: SumTree, generation, info_of, indices, gens) -> None:
    """Test-only: what ``apply_update`` leaves when killed half-way: the first half of
    the leaves it would write, written, and none of their ancestors."""
    t, moves = info_of[indices] >> 32, (info_of[indices] & 0xFFFFFFFF) >> 2
    live = indices[(generation[indices] == gens) & (gens % 2 == 0) & (t < moves)]
    tree.tree[tree._leaf_base + live[: max(1, live.size // 2)]] = 1e3


def empty_draw(n: int) -> tuple[np.ndarray, ...]:
    """Output arrays of draw_kernel: slot, generation, info, P(i), position, T, terminated."""
    i64 = np.empty((5, n), np.int64)
    return i64[0], i64[1], i64[2], np.empty(n), i64[3], i64[4], np.empty(n, np.bool_)


_warm = False


def warm_kernels() -> None:
    """Load the compiled kernels that run under the shared lock once per process, on
    tiny arrays and outside the lock: the first call of a numba function in a process
    loads it from numba's cache (the very first also starts numba's compiler), which
    takes long enough that under the lock it would stall every other process. Called by
    the methods that run them (a no-op after the first call), so that a process that
    never writes (the supervisor) never loads them, and by the forkserver for every
    child (``mpper.runtime.preload``)."""
    global _warm
    if _warm:
        return
    tree = SumTree(4)
    tree.set_range(0, np.ones(3))
    tree.set(np.arange(2), np.ones(2))
    records = np.zeros(4, record_dtype(()))  # strided views, like the shared ones
    gen, info = records["_generation"], records["_info"]
    one = np.zeros(1, np.int64)
    draw_kernel(tree.tree, tree._leaf_base, np.zeros(1), gen, info, one, one.copy(), one.copy(), np.zeros(1),
                 one.copy(), one.copy(), np.zeros(1, np.bool_))  # fmt: skip
    find_torn(gen, info, one, one, one)
    apply_update(tree.tree, tree._leaf_base, gen, info, one, one, np.zeros((1, 1)), 0.0, np.inf, 1.0)
    region = np.zeros(shm_mod.RobustLock.SIZE, np.uint8)  # a mutex of this process alone, for the signature
    shm_mod.RobustLock.initialize(region)
    calls, holder = shm_mod.RobustLock(region).kernel_calls()
    _, rc, _ = locked_update(calls, shm_mod.PID, holder, np.zeros(JOURNAL_FIELDS, np.int64),
                             np.zeros(COUNTER_SLOTS, np.int64), np.zeros(1), 4, tree.tree, tree._leaf_base, gen, info,
                             one, one, np.zeros((1, 1)), 0.0, np.inf, 1.0)  # fmt: skip
    assert rc == 0, rc
    check_update(4, one, np.zeros((1, 1)))
    unsampleable(gen, 0, 2)
    sampleable(gen, 0, 2)
    write_info(info, 0, 2, True)
    _warm = True


