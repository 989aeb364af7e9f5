"""Judge a saved agent: ``python run.py --evaluate RUN_DIR [--episodes N] [--checkpoint FILE] [--seed S]``.

Loads the run's ``config.json`` and checkpoint (``torch.load(weights_only=True)``),
plays N greedy episodes (search without noise, most visited action; all N envs searched
together) with a progress bar, prints mean, std, min and max of return and length, and
writes ``evaluation.json`` into the run directory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .config import ConfigError, load_config
from .envs import env_spec, make_env
from .learner import CheckpointError, load_checkpoint
from .networks import make_model
from .selfplay import play_greedy

__all__ = ["evaluate_run", "evaluate_main"]


def evaluate_run(run_dir: Path, episodes: int = 10, checkpoint: Path | None = None, seed: int = 0) -> dict:
    """Play ``episodes`` greedy episodes with the run's checkpoint; returns the statistics
    (also written to ``run_dir/evaluation.json``)."""
    config = load_config(run_dir / "config.json")
    checkpoint = checkpoint or run_dir / "checkpoint.pt"
    state = load_checkpoint(checkpoint)
    spec = env_spec(config.env)
    network = make_model(config, spec.observation_shape, spec.num_actions)
    network.load_state_dict(state["network"])
    network.eval()
    envs = [make_env(config.env) for _ in range(episodes)]
    started = time.monotonic()
    with tqdm(total=episodes, desc="evaluate", unit="episode", disable=not sys.stderr.isatty()) as bar:
        played = play_greedy(config, envs, network, seed, on_episode=lambda ep: bar.update(1))
    returns = np.array([ep.total_reward for ep in played])
    lengths = np.array([ep.moves for ep in played])
    stats = {
        "checkpoint": str(checkpoint),
        "training_step": int(state["training_step"]),
        "episodes": episodes,
        "seed": seed,
        "seconds": round(time.monotonic() - started, 3),
        "return": _describe(returns),
        "length": _describe(lengths),
        "returns": returns.tolist(),
    }
    (run_dir / "evaluation.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


def _describe(x: np.ndarray) -> dict:
    return {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()), "max": float(x.max())}


def evaluate_main(run_dir: str, episodes: int, checkpoint: str | None, seed: int) -> int:
    """``--evaluate``: clear one-line errors (exit code 2) for a missing or broken run."""
    path = Path(run_dir)
    if not (path / "config.json").is_file():
        print(f"error: --evaluate {run_dir}: no run directory with a config.json there", file=sys.stderr)
        return 2
    try:
        stats = evaluate_run(path, episodes, None if checkpoint is None else Path(checkpoint), seed)
    except (ConfigError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    r, ln = stats["return"], stats["length"]
    print(f"{episodes} greedy episodes, checkpoint at training step {stats['training_step']}:")
    print(f"  return: mean {r['mean']:.2f}, std {r['std']:.2f}, min {r['min']:.2f}, max {r['max']:.2f}")
    print(f"  length: mean {ln['mean']:.1f}, std {ln['std']:.1f}, min {ln['min']:.0f}, max {ln['max']:.0f}")
    print(f"written: {path / 'evaluation.json'}")
    return 0
