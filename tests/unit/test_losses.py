"""Policy losses (ppo_clip with clip-higher and dual clip, gspo, vanilla_pg) and the four aggregations:
against slow references, closed-form gradients, gradcheck, hand-worked examples, micro-batch splits."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import (
    PolicyLossParams,
    approx_kl_k3,
    available_loss_aggs,
    available_policy_losses,
    entropy_from_logits,
    get_loss_agg,
    get_policy_loss,
    masked_mean,
    ppo_clip_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)
from asyncrl.algorithms.losses import gspo_loss, vanilla_pg_loss

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
    assert get_policy_loss("ppo_clip") is ppo_clip_loss and get_policy_loss("gspo") is gspo_loss
    assert get_policy_loss("vanilla_pg") is vanilla_pg_loss
    assert available_policy_losses() == ["gspo", "ppo_clip", "vanilla_pg"]
    assert get_loss_agg("token-mean") is token_mean
    assert available_loss_aggs() == ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                     "token-mean"]
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


# --------------------------------------------------------------- ppo_clip: clip-higher, dual clip


def _reference_ppo_general(logprobs, old, adv, mask, lo, hi, dual=None):
    out = torch.zeros_like(logprobs)
    for i in range(logprobs.shape[0]):
        for j in range(logprobs.shape[1]):
            if not mask[i, j]:
                continue
            ratio = math.exp(float(logprobs[i, j] - old[i, j]))
            a = float(adv[i, j])
            loss = max(-ratio * a, -min(max(ratio, 1 - lo), 1 + hi) * a)
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            out[i, j] = loss
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("lo", "hi", "dual"), [(0.2, 0.28, None), (0.1, 0.3, 1.5), (0.2, 0.2, 3.0)])
def test_ppo_clip_asymmetric_and_dual_match_reference(seed: int, lo: float, hi: float, dual: float | None) -> None:
    logprobs, old, adv, mask = _random_inputs(seed)
    loss, stats = ppo_clip_loss(logprobs, old, adv, mask, PolicyLossParams(lo, hi, dual))
    assert torch.allclose(loss, _reference_ppo_general(logprobs, old, adv, mask, lo, hi, dual), atol=1e-12)
    assert (loss[~mask] == 0).all()
    assert stats["clip_frac"] == pytest.approx(float(stats["clip_frac_low"] + stats["clip_frac_high"]))
    assert ("dual_clip_frac" in stats) == (dual is not None)


def test_ppo_clip_hand_worked_clip_higher_and_dual_clip() -> None:
    # ratio e^0.5 = 1.6487, A = +1, eps_high 0.28: clipped at 1.28 -> loss -1.28 (symmetric 0.2 would give -1.2)
    # ratio e^-0.5 = 0.6065, A = -1, eps_low 0.2: -A*r = 0.6065 < -A*0.8 = 0.8 -> clipped, loss 0.8
    # ratio e^2 = 7.389, A = -1: PPO loss max(7.389, 1.2) = 7.389; dual clip c = 3 caps it at 3
    logprobs = torch.tensor([[0.5, -0.5, 2.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = ppo_clip_loss(logprobs, old, adv, mask, PolicyLossParams(0.2, 0.28, dual_clip=3.0))
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, 3.0]]))
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    sym, _ = ppo_clip_loss(logprobs, old, adv, mask, PolicyLossParams(0.2, 0.2))
    assert sym[0, 0].item() == pytest.approx(-1.2) and sym[0, 2].item() == pytest.approx(math.exp(2.0))


@pytest.mark.parametrize("seed", range(3))
def test_ppo_clip_asymmetric_gradient_is_minus_ratio_times_advantage_inside_the_region(seed: int) -> None:
    logprobs, old, adv, mask = _random_inputs(seed)
    lo, hi = 0.1, 0.3
    logprobs.requires_grad_(True)
    loss, _ = ppo_clip_loss(logprobs, old, adv, mask, PolicyLossParams(lo, hi))
    loss.sum().backward()
    with torch.no_grad():
        ratio = torch.where(mask, logprobs - old, 0.0).exp()
        clipped = ((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - lo))
        want = torch.where(mask & ~clipped, -ratio * adv, 0.0)
    assert torch.allclose(logprobs.grad, want, atol=1e-12)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "vanilla_pg"])
def test_policy_losses_pass_gradcheck_in_float64(name: str) -> None:
    logprobs, old, adv, mask = _random_inputs(11)
    fn = get_policy_loss(name)
    params = PolicyLossParams(0.2, 0.28, dual_clip=2.0)
    lp = logprobs.clone().requires_grad_(True)
    if name == "gspo":
        # GSPO-token's per-token value depends on the whole sequence while its gradient (stop-grad trick)
        # flows through the token only; what is a true gradient is that of the sequence-mean aggregate.
        def f(x):
            return seq_mean_token_mean(fn(x, old, adv, mask, params)[0], mask, global_tokens=1, global_seqs=4)
    else:
        def f(x):
            return fn(x, old, adv, mask, params)[0]
    assert torch.autograd.gradcheck(f, (lp,), eps=1e-7, atol=1e-6)


# ---------------------------------------------------------------------------------------- gspo


def _reference_gspo(logprobs, old, adv, mask, lo, hi):
    out = torch.zeros_like(logprobs)
    for i in range(logprobs.shape[0]):
        pos = [j for j in range(logprobs.shape[1]) if mask[i, j]]
        if not pos:
            continue
        s = math.exp(sum(float(logprobs[i, j] - old[i, j]) for j in pos) / len(pos))
        for j in pos:
            a = float(adv[i, j])
            out[i, j] = max(-s * a, -min(max(s, 1 - lo), 1 + hi) * a)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_gspo_matches_sequence_level_reference(seed: int) -> None:
    logprobs, old, adv, mask = _random_inputs(seed)
    loss, stats = gspo_loss(logprobs, old, adv, mask, PolicyLossParams(0.05, 0.08))
    assert torch.allclose(loss, _reference_gspo(logprobs, old, adv, mask, 0.05, 0.08), atol=1e-12)
    assert torch.isfinite(loss).all() and (loss[~mask] == 0).all()
    assert 0.0 <= stats["seq_clip_frac"].item() <= 1.0


@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_gradient_equals_the_sequence_objective_gradient(seed: int) -> None:
    # GSPO-token with the sequence's advantage on all its tokens and seq-mean-token-mean aggregation has
    # the gradient of GSPO's sequence objective -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean log ratio).
    logprobs, old, adv, mask = _random_inputs(seed)
    eps = 0.05
    lp1 = logprobs.clone().requires_grad_(True)
    loss_tok, _ = gspo_loss(lp1, old, adv, mask, PolicyLossParams(eps, eps))
    seq_mean_token_mean(loss_tok, mask, global_tokens=int(mask.sum()), global_seqs=mask.shape[0]).backward()

    lp2 = logprobs.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(mask.shape[0]):
        if not mask[i].any():
            continue
        s = (lp2[i][mask[i]] - old[i][mask[i]]).mean().exp()
        a = adv[i, 0]
        total = total + torch.maximum(-s * a, -s.clamp(1 - eps, 1 + eps) * a)
    (total / mask.shape[0]).backward()
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-12)
    assert lp1.grad.abs().sum() > 0


def test_gspo_hand_worked_example() -> None:
    # Both rows: token log ratios [0.1, 0.3] -> s = exp(0.2) = 1.22140.
    # Row 0, A = +1: clip(s) = 1.2 is the pessimistic branch -> -1.2 on both tokens (sequence clipped).
    # Row 1, A = -1: -A*s = 1.22140 > -A*1.2 = 1.2 -> unclipped, 1.22140 on both tokens.
    logprobs = torch.tensor([[0.1, 0.3], [0.1, 0.3]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, stats = gspo_loss(logprobs, torch.zeros(2, 2), adv, mask, PolicyLossParams(0.2, 0.2))
    assert torch.allclose(loss, torch.tensor([[-1.2, -1.2], [1.22140, 1.22140]]), atol=1e-5)
    assert stats["seq_clip_frac"].item() == pytest.approx(0.5)
    assert stats["clip_frac"].item() == pytest.approx(0.5)


# ---------------------------------------------------------------------------------- vanilla_pg


def test_vanilla_pg_loss_and_gradient_after_token_mean() -> None:
    logprobs, old, adv, mask = _random_inputs(3)
    logprobs.requires_grad_(True)
    loss, stats = vanilla_pg_loss(logprobs, old, adv, mask, PolicyLossParams())
    assert torch.allclose(loss, torch.where(mask, -adv * logprobs, 0.0).detach())
    n = int(mask.sum())
    token_mean(loss, mask, global_tokens=n).backward()
    assert torch.allclose(logprobs.grad, torch.where(mask, -adv / n, 0.0))
    assert torch.isclose(stats["ratio_mean"], (logprobs - old).exp()[mask].mean())


def test_vanilla_pg_hand_worked_example() -> None:
    # -A * log pi: A = 1, log pi = -0.5 -> 0.5; A = -1, log pi = -2 -> -2; a masked -inf token -> 0
    loss, _ = vanilla_pg_loss(torch.tensor([[-0.5, -2.0, -math.inf]]), torch.zeros(1, 3),
                              torch.tensor([[1.0, -1.0, 5.0]]), torch.tensor([[True, True, False]]), PolicyLossParams())
    assert loss.tolist() == [[0.5, -2.0, 0.0]]


def test_ppo_clip_loss_takes_either_params_or_the_legacy_clip_eps() -> None:
    logprobs, old, adv, mask = _random_inputs(2)
    legacy, _ = ppo_clip_loss(logprobs, old, adv, mask, clip_eps=0.1)
    assert torch.equal(legacy, ppo_clip_loss(logprobs, old, adv, mask, PolicyLossParams(0.1, 0.1))[0])
    assert torch.equal(ppo_clip_loss(logprobs, old, adv, mask)[0],
                       ppo_clip_loss(logprobs, old, adv, mask, PolicyLossParams())[0])
    with pytest.raises(ValueError, match="not both"):
        ppo_clip_loss(logprobs, old, adv, mask, PolicyLossParams(), clip_eps=0.1)


def test_policy_loss_params_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="clip_eps_low"):
        PolicyLossParams(clip_eps_low=1.0)
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossParams(dual_clip=0.5)


# -------------------------------------------------------------------------------- aggregations


def _reference_agg(name, loss_tok, mask, n_seqs, norm_len):
    per_seq = []
    total, tokens = 0.0, 0
    for i in range(loss_tok.shape[0]):
        vals = [float(loss_tok[i, j]) for j in range(loss_tok.shape[1]) if mask[i, j]]
        total += sum(vals)
        tokens += len(vals)
        per_seq.append((sum(vals), sum(vals) / len(vals) if vals else 0.0))
    return {
        "token-mean": total / tokens,
        "seq-mean-token-sum": sum(s for s, _ in per_seq) / n_seqs,
        "seq-mean-token-mean": sum(m for _, m in per_seq) / n_seqs,
        "seq-mean-token-sum-norm": total / (n_seqs * norm_len),
    }[name]


AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("name", AGGS)
@pytest.mark.parametrize("seed", range(3))
def test_aggregation_matches_reference_and_micro_batches_sum_to_the_full_batch(name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 7, 6
    loss_tok = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, t, generator=gen) > 0.35
    mask[2] = False  # a sequence without loss tokens
    loss_tok = torch.where(mask, loss_tok, torch.tensor(float("nan"), dtype=torch.float64))  # garbage off the mask
    fn = get_loss_agg(name)
    kw = dict(global_tokens=int(mask.sum()), global_seqs=b, norm_len=8)
    full = fn(loss_tok, mask, **kw)
    assert full.item() == pytest.approx(_reference_agg(name, loss_tok, mask, b, 8), abs=1e-12)
    parts = sum(fn(loss_tok[lo:hi], mask[lo:hi], **kw) for lo, hi in [(0, 2), (2, 3), (3, 7)])
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)


def test_aggregations_hand_worked_example() -> None:
    # seq 0: tokens [1, 2]; seq 1: token [3]. token-mean 6/3 = 2; seq-mean-token-sum (3 + 3)/2 = 3;
    # seq-mean-token-mean (1.5 + 3)/2 = 2.25; seq-mean-token-sum-norm with norm_len 4: 6/(2*4) = 0.75
    loss_tok = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 7.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    kw = dict(global_tokens=3, global_seqs=2, norm_len=4)
    got = {name: get_loss_agg(name)(loss_tok, mask, **kw).item() for name in AGGS}
    assert got == pytest.approx({"token-mean": 2.0, "seq-mean-token-sum": 3.0, "seq-mean-token-mean": 2.25,
                                 "seq-mean-token-sum-norm": 0.75})


def test_sequence_aggregations_need_their_counts() -> None:
    loss_tok, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="norm_len"):
        seq_mean_token_sum_norm(loss_tok, mask, global_tokens=2, global_seqs=1)
    with pytest.raises(ValueError, match="global_seqs"):
        seq_mean_token_sum(loss_tok, mask, global_tokens=2)
