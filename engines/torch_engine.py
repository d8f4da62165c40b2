"""Native rollout engine: batched sampling with a KV cache on any HF causal LM (CPU or GPU).

Place in the dataflow: a Generator role calls `generate(prompts, params)` and wraps the returned
`Completion`s into Trajectories; the weight receiver calls `load_weights` after each broadcast from the
Trainer. The Trainer also wraps its own module with `TorchEngine.from_model` for held-out evaluation.

One `generate` call is one batch: the prompts are left-padded and prefilled together (each prompt once;
the cache and the last logits are then repeated `n` times, so the n samples share that prefill), after
which every decode step is one forward over all prompts×n rows. A row that sampled a stop token keeps
riding along, fed padding, and emits nothing more. Behaviour logprobs follow the one definition in
ARCHITECTURE.md: log_softmax(logits / T) over the full vocabulary at the sampled token; top-k / top-p
only restrict what may be sampled. Compute runs on a worker thread under a lock that `load_weights`
also takes, so a weight swap lands between generate calls, never inside one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Mapping

import torch
import torch.nn.functional as F

from asyncrl.messages import Completion, SamplingParams
from engines import hf

log = logging.getLogger(__name__)


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """scaled [B, V] -> [B, V] with tokens outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], behaviour logprobs [B]); temperature 0 is greedy."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        logprobs = logits.log_softmax(-1)
    else:
        scaled = logits / params.temperature
        logprobs = scaled.log_softmax(-1)
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class TorchEngine:
    """RolloutEngine over a HF causal LM; see the module docstring for the batching scheme.

    Counters for tests and benchmarks: `num_forwards` (prefill + decode forwards executed) and
    `tokens_generated` (response tokens returned, padding excluded).
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
    ) -> None:
        model = hf.load_model(model_path, dtype=dtype, device=device)
        eos = hf.eos_token_ids(model) if eos_token_ids is None else eos_token_ids
        self._setup(model, eos, max_prompt_len, seed, torch.device(device))

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        *,
        eos_token_ids: list[int],
        max_prompt_len: int = 256,
        seed: int = 0,
        device: str | torch.device | None = None,
    ) -> "TorchEngine":
        """Wrap an existing module without copying its weights (e.g. the trainer's, for evaluation)."""
        self = cls.__new__(cls)
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        self._setup(model, eos_token_ids, max_prompt_len, seed, dev)
        return self

    def _setup(
        self, model: torch.nn.Module, eos: list[int], max_prompt_len: int, seed: int, device: torch.device
    ) -> None:
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        self.model = model
        self.device = device
        self.eos_token_ids = [int(i) for i in eos]
        self.max_prompt_len = max_prompt_len
        self.version = 0
        self.num_forwards = 0
        self.tokens_generated = 0
        self._vocab_size = model.get_input_embeddings().num_embeddings
        pad = getattr(model.config, "pad_token_id", None)
        self._pad_id = int(pad) if pad is not None else 0  # any valid id: padded positions are masked
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._lock = threading.Lock()
        self._closed = False
        forward_args = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values -> cache (the old name is deprecated).
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in forward_args

    # ---- public API -------------------------------------------------------------------------------

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        params.validate()
        self._check_prompts(prompts)
        if not prompts:
            return []
        return await asyncio.to_thread(self._generate_locked, prompts, params)

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `tensors` into the model in place and set `version`; a subset of names is allowed.

        Names are those of `state_dict()`; for tied weights either name (or both, if equal) works.
        Raises ValueError on an unknown name or a shape mismatch, before anything is copied. Blocks
        until a running generate call finishes (call it off the event loop if that matters).
        """
        if self._closed:
            raise RuntimeError("TorchEngine.load_weights called after close()")
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        for name, src in tensors.items():
            if name not in targets:
                raise ValueError(f"load_weights: unknown tensor {name!r} (not a parameter or buffer of the model)")
            want = tuple(targets[name].shape)
            if tuple(src.shape) != want:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(src.shape)}, the model expects {want}")
        with self._lock, torch.no_grad():
            written: dict[int, str] = {}  # storage -> first name written, to catch tied names that disagree
            for name, src in tensors.items():
                dst = targets[name].data
                first = written.setdefault(dst.data_ptr(), name)
                if first != name:
                    if not torch.equal(src.to(dst.device, dst.dtype), dst):
                        raise ValueError(
                            f"load_weights: tied tensors {first!r} and {name!r} were sent with different values"
                        )
                    continue
                dst.copy_(src)
            self.version = int(version)
        log.debug("loaded %d tensors, version %d", len(tensors), version)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            self.model = None  # drop our reference only; a wrapped trainer module lives on

    # ---- internals ----------------------------------------------------------------------------------

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; an engine needs at least one prompt token")
            if min(prompt) < 0 or max(prompt) >= self._vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self._vocab_size})")

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """One forward over the batch; returns the last position's logits [B, V]."""
        kwargs = {self._cache_kw: cache}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)
        self.num_forwards += 1
        return out.logits[:, -1]

    def _generate_locked(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        with self._lock, torch.inference_mode():
            if self._closed:
                raise RuntimeError("TorchEngine.generate called after close()")
            was_training = self.model.training
            self.model.eval()
            try:
                return self._generate(prompts, params)
            finally:
                self.model.train(was_training)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        version, n, dev = self.version, params.n, self.device
        kept = [p[-self.max_prompt_len :] for p in prompts]
        width = max(len(p) for p in kept)
        ids = torch.full((len(kept), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(kept), width), dtype=torch.long)
        for row, p in enumerate(kept):  # left padding: every prompt ends at the last column
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)

        cache = self._new_cache()
        logits = self._forward(ids, mask, pos, cache)
        if n > 1:  # the n samples of a prompt share its prefill
            cache.batch_repeat_interleave(n)
            logits, mask, pos = (t.repeat_interleave(n, dim=0) for t in (logits, mask, pos))
        next_pos = pos[:, -1:] + 1  # [R, 1], R = prompts × n

        gen = self._generator
        if params.seed is not None:
            gen = torch.Generator(device=dev).manual_seed(params.seed)
        stop_ids = torch.tensor(sorted({*self.eos_token_ids, *params.stop_token_ids}), dtype=torch.long, device=dev)
        rows = logits.shape[0]
        finished = torch.zeros(rows, dtype=torch.bool, device=dev)
        lengths = torch.zeros(rows, dtype=torch.long, device=dev)
        tokens, logprobs = [], []
        for step in range(params.max_new_tokens):
            tok, lp = sample_tokens(logits, params, gen)
            tok = tok.masked_fill(finished, self._pad_id)  # finished rows emit nothing more
            tokens.append(tok)
            logprobs.append(lp)
            lengths += (~finished).long()
            finished |= torch.isin(tok, stop_ids)
            if step == params.max_new_tokens - 1 or bool(finished.all()):
                break
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=dev)], dim=1)
            logits = self._forward(tok[:, None], mask, next_pos, cache)
            next_pos = next_pos + 1

        self.tokens_generated += int(lengths.sum())
        return _completions(prompts, kept, n, version, tokens, logprobs, lengths, finished)


def _completions(
    prompts: list[list[int]],
    kept: list[list[int]],
    n: int,
    version: int,
    tokens: list[torch.Tensor],
    logprobs: list[torch.Tensor],
    lengths: torch.Tensor,
    finished: torch.Tensor,
) -> list[list[Completion]]:
    """Per-step [R] tensors (R = prompts × n, prompt-major) -> one list of n Completions per prompt."""
    out_tokens = torch.stack(tokens, dim=1).tolist()
    out_logprobs = torch.stack(logprobs, dim=1).tolist()
    out_lengths, out_finished = lengths.tolist(), finished.tolist()
    results: list[list[Completion]] = []
    for i, prompt in enumerate(kept):
        group = []
        for r in range(i * n, (i + 1) * n):
            length = out_lengths[r]
            group.append(
                Completion(
                    prompt_ids=list(prompt),
                    response_ids=out_tokens[r][:length],
                    logprobs=out_logprobs[r][:length],
                    versions=[version] * length,
                    finish_reason="stop" if out_finished[r] else "length",
                    prompt_truncated=len(prompt) < len(prompts[i]),
                )
            )
        results.append(group)
    return results
