"""Off-policy corrections: each mode against a per-token / per-sequence loop reference, hand-worked
examples, ratio statistics, garbage off the mask, composition with a policy loss (decoupled PPO)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import (
    CorrectionParams,
    PolicyLossParams,
    available_corrections,
    get_policy_loss,
    offpolicy_weights,
    token_mean,
)

torch.set_num_threads(1)

MODES = ["none", "token_tis", "seq_tis", "token_mask", "seq_mask"]


def _random(seed: int, b: int = 6, t: int = 8):
    gen = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    # token noise plus a per-sequence drift, so that sequence-level ratios also leave the bands
    drift = torch.randn(b, 1, generator=gen, dtype=torch.float64) * 0.3
    target = behavior + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.4 + drift
    mask = torch.rand(b, t, generator=gen) > 0.3
    mask[0] = False  # a sequence without loss tokens
    mask[1, :2] = True
    behavior = torch.where(mask, behavior, torch.tensor(-math.inf, dtype=torch.float64))  # garbage off the mask
    return target, behavior, mask


def _reference(target, behavior, mask, p: CorrectionParams):
    """Returns (weights, new_mask, judged ratio per mask token, clipped flags per mask token)."""
    w = torch.zeros_like(target)
    keep = torch.zeros_like(mask)
    ratios, clipped = [], []
    for i in range(mask.shape[0]):
        pos = [j for j in range(mask.shape[1]) if mask[i, j]]
        logs = [float(target[i, j] - behavior[i, j]) for j in pos]
        if p.mode.startswith("seq") and pos:
            s = sum(logs) if p.mode == "seq_tis" else sum(logs) / len(logs)  # product vs geometric mean
            per_tok = [math.exp(s)] * len(pos)
        else:
            per_tok = [math.exp(x) for x in logs]
        for j, r in zip(pos, per_tok):
            ratios.append(r)
            if p.mode.endswith("tis"):
                w[i, j], keep[i, j] = min(r, p.cap), True
                clipped.append(r > p.cap)
            elif p.mode.endswith("mask"):
                keep[i, j] = p.low <= r <= p.high
                w[i, j] = 1.0 if keep[i, j] else 0.0
                clipped.append(False)
            else:
                w[i, j], keep[i, j] = 1.0, True
                clipped.append(False)
    return w, keep, ratios, clipped


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(3))
def test_offpolicy_weights_match_loop_reference(mode: str, seed: int) -> None:
    target, behavior, mask = _random(seed)
    p = CorrectionParams(mode=mode, cap=1.3, low=0.8, high=1.25)
    weights, new_mask, stats = offpolicy_weights(target, behavior, mask, p)
    w_ref, keep_ref, ratios, clipped = _reference(target, behavior, mask, p)
    assert torch.allclose(weights, w_ref, atol=1e-12)
    assert torch.equal(new_mask, keep_ref)
    assert not weights.requires_grad and torch.isfinite(weights).all()
    assert stats["is_ratio_mean"].item() == pytest.approx(sum(ratios) / len(ratios))
    assert stats["is_ratio_max"].item() == pytest.approx(max(ratios))
    assert stats["is_ratio_min"].item() == pytest.approx(min(ratios))
    assert stats["share_clipped"].item() == pytest.approx(sum(clipped) / len(clipped))
    dropped = int((mask & ~keep_ref).sum())
    assert stats["share_masked"].item() == pytest.approx(dropped / len(ratios))
    if mode in ("token_tis", "seq_tis", "token_mask", "seq_mask"):  # the inputs exercise the mode
        assert stats["share_clipped"] > 0 or stats["share_masked"] > 0


def test_hand_worked_example_of_each_mode() -> None:
    # One sequence, two tokens, log ratios [ln 3, ln 0.5]: token ratios [3, 0.5], product 1.5,
    # geometric mean sqrt(1.5) = 1.22474.
    target = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]])
    behavior = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    w = {m: offpolicy_weights(target, behavior, mask, CorrectionParams(m, cap=2.0, low=0.6, high=1.2)) for m in MODES}
    assert torch.allclose(w["none"][0], torch.tensor([[1.0, 1.0, 0.0]]))
    assert torch.allclose(w["token_tis"][0], torch.tensor([[2.0, 0.5, 0.0]]))   # min(3, 2), min(0.5, 2)
    assert torch.allclose(w["seq_tis"][0], torch.tensor([[1.5, 1.5, 0.0]]))     # min(1.5, 2) on both tokens
    assert torch.allclose(w["token_mask"][0], torch.tensor([[0.0, 0.0, 0.0]]))  # 3 > 1.2 and 0.5 < 0.6: both dropped
    assert torch.allclose(w["seq_mask"][0], torch.tensor([[0.0, 0.0, 0.0]]))    # 1.22474 > 1.2: the sequence dropped
    assert w["token_tis"][2]["share_clipped"].item() == pytest.approx(0.5)
    assert w["seq_mask"][2]["is_ratio_max"].item() == pytest.approx(math.sqrt(1.5), rel=1e-6)
    kept = offpolicy_weights(target, behavior, mask, CorrectionParams("seq_mask", low=0.5, high=1.3))
    assert kept[1].tolist() == [[True, True, False]] and kept[2]["share_masked"].item() == 0.0


def test_on_policy_data_gets_unit_weights_in_every_mode() -> None:
    target, _, mask = _random(5)
    for mode in MODES:
        weights, new_mask, stats = offpolicy_weights(target, target.clone(), mask, CorrectionParams(mode))
        assert torch.equal(new_mask, mask)
        assert torch.equal(weights, mask.to(weights.dtype))
        assert stats["is_ratio_mean"].item() == pytest.approx(1.0)


def test_empty_mask_gives_zero_stats_not_nan() -> None:
    z = torch.zeros(2, 3)
    weights, new_mask, stats = offpolicy_weights(z, z, torch.zeros(2, 3, dtype=torch.bool),
                                                 CorrectionParams("token_tis"))
    assert weights.abs().sum() == 0 and not new_mask.any()
    assert all(v.item() == 0.0 for v in stats.values())


def test_decoupled_ppo_composes_weights_with_the_policy_loss() -> None:
    # loss_t = w_t * ppo_clip(pi / pi_prox)_t over the kept tokens: the weight scales the token's gradient.
    target, behavior, mask = _random(7)
    weights, new_mask, _ = offpolicy_weights(target, behavior, mask, CorrectionParams("token_tis", cap=1.5))
    logprobs = target.clone().requires_grad_(True)  # first micro-batch: pi == pi_prox, ratio 1
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    loss_tok, _ = get_policy_loss("ppo_clip")(logprobs, target, adv, new_mask, PolicyLossParams())
    n = int(mask.sum())
    token_mean(loss_tok * weights, mask, global_tokens=n).backward()
    # Inside the trust region (ratio 1) the PPO gradient is -A; weighted: -w * A / n.
    assert torch.allclose(logprobs.grad, torch.where(mask, -weights * adv / n, 0.0), atol=1e-12)


def test_params_are_validated_and_modes_registered() -> None:
    assert available_corrections() == sorted(MODES)
    with pytest.raises(ValueError, match="unknown; known: none"):
        CorrectionParams(mode="token-tis")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="band"):
        CorrectionParams(mode="token_mask", low=1.2, high=2.0)
    with pytest.raises(ValueError, match="cap"):
        CorrectionParams(mode="token_tis", cap=0.0)
    with pytest.raises(ValueError, match="one shape"):
        offpolicy_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), CorrectionParams())
