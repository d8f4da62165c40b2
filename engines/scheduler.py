"""The continuous-batching loop of the native engine, on its own thread.

Place in the dataflow: `TorchEngine.generate` (any number of concurrent coroutines, on any event loop)
submits a `Request` here and awaits its future; `load_weights` stages a `Swap` and blocks its own thread
until the swap has landed; `interrupt` aborts everything in flight. One thread owns the model backend
(`engines.torch_model`) and runs, at every *step boundary*:

| phase | does |
|---|---|
| commands | take new requests, staged weight swaps and interrupts, all at once under the lock |
| swap | copy the staged tensors into the module's parameters, bump `version`, then re-prefill or keep the K/V |
| interrupt | every running and waiting sequence finishes now with `finish_reason="abort"` and its partial tokens |
| sleep | idle only: the backend releases its K/V cache (and CUDA-graph buffers); submits fail until `wake` |
| admit | FIFO: whole prompts (all n samples) while slots are free; one batched prefill per `max_prefill_tokens` |
| decode | one forward over all running sequences (slots 0..B-1), sample, stamp each token with `version` |
| retire | finished sequences leave; the last running slot moves into the hole so slots stay dense |

After a swap, by default (`kv_on_update="recompute"`) every unfinished sequence (prompt + tokens so far) is
re-prefilled under the new weights; `"keep"` reuses the old K/V and flags the sequences `kv_reused`. The whole
pause is recorded in `swap_pauses_s`. On admission a prompt's n samples share its prefill; their first token is
sampled from the prefill logits. A request's future resolves (on its own loop, `call_soon_threadsafe`) once all
its sequences finished.

Counters: `num_prefill_forwards`, `num_decode_forwards`, `tokens_generated`, the decode batch size and
duration of each step (`decode_batch_sizes`, `step_times_s`), the pause of each swap (`swap_pauses_s`), each
record of the last `history` (so a long run does not grow them), and `swap_pause_s_sum` / `swap_pause_s_max`
over every swap.
`on_step(step)` is called after every decode step on this thread (a hook for tests and benchmarks).

When the loop goes from idle to busy it waits until no request arrived for `admit_window_s` (at most ten
windows), so that a burst of concurrent submissions (e.g. `asyncio.gather` over 64 episodes) is
prefilled together rather than one by one.

Sleep (colocated placement, engines.base.SleepableEngine): `sleep()` is a command like the others, so the
cache is released on this thread, between two iterations, never under a forward. It succeeds only when nothing
is running, waiting or submitted; then `asleep` is set under the lock (a later `submit` raises) and the backend
drops its cache. Swaps still land while asleep (they need no cache). `wake()` only clears `asleep`: the next
admission allocates the cache again (`backend.capacity`).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import threading
import time
import weakref
from typing import Any, Callable

import torch

from engines.requests import Request, Sequence, Swap, sequence_seed
from engines.sampling import RowParams, sample

log = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    """Stop every engine thread before the interpreter finalizes. A daemon thread still running then (an
    engine left open, its idle exit due) is killed the moment it waits for the GIL; if that happens inside
    a torch deallocation (C++), the process aborts instead of exiting (seen with Ray's terminate handler)."""
    for scheduler in list(_LIVE):
        try:
            scheduler.close(timeout_s=5.0)
        except Exception as exc:  # noqa: BLE001 - exiting anyway
            log.debug("engine thread not stopped at exit: %s", exc)


def _spent() -> None:
    """A swap's copy once it ran (the closure that held the caller's tensors is dropped)."""


class Scheduler:
    def __init__(
        self, backend, *, vocab_size: int, device: torch.device, seed: int, max_batch: int, max_prompt_len: int,
        kv_on_update: str, admit_window_s: float, max_prefill_tokens: int, history: int = 4096,
    ) -> None:
        self.backend = backend
        self.max_prompt_len = max_prompt_len
        self.vocab_size = vocab_size
        self.device = device
        self.max_batch = max_batch
        self.kv_on_update = kv_on_update
        self.admit_window_s = admit_window_s
        self.max_prefill_tokens = max_prefill_tokens
        self.generator = torch.Generator().manual_seed(seed)  # unseeded requests share this stream
        # A new thread does not inherit torch.set_num_threads (OpenMP settings are per thread): without
        # this the loop would run with every core and contend with the roles beside it.
        self._num_threads = torch.get_num_threads()
        self.version = 0
        self.num_prefill_forwards = 0
        self.num_decode_forwards = 0
        self.tokens_generated = 0
        self.decode_tokens_total = 0  # sum of decode batch sizes (exact mean beyond `history`)
        self.decode_batch_sizes: collections.deque[int] = collections.deque(maxlen=history)
        self._deferred: list[Request] | None = None  # requests a decode step finished, resolved after its record
        self.step_times_s: collections.deque[float] = collections.deque(maxlen=history)
        self.swap_pauses_s: collections.deque[float] = collections.deque(maxlen=history)
        self.swap_pause_s_sum = 0.0  # over every swap (the record above keeps the last `history`)
        self.swap_pause_s_max = 0.0
        self.on_step: Callable[[int], None] | None = None
        # asyncrl.deploy.thread_tuner.ThreadTuner (or None): the loop runs with its `current` thread count and reports
        # each decode step's seconds per token to it
        self.tuner: Any = None
        self.idle_exit_s = 30.0
        self._cv = threading.Condition()
        self._inbox: list[Request] = []
        self._swaps: list[Swap] = []
        self._interrupts: list[concurrent.futures.Future] = []
        self._sleeps: list[concurrent.futures.Future] = []
        self.asleep = False  # the cache is released; set and read under the lock (submit refuses meanwhile)
        self._closing = False
        self._thread: threading.Thread | None = None
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Sequence] = []  # active[i] lives in backend slot i
        self._rows: RowParams | None = None  # sampling params of `_active`, rebuilt when it changes
        _LIVE.add(self)

    # -- thread-safe entry points ----------------------------------------------------------------
    def submit(self, req: Request) -> None:
        self.submit_many([req])

    def submit_many(self, reqs: list[Request]) -> None:
        """Post `reqs` at once: the loop finds all of them in its inbox or none, so they are admitted (and
        prefilled) together whenever their slots allow, whatever the timing of the calling thread."""
        def add() -> None:
            if self.asleep:
                raise RuntimeError("TorchEngine.generate while the engine sleeps (its K/V cache released): "
                                   "call wake() first")
            self._inbox.extend(reqs)

        self._post(add)

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        with self._cv:
            self._cv.notify()

    def swap(self, swap: Swap) -> None:
        """Stage `swap` and block until it has landed at a step boundary (or at once when idle)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("load_weights called from the engine's own thread (e.g. an on_step hook)")
        self._post(lambda: self._swaps.append(swap))
        swap.done.wait()
        if swap.error is not None:
            raise swap.error

    def interrupt(self) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(lambda: self._interrupts.append(fut))
        return fut

    def sleep(self) -> concurrent.futures.Future:
        """Release the backend's cache at the next boundary; the future fails (RuntimeError, nothing changed)
        if a sequence is in flight then."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(lambda: self._sleeps.append(fut))
        return fut

    def wake(self) -> None:
        """Accept requests again; the cache is allocated again by the next admission."""
        with self._cv:
            self.asleep = False

    def staged_swaps(self) -> int:
        """Swaps waiting for the next step boundary."""
        with self._cv:
            return len(self._swaps)

    @property
    def num_threads(self) -> int:
        """The torch threads the loop runs with."""
        return self._num_threads

    def close(self, timeout_s: float | None = None) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _post(self, action: Callable[[], None]) -> None:
        with self._cv:
            if self._closing:
                raise RuntimeError("TorchEngine used after close()")
            action()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
                self._thread.start()
            self._cv.notify()

    # -- the loop --------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._active or self._waiting)

    def _has_work(self) -> bool:
        return bool(self._closing or self._inbox or self._swaps or self._interrupts or self._sleeps or self._busy())

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        while True:
            with self._cv:
                while not self._has_work():
                    if not self._cv.wait(timeout=self.idle_exit_s) and not self._has_work():
                        # Idle for long: end the thread (the next command starts a new one), so that an
                        # engine dropped without close() does not pin its model and cache forever.
                        self._thread = None
                        return
                burst = bool(self._inbox) and not self._busy()
            if burst and self.admit_window_s > 0:
                self._await_quiet_inbox()
            with self._cv:
                if self._closing:
                    break
                inbox, self._inbox = self._inbox, []
                swaps, self._swaps = self._swaps, []
                interrupts, self._interrupts = self._interrupts, []
                sleeps, self._sleeps = self._sleeps, []
            try:
                self._iteration(inbox, swaps, interrupts, sleeps)
            except Exception as exc:  # contained: every request in flight fails with it, the loop goes on
                log.exception("torch engine step failed; failing %d sequences", len(self._active))
                self._fail_all(exc, swaps, interrupts, sleeps)
            # let go of this iteration's commands before waiting for the next (a swap that failed unapplied holds
            # the caller's staged tensors; a weight receiver reuses their memory only once nothing views it)
            del inbox, swaps, interrupts, sleeps
        self._fail_all(RuntimeError("TorchEngine closed"), *self._drain_commands())

    def _await_quiet_inbox(self) -> None:
        """Sleep until no request arrived for one admit window (at most ten windows): a burst of
        concurrent submissions is then admitted, and prefilled, together."""
        seen, deadline = -1, time.monotonic() + 10 * self.admit_window_s
        while time.monotonic() < deadline:
            with self._cv:
                arrived = len(self._inbox)
            if arrived == seen:
                return
            seen = arrived
            time.sleep(self.admit_window_s)

    def _drain_commands(self) -> tuple[list[Swap], list[concurrent.futures.Future], list[concurrent.futures.Future]]:
        with self._cv:
            self._waiting.extend(self._inbox)
            self._inbox = []
            swaps, self._swaps = self._swaps, []
            interrupts, self._interrupts = self._interrupts, []
            sleeps, self._sleeps = self._sleeps, []
        return swaps, interrupts, sleeps

    def _iteration(self, inbox: list[Request], swaps: list[Swap], interrupts: list, sleeps: list) -> None:
        was_idle = not self._busy()
        self._waiting.extend(inbox)  # first: should anything below raise, _fail_all fails these requests too
        if inbox and was_idle:
            self.backend.refresh()  # idle -> busy: re-read the module's parameters (a shared module may
                                     # have had a Parameter replaced since the last request)
        if swaps:
            self._apply_swaps(swaps)
        if interrupts:
            aborted = self._abort_all("abort")
            for fut in interrupts:
                fut.set_result(aborted)
        self._drop_cancelled()
        if sleeps:
            self._sleep(sleeps)
        tuner = self.tuner
        if tuner is not None and tuner.current != self._num_threads:  # on this thread: OpenMP's are per thread
            self._num_threads = tuner.current
            torch.set_num_threads(self._num_threads)
        with torch.inference_mode():
            self._admit()
            if self._active:
                self._decode_step()
        if self.on_step is not None and self._active:
            self.on_step(self.num_decode_forwards)

    # -- sleep -------------------------------------------------------------------------------------
    def _sleep(self, futures: list[concurrent.futures.Future]) -> None:
        """Release the cache if nothing is in flight (checked with the inbox under the lock, so no request
        slips in between the check and `asleep`); otherwise fail the sleep and go on generating."""
        with self._cv:
            in_flight = sum(len(r.prompts) * r.params.n for r in self._inbox)
            in_flight += len(self._active) + sum((len(r.prompts) - r.admitted) * r.params.n for r in self._waiting)
            self.asleep = self.asleep or not in_flight
        if in_flight:
            error = RuntimeError(f"TorchEngine.sleep: {in_flight} sequences in flight; sleep only while idle "
                                 f"(the Generator lets its groups finish first)")
            for fut in futures:
                fut.set_exception(error)
            return
        self.backend.release()
        self._rows = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the device, for the trainer
        for fut in futures:
            fut.set_result(None)

    # -- weights -----------------------------------------------------------------------------------
    def _apply_swaps(self, swaps: list[Swap]) -> None:
        t0 = time.perf_counter()
        landed = []
        for s in swaps:
            try:
                with torch.no_grad():
                    s.copy()
                self.version = s.version
                landed.append(s)
            except Exception as exc:  # reported to that load_weights caller; generation goes on
                s.error = exc
                s.done.set()
            finally:  # its closure holds the caller's staged tensors: let go of them before the caller goes on
                s.copy = _spent
        with torch.inference_mode():
            self.backend.refresh()
            if landed and self._active:
                if self.kv_on_update == "recompute":
                    self._recompute_kv()
                else:
                    for seq in self._active:
                        seq.kv_reused = True
        for s in landed:
            s.done.set()
        if landed:
            pause = time.perf_counter() - t0
            self.swap_pauses_s.append(pause)
            self.swap_pause_s_sum += pause
            self.swap_pause_s_max = max(self.swap_pause_s_max, pause)

    def _recompute_kv(self) -> None:
        """Re-prefill prompt + all tokens but the last (which the next decode feeds) into each slot."""
        contexts = [seq.prompt + seq.tokens[:-1] for seq in self._active]
        for start, stop in self._chunks([len(c) for c in contexts]):
            self.backend.prefill(contexts[start:stop], start, [1] * (stop - start), logits=False)
            self.num_prefill_forwards += 1

    def _chunks(self, lengths: list[int]):
        """Consecutive [start, stop) ranges whose padded size stays within max_prefill_tokens."""
        start, width = 0, 0
        for i, n in enumerate(lengths):
            width = max(width, n)
            if i > start and width * (i + 1 - start) > self.max_prefill_tokens:
                yield start, i
                start, width = i, n
        if start < len(lengths):
            yield start, len(lengths)

    # -- admission ---------------------------------------------------------------------------------
    def _admit(self) -> None:
        new: list[Sequence] = []
        contexts: list[list[int]] = []
        free = self.max_batch - len(self._active)
        while self._waiting and self._waiting[0].params.n <= free:
            req = self._waiting[0]
            p, n = req.admitted, req.params.n
            req.admitted += 1
            if req.admitted == len(req.prompts):
                self._waiting.popleft()
            seed = req.params.seed
            for j in range(n):
                gen = None if seed is None else torch.Generator().manual_seed(sequence_seed(seed, p, j))
                new.append(Sequence(req, p, j, gen))
            contexts.append(req.prompts[p])
            free -= n
        if not new:
            return
        start = len(self._active)
        # Room for any prompt the engine accepts (it truncates to max_prompt_len) plus the new tokens, so
        # the cache grows again only for a larger max_new_tokens; in multiples of 64 positions.
        need_len = max(max(len(s.prompt), self.max_prompt_len) + s.req.params.max_new_tokens for s in new)
        self.backend.capacity(self._slot_capacity(start + len(new)), -(-need_len // 64) * 64)
        repeats = [s.req.params.n for s in new if s.sample_idx == 0]
        logits, routing = [], []
        for a, b in self._chunks([len(c) for c in contexts]):
            first = start + sum(repeats[:a])
            logits.append(self.backend.prefill(contexts[a:b], first, repeats[a:b]))
            routing.extend(getattr(self.backend, "routing_out", ()))
            self.num_prefill_forwards += 1
        if routing:  # each prompt's, to its n samples (a recompute's prefill after a swap records nothing: each
            # position keeps the routing of the forward that sampled from it)
            for s, r in zip(new, [r for r, n in zip(routing, repeats) for _ in range(n)]):
                s.routing.append(r)
        rep = torch.tensor(repeats, device=self.device)
        self._active.extend(new)
        self._rows = None
        self._advance(new, torch.cat(logits).repeat_interleave(rep, 0))
        self._retire()

    def _slot_capacity(self, needed: int) -> int:
        """Grow the slot count in powers of two, capped at max_batch."""
        return min(self.max_batch, 1 << max(0, needed - 1).bit_length())

    # -- decoding ----------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        batch = len(self._active)
        tokens = torch.tensor([s.tokens[-1] for s in self._active], device=self.device)
        logits = self.backend.decode(tokens)
        for s, r in zip(self._active, getattr(self.backend, "routing_out", ())):
            s.routing.append(r)
        self.num_decode_forwards += 1
        self.decode_tokens_total += batch
        self.decode_batch_sizes.append(batch)
        if self._rows is None:
            self._rows = RowParams.build([s.req.params for s in self._active], self.vocab_size, self.device)
            self._rows.any_seeded = any(s.gen is not None for s in self._active)
        self._advance(self._active, logits, self._rows)
        # the step's time is taken before its finished requests wake their callers: a caller that resumes first
        # (and a step time that counted its wake-up) would not see its last step in `step_times_s`
        self._deferred = []
        try:
            self._retire()
            self.step_times_s.append(time.perf_counter() - t0)
            if self.tuner is not None:
                self.tuner.record(self.step_times_s[-1], batch)
        finally:
            done, self._deferred = self._deferred, None
            for req in done:
                req.resolve(result=req.results)

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor, rows: RowParams | None = None) -> None:
        """Sample one token for each of `seqs` (rows of `logits`), append it, mark finished ones."""
        if rows is None:
            rows = RowParams.build([s.req.params for s in seqs], self.vocab_size, self.device)
            rows.any_seeded = any(s.gen is not None for s in seqs)
        uniforms = None
        if rows.any_sampled:
            uniforms = torch.rand(len(seqs), generator=self.generator)
            if rows.any_seeded:  # a seeded sequence's uniform comes from its own stream
                for i, s in enumerate(seqs):
                    if s.gen is not None:
                        uniforms[i] = torch.rand((), generator=s.gen)
            uniforms = uniforms.to(self.device)
        tokens, logprobs = sample(logits, rows, uniforms)
        version = self.version
        for s, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            s.finish = s.finish_reason(tok)
        self.tokens_generated += len(seqs)

    # -- retiring ----------------------------------------------------------------------------------
    def _retire(self) -> None:
        active = self._active
        if not any(s.finish for s in active):
            return
        i = 0
        while i < len(active):
            if active[i].finish is None:
                i += 1
                continue
            self._complete(active[i])
            while len(active) - 1 > i and active[-1].finish is not None:
                self._complete(active.pop())
            last = len(active) - 1
            if last > i:
                self.backend.move(last, i)
                active[i] = active[last]
            active.pop()
            i += 1
        self._rows = None

    def _complete(self, s: Sequence) -> None:
        req = s.req
        req.results[s.prompt_idx][s.sample_idx] = s.completion()
        req.pending -= 1
        if req.pending == 0 and not req.cancelled:
            if self._deferred is not None:  # inside a decode step: resolved once the step is recorded
                self._deferred.append(req)
            else:
                req.resolve(result=req.results)

    def _abort_all(self, reason: str) -> int:
        """Finish every running and waiting sequence now with `reason`; returns how many."""
        count = len(self._active)
        for s in self._active:
            s.finish = reason
            self._complete(s)
        self._active.clear()
        self._rows = None
        while self._waiting:
            req = self._waiting.popleft()
            for p in range(req.admitted, len(req.prompts)):
                for j in range(req.params.n):
                    seq = Sequence(req, p, j, None, finish=reason)
                    self._complete(seq)
                    count += 1
        return count

    def _drop_cancelled(self) -> None:
        if not any(s.req.cancelled for s in self._active) and not any(r.cancelled for r in self._waiting):
            return
        self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
        for s in self._active:
            if s.req.cancelled:
                s.finish = "abort"
        self._retire()

    def _fail_all(self, exc: BaseException, swaps: list[Swap], interrupts: list, sleeps: list = ()) -> None:
        reqs = {id(s.req): s.req for s in self._active}
        reqs.update((id(r), r) for r in self._waiting)
        self._active.clear()
        self._waiting.clear()
        self._rows = None
        for req in reqs.values():
            req.resolve(error=exc)
        for s in swaps:
            if not s.done.is_set():
                s.error = s.error or exc
                s.done.set()
        for fut in interrupts:
            if not fut.done():
                fut.set_result(0)
        for fut in sleeps:
            if not fut.done():
                fut.set_exception(exc)
