"""What an ``env.id`` names, and where the Python modules it names are looked for.

Three forms, told apart by this rule (checked in this order):

1. an id in gymnasium's registry as it stands (``CartPole-v1``, ``mpper/TicTacToe-v0``,
   ``MinAtar/Breakout-v1``): made with ``gymnasium.make``, nothing imported by mpper;
2. ``module:callable``, where the part after the colon is a Python name (letters, digits,
   ``_``, dots): ``myenv:make_env`` imports ``myenv`` and calls ``make_env(**env.kwargs)``,
   which returns a ``gymnasium.Env``;
3. ``module:EnvId``, where the part after the colon is a gymnasium id (it has a version
   ``-v0`` or a namespace ``ns/``): gymnasium's own form, ``mypkg:MyEnv-v0`` imports
   ``mypkg``, whose import registers ``MyEnv-v0``, then ``gymnasium.make`` makes that id.

Forms 2 and 3 run code: a run directory's ``config.json`` may name neither
(:func:`mpper.config.load_run_config`). Their modules are looked for on ``sys.path`` with
the current directory added (:func:`search_current_directory`), so that a ``myenv.py``
beside where mpper runs is found whichever way mpper was started (the ``mpper`` script or
``python run.py``, neither of which puts the current directory on the path); child
processes inherit the same path.
"""

from __future__ import annotations

import os
import re
import sys
from typing import NamedTuple

__all__ = ["EnvIdForm", "env_id_form", "module_not_found_text", "search_current_directory"]

_PYTHON_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class EnvIdForm(NamedTuple):
    """``kind``: ``"registered"``, ``"factory"`` (module:callable) or ``"module_id"``
    (gymnasium's module:EnvId); ``module`` and ``name``: the two sides of the colon
    (None for a registered id)."""

    kind: str
    module: str | None = None
    name: str | None = None

    @property
    def imports(self) -> bool:
        """Whether making the env imports a module named by the id (runs its code)."""
        return self.module is not None


def env_id_form(env_id: str) -> EnvIdForm:
    """Which of the three forms (module docstring) ``env_id`` is. An id with a colon whose
    module part is not a Python module name is "registered" (gymnasium then says it is not)."""
    import gymnasium

    if env_id in gymnasium.envs.registry or ":" not in env_id:
        return EnvIdForm("registered")
    module, _, name = env_id.partition(":")
    if not _PYTHON_NAME.match(module):
        return EnvIdForm("registered")
    return EnvIdForm("factory" if _PYTHON_NAME.match(name) else "module_id", module, name)


def search_current_directory() -> str:
    """Add the current directory to the end of ``sys.path`` (once), as ``python -m`` puts
    it at the start: a module beside where mpper runs is found, an installed one of the
    same name still wins. Returns the directory."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    return here


def module_not_found_text(module: str, env_id: str) -> str:
    """The one line for a module of ``env_id`` that cannot be found, naming where it was looked for."""
    here = os.getcwd()
    return (f'module "{module}" of {env_id!r} cannot be found: looked in the current directory ({here}), '
            f"PYTHONPATH and the installed packages; run mpper from the directory that holds {module.split('.')[0]}.py "
            f"(or its package), or add that directory to PYTHONPATH")  # fmt: skip
