"""Batched sampling for the native engine: one call samples every running sequence, each with its own
temperature, top-k, top-p and random stream.

Place in the dataflow: `engines.scheduler` calls `sample` on the logits of each prefill/decode forward.
Behaviour logprobs follow the runtime's one definition (docs/architecture.md, "Logprobs"):
log_softmax(logits / T) over the full vocabulary at the sampled token (top-k / top-p only restrict what
may be sampled); a greedy row (T = 0) takes the argmax and reports log_softmax(logits). A sampled row
draws its token by inverse CDF from one uniform number per token, so a sequence with its own seeded
generator consumes exactly one draw per token, whatever else is in the batch: a seeded request
reproduces regardless of its companions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.messages import SamplingParams


@dataclass
class RowParams:
    """Per-row sampling parameters of one batch, as device tensors [B]."""

    temperature: torch.Tensor  # 1.0 where greedy, so one division serves every row
    greedy: torch.Tensor       # bool
    top_k: torch.Tensor        # long; vocabulary size where off
    top_p: torch.Tensor        # float; 2.0 where off (never reached by a cumulative mass)
    any_sampled: bool
    any_greedy: bool
    any_filter: bool
    unit_temperature: bool = False  # every row has T = 1 or is greedy: dividing by T would change nothing
    any_seeded: bool = True         # some row may draw from its own generator (the scheduler sets it)

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> "RowParams":
        greedy = [p.temperature == 0 for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        return cls(
            temperature=torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            any_sampled=not all(greedy),
            any_greedy=any(greedy),
            any_filter=any(not g and (k < vocab or p <= 1.0) for g, k, p in zip(greedy, top_k, top_p)),
            unit_temperature=all(p.temperature in (0, 1) for p in params),
        )


def _pick(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: probs [B, V] (rows sum to ~1, zeros allowed), uniforms [B] in [0, 1) -> indices [B].

    The threshold stays strictly below the total mass, so the first index whose cumulative mass exceeds it
    always has a positive probability (trailing zeros are never picked)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    x = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, rows: RowParams, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], uniforms [B] (None when every row is greedy) -> (tokens [B], behaviour logprobs [B])."""
    logits = logits.float()
    scaled = logits if rows.unit_temperature else logits / rows.temperature[:, None]  # x / 1 == x exactly
    logprobs = scaled.log_softmax(-1)
    tokens = logits.argmax(-1) if rows.any_greedy else None
    if rows.any_sampled:
        assert uniforms is not None
        if rows.any_filter:
            # Top-k, then top-p on the renormalised top-k mass, in sorted order; sample there and map back.
            ordered, order = torch.sort(scaled, dim=-1, descending=True)
            rank = torch.arange(ordered.shape[-1], device=ordered.device)[None]
            ordered = ordered.masked_fill(rank >= rows.top_k[:, None], float("-inf"))
            probs = ordered.softmax(-1)
            # Drop a token when the mass before it already reaches top_p; the top token always stays.
            probs = probs.masked_fill(probs.cumsum(-1) - probs >= rows.top_p[:, None], 0.0)
            sampled = order.gather(-1, _pick(probs, uniforms)[:, None]).squeeze(-1)
        else:
            sampled = _pick(scaled.softmax(-1), uniforms)
        tokens = sampled if tokens is None else torch.where(rows.greedy, tokens, sampled)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
