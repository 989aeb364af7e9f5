"""A run's facts, computed once: :class:`RunSetup`.

The main process builds one after the checks (``launch.py``: config, env, run
directory, resume) and hands it whole to every role and child process: it is frozen and
picklable, so nothing downstream builds an env to read its shapes, spells a run-dir path,
or decides again whether the run resumes. :meth:`RunSetup.make_network` is the one place
a network is made for a run; :class:`Seeds` says which random stream each role uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..algos.base import Algorithm
from ..algos.registry import algorithm_of, run_env_spec
from ..config import Config
from ..envs.spec import EnvSpec
from .offline import OfflineData
from .rundir import RunDir

__all__ = ["RunSetup", "Seeds"]


@dataclass(frozen=True)
class Seeds:
    """The seed of every random stream of a run, from ``runtime.seed``: self-play stream
    (worker) ``i`` after ``restarts`` restarts, evaluation round ``k``, and the final evaluation. Distinct for
    every stream, restart and round (the strides are primes larger than any count of them)."""

    base: int

    def worker(self, worker: int, restarts: int = 0) -> int:
        return self.base * 1_000_003 + worker * 7919 + restarts * 104_729

    def evaluation(self, round_: int) -> int:
        return self.base + 999_983 + 10_000 * round_

    def final_evaluation(self) -> int:
        """The final evaluation's episodes: ``seed + i`` for episode ``i``, below every
        evaluation round's (rounds are 10,000 apart, from 999,983 up)."""
        return self.base + 499_979


@dataclass(frozen=True)
class RunSetup:
    """What every role of one run needs to know, decided once.

    ``config``: the checked config. ``spec``: the env's shapes and action count (from one
    env, made once by :meth:`create`). ``run_dir``: the run directory's paths. ``resume``:
    whether this run continues the one in ``run_dir`` (its ``checkpoint.pt`` and
    ``buffer/``, where they were written). ``offline``: the snapshots an offline run
    (``--offline``) fills its buffer from; it then starts no self-play."""

    config: Config
    spec: EnvSpec
    run_dir: RunDir
    resume: bool = False
    offline: OfflineData | None = None

    @classmethod
    def create(cls, config: Config, run_dir: str | Path | RunDir, resume: bool = False) -> RunSetup:
        """The setup of a run of ``config`` in ``run_dir``; the env is made once here
        (ValueError when the algorithm cannot train it: ``run_env_spec``)."""
        folder = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        return cls(config, run_env_spec(config), folder, resume)

    @property
    def algorithm(self) -> Algorithm:
        return algorithm_of(self.config)

    @property
    def seeds(self) -> Seeds:
        return Seeds(self.config.runtime.seed)

    @property
    def resume_checkpoint(self) -> Path | None:
        """The checkpoint to continue from (a resumed run stopped before its first one has none)."""
        path = self.run_dir.checkpoint
        return path if self.resume and path.exists() else None

    @property
    def resume_snapshot(self) -> Path | None:
        """The buffer snapshot to continue from, when resuming and one was written."""
        path = self.run_dir.buffer
        return path if self.resume and path.exists() else None

    @property
    def selfplay(self) -> bool:
        """Whether the run plays: every run but an offline one."""
        return self.offline is None

    def make_network(self):
        """A new network of the run's algorithm for its env (the caller seeds torch first
        when the weights must be the run's: the learner does)."""
        return self.algorithm.make_network(self.config, self.spec.observation_shape, self.spec.num_actions)
