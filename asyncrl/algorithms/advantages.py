"""Advantage estimators: rewards (and critic values) → per-token advantages, registered by name.

Place in the dataflow: the Scorer fills `Trajectory.reward` (and, for Safe-RLHF, a cost); the Trainer's
`Learner` gathers a step's sequence rewards, group ids and loss masks into an `AdvantageInput` and calls
the estimator `[algorithm] advantage` names; the policy loss (losses.py) reads the [B, T] advantages.

Estimators (each `fn(AdvantageInput, AdvantageParams) -> AdvantageOutput`, registered with what it
needs: `AlgorithmNeeds` in registry.py — grpo, drgrpo, rloo and reinforce_pp_baseline groups of >= 2
samples, remax a greedy baseline, gae a critic):

| name                   | advantage of sample i                                                    | paper       |
|------------------------|--------------------------------------------------------------------------|-------------|
| grpo                   | (r_i − mean_g) / (std_g + eps), broadcast over its loss tokens             | DeepSeekMath|
| drgrpo                 | r_i − mean_g (no std normalisation)                                       | Dr. GRPO    |
| rloo                   | r_i − mean_{j≠i in g} r_j                                                 | RLOO        |
| reinforce_pp           | return-to-go of token rewards (+ r_i on the last loss token), whitened    | REINFORCE++ |
|                        | over all loss tokens of the batch                                         |             |
| reinforce_pp_baseline  | as reinforce_pp with r_i − mean_g in place of r_i                          | REINFORCE++ |
| remax                  | r_i − b_i, b_i = reward of the greedy rollout of the same prompt           | ReMax       |
| gae                    | GAE(γ, λ) from critic values; returns = advantages + values                | PPO         |

"r_i" is the sequence reward plus, for the outcome estimators (grpo, drgrpo, rloo, remax), the sum of
`token_rewards` over its loss tokens (e.g. a −β·KL reward penalty); reinforce_pp*/gae place the token
rewards at their positions. A group of one sample and a group whose rewards are all equal give advantage
exactly 0 under grpo, drgrpo, rloo and reinforce_pp_baseline (before batch whitening) — such groups carry
no learning signal. Group statistics are computed in float64; outputs are float32, exactly 0 where ~mask.
The token dimension may hold any layout (prompt positions, holes for environment-written tokens): only
mask positions are steps of the return; masked-out positions are skipped, not zero-reward steps.

Also here: `masked_whiten`, DAPO's `overlong_penalty` (reward shaping, applied by the caller before the
estimator), and Safe-RLHF's `lagrangian_advantages` with its `LagrangeMultiplier`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.algorithms.registry import AlgorithmNeeds, register_advantage


@dataclass
class AdvantageInput:
    """What every estimator receives; B samples of one train step, T token positions."""

    rewards: Tensor                      # [B] sequence reward (already shaped by the caller)
    group_ids: Tensor                    # [B] int64, samples of one prompt share it
    mask: Tensor                         # [B, T] bool, loss tokens (the sequence reward sits on the last one)
    values: Tensor | None = None         # [B, T] critic values at the same positions (gae)
    token_rewards: Tensor | None = None  # [B, T] extra per-token rewards, e.g. -beta*KL (0 where ~mask)
    baselines: Tensor | None = None      # [B] ReMax: reward of the greedy rollout of the same prompt


@dataclass
class AdvantageOutput:
    advantages: Tensor            # [B, T] float32, exactly 0 where ~mask
    returns: Tensor | None = None  # [B, T] float32 value targets (gae), else None


@dataclass(frozen=True)
class AdvantageParams:
    gamma: float = 1.0    # discount per loss token (reinforce_pp*, gae)
    lam: float = 1.0      # GAE λ (gae)
    eps: float = 1e-6     # added to std in grpo and to the variance in whitening
    whiten: bool = False  # whiten advantages over all mask tokens of the batch (gae; reinforce_pp* always do)

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma={self.gamma} must lie in [0, 1]")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam={self.lam} must lie in [0, 1]")
        if not self.eps > 0.0:
            raise ValueError(f"eps={self.eps} must be > 0")


# ---------------------------------------------------------------------------------------- helpers


def _group_stats(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """values [N] float64, group_ids [N] -> (inverse [N], counts [G], sum [G], mean [G], unbiased std [G],
    informative [G] bool: more than one sample and not all equal).

    `inverse` maps each sample to its group's row; groups of one sample get std 0.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    sums = values.new_zeros(n_groups).index_add_(0, inverse, values)
    mean = sums / counts
    sq_dev = values.new_zeros(n_groups).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    # Bessel's correction as torch.std (and verl) use; clamp keeps size-1 groups at 0 / 1 = 0, not NaN.
    std = (sq_dev / (counts - 1).clamp(min=1)).sqrt()
    g_max = torch.full_like(mean, -torch.inf).scatter_reduce(0, inverse, values, reduce="amax")
    g_min = torch.full_like(mean, torch.inf).scatter_reduce(0, inverse, values, reduce="amin")
    informative = (counts > 1) & (g_max > g_min)
    return inverse, counts, sums, mean, std, informative


def _check(inp: AdvantageInput) -> None:
    b = inp.rewards.shape[0] if inp.rewards.dim() == 1 else -1
    if inp.rewards.dim() != 1 or inp.group_ids.shape != (b,):
        got = f"{tuple(inp.rewards.shape)} and {tuple(inp.group_ids.shape)}"
        raise ValueError(f"rewards and group_ids must both be [B], got {got}")
    if inp.mask.dim() != 2 or inp.mask.shape[0] != b:
        raise ValueError(f"mask must be [B, T] with B={b}, got {tuple(inp.mask.shape)}")
    for name in ("values", "token_rewards"):
        x = getattr(inp, name)
        if x is not None and x.shape != inp.mask.shape:
            raise ValueError(f"{name} must be [B, T] like mask {tuple(inp.mask.shape)}, got {tuple(x.shape)}")
    if inp.baselines is not None and inp.baselines.shape != (b,):
        raise ValueError(f"baselines must be [B] with B={b}, got {tuple(inp.baselines.shape)}")


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _masked64(x: Tensor, mask: Tensor) -> Tensor:
    """x [B, T] -> float64 copy with exact 0 where ~mask (garbage there never propagates)."""
    x = x.to(torch.float64)
    return torch.where(mask, x, _zero(x))


def _sequence_rewards(inp: AdvantageInput) -> Tensor:
    """[B] float64: the sequence reward plus the token rewards summed over the loss tokens."""
    r = inp.rewards.to(torch.float64)
    if inp.token_rewards is not None:
        r = r + _masked64(inp.token_rewards, inp.mask.bool()).sum(dim=1)
    return r


def _broadcast(adv: Tensor, mask: Tensor) -> Tensor:
    """adv [B] -> [B, T] float32 with adv on mask tokens, exact 0 elsewhere."""
    a = adv.to(torch.float32)[:, None].expand(mask.shape)
    return torch.where(mask, a, _zero(a))


def _last_mask_token(mask: Tensor) -> Tensor:
    """mask [B, T] bool -> [B, T] bool, True only at each row's last mask position (none for empty rows)."""
    t = mask.shape[1]
    if t == 0:
        return mask
    last = (t - 1) - mask.flip(1).to(torch.int8).argmax(dim=1)
    onehot = torch.zeros_like(mask)
    onehot[torch.arange(mask.shape[0], device=mask.device), last] = True
    return onehot & mask.any(dim=1, keepdim=True)


def _token_level_rewards(seq_rewards: Tensor, inp: AdvantageInput) -> Tensor:
    """seq_rewards [B] float64 -> [B, T] float64: token rewards + the sequence reward on the last mask token."""
    mask = inp.mask.bool()
    if inp.token_rewards is not None:
        rew = _masked64(inp.token_rewards, mask)
    else:
        rew = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    return rew + torch.where(_last_mask_token(mask), seq_rewards[:, None], _zero(rew))


def _compact(mask: Tensor) -> tuple[Tensor, Tensor]:
    """mask [B, T] -> (order [B, T]: each row's mask positions first, in time order, then the rest;
    valid [B, T] bool: which compacted slots hold a mask position). Gathering with `order` turns the
    mask steps of a row into consecutive slots, so recurrences over mask steps need no per-step where()."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    valid = torch.arange(mask.shape[1], device=mask.device)[None, :] < mask.sum(dim=1, keepdim=True)
    return order, valid


def _discounted_suffix_sum(x: Tensor, valid: Tensor, c: float) -> Tensor:
    """x [B, T] compacted (0 on invalid slots, which trail the valid ones) -> y_k = x_k + c·y_{k+1}."""
    xt = torch.where(valid, x, _zero(x)).t().contiguous()  # time-major: each step reads one contiguous row
    out = torch.zeros_like(xt)
    running = xt.new_zeros(xt.shape[1])
    steps = int(valid.sum(dim=1).max()) if valid.numel() else 0
    for k in range(steps - 1, -1, -1):  # a loop over time, vectorised over the batch
        running = xt[k] + c * running
        out[k] = running
    return out.t()


def _uncompact(x: Tensor, order: Tensor, mask: Tensor) -> Tensor:
    """Inverse of gathering with `order`; exact 0 off the mask."""
    out = torch.zeros_like(x).scatter_(1, order, x)
    return torch.where(mask, out, _zero(out))


def _returns_to_go(rew: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """rew [B, T] float64, mask [B, T] -> G_t = sum_{k>=t, mask} gamma^(#mask steps from t to k) rew_k,
    counted over mask positions only (a masked-out position neither adds reward nor discounts); 0 off mask."""
    order, valid = _compact(mask)
    return _uncompact(_discounted_suffix_sum(rew.gather(1, order), valid, gamma), order, mask)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-6) -> Tensor:
    """x [...], mask [...] bool -> (x − mean) / sqrt(var + eps) with mean and unbiased var over mask positions;
    with `shift_mean=False` the mean is added back (unit variance, original mean), as verl / TRL do.
    Same dtype as x (float32 if integral); statistics in float64; exact 0 where ~mask. One mask element
    (or none) gives var 0 and so x − mean = 0."""
    mask = mask.bool()
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    v = _masked64(x, mask)
    n = mask.sum()
    mean = v.sum() / n.clamp(min=1)
    var = torch.where(mask, (v - mean) ** 2, _zero(v)).sum() / (n - 1).clamp(min=1)
    w = (v - mean) / (var + eps).sqrt()
    if not shift_mean:
        w = w + mean
    return torch.where(mask, w, _zero(w)).to(out_dtype)


# ------------------------------------------------------------------------------ outcome estimators


def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6, norm_by_std: bool = True) -> Tensor:
    """rewards [N] float, group_ids [N] int64 -> advantages [N] (dtype of rewards, float32 if integral).

    GRPO: (r - mean of the sample's group) / (unbiased std of the group + eps); with `norm_by_std=False`
    only the mean is subtracted (Dr. GRPO). A group of one sample, and a group whose rewards are all
    equal, gets advantage exactly 0 — such groups carry no learning signal, and rounding in the mean
    must not turn into a spurious ±1 after division by a tiny std. A plain helper; the registered
    "grpo" / "drgrpo" estimators call it.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        return rewards.to(out_dtype)
    # float64 inside: group means of float32 rewards are exact enough that equal rewards give 0 deviation.
    r = rewards.to(torch.float64)
    inverse, _, _, mean, std, informative = _group_stats(r, group_ids)
    adv = r - mean[inverse]
    if norm_by_std:
        adv = adv / (std[inverse] + eps)
    adv = torch.where(informative[inverse], adv, torch.zeros_like(adv))
    return adv.to(out_dtype)


@register_advantage("grpo", needs=AlgorithmNeeds(min_group_size=2))
def compute_grpo(inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput:
    """GRPO: group-normalised sequence reward, (r_i − mean_g) / (std_g + eps), on every loss token."""
    _check(inp)
    adv = grpo_advantages(_sequence_rewards(inp), inp.group_ids, eps=params.eps)
    return AdvantageOutput(_broadcast(adv, inp.mask.bool()))


@register_advantage("drgrpo", needs=AlgorithmNeeds(min_group_size=2))
def compute_drgrpo(inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput:
    """Dr. GRPO: r_i − mean_g on every loss token (no division by the group std, which biases toward
    groups of near-equal rewards). Pair with the seq-mean-token-sum-norm aggregation."""
    _check(inp)
    adv = grpo_advantages(_sequence_rewards(inp), inp.group_ids, eps=params.eps, norm_by_std=False)
    return AdvantageOutput(_broadcast(adv, inp.mask.bool()))


@register_advantage("rloo", needs=AlgorithmNeeds(min_group_size=2))
def compute_rloo(inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput:
    """RLOO: r_i − mean of the *other* samples of its group = n/(n−1) · (r_i − mean_g); a group of one
    sample (no other sample to compare with) and an all-equal group give 0."""
    _check(inp)
    r = _sequence_rewards(inp)
    if r.numel() == 0:
        return AdvantageOutput(_broadcast(r, inp.mask.bool()))
    inverse, counts, sums, _, _, informative = _group_stats(r, inp.group_ids)
    n = counts[inverse].to(torch.float64)
    loo_mean = (sums[inverse] - r) / (n - 1).clamp(min=1)
    adv = torch.where(informative[inverse], r - loo_mean, torch.zeros_like(r))
    return AdvantageOutput(_broadcast(adv, inp.mask.bool()))


@register_advantage("remax", needs=AlgorithmNeeds(greedy_baseline=True))
def compute_remax(inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput:
    """ReMax: r_i − b_i, with b_i the reward of a greedy (argmax) rollout of the same prompt."""
    _check(inp)
    if inp.baselines is None:
        raise ValueError("remax needs AdvantageInput.baselines: the reward of a greedy rollout of each prompt")
    adv = _sequence_rewards(inp) - inp.baselines.to(torch.float64)
    return AdvantageOutput(_broadcast(adv, inp.mask.bool()))


# ------------------------------------------------------------------------- token-level estimators


@register_advantage("reinforce_pp")
def compute_reinforce_pp(inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput:
    """REINFORCE++: return-to-go (γ per loss token) of the token rewards with the sequence reward on the
    last loss token, whitened over all loss tokens of the batch (the batch is the baseline)."""
    _check(inp)
    mask = inp.mask.bool()
    returns = _returns_to_go(_token_level_rewards(inp.rewards.to(torch.float64), inp), mask, params.gamma)
    return AdvantageOutput(masked_whiten(returns, mask, eps=params.eps).to(torch.float32))


@register_advantage("reinforce_pp_baseline", needs=AlgorithmNeeds(min_group_size=2))
def compute_reinforce_pp_baseline(inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput:
    """REINFORCE++ with a group baseline: the sequence reward minus its group's mean (a group of one and an
    all-equal group give 0), then reinforce_pp's return-to-go and batch whitening."""
    _check(inp)
    mask = inp.mask.bool()
    r = inp.rewards.to(torch.float64)
    if r.numel():
        inverse, _, _, mean, _, informative = _group_stats(r, inp.group_ids)
        r = torch.where(informative[inverse], r - mean[inverse], torch.zeros_like(r))
    returns = _returns_to_go(_token_level_rewards(r, inp), mask, params.gamma)
    return AdvantageOutput(masked_whiten(returns, mask, eps=params.eps).to(torch.float32))


@register_advantage("gae", needs=AlgorithmNeeds(critic=True))
def compute_gae(inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput:
    """PPO's GAE(γ, λ) from critic values.

    Rewards: token rewards + the sequence reward on the last loss token. Over a row's mask positions
    t_1 < ... < t_n only: δ_k = r_k + γ V_{k+1} − V_k (V_{n+1} = 0: the response ends), A_k = δ_k + γλ A_{k+1}.
    returns = A + V (value targets, before whitening); A whitened over the batch's loss tokens if
    `params.whiten`.
    """
    _check(inp)
    if inp.values is None:
        raise ValueError("gae needs AdvantageInput.values: critic values [B, T] at the loss positions")
    mask = inp.mask.bool()
    rew = _token_level_rewards(inp.rewards.to(torch.float64), inp)
    values = _masked64(inp.values, mask)
    # Compacted, a row's mask steps are consecutive slots: V_{k+1} is the next slot (0 after the last).
    order, valid = _compact(mask)
    v = torch.where(valid, values.gather(1, order), _zero(values))
    next_v = torch.nn.functional.pad(v[:, 1:], (0, 1))
    delta = rew.gather(1, order) + params.gamma * next_v - v
    adv = _uncompact(_discounted_suffix_sum(delta, valid, params.gamma * params.lam), order, mask)
    returns = torch.where(mask, adv + values, _zero(adv))
    if params.whiten:
        adv = masked_whiten(adv, mask, eps=params.eps)
    return AdvantageOutput(adv.to(torch.float32), returns.to(torch.float32))


# ---------------------------------------------------------------------------------- reward shaping


def overlong_penalty(response_lengths: Tensor, max_len: int, cache_len: int, penalty: float = 1.0) -> Tensor:
    """response_lengths [B] -> [B] float32 DAPO soft overlong punishment, added to the reward by the caller:
    0 for L <= max_len − cache_len, then linear (max_len − cache_len − L) / cache_len · penalty down to
    −penalty at L = max_len, and −penalty beyond."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong cache_len={cache_len} must lie in (0, max_len={max_len}]")
    if penalty < 0:
        raise ValueError(f"overlong penalty={penalty} must be >= 0 (it is subtracted)")
    over = (response_lengths.to(torch.float64) - (max_len - cache_len)).clamp(min=0.0, max=float(cache_len))
    return (-over / cache_len * penalty).to(torch.float32)


# ------------------------------------------------------------------------------------- Safe-RLHF


def lagrangian_advantages(adv_reward: Tensor, adv_cost: Tensor, lam: float) -> Tensor:
    """adv_reward [B, T], adv_cost [B, T], λ >= 0 -> [B, T] (A_r − λ·A_c) / (1 + λ) (Safe-RLHF).

    Dividing by 1 + λ keeps the advantage scale (and so the PPO trust region) stable as λ grows."""
    if lam < 0:
        raise ValueError(f"Lagrange multiplier {lam} must be >= 0")
    return (adv_reward - lam * adv_cost) / (1.0 + lam)


class LagrangeMultiplier:
    """Safe-RLHF's λ for the constraint E[cost] <= threshold, learned by projected gradient ascent on the
    Lagrangian: after each step λ ← clip(λ + lr · (mean_cost − threshold), 0, max_value). λ grows while the
    measured cost exceeds the threshold (weighting the cost advantage more) and shrinks toward 0 once it
    is met."""

    def __init__(self, init: float, lr: float, threshold: float, max_value: float | None = None) -> None:
        if init < 0:
            raise ValueError(f"Lagrange multiplier init={init} must be >= 0")
        if lr <= 0:
            raise ValueError(f"Lagrange multiplier lr={lr} must be > 0")
        if max_value is not None and max_value < init:
            raise ValueError(f"Lagrange multiplier max_value={max_value} must be >= init={init}")
        self.lr, self.threshold, self.max_value = float(lr), float(threshold), max_value
        self.value = float(init)

    def update(self, mean_cost: float) -> float:
        """One ascent step from the step's measured mean cost; returns the new λ."""
        v = max(0.0, self.value + self.lr * (float(mean_cost) - self.threshold))
        self.value = v if self.max_value is None else min(v, float(self.max_value))
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
