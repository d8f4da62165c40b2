"""Resolve a reward function from its spec, learn its form, and call it safely.

Place in the dataflow: building a run resolves each reward function once (`resolve_function`, from
asyncrl/rewards/setup.py) and wraps it into a `FunctionComponent` of the roles' `RewardSet`; with
`reward.isolation = "process"` a worker process (worker.py) resolves the per-sample functions and calls them
with `call_reward`. `asyncrl validate` calls `check_reward`.

A function's form is read off the function itself:

| form       | detected by                                        | called as                                    |
|------------|----------------------------------------------------|----------------------------------------------|
| per sample | (neither of the below)                             | `fn(prompt, completion, **fields) -> value`  |
| batched    | `@asyncrl.rewards.batched`, or a parameter named   | `fn(prompts=[...], completions=[...],        |
|            | `completions` and none named `completion` (TRL's   | **columns) -> [value, ...]`, keywords only,  |
|            | `reward_funcs` convention)                         | once per scored batch (whole groups)         |
| async      | `async def` (either of the above)                  | awaited on the role's event loop             |

A value is a finite number, or a dict of named finite numbers (components, see combine.py). A per-sample
sync function runs on a daemon thread, one call after the other; an async one is awaited, at most
`reward.max_concurrency` calls at once; a batched one is one call for the batch (a daemon thread, or awaited).
Each call (a batched one: the whole batch) is bounded by `reward.timeout_s`.

`fields` are the dataset row's fields plus what the run knows of the sample: `finish_reason` ("stop" or
"length") and `completion_tokens` (its token count), each passed only when known (ReMax's greedy baseline
has no finish reason). A batched function gets each as a column: a list over the batch (TRL passes dataset
columns the same way). Row fields named `prompt`, `completion`, `finish_reason` or `completion_tokens`
(batched: also `prompts`, `completions`) are not passed: the call's own values take those names.

A per-sample user function must name its first two parameters `prompt` and `completion` (or take `*args`).
Any function that takes `**kwargs` receives every field; otherwise only those it names as parameters, so
`def f(prompt, completion, answer)` works on rows with many more fields. A named parameter without a
default that the call lacks is a ValueError at call time (the scorer catches and counts it).
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import math
import queue
import threading
import time
from typing import Any, Callable, Sequence

from asyncrl.aio import on_daemon_thread
from asyncrl.registry import import_path
from asyncrl.rewards.base import Call, Value
from asyncrl.rewards.rules import RULES, RewardFn

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_EXTRAS = ("finish_reason", "completion_tokens")
_RESERVED = ("prompt", "completion", *_EXTRAS)
_BATCH_RESERVED = ("prompts", "completions", *_RESERVED)
_BATCHED_MARK = "__asyncrl_batched__"
MAX_HUNG_CALLS = 8  # reward calls past their timeout, still running on their threads, one role may hold


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a reward function as batched: called as `fn(prompts=[...], completions=[...], **columns)` with
    keyword arguments, once per scored batch, returning one value per sample (a list)."""
    try:
        setattr(fn, _BATCHED_MARK, True)
        return fn
    except AttributeError:  # a builtin or a slotted object: mark a wrapper instead
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        setattr(wrapper, _BATCHED_MARK, True)
        return wrapper


def is_batched(fn: Any) -> bool:
    """Marked with `@batched`, or TRL's convention: a `completions` parameter and no `completion` one."""
    if getattr(fn, _BATCHED_MARK, False):
        return True
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "completions" in params and "completion" not in params


def is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def form(fn: Any) -> str:
    """'per-sample', 'batched', 'async' or 'async batched' (for messages)."""
    words = (["async"] if is_async(fn) else []) + (["batched"] if is_batched(fn) else [])
    return " ".join(words) or "per-sample"


def resolve_reward(spec: str, answer_key: str) -> RewardFn:
    """A built-in rule name or 'pkg.module:function' -> the function, adapted to its form's calling convention.

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


def resolve_function(spec: str, answer_key: str, path: str = "reward.fn", *, isolation: str = "thread") -> RewardFn:
    """`resolve_reward` with its error lines naming `path` (the TOML key holding `spec`); with
    `isolation = "process"` only per-sample sync functions (a worker calls one sample at a time)."""
    try:
        fn = resolve_reward(spec, answer_key)
    except ValueError as exc:
        raise ValueError(_at(path, str(exc))) from None
    if isolation == "process" and (is_async(fn) or is_batched(fn)):
        raise ValueError(f"{path}: {spec!r} is {form(fn)} — reward.isolation = 'process' calls plain per-sample "
                         f"functions; use reward.isolation = 'thread' (the default) for async and batched ones")
    return fn


def check_reward(spec: str, answer_key: str, path: str = "reward.fn", *, isolation: str = "thread") -> list[str]:
    """Error lines for `asyncrl validate`; empty when `spec` resolves to a usable function. `path` is the
    TOML key that holds it (reward.fn, reward.functions[i].fn, reward.cost_fn)."""
    try:
        resolve_function(spec, answer_key, path, isolation=isolation)
    except ValueError as exc:
        return [str(exc)]
    return []


def resolve_cost(spec: str, answer_key: str) -> RewardFn:
    """`reward.cost_fn` -> a function: the same rules, forms and loader as rewards."""
    return resolve_function(spec, answer_key, "reward.cost_fn")


def _at(path: str, line: str) -> str:
    """Re-point an error line of `resolve_reward` ('reward.fn: ...') at another TOML key."""
    prefix = "reward.fn: "
    return path + ": " + line[len(prefix):] if line.startswith(prefix) else line


# -- calling -------------------------------------------------------------------------------------------


def sample_fields(row: dict[str, Any], finish_reason: str | None, completion_tokens: int | None) -> dict[str, Any]:
    """The keyword arguments of a per-sample call: the row's fields and the known extras."""
    fields = {k: v for k, v in row.items() if k not in _RESERVED}
    for key, value in zip(_EXTRAS, (finish_reason, completion_tokens)):
        if value is not None:
            fields[key] = value
    return fields


def batch_columns(calls: Sequence[Call]) -> dict[str, list[Any]]:
    """The keyword arguments of a batched call: prompts, completions, each row field (None where a row lacks
    it) and each extra known for some call, as lists over the batch."""
    keys = dict.fromkeys(k for c in calls for k in c.row if k not in _BATCH_RESERVED)
    columns: dict[str, list[Any]] = {"prompts": [c.prompt for c in calls],
                                     "completions": [c.completion for c in calls]}
    columns.update({k: [c.row.get(k) for c in calls] for k in keys})
    for key in _EXTRAS:
        values = [getattr(c, key) for c in calls]
        if any(v is not None for v in values):
            columns[key] = values
    return columns


def check_value(fn: Any, result: Any) -> Value:
    """A function's result for one sample as a Value: a finite float, or a dict of them by non-empty string
    keys. Anything else (None, a string, a list, NaN/inf) raises ValueError naming the function and value."""
    name = getattr(fn, "__name__", repr(fn))
    if isinstance(result, dict):
        out: dict[str, float] = {}
        for key, v in result.items():
            value = _finite(v)
            if not isinstance(key, str) or not key or value is None:
                raise ValueError(f"reward function {name!r} returned component {key!r}: {v!r}; a dict it returns "
                                 f"must map non-empty names to finite numbers")
            out[key] = value
        return out
    value = _finite(result)
    if value is None:
        raise ValueError(
            f"reward function {name!r} returned {result!r} ({type(result).__name__}); "
            f"it must return a finite number (or a dict of named finite numbers)"
        )
    return value


def _finite(result: Any) -> float | None:
    if isinstance(result, (str, bytes)) or result is None:
        return None
    try:
        value = float(result)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def check_batch(fn: Any, result: Any, n: int) -> list[Value | BaseException]:
    """A batched function's result as one Value (or the ValueError that fails it) per sample; a result that
    is not a sequence of `n` raises ValueError (every sample of the batch fails)."""
    name = getattr(fn, "__name__", repr(fn))
    if hasattr(result, "tolist") and not isinstance(result, (list, tuple)):  # numpy array, torch tensor
        result = result.tolist()
    if not isinstance(result, (list, tuple)) or len(result) != n:
        got = f"{len(result)} values" if isinstance(result, (list, tuple)) else f"{type(result).__name__}"
        raise ValueError(f"batched reward function {name!r} returned {got} for {n} samples; it must return a "
                         f"list with one value per completion")
    out: list[Value | BaseException] = []
    for item in result:
        try:
            out.append(check_value(fn, item))
        except ValueError as exc:
            out.append(exc)
    return out


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


class _RewardThreads:
    """Daemon threads that run reward batches (`call_rewards_async`), kept idle between batches: starting a
    thread per batch blocks the event loop until the new thread first runs, which on a busy core costs more
    than the batch itself. A thread whose call hung is never given work again: its batch is abandoned, and the
    thread ends when that call returns. Idle threads (at most `keep`) wait on their own queue; they are daemon
    threads, so they never hold up interpreter exit."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []

    def submit(self, work: Callable[[], bool], then: Callable[[], None]) -> None:
        """Run `work()` on an idle thread (a new one if none): when it returns True the thread is idle again,
        then `then()` runs on it; False (its batch was abandoned) ends the thread."""
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="reward", daemon=True).start()
        jobs.put((work, then))

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while True:
            work, then = jobs.get()
            if not work():
                return
            with self._lock:  # idle before `then` wakes the loop: the next batch finds this thread
                keep = len(self._idle) < self.keep
                if keep:
                    self._idle.append(jobs)
            then()
            if not keep:
                return

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)


REWARD_THREADS = _RewardThreads()


def call_reward(fn: RewardFn, prompt: str, completion: str, row: dict[str, Any],
                finish_reason: str | None = None, completion_tokens: int | None = None) -> Value:
    """Call a resolved per-sample sync function on one sample and check its result (`check_value`);
    exceptions raised by the function itself propagate unchanged."""
    return check_value(fn, fn(prompt, completion, **sample_fields(row, finish_reason, completion_tokens)))


async def call_reward_async(fn: RewardFn, prompt: str, completion: str, row: dict[str, Any],
                            finish_reason: str | None = None, completion_tokens: int | None = None) -> Value:
    """`call_reward` for an `async def` per-sample function."""
    return check_value(fn, await fn(prompt, completion, **sample_fields(row, finish_reason, completion_tokens)))


def call_batch(fn: RewardFn, calls: Sequence[Call]) -> list[Value | BaseException]:
    """Call a resolved batched sync function on the whole batch (`check_batch`)."""
    return check_batch(fn, fn(**batch_columns(calls)), len(calls))


async def call_rewards_async(fn: RewardFn, calls: Sequence[Call | tuple], timeout_s: float, *,
                             hung: HungCalls) -> list[Value | BaseException]:
    """`call_reward` on each (prompt, completion, row), one call after the other on one daemon thread, each
    call bounded by `timeout_s` from its start. Returns, per call, its value or its exception
    (asyncio.TimeoutError for one that hung; RuntimeError for those not started because `hung` is full).

    One call at a time, except beside a call that already timed out: a hung call cannot be killed, so it
    holds only its own thread, counted in `hung` until it returns, and the calls after it go on on another
    one. Not a fixed-size pool: there each hung call would hold a worker for good — after `max_workers` of
    them every later call times out waiting in the queue, every group fails and training starves. The
    threads (`REWARD_THREADS`) are kept idle between batches, and one whose call hung is never reused. The
    thread runs through the batch and wakes the loop once, at its end; meanwhile the loop sleeps until the
    running call's deadline (no thread start and no round trip through the event loop per call: each would
    cost more than a rule reward on a busy core).
    """
    loop = asyncio.get_running_loop()
    out: list[Value | BaseException] = []
    lock = threading.Lock()
    while len(out) < len(calls):
        try:
            hung.check(timeout_s)
        except RuntimeError as full:
            out.extend(full for _ in range(len(calls) - len(out)))
            break
        done = asyncio.Event()
        # shared with the thread, under `lock`: the next call it makes, the call running and since when (or
        # None between calls), whether it was abandoned (a call of it hung), and the returned calls' results
        state: dict[str, Any] = {"next": len(out), "running": None, "since": 0.0, "abandoned": False}
        results: dict[int, tuple[Value | None, BaseException | None]] = {}

        def work(state: dict[str, Any] = state, results: dict = results) -> bool:
            """The batch's calls from state["next"] on; False when it was abandoned (a call of it hung)."""
            while True:
                with lock:  # claim the next call, unless abandoned meanwhile
                    j = state["next"]
                    if state["abandoned"]:
                        return False
                    if j >= len(calls):
                        return True
                    state["next"], state["running"], state["since"] = j + 1, j, time.monotonic()
                value, exc = None, None
                try:
                    value = call_reward(fn, *calls[j])
                except Exception as e:  # noqa: BLE001 - user code; the caller reports it
                    exc = e
                with lock:
                    if state["abandoned"]:  # abandoned inside call j, which has returned now: no longer hung
                        hung.done()
                        return False
                    results[j], state["running"] = (value, exc), None

        def wake(done: asyncio.Event = done) -> None:
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

        REWARD_THREADS.submit(work, wake)
        hung_at: int | None = None
        while not done.is_set():
            with lock:
                running, since = state["running"], state["since"]
            left = timeout_s if running is None else since + timeout_s - time.monotonic()
            if left > 0:
                try:
                    await asyncio.wait_for(done.wait(), left)
                except asyncio.TimeoutError:
                    pass
                continue
            with lock:  # still inside the call that ran past its deadline: abandon the thread
                if state["running"] == running and not done.is_set():
                    state["abandoned"] = True
                    hung.add()
                    hung_at = running
            if hung_at is not None:
                break
        with lock:
            for j in range(len(out), len(calls) if hung_at is None else hung_at):
                value, exc = results[j]
                out.append(exc if exc is not None else value)  # type: ignore[arg-type]
        if hung_at is not None:
            out.append(asyncio.TimeoutError(f"reward call ran past reward.timeout_s ({timeout_s:g} s)"))
    return out


class FunctionComponent:
    """One resolved reward function as a `Component` (base.py), called in its form (module docstring)."""

    def __init__(self, fn: RewardFn, *, name: str = "", weight: float = 1.0, timeout_s: float = 30.0,
                 max_concurrency: int = 32) -> None:
        self.fn = fn
        self.name = name
        self.weight = weight
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency  # async per-sample calls in flight at once
        self.batched = is_batched(fn)
        self.is_async = is_async(fn)
        self.hung = HungCalls()  # its calls past timeout_s still running on their threads (bounded)

    @property
    def hung_calls(self) -> int:
        return self.hung.running

    async def values(self, calls: list[Call]) -> list[Value | BaseException]:
        if self.batched:
            return await self._batch(calls)
        if self.is_async:
            return await self._concurrently(calls)
        return await call_rewards_async(self.fn, calls, self.timeout_s, hung=self.hung)

    async def _batch(self, calls: list[Call]) -> list[Value | BaseException]:
        """One call for the batch; what fails it (a raise, a hang, a result of the wrong length) fails every
        sample of the batch."""
        try:
            if self.is_async:
                result = await asyncio.wait_for(self.fn(**batch_columns(calls)), self.timeout_s)
                return check_batch(self.fn, result, len(calls))
            return await asyncio.wait_for(on_daemon_thread(call_batch, self.fn, calls, name="reward"), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - user code (TimeoutError included); the role reports it
            return [exc] * len(calls)

    async def _concurrently(self, calls: list[Call]) -> list[Value | BaseException]:
        """`async def` per sample, on this loop: at most `max_concurrency` in flight, each bounded by
        `timeout_s` from its start (not from its wait for a slot)."""
        slots = asyncio.Semaphore(self.max_concurrency)  # made here: it belongs to this loop

        async def one(call: Call) -> Value | BaseException:
            async with slots:
                try:
                    return await asyncio.wait_for(call_reward_async(self.fn, *call), self.timeout_s)
                except Exception as exc:  # noqa: BLE001 - user code; the role reports it
                    return exc

        return list(await asyncio.gather(*(one(c) for c in calls)))

    def close(self) -> None:
        """Nothing to stop: a hung daemon thread holds only itself."""


def _adapt(spec: str, fn: Any) -> RewardFn:
    """Check a user function's signature against its form's convention and wrap it so that it receives only
    the fields it names (unless it takes **kwargs)."""
    if not callable(fn):
        raise ValueError(f"reward.fn: {spec!r} is not callable (got {type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # uninspectable (some builtins): trust the documented convention
    params = list(sig.parameters.values())
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if is_batched(fn):
        stuck = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty]
        if stuck:
            raise ValueError(f"reward.fn: {spec!r} is batched and has signature {sig}; it is called with keyword "
                             f"arguments only (prompts=, completions=, row columns) — make {', '.join(stuck)} "
                             f"a normal parameter")
        named = [p for p in params if p.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY)]
        return _keeping(spec, fn, named, takes_all, batch=True)
    positional = [p for p in params if p.kind in _POSITIONAL]
    has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    head = tuple(p.name for p in positional[:2])
    ok_head = head == _RESERVED[:2] or (has_varargs and _RESERVED[: len(head)] == head)
    rest = positional[2:] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    stuck = [p.name for p in rest if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty]
    if not ok_head or stuck:
        raise ValueError(
            f"reward.fn: {spec!r} has signature {sig}; it must accept (prompt, completion, **fields) "
            f"— name its first two parameters prompt and completion and take row fields as keywords"
        )
    return _keeping(spec, fn, rest, takes_all, batch=False)


def _keeping(spec: str, fn: Any, named: list[inspect.Parameter], takes_all: bool, *, batch: bool) -> RewardFn:
    """`fn` behind a wrapper of the same form that passes on only the keyword arguments it names."""
    if takes_all:
        return fn
    names = frozenset(p.name for p in named)
    required = frozenset(p.name for p in named if p.default is p.empty)

    def keep(fields: dict[str, Any]) -> dict[str, Any]:
        missing = sorted(required - fields.keys())
        extras = [m for m in missing if m in _EXTRAS]
        if extras:
            raise ValueError(f"reward function {spec!r} needs {', '.join(extras)}, which this call does not know "
                             f"(e.g. a ReMax greedy baseline has no finish reason) — give it a default")
        if missing:
            what = "column(s)" if batch else "row field(s)"
            raise ValueError(f"reward function {spec!r} needs {what} {', '.join(missing)} that this "
                             f"{'batch' if batch else 'row'} lacks")
        return {k: v for k, v in fields.items() if k in names}

    if batch and is_async(fn):
        async def reward(**columns: Any) -> Any:
            return await fn(**keep(columns))
    elif batch:
        def reward(**columns: Any) -> Any:
            return fn(**keep(columns))
    elif is_async(fn):
        async def reward(prompt: str, completion: str, **fields: Any) -> Any:  # type: ignore[misc]
            return await fn(prompt, completion, **keep(fields))
    else:
        def reward(prompt: str, completion: str, **fields: Any) -> Any:  # type: ignore[misc]
            return fn(prompt, completion, **keep(fields))

    functools.update_wrapper(reward, fn)
    if batch:
        setattr(reward, _BATCHED_MARK, True)
    return reward
