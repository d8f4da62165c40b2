"""Policy losses (per token) and loss aggregations (tokens → one scalar), registered by name.

Place in the dataflow: inside the Trainer's `Learner`, after the forward pass gives the current policy's
logprobs of each micro-batch: `[algorithm] policy_loss` turns logprobs, old logprobs and advantages into a
per-token loss (optionally multiplied by off-policy weights from offpolicy.py); `[algorithm] loss_agg`
reduces it to the scalar whose gradient is accumulated.

`old_logprobs` is the policy the trust region is around: the behaviour logprobs the engine recorded while
sampling, or, in decoupled PPO, the proximal policy's logprobs recomputed at the step's start (the caller
decides). Masked positions (padding, prompt, tokens the environment wrote) may hold garbage (0, -inf, NaN)
there: they contribute exactly 0 to the loss and to its gradient.

Policy losses (`fn(logprobs, old_logprobs, advantages, mask, PolicyLossParams) -> (loss [B, T], stats)`):
- ppo_clip:   −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), r = π/π_old per token; ε_high > ε_low is DAPO's
              clip-higher; `dual_clip` c bounds the loss of negative advantages at −c·A (dual-clip PPO).
- gspo:       the same clipped surrogate on the sequence ratio s_i = exp(mean over i's tokens of log π/π_old)
              (GSPO), with the GSPO-token gradient trick s_i,t = sg[s_i]·exp(logπ_t − sg[logπ_t]).
- vanilla_pg: −A·log π (REINFORCE; no ratio, no clip), for REINFORCE / ReMax / RLOO users who want it.

Aggregations (all `fn(loss_tok, mask, *, global_tokens, global_seqs, norm_len=None) -> scalar`):
- token-mean:              sum over all loss tokens / global_tokens (every token weighs the same; DAPO).
- seq-mean-token-sum:      sum over a sequence's tokens, mean over sequences: sum / global_seqs.
- seq-mean-token-mean:     token mean within each sequence, mean over sequences (original GRPO, GSPO).
- seq-mean-token-sum-norm: sum over all tokens / (global_seqs · norm_len), norm_len a constant such as
                           max_new_tokens (Dr. GRPO: no length bias).
They divide by counts of the whole optimizer step (`global_tokens`, `global_seqs`), not of the
micro-batch, so that accumulating micro-batch gradients gives exactly the full-batch gradient.
`global_seqs` counts the sequences of the step (the Learner counts all of them; a sequence without loss
tokens adds 0 to the numerator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.algorithms.registry import register_loss_agg, register_policy_loss

# exp() of a log-ratio beyond this overflows float32 on the way to a NaN gradient (0 * inf); a ratio
# of e^20 is clipped anyway, so clamping changes no gradient that PPO would use.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class PolicyLossParams:
    clip_eps_low: float = 0.2          # ratio floor 1 − ε_low
    clip_eps_high: float = 0.2         # ratio ceiling 1 + ε_high; DAPO clip-higher: high > low (e.g. 0.28)
    dual_clip: float | None = None     # dual-clip constant c > 1: loss of A < 0 tokens capped at −c·A

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise ValueError(f"clip_eps_low={self.clip_eps_low} must lie in [0, 1)")
        if not self.clip_eps_high >= 0.0:
            raise ValueError(f"clip_eps_high={self.clip_eps_high} must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip={self.dual_clip} must be > 1 (or None for off)")


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _ratio_stats(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Detached mean / max of the ratio over mask tokens (0 when there are none)."""
    with torch.no_grad():
        n = mask.sum()
        kept = torch.where(mask, ratio, _zero(ratio))
        return {
            "ratio_mean": kept.sum() / n.clamp(min=1).to(ratio.dtype),
            "ratio_max": kept.amax() if n > 0 else _zero(ratio).clone(),
        }


def _share(flags: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    return ((flags & mask).sum().to(dtype) / mask.sum().clamp(min=1).to(dtype)).detach()


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, mask: Tensor, params: PolicyLossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """ratio, adv [B, T] (0 / 1 where ~mask) -> (−min(r·A, clip(r)·A) [dual-clipped], exact 0 where ~mask;
    clip stats)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - params.clip_eps_low, 1.0 + params.clip_eps_high)
    # Strictly greater: the clipped branch is active (and has zero gradient) only where the ratio left
    # the trust region in the direction the advantage pushes it.
    clip_active = (clipped > unclipped) & mask
    loss = torch.where(clip_active, clipped, unclipped)
    stats = {
        "clip_frac": _share(clip_active, mask, ratio.dtype),
        "clip_frac_low": _share(clip_active & (adv < 0), mask, ratio.dtype),
        "clip_frac_high": _share(clip_active & (adv > 0), mask, ratio.dtype),
    }
    if params.dual_clip is not None:
        # Dual clip: with A < 0 a huge ratio would make the loss unbounded; cap it at −c·A.
        cap = -adv * params.dual_clip
        dual_active = (adv < 0) & (loss > cap) & mask
        loss = torch.where(dual_active, cap, loss)
        stats["dual_clip_frac"] = _share(dual_active, mask, ratio.dtype)
    return torch.where(mask, loss, _zero(loss)), stats


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams | None = None,
    *,
    clip_eps: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token, asymmetric clip (DAPO clip-higher) and optional dual clip.

    logprobs [B, T] (current policy, with grad), old_logprobs [B, T], advantages [B, T], mask [B, T] bool,
    params (or, for older callers, `clip_eps=` alone: ε_low = ε_high = clip_eps; neither: 0.2)
    -> (loss [B, T] = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) (then max'd down to −c·A for A < 0 with
        dual clip), exactly 0 where ~mask;
        stats: clip_frac (share of mask tokens where the clipped branch is active), clip_frac_low /
        clip_frac_high (of those, with A < 0 / A > 0), dual_clip_frac (with dual clip), ratio_mean,
        ratio_max (over mask tokens; 0 when there are none); detached scalars).
    """
    if params is None:
        eps = 0.2 if clip_eps is None else clip_eps
        params = PolicyLossParams(eps, eps)
    elif clip_eps is not None:
        raise ValueError("ppo_clip_loss takes params or clip_eps, not both")
    mask = mask.bool()
    zero = _zero(logprobs)
    # where() before exp(): garbage old logprobs at masked positions never reach the loss, and the
    # gradient of the unselected branch is exactly 0 (no 0 * inf).
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    ratio = log_ratio.exp()
    loss, stats = _clipped_surrogate(ratio, adv, mask, params)
    return loss, {**stats, **_ratio_stats(ratio, mask)}


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, params: PolicyLossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clipped surrogate on the sequence-level ratio, per token (GSPO-token).

    s_i = exp(mean over i's mask tokens of (logπ − logπ_old)) (length-normalised, so one ratio per
    sequence); token ratio s_i,t = sg[s_i] · exp(logπ_t − sg[logπ_t]) has value s_i and gradient s_i·∇logπ_t,
    so with a sequence's advantage on all its tokens and seq-mean-token-mean aggregation the gradient is
    GSPO's s_i·A_i·mean_t ∇logπ_t. Clipping with ε_low / ε_high (GSPO uses small ones, e.g. 3e-4 / 4e-4)
    then keeps or drops whole sequences.
    -> (loss [B, T], exact 0 where ~mask; stats of ppo_clip with the ratio of s_i,t, plus seq_clip_frac:
        share of sequences with loss tokens whose clipped branch is active on any token).
    """
    mask = mask.bool()
    zero = _zero(logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero)
    n_tok = mask.sum(dim=1, keepdim=True)
    seq_log_ratio = (log_ratio.sum(dim=1, keepdim=True) / n_tok.clamp(min=1).to(log_ratio.dtype)).detach()
    masked_lp = torch.where(mask, logprobs, zero)
    tok_log_ratio = (masked_lp - masked_lp.detach() + seq_log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    tok_log_ratio = torch.where(mask, tok_log_ratio, zero)
    ratio = tok_log_ratio.exp()
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    loss, stats = _clipped_surrogate(ratio, adv, mask, params)
    with torch.no_grad():
        # clip_active is not returned; recompute it per sequence from the loss branches.
        clipped = -adv * ratio.clamp(1.0 - params.clip_eps_low, 1.0 + params.clip_eps_high)
        seq_clipped = ((clipped > -adv * ratio) & mask).any(dim=1)
        has_tokens = n_tok.squeeze(1) > 0
        stats["seq_clip_frac"] = (seq_clipped.sum().to(ratio.dtype) / has_tokens.sum().clamp(min=1).to(ratio.dtype))
    return loss, {**stats, **_ratio_stats(ratio, mask)}


@register_policy_loss("vanilla_pg")
def vanilla_pg_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, params: PolicyLossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE: loss [B, T] = −A·logπ on mask tokens, exact 0 elsewhere (no ratio, no clip: on-policy
    data, or off-policy weights from offpolicy.py). `params` is unused. Stats: ratio_mean / ratio_max of
    π/π_old, for the same logs as the clipped losses."""
    mask = mask.bool()
    zero = _zero(logprobs)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    loss = torch.where(mask, -adv * torch.where(mask, logprobs, zero), zero)
    with torch.no_grad():
        ratio = torch.where(mask, logprobs - old_logprobs, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    return loss, _ratio_stats(ratio, mask)


# ---------------------------------------------------------------------------------- aggregations


def _masked(loss_tok: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), loss_tok, _zero(loss_tok))


@register_loss_agg("token-mean")
def token_mean(
    loss_tok: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int | None = None, norm_len: int | None = None
) -> Tensor:
    """loss_tok [B, T], mask [B, T] bool -> scalar sum(loss over mask tokens) / global_tokens.

    `global_tokens` is the number of loss tokens in the whole optimizer step (all micro-batches), so the
    sum over micro-batches is the token mean of the full batch: every token weighs the same, whatever
    micro-batch it landed in. `global_seqs`, `norm_len` are unused here. A step without loss tokens gives 0.
    """
    return _masked(loss_tok, mask).sum() / max(int(global_tokens), 1)


def _require_seqs(global_seqs: int | None, name: str) -> int:
    if global_seqs is None:
        raise ValueError(f"loss aggregation {name!r} needs global_seqs (the number of sequences in the optimizer step)")
    return max(int(global_seqs), 1)


@register_loss_agg("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_tok: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int | None = None, norm_len: int | None = None
) -> Tensor:
    """loss_tok [B, T], mask [B, T] -> scalar sum over sequences of (sum over its mask tokens) / global_seqs."""
    return _masked(loss_tok, mask).sum() / _require_seqs(global_seqs, "seq-mean-token-sum")


@register_loss_agg("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_tok: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int | None = None, norm_len: int | None = None
) -> Tensor:
    """loss_tok [B, T], mask [B, T] -> scalar sum over sequences of (mean over its mask tokens) / global_seqs;
    a sequence without mask tokens adds 0."""
    seq_tokens = mask.bool().sum(dim=1).clamp(min=1).to(loss_tok.dtype)
    return (_masked(loss_tok, mask).sum(dim=1) / seq_tokens).sum() / _require_seqs(global_seqs, "seq-mean-token-mean")


@register_loss_agg("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_tok: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int | None = None, norm_len: int | None = None
) -> Tensor:
    """loss_tok [B, T], mask [B, T] -> scalar sum over mask tokens / (global_seqs · norm_len) (Dr. GRPO):
    a constant normaliser, so long and short responses weigh each token alike."""
    if norm_len is None or norm_len < 1:
        raise ValueError(
            f"loss aggregation 'seq-mean-token-sum-norm' needs norm_len >= 1 (e.g. max_new_tokens), got {norm_len}"
        )
    return _masked(loss_tok, mask).sum() / (_require_seqs(global_seqs, "seq-mean-token-sum-norm") * int(norm_len))
