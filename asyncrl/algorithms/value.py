"""PPO's critic loss: the clipped value loss and its diagnostics.

Place in the dataflow: with the `gae` estimator the Trainer's `Learner` runs a value model over a step's
tokens; `gae` (advantages.py) turns its detached values into advantages and value targets (`returns`);
each value-model micro-batch then calls `value_loss` with fresh values (with grad), the values of the
step's start (`old_values`) and the targets, and aggregates the per-token loss like the policy loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float | None = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss per token.

    values [B, T] (with grad), old_values [B, T] (values when the step's data was scored), returns
    [B, T] (targets), mask [B, T] bool
    -> (loss [B, T] = ½·max((v − R)², (clip(v, v_old − ε, v_old + ε) − R)²), or ½(v − R)² with
        clip_eps None; exactly 0 where ~mask;
        stats: vf_clip_frac (share of mask tokens where the clipped term is strictly larger, so the
        gradient is 0), value_mean, explained_variance = 1 − Var(R − v)/Var(R) over mask tokens (0 when
        Var(R) = 0 or no tokens); detached scalars).
    Clipping stops one batch from moving the value further than ε from where it was (as in PPO2).
    """
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"value clip_eps={clip_eps} must be > 0 (or None for no clipping)")
    mask = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    ret = torch.where(mask, returns.to(values.dtype), zero)
    unclipped = (v - ret) ** 2
    if clip_eps is None:
        clip_active = torch.zeros_like(mask)
        loss = 0.5 * unclipped
    else:
        v_old = torch.where(mask, old_values.to(values.dtype), zero)
        v_clipped = v_old + (v - v_old).clamp(-clip_eps, clip_eps)
        clipped = (v_clipped - ret) ** 2
        clip_active = (clipped > unclipped) & mask
        loss = 0.5 * torch.where(clip_active, clipped, unclipped)
    loss = torch.where(mask, loss, zero)

    with torch.no_grad():
        n = mask.sum()
        denom = n.clamp(min=1).to(values.dtype)
        v_mean = v.sum() / denom
        r_mean = ret.sum() / denom
        var_r = torch.where(mask, (ret - r_mean) ** 2, zero).sum() / denom
        resid = ret - v
        resid_mean = resid.sum() / denom
        var_resid = torch.where(mask, (resid - resid_mean) ** 2, zero).sum() / denom
        ev = torch.where(var_r > 0, 1.0 - var_resid / var_r.clamp(min=torch.finfo(values.dtype).tiny), zero)
        stats = {
            "vf_clip_frac": clip_active.sum().to(values.dtype) / denom,
            "value_mean": v_mean,
            "explained_variance": ev,
        }
    return loss, stats
