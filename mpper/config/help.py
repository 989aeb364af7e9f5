"""``--help-config``: every key of a :class:`~mpper.config.engine.ConfigSchema` with its
type, default, allowed values and description, as plain text or a Markdown table, read
from the same field metadata the checks use."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from .engine import ConfigSchema

__all__ = ["HELP_WIDTH", "describe_schema"]

HELP_WIDTH = 100  # --help-config's columns at most: a common terminal


def _default_text(v: Any) -> str:
    return json.dumps(v)


def describe_schema(schema: ConfigSchema, markdown: bool = False) -> str:
    """Every key with its type, default, allowed values and description: plain text for
    ``--help-config``, or a Markdown table (``markdown=True``). The sections of an
    algorithm are marked with its name; the shared rules with a ``doc`` are listed last."""
    specs = schema.field_specs()
    owner = {sec: name for name, a in schema.algorithms.items() for sec in a.sections}
    docs = {**schema.shared_sections}
    for a in schema.algorithms.values():
        docs.update(a.sections)
    rows = [(s.key, s.type_name, _default_text(s.default), s.allowed_text, s.doc) for s in specs]
    rules = [rule.doc for rule in schema.rules if rule.doc]
    if markdown:
        lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for spec, row in zip(specs, rows):
            head = spec.key.split(".")[0]
            doc = f"({owner[head]} only) {row[4]}" if head in owner and "." in spec.key else row[4]
            cells = (f"`{row[0]}`", row[1], row[2], row[3], doc)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
        lines.append("Rules between keys: " + "; ".join(f"`{r}`" for r in rules) + ".")
        return "\n".join(lines)

    def wrapped(text: str, indent: str = "") -> list[str]:
        return textwrap.wrap(text, HELP_WIDTH, initial_indent=indent, subsequent_indent=indent or "    ",
                             break_on_hyphens=False)  # fmt: skip

    shared = " and ".join([", ".join(list(schema.shared_sections)[:-1]), list(schema.shared_sections)[-1]])
    lines = [
        "Config keys (JSON: top-level keys, then one object per section). Missing keys take the default.",
        f"{shared} are shared; the other sections belong to one algorithm each.",
        "Override any key with --set section.key=value (value parsed as JSON, else as a string).",
        'A config may extend another: "base": "cartpole" (a shipped name) or "base": "./other.json".',
        "Each key: its name, type, default and allowed values, then what it means.",
        "",
    ]
    section: str | None = None
    for spec, row in zip(specs, rows):
        sec = spec.key.split(".")[0] if "." in spec.key else None
        if sec is not None and sec != section:
            section = sec
            lines.append("")
            whose = f" (algorithm {owner[sec]})" if sec in owner else ""
            lines.extend(wrapped(f"[{sec}]{whose} {(docs[sec].__doc__ or '').strip()}"))
        key, type_name, default, allowed, doc = row
        lines.extend(wrapped(f"{key}  {type_name}  default {default}  allowed {allowed}"))
        lines.extend(wrapped(doc, "      "))
    lines.append("")
    lines.extend(wrapped("Rules between keys: " + "; ".join(rules) + "."))
    return "\n".join(lines)
