"""What the forkserver does once, before it forks any child (``procs.process_context``).

Every child is a fork of the forkserver, so whatever is loaded here is loaded in all of
them at no cost. Imported for its effects, by the forkserver only:

- the modules every child imports anyway (the process mains and both algorithms);
- the replay buffer's compiled kernels (``mpper.replay.buffer.warm_kernels``), with
  numba's compiler, which cost each process that loads them a CPU second and tens of MiB.

``python bench/startup.py`` times each of these steps and the start of a run.
"""

import mpper.algos.registry  # noqa: F401  (every algorithm's modules)
import mpper.runtime.children  # noqa: F401
from mpper.replay.buffer import warm_kernels

warm_kernels()
