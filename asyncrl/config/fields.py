"""Reading a config file and converting it field by field against the schema, every problem one line.

Place in the dataflow: `asyncrl.config.load_config` reads the TOML here (`read_toml`, `parse_value` for
`--set` values), converts it with `convert_struct` (unknown keys with a did-you-mean, each value alone with
`msgspec.convert` against its annotated type, the field's description quoted as the hint), then runs its
cross-field checks; `drop_none` prepares a Config for writing back as TOML.
"""

from __future__ import annotations

import difflib
import re
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec


class ConfigError(Exception):
    """A config with problems; `errors` holds one line per problem."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


# -- reading --------------------------------------------------------------------------------------------


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read the config ({exc})"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        at = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        line = at.group(1) if at else str(text.count("\n") + 1)
        reason = re.sub(r"\s*\(at [^)]*\)$", "", msg)
        col = f" at column {at.group(2)}" if at else " at the end of the file"
        raise ConfigError([f"{path}:{line}: TOML syntax error: {reason}{col}"]) from None


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # e.g. run.output_dir=runs/x


def drop_none(obj: Any) -> Any:
    """TOML has no null: an unset optional table (e.g. model.build_tiny) is simply left out."""
    if isinstance(obj, dict):
        return {k: drop_none(v) for k, v in obj.items() if v is not None}
    return obj


# -- field-by-field validation --------------------------------------------------------------------------

_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "array": "a list", "object": "a table", "null": "nothing"}


def convert_struct(cls: type, raw: Any, path: str, errors: list[str], broken: set[str]) -> Any:
    """Build `cls` from a TOML table one field at a time, appending one line per problem."""
    fields = msgspec.structs.fields(cls)
    known = [f.encode_name for f in fields]
    for key in raw:
        if key not in known:
            what = "unknown key" if path else "unknown section"
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
            errors.append(f"{_join(path, key)}: {what} — {hint}")
    kwargs: dict[str, Any] = {}
    for f in fields:
        fpath = _join(path, f.name)
        sub = _struct_type(f.type)
        if f.encode_name not in raw:
            if f.required:
                broken.add(fpath)
                kwargs[f.name] = None  # placeholder: checks reading this path are skipped
                what = f"missing required section — add a [{fpath}] table" if sub else "missing required key"
                errors.append(_line(fpath, what, f.type))
            continue
        value = raw[f.encode_name]
        item = _list_struct_type(f.type)
        if item is not None and isinstance(value, list):  # [[section.key]] tables: each entry field by field
            if all(isinstance(v, dict) for v in value):
                kwargs[f.name] = [convert_struct(item, v, f"{fpath}[{i}]", errors, broken) for i, v in enumerate(value)]
                continue
            errors.append(_line(fpath, f"expected a list of tables [[{fpath}]], got {_show(value)}", f.type))
        elif sub is not None and not (isinstance(value, bool) and _is_switch(f.type)):
            if isinstance(value, dict):
                kwargs[f.name] = convert_struct(sub, value, fpath, errors, broken)
                continue
            either = "true, false or " if _is_switch(f.type) else ""
            errors.append(_line(fpath, f"expected {either}a table [{fpath}], got {_show(value)}", f.type))
        else:
            try:
                kwargs[f.name] = msgspec.convert(value, f.type)
                continue
            except msgspec.ValidationError as exc:
                suffix, text = _rephrase(str(exc), value, f.type)
                errors.append(_line(fpath + suffix, text, f.type))
        broken.add(fpath)
        if f.required:
            kwargs[f.name] = None
    return cls(**kwargs)


def _rephrase(msg: str, value: Any, tp: Any) -> tuple[str, str]:
    """msgspec's 'Expected `float` > 0.0 - at `$[1]`' -> ('[1]', 'expected a number > 0, got -1')."""
    body, _, loc = msg.partition(" - at `$")
    loc = loc.rstrip("`")
    for index, key, any_key in re.findall(r"\[(\d+)\]|\.(\w+)|(\[\.\.\.\])", loc):
        if any_key:  # a table's value (msgspec does not say which key): name it when the table has one
            if not (isinstance(value, dict) and len(value) == 1):
                break
            (key, value), = value.items()
            loc = loc.replace("[...]", f".{key}", 1)
            continue
        try:
            value = value[int(index)] if index else value[key]
        except (LookupError, TypeError):
            break
    m = re.fullmatch(r"Expected `(\w+)`(.*?)(?:, got `\w+`)?", body)
    if m:
        kind, constraint = _KINDS.get(m.group(1), m.group(1)), re.sub(r"(\d)\.0\b", r"\1", m.group(2))
        if not constraint and not loc:  # a type mismatch: still say which range is allowed
            constraint = _bounds(tp)
        if m.group(1) == "str" and constraint == " of length >= 1":
            kind, constraint = "a non-empty string", ""
        text = f"expected {kind}{constraint}"
    elif body.startswith("Invalid enum value"):
        text = "expected one of " + ", ".join(_choices(_unwrap(tp)))
    else:
        text = body[:1].lower() + body[1:]
    return loc, f"{text}, got {_show(value)}"


def _choices(tp: Any) -> list[str]:
    """The allowed values of a Literal (or a union of Literals and plain types) as TOML spells them:
    Literal["auto"] | bool -> ["'auto'", "true", "false"]."""
    out: list[str] = []
    for arg in typing.get_args(tp) or (tp,):
        if typing.get_origin(arg) is typing.Literal:
            out += _choices(arg)
        elif arg is bool:
            out += ["true", "false"]
        elif arg is type(None):  # an optional choice: leaving the key out is how TOML says "unset"
            continue
        elif isinstance(arg, type):
            out.append(f"a {arg.__name__}")
        else:
            out.append(repr(arg))
    return out


def _bounds(tp: Any) -> str:
    """' > 0 and <= 1' from a field's Meta(gt=0, le=1); '' when it has no numeric bounds."""
    ops = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
    parts = [f"{op} {getattr(meta, key):g}" for meta in getattr(tp, "__metadata__", ())
             if isinstance(meta, msgspec.Meta) for key, op in ops if getattr(meta, key) is not None]
    return (" " + " and ".join(parts)) if parts else ""


def _unwrap(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def _list_struct_type(tp: Any) -> type | None:
    """The Struct class of a field typed `list[SomeStruct]`, else None."""
    inner = _unwrap(tp)
    if typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner) or (None,)
        if isinstance(item, type) and issubclass(item, msgspec.Struct):
            return item
    return None


def _struct_type(tp: Any) -> type | None:
    """The Struct class of a field typed `SomeStruct` or `SomeStruct | None`, else None."""
    if _list_struct_type(tp) is not None:
        return None
    for t in (_unwrap(tp), *typing.get_args(_unwrap(tp))):
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            return t
    return None


def _is_switch(tp: Any) -> bool:
    """A table that `true` / `false` may stand for (`SomeStruct | bool | None`, e.g. logging.wandb)."""
    return bool in typing.get_args(_unwrap(tp))


def _description(tp: Any) -> str:
    for meta in getattr(tp, "__metadata__", ()):
        if isinstance(meta, msgspec.Meta) and meta.description:
            return meta.description
    return ""


def _line(path: str, problem: str, tp: Any) -> str:
    hint = _description(tp)
    return f"{path}: {problem}" + (f" — {hint}" if hint else "")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    return repr(value)
