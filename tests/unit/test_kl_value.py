"""KL estimators k1 / k2 / k3 and the clipped value loss: references, hand-worked examples, closed-form
gradients, gradcheck, unbiasedness by Monte Carlo, garbage off the mask."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import approx_kl_k3, available_kl_estimators, get_kl_estimator, kl_estimate, value_loss

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------- KL


def _reference_kl(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1.0}[kind]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimates_match_per_token_reference_with_masked_garbage(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 4
    ref = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 4
    mask = torch.rand(3, 5, generator=gen) > 0.3
    ref_garbage = torch.where(mask, ref, torch.tensor(-math.inf, dtype=torch.float64))
    got = kl_estimate(lp, ref_garbage, kind, mask=mask)
    want = torch.tensor([[_reference_kl(float(lp[i, j]), float(ref[i, j]), kind) if mask[i, j] else 0.0
                          for j in range(5)] for i in range(3)], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.allclose(kl_estimate(lp, ref, kind), torch.tensor(
        [[_reference_kl(float(a), float(b), kind) for a, b in zip(r1, r2)] for r1, r2 in zip(lp, ref)],
        dtype=torch.float64))


def test_kl_hand_worked_example() -> None:
    # log pi = -1, log pi_ref = -2: k1 = 1; k2 = 0.5; k3 = e^(-1) - (-1) - 1 = 0.36788
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.36788, abs=1e-5)
    assert torch.equal(kl_estimate(lp, ref, "k3"), approx_kl_k3(lp, ref))


def test_kl_gradients_have_their_closed_forms_and_pass_gradcheck() -> None:
    # d/dlogpi: k1 -> 1, k2 -> logpi - logref, k3 -> 1 - pi_ref/pi
    gen = torch.Generator().manual_seed(1)
    ref = -torch.rand(6, generator=gen, dtype=torch.float64) * 3
    lp0 = -torch.rand(6, generator=gen, dtype=torch.float64) * 3
    want = {"k1": torch.ones(6, dtype=torch.float64), "k2": lp0 - ref, "k3": 1 - (ref - lp0).exp()}
    for kind, g in want.items():
        lp = lp0.clone().requires_grad_(True)
        kl_estimate(lp, ref, kind).sum().backward()
        assert torch.allclose(lp.grad, g, atol=1e-12), kind
        assert torch.autograd.gradcheck(lambda x, k=kind: kl_estimate(x, ref, k), (lp0.clone().requires_grad_(True),))


def test_k1_and_k3_are_unbiased_and_k3_never_negative() -> None:
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    exact = float((p * (p / q).log()).sum())
    for kind in ("k1", "k3"):
        assert kl_estimate(p.log()[x], q.log()[x], kind).mean().item() == pytest.approx(exact, rel=0.03), kind
    assert (kl_estimate(p.log()[x], q.log()[x], "k3") >= 0).all()
    assert (kl_estimate(p.log()[x], q.log()[x], "k1") < 0).any()  # k1 per token can be negative


def test_kl_clamps_wild_log_ratios_and_names_unknown_kinds() -> None:
    out = kl_estimate(torch.tensor([0.0]), torch.tensor([1000.0]), "k3")
    assert torch.isfinite(out).all() and out.item() == pytest.approx(math.exp(20) - 21)
    assert available_kl_estimators() == ["k1", "k2", "k3"]
    assert get_kl_estimator("k2") is not None
    with pytest.raises(KeyError, match="known: k1, k2, k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


# ------------------------------------------------------------------------------------ value loss


def _reference_value(v, v_old, ret, mask, eps):
    out = torch.zeros_like(v)
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            if not mask[i, j]:
                continue
            a, o, r = float(v[i, j]), float(v_old[i, j]), float(ret[i, j])
            unclipped = (a - r) ** 2
            clipped = (min(max(a, o - eps), o + eps) - r) ** 2 if eps is not None else unclipped
            out[i, j] = 0.5 * max(unclipped, clipped)
    return out


def _value_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    v_old = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    v = v_old + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.4
    ret = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    return v, torch.where(mask, v_old, nan), torch.where(mask, ret, nan), mask


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("eps", [0.2, None])
def test_value_loss_matches_reference_and_gradient_is_zero_where_clipped(seed: int, eps: float | None) -> None:
    v, v_old, ret, mask = _value_inputs(seed)
    v = v.requires_grad_(True)
    loss, stats = value_loss(v, v_old, ret, mask, eps)
    assert torch.allclose(loss, _reference_value(v.detach(), v_old, ret, mask, eps), atol=1e-12)
    assert (loss[~mask] == 0).all()
    loss.sum().backward()
    with torch.no_grad():
        if eps is None:
            clipped = torch.zeros_like(mask)
        else:
            vc = v_old + (v - v_old).clamp(-eps, eps)
            clipped = mask & ((vc - ret) ** 2 > (v - ret) ** 2)
        want = torch.where(mask & ~clipped, v - ret, 0.0)  # d/dv of 1/2 (v - R)^2
    assert torch.isfinite(v.grad).all()
    assert torch.allclose(v.grad, want, atol=1e-12)
    assert stats["vf_clip_frac"].item() == pytest.approx(float(clipped.sum()) / float(mask.sum()))
    if eps is not None:
        assert clipped.any() and (mask & ~clipped).any(), "inputs must exercise both branches"


def test_value_loss_hand_worked_example_and_stats() -> None:
    # v_old 0, eps 0.2. Token 0: v = 1, R = 2: unclipped 1, clipped (0.2 - 2)^2 = 3.24 -> 1/2 * 3.24 = 1.62
    # Token 1: v = 0.1, R = 0.1: unclipped 0, clipped 0 -> 0. Token 2: v = -1, R = 0: unclipped 1,
    # clipped (-0.2)^2 = 0.04 -> 1/2 * 1 = 0.5 (the unclipped one is larger: moves the value back).
    v = torch.tensor([[1.0, 0.1, -1.0]])
    loss, stats = value_loss(v, torch.zeros(1, 3), torch.tensor([[2.0, 0.1, 0.0]]), torch.ones(1, 3, dtype=torch.bool),
                             0.2)
    assert torch.allclose(loss, torch.tensor([[1.62, 0.0, 0.5]]))
    assert stats["vf_clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["value_mean"].item() == pytest.approx(0.1 / 3)
    # explained variance (population variances): R = [2, .1, 0], mean .7, var (1.69 + .36 + .49)/3 = 0.84667;
    # R - v = [1, 0, 1], var 2/9 = 0.22222 -> 1 - 0.22222/0.84667 = 0.73753
    assert stats["explained_variance"].item() == pytest.approx(0.73753, abs=1e-4)


def test_value_loss_explained_variance_is_one_for_a_perfect_critic_and_zero_without_variance() -> None:
    ret = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert value_loss(ret.clone(), ret, ret, mask, None)[1]["explained_variance"].item() == pytest.approx(1.0)
    flat = torch.ones(1, 3)
    assert value_loss(torch.zeros(1, 3), flat, flat, mask, None)[1]["explained_variance"].item() == 0.0
    with pytest.raises(ValueError, match="clip_eps"):
        value_loss(flat, flat, flat, mask, 0.0)


def test_value_loss_passes_gradcheck() -> None:
    v, v_old, ret, mask = _value_inputs(4)
    assert torch.autograd.gradcheck(lambda x: value_loss(x, v_old, ret, mask, 0.3)[0],
                                    (v.clone().requires_grad_(True),))
