"""Advantage estimators: per-sample rewards → per-sample advantages, registered by name.

Place in the dataflow: the Scorer fills `Trajectory.reward`; the Trainer's `Learner` gathers a step's
rewards and group ids into tensors and calls the estimator `[algorithm] advantage` names; the advantage of
a sample is then broadcast over its loss tokens by the policy loss (losses.py).

Every estimator is a pure, vectorised tensor function (no Python loop over groups); the unit tests check
each against a slow, obviously correct reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algorithms.registry import register_advantage


def _group_stats(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """values [N] float64, group_ids [N] -> (inverse [N], counts [G], mean [G], unbiased std [G]).

    `inverse` maps each sample to its group's row; groups of one sample get std 0.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    sums = values.new_zeros(n_groups).index_add_(0, inverse, values)
    mean = sums / counts
    sq_dev = values.new_zeros(n_groups).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    # Bessel's correction as torch.std (and verl) use; clamp keeps size-1 groups at 0 / 1 = 0, not NaN.
    std = (sq_dev / (counts - 1).clamp(min=1)).sqrt()
    return inverse, counts, mean, std


@register_advantage("grpo")
def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6, norm_by_std: bool = True) -> Tensor:
    """rewards [N] float, group_ids [N] int64 -> advantages [N] (dtype of rewards, float32 if integral).

    GRPO: (r - mean of the sample's group) / (unbiased std of the group + eps); with `norm_by_std=False`
    only the mean is subtracted (Dr. GRPO). A group of one sample, and a group whose rewards are all
    equal, gets advantage exactly 0 — such groups carry no learning signal, and rounding in the mean
    must not turn into a spurious ±1 after division by a tiny std.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        return rewards.to(out_dtype)
    # float64 inside: group means of float32 rewards are exact enough that equal rewards give 0 deviation.
    r = rewards.to(torch.float64)
    inverse, counts, mean, std = _group_stats(r, group_ids)
    adv = r - mean[inverse]
    if norm_by_std:
        adv = adv / (std[inverse] + eps)
    g_max = torch.full_like(mean, -torch.inf).scatter_reduce(0, inverse, r, reduce="amax")
    g_min = torch.full_like(mean, torch.inf).scatter_reduce(0, inverse, r, reduce="amin")
    informative = (counts > 1) & (g_max > g_min)
    adv = torch.where(informative[inverse], adv, torch.zeros_like(adv))
    return adv.to(out_dtype)
