"""Judge a checkpoint on stored data: ``python run.py --evaluate RUN_DIR --on-snapshot SNAPSHOT_DIR``.

Where ``--evaluate`` plays new episodes, this runs the run's checkpoint over every
sampleable position of a buffer snapshot (opened memory-mapped and read-only, so a
snapshot larger than RAM still works) and compares its predictions with the targets
the learner would train on, built from the stored episodes by the same code
(``mpper.targets``). It answers "how well does this network fit this data", for
instance its own final buffer, or another run's.

The comparison depends on the algorithm, so it is a table of per-algorithm functions,
:data:`EVALUATORS`, keyed by ``config.algorithm``. Each gets a :class:`SnapshotRun`
(config, env facts, checkpoint, buffer, every position) and returns a dict with a
``"table"`` entry (a list of rows, each a dict of column -> value, printed as a table)
and whatever else it wants in ``snapshot_evaluation.json``. Adding an algorithm is one
function and one entry in that dict. The snapshot must hold the fields the run's buffer
stores (``mpper.schema.schema_for``), with the same shapes and dtypes.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .config import Config, ConfigError, load_run_config
from .envs import EnvSpec, env_spec
from .inspect_snapshot import load_snapshot
from .learner import CheckpointError, load_checkpoint, load_network_weights
from .networks import make_network, support_to_scalar
from .replay_buffer import ReplayBuffer
from .schema import Field, normalize_schema, schema_for
from .snapshot import SnapshotError
from .targets import MuZeroTargets, NStepTargets

__all__ = [
    "EVALUATORS",
    "Positions",
    "SnapshotMismatchError",
    "SnapshotRun",
    "evaluate_on_snapshot",
    "evaluate_snapshot_main",
    "format_table",
]

RESULT_NAME = "snapshot_evaluation.json"


class SnapshotMismatchError(ValueError):
    """The snapshot does not hold what the run's buffer stores (other fields or shapes),
    or the run's algorithm has no snapshot evaluation."""


# ---- every stored position -----------------------------------------------------------
@dataclass(frozen=True)
class Positions:
    """Sampleable positions, as ``ReplayBuffer.sample`` hands them to a target builder:
    each (N,) int64 / bool. ``slots``: ring slot; ``pos``: t, the position in its episode
    (0 .. T-1); ``moves``: the episode's T; ``terminated``: it ended by termination
    (False: cut by a time limit)."""

    slots: np.ndarray
    pos: np.ndarray
    moves: np.ndarray
    terminated: np.ndarray

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    def batches(self, size: int) -> Iterator[Positions]:
        """Consecutive slices of at most ``size`` positions (episode by episode, in order)."""
        for lo in range(0, len(self), size):
            sl = slice(lo, lo + size)
            yield Positions(self.slots[sl], self.pos[sl], self.moves[sl], self.terminated[sl])


def all_positions(buf: ReplayBuffer) -> Positions:
    """Every sampleable position of every published episode, oldest episode first.

    An episode of T moves starting at slot s has positions t = 0 .. T-1 in slots
    s .. s+T-1 (its last row, the final observation, is never a position).
    """
    refs = buf.episodes()
    moves = np.array([r.rows - 1 for r in refs], np.int64)
    starts = np.array([r.start for r in refs], np.int64)
    first = np.concatenate([[0], np.cumsum(moves)])  # index of each episode's position 0
    pos = np.arange(first[-1], dtype=np.int64) - np.repeat(first[:-1], moves)
    return Positions(np.repeat(starts, moves) + pos, pos, np.repeat(moves, moves),
                     np.repeat(np.array([r.terminated for r in refs], bool), moves))  # fmt: skip


# ---- what each algorithm gets and does --------------------------------------------------
@dataclass
class SnapshotRun:
    """Everything a per-algorithm evaluator needs.

    ``checkpoint``: the dict ``load_checkpoint`` returned (``"network"`` state dict on
    the CPU, ``"training_step"``, ...). ``buffer``: the snapshot, read-only. ``advance(n)``:
    call after each batch with the number of positions done (the progress bar).
    """

    config: Config
    spec: EnvSpec
    checkpoint: dict
    checkpoint_path: Path
    buffer: ReplayBuffer
    positions: Positions
    batch_size: int
    advance: Callable[[int], None]

    def load_weights(self, network: torch.nn.Module) -> torch.nn.Module:
        """``network`` with the checkpoint's weights, in eval mode; CheckpointError (one
        line) when they do not fit the network the run's config describes."""
        return load_network_weights(network, self.checkpoint["network"], self.checkpoint_path).eval()


def evaluate_muzero(run: SnapshotRun) -> dict:
    """MuZero: per unroll step k = 0..K, the mean over positions of

    - value error ``|v_k - z_k|``: the predicted scalar value (support -> scalar) against
      the n-step value target (reanalysed value where stored), in return units;
    - reward error ``|r_k - u_k|`` (k >= 1; step 0 predicts no reward), reward units;
    - policy KL ``KL(pi_k || p_k)`` and cross-entropy ``-sum pi_k log p_k`` (nats) of the
      predicted policy p against the stored visit distribution pi.

    Step k of position t looks at index i = t + k of the episode. Training also unrolls
    past the end (absorbing states with made-up targets: value 0, uniform policy); those
    are not stored data, so only i < T counts for value and policy, and i <= T for the
    reward (r_T, the last reward, is stored). ``positions`` per step says how many counted.
    """
    cfg, t = run.config, run.config.training
    K, num_actions = t.num_unroll_steps, run.spec.num_actions
    network = run.load_weights(make_network(cfg.network, run.spec.observation_shape, num_actions,
                                            t.stacked_observations))  # fmt: skip
    targets = MuZeroTargets(K, t.td_steps, cfg.mcts.discount, num_actions, t.stacked_observations)
    support = cfg.network.support_size
    rng = np.random.default_rng(0)  # actions past an episode's end; those steps are masked out
    steps = np.arange(K + 1)
    sums = {name: np.zeros(K + 1) for name in ("value_error", "reward_error", "policy_kl", "policy_cross_entropy")}
    state_count = np.zeros(K + 1, np.int64)
    reward_count = np.zeros(K + 1, np.int64)
    with torch.no_grad():
        for p in run.positions.batches(run.batch_size):
            d = targets.build(run.buffer.fields, p.slots, p.pos, p.moves, p.terminated, rng)
            index = p.pos[:, None] + steps  # (B, K+1) index in the episode
            has_state = index < p.moves[:, None]
            has_reward = (index <= p.moves[:, None]) & (steps > 0)
            state_count += has_state.sum(0)
            reward_count += has_reward.sum(0)
            actions = torch.from_numpy(d["actions"])
            out = network.initial_inference(torch.from_numpy(d["observation"]))
            for k in range(K + 1):
                if k > 0:
                    out = network.recurrent_inference(out.hidden_state, actions[:, k])
                    reward = support_to_scalar(out.reward_logits, support).numpy()
                    sums["reward_error"][k] += np.abs(reward - d["target_reward"][:, k])[has_reward[:, k]].sum()
                value = support_to_scalar(out.value_logits, support).numpy()
                sums["value_error"][k] += np.abs(value - d["target_value"][:, k])[has_state[:, k]].sum()
                target = torch.from_numpy(d["target_policy"][:, k])
                cross_entropy = -(target * torch.log_softmax(out.policy_logits, dim=1)).sum(1)
                kl = cross_entropy + torch.xlogy(target, target).sum(1)  # KL = CE - H(pi), 0 log 0 = 0
                sums["policy_cross_entropy"][k] += cross_entropy.numpy()[has_state[:, k]].sum()
                sums["policy_kl"][k] += kl.numpy()[has_state[:, k]].sum()
            run.advance(len(p))

    def mean(total: float, count: int) -> float | None:
        return float(total / count) if count else None

    def row(k, states: int, rewards: int, pick) -> dict:
        return {
            "k": k,
            "positions": int(states),  # counted for value and policy
            "value_error": mean(pick(sums["value_error"]), states),
            "reward_positions": int(rewards),
            "reward_error": mean(pick(sums["reward_error"]), rewards),
            "policy_kl": mean(pick(sums["policy_kl"]), states),
            "policy_cross_entropy": mean(pick(sums["policy_cross_entropy"]), states),
        }

    table = [row(k, state_count[k], reward_count[k], lambda a, k=k: a[k]) for k in range(K + 1)]
    overall = row("all", state_count.sum(), reward_count.sum(), np.sum)  # pooled over every counted step
    return {"num_unroll_steps": K, "per_step": table, "overall": overall, "table": [*table, overall]}


def evaluate_dqn(run: SnapshotRun) -> dict:
    """DQN: the distribution of n-step TD errors ``delta = Q(s_t, a_t) - (R + gamma^m *
    max_a Q(s_{t+m}, a) * (1 - done))`` over every stored transition, built by the
    learner's ``NStepTargets`` (n = dqn.n_step, gamma = dqn.gamma).

    The checkpoint's online network plays both roles (``best.pt`` holds no target
    network, and the online one is the agent being judged); with ``dqn.double`` that
    is the same as the max. Rows: all transitions, those that end the episode by
    termination (``done``: no bootstrap) and the rest; columns: count, mean and
    percentiles of ``|delta|`` (return units), mean ``delta`` (its sign says whether the
    network over- or under-estimates) and mean ``Q(s_t, a_t)``.
    """
    from .dqn import QNetwork

    cfg = run.config
    network = run.load_weights(QNetwork(run.spec.observation_shape, run.spec.num_actions,
                                        list(cfg.network.hidden), cfg.dqn.dueling))  # fmt: skip
    targets = NStepTargets(cfg.dqn.n_step, cfg.dqn.gamma)
    deltas, done, q_taken = [], [], []
    with torch.no_grad():
        for p in run.positions.batches(run.batch_size):
            d = targets.build(run.buffer.fields, p.slots, p.pos, p.moves, p.terminated, None)
            q = network(torch.from_numpy(d["observation"])).double()
            q_sa = q.gather(1, torch.from_numpy(d["action"]).long()[:, None]).squeeze(1).numpy()
            q_next = network(torch.from_numpy(d["next_observation"])).double().max(1).values.numpy()
            target = d["reward"] + d["discount"] * np.where(d["done"], 0.0, q_next)
            deltas.append(q_sa - target)
            done.append(d["done"])
            q_taken.append(q_sa)
            run.advance(len(p))
    delta = np.concatenate(deltas) if deltas else np.zeros(0)
    is_done = np.concatenate(done) if done else np.zeros(0, bool)
    q_all = np.concatenate(q_taken) if q_taken else np.zeros(0)

    def row(name: str, mask: np.ndarray) -> dict:
        a = np.abs(delta[mask])
        if a.size == 0:
            return {"transitions": name, "count": 0}
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return {"transitions": name, "count": int(a.size), "mean_abs_td": float(a.mean()), "p50": float(p50),
                "p90": float(p90), "p99": float(p99), "max": float(a.max()), "mean_td": float(delta[mask].mean()),
                "mean_q": float(q_all[mask].mean())}  # fmt: skip

    table = [row("all", np.ones(delta.shape, bool)), row("done", is_done), row("not done", ~is_done)]
    edges = np.concatenate([[0.0], np.logspace(-3, 3, 13)])
    hist = np.histogram(np.abs(delta), bins=np.append(edges, np.inf))[0]
    return {"n_step": cfg.dqn.n_step, "gamma": cfg.dqn.gamma, "table": table,
            "abs_td_histogram": {"edges": edges.tolist() + ["inf"], "counts": hist.tolist()}}  # fmt: skip


# Per-algorithm evaluation: config.algorithm -> function(SnapshotRun) -> dict with "table".
EVALUATORS: dict[str, Callable[[SnapshotRun], dict]] = {"muzero": evaluate_muzero, "dqn": evaluate_dqn}


# ---- the command ---------------------------------------------------------------------------
def check_schema(snapshot: Path, run_dir: Path, stored: tuple[Field, ...], expected: tuple[Field, ...]) -> None:
    """SnapshotMismatchError naming the snapshot, the run and each field that differs
    (name, shape or dtype; the fill value is not compared)."""
    have = {f.name: f for f in stored}
    want = {f.name: f for f in expected}
    problems = []
    for name, field in want.items():
        if name in have and (have[name].shape, have[name].dtype) != (field.shape, field.dtype):
            problems.append(f"{name} is {_describe(have[name])} there, the run stores {_describe(field)}")
    only_snapshot = [n for n in have if n not in want]
    only_run = [n for n in want if n not in have]
    if only_snapshot:
        problems.append(f"fields only in the snapshot: {', '.join(only_snapshot)}")
    if only_run:
        problems.append(f"fields the snapshot lacks: {', '.join(only_run)}")
    if problems:
        raise SnapshotMismatchError(f"snapshot {snapshot} does not match run {run_dir}: {'; '.join(problems)}")


def _describe(f: Field) -> str:
    return f"{tuple(f.shape)} {f.dtype}"


def evaluate_on_snapshot(run_dir: Path, snapshot_dir: Path, checkpoint: Path | None = None,
                         batch_size: int = 1024, overrides: Sequence[str] = ()) -> dict:  # fmt: skip
    """Run the checkpoint (default ``run_dir/checkpoint.pt``) over every position of the
    snapshot, in batches of ``batch_size`` positions; returns the report (also written to
    ``run_dir/snapshot_evaluation.json``, atomically).

    Raises ConfigError, FileNotFoundError / CheckpointError (checkpoint), SnapshotError
    (missing or corrupt snapshot), SnapshotMismatchError (schema, algorithm).
    """
    run_dir, snapshot_dir = Path(run_dir), Path(snapshot_dir)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    config = load_run_config(run_dir, overrides)  # names no code to import unless an override does
    evaluator = EVALUATORS.get(config.algorithm)
    if evaluator is None:
        raise SnapshotMismatchError(f"--on-snapshot: no snapshot evaluation for algorithm {config.algorithm!r} "
                                    f"(run {run_dir}) yet; there is one for: {', '.join(EVALUATORS)}")  # fmt: skip
    checkpoint = Path(checkpoint) if checkpoint is not None else run_dir / "checkpoint.pt"
    state = load_checkpoint(checkpoint)
    spec = env_spec(config.env)
    started = time.monotonic()
    with load_snapshot(snapshot_dir) as buf:
        expected = schema_for(config.algorithm, spec.observation_shape, spec.num_actions, spec.observation_dtype)
        check_schema(snapshot_dir, run_dir, buf.schema, normalize_schema(expected))
        positions = all_positions(buf)
        if len(positions) == 0:
            raise SnapshotMismatchError(f"snapshot {snapshot_dir} holds no sampleable position")
        with tqdm(total=len(positions), desc="evaluate on snapshot", unit="position",
                  disable=not sys.stderr.isatty()) as bar:  # fmt: skip
            run = SnapshotRun(config, spec, state, checkpoint, buf, positions, batch_size, bar.update)
            result = evaluator(run)
        episodes = len(buf.episodes())
    report = {
        "algorithm": config.algorithm,
        "run_dir": str(run_dir),
        "snapshot": str(snapshot_dir),
        "checkpoint": str(checkpoint),
        "training_step": int(state.get("training_step", -1)),
        "episodes": episodes,
        "positions": len(positions),
        "batch_size": batch_size,
        "seconds": round(time.monotonic() - started, 3),
        **result,
    }
    _write_json_atomic(run_dir / RESULT_NAME, report)
    return report


def _write_json_atomic(path: Path, data: dict) -> None:
    """A temp file in the same directory renamed over ``path``: never a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def format_table(rows: list[dict]) -> str:
    """Rows of dicts (same keys) as an aligned text table: numbers to 4 significant
    digits, None as '-'."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def evaluate_snapshot_main(run_dir: str, snapshot_dir: str, checkpoint: str | None,
                           overrides: Sequence[str] = ()) -> int:  # fmt: skip
    """``--evaluate RUN_DIR --on-snapshot SNAPSHOT_DIR``: the table, or one line
    ``error: ...`` on stderr and exit code 2 (nothing written)."""
    path = Path(run_dir)
    if not (path / "config.json").is_file():
        print(f"error: --evaluate {run_dir}: no run directory with a config.json there", file=sys.stderr)
        return 2
    try:
        report = evaluate_on_snapshot(path, Path(snapshot_dir), None if checkpoint is None else Path(checkpoint),
                                      overrides=overrides)  # fmt: skip
    except (ConfigError, CheckpointError, FileNotFoundError, SnapshotError, SnapshotMismatchError) as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    print(f"{report['algorithm']} checkpoint at training step {report['training_step']} on {report['snapshot']}: "
          f"{report['positions']:,} positions in {report['episodes']:,} episodes ({report['seconds']:.1f} s)")  # fmt: skip
    print(format_table(report["table"]))
    print(f"written: {path / RESULT_NAME}")
    return 0
