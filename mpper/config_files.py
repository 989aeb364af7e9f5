"""Config files on disk: reading one (one-line errors), the configs mpper ships, how a
name or a path picks a file, and ``"base"``: a config that extends another.

Names and paths (``--config`` and ``"base"`` follow the same rule):

- a bare name (no ``/``, no ``.json`` suffix), such as ``cartpole``, is always a config
  mpper ships (``mpper/configs/cartpole.json``), even when a file of that name exists in
  the current directory: a shipped name never runs a file someone left there;
- anything else (``./cartpole``, ``cartpole.json``, ``configs/x.json``, an absolute path)
  is a file. ``--config`` reads it from the current directory; ``"base"`` reads it from
  the directory of the file that names it.

``"base"``: the file's sections are merged key by key over its base's (a key's value,
an object such as ``env.kwargs`` or a list included, replaces the base's value whole);
top-level keys likewise. A base may have a base; a cycle or a missing base is a
:class:`ConfigError`. A run directory's ``config.json`` is always the whole resolved config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .safe_files import ReceivedFileError, read_received

__all__ = [
    "BASE_KEY",
    "SHIPPED_CONFIGS",
    "ConfigError",
    "config_name_path",
    "is_bare_name",
    "read_config_file",
    "read_config_json",
    "resolve_bases",
    "shipped_configs",
]

SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"
BASE_KEY = "base"
_MAX_BASE_DEPTH = 16  # far beyond any real chain; bounds what one file can make mpper read
_MAX_CONFIG_BYTES = 16 << 20  # a config is a few KB; a larger "config" is not one


class ConfigError(ValueError):
    """A mistake in a config file, a ``--set`` override or a flag. ``str(err)`` is one line
    naming the file (or the override), the dotted key and what is allowed."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).splitlines()))


class _Obj(dict):
    """A JSON object that remembers keys it saw twice."""

    duplicates: list


def _pairs_hook(pairs):
    obj = _Obj()
    obj.duplicates = []
    for k, v in pairs:
        if k in obj:
            obj.duplicates.append(k)
        obj[k] = v
    return obj


def shipped_configs() -> list[str]:
    """The names of the configs that come with mpper (``mpper/configs/NAME.json``)."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))


def is_bare_name(text: str) -> bool:
    """Whether ``text`` names a shipped config (``cartpole``) rather than a file
    (``./cartpole``, ``cartpole.json``, ``a/b``)."""
    return bool(text) and "/" not in text and "\\" not in text and not text.endswith(".json") and text not in (".", "..")


def config_name_path(text: str, relative_to: Path | None = None, what: str = "--config") -> Path:
    """The file ``text`` names (see the module docstring): a shipped config for a bare
    name, else a path (relative ones against ``relative_to`` when given). ConfigError,
    naming the shipped configs, for a bare name mpper does not ship."""
    if not is_bare_name(text):
        path = Path(text).expanduser()
        return path if relative_to is None or path.is_absolute() else relative_to / path
    shipped = SHIPPED_CONFIGS / f"{text}.json"
    if shipped.is_file():
        return shipped
    raise ConfigError(f"{what} {text}: mpper ships no config of that name (shipped: {', '.join(shipped_configs())}); "
                      f"a file is named as a path: ./{text} or {text}.json")  # fmt: skip


def read_config_json(path: str | Path, label: str | None = None, follow_links: bool = True) -> dict:
    """One JSON config file as an object (duplicate keys remembered, see ``_Obj``), or a
    one-line ConfigError: missing, not a regular file (a FIFO or device, whose reads never
    end, is refused unread: :func:`mpper.safe_files.read_received`), a symbolic link unless
    ``follow_links`` (a file the user named may be a link of theirs; a run directory's,
    received, may not), unreadable, too large, not UTF-8, empty, invalid JSON, or not an
    object."""
    label = str(path) if label is None else label
    p = Path(path)
    try:
        raw = read_received(p, _MAX_CONFIG_BYTES, follow_links=follow_links)
    except ReceivedFileError as e:
        if p.is_dir() and not p.is_symlink():
            raise ConfigError(f"{label}: is a directory, expected a JSON file") from None
        raise ConfigError(str(e)) from None
    except FileNotFoundError:
        raise ConfigError(f"{label}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{label}: is a directory, expected a JSON file") from None
    except PermissionError:
        raise ConfigError(f"{label}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{label}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{label}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise ConfigError(f"{label}: the file is empty, expected a JSON object")
    try:
        data = json.loads(text, object_pairs_hook=_pairs_hook)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{label}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{label}: invalid JSON: nested too deeply") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"{label}: invalid JSON: a number of more than {sys.get_int_max_str_digits():,} "
                          f"digits") from None  # fmt: skip
    return data


def _check_duplicates(data: dict, label: str) -> None:
    """Duplicate keys at the top level or in a section: each file is checked by itself,
    since merging forgets them."""
    if getattr(data, "duplicates", None):
        raise ConfigError(f"{label}: {data.duplicates[0]}: duplicate key")  # type: ignore[attr-defined]
    for key, value in data.items():
        if getattr(value, "duplicates", None):
            raise ConfigError(f"{label}: {key}.{value.duplicates[0]}: duplicate key")


def read_config_file(path: str | Path, label: str | None = None,
                     allow_base: bool = True) -> tuple[Any, dict[str, str]]:  # fmt: skip
    """``path`` read as :func:`read_config_json` with its ``"base"`` chain resolved.

    Returns ``(data, origins)``: the merged JSON object (without ``"base"``), and for
    each key whose value came from a base file, ``{"section.key" or "key": base label}``
    so that an error names the file that set the value. Not an object: returned as read,
    for the caller's error. ``allow_base=False`` (a run directory's ``config.json``,
    always a whole config): a ``"base"`` there is a ConfigError, and no other file is read.
    """
    label = str(path) if label is None else label
    data = read_config_json(path, label, follow_links=allow_base)  # a run directory's own: no link either
    if not isinstance(data, dict):
        return data, {}
    _check_duplicates(data, label)
    if BASE_KEY in data and not allow_base:
        raise ConfigError(f'{label}: {BASE_KEY}: a run directory\'s config.json is a whole config and names no '
                          f"base; received files name no other file to read")  # fmt: skip
    return resolve_bases(data, label, Path(path))


def resolve_bases(data: dict, label: str = "<config>", path: Path | None = None) -> tuple[dict, dict[str, str]]:
    """``data`` (a config object) with its ``"base"`` chain resolved, as
    :func:`read_config_file` returns it. ``path``: the file ``data`` was read from, whose
    directory a relative base is read from (without it, the current directory)."""
    if BASE_KEY not in data:
        return data, {}
    here = Path(path).resolve() if path is not None else None
    chain = [(here, (here.parent if here else Path.cwd()), label, data)]  # (file, its directory, label, object)
    while BASE_KEY in chain[-1][3]:
        _, directory, here_label, here_data = chain[-1]
        base = here_data[BASE_KEY]
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{here_label}: {BASE_KEY}: expected the name of a shipped config or a path to a JSON "
                              f"file, got {json.dumps(base)}")  # fmt: skip
        base_path = config_name_path(base, relative_to=directory, what=f"{here_label}: {BASE_KEY}:")
        resolved = base_path.resolve()
        seen = [c[0] for c in chain]
        if resolved in seen:
            names = " -> ".join([c[2] for c in chain[seen.index(resolved):]] + [base])
            raise ConfigError(f"{here_label}: {BASE_KEY}: a cycle of bases ({names})")
        if len(chain) > _MAX_BASE_DEPTH:
            raise ConfigError(f"{label}: {BASE_KEY}: more than {_MAX_BASE_DEPTH} bases in a chain")
        base_label = base if is_bare_name(base) else str(base_path)
        base_data = read_config_json(base_path, f"{here_label}: {BASE_KEY} {base_label}")
        if not isinstance(base_data, dict):
            raise ConfigError(f"{base_label} (the base of {here_label}): expected a JSON object at the top level")
        _check_duplicates(base_data, base_label)
        chain.append((resolved, resolved.parent, base_label, base_data))
    merged: dict = {}
    origins: dict[str, str] = {}  # keys set by a base; the named file's own keys are its label's
    for depth in range(len(chain) - 1, -1, -1):  # the deepest base first, the named object last
        file_label, file_data = chain[depth][2:]
        for key, value in file_data.items():
            if key == BASE_KEY:
                continue
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key].update(value)  # a section: key by key
                set_here = [f"{key}.{sub}" for sub in value]
            else:
                merged[key] = dict(value) if isinstance(value, dict) else value
                set_here = [key] + ([f"{key}.{sub}" for sub in value] if isinstance(value, dict) else [])
                for dotted in [k for k in origins if k.startswith(key + ".")]:
                    del origins[dotted]
            for dotted in set_here:
                if depth == 0:
                    origins.pop(dotted, None)
                else:
                    origins[dotted] = file_label
    return merged, origins
