"""`extends = "base.toml"` and `${env:VAR}` in a config file: the TOML dict a run's config resolves to.

Place in the dataflow: `asyncrl.config.load_config` calls `read_config(path)` first; it reads the file and the
files it extends (`read_toml`: syntax errors name file:line), merges them and replaces `${env:...}` in string
values, and returns the resolved dict with the file each value came from, so that an error about a value set in
a base file names that file and line. `--set` overrides are applied after this, without interpolation (the shell
already expands `$VAR` on a command line). The run directory keeps the resolved config (`config_to_toml`, which
escapes a literal `${` as `$${`), so `launch --resume` never reads the base files again.

- `extends = "base.toml"` or `extends = ["a.toml", "b.toml"]`: paths relative to the folder of the file that
  names them; the bases merge in order, then the file itself on top. Tables merge key by key, all the way down;
  any other value (a number, a string, an array, an array of tables) replaces the base's. Bases may extend
  further; a cycle is one error naming it.
- `${env:VAR}` is replaced by the environment variable VAR, `${env:VAR:-text}` by `text` when VAR is unset or
  empty; `$${` is a literal `${`. Interpolation works on text: the value stays a string (a number for a numeric
  key comes through `--set key=$VAR` instead).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from asyncrl.config.fields import ConfigError, read_toml

__all__ = ["EXTENDS_DESCRIPTION", "blame", "escape_interpolation", "forget", "read_config"]

EXTENDS_DESCRIPTION = ("base config file(s) this one builds on, relative to this file's folder: tables merge key by "
                       "key, other values from this file replace the base's")

# `$${` (a literal `${`), `${env:NAME}` / `${env:NAME:-default}`, or any other `${...}` (an error: say the fix)
_REF = re.compile(r"\$\$\{|\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\{[^}]*\}?")


def read_config(path: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """The TOML dict of `path` with its bases merged in and `${env:...}` replaced, and for each value (dotted
    key path) the file that set it; raise ConfigError (one line per problem)."""
    raw, origins = _resolve(Path(path), [])
    errors: list[str] = []
    raw = _interpolate(raw, "", errors)
    if errors:
        raise ConfigError(blame(errors, origins, Path(path)))
    return raw, origins


def _resolve(path: Path, chain: list[Path]) -> tuple[dict[str, Any], dict[str, Path]]:
    raw = read_toml(path)
    bases = raw.pop("extends", [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError([f"{path}: extends: expected a file name or a list of file names, e.g. "
                           f"extends = \"../base.toml\", got {bases!r}"])
    merged: dict[str, Any] = {}
    origins: dict[str, Path] = {}
    here = [*chain, path]
    for name in bases:
        base = Path(os.path.normpath(path.parent / name))
        seen = [p.resolve() for p in here]
        if base.resolve() in seen:
            cycle = " -> ".join(str(p) for p in here[seen.index(base.resolve()):] + [base])
            raise ConfigError([f"{path}: extends = {name!r} makes a cycle: {cycle} — remove one of these extends"])
        if not base.is_file():
            raise ConfigError([f"{path}: extends = {name!r}: no file {base} (a relative path is read from the "
                               f"folder of the file that names it)"])
        base_raw, base_origins = _resolve(base, here)
        _merge(merged, base_raw)
        origins.update(base_origins)
    _merge(merged, raw)
    origins.update((key, path) for key in _leaves(raw, ""))
    return merged, origins


def _merge(into: dict[str, Any], top: dict[str, Any]) -> None:
    """Deep merge, in place: tables merge recursively, any other value of `top` replaces `into`'s."""
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _leaves(raw: dict[str, Any], prefix: str) -> list[str]:
    out: list[str] = []
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else key
        out += _leaves(value, dotted) if isinstance(value, dict) and value else [dotted]
    return out


def _interpolate(value: Any, key: str, errors: list[str]) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, f"{key}.{k}" if key else k, errors) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, f"{key}[{i}]", errors) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def replace(m: re.Match[str]) -> str:
        text, name, default = m.group(0), m.group(1), m.group(2)
        if text == "$${":
            return "${"
        if name is None:
            errors.append(f"{key}: {text!r} is not an interpolation asyncrl knows — write ${{env:VAR}} or "
                          f"${{env:VAR:-default}} for an environment variable, or $${{ for a literal ${{")
            return text
        found = os.environ.get(name)
        if found:
            return found
        if default is not None:
            return default
        errors.append(f"{key}: environment variable {name} is not set — export {name}=..., or give a default: "
                      f"${{env:{name}:-value}}")
        return text

    return _REF.sub(replace, value)


def escape_interpolation(value: Any) -> Any:
    """A resolved value written back as TOML: each literal `${` becomes `$${`, so reading it gives it back."""
    if isinstance(value, dict):
        return {k: escape_interpolation(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escape_interpolation(v) for v in value]
    if isinstance(value, str):
        return value.replace("${", "$${")
    return value


_PATH = re.compile(r"[A-Za-z_][\w-]*(?:\[\d+\])*(?:\.[A-Za-z_][\w-]*(?:\[\d+\])*)*")


def blame(errors: list[str], origins: dict[str, Path], top: Path) -> list[str]:
    """Prefix `file:line: ` to each error about a value that a base file (not `top`) set."""
    out = []
    for line in errors:
        m = _PATH.match(line)
        key = _origin_key(m.group(0), origins) if m else None
        origin = origins[key] if key is not None else None
        if origin is None or origin == top:
            out.append(line)
            continue
        at = _line_of(origin, key)
        out.append(f"{origin}:{at}: {line}" if at else f"{origin}: {line}")
    return out


def forget(origins: dict[str, Path], key: str) -> None:
    """A `--set key=...` replaced `key` and everything under it: no file set those values any more."""
    for k in [k for k in origins if k == key or k.startswith(key + ".")]:
        del origins[k]


def _origin_key(path: str, origins: dict[str, Path]) -> str | None:
    """The longest prefix of `path` (indices dropped) that a file set: 'env.kwargs' for 'env.kwargs.x'."""
    parts = re.sub(r"\[\d+\]", "", path).split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in origins:
            return key
    return None


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?")
_KEY = re.compile(r"^\s*([A-Za-z0-9_.\"' -]+?)\s*=")


def _line_of(path: Path, key: str | None) -> int | None:
    """The line of `path` that sets dotted `key` (a table header, then `name =`), or None when the text does not
    show it plainly (e.g. a key inside an inline table); only to point at it."""
    if key is None:
        return None
    table = ""
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if m := _HEADER.match(text):
            table = _dotted(m.group(1))
            if table == key:
                return number
        elif m := _KEY.match(text):
            name = _dotted(m.group(1))
            if (f"{table}.{name}" if table else name) == key:
                return number
    return None


def _dotted(text: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in text.split("."))
