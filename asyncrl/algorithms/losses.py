"""Policy losses (per token) and loss aggregations (tokens → one scalar), registered by name.

Place in the dataflow: inside the Trainer's `Learner`, after the forward pass gives the current policy's
logprobs of each micro-batch: `[algorithm] policy_loss` turns logprobs, behaviour logprobs and advantages
into a per-token loss; `[algorithm] loss_agg` reduces it to the scalar whose gradient is accumulated.

Off-policy correction uses the behaviour logprobs the engine recorded while sampling (`old_logprobs`),
never logprobs recomputed under the current policy. Masked positions (padding, prompt, tokens the
environment wrote) may hold garbage (0, -inf, NaN) there: they contribute exactly 0 to the loss and to
its gradient.

Aggregations divide by counts of the whole optimizer step (`global_tokens`, `global_seqs`), not of the
micro-batch, so that accumulating micro-batch gradients gives exactly the full-batch gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algorithms.registry import register_loss_agg, register_policy_loss

# exp() of a log-ratio beyond this overflows float32 on the way to a NaN gradient (0 * inf); a ratio
# of e^20 is clipped anyway, so clamping changes no gradient that PPO would use.
_MAX_LOG_RATIO = 20.0


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_eps: float = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token.

    logprobs [B, T] (current policy, with grad), old_logprobs [B, T] (behaviour, from the engine),
    advantages [B, T] (a sample's advantage repeated over its tokens), mask [B, T] bool (loss tokens)
    -> (loss [B, T] = -min(ratio*A, clip(ratio, 1-eps, 1+eps)*A), exactly 0 where ~mask,
        stats: clip_frac (share of mask tokens where the clipped branch is active), ratio_mean,
        ratio_max (over mask tokens; 0 when there are none); detached scalars).
    """
    mask = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # where() before exp(): garbage behaviour logprobs at masked positions never reach the loss, and
    # the gradient of the unselected branch is exactly 0 (no 0 * inf).
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    # Strictly greater: the clipped branch is active (and has zero gradient) only where the ratio left
    # the trust region in the direction the advantage pushes it.
    clip_active = (clipped > unclipped) & mask
    loss = torch.where(clip_active, clipped, unclipped)
    loss = torch.where(mask, loss, zero)

    with torch.no_grad():
        n = mask.sum()
        denom = n.clamp(min=1).to(logprobs.dtype)
        stats = {
            "clip_frac": clip_active.sum().to(logprobs.dtype) / denom,
            "ratio_mean": torch.where(mask, ratio, zero).sum() / denom,
            "ratio_max": torch.where(mask, ratio, zero).amax() if n > 0 else zero.clone(),
        }
    return loss, stats


@register_loss_agg("token-mean")
def token_mean(loss_tok: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int | None = None) -> Tensor:
    """loss_tok [B, T], mask [B, T] bool -> scalar sum(loss over mask tokens) / global_tokens.

    `global_tokens` is the number of loss tokens in the whole optimizer step (all micro-batches), so the
    sum over micro-batches is the token mean of the full batch: every token weighs the same, whatever
    micro-batch it landed in. `global_seqs` is unused here (sequence-level aggregations read it).
    A step without loss tokens gives 0.
    """
    masked = torch.where(mask.bool(), loss_tok, torch.zeros((), dtype=loss_tok.dtype, device=loss_tok.device))
    return masked.sum() / max(int(global_tokens), 1)
