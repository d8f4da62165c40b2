"""`ProcessRewards`: the per-sample reward (and cost) functions in a pool of worker processes
(`reward.isolation = "process"`).

Place in the dataflow: a Scorer (and the trainer's Evaluator) hands a batch of calls to `score`; every
(function, call) pair runs as one request, in parallel across `workers` processes (asyncrl/rewards/worker.py),
one request at a time in each; `PoolFunctions` combines each call's values (combine.py) and the
`RewardSet` adds any in-process component (a reward model). What a worker does to itself stays there:

| what the reward does                        | what happens                                                     |
|---------------------------------------------|------------------------------------------------------------------|
| raises, returns a non-number                | the call fails with that exception; the worker goes on           |
| runs past `timeout_s` (sleeps, loops in C   | the worker's process group gets SIGKILL; the call fails with     |
| holding its interpreter lock)               | asyncio.TimeoutError; a fresh worker takes its slot              |
| dies (os._exit, a segfault, the OOM killer) | the call fails with RewardWorkerDied; a fresh worker takes over  |
| MemoryError (e.g. under `max_memory_mb`)    | the call fails with MemoryError; the worker exits and is replaced|

Only the request a worker is running fails; the others, and the role, go on. Each worker resolves the
functions itself from the spec strings, so the role's process never imports the user's module. Workers call
plain per-sample functions only: async and batched ones need `reward.isolation = "thread"`.

The workers are started, and replaced, on the thread that builds the pool or calls `score` (the death
signal of a worker follows that thread: see worker.py); the blocking pipe reads run on daemon threads, so
the pool works from any event loop and never delays interpreter exit. `close()` kills every worker; a pool
that is garbage-collected, or alive at exit, is closed too.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import weakref
from typing import Iterator, Sequence, TypeVar

import msgspec

from asyncrl.aio import on_daemon_thread
from asyncrl.rewards.base import Call, Component, FunctionSpec, Score, Value
from asyncrl.rewards.combine import RewardSet, combine
from asyncrl.rewards.worker import Hello, Reply, Request, WorkerFunction, WorkerSettings, receive, send

START_TIMEOUT_S = 120.0  # python start + the user's imports (torch, a tokenizer...) in a fresh worker
T = TypeVar("T")
log = logging.getLogger(__name__)


class RewardWorkerDied(RuntimeError):
    """The worker process ended during a call: os._exit, a signal, a malformed message."""


class RewardError(Exception):
    """The reward raised an exception of a type that is not a builtin: 'module.Type: message'."""


class ProcessRewards(RewardSet):
    """`Rewards` (base.py) whose functions run in `workers` worker processes; `score` takes one batch at a time.

    `reward_fn`: one spec ('exact_match', 'pkg.module:function'), or the run's `FunctionSpec`s (named,
    weighted); `extra`: components that run in this process beside them (the reward model)."""

    def __init__(self, reward_fn: str | Sequence[FunctionSpec], answer_key: str, cost_fn: str = "", *,
                 timeout_s: float = 30.0, workers: int = 2, max_memory_mb: int = 0,
                 start_timeout_s: float = START_TIMEOUT_S, extra: Sequence[Component] = ()) -> None:
        """Start the workers and wait until each resolved the functions. Raises ValueError with the worker's one
        line ('reward.fn: ...' / 'reward.cost_fn: ...') when a spec does not resolve, and TimeoutError when a
        worker is not ready within `start_timeout_s`."""
        specs = [FunctionSpec("", reward_fn)] if isinstance(reward_fn, str) else list(reward_fn)
        functions = [WorkerFunction(fn=s.fn, path=s.path) for s in specs]
        if cost_fn:
            functions.append(WorkerFunction(fn=cost_fn, path="reward.cost_fn"))
        self.pool = WorkerPool(functions, answer_key, timeout_s=timeout_s, workers=workers,
                               max_memory_mb=max_memory_mb, start_timeout_s=start_timeout_s)
        reward = [PoolFunctions(self.pool, [(s.name, s.weight, i) for i, s in enumerate(specs)])] if specs else []
        cost = PoolFunctions(self.pool, [("", 1.0, len(specs))]) if cost_fn else None
        super().__init__([*reward, *extra], cost)

    def pids(self) -> list[int]:
        """Process ids of the current workers (tests check that they end)."""
        return self.pool.pids()


class PoolFunctions:
    """Several weighted functions of one `WorkerPool` as one `Component`: each call's values, combined."""

    def __init__(self, pool: WorkerPool, functions: list[tuple[str, float, int]]) -> None:
        self.pool = pool
        self.functions = functions  # (component name, weight, index in the pool)
        self.name = ""  # its values are Scores: they carry their components' names
        self.weight = 1.0

    hung_calls = 0  # a call past the timeout is not left running (killed, or bounded by the batch)

    async def values(self, calls: list[Call]) -> list[Value | Score | BaseException]:
        n = len(calls)
        results = await self.pool.run([(index, call) for _, _, index in self.functions for call in calls])
        out: list[Value | Score | BaseException] = []
        for i in range(n):
            parts = [(name, weight, results[k * n + i]) for k, (name, weight, _) in enumerate(self.functions)]
            failed = next((v for _, _, v in parts if isinstance(v, BaseException)), None)
            try:
                out.append(failed if failed is not None else combine(parts))  # type: ignore[arg-type]
            except ValueError as exc:
                out.append(exc)
        return out

    def close(self) -> None:
        self.pool.close()


class WorkerPool:
    """`workers` processes that each resolved `functions`; `run` takes one batch of requests at a time."""

    def __init__(self, functions: list[WorkerFunction], answer_key: str, *, timeout_s: float = 30.0,
                 workers: int = 2, max_memory_mb: int = 0, start_timeout_s: float = START_TIMEOUT_S) -> None:
        if workers < 1:
            raise ValueError(f"reward.workers must be at least 1, got {workers}")
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        settings = WorkerSettings(functions=functions, answer_key=answer_key, max_memory_mb=max_memory_mb,
                                  parent_pid=os.getpid())
        self._argv = [sys.executable, "-m", "asyncrl.rewards.worker", msgspec.json.encode(settings).decode()]
        # the worker imports what this process can: the same search path (tests, Ray working dirs, '' = cwd)
        path = [p or os.getcwd() for p in sys.path if isinstance(p, str)]
        self._env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self._slots: list[_Worker | None] = [None] * workers  # replaced in place: the finalizer holds this list
        self._close = weakref.finalize(self, _kill_all, self._slots)
        self._busy = False
        try:
            for i in range(workers):
                self._slots[i] = _Worker(self._argv, self._env)
            for w in self._slots:
                assert w is not None
                w.wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    async def run(self, requests: list[tuple[int, Call]]) -> list[Value | BaseException]:
        """The value of each (function index, call), in order, or the exception that failed it."""
        if not self._close.alive:
            raise RuntimeError("the reward workers were closed")
        if self._busy:  # a second batch would interleave its requests with the first's on one pipe
            raise RuntimeError("WorkerPool.run: one batch at a time")
        self._busy = True
        out: list[Value | BaseException] = [RuntimeError("not called")] * len(requests)
        todo = iter(enumerate(requests))

        async def lane(slot: int) -> None:  # each worker takes the next request as it finishes one
            for i, (fn, call) in todo:
                out[i] = await self._call(slot, fn, call)

        try:
            await asyncio.gather(*(lane(s) for s in range(min(len(self._slots), len(requests)))))
        finally:
            self._busy = False
        return out

    async def _call(self, slot: int, fn: int, call: Call) -> Value | BaseException:
        if not self._close.alive:  # closed mid-batch: start nothing more
            return RuntimeError("the reward workers were closed")
        try:
            request = msgspec.msgpack.encode(Request(fn=fn, prompt=call.prompt, completion=call.completion,
                                                     row=call.row, finish_reason=call.finish_reason,
                                                     completion_tokens=call.completion_tokens))
            worker = self._worker(slot)
        except (TypeError, ValueError, OSError) as exc:  # a row value msgpack cannot carry; no process to start
            return exc
        try:
            if not worker.ready:
                await asyncio.wait_for(on_daemon_thread(worker.wait_ready, None, name="reward-worker-io"),
                                       self.start_timeout_s)
            return await asyncio.wait_for(on_daemon_thread(worker.call, request, name="reward-worker-io"),
                                          self.timeout_s)
        except (asyncio.TimeoutError, RewardWorkerDied, ValueError) as exc:  # ValueError: the spec broke since
            self._replace(slot)
            return exc
        except asyncio.CancelledError:  # the worker may still answer: its next reply would be out of step
            self._replace(slot)
            raise

    def _worker(self, slot: int) -> _Worker:
        """The slot's worker; one that ended while idle (or said it would) is replaced without failing a call."""
        w = self._slots[slot]
        if w is None or w.retiring or w.proc.poll() is not None:
            if w is not None:
                w.kill()
            w = self._slots[slot] = _Worker(self._argv, self._env)
        return w

    def _replace(self, slot: int) -> None:
        """Kill the slot's worker and start its successor now (a failed start is retried at the next call)."""
        w = self._slots[slot]
        if w is not None:
            w.kill()
        self._slots[slot] = None
        if self._close.alive:
            try:
                self._slots[slot] = _Worker(self._argv, self._env)
            except OSError as exc:
                log.warning("could not start a reward worker (%s); retrying at the next call", exc)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._slots if w is not None]

    def close(self) -> None:
        self._close()


class _Worker:
    """One worker process and its pipe. `wait_ready` and `call` block: the pool runs them on daemon threads.

    The pipe is closed by whoever finishes last, the killer or the thread using it: closing a descriptor
    another thread is about to read could hand that thread the next worker's pipe under the same number.
    """

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        # its own process group: a kill also takes whatever the reward started; Ctrl-C reaches only the parent
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True)
        self.ready = False
        self.retiring = False  # its last reply said it exits (MemoryError)
        self._lock = threading.Lock()
        self._in_use = False  # a thread is reading or writing the pipe
        self._killed = False

    def wait_ready(self, timeout_s: float | None) -> None:
        with self._using("while starting"):
            assert self.proc.stdout is not None
            if timeout_s is not None and not select.select([self.proc.stdout], [], [], timeout_s)[0]:
                raise TimeoutError(f"a reward worker did not start within {timeout_s:g} s (importing the reward "
                                   f"function's module?)")
            hello = self._receive(Hello, "while starting")
        if hello.error:
            raise ValueError(hello.error)
        self.ready = True

    def call(self, request: bytes) -> Value | BaseException:
        """The reply to one request: its value, or the exception the reward raised (returned, not raised).
        Raises RewardWorkerDied when the worker ends before it answers."""
        with self._using("before the call"):
            assert self.proc.stdin is not None
            try:
                send(self.proc.stdin, request)
            except BrokenPipeError:
                raise RewardWorkerDied(self._ended("before the call")) from None
            reply = self._receive(Reply, "during the call")
        self.retiring = reply.last
        return _exception(reply) if reply.error_type else reply.value

    @contextlib.contextmanager
    def _using(self, when: str) -> Iterator[None]:
        with self._lock:
            if self._killed:
                raise RewardWorkerDied(f"reward worker was killed {when}")
            self._in_use = True
        try:
            yield
        finally:
            with self._lock:
                self._in_use = False
                if self._killed:
                    self._close_pipe()

    def _receive(self, kind: type[T], when: str) -> T:
        assert self.proc.stdout is not None
        try:
            message = receive(self.proc.stdout, kind)
        except (msgspec.DecodeError, ValueError) as exc:
            self.kill()
            raise RewardWorkerDied(f"reward worker sent a malformed message {when} ({exc}); killed") from None
        if message is None:
            raise RewardWorkerDied(self._ended(when))
        return message

    def _ended(self, when: str) -> str:
        try:
            code = self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # it closed its pipe but lives on
            self.kill()
            return f"reward worker closed its pipe {when}; killed"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return f"reward worker was killed by {name} {when}"
        return f"reward worker exited with status {code} {when}"

    def kill(self) -> None:
        """SIGKILL to its process group and reap it (idempotent); the pipe closes once no thread uses it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        with self._lock:
            self._killed = True
            if not self._in_use:
                self._close_pipe()

    def _close_pipe(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # BrokenPipeError flushing stdin
                    pass


def _kill_all(slots: list[_Worker | None]) -> None:
    for i, w in enumerate(slots):
        if w is not None:
            w.kill()
        slots[i] = None


def _exception(reply: Reply) -> Exception:
    """The reward's exception again: a builtin type as itself (ValueError stays ValueError), any other as
    RewardError naming its type."""
    cls = getattr(builtins, reply.error_type, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(*reply.error_args)
        except Exception:  # noqa: BLE001 - a builtin whose constructor wants more (UnicodeDecodeError)
            pass
    return RewardError(f"{reply.error_type}: {reply.error}")
