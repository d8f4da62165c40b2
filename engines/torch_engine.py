"""Native rollout engine: continuous batching over a slot KV cache, on any HF causal LM (CPU or GPU).

Place in the dataflow: a Generator role calls `generate(prompts, params)` (from as many concurrent
episodes as it likes) and wraps the returned `Completion`s into Trajectories; the weight receiver calls
`load_weights` after each broadcast from the Trainer. The Trainer also wraps its own module with
`TorchEngine.from_model` for held-out evaluation (weights shared, never copied).

Pieces: `engines.torch_model` (the fast Llama/Qwen2 forward over a preallocated slot KV cache) or
`engines.hf_fallback` (any other model; a warning says which and why), `engines.scheduler` (the loop on
its own thread that admits, prefills, decodes, retires and swaps weights at step boundaries),
`engines.requests` (per-request/sequence state), `engines.sampling` (per-row temperature / top-k /
top-p / seed). This module validates inputs and turns calls into scheduler commands.

Semantics callers rely on:
* Behaviour logprob = log_softmax(logits / T) over the full vocabulary at the sampled token; greedy
  (T = 0) reports log_softmax(logits). Every token carries the version that sampled it.
* `load_weights` is an *in-flight* update: it blocks only its calling thread (run it with
  `asyncio.to_thread`) until the scheduler has copied the tensors at the next decode-step boundary (at once
  when idle). Unfinished sequences then continue under the new version; with `kv_on_update="recompute"`
  (default) their K/V is recomputed first, so every later logprob is exactly the new policy's; with
  `"keep"` the old K/V is reused (a mixture of versions; the Completion says `kv_reused=True`).
* `interrupt()` ends every in-flight sequence at the next boundary with finish_reason "abort" and its
  partial tokens, logprobs and versions: resubmit `prompt_ids + response_ids` to carry it over.
* Stop strings need a detokenizer: pass `detokenize`, or (engines built from a path) the model folder's
  tokenizer is loaded on first use. A sequence stops once its decoded response contains a stop string;
  the tokens up to and including the one that completed it are returned, finish_reason "stop".
* `sleep()` (colocated placement, only while idle: with a sequence in flight it raises and changes nothing)
  releases the K/V cache and the CUDA-graph buffers and, on CUDA, empties torch's cache so the trainer can use
  the memory; `generate` raises until `wake()`, `load_weights` still lands. The cache is allocated again by the
  first request after `wake()`, so the same seeded request gives the same tokens with or without a sleep.
* A seeded request gives each sample its own random stream, so its tokens do not depend on what else is
  in the batch; unseeded requests share the engine's stream (seeded by `seed`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

import torch

from asyncrl.messages import Completion, SamplingParams
from engines import hf
from engines.base import check_prompts
from engines.hf_fallback import HFDecoder
from engines.requests import Request, Swap
from engines.routing import moe_routers
from engines.scheduler import Scheduler
from engines.torch_model import SlotDecoder, unsupported_reason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """Keyword options of `TorchEngine` beyond the RolloutEngine basics."""

    max_batch: int = 256               # most sequences decoded together (KV slots); more wait, FIFO
    kv_on_update: str = "recompute"    # "recompute" | "keep": what in-flight swaps do with existing K/V
    fast: bool | None = None           # None: fast path when supported; False: force the HF fallback
    admit_window_s: float = 0.001      # idle -> busy: wait until no request came for this long (at most
                                       # 10x), so that a burst of concurrent calls is prefilled together
    max_prefill_tokens: int = 8192     # padded tokens per prefill forward (bounds prefill memory)
    cuda_graphs: bool | None = None    # None: on for a CUDA device on the fast path; decode steps replay a
                                       # CUDA graph per batch bucket (engines.torch_model._StaticDecode)
    record_routing: bool = False       # an MoE model: each completion carries the experts every position was
                                       # routed to (Completion.routed_experts; engines/routing.py)
    lm_head_fp32: bool = False         # on bf16 / fp16 weights, the LM head's product in float32 from a float32
                                       # copy of the head (fast path; engines.torch_model.SlotDecoder)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"TorchEngine max_batch must be >= 1, got {self.max_batch}")
        if self.kv_on_update not in ("recompute", "keep"):
            raise ValueError(f"TorchEngine kv_on_update must be 'recompute' or 'keep', got {self.kv_on_update!r}")
        if self.max_prefill_tokens < 1 or self.admit_window_s < 0:
            raise ValueError("TorchEngine max_prefill_tokens must be >= 1 and admit_window_s >= 0")


async def _no_completions() -> list[list[Completion]]:
    return []


def _options(options: dict[str, Any]) -> EngineOptions:
    known = set(EngineOptions.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"TorchEngine: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return EngineOptions(**options)


class TorchEngine:
    """RolloutEngine over a HF causal LM; see the module docstring.

    Built from a path the engine owns its module and stores each layer's q/k/v and gate/up weights in one
    fused buffer (the module's Parameters become views of it: same names, shapes and values, one matmul
    instead of three). `from_model` touches nothing of the module it shares.

    Counters (read-only): `num_forwards` = `num_prefill_forwards` + `num_decode_forwards`,
    `tokens_generated`; `scheduler` holds the per-step records (`decode_batch_sizes`, `step_times_s`,
    `swap_pauses_s`) and the `on_step` hook; `stats()` summarises them.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_prompt_len: int = 256,
        seed: int = 0,
        eos_token_ids: list[int] | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        **options: Any,
    ) -> None:
        opts = _options(options)
        model = hf.load_model(model_path, dtype=dtype, device=device)
        eos = hf.eos_token_ids(model) if eos_token_ids is None else eos_token_ids
        self._model_path = str(model_path)
        self._setup(model, eos, max_prompt_len, seed, torch.device(device), detokenize, opts)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        *,
        eos_token_ids: list[int],
        max_prompt_len: int = 256,
        seed: int = 0,
        device: str | torch.device | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        **options: Any,
    ) -> "TorchEngine":
        """Wrap an existing module without copying its weights (e.g. the trainer's, for evaluation)."""
        self = cls.__new__(cls)
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        self._model_path = None
        self._setup(model, eos_token_ids, max_prompt_len, seed, dev, detokenize, _options(options))
        return self

    def _setup(self, model, eos, max_prompt_len, seed, device, detokenize, options: EngineOptions) -> None:
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        self.model = model
        self.device = device
        self.eos_token_ids = [int(i) for i in eos]
        self.max_prompt_len = max_prompt_len
        self.options = options
        self._detokenize = detokenize
        self._vocab_size = model.get_input_embeddings().num_embeddings
        reason = unsupported_reason(model) if options.fast is not False else "fast=False"
        if options.record_routing:
            if not moe_routers(model):
                raise ValueError("TorchEngine record_routing: the model has no MoE router (a dense model routes "
                                 "nothing; turn routing replay off)")
            reason = reason or "record_routing (the HF path records each forward's routing)"
        if options.cuda_graphs and device.type != "cuda":
            raise ValueError(f"TorchEngine cuda_graphs=True needs a CUDA device, got {device}")
        if reason is None:
            graphs = "cuda" if device.type == "cuda" and options.cuda_graphs is not False else "off"
            backend = SlotDecoder(model, device, fuse=self._model_path is not None, graphs=graphs,
                                  fp32_head=options.lm_head_fp32)
        else:
            log.warning("TorchEngine: HF fallback path (one forward per sequence and step): %s%s", reason,
                        "; its LM head runs in the model's dtype (lm_head_fp32 is the fast path's)"
                        if options.lm_head_fp32 and model.dtype != torch.float32 else "")
            backend = HFDecoder(model, device, record_routing=options.record_routing)
        self.fast = reason is None
        self.scheduler = Scheduler(
            backend, vocab_size=self._vocab_size, device=device, seed=seed, max_batch=options.max_batch,
            max_prompt_len=max_prompt_len, kv_on_update=options.kv_on_update, admit_window_s=options.admit_window_s,
            max_prefill_tokens=options.max_prefill_tokens,
        )
        self._closed = False

    # ---- counters ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.scheduler.version

    @property
    def num_prefill_forwards(self) -> int:
        return self.scheduler.num_prefill_forwards

    @property
    def num_decode_forwards(self) -> int:
        return self.scheduler.num_decode_forwards

    @property
    def num_forwards(self) -> int:
        return self.scheduler.num_prefill_forwards + self.scheduler.num_decode_forwards

    @property
    def tokens_generated(self) -> int:
        return self.scheduler.tokens_generated

    @property
    def swap_pauses_s(self) -> Sequence[float]:
        """The pauses of the last swaps (the scheduler's `history` of them)."""
        return self.scheduler.swap_pauses_s

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        steps = s.num_decode_forwards
        times = list(s.step_times_s)
        return {
            "engine/prefill_forwards": float(s.num_prefill_forwards),
            "engine/decode_forwards": float(steps),
            "engine/tokens": float(s.tokens_generated),
            "engine/decode_batch/mean": s.decode_tokens_total / steps if steps else 0.0,
            "engine/decode_tokens": float(s.decode_tokens_total),  # sum of decode batch sizes, since the start
            "engine/step_s/mean": sum(times) / len(times) if times else 0.0,
            "engine/swap_pause_s/max": s.swap_pause_s_max,
            "engine/swap_pause_s/sum": s.swap_pause_s_sum,
        }

    # ---- public API -------------------------------------------------------------------------------
    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        req = self._request(prompts, params)
        if req is None:
            return []
        self.scheduler.submit(req)
        return await self._result(req)

    def submit_many(self, calls: list[tuple[list[list[int]], SamplingParams]],
                    ) -> list[Awaitable[list[list[Completion]]]]:
        """Begin one `generate(prompts, params)` per call, all posted to the engine at once (called on the event
        loop's thread); returns each call's outcome to await, in order. The engine admits them in the same
        step whenever its slots allow, so their batch does not depend on how far apart the calls were made (an
        exact resume needs every run to batch alike). Each call is validated first; one that fails raises here,
        before anything is posted."""
        reqs = [self._request(prompts, params) for prompts, params in calls]
        self.scheduler.submit_many([r for r in reqs if r is not None])
        return [self._result(r) if r is not None else _no_completions() for r in reqs]

    def _request(self, prompts: list[list[int]], params: SamplingParams) -> Request | None:
        """The engine's request for `generate(prompts, params)`, validated; None for no prompts."""
        params.validate()
        self._check_prompts(prompts)
        if params.n > self.options.max_batch:
            raise ValueError(f"SamplingParams.n ({params.n}) exceeds the engine's max_batch ({self.options.max_batch})")
        if self._closed:
            raise RuntimeError("TorchEngine.generate called after close()")
        detokenize = self._stop_decoder() if params.stop else None
        if not prompts:
            return None
        kept = [list(p[-self.max_prompt_len :]) for p in prompts]
        loop = asyncio.get_running_loop()
        return Request(
            prompts=kept, truncated=[len(k) < len(p) for k, p in zip(kept, prompts)], params=params,
            stop_ids=frozenset((*([] if params.ignore_eos else self.eos_token_ids), *params.stop_token_ids)),
            detokenize=detokenize,
            loop=loop, future=loop.create_future(),
        )

    async def _result(self, req: Request) -> list[list[Completion]]:
        try:
            return await req.future
        except asyncio.CancelledError:
            self.scheduler.cancel(req)
            raise

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `tensors` into the model in place and set `version`; a subset of names is allowed.

        Names are those of `state_dict()`; for tied weights either name (or both, if equal) works.
        Raises ValueError on an unknown name, a shape mismatch or tied names sent with different
        values, before anything is copied. Blocks the calling thread until the swap has landed at the
        next decode-step boundary (at once when the engine is idle); generation is paused only for the
        copy (and the K/V recompute with kv_on_update="recompute"). `tensors` must stay untouched until
        it returns (they are the caller's staging copy).
        """
        if self._closed:
            raise RuntimeError("TorchEngine.load_weights called after close()")
        pairs = self._validated_targets(tensors)

        def copy() -> None:
            for dst, src in pairs:
                dst.copy_(src)

        self.scheduler.swap(Swap(copy=copy, version=int(version)))
        log.debug("loaded %d tensors, version %d", len(tensors), version)

    async def interrupt(self) -> int:
        """Make every in-flight request return now: running and waiting sequences finish with
        finish_reason "abort" and what they have so far. Returns how many sequences were aborted."""
        if self._closed:
            return 0
        return await asyncio.wrap_future(self.scheduler.interrupt())

    async def sleep(self) -> None:
        """Release the K/V cache and the CUDA-graph buffers (on CUDA: and hand them back to the device). Only
        while idle: RuntimeError, nothing changed, if a sequence is in flight. `generate` raises until `wake`."""
        if self._closed:
            raise RuntimeError("TorchEngine.sleep called after close()")
        await asyncio.wrap_future(self.scheduler.sleep())

    async def wake(self) -> None:
        """Accept requests again; the cache is allocated again, as large as they need, by the first of them."""
        if self._closed:
            raise RuntimeError("TorchEngine.wake called after close()")
        self.scheduler.wake()

    @property
    def asleep(self) -> bool:
        return self.scheduler.asleep

    async def close(self) -> None:
        """Stop the scheduler thread; requests still in flight fail with RuntimeError."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self.scheduler.close)
        self.model = None  # drop our reference only; a wrapped trainer module lives on

    # ---- internals ----------------------------------------------------------------------------------
    def _check_prompts(self, prompts: list[list[int]]) -> None:
        check_prompts(prompts, self._vocab_size)

    def _stop_decoder(self) -> Callable[[list[int]], str]:
        if self._detokenize is None:
            if self._model_path is None:
                raise ValueError(
                    "SamplingParams.stop needs a detokenizer: build the engine with detokenize=..."
                )
            tok = hf.load_tokenizer(self._model_path)
            self._detokenize = lambda ids: tok.decode(ids, skip_special_tokens=True)
        return self._detokenize

    def _validated_targets(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) pairs, one per storage; every check runs before anything is copied."""
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        pairs: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
        for name, src in tensors.items():
            if name not in targets:
                raise ValueError(f"load_weights: unknown tensor {name!r} (not a parameter or buffer of the model)")
            want = tuple(targets[name].shape)
            if tuple(src.shape) != want:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(src.shape)}, the model expects {want}")
            dst = targets[name].data
            first = pairs.setdefault(dst.data_ptr(), (name, dst, src))
            if first[0] != name and not torch.equal(first[2].to(src.device, src.dtype), src):
                raise ValueError(
                    f"load_weights: tied tensors {first[0]!r} and {name!r} were sent with different values"
                )
        return [(dst, src) for _, dst, src in pairs.values()]
