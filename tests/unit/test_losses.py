"""PPO clipped loss and token-mean aggregation: against slow references, closed-form gradients, registry."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import (
    approx_kl_k3,
    available_loss_aggs,
    available_policy_losses,
    entropy_from_logits,
    get_loss_agg,
    get_policy_loss,
    masked_mean,
    ppo_clip_loss,
    token_mean,
)

torch.set_num_threads(1)


def _random_inputs(seed: int, b: int = 4, t: int = 7):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    old = logprobs + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3  # ratios on both sides of the clip
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, t).clone()
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask[0, 0] = False  # a hole inside a sequence (an env-written token)
    mask[1, :] = True
    old = torch.where(mask, old, torch.tensor(-math.inf, dtype=torch.float64))  # garbage on padding
    old[2, ~mask[2]] = 0.0
    return logprobs, old, adv, mask


def _reference_ppo(logprobs, old, adv, mask, eps):
    out = torch.zeros_like(logprobs)
    for i in range(logprobs.shape[0]):
        for j in range(logprobs.shape[1]):
            if not mask[i, j]:
                continue
            ratio = math.exp(float(logprobs[i, j] - old[i, j]))
            a = float(adv[i, j])
            out[i, j] = -min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_ppo_clip_matches_per_token_reference_with_masked_garbage(seed: int) -> None:
    logprobs, old, adv, mask = _random_inputs(seed)
    loss, stats = ppo_clip_loss(logprobs, old, adv, mask, clip_eps=0.2)
    want = _reference_ppo(logprobs, old, adv, mask, 0.2)
    assert torch.isfinite(loss).all()
    assert torch.allclose(loss, want, atol=1e-12)
    assert (loss[~mask] == 0).all()
    ratios = (logprobs - old).exp()[mask]
    assert torch.isclose(stats["ratio_mean"], ratios.mean())
    assert torch.isclose(stats["ratio_max"], ratios.max())


@pytest.mark.parametrize("seed", range(4))
def test_ppo_clip_gradient_is_minus_ratio_times_advantage_where_unclipped_else_zero(seed: int) -> None:
    logprobs, old, adv, mask = _random_inputs(seed)
    eps = 0.2
    logprobs.requires_grad_(True)
    loss, _ = ppo_clip_loss(logprobs, old, adv, mask, clip_eps=eps)
    loss.sum().backward()

    with torch.no_grad():
        ratio = torch.where(mask, logprobs - old, 0.0).exp()
        clipped = ((adv > 0) & (ratio > 1 + eps)) | ((adv < 0) & (ratio < 1 - eps))
        want = torch.where(mask & ~clipped, -ratio * adv, 0.0)
    assert torch.isfinite(logprobs.grad).all()
    assert torch.allclose(logprobs.grad, want, atol=1e-12)
    assert clipped[mask].any() and (~clipped[mask]).any(), "inputs must exercise both branches"


def test_clip_frac_on_a_hand_case() -> None:
    # ratios e^0.5=1.65 (A>0: clipped), e^-0.5=0.61 (A<0: clipped), e^0.5 with A<0 (not clipped: the
    # unclipped branch is the pessimistic one), 1.0 (inside), and a masked token that would be clipped.
    logprobs = torch.tensor([[0.5, -0.5, 0.5, 0.0, 0.5]])
    old = torch.zeros(1, 5)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    _, stats = ppo_clip_loss(logprobs, old, adv, mask, clip_eps=0.2)
    assert stats["clip_frac"].item() == pytest.approx(2 / 4)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.5))


def test_token_mean_divides_by_global_token_count() -> None:
    loss_tok = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), float("nan")]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    got = token_mean(loss_tok, mask, global_tokens=10, global_seqs=5)
    assert got.item() == pytest.approx((1 + 2 + 3) / 10)
    # Two halves of a batch summed give the full batch's token mean, whatever their token counts.
    halves = token_mean(loss_tok[:1], mask[:1], global_tokens=3) + token_mean(loss_tok[1:], mask[1:], global_tokens=3)
    assert halves.item() == pytest.approx(2.0)


def test_builtins_are_registered_and_unknown_names_list_known_ones() -> None:
    assert "ppo_clip" in available_policy_losses() and get_policy_loss("ppo_clip") is ppo_clip_loss
    assert "token-mean" in available_loss_aggs() and get_loss_agg("token-mean") is token_mean
    with pytest.raises(KeyError, match="unknown policy loss 'nope'; known: .*ppo_clip"):
        get_policy_loss("nope")
    with pytest.raises(KeyError, match="token-mean"):
        get_loss_agg("seq-mean-nope")


def test_entropy_of_uniform_and_of_banned_tokens() -> None:
    logits = torch.zeros(2, 8)
    logits[1, 4:] = -math.inf  # 4 tokens banned: uniform over the other 4
    ent = entropy_from_logits(logits)
    assert torch.allclose(ent, torch.tensor([math.log(8), math.log(4)]))


def test_k3_is_zero_on_equal_policies_and_estimates_kl() -> None:
    assert approx_kl_k3(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0])).abs().max() == 0
    # Sample from p, estimate KL(p || q) with the mean of k3; compare with the exact value.
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = approx_kl_k3(p.log()[x], q.log()[x]).mean()
    exact = (p * (p / q).log()).sum()
    assert est.item() == pytest.approx(exact.item(), rel=0.03)


def test_masked_mean_ignores_garbage_and_empty_masks() -> None:
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    mask = torch.tensor([[True, False], [True, True]])
    assert masked_mean(x, mask).item() == pytest.approx(3.0)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    assert torch.allclose(masked_mean(x, mask, dim=1), torch.tensor([1.0, 4.0]))
