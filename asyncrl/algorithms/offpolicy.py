"""Off-policy corrections for stale data: importance weights between the policy the loss is built
around and the behaviour policy that sampled the tokens; composes with any policy loss.

Place in the dataflow: generators sample with a policy μ that may be a few versions behind; the engine
records its logprobs (`Trajectory.behavior_logprobs`). At the start of a train step the Trainer's
`Learner` recomputes the logprobs of a proximal policy π_prox (the weights the step starts from) and calls
`offpolicy_weights(target=π_prox, behaviour=μ)`. Decoupled PPO (Hilton et al.) then uses
    loss_t = w_t · policy_loss(π / π_prox)_t      with w_t = correction of π_prox / μ,
so the trust region is around π_prox while the weight corrects for sampling from μ; tokens whose weight
is 0 (dropped) leave the loss. Pass `new_mask` as the policy loss's mask and multiply its per-token loss
by `weights`. The aggregation's global counts may come from either mask: from `new_mask` the kept tokens
are renormalised to the step's usual loss scale; from the original mask a dropped token counts as a 0.

Modes (registered in `CORRECTIONS`; `CorrectionParams.mode` names one):

| mode       | ratio judged                                        | weight on kept tokens | dropped            |
|------------|-----------------------------------------------------|-----------------------|--------------------|
| none       | token ratio ρ_t = π_prox/μ (logged only)            | 1                     | nothing            |
| token_tis  | ρ_t                                                 | min(ρ_t, cap)         | nothing            |
| seq_tis    | sequence ratio: product over its loss tokens, ∏ ρ_t | min(∏ ρ_t, cap)       | nothing            |
| token_mask | ρ_t                                                 | 1                     | ρ_t ∉ [low, high]  |
| seq_mask   | geometric mean, exp(mean_t log ρ_t) (verl's "geo")  | 1                     | whole sequence ∉ band |

seq_tis uses the product because that is the sequence's true likelihood ratio; seq_mask uses the
geometric mean because a product over hundreds of tokens leaves any fixed band for long sequences even
when each token is near on-policy, so the band would reject by length. Log-ratios (token, and the
sequence sum) are clamped to ±20 before exp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from asyncrl.algorithms.registry import CORRECTIONS, get_correction, register_correction

_MAX_LOG_RATIO = 20.0

CorrectionMode = Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask"]


@dataclass(frozen=True)
class CorrectionParams:
    mode: CorrectionMode = "none"
    cap: float = 2.0    # truncation cap C for *_tis: weight = min(ratio, C)
    low: float = 0.5    # band for *_mask: tokens / sequences with ratio outside [low, high] are dropped
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in CORRECTIONS:
            known = ", ".join(CORRECTIONS.names())
            raise ValueError(f"off-policy correction mode {self.mode!r} is unknown; known: {known}")
        if not self.cap > 0:
            raise ValueError(f"off-policy cap={self.cap} must be > 0")
        if not 0 <= self.low <= 1.0 <= self.high:
            raise ValueError(
                f"off-policy band [low={self.low}, high={self.high}] must contain 1 (0 <= low <= 1 <= high)"
            )


def _seq_log_ratio(log_ratio: Tensor, mask: Tensor, *, mean: bool) -> Tensor:
    """[B, T] -> [B, T]: the row's sum (or mean) of log ratios over its mask tokens, on every position."""
    s = log_ratio.sum(dim=1, keepdim=True)
    if mean:
        s = s / mask.sum(dim=1, keepdim=True).clamp(min=1).to(s.dtype)
    return s.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).expand_as(log_ratio)


def _no_flags(mask: Tensor) -> Tensor:
    return torch.zeros_like(mask)


@register_correction("none")
def correction_none(log_ratio: Tensor, mask: Tensor, params: CorrectionParams) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """No correction: weight 1; the token ratio is still returned for logging."""
    ratio = log_ratio.exp()
    return ratio, torch.ones_like(ratio), mask, _no_flags(mask)


@register_correction("token_tis")
def correction_token_tis(
    log_ratio: Tensor, mask: Tensor, params: CorrectionParams
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Token-level truncated IS: w_t = min(ρ_t, cap)."""
    ratio = log_ratio.exp()
    return ratio, ratio.clamp(max=params.cap), mask, (ratio > params.cap) & mask


@register_correction("seq_tis")
def correction_seq_tis(
    log_ratio: Tensor, mask: Tensor, params: CorrectionParams
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sequence-level truncated IS: w = min(∏_t ρ_t, cap) on all of the sequence's tokens."""
    ratio = _seq_log_ratio(log_ratio, mask, mean=False).exp()
    return ratio, ratio.clamp(max=params.cap), mask, (ratio > params.cap) & mask


@register_correction("token_mask")
def correction_token_mask(
    log_ratio: Tensor, mask: Tensor, params: CorrectionParams
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Token-level rejection: drop tokens with ρ_t outside [low, high]; weight 1 on the others."""
    ratio = log_ratio.exp()
    keep = mask & (ratio >= params.low) & (ratio <= params.high)
    return ratio, torch.ones_like(ratio), keep, _no_flags(mask)


@register_correction("seq_mask")
def correction_seq_mask(
    log_ratio: Tensor, mask: Tensor, params: CorrectionParams
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sequence-level rejection: drop whole sequences whose geometric-mean ratio leaves [low, high]."""
    ratio = _seq_log_ratio(log_ratio, mask, mean=True).exp()
    keep = mask & (ratio >= params.low) & (ratio <= params.high)
    return ratio, torch.ones_like(ratio), keep, _no_flags(mask)


def offpolicy_weights(
    target_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, params: CorrectionParams
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """target_logprobs [B, T] (π_prox), behavior_logprobs [B, T] (μ, from the engine), mask [B, T] bool
    -> (weights [B, T] (detached; float dtype of target, float32 if not float; exact 0 where dropped or ~mask),
        new_mask [B, T] bool (mask without the dropped tokens),
        stats over the original mask tokens: is_ratio_mean / is_ratio_max / is_ratio_min of the ratio the
        mode judges (token ratio, or the sequence ratio on each of its tokens), share_clipped (tokens whose
        weight was truncated, *_tis), share_masked (tokens dropped, *_mask); detached scalars, 0 when
        there are no mask tokens).
    """
    if target_logprobs.shape != behavior_logprobs.shape or target_logprobs.shape != mask.shape:
        raise ValueError(
            f"target {tuple(target_logprobs.shape)}, behaviour {tuple(behavior_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have one shape [B, T]"
        )
    fn = get_correction(params.mode)
    mask = mask.bool()
    dtype = target_logprobs.dtype if target_logprobs.is_floating_point() else torch.float32
    zero = torch.zeros((), dtype=dtype, device=target_logprobs.device)
    with torch.no_grad():
        # where() before exp(): garbage (-inf, NaN) behaviour logprobs off the mask never reach a ratio.
        diff = target_logprobs.detach().to(dtype) - behavior_logprobs.to(dtype)
        log_ratio = torch.where(mask, diff, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio, weight, keep, clipped = fn(log_ratio, mask, params)
        new_mask = keep & mask
        weights = torch.where(new_mask, weight, zero)

        n = mask.sum()
        denom = n.clamp(min=1).to(dtype)
        has = n > 0
        stats = {
            "is_ratio_mean": torch.where(mask, ratio, zero).sum() / denom,
            "is_ratio_max": (
                torch.where(mask, ratio, torch.full_like(ratio, -torch.inf)).amax() if has else zero.clone()
            ),
            "is_ratio_min": (
                torch.where(mask, ratio, torch.full_like(ratio, torch.inf)).amin() if has else zero.clone()
            ),
            "share_clipped": (clipped & mask).sum().to(dtype) / denom,
            "share_masked": (mask & ~new_mask).sum().to(dtype) / denom,
        }
    return weights, new_mask, stats
