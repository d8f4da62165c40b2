"""Diagnostics of a train step: entropy, the k3 KL estimator, masked means (pure tensor functions).

Place in the dataflow: the Trainer's `Learner` calls these on each forward pass to report
`trainer/entropy`, `trainer/approx_kl` and the engine-vs-trainer logprob gap; the KL-to-reference penalty
uses kl.py (whose k3 equals `approx_kl_k3`). Nothing here is trained through unless a loss chooses to.
"""

from __future__ import annotations

import torch
from torch import Tensor

# k3 is exp(r) - 1 - r: beyond |r| = 20 it is dominated by exp(r) and overflows float32 soon after.
_MAX_LOG_RATIO = 20.0


def entropy_from_logits(logits: Tensor) -> Tensor:
    """logits [..., V] -> entropy [...] in nats, computed in float32 over the full vocabulary.

    Logits of -inf (banned tokens) contribute 0, not NaN.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=p.dtype, device=p.device))
    return -plogp.sum(dim=-1)


def approx_kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """logprobs [...], ref_logprobs [...] -> per-token k3 [...] = exp(r) - 1 - r with r = ref - logprobs.

    With tokens sampled from the policy of `logprobs`, the mean of k3 is an unbiased, low-variance,
    never-negative estimate of KL(policy of logprobs || policy of ref_logprobs) (Schulman's k3).
    r is clamped to ±20 so that a single wild token cannot overflow the estimate.
    """
    r = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return r.exp() - 1.0 - r


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """values [...], mask [...] bool -> sum over mask positions (garbage elsewhere is ignored, not 0 * NaN)."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """values [...], mask [...] bool -> mean over mask positions (of all, or along `dim`); 0 if none."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)
