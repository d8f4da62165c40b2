"""A reward worker process (`reward.isolation = "process"`): resolves the run's per-sample reward functions
(`reward.fn` or each [[reward.functions]] entry, and `reward.cost_fn`) from their spec strings and answers
calls on its stdin/stdout, one at a time, until stdin closes.

Place in the dataflow: `ProcessRewards` (process.py) starts a few of these per Scorer, as
`python -m asyncrl.rewards.worker SETTINGS_JSON`. Only spec strings and msgpack messages cross the pipe:
nothing needs pickling, and nothing a worker sends can make its parent run code.

Wire: every message is a 4-byte little-endian length and a msgpack body (at most `MAX_MESSAGE` bytes).
The worker sends one `Hello`, then answers each `Request` (one function, one sample) with one `Reply`.

The worker dies with its parent: PR_SET_PDEATHSIG (Linux) kills it when the thread that started it ends,
and an idle worker also ends when its stdin closes.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import struct
import sys
from typing import IO, Any, TypeVar

import msgspec

MAX_MESSAGE = 64 * 2**20  # a longer length prefix is a broken (or hostile) peer, not a message
_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("<I")
T = TypeVar("T")


class WorkerFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    fn: str                      # a built-in rule name or 'pkg.module:function'
    path: str                    # the TOML key holding it (reward.fn, reward.functions[i].fn, reward.cost_fn)


class WorkerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    functions: list[WorkerFunction]  # a Request names one by its index
    answer_key: str
    max_memory_mb: int = 0       # RLIMIT_AS of the worker; 0 = no limit
    parent_pid: int              # exits at once if the parent died before the death signal was armed


class Hello(msgspec.Struct, kw_only=True):
    error: str = ""              # empty: the functions resolved; else the one line naming the TOML key to fix


class Request(msgspec.Struct, kw_only=True):
    fn: int                      # index into WorkerSettings.functions
    prompt: str
    completion: str
    row: dict[str, Any]          # the dataset row (JSON values)
    finish_reason: str | None = None     # what the run knows of the sample (base.Call)
    completion_tokens: int | None = None


class Reply(msgspec.Struct, kw_only=True):
    value: float | dict[str, float] = 0.0  # a number, or named components
    error_type: str = ""         # empty: `value` is the result; else the exception's (qualified) type name
    error: str = ""              # str() of that exception
    error_args: list[Any] = []   # its args, each a plain value or its repr (to rebuild a builtin type as it was)
    last: bool = False           # the worker exits after this reply (MemoryError: what leaked goes with it)


def send(stream: IO[bytes], message: msgspec.Struct | bytes) -> None:
    """One message: a Struct, or one already msgpack-encoded."""
    body = message if isinstance(message, bytes) else msgspec.msgpack.encode(message)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def receive(stream: IO[bytes], kind: type[T]) -> T | None:
    """The next message, or None at the end of the stream. Raises msgspec.DecodeError/ValueError on a
    malformed one."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes (at most {MAX_MESSAGE})")
    body = stream.read(size)
    if len(body) < size:
        return None
    return msgspec.msgpack.decode(body, type=kind)


def error_type(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (str, bytes, int, float, bool)) else repr(value)


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no usable libc: stdin closing still ends an idle worker
            pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _limit(max_memory_mb: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a reward that segfaults leaves no core files
    if max_memory_mb > 0:
        limit = max_memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def serve(settings: WorkerSettings, wire_in: IO[bytes], wire_out: IO[bytes]) -> None:
    """Resolve the functions, say hello, answer requests until `wire_in` ends."""
    from asyncrl.rewards.loader import call_reward, resolve_function

    fns = []
    path = ""
    try:
        for f in settings.functions:
            path = f.path
            fns.append(resolve_function(f.fn, settings.answer_key, f.path, isolation="process"))
    except ValueError as exc:
        send(wire_out, Hello(error=str(exc)))
        return
    except Exception as exc:  # noqa: BLE001 - the user's module raised while being imported
        send(wire_out, Hello(error=f"{path}: importing it raised {error_type(exc)}: {exc}"))
        return
    send(wire_out, Hello())
    while (req := receive(wire_in, Request)) is not None:
        try:
            if not 0 <= req.fn < len(fns):
                raise IndexError(f"no reward function #{req.fn} (this worker has {len(fns)})")
            value = call_reward(fns[req.fn], req.prompt, req.completion, req.row, req.finish_reason,
                                req.completion_tokens)
            reply = Reply(value=value)
        except MemoryError as exc:
            send(wire_out, Reply(error_type="MemoryError", error=str(exc), last=True))
            return
        except Exception as exc:  # noqa: BLE001 - user code; the parent reports it
            reply = Reply(error_type=error_type(exc), error=str(exc), error_args=[_plain(a) for a in exc.args])
        send(wire_out, reply)


def main(argv: list[str]) -> None:
    settings = msgspec.json.decode(argv[0], type=WorkerSettings)
    # the wire gets private descriptors; what the user's code prints goes to stderr, its stdin is empty
    wire_in, wire_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    _die_with_parent(settings.parent_pid)
    _limit(settings.max_memory_mb)
    try:
        serve(settings, wire_in, wire_out)
    except BrokenPipeError:  # the parent went away mid-reply: nobody to answer
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
