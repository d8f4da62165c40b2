"""KL-to-reference estimators k1 / k2 / k3 (Schulman, "Approximating KL divergence"), registered by name.

Place in the dataflow: the Trainer's `Learner` computes the reference policy's logprobs of a step's tokens
and either subtracts β·KL from the rewards (`AdvantageInput.token_rewards`, detached: "KL in reward",
as InstructGPT / REINFORCE++) or adds β·KL to the per-token loss ("KL as loss", as GRPO). With tokens
sampled from the policy π and r = log π_ref − log π:

| name | per token            | value: unbiased for KL(π‖π_ref)? | gradient wrt log π as a loss term        |
|------|----------------------|----------------------------------|------------------------------------------|
| k1   | −r = log π − log π_ref | yes, high variance, can be < 0  | 1 (zero in expectation: no KL pull)       |
| k2   | ½ r²                 | no (biased, low variance, >= 0)  | log π − log π_ref (the reverse-KL gradient)|
| k3   | e^r − r − 1          | yes, low variance, >= 0          | 1 − π_ref/π                               |

The log-ratio is clamped to ±20 like the losses, so that a single wild token cannot overflow k3.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from asyncrl.algorithms.registry import get_kl_estimator, register_kl

_MAX_LOG_RATIO = 20.0

KLKind = Literal["k1", "k2", "k3"]


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """log π − log π_ref, clamped to ±20."""
    return (logprobs - ref_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


@register_kl("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """[...] -> [...] log π − log π_ref."""
    return _log_ratio(logprobs, ref_logprobs)


@register_kl("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """[...] -> [...] ½ (log π − log π_ref)²."""
    return 0.5 * _log_ratio(logprobs, ref_logprobs) ** 2


@register_kl("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """[...] -> [...] exp(r) − r − 1 with r = log π_ref − log π (never negative)."""
    r = -_log_ratio(logprobs, ref_logprobs)
    return r.exp() - 1.0 - r  # the operation order of diagnostics.approx_kl_k3: bit-identical values


def kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind | str = "k3", *, mask: Tensor | None = None
) -> Tensor:
    """logprobs [B, T] (maybe with grad), ref_logprobs [B, T] -> per-token KL estimate [B, T] of `kind`.

    With `mask` [B, T] bool, positions outside it are exactly 0 (and garbage there, e.g. -inf, never
    reaches exp or the gradient). Unknown kinds raise KeyError listing the known ones.
    """
    fn = get_kl_estimator(kind)
    if mask is None:
        return fn(logprobs, ref_logprobs)
    mask = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # where() before the estimator: both inputs equal (KL 0) off the mask, so no NaN enters exp().
    lp = torch.where(mask, logprobs, zero)
    ref = torch.where(mask, ref_logprobs.to(logprobs.dtype), zero)
    return torch.where(mask, fn(lp, ref), zero)
