"""Tools as chat models see them: a Python callable described by a JSON schema, arguments checked against it,
and a tool set that answers every call with one tool message — a result or an error, never an exception.

Place in the dataflow: `ToolSet.schemas` go into the chat template's `tools=` argument when an episode
starts (asyncrl/envs/transcript.py); each call the parser reads from a model turn (asyncrl/envs/tool_parsers.py)
goes through `ToolSet.call`, whose `ToolResult.message` (role "tool") is appended through the template.

A tool is any function, sync or async, with type hints and a Google-style docstring (an `Args:` section
describing every parameter). Its schema is made by `transformers.utils.get_json_schema`, in the OpenAI
function format: {"type": "function", "function": {"name", "description", "parameters"}}. Sync tools
run in a worker thread, so a slow one does not stall the event loop's other episodes; a timed-out sync
tool's thread runs on to its end (Python cannot stop a thread), an async one is cancelled.

Errors the model gets back as the tool message's content (`error: <one line>`), counted in `ToolSet.errors`:
a call that could not be read, an unknown tool, arguments that do not match the schema (missing, extra, of a
wrong type), a tool that raises, times out, returns "error: ..." or something that is neither text nor JSON.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jsonschema

from asyncrl.envs.tool_parsers import ToolCall
from asyncrl.registry import import_path

log = logging.getLogger(__name__)


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI-format JSON schema of `fn` from its signature, type hints and docstring."""
    from transformers.utils import get_json_schema

    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
    label = name or getattr(fn, "__name__", type(fn).__name__)
    try:
        schema = get_json_schema(target)
    except Exception as exc:  # noqa: BLE001 — transformers' DocstringParsing/TypeHintParsing exceptions and kin
        raise ValueError(f"tool {label!r}: no JSON schema ({str(exc).splitlines()[0]}) — give it type hints and a "
                         f"Google-style docstring with an 'Args:' line per parameter") from None
    schema["function"].pop("return", None)  # not part of OpenAI's function format
    if name:
        schema["function"]["name"] = name
    return schema


def _validation_schema(parameters: dict[str, Any], open_ended: bool) -> dict[str, Any]:
    """`parameters` as a JSON Schema validator needs it: OpenAPI's `nullable` (which get_json_schema writes for
    `X | None`) becomes a "null" type, and unknown arguments are refused unless the function takes **kwargs."""
    schema = copy.deepcopy(parameters)

    def fix(node: Any) -> None:
        if isinstance(node, dict):
            if node.pop("nullable", False) and "type" in node:
                types = node["type"] if isinstance(node["type"], list) else [node["type"]]
                node["type"] = [*types, "null"]
            for value in node.values():
                fix(value)
        elif isinstance(node, list):
            for value in node:
                fix(value)

    fix(schema)
    schema.setdefault("type", "object")
    if not open_ended:
        schema.setdefault("additionalProperties", False)
    return schema


class Tool:
    """A callable with its JSON schema; `check` names what is wrong with a call's arguments."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None,
                 schema: dict[str, Any] | None = None) -> None:
        self.fn = fn
        self.schema = schema if schema is not None else tool_schema(fn, name)
        self.name: str = self.schema["function"]["name"]
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = []  # uninspectable: trust the schema
        open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        parameters = self.schema["function"].get("parameters") or {"type": "object", "properties": {}}
        self._validator = jsonschema.Draft202012Validator(_validation_schema(parameters, open_ended))

    def check(self, arguments: dict[str, Any]) -> str:
        """'' when `arguments` fit the schema, else what is wrong (one line)."""
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(arguments))
        if error is None:
            return ""
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{where}: {error.message}" if where else error.message

    async def run(self, arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None)):
            return await self.fn(**arguments)
        result = await asyncio.to_thread(self.fn, **arguments)
        return await result if inspect.isawaitable(result) else result


# Tools named by a string, built once per process: an env builds its tool set for every episode, and building a
# PythonTool probes the machine's namespaces with subprocesses (and a schema parses a docstring). Tools keep no
# per-call state, so the episodes of a process share them.
_NAMED: dict[str, Tool] = {}


def resolve_tool(spec: str | Callable[..., Any] | Tool) -> Tool:
    """A Tool from a registered name ("calculator", "python"), an import path "pkg.module:function", a
    callable or a Tool. ValueError with one line otherwise."""
    if isinstance(spec, Tool):
        return spec
    if callable(spec):
        return Tool(spec)
    if not isinstance(spec, str):
        raise ValueError(f"a tool is a registered name, 'pkg.module:function' or a callable, got {spec!r:.60}")
    if spec not in _NAMED:
        _NAMED[spec] = _named_tool(spec)
    return _NAMED[spec]


def _named_tool(spec: str) -> Tool:
    from asyncrl.envs.tools import TOOLS

    if spec in TOOLS:
        return Tool(TOOLS[spec](), name=spec)
    if ":" not in spec:
        raise ValueError(f"unknown tool {spec!r} — registered: {', '.join(sorted(TOOLS))}; or an import path "
                         f"'pkg.module:function'")
    fn = import_path(spec)
    if not callable(fn):
        raise ValueError(f"tool {spec!r} is a {type(fn).__name__}, not a function")
    return Tool(fn)


@dataclass(slots=True)
class ToolResult:
    """What a call produced: the tool message's content, and whether it is an error."""

    call: ToolCall
    content: str
    error: bool = False

    @property
    def message(self) -> dict[str, str]:
        """The tool message for the chat template (role "tool", the tool's name, the call's id)."""
        msg = {"role": "tool", "name": self.call.name, "content": self.content}
        if self.call.id:
            msg["tool_call_id"] = self.call.id
        return msg


class ToolSet:
    """Tools by name with their schemas; `call` answers every call with a ToolResult and counts it."""

    def __init__(self, tools: Sequence[str | Callable[..., Any] | Tool], *, timeout_s: float = 5.0,
                 max_output: int = 2000) -> None:
        self.tools: dict[str, Tool] = {}
        for spec in tools:
            tool = resolve_tool(spec)
            if tool.name in self.tools:
                raise ValueError(f"tool {tool.name!r} is given twice")
            self.tools[tool.name] = tool
        self.timeout_s = timeout_s
        self.max_output = max_output
        self.calls = 0
        self.errors = 0

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas (OpenAI function format), for the chat template's `tools=`."""
        return [t.schema for t in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolResult:
        self.calls += 1
        result = await self._call(call)
        self.errors += result.error
        return result

    async def _call(self, call: ToolCall) -> ToolResult:
        if call.error:
            return ToolResult(call, f"error: {call.error}", True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call, f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}", True)
        wrong = tool.check(call.arguments)
        if wrong:
            return ToolResult(call, f"error: {call.name}: invalid arguments: {wrong}", True)
        try:
            out = await asyncio.wait_for(tool.run(call.arguments), self.timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(call, f"error: {call.name} timed out after {self.timeout_s:g}s", True)
        except Exception as exc:  # noqa: BLE001 — the tool's fault becomes the model's observation
            text = str(exc).strip().splitlines()
            return ToolResult(call, f"error: {type(exc).__name__}: {text[0][:200] if text else ''}", True)
        if not isinstance(out, str):
            try:
                out = json.dumps(out, ensure_ascii=False)
            except (TypeError, ValueError):
                return ToolResult(call, f"error: {call.name} returned {type(out).__name__}, not text or JSON", True)
        return ToolResult(call, out[: self.max_output], out.startswith("error:"))
