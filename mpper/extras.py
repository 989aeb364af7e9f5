"""Optional packages (setup.cfg extras) and the one-line error when one is missing.

``--render`` needs Pillow (and pygame for gymnasium's classic-control renderers), ``--plot``
needs matplotlib. They are not dependencies of training, so they are imported only by
the command that needs them, through :func:`require`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtraError", "require"]


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
