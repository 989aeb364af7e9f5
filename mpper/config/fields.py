"""One config key: how a section declares it and how one value of it is checked.

Every key of every section is a dataclass field whose default, allowed values and
one-line description live together (``opt(default, allowed, doc)``), so that the checks
and ``--help-config`` come from the same place. ``allowed`` is one of:

- a range string: ``">= 1"``, ``"> 0"``, ``"[0, 1]"``, ``"(0, 1]"`` (for int and float fields);
- a tuple of the allowed strings (enums);
- a :class:`Check`: a description and a function, for lists and special strings;
- ``None``: any value of the field's type (finite, for numbers).

:func:`section_specs` reads a section's fields into :class:`FieldSpec` objects;
:func:`check_value` checks one value against one and raises a one-line ``ConfigError``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

from ..config_files import ConfigError

__all__ = ["Check", "FieldSpec", "Invalid", "Range", "check_value", "is_number", "opt", "section_specs", "show"]


class Invalid(Exception):
    """Raised by a :class:`Check` function: ``key_suffix`` (e.g. ``"[1]"``) and detail."""

    def __init__(self, detail: str, key_suffix: str = ""):
        super().__init__(detail)
        self.detail = detail
        self.key_suffix = key_suffix


@dataclass(frozen=True)
class Check:
    """A custom validation: ``describe`` is the allowed-values text for the help and the
    messages; ``fn(value)`` returns the normalised value or raises :class:`Invalid`."""

    describe: str
    fn: Callable[[Any], Any]
    late: bool = False  # run only after every other check passed (slow or needs imports)


def opt(default: Any, allowed: Any, doc: str) -> Any:
    """A dataclass field with its allowed values and description as metadata (typed
    ``Any`` so that the field's own annotation is what a type checker sees)."""
    md = {"allowed": allowed, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata=md)
    return field(default=default, metadata=md)


def show(value: Any, limit: int = 60) -> str:
    """``value`` as JSON (else its repr), cut to ``limit`` characters for a one-line message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Range:
    """An interval of allowed numbers; ``text`` is how messages and the help write it."""

    text: str
    lo: float | None
    hi: float | None
    lo_open: bool
    hi_open: bool

    def __contains__(self, v: Any) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return False
        return True


_NUM = r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"


@functools.cache
def parse_range(text: str) -> Range:
    """``">= 1"``, ``"< 5"``, ``"[0, 1]"``, ``"(0, 1]"`` -> :class:`Range`."""
    m = re.fullmatch(rf"\s*(>=|>|<=|<)\s*({_NUM})\s*", text)
    if m:
        op, x = m.group(1), float(m.group(2))
        if op[0] == ">":
            return Range(text, x, None, op == ">", False)
        return Range(text, None, x, False, op == "<")
    m = re.fullmatch(rf"\s*([\[(])\s*({_NUM})\s*,\s*({_NUM})\s*([\])])\s*", text)
    if m:
        return Range(f"in {text}", float(m.group(2)), float(m.group(3)), m.group(1) == "(", m.group(4) == ")")
    raise ValueError(f"bad range spec {text!r}")


_NONE = type(None)
_TYPE_PHRASE = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "an object",
                list: "a list"}  # fmt: skip
_TYPE_NAME = {int: "int", float: "float", str: "str", bool: "bool", dict: "object", list: "list"}


@dataclass(frozen=True)
class FieldSpec:
    """One key: dotted name, types, default, allowed values and description."""

    key: str
    types: tuple  # base types (int, float, str, bool, dict, list), without NoneType
    nullable: bool
    default: Any
    allowed: Any  # None, Range, tuple of strings, Check
    doc: str

    @property
    def type_name(self) -> str:
        name = " | ".join(_TYPE_NAME[t] for t in self.types)
        return name + " | null" if self.nullable else name

    @property
    def allowed_text(self) -> str:
        if isinstance(self.allowed, Range):
            return self.allowed.text
        if isinstance(self.allowed, tuple):
            return "one of " + ", ".join(f'"{c}"' for c in self.allowed)
        if isinstance(self.allowed, Check):
            return self.allowed.describe
        if self.types == (bool,):
            return "true or false"
        if self.types == (float,):
            return "a finite number"
        if self.types == (dict,):
            return "an object"
        return "any"

    def expected(self) -> str:
        """``"an integer >= 1"``, ``"a number in [0, 1] or null"``, ``'one of "a", "b"'``."""
        if isinstance(self.allowed, tuple):
            text = self.allowed_text
        elif isinstance(self.allowed, Check):
            text = self.allowed.describe
        else:
            text = " or ".join(_TYPE_PHRASE[t] for t in self.types)
            if isinstance(self.allowed, Range):
                text += " " + self.allowed.text
        return text + " or null" if self.nullable else text


def _split_hint(hint: Any) -> tuple[tuple, bool]:
    if get_origin(hint) in (Union, types.UnionType):
        args = get_args(hint)
        return tuple(a for a in args if a is not _NONE), _NONE in args
    return (hint,), False


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[operator]  # opt() gives every field one or the other


@functools.cache
def section_specs(cls: type, name: str | None = None) -> dict[str, FieldSpec]:
    """The keys of one section (``cls``, called ``name`` in the file), or the top-level
    keys of a whole config (``name`` None): every field that is not itself a section."""
    hints = get_type_hints(cls)
    prefix = "" if name is None else name + "."
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        allowed = f.metadata["allowed"]
        if isinstance(allowed, str):
            allowed = parse_range(allowed)
        types_, nullable = _split_hint(hints[f.name])
        out[f.name] = FieldSpec(prefix + f.name, types_, nullable, _default_of(f), allowed, f.metadata["doc"])
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def check_value(spec: FieldSpec, value: Any, source: str, late: bool = False) -> Any:
    """Type, range, enum and custom checks of one value; returns it normalised (ints of
    float keys become floats). ``late``: also run checks marked ``late``. Raises
    ``ConfigError("<source>: <key>: expected ..., got ...")``."""
    def bad(detail: str | None = None, suffix: str = "") -> ConfigError:
        detail = detail or f"expected {spec.expected()}, got {show(value)}"
        return ConfigError(f"{source}: {spec.key}{suffix}: {detail}")

    if value is None:
        if spec.nullable:
            return None
        raise bad()
    # type
    if isinstance(value, bool):
        ok = bool in spec.types
    elif isinstance(value, int):
        ok = int in spec.types or float in spec.types
    elif isinstance(value, float):
        ok = float in spec.types
    else:
        ok = isinstance(value, tuple(t for t in spec.types if t not in (int, float, bool)))
    if not ok:
        raise bad()
    if is_number(value) and (int not in spec.types or isinstance(value, float)):
        value = float(value)
        if not math.isfinite(value):
            raise bad()
    # allowed values
    allowed = spec.allowed
    if isinstance(allowed, Range):
        if value not in allowed:
            raise bad()
    elif isinstance(allowed, tuple):
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            raise bad(f"expected {spec.expected()}, got {show(value)}{hint}")
    elif isinstance(allowed, Check) and (late or not allowed.late):
        try:
            value = allowed.fn(value)
        except Invalid as e:
            raise bad(e.detail, e.key_suffix) from None
    return _plain(value)
