"""SGLang rollout engine: `RolloutEngine` + `CollectiveWeightEngine` over SGLang's offline `sglang.Engine`.

NOT RUN AGAINST A REAL SGLANG: no machine available to this project can install or run SGLang. The
adapter follows SGLang's source as read (sgl-project/sglang, 2025: `srt/entrypoints/engine.py`,
`srt/managers/tokenizer_manager.py`, `srt/model_executor/model_runner.py`, `srt/utils` and
`srt/layers/sampler.py`); it is tested against a stand-in (tests/unit/test_sglang_contract.py) and by
tests marked `sglang` that run only where SGLang is installed (tests/sglang_engine/).

Place in the dataflow: a Generator holds this engine like any other (`rollout.engine = "sglang"`). Token
ids go in, token ids + behaviour logprobs + version stamps come out. New weights arrive through
SGLang's own weight-update group: the Trainer (rank 0) broadcasts each tensor with
`transports.sglang.PerTensorSender` (the "per_tensor" transport), SGLang's scheduler process(es)
receive them in `update_weights_from_distributed`.

Wire protocol of one weight update (SGLang's, not `transports.collective`'s header + buckets):
    group     SGLang ranks join with `init_weights_update_group(master_address, master_port, rank_offset,
              world_size, group_name, backend)`, i.e. torch's tcp:// rendezvous on the trainer's TCPStore,
              `PrefixStore(group_name, store)` and torch's `_new_process_group_helper` (keys under
              `<group_name>/<device>/`). The trainer joins the same keys without touching torch's global
              group registry (`transports.sglang.join_sglang_sender`).
    header    not part of SGLang's protocol: before each update the sender sets the store key
              `asyncrl-sglang/<group_name>/<n>` to msgpack [version, meta_crc]; the adapter (in the
              generator process, a client of the same store) reads it to learn the version and to refuse
              a different `WeightsMeta` before SGLang allocates anything.
    tensors   one broadcast from rank 0 per tensor of `WeightsMeta.tensors`, in that order, in the
              tensor's own dtype and shape (SGLang receives into `torch.empty(shape, dtype)`).

Semantics callers rely on:
* Updates land between requests, never inside one: `receive_weights` / `load_weights` first stop new
  requests and wait for running ones to finish (SGLang's own writer lock does the same), so each
  completion's `versions` are exact. There are no in-flight swaps and no `interrupt()`; `kv_on_update`
  is accepted and has nothing to do. The prefix cache is flushed after every update.
* `n` samples per prompt are sent as n copies of the prompt in one batch request (explicit order; SGLang's
  radix cache shares their prefix), not as SGLang's `n`.
* A seeded request gives sample k of the request the SGLang `sampling_seed` derived from (seed, k).

Assumptions about SGLang (each one is where a real run could differ):
1. `sglang.Engine(model_path=, dtype=, random_seed=, skip_tokenizer_init=, **server_args)`; its
   `async_generate(input_ids=[[...], ...], sampling_params=dict | list[dict], return_logprob=True,
   logprob_start_len=-1)` returns one dict per input: {"output_ids": [...], "meta_info": {"finish_reason":
   {"type": "stop" | "length" | "abort", ...}, "output_token_logprobs": [(logprob, token_id, text|None),
   ...], "completion_tokens": int, ...}} ("text" too when the tokenizer is loaded).
2. Sampling-param keys: max_new_tokens, temperature (0 = greedy, made top_k=1), top_p, top_k (-1 = off),
   stop, stop_token_ids, no_stop_trim, sampling_seed (newer SGLang; only sent for seeded requests).
   Stop strings need SGLang's tokenizer, so the engine loads it (skip_tokenizer_init=False by default).
3. Logprobs: SGLang's sampler returns log(softmax(logits / T)) renormalised over the top-p nucleus (top-k
   not applied), and log_softmax(logits) for greedy requests; with top_p = 1 this is asyncrl's definition.
   With the env var SGLANG_RETURN_ORIGINAL_LOGPROB (older: RETURN_ORIGINAL_LOGPROB) set, it returns the
   raw T = 1 logprobs instead: the adapter then refuses temperatures other than 0 and 1.
4. The Engine's control methods are synchronous wrappers (`self.loop.run_until_complete(
   tokenizer_manager.X(ReqInput, None))`) that cannot run inside a running loop; `_AsyncSGLang` awaits
   the same tokenizer-manager coroutines with the same `sglang.srt.managers.io_struct` request objects
   (InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput)
   on the engine's own loop, which runs on a thread of this adapter (SGLang allows a tokenizer manager off
   the main thread; it then installs no signal handlers, with a warning).
5. Control results are (success, message) tuples or objects with `.success` / `.message`.
6. SGLang's group keys are PrefixStore(group_name) + torch's "<group_name>/<device>/" (read in current SGLang; a
   release that prefixes differently makes the join time out): `transports.sglang.join_sglang_sender`
   builds the same.
7. One SGLang rank per engine (tp_size = 1): SGLang's ranks are rank_offset + tp_rank, and asyncrl's
   controller gives each generator one rank. tp_size > 1 needs the controller to count tp ranks.
8. SGLang's import sets a uvloop event-loop policy and the multiprocessing start method to "spawn"
   process-wide (its side effects, not ours).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.messages import Completion, SamplingParams, WeightsMeta
from transports.base import sync_stats
from transports.sglang import GROUP_NAME, read_header

log = logging.getLogger(__name__)

ORIGINAL_LOGPROB_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")
_FINISH = {"stop": "stop", "length": "length"}


class SGLangResponseError(RuntimeError):
    """SGLang answered with something the adapter cannot read (a version mismatch or a bug)."""


# ---- the real SGLang, driven from a running loop ---------------------------------------------------
class _AsyncSGLang:
    """sglang.Engine with async control methods (assumption 4 of the module docstring). Built on the
    adapter's engine loop, so SGLang's tokenizer manager lives on that loop."""

    def __init__(self, **engine_kwargs: Any) -> None:
        try:
            import sglang  # optional extra: imported only when an SGLang engine is built
        except ImportError as exc:
            raise ImportError("rollout.engine = 'sglang' needs SGLang: pip install 'sglang[all]' (CUDA machines; "
                              "see docs/engines.md)") from exc
        engine_cls = getattr(sglang, "Engine", None)  # None: e.g. a folder named sglang/ shadows the package
        if engine_cls is None:
            raise ImportError(f"the imported 'sglang' ({getattr(sglang, '__path__', sglang)}) has no Engine: "
                              "install SGLang, or remove what shadows it on sys.path")
        self.engine = engine_cls(**engine_kwargs)
        self.tp_size = int(engine_kwargs.get("tp_size", 1))

    async def async_generate(self, **kwargs: Any) -> Any:
        return await self.engine.async_generate(**kwargs)

    async def init_weights_update_group(self, **kwargs: Any) -> Any:
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        return await self.engine.tokenizer_manager.init_weights_update_group(
            InitWeightsUpdateGroupReqInput(**kwargs), None)

    async def update_weights_from_distributed(self, **kwargs: Any) -> Any:
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        return await self.engine.tokenizer_manager.update_weights_from_distributed(
            UpdateWeightsFromDistributedReqInput(**kwargs), None)

    async def update_weights_from_tensor(self, named_tensors: list[tuple[str, Tensor]], load_format: str | None = None,
                                         flush_cache: bool = True) -> Any:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        per_rank = getattr(self.engine, "_serialize_tensors_per_rank", None)
        payload = (per_rank(named_tensors, load_format) if per_rank is not None
                   else [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self.tp_size)])
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format=load_format,
                                              flush_cache=flush_cache)
        return await self.engine.tokenizer_manager.update_weights_from_tensor(obj, None)

    async def flush_cache(self) -> Any:
        return await self.engine.tokenizer_manager.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _check_result(result: Any, what: str) -> None:
    """Raise if an SGLang control call reports failure (assumption 5)."""
    if result is None:
        return
    if isinstance(result, bool):
        ok, message = result, ""
    elif isinstance(result, (tuple, list)) and result and isinstance(result[0], bool):
        ok, message = result[0], (result[1] if len(result) > 1 else "")
    elif hasattr(result, "success"):
        ok, message = bool(result.success), getattr(result, "message", "")
    else:
        raise SGLangResponseError(f"SGLang {what} returned {result!r}; expected (success, message)")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _sample_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(repr((seed, index)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _original_logprobs() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in ORIGINAL_LOGPROB_ENV)


def _vocab_size(model_path: str) -> int | None:
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no local config (e.g. a buffer id): SGLang validates ids itself


def parse_output(out: Any) -> tuple[list[int], list[float], str]:
    """One SGLang generate result -> (token ids, logprobs, finish reason); SGLangResponseError if unreadable."""
    if not isinstance(out, Mapping) or not isinstance(out.get("meta_info"), Mapping):
        raise SGLangResponseError(f"SGLang output has no 'meta_info' dict: {str(out)[:200]}")
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, (list, tuple)):
        raise SGLangResponseError("SGLang meta_info has no 'output_token_logprobs' list (was return_logprob=True "
                                  "dropped?)")
    try:
        logprobs = [float(e[0]) for e in entries]
        ids = [int(e[1]) for e in entries]
    except (TypeError, ValueError, IndexError) as exc:
        raise SGLangResponseError(f"SGLang output_token_logprobs entries are not (logprob, token_id, text): "
                                  f"{str(entries)[:200]}") from exc
    output_ids = out.get("output_ids")
    if output_ids is not None and list(output_ids) not in (ids, ids[:-1]):  # [:-1]: a trimmed stop token
        raise SGLangResponseError(f"SGLang output_ids {list(output_ids)[:20]} disagree with the token ids of "
                                  f"output_token_logprobs {ids[:20]}")
    count = meta.get("completion_tokens")
    if isinstance(count, int) and count != len(ids):
        raise SGLangResponseError(f"SGLang reports {count} completion tokens but {len(ids)} logprobs")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else None
    if kind == "abort":
        raise RuntimeError(f"SGLang aborted the request: {reason.get('message', reason)}")
    if kind not in _FINISH:
        raise SGLangResponseError(f"SGLang finish_reason {reason!r} is not a finished 'stop' or 'length'")
    return ids, logprobs, _FINISH[kind]


class SGLangEngine:
    """RolloutEngine + CollectiveWeightEngine over `sglang.Engine`; see the module docstring.

    Keyword arguments are those `asyncrl.deploy.build` passes (`model_path`, `dtype`, `max_prompt_len`, `seed`,
    `detokenize`, `kv_on_update`), plus `group_name` (SGLang weight-update group), `engine_factory`
    (builds the SGLang engine from its keyword arguments; default: the real one, tests pass a stand-in)
    and any `sglang.Engine` server argument (`tp_size`, `mem_fraction_static`, ...), passed through.
    `detokenize` is ignored: SGLang detokenizes stop strings with its own tokenizer.
    """

    def __init__(self, model_path: str, *, dtype: str = "auto", max_prompt_len: int = 256, seed: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None, kv_on_update: str = "recompute",
                 group_name: str = GROUP_NAME, engine_factory: Callable[..., Any] | None = None,
                 **sglang_kwargs: Any) -> None:
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        if kv_on_update not in ("recompute", "keep"):
            raise ValueError(f"SGLangEngine kv_on_update must be 'recompute' or 'keep', got {kv_on_update!r}")
        del detokenize  # SGLang detokenizes with its own tokenizer (stop strings)
        self.max_prompt_len = max_prompt_len
        self.group_name = group_name
        kwargs = {"model_path": str(model_path), "dtype": dtype, "random_seed": seed,
                  "skip_tokenizer_init": False, **sglang_kwargs}
        self.engine_kwargs = kwargs
        self._skip_tokenizer = bool(kwargs["skip_tokenizer_init"])
        self._tp_size = int(kwargs.get("tp_size", 1))
        self._vocab_size = _vocab_size(str(model_path))
        self._version = 0
        self._closed = False
        self._warned_truncation = False
        self._store: dist.Store | None = None
        self._meta: WeightsMeta | None = None
        self._received = 0
        # SGLang's tokenizer manager lives on this loop, on its own thread: callers on any loop or thread
        # reach it through run_coroutine_threadsafe, and SGLang's control coroutines can be awaited.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine-loop", daemon=True)
        self._thread.start()
        factory = engine_factory if engine_factory is not None else _AsyncSGLang
        try:
            self._engine = self._run(self._construct(factory, kwargs))
        except BaseException:
            self._stop_loop()
            raise

    # ---- RolloutEngine ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        params.validate()
        if self._closed:
            raise RuntimeError("SGLangEngine.generate called after close()")
        self._check_prompts(prompts)
        self._check_params(params)
        if not prompts:
            return []
        kept = [list(p[-self.max_prompt_len:]) for p in prompts]
        input_ids = [k for k in kept for _ in range(params.n)]
        outputs, version = await self._submit(self._generate_on_loop(input_ids, self._sampling(params, len(input_ids))))
        if isinstance(outputs, Mapping) and len(input_ids) == 1:
            outputs = [outputs]
        if not isinstance(outputs, list) or len(outputs) != len(input_ids):
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            raise SGLangResponseError(f"SGLang returned {got} outputs for a batch of {len(input_ids)} requests")
        result: list[list[Completion]] = []
        for i, (prompt, original) in enumerate(zip(kept, prompts)):
            group = []
            for out in outputs[i * params.n:(i + 1) * params.n]:
                ids, logprobs, finish = parse_output(out)
                group.append(Completion(prompt_ids=prompt, response_ids=ids, logprobs=logprobs,
                                        versions=[version] * len(ids), finish_reason=finish,
                                        prompt_truncated=len(prompt) < len(original)))
            result.append(group)
        return result

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `tensors` (state_dict names) through SGLang's update_weights_from_tensor, flush the prefix
        cache, set `version`. Blocks the calling thread (any thread: SGLang runs on the adapter's own loop)
        until running requests have finished and the weights are in. CPU tensors travel through shared
        memory, so SGLang must run on this host."""
        if self._closed:
            raise RuntimeError("SGLangEngine.load_weights called after close()")
        named = [(name, t.detach()) for name, t in tensors.items()]
        self._run(self._load_on_loop(named, int(version)))

    async def close(self) -> None:
        """Shut SGLang down (its processes); requests still in flight fail with RuntimeError."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._shutdown)

    # ---- CollectiveWeightEngine ---------------------------------------------------------------------
    async def join_weight_group(self, *, host: str, port: int, rank: int, world_size: int, backend: str,
                                timeout_s: float, meta: WeightsMeta) -> None:
        """Have SGLang join the trainer's weight-update group as `rank` (rank_offset; one SGLang rank)."""
        if not 1 <= rank < world_size:
            raise ValueError(f"an SGLang engine joins as a receiver: rank must be in [1, {world_size}), got {rank}")
        if self._tp_size != 1:
            raise NotImplementedError(f"SGLang tp_size={self._tp_size}: its ranks are rank_offset..rank_offset+"
                                      f"{self._tp_size - 1}, which asyncrl's controller does not count yet")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend must be resolved to 'gloo' or 'nccl', got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        store = await asyncio.to_thread(lambda: dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout))
        result = await self._submit(self._engine.init_weights_update_group(
            master_address=host, master_port=port, rank_offset=rank, world_size=world_size,
            group_name=self.group_name, backend=backend))
        _check_result(result, "init_weights_update_group")
        self._store, self._meta, self._received = store, meta, 0

    async def receive_weights(self) -> tuple[int, dict[str, float]]:
        """Take part in one update from the trainer's `PerTensorSender`: wait for its header, let running
        requests finish, receive and load through SGLang, flush the prefix cache, set `version`."""
        if self._store is None or self._meta is None:
            raise RuntimeError("SGLangEngine.receive_weights before join_weight_group")
        start = time.perf_counter()
        version = await self._submit(self._receive_on_loop(self._store, self._meta))
        meta = self._meta
        return version, sync_stats(meta.total_bytes, time.perf_counter() - start, len(meta.tensors))

    # ---- on the engine loop -------------------------------------------------------------------------
    async def _construct(self, factory: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        self._cond = asyncio.Condition()
        self._inflight = 0
        self._updating = False
        return factory(**kwargs)  # inside the running loop: sglang.Engine binds to it

    async def _generate_on_loop(self, input_ids: list[list[int]], sampling: Any) -> tuple[Any, int]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._updating)
            self._inflight += 1
            version = self._version
        try:
            out = await self._engine.async_generate(input_ids=input_ids, sampling_params=sampling,
                                                    return_logprob=True, logprob_start_len=-1)
        except asyncio.CancelledError:
            if self._closed:
                raise RuntimeError("SGLangEngine was closed while the request was in flight") from None
            raise
        finally:
            async with self._cond:
                self._inflight -= 1
                self._cond.notify_all()
        return out, version

    @asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """No request runs inside: new ones wait, running ones finish first (updates land between requests)."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._updating)
            self._updating = True
            await self._cond.wait_for(lambda: self._inflight == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._updating = False
                self._cond.notify_all()

    async def _flush(self) -> None:
        result = await self._engine.flush_cache()
        _check_result(result, "flush_cache")

    async def _load_on_loop(self, named: list[tuple[str, Tensor]], version: int) -> None:
        async with self._exclusive():
            result = await self._engine.update_weights_from_tensor(named_tensors=named, load_format=None,
                                                                   flush_cache=True)
            _check_result(result, "update_weights_from_tensor")
            await self._flush()
            self._version = version

    async def _receive_on_loop(self, store: dist.Store, meta: WeightsMeta) -> int:
        version = await asyncio.to_thread(read_header, store, self.group_name, self._received, meta)
        async with self._exclusive():
            result = await self._engine.update_weights_from_distributed(
                names=[m.name for m in meta.tensors], dtypes=[m.dtype for m in meta.tensors],
                shapes=[list(m.shape) for m in meta.tensors], group_name=self.group_name, flush_cache=True)
            _check_result(result, "update_weights_from_distributed")
            await self._flush()
            self._version = int(version)
        self._received += 1
        return int(version)

    async def _shutdown_on_loop(self) -> None:
        try:
            self._engine.shutdown()
        finally:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            if others:  # let them unwind, so every caller gets its answer before the loop stops
                await asyncio.wait(others, timeout=10)

    # ---- plumbing -------------------------------------------------------------------------------------
    async def _submit(self, coro: Any) -> Any:
        """Await `coro` on the engine loop from the caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _run(self, coro: Any) -> Any:
        """Run `coro` on the engine loop and block this (non-engine) thread until it is done."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SGLangEngine: blocking call from the engine's own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _shutdown(self) -> None:
        try:
            self._run(self._shutdown_on_loop())
        except concurrent.futures.CancelledError:
            pass
        finally:
            self._stop_loop()
            self._store = None

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; an engine needs at least one prompt token")
            if self._vocab_size is not None and (min(prompt) < 0 or max(prompt) >= self._vocab_size):
                raise ValueError(f"prompt {i} has token ids outside [0, {self._vocab_size})")

    def _check_params(self, params: SamplingParams) -> None:
        if params.stop and self._skip_tokenizer:
            raise ValueError("SamplingParams.stop needs SGLang's tokenizer: build the engine without "
                             "skip_tokenizer_init=True")
        if _original_logprobs() and params.temperature not in (0.0, 1.0):
            raise ValueError(f"{'/'.join(ORIGINAL_LOGPROB_ENV)} is set, so SGLang returns T=1 logprobs; "
                             f"temperature {params.temperature} would get the wrong behaviour logprobs: unset it")
        if params.temperature > 0 and (params.top_p < 1 or params.top_k != -1) and not self._warned_truncation:
            self._warned_truncation = True
            log.warning("SGLang renormalises logprobs over the top-p nucleus and ignores top-k in them: with "
                        "top_p=%s top_k=%s they are not log_softmax(logits/T); do not train on them",
                        params.top_p, params.top_k)

    @staticmethod
    def _sampling(params: SamplingParams, count: int) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang sampling_params: one dict for the batch, or one per request when seeded."""
        base: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "top_k": params.top_k, "no_stop_trim": True}
        if params.stop_token_ids:
            base["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            base["ignore_eos"] = True
        if params.stop:
            base["stop"] = list(params.stop)
        if params.seed is None:
            return base
        return [{**base, "sampling_seed": _sample_seed(params.seed, k)} for k in range(count)]
