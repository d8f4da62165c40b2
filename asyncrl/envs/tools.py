"""Tools an environment offers the model: a call format, a registry by name, a calculator and a sandboxed
Python runner. A tool that raises, times out or returns garbage gives an error observation — never a
dead episode.

Place in the dataflow: an env's `step` parses the model's turn with `parse_call`; if it is a call, it
awaits `ToolBox.call(...)` and returns the result text as the observation (appended, loss_mask False).

Call format (compact, so that a character-level model over "0123456789+-*=..." can emit it):
    NAME:ARGS          e.g. "calculator:2+3*4", "python:print(7*8)"
    ARGS=              with a default tool: a turn ending in "=" calls it, e.g. "7*8=" -> calculator("7*8")
Results come back as text; errors as "error: <one line>".

The same tools serve chat models through JSON schemas and their own call formats (hermes `<tool_call>`
blocks, ...): asyncrl/envs/tool_schema.py and tool_parsers.py; `TOOLS` below is the registry of both.

The Python tool (`PythonTool`: a fresh interpreter under resource limits, namespaces and Landlock where
the machine allows them) lives in asyncrl/envs/sandbox.py; its docstring says what is and is not confined.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import math
import operator
import re
from dataclasses import dataclass
from typing import Awaitable, Callable

from asyncrl.envs.sandbox import PythonTool

log = logging.getLogger(__name__)

ToolFn = Callable[[str], Awaitable[str]]
_CALL = re.compile(r"^\s*([a-z_][a-z0-9_]*):(.*)$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class TextCall:
    """A NAME:ARGS call: the tool's name and its one text argument (JSON-schema calls: tool_parsers.ToolCall)."""

    name: str
    args: str


def parse_call(text: str, names: set[str] | frozenset[str], default: str | None = None) -> TextCall | None:
    """The tool call in a model turn, or None when the turn is not a call (e.g. a final answer)."""
    m = _CALL.match(text)
    if m and m.group(1) in names:
        return TextCall(m.group(1), m.group(2).strip())
    stripped = text.strip()
    if default is not None and stripped.endswith("="):
        return TextCall(default, stripped[:-1])
    return None


class ToolBox:
    """Tools by name; `call` contains every failure as an error observation and counts it."""

    def __init__(self, tools: dict[str, ToolFn], *, timeout_s: float = 5.0, max_output: int = 200) -> None:
        self.tools = dict(tools)
        self.timeout_s = timeout_s
        self.max_output = max_output
        self.calls = 0
        self.errors = 0

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.tools)

    async def call(self, call: TextCall) -> str:
        self.calls += 1
        fn = self.tools.get(call.name)
        if fn is None:
            self.errors += 1
            return f"error: unknown tool {call.name!r}"
        try:
            out = await asyncio.wait_for(fn(call.args), self.timeout_s)
        except asyncio.TimeoutError:
            self.errors += 1
            return f"error: {call.name} timed out after {self.timeout_s:g}s"
        except Exception as exc:  # the tool's fault becomes the model's observation
            self.errors += 1
            return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
        if not isinstance(out, str):
            self.errors += 1
            return f"error: {call.name} returned {type(out).__name__}, not text"
        return out[: self.max_output]


# -- calculator ---------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPR = 200
MAX_POW = 64
MAX_BITS = 4096  # integer results (and operands of * and **) stay below this: the tool runs on the event loop


def calculate(expr: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses over numbers by walking the AST (no eval). ValueError else."""
    if len(expr) > MAX_EXPR:
        raise ValueError(f"expression longer than {MAX_EXPR} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expr!r:.40}") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_POW:
                raise ValueError(f"exponent {right} too large (at most {MAX_POW})")
            _check_size(node.op, left, right)
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax {type(node).__name__}")

    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result too large") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    return value


def _check_size(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuse, before computing it, an integer product or power of more than MAX_BITS bits: a few nested
    powers ("(((9**64)**64)**64)**64") would otherwise block the event loop for tens of seconds."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return  # float arithmetic is constant time (an overflow raises OverflowError)
    if isinstance(op, ast.Pow) and right > 0:
        bits = abs(left).bit_length() * right
    elif isinstance(op, ast.Mult):
        bits = abs(left).bit_length() + abs(right).bit_length()
    else:
        bits = max(abs(left).bit_length(), abs(right).bit_length())
    if bits > MAX_BITS:
        raise ValueError(f"result too large (over {MAX_BITS} bits)")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "(2+3)*4".
    """
    return format_number(calculate(expression))


# Tools by name: each entry makes a fresh tool (a PythonTool holds its limits). Every one takes a single text
# argument (NAME:ARGS) and has type hints and a docstring (its JSON schema, tool_schema.py).
TOOLS: dict[str, Callable[[], ToolFn]] = {"calculator": lambda: calculator, "python": PythonTool}


def make_toolbox(names: list[str], *, aliases: dict[str, str] | None = None, timeout_s: float = 5.0) -> ToolBox:
    """A ToolBox holding the registered tools `names` (plus `aliases`: short name -> registered name)."""
    tools: dict[str, ToolFn] = {}
    for name in [*names, *(aliases or {}).values()]:
        if name not in TOOLS:
            raise ValueError(f"unknown tool {name!r}; registered: {', '.join(sorted(TOOLS))}")
    for name in names:
        tools[name] = TOOLS[name]()
    for short, name in (aliases or {}).items():
        tools[short] = tools.get(name) or TOOLS[name]()
    return ToolBox(tools, timeout_s=timeout_s)
