"""Resolve `reward.fn` into a callable and call it safely.

Place in the dataflow: building a run resolves `resolve_reward(cfg.reward.fn, cfg.reward.answer_key)` once
(asyncrl/build.py); the Scorer then scores a batch of trajectories with `call_rewards_async` (one call after
the other on a worker thread, each bounded by `reward.timeout_s`) and the Evaluator single completions with
`call_reward_async`; both wrap `call_reward`. `asyncrl validate` calls `check_reward`. A call that hangs past
its timeout cannot be killed: it keeps its daemon thread, counted by the caller's `HungCalls`, which bounds
them (`MAX_HUNG_CALLS` a role): a reward that hangs now and then does not pile up threads over a long run.

The calling convention of a reward function is

    fn(prompt: str, completion: str, **fields) -> float

where `fields` are the dataset row's fields (minus any named `prompt` or `completion`, which would clash
with the two positional arguments). A user function given as 'pkg.module:function' must name its first two
parameters `prompt` and `completion` (or take `*args`). If it takes `**kwargs` it receives every row field;
otherwise it receives only the row fields it names as parameters, so `def f(prompt, completion, answer)`
works on rows with many more fields. A named parameter without a default that the row lacks is a
ValueError at call time (the scorer catches and counts it).
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import math
import threading
from typing import Any

from asyncrl.registry import import_path
from asyncrl.rewards.rules import RULES, RewardFn

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_RESERVED = ("prompt", "completion")


def resolve_reward(spec: str, answer_key: str) -> RewardFn:
    """A built-in rule name or 'pkg.module:function' -> fn(prompt, completion, **fields) -> float.

    Raises ValueError with one line starting 'reward.fn:' when the spec does not resolve or the function's
    signature cannot be called that way.
    """
    if ":" not in spec:
        if spec not in RULES:
            close = difflib.get_close_matches(spec, RULES.names(), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"reward.fn: unknown reward rule {spec!r} — {hint}built-in rules: {', '.join(RULES.names())}; "
                f"or give an import path 'pkg.module:function'"
            )
        return RULES.get(spec)(answer_key)
    try:
        fn = import_path(spec)
    except ValueError as exc:
        raise ValueError(f"reward.fn: {exc} — is its package installed or on PYTHONPATH?") from None
    return _adapt(spec, fn)


def check_reward(spec: str, answer_key: str, path: str = "reward.fn") -> list[str]:
    """Error lines for `asyncrl validate`; empty when `spec` resolves to a usable function. `path` is
    the TOML key that holds it (reward.fn, or reward.cost_fn for a Safe-RLHF cost function)."""
    try:
        resolve_reward(spec, answer_key)
    except ValueError as exc:
        return [_at(path, str(exc))]
    return []


def resolve_cost(spec: str, answer_key: str) -> RewardFn:
    """`reward.cost_fn` -> fn(prompt, completion, **fields) -> float: the same rules and loader as rewards."""
    try:
        return resolve_reward(spec, answer_key)
    except ValueError as exc:
        raise ValueError(_at("reward.cost_fn", str(exc))) from None


def _at(path: str, line: str) -> str:
    """Re-point an error line of `resolve_reward` ('reward.fn: ...') at another TOML key."""
    prefix = "reward.fn: "
    return path + ": " + line[len(prefix):] if line.startswith(prefix) else line


MAX_HUNG_CALLS = 8  # reward calls past their timeout, still running on their threads, one role may hold


class HungCalls:
    """The reward calls of one role (a Scorer, an Evaluator) that ran past their timeout and still hold their
    daemon thread: a hung call cannot be killed, so each would otherwise hold a thread (its stack, what the
    call holds) for the rest of the run. With `limit` of them running, no new call starts: each fails at once
    with one line naming the cause (its group fails and the run's watch reports it) until a hung call returns.
    Thread-safe: the calls' threads report their own end."""

    def __init__(self, limit: int = MAX_HUNG_CALLS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._running = 0

    @property
    def running(self) -> int:
        """Calls that timed out and have not returned yet."""
        return self._running

    def check(self, timeout_s: float) -> None:
        """Raise RuntimeError when `limit` hung calls still run (no new call may start)."""
        if self._running >= self.limit:
            raise RuntimeError(f"{self._running} reward calls ran past reward.timeout_s ({timeout_s:g} s) and "
                               f"still run; no new call starts until one returns — the reward function hangs")

    def add(self) -> None:
        with self._lock:
            self._running += 1

    def done(self) -> None:
        with self._lock:
            self._running -= 1


def call_reward(fn: RewardFn, prompt: str, completion: str, row: dict[str, Any]) -> float:
    """Call a resolved reward function on one sample and return its result as a finite float.

    A result that is not a real number (None, a string, a list) or is NaN/inf raises ValueError naming the
    function and the value; exceptions raised by the function itself propagate unchanged.
    """
    fields = {k: v for k, v in row.items() if k not in _RESERVED}
    result = fn(prompt, completion, **fields)
    name = getattr(fn, "__name__", repr(fn))
    value: float | None = None
    if not isinstance(result, (str, bytes)) and result is not None:
        try:
            value = float(result)
        except (TypeError, ValueError):
            value = None
    if value is None or not math.isfinite(value):
        raise ValueError(
            f"reward function {name!r} returned {result!r} ({type(result).__name__}); "
            f"it must return a finite number"
        )
    return value


async def call_reward_async(fn: RewardFn, prompt: str, completion: str, row: dict[str, Any],
                            timeout_s: float, *, hung: HungCalls) -> float:
    """`call_reward` on a daemon thread of its own, bounded by `timeout_s` (asyncio.TimeoutError); a call
    that times out is counted in `hung` until it returns (RuntimeError at once while `hung` is full).

    Not a thread pool: a call that hangs cannot be killed, and in a pool each hung call would hold a
    worker for good — after `max_workers` of them every later call times out waiting in the queue, every
    group fails and training starves; pool threads would also block interpreter exit. A hung daemon
    thread holds only itself.
    """
    hung.check(timeout_s)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[float] = loop.create_future()
    lock = threading.Lock()
    state = {"returned": False, "abandoned": False}  # guarded by `lock`

    def settle(value: float | None, exc: BaseException | None) -> None:
        if fut.done():  # timed out (cancelled) meanwhile
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)  # type: ignore[arg-type]

    def work() -> None:
        value, exc = None, None
        try:
            value = call_reward(fn, prompt, completion, row)
        except Exception as e:  # noqa: BLE001 - user code; the caller reports it
            exc = e
        with lock:
            state["returned"] = True
            if state["abandoned"]:
                hung.done()
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop closed while the call hung
            pass

    threading.Thread(target=work, name="reward", daemon=True).start()
    try:
        return await asyncio.wait_for(fut, timeout_s)
    except asyncio.TimeoutError:
        with lock:
            if not state["returned"]:
                state["abandoned"] = True
                hung.add()
        raise


async def call_rewards_async(fn: RewardFn, calls: list[tuple[str, str, dict[str, Any]]],
                             timeout_s: float, *, hung: HungCalls) -> list[float | BaseException]:
    """`call_reward` on each (prompt, completion, row), one call after the other on one daemon thread, each
    call bounded by `timeout_s`. Returns, per call, its value or its exception (asyncio.TimeoutError for one
    that hung; RuntimeError for those not started because `hung` is full).

    The same guarantees as `call_reward_async` (one call at a time, except beside a call that already
    timed out: a hung call holds only its own thread, counted in `hung` until it returns, and the calls after
    it go on on a fresh one), without a thread start and a round trip through the event loop per call: the
    thread runs through the batch and hands each result to the loop as it goes.
    """
    loop = asyncio.get_running_loop()
    out: list[float | BaseException] = []
    lock = threading.Lock()
    while len(out) < len(calls):
        try:
            hung.check(timeout_s)
        except RuntimeError as full:
            out.extend(full for _ in range(len(calls) - len(out)))
            break
        results: asyncio.Queue[tuple[float | None, BaseException | None]] = asyncio.Queue()
        # the next call this thread will make (None once the thread is abandoned: a call of it hung), and
        # the last call it returned from; both guarded by `lock`
        claim: list[int | None] = [len(out)]
        returned = [len(out) - 1]

        def work(q: asyncio.Queue = results, claim: list[int | None] = claim, returned: list[int] = returned) -> None:
            while True:
                with lock:  # claim the next call, unless abandoned meanwhile
                    j = claim[0]
                    if j is None or j >= len(calls):
                        return
                    claim[0] = j + 1
                value, exc = None, None
                try:
                    value = call_reward(fn, *calls[j])
                except Exception as e:  # noqa: BLE001 - user code; the caller reports it
                    exc = e
                with lock:
                    returned[0] = j
                    if claim[0] is None:  # abandoned inside call j, which has returned now: no longer hung
                        hung.done()
                        return
                try:
                    loop.call_soon_threadsafe(q.put_nowait, (value, exc))
                except RuntimeError:  # the loop closed while a call hung
                    return

        threading.Thread(target=work, name="reward", daemon=True).start()
        while len(out) < len(calls):
            try:
                value, exc = await asyncio.wait_for(results.get(), timeout_s)
            except asyncio.TimeoutError as timeout:
                with lock:
                    if claim[0] == len(out) + 1 and returned[0] < len(out):  # inside call len(out): abandon it
                        claim[0] = None
                        hung.add()
                if claim[0] is not None:  # it just returned from that call: its result is on the way
                    value, exc = await results.get()
                else:
                    out.append(timeout)
                    break  # the next calls on a fresh thread
            out.append(exc if exc is not None else value)  # type: ignore[arg-type]
    return out


def _adapt(spec: str, fn: Any) -> RewardFn:
    """Check a user function's signature and wrap it into the fn(prompt, completion, **fields) convention."""
    if not callable(fn):
        raise ValueError(f"reward.fn: {spec!r} is not callable (got {type(fn).__name__})")
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"reward.fn: {spec!r} is an async function — make it a plain def "
                         f"(scorers call it in a thread)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # uninspectable (some builtins): trust the documented convention
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    head = tuple(p.name for p in positional[:2])
    ok_head = head == _RESERVED or (has_varargs and _RESERVED[: len(head)] == head)
    rest = positional[2:] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    stuck = [p.name for p in rest if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty]
    if not ok_head or stuck:
        raise ValueError(
            f"reward.fn: {spec!r} has signature {sig}; it must accept (prompt, completion, **fields) "
            f"— name its first two parameters prompt and completion and take row fields as keywords"
        )
    if takes_all:
        return fn
    names = frozenset(p.name for p in rest)
    required = frozenset(p.name for p in rest if p.default is p.empty)

    @functools.wraps(fn)
    def reward(prompt: str, completion: str, **fields: Any) -> float:
        missing = sorted(required - fields.keys())
        if missing:
            raise ValueError(
                f"reward function {spec!r} needs row field(s) {', '.join(missing)} that this row lacks"
            )
        return fn(prompt, completion, **{k: v for k, v in fields.items() if k in names})

    return reward
