"""`asyncrl config schema | init`: the config's JSON schema for TOML editors, and a commented starter config.

Place in the dataflow: beside the loader, read by nobody at run time. Both are generated from the schema's
Structs (asyncrl/config/schema.py, asyncrl/config/algo.py), so they never drift from what `load_config` accepts:
`config_schema()` is `msgspec.json.schema(Config)` plus the `extends` key (asyncrl/config/include.py), and
`starter_config()` walks the same Structs, writing each field's description as a comment above it. The starter's
set keys (`STARTER`) train the first-digit task on a tiny model; every other key is written commented out at its
default. (`asyncrl config show` is `config_to_toml` of a loaded config: asyncrl/config/loader.py.)
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import msgspec

from asyncrl.config.fields import _bounds, _choices, _description, _list_struct_type, _struct_type, _unwrap
from asyncrl.config.include import EXTENDS_DESCRIPTION
from asyncrl.config.schema import Config

__all__ = ["STARTER", "config_schema", "starter_config"]

# What `asyncrl config init` sets: a run that works as written (the first-digit task of examples/first_digit on a
# tiny random model built on first use, a minute or two on 2 CPU cores); a test launches it.
STARTER: dict[str, Any] = {
    "model": {"path": "runs/models/tiny-qwen2-starter", "build_tiny": {"vocab": "0123456789+="}},
    "data": {"source": "asyncrl.tasks.digits:first_digit", "max_prompt_len": 16},
    "rollout": {"group_size": 8, "max_new_tokens": 2},
    "reward": {"fn": "prefix_match", "answer_key": "answer"},
    "trainer": {"total_steps": 60, "prompts_per_step": 16, "micro_batch_size": 128, "lr": 3e-3,
                "eval_prompts": 100},
    "staleness": {"max_staleness": 1},
    "run": {"output_dir": "runs/starter"},
}

_HEADER = """\
# asyncrl run config, written by `asyncrl config init`. As written it trains a tiny random model on the
# first-digit task ("5382=" -> "5"): change [model] path to your Hugging Face model folder (and drop
# [model.build_tiny]), [data] and [reward] to your task. Every key is listed with what it does; the keys
# commented out hold their defaults.
#   asyncrl validate config.toml          # every problem at once, one line each
#   asyncrl config show config.toml       # the resolved config, every default included
#   asyncrl launch config.toml --local    # run it in this process
# Completion and checks in your editor (Taplo / Even Better TOML): asyncrl config schema --out asyncrl.schema.json
# and make `#:schema ./asyncrl.schema.json` the first line of this file. Docs: docs/config.md.
"""


def config_schema() -> dict[str, Any]:
    """The JSON schema of a config file: msgspec's for Config, plus `extends`, each table's description on the key
    that holds it (editors show the key's own description on hover), and no required keys: a file that extends
    another may leave [model] path to its base, so `asyncrl validate` checks required keys, not the editor."""
    schema = msgspec.json.schema(Config)
    defs = schema["$defs"]
    for d in defs.values():
        d.pop("required", None)
        for prop in d.get("properties", {}).values():
            ref = prop.get("$ref") or next((a["$ref"] for a in prop.get("anyOf", ()) if "$ref" in a), None)
            if ref and "description" not in prop and "description" in defs[ref.rsplit("/", 1)[1]]:
                prop["description"] = defs[ref.rsplit("/", 1)[1]]["description"]
    defs["Config"]["properties"]["extends"] = {
        "description": EXTENDS_DESCRIPTION,
        "anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1}}],
    }
    # draft-07: what TOML editors (Taplo) read; the schema uses nothing newer, and is valid 2020-12 too
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "asyncrl run config", **schema}


def starter_config() -> str:
    """The commented starter config: `STARTER` set, every other key of every table commented out at its default."""
    lines = _HEADER.splitlines()
    _table(lines, Config, "", STARTER, active=True)
    return "\n".join(lines).rstrip() + "\n"


def _table(lines: list[str], cls: type, path: str, values: dict[str, Any], *, active: bool,
           array: bool = False) -> None:
    """One table: its description, its header, its keys; then its sub-tables (TOML wants a table's own keys
    before any sub-table)."""
    off = "" if active else "# "
    if path:
        lines.append("")
        lines += _comment(_doc(cls))
        lines.append(f"{off}[[{path}]]" if array else f"{off}[{path}]")
    subtables = []
    for f in msgspec.structs.fields(cls):
        key = f"{path}.{f.encode_name}" if path else f.encode_name
        sub, items = _struct_type(f.type), _list_struct_type(f.type)
        if sub is not None or items is not None:
            subtables.append((f, key, sub, items))
            continue
        lines += _comment(_description(f.type) + _hint(f.type))
        if f.encode_name in values:
            lines.append(f"{off}{f.encode_name} = {_inline(values[f.encode_name])}")
        elif f.required:
            lines.append(f"# {f.encode_name} =   (required)")
        else:
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            if default is None:  # unset by default (TOML has no null): the key is simply left out
                lines.append(f"# {f.encode_name} =   (unset by default)")
            else:
                lines.append(f"# {f.encode_name} = {_inline(msgspec.to_builtins(default))}")
    for f, key, sub, items in subtables:
        given = values.get(f.encode_name)
        if items is not None:  # [[a.b]] tables: one commented-out example entry
            _table(lines, items, key, {}, active=False, array=True)
            continue
        on = active and (given is not None or (not f.required and f.default is not None))
        _table(lines, sub, key, given or {}, active=on)


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


def _hint(tp: Any) -> str:
    """The allowed values the description may not spell out: a Literal's choices, a number's bounds."""
    inner = _unwrap(tp)
    if "Literal" in repr(inner):
        hint = "one of: " + ", ".join(_choices(inner))
    else:
        hint = _bounds(tp).strip()
    return f" [{hint.replace(' ', _NBSP)}]" if hint else ""  # wrapped as one word


_NBSP = "\u00a0"


def _comment(text: str) -> list[str]:
    lines = textwrap.wrap(text, width=116, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False)
    return [line.replace(_NBSP, " ") for line in lines]


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _inline(value: Any) -> str:
    """A value as one line of TOML (arrays and tables inline)."""
    if isinstance(value, dict):
        items = ", ".join(f"{k if _BARE_KEY.fullmatch(k) else _inline(k)} = {_inline(v)}" for k, v in value.items())
        return "{" + (f" {items} " if items else "") + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return msgspec.toml.encode({"v": value}).decode().strip()[len("v = "):]
