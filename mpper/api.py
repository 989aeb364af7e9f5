"""The Python API: train a run, read it, and act with what it learned.

    import mpper

    if __name__ == "__main__":  # the run's child processes import this script again
        run = mpper.train("cartpole", workers=2, time_limit=240, run_dir="runs/cp")
        print(run.solved, run.solved_at, run.best)
        agent = run.agent()  # best.pt, the weights of the run's best evaluation
        action = agent.act(observation)

:func:`train` takes the path the command line takes (:func:`mpper.launch.launch`): the
same checks, the same run-directory lock, the same runtime; a run that cannot start
raises :class:`~mpper.config.ConfigError` or :class:`~mpper.launch.LaunchError` (both
``ValueError``) with the line ``python run.py`` would print after ``error:``.
:func:`load` builds the run's network and its algorithm's greedy player, the ones the
evaluator and ``--evaluate`` play with (MuZero: search without noise, most visited
action; DQN: argmax Q).
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .config import Config
from .launch import launch

__all__ = ["Agent", "TrainedRun", "load", "train"]

Overrides = Mapping[str, Any] | Iterable[str]


def train(config: str | Path | Mapping[str, Any], *, overrides: Overrides = (), workers: int | None = None,
          device: str | None = None, seed: int | None = None, run_dir: str | Path | None = None,
          resume: str | Path | None = None, time_limit: float | None = None, max_train_steps: int | None = None,
          env_steps: int | None = None, ray_address: str | None = None,
          offline: Sequence[str | Path] | None = None) -> TrainedRun:  # fmt: skip
    """Train as ``python run.py`` does, in this process and its children; returns the
    finished run.

    ``config``: a JSON file, a shipped config's name (``"cartpole"``) or a dict of a
    config file's content. ``overrides``: config keys, ``{"training.batch_size": 64}``
    (or ``--set`` strings, ``["training.batch_size=64"]``), checked like the file. The
    keyword arguments are the command line's flags: ``workers`` (``--workers``; 0: one
    process), ``device``, ``seed``, ``run_dir`` (default ``runs/<config-name>/<timestamp>/``),
    ``resume`` (a run directory to continue), ``time_limit`` (seconds),
    ``max_train_steps``, ``env_steps`` (a budget in env steps), ``ray_address``; None keeps
    the config's value. ``offline``: snapshot directories to learn from with no self-play
    (``--offline``, docs/offline.md).

    With ``workers`` > 0 the run's child processes import the ``__main__`` script again
    (multiprocessing's forkserver does so to find what it pickles): a call at a script's
    top level, outside ``if __name__ == "__main__":``, is refused before anything starts,
    with one line on stderr saying what to add, and ``SystemExit(2)``.

    Raises ConfigError or LaunchError (ValueError, one line) for a run that cannot start
    (a bad config, a run directory another live run holds or that holds a finished run,
    a run that does not fit this machine), KeyboardInterrupt for a run stopped by Ctrl-C,
    and RuntimeError for a run that failed (its output says why).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A child process importing the user's script (multiprocessing's own flag for it),
        # which calls train() at its top level: a call the check below could not see.
        raise RuntimeError(f"mpper.train: called while a child process imports the script again: {_GUARD_HELP}")
    caller = _unguarded_call()

    def refuse_unguarded(checked: Config) -> None:
        if caller is not None and checked.runtime.workers > 0:
            # The script cannot go on: each child would run it again. One line, as the
            # command line says a mistake, and the exit code of one (2).
            print(f"error: mpper.train: called at the top level of {caller}, which each of the run's child "
                  f"processes imports again: {_GUARD_HELP}", file=sys.stderr)  # fmt: skip
            raise SystemExit(2)

    code, where = launch(dict(config) if isinstance(config, Mapping) else config, _set_strings(overrides),
                         run_dir=run_dir, resume=resume, workers=workers, device=device, seed=seed,
                         training_steps=max_train_steps, env_steps=env_steps, time_limit_s=time_limit,
                         ray_address=ray_address, offline=offline,
                         check=refuse_unguarded)  # fmt: skip
    if code == 130:
        raise KeyboardInterrupt
    if code != 0:
        raise RuntimeError(f"mpper.train: the run in {where} failed (exit code {code}); its last lines say why")
    return TrainedRun(where)


_GUARD_HELP = 'put the call under `if __name__ == "__main__":` (or train with workers=0)'


def _unguarded_call() -> str | None:
    """``path:line`` of the ``__main__`` script's top-level statement that led to this
    call when that statement is not inside ``if __name__ == "__main__":``; None when it
    is, or when there is no script file (``python -c``, a REPL, a notebook: children
    import nothing again)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None  # nothing to tell from: let the run go
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
                return None
    return f"{path}:{line}"


def _is_main_test(test: ast.expr) -> bool:
    """Whether an ``if`` test compares ``__name__`` with ``"__main__"`` (either way round,
    possibly inside an ``and``)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_test(v) for v in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return bool(names and consts)


def _set_strings(overrides: Overrides) -> list[str]:
    """``{"training.batch_size": 64}`` as ``--set`` strings (values as JSON); strings pass as they are."""
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    return list(overrides)


class TrainedRun:
    """A run directory, read: ``python run.py``'s runs as well as :func:`train`'s.

    ``dir``: the directory. ``config``: its ``config.json`` (a dict). ``metrics``: every
    record of ``metrics.jsonl`` (dicts; ``event`` is "progress", "evaluation" or "end", and in a lockstep
    run "train_step", one per training step with its losses).
    ``evaluations``: each evaluation with the run's ``time_s`` and ``env_steps`` at the
    time. ``solved`` / ``solved_at``: whether an evaluation reached
    ``runtime.solve_return``, and the first that did. ``best``: what ``best.pt`` holds.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        if not (self.dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.dir}: no run directory with a config.json there")

    def __repr__(self) -> str:
        return f"TrainedRun({str(self.dir)!r})"

    @property
    def config(self) -> dict:
        return json.loads((self.dir / "config.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        if not path.is_file():
            return []
        lines = path.read_text().split("\n")
        return [json.loads(line) for line in lines[:-1] if line]  # a last partial line is still being written

    @property
    def evaluations(self) -> list[dict]:
        return [{**r["evaluation"], "time_s": r["time_s"], "env_steps": r["env_steps"]}
                for r in self.metrics if r["event"] == "evaluation" and r.get("evaluation")]  # fmt: skip

    @property
    def solved_at(self) -> dict | None:
        """The first evaluation whose mean return reached ``runtime.solve_return`` (its
        ``training_step``, ``mean_return``, ``time_s``, ``env_steps``...), or None."""
        solve = self.config["runtime"].get("solve_return")
        if solve is None:
            return None
        return next((e for e in self.evaluations if e.get("mean_return", -np.inf) >= solve), None)

    @property
    def solved(self) -> bool:
        return self.solved_at is not None

    @property
    def best(self) -> dict | None:
        """``best.pt``: ``{"path", "training_step", "mean_return"}``, or None if the run has none."""
        import torch

        path = self.dir / "best.pt"
        if not path.is_file():
            return None
        state = torch.load(path, map_location="cpu", weights_only=True)
        return {"path": path, "training_step": int(state["training_step"]),
                "mean_return": float(state["extra"]["mean_return"])}  # fmt: skip

    def agent(self, weights: str = "best", overrides: Overrides = ()) -> Agent:
        """:func:`load` of this run: ``weights`` "best" (``best.pt``, else ``checkpoint.pt``)
        or "last" (``checkpoint.pt``)."""
        if weights not in ("best", "last"):
            raise ValueError(f'weights: expected "best" or "last", got {weights!r}')
        return load(self.dir if weights == "best" else self.dir / "checkpoint.pt", overrides)


class Agent:
    """A run's network with its algorithm's greedy player: ``act(observation)``.

    ``checkpoint``: the file the weights came from; ``training_step``: their learner step;
    ``mean_return``: the evaluation ``best.pt`` scored (None for ``checkpoint.pt``);
    ``config``: the run's :class:`~mpper.config.Config`; ``observation_shape``,
    ``num_actions``: the env's; ``network``: the torch module (CPU, eval mode).
    ``sees_past``: the network also sees past observations (``muzero.stacked_observations``,
    ``dqn.frame_stack``): the agent then keeps the episode's observations and its own
    actions, takes one observation at a time, and needs ``reset()`` when an episode starts.

    ``act`` runs the network on ``runtime.torch_threads`` torch threads, as the run's
    evaluator does (1 unless the config or ``load``'s overrides say otherwise), and puts the
    caller's thread count back after it.
    """

    def __init__(self, config: Config, checkpoint: Path, seed: int = 0) -> None:
        from .algos.registry import algorithm_of
        from .checkpoint import load_checkpoint
        from .envs.spec import env_spec, make_env
        from .tools.evaluate import load_network

        state = load_checkpoint(checkpoint)
        spec = env_spec(config.env)
        self.config = config
        self.checkpoint = Path(checkpoint)
        self.training_step = int(state["training_step"])
        mean = (state.get("extra") or {}).get("mean_return")
        self.mean_return = None if mean is None else float(mean)
        self.observation_shape = tuple(spec.observation_shape)
        self.num_actions = int(spec.num_actions)
        self.continuous_actions = spec.continuous_actions  # act() returns float action vectors
        self.network = load_network(config, spec, state, self.checkpoint)
        env = make_env(config.env)  # the player reads the action space from it; act() never steps it
        try:
            self._player = algorithm_of(config).make_player(config, [env], self.network, explore=False, seed=seed)
        finally:
            env.close()
        stacked = getattr(getattr(config, "muzero", None), "stacked_observations", 0) or 0
        frames = getattr(getattr(config, "dqn", None), "frame_stack", 1) or 1
        self.sees_past = stacked > 0 or frames > 1
        self._episode: Any = None  # with sees_past: this episode's observations and actions so far (EpisodeRows)

    def __repr__(self) -> str:
        return f"Agent({self.config.algorithm}, {str(self.checkpoint)!r}, training step {self.training_step})"

    def act(self, observation, action_mask=None, to_play=None):
        """The greedy action for one observation (an int), or for a batch (N, *shape) of
        them (an (N,) int64 array); for a continuous (Box) action space, a float32 action
        vector of the Box's shape, or (N, *action shape). ``action_mask``: the legal actions, (A,) or (N, A)
        bool, when the env gives one (``info["action_mask"]``); ``to_play``: the player to
        move in a two-player game (0 or 1). ValueError for an observation of another shape."""
        from .algos.base import as_stored
        from .runtime.procs import torch_configured

        obs = as_stored(observation)
        single = obs.shape == self.observation_shape
        if not single and obs.shape[1:] != self.observation_shape:
            raise ValueError(f"act(): expected an observation of shape {self.observation_shape} or a batch "
                             f"(N, {', '.join(map(str, self.observation_shape))}), got shape {obs.shape}")  # fmt: skip
        if self.sees_past:
            if not single:
                raise ValueError("act(): this run's network also sees past observations (muzero.stacked_observations "
                                 "or dqn.frame_stack): give one observation at a time, and reset() at each new episode")
            batch = self._network_input(obs)[None]
        else:
            batch = obs[None] if single else obs
        legal = None if action_mask is None else np.asarray(action_mask, bool).reshape(len(batch), self.num_actions)
        players = None if to_play is None else np.broadcast_to(np.asarray(to_play, np.int64), (len(batch),))
        with torch_configured(self.config.runtime.torch_threads):  # as the run's evaluator plays
            actions = self._player.greedy_actions(batch, legal, players)
        if self.sees_past:
            self._episode.action.append(int(actions[0]))  # the action that leads to the next observation
        if self.continuous_actions:  # float action vectors in the env's Box
            return np.asarray(actions[0] if single else actions, np.float32)
        return int(actions[0]) if single else np.asarray(actions, np.int64)

    def reset(self) -> None:
        """Start a new episode: the next ``act`` sees no past observations. (Only a
        network that sees past ones, ``sees_past``, keeps any.)"""
        self._episode = None

    def _network_input(self, observation: np.ndarray) -> np.ndarray:
        """``observation`` appended to this episode, and what the network sees there,
        built by the player's own ``network_input``."""
        if self._episode is None:
            # the algorithm's episode record, empty (row 0's action is 0); each act() appends
            # its action, so row i holds the action that led to observation i, as in play
            self._episode = type(self._player.episodes[0])()
        self._episode.observation.append(observation)
        return self._player.network_input(self._episode)


def load(path: str | Path, overrides: Overrides = (), seed: int = 0) -> Agent:
    """The agent of a run directory (its ``best.pt`` when it has one, else ``checkpoint.pt``;
    ``agent.checkpoint`` says which) or of a checkpoint file inside one.

    ``overrides``: as :func:`train`'s, applied to the run's ``config.json``; a run whose
    env is a ``module:callable`` factory needs it named here, ``{"env.id": "mymod:make"}``
    (a run directory may come from someone else: its config runs no code by itself).
    ``seed``: the search's random stream (ties). Raises FileNotFoundError for a path that
    holds no run, ConfigError or CheckpointError (ValueError, one line) for one that
    does not load.
    """
    from .algos.configs import load_run_config
    from .tools.evaluate import run_weights

    path = Path(path)
    run_dir, checkpoint = (path, run_weights(path)) if path.is_dir() else (path.parent, path)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"mpper.load {path}: no run directory with a config.json there")
    if not checkpoint.is_file():
        raise FileNotFoundError(f"mpper.load {path}: no such checkpoint {checkpoint}")
    return Agent(load_run_config(run_dir, _set_strings(overrides)), checkpoint, seed)
