"""The config engine: a parsed JSON object, ``--set`` overrides and flags in, a checked
config object out, or a :class:`~mpper.config_files.ConfigError` whose message is one
line: ``<file or flag>: <section.key>: <what is wrong and what is allowed>``.

It knows no section and no algorithm: :class:`ConfigSchema` gives it the root config
class (the top-level keys and the shared sections, :mod:`mpper.config.schema`), each
algorithm's :class:`AlgorithmConfig` by the name the ``algorithm`` key gives (a subclass
of the root whose extra fields are that algorithm's sections), the rules between keys
and the names for "did you mean". The algorithm a file names decides which sections it
may hold; a section of another algorithm is an error that says whose it is.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from ..config_files import ConfigError
from .fields import FieldSpec, check_value, section_specs, show

__all__ = ["ALGORITHM_KEY", "AlgorithmConfig", "ConfigSchema", "Rule", "Sources", "own_sections", "parse_config",
           "value_at"]

ALGORITHM_KEY = "algorithm"  # the top-level key that picks the algorithm, hence the sections a file may hold


@dataclass(frozen=True)
class Rule:
    """A rule between keys: ``check(config)`` returns None when it holds, else what is
    wrong (``ConfigError`` names ``keys[0]`` and where the first of ``keys`` that a flag or
    ``--set`` changed came from). ``doc``: the rule as ``--help-config`` lists it."""

    keys: tuple[str, ...]
    check: Callable[[Any], str | None]
    doc: str = ""


def own_sections(cls: type) -> dict[str, type]:
    """The sections ``cls`` declares itself (section name -> dataclass), not those it
    inherits: an algorithm's config class over the root one."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if f.name not in inherited and dataclasses.is_dataclass(hints[f.name])}  # fmt: skip


@dataclass(frozen=True)
class AlgorithmConfig:
    """What an algorithm adds to a config: ``config``, its typed config class (a subclass
    of the root config whose own fields are the algorithm's sections, dataclasses built
    like the shared ones with ``opt`` fields), the rules between their keys, and
    ``offline``: the ``--set`` overrides an offline run (``--offline``) applies before the
    user's own (MuZero: reanalyse every episode with a new search)."""

    config: type
    rules: tuple[Rule, ...] = ()
    offline: tuple[str, ...] = ()

    @property
    def sections(self) -> dict[str, type]:
        """The algorithm's own sections by name, in declaration order."""
        return own_sections(self.config)


@dataclass(frozen=True)
class ConfigSchema:
    """What the engine checks a file against.

    ``root``: the config class of the top-level keys and the shared sections (fields
    whose type is a dataclass); ``algorithms``: each algorithm's sections by name;
    ``rules``: rules between shared keys, checked before the algorithm's own;
    ``renamed``: ``{old dotted key: (new dotted key, note)}``; ``foreign_names``: ``{name
    another library gives a setting: (mpper keys that mean it, what it is)}``."""

    root: type
    algorithms: Mapping[str, AlgorithmConfig]
    rules: tuple[Rule, ...] = ()
    renamed: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    foreign_names: Mapping[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shared = set(self.shared_sections) | set(section_specs(self.root))
        for name, a in self.algorithms.items():
            if not issubclass(a.config, self.root):
                raise TypeError(f"algorithm {name!r}: its config class {a.config.__name__} does not extend "
                                f"{self.root.__name__}")  # fmt: skip
            clash = set(a.sections) & shared
            if clash:
                raise ValueError(f"algorithm {name!r} defines sections that exist already: {sorted(clash)}")

    @property
    def shared_sections(self) -> dict[str, type]:
        hints = get_type_hints(self.root)
        return {f.name: hints[f.name] for f in dataclasses.fields(self.root) if dataclasses.is_dataclass(hints[f.name])}

    def top_specs(self) -> dict[str, FieldSpec]:
        """The top-level keys; ``algorithm`` allows the names of ``algorithms``."""
        top = dict(section_specs(self.root))
        top[ALGORITHM_KEY] = dataclasses.replace(top[ALGORITHM_KEY], allowed=tuple(self.algorithms))
        return top

    def field_specs(self) -> list[FieldSpec]:
        """Every key of a config, in declaration order: top-level keys, the shared
        sections, then each algorithm's sections."""
        out = list(self.top_specs().values())
        for name, cls in self.shared_sections.items():
            out.extend(section_specs(cls, name).values())
        for a in self.algorithms.values():
            for name, cls in a.sections.items():
                out.extend(section_specs(cls, name).values())
        return out


class _Layout:
    """What one file may hold: the top-level keys, the shared sections and the sections
    of ``algorithm``; ``owner`` names the algorithm of every other algorithm's section,
    for the error that says whose it is."""

    def __init__(self, schema: ConfigSchema, algorithm: str):
        self.schema, self.algorithm = schema, algorithm
        self.config_class = schema.algorithms[algorithm].config
        self.shared = schema.shared_sections
        self.own = schema.algorithms[algorithm].sections
        self.sections: dict[str, type] = {**self.shared, **self.own}
        self.owner = {sec: name for name, a in schema.algorithms.items() for sec in a.sections if sec not in self.own}
        self.top = schema.top_specs()

    def specs(self, section: str) -> dict[str, FieldSpec]:
        return section_specs(self.sections[section], section)

    def all_keys(self) -> list[str]:
        """Every key of every algorithm (for "did you mean" across sections)."""
        return [spec.key for spec in self.schema.field_specs()]


# ---- did you mean -----------------------------------------------------------------------------


def _foreign_hint(key: str, layout: _Layout) -> str | None:
    """``did you mean training.lr_init? mpper's name for the initial learning rate ...`` for
    a name another library uses, or None (also when the config's algorithm has no such key)."""
    found = layout.schema.foreign_names.get(key.lower())
    if found is None:
        return None
    candidates, meaning = found
    own = [k for k in candidates if k.split(".")[0] in layout.sections]
    return f"did you mean {own[0]}? mpper's name for {meaning}" if own else None


def _unknown_key(source: str, key: str, section: str | None, known: Iterable[str], layout: _Layout) -> ConfigError:
    """``unknown key`` with a did-you-mean: a renamed key; another library's name for a
    key (``learning_rate``: ``training.lr_init``); a close match in the same section,
    else in any section; a section of another algorithm says whose it is."""
    dotted = f"{section}.{key}" if section else key
    renamed = layout.schema.renamed
    if dotted in renamed:
        new, note = renamed[dotted]
        return ConfigError(f"{source}: {dotted}: renamed to {new} ({note})")
    foreign = _foreign_hint(key, layout)
    if foreign is not None:
        return ConfigError(f"{source}: {dotted}: unknown key ({foreign})")
    if section is None and key in layout.owner:
        return ConfigError(f'{source}: {key}: a section of algorithm "{layout.owner[key]}", not of '
                           f'"{layout.algorithm}" (whose sections are '
                           f'{", ".join(layout.sections)})')  # fmt: skip
    known = list(known)
    all_keys = layout.all_keys()
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {section + '.' if section else ''}{close[0]}?"
    else:
        elsewhere = [k for k in all_keys if k.rsplit(".", 1)[-1] == key]
        if not elsewhere:
            near = difflib.get_close_matches(key, [k.rsplit(".", 1)[-1] for k in all_keys], n=1, cutoff=0.75)
            elsewhere = [k for k in all_keys if near and k.rsplit(".", 1)[-1] == near[0]]
        own = [k for k in elsewhere if k.split(".")[0] in layout.sections or "." not in k]
        if own or elsewhere:
            hint = f"did you mean {(own or elsewhere)[0]}?"
        else:
            hint = f"allowed in {section}: " if section else "allowed at the top level: "
            hint += ", ".join(known)
    what = "unknown section" if section is None and close and close[0] in layout.sections else "unknown key"
    return ConfigError(f"{source}: {dotted}: {what} ({hint})")


# ---- where each value came from ---------------------------------------------------------------


class Sources:
    """Where each key's value came from: the file unless an override or flag set it."""

    def __init__(self, file_label: str):
        self.file = file_label
        self.by_key: dict[str, str] = {}

    def __call__(self, *keys: str) -> str:
        for k in keys:
            if k in self.by_key:
                return self.by_key[k]
        return self.file


def _json_kind(v: Any) -> str:
    if isinstance(v, list):
        return "a list"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "true/false"
    if v is None:
        return "null"
    return "a number"


def _check_structure(data: Any, source: str, layout: _Layout) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level, got {_json_kind(data)}")
    if getattr(data, "duplicates", None):
        raise ConfigError(f"{source}: {data.duplicates[0]}: duplicate key")  # type: ignore[attr-defined]
    known = list(layout.top) + list(layout.sections)
    for key, value in data.items():
        if key in layout.sections:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {key}: expected an object (a section of keys), got {show(value)}")
            if getattr(value, "duplicates", None):
                raise ConfigError(f"{source}: {key}.{value.duplicates[0]}: duplicate key")  # type: ignore[attr-defined]
        elif key not in layout.top:
            raise _unknown_key(source, key, None, known, layout)


# ---- --set ------------------------------------------------------------------------------------


def _show_set(text: str, limit: int = 80) -> str:
    """An override as an error names it: cut to ``limit`` characters, so that one line
    stays readable whatever was given."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _parse_set(text: str) -> tuple[str, Any]:
    """``section.key=value`` -> (dotted key, value): the value is JSON when it parses, else a
    plain string (so ``env.id=CartPole-v1`` and ``runtime.device=cpu`` need no quotes)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {_show_set(text)}: expected section.key=value, e.g. --set training.batch_size=64")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, too many digits, nested too deeply: a plain string
        value = raw
    return key, value


def _apply_override(data: dict, key: str, value: Any, label: str, sources: Sources, layout: _Layout) -> None:
    parts = key.split(".")
    top = layout.top
    if any(not p for p in parts):
        raise ConfigError(f"{label}: {key}: expected section.key=value, e.g. --set training.batch_size=64")
    head = parts[0]
    if len(parts) == 1:
        if head in layout.sections:
            first = next(iter(layout.specs(head)))
            raise ConfigError(f"{label}: {key}: is a section; set one of its keys, e.g. --set {key}.{first}=...")
        if head not in top:
            raise _unknown_key(label, head, None, list(top) + list(layout.sections), layout)
        data[head] = value
        sources.by_key[head] = label
        return
    if head not in layout.sections:
        if head in top:
            raise ConfigError(f"{label}: {key}: {head} is not a section")
        if head in layout.owner:
            raise _unknown_key(label, head, None, layout.sections, layout)
        close = difflib.get_close_matches(head, list(layout.sections), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "sections: " + ", ".join(layout.sections)
        raise ConfigError(f"{label}: {head}: unknown section ({hint})")
    specs = layout.specs(head)
    name = parts[1]
    if name not in specs:
        raise _unknown_key(label, name, head, specs, layout)
    section = data.setdefault(head, {})
    dotted = f"{head}.{name}"
    if len(parts) > 2:  # into an object-valued key, e.g. env.kwargs.render_mode=rgb_array
        if dict not in specs[name].types:
            raise ConfigError(f"{label}: {key}: {dotted} is not an object ({specs[name].type_name})")
        target = section.get(name)
        if target is None:
            target = section[name] = {}
        if not isinstance(target, dict):
            raise ConfigError(f"{sources(dotted)}: {dotted}: expected {specs[name].expected()}, got {show(target)}")
        for p in parts[2:-1]:
            nxt = target.get(p)
            if not isinstance(nxt, dict):
                nxt = target[p] = {}
            target = nxt
        target[parts[-1]] = value
    else:
        section[name] = value
    sources.by_key[dotted] = label


# ---- building ---------------------------------------------------------------------------------


def _build_section(cls: type, name: str, raw: Mapping, sources: Sources, layout: _Layout) -> Any:
    specs = section_specs(cls, name)
    kwargs = {}
    for key, value in raw.items():
        if key not in specs:
            raise _unknown_key(sources(f"{name}.{key}"), key, name, specs, layout)
        kwargs[key] = check_value(specs[key], value, sources(specs[key].key))
    return cls(**kwargs)


def _build(raw: Mapping, sources: Sources, layout: _Layout) -> Any:
    kwargs = {}
    for key, value in raw.items():
        if key in layout.shared:
            kwargs[key] = _build_section(layout.shared[key], key, value, sources, layout)
        elif key in layout.top:
            kwargs[key] = check_value(layout.top[key], value, sources(key))
    for name, cls in layout.own.items():
        kwargs[name] = _build_section(cls, name, raw.get(name, {}), sources, layout)
    return layout.config_class(**kwargs)


def value_at(config: Any, dotted: str) -> Any:
    """``config``'s value of ``"section.key"`` (or of a top-level key)."""
    obj = config
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _algorithm_of(data: Mapping, overrides: list[tuple[str, Any, str]], source: str, schema: ConfigSchema) -> str:
    """The algorithm the file (or the last override or flag that sets it) names, checked:
    it decides which sections the rest of the file may hold."""
    label, value = source, data.get(ALGORITHM_KEY, section_specs(schema.root)[ALGORITHM_KEY].default)
    for key, v, lab in overrides:
        if key == ALGORITHM_KEY:
            label, value = lab, v
    return check_value(schema.top_specs()[ALGORITHM_KEY], value, label)


def parse_config(schema: ConfigSchema, data: Any, source: str, overrides: Iterable[str] = (),
                 flags: Iterable[tuple[str, str, Any]] = (), origins: Mapping[str, str] | None = None,
                 ) -> tuple[Any, Sources]:  # fmt: skip
    """Check ``data`` (a parsed JSON object) with ``overrides`` (``"section.key=value"``
    strings, ``--set``) and ``flags`` (``(label, dotted key, value)``, applied last) into an
    instance of the named algorithm's config class, every rule checked; missing keys take
    their defaults. Returns it with its :class:`Sources` (for checks the caller runs
    after: ``Check``s marked ``late``). ``origins``: ``{dotted key: label}`` of the keys a
    base file set. Raises ``ConfigError`` naming ``source`` or the override, flag or base
    file that set the bad value."""
    sources = Sources(source)
    sources.by_key.update(origins or {})
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level, got {_json_kind(data)}")
    changes = [(*_parse_set(text), f"--set {_show_set(text)}") for text in overrides]
    changes += [(key, value, label) for label, key, value in flags]
    layout = _Layout(schema, _algorithm_of(data, changes, source, schema))
    _check_structure(data, source, layout)
    data = copy.deepcopy(data)
    for key, value, label in changes:
        _apply_override(data, key, value, label, sources, layout)
    # top-level and section duplicates were checked above; _build checks every key
    config = _build(data, sources, layout)
    for rule in (*schema.rules, *schema.algorithms[layout.algorithm].rules):
        problem = rule.check(config)
        if problem:
            raise ConfigError(f"{sources(*rule.keys)}: {rule.keys[0]}: {problem}")
    return config, sources
