"""Token log-probabilities and entropy of a causal LM on its own samples, without full-vocabulary memory.

Place in the dataflow: the Learner's gradient passes and proximal forwards, the frozen reference (in the trainer or
the scorer) and the bare step of benchmarks/train_step.py call `token_logprobs` on one micro-batch (training/batch.py
`collate`) and read one logprob per response token: position t holds log p(token t | tokens < t) under the
sample's temperature, so position 0 never carries one.

The vocabulary-wide part is the memory: a [tokens, V] float32 tensor of logits (V = 49,152 for SmolLM2: 197 KB a
token), kept for the backward pass, plus the log-softmax and the entropy's probabilities. Two ways, by `chunk`
(trainer.logprob_chunk_tokens):

    chunk > 0   the head is fused with the log-softmax. For the span of the forward the model's output layer
                (`get_output_embeddings()`, through DDP, FSDP2 and peft wrappers) answers with the logprob and the
                entropy of the response positions only: it takes the last hidden states of the positions that
                predict a response token and runs head -> / temperature -> log_softmax -> (target, entropy)
                `chunk` rows at a time, each chunk under non-reentrant activation checkpointing, so the backward
                recomputes one chunk's logits at a time instead of keeping all of them. Peak: one chunk's
                [chunk, V] logits and softmax, not the sequence's; the cost: the head's matmul runs twice for the
                gradient passes (one more forward of it, ~1/3 of its share of the step).
    chunk = 0   the whole head at once, as HF computes it: logits from the column before the earliest response
                position on (HF `logits_to_keep`), the log-softmax on the response positions' rows alone.

Both give the same numbers (row-wise maths on the same rows); with trainer.compile the head is not patched (the
compiled graph holds the plain head) and the second way runs.

Under bf16 autocast with `float_head` (trainer.lm_head_fp32, on by default) the head's product runs in float32
either way: the hidden states (the residual stream's float32 under autocast) times the float32 master weight (a
bfloat16 model's — the frozen reference's — upcast), so the logits are not rounded to bfloat16, by up to 1/16 at a
real model's logit scale. Not behind trainer.compile (the graph holds the plain head).

Packing (trainer.pack_sequences, `packed_logprobs`): a micro-batch's samples run as one row of their real tokens,
no padding; position ids restart at 0 for each sample and HF's attention keeps the samples apart (a
block-diagonal causal mask under sdpa / eager, varlen kernels under flash-attention). The per-token results go
back to the padded [B, L] layout, so the loss, its masks and its normalisation are the padded path's. Whether it
pays depends on the attention kernel: with sdpa on a CPU the block-diagonal mask is dense, so attention costs
S^2 for a row of S tokens where padding costs B x L^2, and sorting by length (trainer.max_tokens_per_micro_batch)
is the cheaper way to drop padding there.

Prompt sharing (trainer.share_prompts, `shared_prompt_logprobs`): the samples that share a prompt run as one row of
the prompt and their replies (training/sharing.py has the layout and its mask), the fused head reading the hidden
state that predicts each reply token by its index in that layout; the results go back to [B, L] as packing's do.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from asyncrl.algorithms import entropy_from_logits
from asyncrl.training import precision
from asyncrl.training.sharing import SharedRows, attention_kind, share_prompts


def token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None, response_mask: Tensor,
                   temperature: float | Tensor, *, entropy_grad: bool = False, autocast: torch.dtype | None = None,
                   chunk: int = 0, position_ids: Tensor | None = None,
                   float_head: bool = False) -> tuple[Tensor, Tensor]:
    """input_ids, attention_mask, response_mask [B, L] (right-padded prompt+response; attention_mask None with
    `position_ids` for packed rows), temperature (float, [B] or [B, L]) -> (logprobs [B, L], entropy [B, L]); both
    0 outside response_mask.

    logprobs[b, t] = log_softmax(logits[b, t-1] / T)[input_ids[b, t]] in float32 (float64 for a float64 model),
    with grad if enabled; entropy of the same distribution, with grad only if `entropy_grad` (the entropy bonus
    trains through it; the diagnostic does not). `autocast` (trainer.mixed_precision): the model's forward runs
    under torch.autocast in that dtype; the maths on its logits stays float32. `chunk`: module doc. `float_head`
    (trainer.lm_head_fp32): under autocast, the output layer's product in float32 too (module doc).
    """
    b, width = input_ids.shape
    read = response_mask.bool().clone()
    read[:, 0] = False                                        # position 0 has nothing before it
    temp = _per_position(temperature, b, width, input_ids.device)
    targets, temps = input_ids[read], temp[read]              # one per read position, row-major
    head = _output_head(model)
    float_head = float_head and autocast is not None
    kwargs: dict[str, Any] = {"use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if head is not None and chunk > 0:
        src = read[:, 1:].nonzero()                           # (row, column) of the states that predict a read token
        with _fused_head(head, src[:, 0] * width + src[:, 1], targets, temps, chunk, entropy_grad, float_head), \
                precision.autocast(input_ids.device, autocast):
            out = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits   # [n, 2]
        tok_logp, entropy = out[:, 0], out[:, 1]
    else:
        cols = read.any(0).nonzero()
        first = int(cols[0]) if len(cols) else width - 1      # the earliest position that holds a logprob
        keep = width - (first - 1) if _takes_logits_to_keep(model) else width
        if keep < width:
            kwargs["logits_to_keep"] = keep
        with _patched(head, _float32_forward(head) if head is not None and float_head else None), \
                precision.autocast(input_ids.device, autocast):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        start = width - logits.shape[1]                       # logits column c predicts token start + c + 1
        rows = logits[:, :-1][read[:, start + 1 :]]           # [n, V]: one row per read position
        tok_logp, entropy = _logprob_entropy(rows, targets, temps, entropy_grad)
    # back to [B, L]: zeros, then the values in row-major order (masked_scatter keeps the gradient)
    logprobs = tok_logp.new_zeros((b, width)).masked_scatter(read, tok_logp)
    return logprobs, tok_logp.new_zeros((b, width)).masked_scatter(read, entropy.to(tok_logp))


def packed_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                    temperature: float | Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """`token_logprobs` of a right-padded batch computed without its padding: the B samples' real tokens packed
    into one row [1, S] (S = the tokens of all samples), position ids restarting at 0 for each, no attention mask
    (HF then builds a block-diagonal causal mask from the position ids, or runs varlen attention under
    flash-attention), and the results put back at the batch's [B, L] positions. The same numbers as the padded
    forward: each token attends to exactly its own sequence's earlier tokens at the same positions."""
    b, width = input_ids.shape
    real = attention_mask.bool()
    position_ids = (real.long().cumsum(1) - 1)[real][None]
    temp = _per_position(temperature, b, width, input_ids.device)
    logprobs, entropy = token_logprobs(model, input_ids[real][None], None, response_mask.bool()[real][None],
                                       temp[real][None], position_ids=position_ids, **kwargs)
    zeros = logprobs.new_zeros((b, width))
    return zeros.masked_scatter(real, logprobs[0]), zeros.masked_scatter(real, entropy[0])


def shared_prompt_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                           response_mask: Tensor, temperature: float | Tensor, *, entropy_grad: bool = False,
                           autocast: torch.dtype | None = None, chunk: int = 0,
                           rows: SharedRows | None = None, float_head: bool = False) -> tuple[Tensor, Tensor]:
    """`token_logprobs` of a collated batch with each prompt computed once for all its samples (trainer.share_prompts,
    training/sharing.py): the same numbers as the padded forward, at the batch's [B, L] positions. `rows`: the
    batch's layout if the caller built it already. The model's attention must take a custom mask
    (`sharing.attention_kind`); the head is fused as with chunk > 0, one piece without checkpointing at chunk 0."""
    b, width = input_ids.shape
    kind = attention_kind(getattr(_hf_model(model), "config", None))
    if kind is None:
        raise ValueError("prompt sharing needs sdpa or eager attention (a custom 4D mask)")
    rows = rows if rows is not None else share_prompts(input_ids, attention_mask, response_mask)
    read = response_mask.bool().clone()
    read[:, 0] = False
    temp = _per_position(temperature, b, width, input_ids.device)
    targets, temps = input_ids[read], temp[read]
    kwargs = {"input_ids": rows.input_ids, "attention_mask": rows.mask(kind), "position_ids": rows.position_ids,
              "use_cache": False}
    head = _output_head(model)
    if head is not None:
        with _fused_head(head, rows.src, targets, temps, chunk, entropy_grad, float_head and autocast is not None), \
                precision.autocast(input_ids.device, autocast):
            out = model(**kwargs).logits                      # [n, 2]
        tok_logp, entropy = out[:, 0], out[:, 1]
    else:                                                     # torch.compile: the whole head, then the read rows
        with precision.autocast(input_ids.device, autocast):
            logits = model(**kwargs).logits
        tok_logp, entropy = _logprob_entropy(logits.flatten(0, 1)[rows.src], targets, temps, entropy_grad)
    logprobs = tok_logp.new_zeros((b, width)).masked_scatter(read, tok_logp)
    return logprobs, tok_logp.new_zeros((b, width)).masked_scatter(read, entropy.to(tok_logp))


def _per_position(temperature: float | Tensor, b: int, width: int, device: torch.device) -> Tensor:
    """A temperature (float, [B] or [B, L]) -> [B, L], one per position."""
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    return temp.reshape(b, -1).expand(b, width) if temp.dim() else temp.expand(b, width)


def _logprob_entropy(rows: Tensor, targets: Tensor, temps: Tensor, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """rows [n, V] logits, targets [n], temps [n] -> (logprob of each target [n], entropy [n]), float32 or wider."""
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32)) / temps.to(rows.device)[:, None]
    tok_logp = rows.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(rows, dim=-1)
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        entropy = entropy_from_logits(rows)
    return tok_logp, entropy


def _head_chunk(head_forward: Any, hidden: Tensor, targets: Tensor, temps: Tensor, entropy_grad: bool) -> Tensor:
    """One chunk: hidden [c, H] -> [c, 2] (logprob, entropy); under checkpointing its logits are not kept."""
    tok_logp, entropy = _logprob_entropy(head_forward(hidden), targets, temps, entropy_grad)
    return torch.stack([tok_logp, entropy.to(tok_logp)], dim=-1)


@contextlib.contextmanager
def _fused_head(head: torch.nn.Module, src: Tensor, targets: Tensor, temps: Tensor, chunk: int,
                entropy_grad: bool, float_head: bool = False) -> Iterator[None]:
    """For the span of one forward, `head(hidden [B, L, H])` -> [n, 2]: the (logprob, entropy) of the n read
    tokens, `src` [n] indexing the flattened [B * L] hidden states that predict them, `chunk` rows at a time under
    checkpointing (chunk 0: all rows at once, kept for the backward as the plain head's logits would be);
    `float_head`: each chunk's product in float32 (`_float32_forward`)."""
    plain = _float32_forward(head) if float_head else head.forward   # the bound method: no hooks run twice

    def fused(hidden: Tensor) -> Tensor:
        h = hidden.flatten(0, 1)[src]                         # [n, H]
        step = chunk if chunk > 0 else max(h.shape[0], 1)
        parts = []
        for i in range(0, h.shape[0], step):
            args = (plain, h[i : i + step], targets[i : i + step], temps[i : i + step], entropy_grad)
            parts.append(checkpoint(_head_chunk, *args, use_reentrant=False) if chunk > 0 and torch.is_grad_enabled()
                         else _head_chunk(*args))
        if not parts:
            return hidden.new_zeros((0, 2), dtype=torch.promote_types(hidden.dtype, torch.float32))
        return torch.cat(parts)

    with _patched(head, fused):
        yield


@contextlib.contextmanager
def _patched(head: torch.nn.Module | None, forward: Any) -> Iterator[None]:
    """`head.forward` replaced by `forward` for the span (None: left alone); an instance attribute, so the
    module's hooks still run once and its state dict is untouched."""
    if head is None or forward is None:
        yield
        return
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _float32_forward(head: torch.nn.Module) -> Any:
    """The output layer's forward with its product in float32 whatever the autocast around it: the hidden
    states (float32 under autocast: the residual stream's dtype) times the weight (the float32 master, or a
    bfloat16 model's weight upcast), logits in float32 — not rounded to bfloat16 (module doc)."""
    plain = head.forward

    def forward(hidden: Tensor) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            weight = getattr(head, "weight", None)
            if isinstance(head, torch.nn.Linear) and weight is not None and weight.dtype != torch.float32:
                bias = None if head.bias is None else head.bias.float()
                return torch.nn.functional.linear(hidden.float(), weight.float(), bias)
            return plain(hidden.float())
    return forward


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that maps the last hidden states to logits, where it can be fused: not behind torch.compile,
    and not for models that change the logits after the head (final logit soft-capping)."""
    if hasattr(model, "_orig_mod"):                           # trainer.compile: the graph holds the plain head
        return None
    inner = _hf_model(model)
    get = getattr(inner, "get_output_embeddings", None)
    config = getattr(inner, "config", None)
    if get is None or getattr(config, "final_logit_softcapping", None):
        return None
    return get()


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes HF's `logits_to_keep` (through a DDP or peft wrapper: peft passes it on)."""
    return _forward_takes(type(_hf_model(model)), "logits_to_keep")


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model behind trainer.compile's, DDP's and peft's wrappers."""
    inner = getattr(model, "_orig_mod", model)                # torch.compile (trainer.compile)
    inner = getattr(inner, "module", inner)                   # DDP
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner   # peft


@functools.cache
def _forward_takes(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.forward).parameters
