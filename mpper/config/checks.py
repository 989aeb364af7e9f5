"""The custom checks of the shared sections' keys (and of the lists an algorithm's
sections hold): layer widths, temperature schedules, the initial priority, the env id,
a Ray address, Ray resources. Each is a :class:`~mpper.config.fields.Check`."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from ..env_ids import env_id_form, module_not_found_text, search_current_directory
from ..extras import MissingExtraError, register_env_family
from .fields import Check, Invalid, is_number, show

__all__ = ["ENV_ID", "INITIAL_PRIORITY", "MAX_LAYERS", "MAX_WIDTH", "RAY_ADDRESS", "RESOURCES", "SCHEDULE", "WIDTHS"]

MAX_WIDTH, MAX_LAYERS = 65536, 64


def _check_widths(value: list) -> list:
    if len(value) > MAX_LAYERS:
        raise Invalid(f"expected at most {MAX_LAYERS} widths, got {len(value)}")
    for i, w in enumerate(value):
        if not (isinstance(w, int) and not isinstance(w, bool)) or not 1 <= w <= MAX_WIDTH:
            raise Invalid(f"expected an integer in [1, {MAX_WIDTH}], got {show(w)}", f"[{i}]")
    return list(value)


def _check_schedule(value: list) -> list:
    if not value:
        raise Invalid("expected at least one [fraction, temperature] pair, got []")
    out: list[list[float]] = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise Invalid(f"expected a [fraction, temperature] pair, got {show(pair)}", f"[{i}]")
        frac, temp = pair
        if not is_number(frac) or not math.isfinite(frac) or not 0 <= frac <= 1:
            raise Invalid(f"expected a fraction of training in [0, 1], got {show(frac)}", f"[{i}][0]")
        if not is_number(temp) or not math.isfinite(temp) or temp < 0:
            raise Invalid(f"expected a temperature >= 0, got {show(temp)}", f"[{i}][1]")
        if i == 0 and frac != 0:
            raise Invalid(f"the first fraction must be 0 (the schedule starts at step 0), got {show(frac)}", "[0][0]")
        if out and frac <= out[-1][0]:
            raise Invalid(
                f"fractions must increase (sorted, no repeats), got {show(frac)} after {show(out[-1][0])}",
                f"[{i}][0]",
            )
        out.append([float(frac), float(temp)])
    return out


def _check_initial_priority(value: Any) -> Any:
    if isinstance(value, str):
        if value not in ("actor", "max"):
            raise Invalid(f'expected "actor", "max" or a number >= 0, got {show(value)}')
        return value
    if not math.isfinite(value) or value < 0:
        raise Invalid(f'expected "actor", "max" or a number >= 0, got {show(value)}')
    return float(value)


def _check_env_id(value: str) -> str:
    """A registered gymnasium id, ``module:callable`` or gymnasium's ``module:EnvId``
    (:mod:`mpper.env_ids`) whose module can be found (located, not run; no env is
    created), the current directory included."""
    import gymnasium

    try:
        register_env_family(value)  # MinAtar/..., ALE/...: ids their packages register on request
    except MissingExtraError as exc:
        raise Invalid(str(exc)) from None
    form = env_id_form(value)
    if form.module is not None:  # form.imports: an id that names a module, which is found here, not run
        import importlib.util

        search_current_directory()
        try:
            found = importlib.util.find_spec(form.module) is not None
        except (ImportError, ValueError):  # a parent package that is missing
            found = False
        if not found:
            raise Invalid(module_not_found_text(form.module, value))
        return value
    registry = gymnasium.envs.registry
    if value in registry:
        return value
    close = difflib.get_close_matches(value, list(registry), n=1, cutoff=0.6)
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    raise Invalid(
        f'{show(value)} is not a registered gymnasium id{hint}; expected a registered id such as "CartPole-v1", '
        '"module:callable" returning a gymnasium.Env, or "module:EnvId-v0" (importing module registers EnvId-v0)'
    )


_RAY_ADDRESS_RE = re.compile(r"^[A-Za-z0-9._-]+:[0-9]{1,5}$")


def _check_ray_address(value: str) -> str:
    if value == "auto" or (_RAY_ADDRESS_RE.match(value) and 0 < int(value.rsplit(":", 1)[1]) < 65536):
        return value
    if value.startswith("ray://"):
        raise Invalid(f"{show(value)} is a Ray Client address; mpper joins the cluster as a node's driver (the "
                       'buffer\'s machine must be a node: ray start there), expected "auto" or the head\'s "host:port"')
    raise Invalid(f'expected "auto" or the head\'s "host:port" (such as "10.0.0.5:6379"), got {show(value)}')


def _check_resources(value: dict) -> dict:
    for name, amount in value.items():
        if not name or not is_number(amount) or not math.isfinite(amount) or amount <= 0:
            raise Invalid(f"expected a number > 0 per resource name, got {show(amount)}", f".{name}")
    return {str(k): float(v) for k, v in value.items()}


WIDTHS = Check(f"a list of at most {MAX_LAYERS} integers in [1, {MAX_WIDTH}]", _check_widths)
SCHEDULE = Check("a list of [fraction, T] pairs: fractions in [0, 1] increasing from 0, T >= 0", _check_schedule)
INITIAL_PRIORITY = Check('"actor", "max" or a number >= 0', _check_initial_priority)
ENV_ID = Check('a registered gymnasium id, "module:callable" or "module:EnvId-v0"', _check_env_id, late=True)
RAY_ADDRESS = Check('"auto" or "host:port"', _check_ray_address)
RESOURCES = Check("an object of resource name -> amount > 0", _check_resources)
