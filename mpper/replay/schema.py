"""Replay schemas: which per-step fields a buffer stores, with shape, dtype and fill."""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np

__all__ = ["Field", "Schema", "normalize_schema", "normalize_counters", "schema_from_json", "schema_to_json"]


class Field(NamedTuple):
    """One per-step field: stored as an array of shape ``(capacity, *shape)``."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fill: float  # value of rows a writer leaves out


class Schema(dict):
    """An algorithm's replay schema: ``{field: (shape, dtype[, fill])}`` (a dict, as
    ``ReplayBuffer.create`` takes), plus ``counters``, the names of the event counters
    the algorithm counts in the buffer beside the buffer's own (``COUNTERS``), e.g. its
    row rewrites stored and dropped (``ReplayBuffer.rewrite_rows``), and ``optional``,
    the names of fields a snapshot may lack (added to the schema after snapshots of it
    were written): a resumed buffer gets them with their fill value
    (``ReplayBuffer.load(..., add_fields=...)``)."""

    def __init__(self, fields: Mapping[str, Sequence] = (), counters: Sequence[str] = (),
                 optional: Sequence[str] = ()) -> None:  # fmt: skip
        super().__init__(fields)
        self.counters = tuple(counters)
        self.optional = tuple(optional)
        unknown = [name for name in self.optional if name not in self]
        if unknown:
            raise ValueError(f"optional fields {unknown} are not fields of the schema")

    def __reduce__(self):
        return Schema, (dict(self), self.counters, self.optional)


# A row field's dimensions (an image stack is 3 or 4); numpy's record dtypes take few more.
MAX_FIELD_DIMS = 16


def normalize_schema(schema: Mapping[str, Sequence]) -> tuple[Field, ...]:
    """``{name: (shape, dtype)}`` or ``{name: (shape, dtype, fill)}`` -> Fields.

    Raises ValueError naming the field on a bad name, shape or dtype.
    """
    if not schema:
        raise ValueError("a replay schema needs at least one field")
    fields = []
    for name, spec in schema.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"schema field name {name!r} must be an identifier not starting with '_'")
        if isinstance(spec, Field):
            spec = (spec.shape, spec.dtype, spec.fill)
        if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
            raise ValueError(f"schema field {name!r}: expected (shape, dtype) or (shape, dtype, fill), got {spec!r}")
        shape, dtype = spec[0], spec[1]
        fill = float(spec[2]) if len(spec) == 3 else 0.0
        if isinstance(shape, int):
            shape = (shape,)
        try:
            shape = tuple(int(d) for d in shape)
        except TypeError:
            raise ValueError(f"schema field {name!r}: shape must be a tuple of ints, got {shape!r}") from None
        if any(d < 1 for d in shape):
            raise ValueError(f"schema field {name!r}: every dimension must be >= 1, got {shape}")
        if len(shape) > MAX_FIELD_DIMS:
            raise ValueError(f"schema field {name!r}: at most {MAX_FIELD_DIMS} dimensions, got {len(shape)}")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"schema field {name!r}: unknown dtype {dtype!r}") from None
        if dt.kind not in "biuf" or (dt.kind == "f" and dt.itemsize not in (4, 8)):
            raise ValueError(f"schema field {name!r}: dtype must be bool, integer, float32 or float64, got {dt}")
        if not dt.isnative:  # the compiled gathers read this machine's byte order only
            raise ValueError(f"schema field {name!r}: dtype {dt.str} is not in this machine's byte order")
        if math.isnan(fill) and dt.kind != "f":
            raise ValueError(f"schema field {name!r}: fill NaN needs a float dtype, got {dt}")
        if not _holds(dt, fill):  # rows a writer leaves out are set to it
            raise ValueError(f"schema field {name!r}: fill {fill!r} is not a value of {dt}")
        fields.append(Field(name, shape, dt, fill))
    return tuple(fields)


def normalize_counters(names: Sequence[str], reserved: Sequence[str], room: int) -> tuple[str, ...]:
    """Extra counter names, checked: identifiers, distinct, none of ``reserved`` (the
    buffer's own names), at most ``room`` of them. Raises ValueError naming the problem."""
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"counter name {name!r} must be an identifier")
        if name in reserved:
            raise ValueError(f"counter name {name!r} is one of the buffer's own counters")
    if len(set(names)) != len(names):
        raise ValueError(f"counter names must be distinct, got {list(names)}")
    if len(names) > room:
        raise ValueError(f"at most {room} extra counters fit the buffer, got {len(names)}: {list(names)}")
    return names


def _holds(dt: np.dtype, fill: float) -> bool:
    """Whether ``fill`` is a value of ``dt``: NaN or a finite float in its range, an
    integer in its range, 0 or 1 for bool."""
    if dt.kind == "f":
        return math.isnan(fill) or abs(fill) <= float(np.finfo(dt).max)
    if dt.kind == "b":
        return fill in (0.0, 1.0)
    info = np.iinfo(dt)
    return fill.is_integer() and info.min <= fill <= info.max


def schema_to_json(fields: Sequence[Field]) -> list:
    return [
        {"name": f.name, "shape": list(f.shape), "dtype": f.dtype.str,
         "fill": "nan" if math.isnan(f.fill) else f.fill}
        for f in fields
    ]  # fmt: skip


def schema_from_json(items: list) -> tuple[Field, ...]:
    return normalize_schema(
        {d["name"]: (tuple(d["shape"]), d["dtype"], float(d["fill"])) for d in items}
    )
