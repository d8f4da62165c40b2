"""Tool-call formats: reading the calls out of a model turn, one parser per format, registered by name.

Place in the dataflow: a model turn (decoded text) ──► **parser.parse(text)** ──► ParsedTurn(content, calls)
──► `ToolSet.call` for each call (asyncrl/envs/tool_schema.py) ──► tool messages appended through the chat
template (asyncrl/envs/tool_env.py, `asyncrl.Runtime` episodes). Anything else that reads model output
(an OpenAI-compatible endpoint) can use the same parsers: `make_parser(name).parse(text)`.

Formats (`PARSERS`):
* `hermes` — what Qwen2.5/Qwen3, Hermes and many other instruct models emit (their chat templates describe
  it): any number of `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks in a turn; the
  text outside them is the content. A block left open at the end of the turn (the model ran out of tokens
  or stopped on "</tool_call>") is read to the end of the turn.
* `json` — the whole turn is one JSON object `{"name": ..., "arguments"|"parameters": {...}}` or a list of
  them (Llama 3.1's JSON tool calls; a leading `<|python_tag|>` and a ```json fence are skipped).
* `name_args` — the compact `NAME:ARGS` of the char-level examples (asyncrl/envs/tools.py): ARGS goes to the
  tool's one required parameter, so a char-level model can call a JSON-schema tool too.

A call that cannot be read (malformed JSON, no name, arguments that are not an object) is still a call:
`ToolCall.error` says why, and the tool set answers it with an error tool message instead of running it, so
the model learns from the error and the episode goes on.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.registry import Registry


def new_call_id() -> str:
    """An id in OpenAI's style; formats without ids (hermes) get one so that results can name their call."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_call_id)
    error: str = ""    # why the call could not be read; such a call is answered with this error, never run


@dataclass(slots=True)
class ParsedTurn:
    """A model turn split into its calls and the text around them."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    """A tool-call format. Parsers are built with the tools' schemas (`name_args` needs them)."""

    name: str

    def parse(self, text: str) -> ParsedTurn: ...
    def format_call(self, call: ToolCall) -> str: ...          # the text a model writes for `call`
    def system_prompt(self, schemas: list[dict[str, Any]]) -> str: ...  # for templates that ignore `tools=`


PARSERS: Registry[type] = Registry("tool-call format")


def make_parser(name: str, schemas: list[dict[str, Any]] | None = None) -> ToolParser:
    """The parser registered as `name`, built for the tools `schemas` (OpenAI function format)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call format {name!r} — one of {', '.join(PARSERS.names())}")
    return PARSERS.get(name)(schemas or [])


def _call_from(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A ToolCall from one decoded JSON value, or a ToolCall carrying the reason it is not one."""
    if not isinstance(obj, dict):
        return ToolCall("", error=f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", error='a tool call needs a "name" string')
    key = next((k for k in args_keys if k in obj), None)
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI's API carries them
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name, error=f"arguments of {name} are not valid JSON: {exc}")
    if not isinstance(args, dict):
        return ToolCall(name, error=f'"{key}" of {name} must be a JSON object, got {type(args).__name__}')
    call_id = obj.get("id")
    return ToolCall(name, args, **({"id": call_id} if isinstance(call_id, str) and call_id else {}))


def _tools_json(schemas: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)


@PARSERS.register("hermes")
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number per turn."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def __init__(self, schemas: list[dict[str, Any]]) -> None:
        del schemas  # the format does not depend on the tools

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        for m in self._BLOCK.finditer(text):
            body = m.group(1).strip()
            try:
                calls.append(_call_from(json.loads(body)))
            except json.JSONDecodeError as exc:
                calls.append(ToolCall("", error=f"the <tool_call> block is not valid JSON ({exc}): {body[:80]!r}"))
        return ParsedTurn(self._BLOCK.sub("", text).strip(), calls)

    def format_call(self, call: ToolCall) -> str:
        return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}) + "\n</tool_call>"

    def system_prompt(self, schemas: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to help with the user's request. The functions "
                f"are described by JSON schemas in <tools></tools> tags:\n<tools>\n{_tools_json(schemas)}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and arguments in <tool_call></tool_call> "
                'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@PARSERS.register("json")
class JsonParser:
    """The whole turn is one JSON call object or a list of them (Llama 3.1 style: "parameters" or "arguments")."""

    name = "json"
    _FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)

    def __init__(self, schemas: list[dict[str, Any]]) -> None:
        del schemas

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        fenced = self._FENCE.match(body)
        body = fenced.group(1) if fenced else body
        if not body.startswith(("{", "[")):
            return ParsedTurn(text.strip())
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            if re.match(r'^[\[{]\s*\{?\s*"name"', body):  # it set out to be a call
                return ParsedTurn("", [ToolCall("", error=f"the tool call is not valid JSON ({exc}): {body[:80]!r}")])
            return ParsedTurn(text.strip())
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, dict) and "name" in v for v in items) or not items:
            return ParsedTurn(text.strip())  # JSON, but not calls: an answer that happens to be JSON
        return ParsedTurn("", [_call_from(v, ("arguments", "parameters")) for v in items])

    def format_call(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "arguments": call.arguments})

    def system_prompt(self, schemas: list[dict[str, Any]]) -> str:
        return ("You can call these functions (JSON schemas):\n"
                f"{_tools_json(schemas)}\n\n"
                'To call one, answer with only a JSON object: {"name": <function-name>, "arguments": '
                "<args-json-object>} (a list of such objects calls several).")


@PARSERS.register("name_args")
class NameArgsParser:
    """`NAME:ARGS`: ARGS (the rest of the turn) is the value of the tool's one required parameter."""

    name = "name_args"
    _CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*):(.*)$", re.DOTALL)

    def __init__(self, schemas: list[dict[str, Any]]) -> None:
        self.param: dict[str, str] = {}
        for s in schemas:
            fn = s.get("function", {})
            params = fn.get("parameters", {})
            required = params.get("required") or list(params.get("properties", {}))
            if len(required) != 1:
                raise ValueError(f"tool-call format 'name_args': tool {fn.get('name')!r} takes {len(required)} "
                                 f"required parameters; NAME:ARGS can fill exactly one — use 'hermes' or 'json'")
            self.param[fn["name"]] = required[0]

    def parse(self, text: str) -> ParsedTurn:
        m = self._CALL.match(text)
        if not m or m.group(1) not in self.param:
            return ParsedTurn(text.strip())
        name = m.group(1)
        return ParsedTurn("", [ToolCall(name, {self.param[name]: m.group(2).strip()})])

    def format_call(self, call: ToolCall) -> str:
        return f"{call.name}:{call.arguments.get(self.param.get(call.name, ''), '')}"

    def system_prompt(self, schemas: list[dict[str, Any]]) -> str:
        names = ", ".join(s["function"]["name"] for s in schemas)
        return f"Tools: {names}. Call one as NAME:ARGS."
