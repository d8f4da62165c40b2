"""Tools an environment offers the model: a call format, a registry by name, a calculator and a sandboxed
Python runner. A tool that raises, times out or returns garbage gives an error observation — never a
dead episode.

Place in the dataflow: an env's `step` parses the model's turn with `parse_call`; if it is a call, it
awaits `ToolBox.call(...)` and returns the result text as the observation (appended, loss_mask False).

Call format (compact, so that a character-level model over "0123456789+-*=..." can emit it):
    NAME:ARGS          e.g. "calculator:2+3*4", "python:print(7*8)"
    ARGS=              with a default tool: a turn ending in "=" calls it, e.g. "7*8=" -> calculator("7*8")
Results come back as text; errors as "error: <one line>".

Python sandbox: `sys.executable -I -c CODE` in a fresh process, with RLIMIT_AS (memory) and RLIMIT_CPU set in
the child before exec, a wall-clock timeout (the process group is killed), stdin closed, an empty
environment and a temporary working directory. Network: when `unshare -rn` works here (user + network
namespaces), the child runs in a namespace with no network interface; otherwise `socket.socket` and
`socket.create_connection` are replaced by functions that raise before the user code runs — a Python-level
block that code importing `_socket` directly could bypass. `PythonTool.isolation` says which one is active.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import math
import operator
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

ToolFn = Callable[[str], Awaitable[str]]
_CALL = re.compile(r"^\s*([a-z_][a-z0-9_]*):(.*)$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    args: str


def parse_call(text: str, names: set[str] | frozenset[str], default: str | None = None) -> ToolCall | None:
    """The tool call in a model turn, or None when the turn is not a call (e.g. a final answer)."""
    m = _CALL.match(text)
    if m and m.group(1) in names:
        return ToolCall(m.group(1), m.group(2).strip())
    stripped = text.strip()
    if default is not None and stripped.endswith("="):
        return ToolCall(default, stripped[:-1])
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

    async def call(self, call: ToolCall) -> str:
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


async def calculator(args: str) -> str:
    return format_number(calculate(args))


# -- python sandbox -----------------------------------------------------------------------------------

_SOCKET_BLOCK = (
    "import socket as _s\n"
    "def _no_net(*a, **k):\n    raise OSError('network access is disabled in the python tool')\n"
    "_s.socket = _no_net; _s.create_connection = _no_net; _s.socketpair = _no_net\n"
    "del _s, _no_net\n"
)


def _unshare_works() -> bool:
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class PythonTool:
    """Runs a code snippet in a fresh, limited interpreter; returns its stdout (or 'error: ...')."""

    def __init__(self, *, timeout_s: float = 2.0, memory_mb: int = 256, cpu_s: int = 2,
                 max_output: int = 2000, isolation: str = "auto") -> None:
        if isolation not in ("auto", "namespace", "socket_block"):
            raise ValueError(f"PythonTool isolation must be auto, namespace or socket_block, got {isolation!r}")
        if isolation == "auto":
            isolation = "namespace" if _unshare_works() else "socket_block"
        self.isolation = isolation
        self.timeout_s = timeout_s
        self.memory_bytes = memory_mb * 2**20
        self.cpu_s = cpu_s
        self.max_output = max_output

    def _limits(self) -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    async def __call__(self, code: str) -> str:
        argv = [sys.executable, "-I", "-c", _SOCKET_BLOCK + code]
        if self.isolation == "namespace":
            argv = [shutil.which("unshare") or "unshare", "-rn", *argv]
        with tempfile.TemporaryDirectory(prefix="asyncrl-py-") as cwd:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, preexec_fn=self._limits,
                start_new_session=True)
            try:
                # Not communicate(): it would hold everything the child prints (GBs within the time limit)
                # in this process, past the child's own memory limit. Keep a bounded head / tail instead.
                out, err, _ = await asyncio.wait_for(asyncio.gather(
                    _drain(proc.stdout, self.max_output), _drain(proc.stderr, 8192, tail=True), proc.wait()),
                    self.timeout_s)
            except asyncio.TimeoutError:
                _kill_group(proc.pid)
                await proc.wait()
                return f"error: python timed out after {self.timeout_s:g}s"
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit status {proc.returncode}"
            if proc.returncode < 0:
                why = f"killed by signal {-proc.returncode} (cpu or memory limit)"
            return f"error: {why[:200]}"
        return out.decode(errors="replace")[: self.max_output].rstrip("\n")


async def _drain(stream: asyncio.StreamReader | None, cap: int, *, tail: bool = False) -> bytes:
    """Read `stream` to its end, keeping only its first (or, with `tail`, last) `cap` bytes."""
    buf = bytearray()
    if stream is None:
        return b""
    while chunk := await stream.read(65536):
        buf += chunk
        if len(buf) > cap:
            buf = buf[-cap:] if tail else buf[:cap]
    return bytes(buf)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
