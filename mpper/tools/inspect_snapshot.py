"""What a buffer snapshot holds: ``python run.py --inspect SNAPSHOT_DIR [--json]``.

The snapshot is opened memory-mapped and read-only (``ReplayBuffer.load(mmap=True)``),
so a snapshot larger than RAM still opens; the statistics read the per-episode rows
and the priority leaves, not the observations.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from ..replay.buffer import COUNTERS, ReplayBuffer, load_snapshot

__all__ = ["format_stats", "inspect_main", "snapshot_stats"]


def _summary(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"count": 0}
    q = np.percentile(values, [0, 25, 50, 75, 100])
    return {"count": int(values.size), "mean": float(values.mean()), "std": float(values.std()),
            "min": float(q[0]), "p25": float(q[1]), "median": float(q[2]), "p75": float(q[3]),
            "max": float(q[4])}  # fmt: skip


def snapshot_stats(buf: ReplayBuffer) -> dict:
    """Schema, fill, counters, episode returns and lengths, data age, priorities, reanalyse."""
    episodes = buf.episodes()
    lengths = np.array([ref.rows - 1 for ref in episodes], dtype=np.int64)
    returns = np.array([float(buf.fields["reward"][ref.start + 1 : ref.start + ref.rows].sum())
                        for ref in episodes]) if "reward" in buf.fields else np.zeros(0)  # fmt: skip
    ids = np.array([ref.episode_id for ref in episodes], dtype=np.int64)
    positions = np.concatenate([np.arange(ref.start, ref.start + ref.rows - 1) for ref in episodes]) \
        if episodes else np.zeros(0, np.int64)  # fmt: skip
    leaves = buf.priorities(positions) if positions.size else np.zeros(0)
    total = float(leaves.sum())
    top = np.sort(leaves)[::-1][: max(1, int(np.ceil(0.01 * leaves.size)))] if leaves.size else leaves
    stats = {
        "schema": {f.name: {"shape": list(f.shape), "dtype": f.dtype.str} for f in buf.schema},
        "capacity": buf.capacity,
        "positions": len(buf),
        "fill": len(buf) / buf.capacity,
        "counters": buf.counters,
        "episodes": len(episodes),
        "episode_length": _summary(lengths.astype(float)),
        "episode_return": _summary(returns),
        "episode_ids": {"oldest": int(ids.min()), "newest": int(ids.max())} if ids.size else {},
        "priorities": {
            "alpha": buf.alpha,
            "leaf_min": float(leaves.min()) if leaves.size else None,
            "leaf_mean": float(leaves.mean()) if leaves.size else None,
            "leaf_max": float(leaves.max()) if leaves.size else None,
            "top_1_percent_mass_share": float(top.sum() / total) if total > 0 else None,
            # Kish's effective sample size of the sampling distribution: N when uniform
            "effective_sample_size": float(total**2 / np.square(leaves).sum()) if total > 0 else None,
        },
    }
    if "reanalysed_value" in buf.fields and positions.size:
        stats["reanalysed_share"] = float(np.isfinite(buf.fields["reanalysed_value"][positions]).mean())
    if "reanalysed_policy" in buf.fields and positions.size:
        searched = np.isfinite(buf.fields["reanalysed_policy"][positions]).all(axis=1)
        stats["reanalysed_policy_share"] = float(searched.mean())
    return stats


def format_stats(stats: dict) -> str:
    """The statistics as a few readable lines."""
    p, ln, ret = stats["priorities"], stats["episode_length"], stats["episode_return"]
    lines = [
        f"capacity {stats['capacity']:,} slots, {stats['positions']:,} sampleable positions ({stats['fill']:.1%} full)",
        f"episodes {stats['episodes']:,} (ids {stats['episode_ids'].get('oldest', '-')}"
        f"..{stats['episode_ids'].get('newest', '-')}), {stats['counters']['games']:,} stored in all, "
        f"steps {stats['counters']['steps']:,}",
        "schema: " + ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in stats["schema"].items()),
    ]
    if ln["count"]:
        lines.append(f"episode length: mean {ln['mean']:.1f}, median {ln['median']:.0f}, min {ln['min']:.0f}, "
                     f"max {ln['max']:.0f}")  # fmt: skip
        lines.append(f"episode return: mean {ret['mean']:.2f}, std {ret['std']:.2f}, min {ret['min']:.2f}, "
                     f"max {ret['max']:.2f}")  # fmt: skip
        lines.append(f"priorities (leaves, alpha {p['alpha']:g}): min {p['leaf_min']:.4g}, mean {p['leaf_mean']:.4g}, "
                     f"max {p['leaf_max']:.4g}; top 1 % holds {p['top_1_percent_mass_share']:.1%} of the mass; "
                     f"effective sample size {p['effective_sample_size']:,.0f}")  # fmt: skip
    if "reanalysed_share" in stats:
        lines.append(f"positions with a reanalysed value: {stats['reanalysed_share']:.1%}")
    if "reanalysed_policy_share" in stats:
        lines.append(f"positions with a reanalysed policy (searched again): {stats['reanalysed_policy_share']:.1%}")
    c = stats["counters"]
    line = (f"samples drawn {c['samples']:,}; priority updates applied {c['priority_updates_applied']:,}, "
            f"dropped {c['priority_updates_dropped']:,}")  # fmt: skip
    extra = [f"{name.replace('_', ' ')} {value:,}" for name, value in c.items() if name not in COUNTERS + ("positions",)]
    lines.append("; ".join([line, *extra]))
    return "\n".join(lines)


def inspect_main(path: str, as_json: bool) -> int:
    """``--inspect``: print the statistics (or JSON); errors as one line, exit code 2."""
    from ..replay.snapshot import SnapshotError

    try:
        with load_snapshot(path) as buf:
            stats = snapshot_stats(buf)
    except SnapshotError as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=1) if as_json else format_stats(stats))
    return 0
