"""Optional packages (setup.cfg extras) and the one-line error when one is missing.

``--render`` needs Pillow (and pygame for gymnasium's classic-control renderers), ``--plot``
needs matplotlib. They are not dependencies of training, so they are imported only by
the command that needs them, through :func:`require`.

Env families whose packages register their gymnasium ids only on request (MinAtar's
``MinAtar/...``, the Arcade Learning Environment's ``ALE/...``) are registered by
:func:`register_env_family` when an env id names their namespace. gymnasium's own MuJoCo
envs (``HalfCheetah-v5``, ...) are always registered but need the ``mujoco`` package
(the ``mujoco`` extra), which the same function asks for when an env id is one of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from types import ModuleType

__all__ = ["ENV_FAMILIES", "MissingExtraError", "installed", "register_env_family", "require"]


class MissingExtraError(ImportError):
    """An optional package is not installed; the message says which extra installs it."""


def require(module: str, package: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise MissingExtraError naming ``package`` and the extra.

    Example: ``require("PIL.Image", "Pillow", "render", "--render gif")``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{purpose} needs {package}, which is not installed ({exc}); install it with: pip install -e .[{extra}]"
        ) from None


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (TensorBoard, wandb:
    their imports take seconds). A module set to None in ``sys.modules`` counts as missing."""
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# namespace -> (module, package, extra, how the module registers its ids)
ENV_FAMILIES = {
    "MinAtar": ("minatar.gym", "minatar", "minatar", "register_envs"),
    "ALE": ("ale_py", "ale-py", "atari", "gymnasium.register_envs"),
}


# gymnasium's MuJoCo envs: registered ids whose entry point is in this package
MUJOCO_ENTRY_POINTS = "gymnasium.envs.mujoco."


def register_env_family(env_id: str) -> bool:
    """Register the gymnasium ids of the family ``env_id``'s namespace names (``MinAtar/``
    or ``ALE/``), importing its package; for one of gymnasium's MuJoCo ids, import
    ``mujoco``; False for any other id. MissingExtraError naming the extra when the
    package is not installed. Idempotent, per process."""
    if _is_gymnasium_mujoco(env_id):
        _warn_through_python(require("mujoco", "mujoco", "mujoco", f"the env {env_id!r}"))
        return True
    namespace = env_id.split("/", 1)[0] if "/" in env_id else None
    if namespace not in ENV_FAMILIES:
        return False
    import gymnasium

    module, package, extra, how = ENV_FAMILIES[namespace]
    if any(key.startswith(namespace + "/") for key in gymnasium.envs.registry):
        return True
    found = require(module, package, extra, f"the env {env_id!r}")
    if how == "register_envs":
        found.register_envs()
    else:
        gymnasium.register_envs(found)
    return True


def _is_gymnasium_mujoco(env_id: str) -> bool:
    """Whether ``env_id`` is registered with an entry point among gymnasium's MuJoCo envs."""
    if "/" in env_id or ":" in env_id:
        return False
    import gymnasium

    found = gymnasium.envs.registry.get(env_id)
    entry_point = getattr(found, "entry_point", None)
    return isinstance(entry_point, str) and entry_point.startswith(MUJOCO_ENTRY_POINTS)


def _mujoco_warning(message: str) -> None:
    # a deprecation in a model file (gymnasium's HalfCheetah-v5 under mujoco 4) is the model's
    # maintainers' to act on: a DeprecationWarning, which Python shows only when asked (-W)
    # (raised here, in mpper, not at the env's line in gymnasium, whose filter shows its own
    # DeprecationWarnings)
    category = DeprecationWarning if "deprecated" in message else RuntimeWarning
    warnings.warn(f"MuJoCo: {message}", category, stacklevel=1)


def _warn_through_python(mujoco: ModuleType) -> None:
    """MuJoCo's own warning handler prints and also appends to MUJOCO_LOG.TXT in the current
    directory (mujoco 4 warns of a deprecated attribute of HalfCheetah-v5's model), which
    would leave a file wherever a run starts: its warnings go to Python's ``warnings``
    instead (shown once per place, as Python's are; deprecations hidden unless asked for).
    A handler someone else set is kept."""
    getter = getattr(mujoco, "get_mju_user_warning", None)
    if getter is not None and getter() is None:
        mujoco.set_mju_user_warning(_mujoco_warning)
