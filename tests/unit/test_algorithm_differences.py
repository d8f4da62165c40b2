"""On one batch, each algorithm's advantages / loss differ from GRPO's where its definition says they
should (no silent fallback to GRPO), and equal them (or a known transform of them) where they must."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algorithms import (
    AdvantageInput,
    AdvantageParams,
    CorrectionParams,
    PolicyLossParams,
    get_advantage,
    get_loss_agg,
    get_policy_loss,
    kl_estimate,
    lagrangian_advantages,
    masked_whiten,
    offpolicy_weights,
    overlong_penalty,
    ppo_clip_loss,
)

torch.set_num_threads(1)

P = AdvantageParams()


def _batch():
    """Two groups of 4 (stds 0.5 and 1.5, not 1) and a lone sample; response lengths 2..6 after a
    2-token prompt; a stale behaviour policy (ratios well outside 1 ± 0.2)."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 0.0, 1.5, -1.0, 2.0])
    group_ids = torch.tensor([5, 5, 5, 5, 9, 9, 9, 9, 11])
    lengths = torch.tensor([2, 5, 3, 6, 4, 2, 6, 5, 3])
    t = 8
    pos = torch.arange(t)[None, :]
    mask = (pos >= 2) & (pos < 2 + lengths[:, None])
    logprobs = (-torch.rand(9, t, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    old = logprobs.detach() + torch.randn(9, t, generator=gen, dtype=torch.float64) * 0.3
    values = torch.randn(9, t, generator=gen, dtype=torch.float64) * 0.5
    return rewards, group_ids, mask, logprobs, old, values, lengths


def _adv(name: str, **kw) -> torch.Tensor:
    rewards, group_ids, mask, *_ = _batch()
    params = kw.pop("params", P)
    return get_advantage(name)(AdvantageInput(rewards, group_ids, mask, **kw), params).advantages.double()


def _loss(adv, *, policy="ppo_clip", agg="token-mean", params=PolicyLossParams(), weights=None, extra=None):
    _, _, mask, logprobs, old, _, _ = _batch()
    loss_tok, _ = get_policy_loss(policy)(logprobs, old, adv, mask, params)
    if weights is not None:
        loss_tok = loss_tok * weights
    if extra is not None:
        loss_tok = loss_tok + extra
    return get_loss_agg(agg)(loss_tok, mask, global_tokens=int(mask.sum()), global_seqs=mask.shape[0], norm_len=8)


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not torch.allclose(a.detach(), b.detach(), atol=1e-6)


# -------------------------------------------------------------------------------- advantages


def test_drgrpo_is_grpo_times_the_group_std_and_differs_from_it() -> None:
    grpo, dr = _adv("grpo"), _adv("drgrpo")
    # group 5: rewards [1, 0, 1, 0], unbiased std 0.57735; group 9: [3, 0, 1.5, -1], std 1.75; the lone sample: 0
    std = torch.tensor([0.57735] * 4 + [1.75] * 4 + [0.0], dtype=torch.float64)[:, None]
    assert torch.allclose(dr, grpo * (std + 1e-6), atol=1e-4)
    assert _differ(dr, grpo)


def test_rloo_is_drgrpo_times_n_over_n_minus_one() -> None:
    rloo, dr = _adv("rloo"), _adv("drgrpo")
    assert torch.allclose(rloo, dr * 4 / 3, atol=1e-6)
    assert _differ(rloo, _adv("grpo"))


def test_remax_with_the_group_mean_as_baseline_is_drgrpo_and_otherwise_differs() -> None:
    group_mean = torch.tensor([0.5] * 4 + [0.875] * 4 + [2.0])
    assert torch.allclose(_adv("remax", baselines=group_mean), _adv("drgrpo"), atol=1e-6)
    greedy = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    assert _differ(_adv("remax", baselines=greedy), _adv("grpo"))


def test_reinforce_pp_baseline_is_the_batch_whitened_drgrpo_and_reinforce_pp_keeps_the_lone_sample() -> None:
    _, _, mask, *_ = _batch()
    rpp_b = _adv("reinforce_pp_baseline")
    assert torch.allclose(rpp_b, masked_whiten(_adv("drgrpo"), mask).double(), atol=1e-5)
    assert _differ(rpp_b, _adv("grpo"))
    rpp = _adv("reinforce_pp")
    assert rpp[8][mask[8]].abs().min() > 0.1  # no group baseline: the lone sample still gets a signal
    assert _adv("grpo")[8].abs().max() == 0


def test_gae_with_gamma_lambda_one_is_reward_minus_value_and_differs_from_grpo() -> None:
    rewards, _, mask, _, _, values, _ = _batch()
    # lambda = gamma = 1: A_t = R - V_t; with V = the group mean at every token this is drgrpo
    group_mean = torch.tensor([0.5] * 4 + [0.875] * 4 + [2.0], dtype=torch.float64)[:, None].expand(mask.shape)
    assert torch.allclose(_adv("gae", values=group_mean), _adv("drgrpo"), atol=1e-6)
    gae = _adv("gae", values=values, params=AdvantageParams(gamma=0.95, lam=0.9))
    assert _differ(gae, _adv("grpo"))
    # a token's advantage varies within a sequence with a critic, unlike any outcome estimator
    assert gae[1][mask[1]].unique().numel() > 1


def test_token_rewards_reach_every_estimator_that_reads_them() -> None:
    _, _, mask, logprobs, old, values, _ = _batch()
    kl_pen = -0.1 * kl_estimate(logprobs.detach(), old, "k1", mask=mask)
    for name in ["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]:
        assert _differ(_adv(name, token_rewards=kl_pen), _adv(name)), name
    assert _differ(_adv("gae", values=values, token_rewards=kl_pen), _adv("gae", values=values))


def test_dapo_overlong_shaping_changes_only_overlong_samples() -> None:
    rewards, group_ids, mask, _, _, _, lengths = _batch()
    shaped = rewards + overlong_penalty(lengths, max_len=6, cache_len=2, penalty=1.0)  # lengths 5, 6 punished
    assert torch.equal(shaped != rewards, lengths > 4)
    a = get_advantage("grpo")(AdvantageInput(shaped, group_ids, mask), P).advantages.double()
    assert _differ(a, _adv("grpo"))


def test_safe_rlhf_lagrangian_is_the_reward_advantage_at_lambda_zero_only() -> None:
    a_r = _adv("grpo")
    a_c = _adv("drgrpo")
    assert torch.equal(lagrangian_advantages(a_r, a_c, 0.0), a_r)
    assert _differ(lagrangian_advantages(a_r, a_c, 0.5), a_r)


# ------------------------------------------------------------------------------------- losses


def test_ppo_clip_with_equal_eps_is_the_old_ppo_clip_loss_and_clip_higher_differs() -> None:
    _, _, mask, logprobs, old, _, _ = _batch()
    adv = _adv("grpo")
    new, new_stats = get_policy_loss("ppo_clip")(logprobs, old, adv, mask, PolicyLossParams(0.2, 0.2))
    legacy, legacy_stats = ppo_clip_loss(logprobs, old, adv, mask, clip_eps=0.2)
    assert torch.equal(new, legacy)
    assert new_stats["clip_frac"] == legacy_stats["clip_frac"]
    assert _differ(_loss(adv, params=PolicyLossParams(0.2, 0.28)), _loss(adv))
    assert _differ(_loss(adv, params=PolicyLossParams(0.2, 0.2, dual_clip=1.5)), _loss(adv))


def test_gspo_differs_from_ppo_clip_but_equals_it_on_one_token_sequences() -> None:
    _, _, mask, logprobs, old, _, _ = _batch()
    adv = _adv("grpo")
    assert _differ(_loss(adv, policy="gspo", agg="seq-mean-token-mean"), _loss(adv, agg="seq-mean-token-mean"))
    one = torch.zeros_like(mask)
    one[:, 3] = True
    g, _ = get_policy_loss("gspo")(logprobs, old, adv, one, PolicyLossParams())
    p, _ = get_policy_loss("ppo_clip")(logprobs, old, adv, one, PolicyLossParams())
    assert torch.allclose(g, p, atol=1e-12)


def test_vanilla_pg_has_the_ppo_gradient_on_policy_and_differs_off_policy() -> None:
    _, _, mask, logprobs, old, _, _ = _batch()
    adv = _adv("grpo")
    grads = {}
    for name in ("vanilla_pg", "ppo_clip"):
        lp = logprobs.detach().clone().requires_grad_(True)
        loss_tok, _ = get_policy_loss(name)(lp, lp.detach(), adv, mask, PolicyLossParams())
        get_loss_agg("token-mean")(loss_tok, mask, global_tokens=int(mask.sum())).backward()
        grads[name] = lp.grad
    assert torch.allclose(grads["vanilla_pg"], grads["ppo_clip"], atol=1e-12)
    assert _differ(_loss(adv, policy="vanilla_pg"), _loss(adv))


def test_aggregations_differ_on_unequal_lengths_and_agree_on_equal_ones() -> None:
    adv = _adv("grpo")
    losses = {agg: _loss(adv, agg=agg)
              for agg in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]}
    vals = [v.item() for v in losses.values()]
    assert len({round(v, 9) for v in vals}) == 4, losses
    loss_tok = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    kw = dict(global_tokens=12, global_seqs=3, norm_len=4)
    # equal lengths L = norm_len: token-mean = seq-mean-token-mean = seq-mean-token-sum-norm = seq-mean-token-sum / L
    tm = get_loss_agg("token-mean")(loss_tok, mask, **kw)
    assert torch.allclose(get_loss_agg("seq-mean-token-mean")(loss_tok, mask, **kw), tm)
    assert torch.allclose(get_loss_agg("seq-mean-token-sum-norm")(loss_tok, mask, **kw), tm)
    assert torch.allclose(get_loss_agg("seq-mean-token-sum")(loss_tok, mask, **kw) / 4, tm)


def test_kl_loss_term_and_offpolicy_weights_change_the_loss_only_when_policies_differ() -> None:
    _, _, mask, logprobs, old, _, _ = _batch()
    adv = _adv("grpo")
    base = _loss(adv)
    for kind in ("k1", "k2", "k3"):
        assert _differ(_loss(adv, extra=0.1 * kl_estimate(logprobs, old, kind, mask=mask)), base), kind
        assert torch.allclose(_loss(adv, extra=0.1 * kl_estimate(logprobs, logprobs.detach(), kind, mask=mask)), base)
    behavior = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.3
    for mode in ("token_tis", "seq_tis", "token_mask", "seq_mask"):
        p = CorrectionParams(mode, cap=1.2, low=0.8, high=1.2)
        w, _, _ = offpolicy_weights(old, behavior, mask, p)
        assert _differ(_loss(adv, weights=w), base), mode
        w_on, _, _ = offpolicy_weights(old, old.clone(), mask, p)
        assert torch.allclose(_loss(adv, weights=w_on), base), mode


PRESETS = {
    # name: (advantage, extra AdvantageInput fields, policy loss, params, aggregation)
    "drgrpo": ("drgrpo", {}, "ppo_clip", PolicyLossParams(), "seq-mean-token-sum-norm"),
    "dapo": ("grpo", {}, "ppo_clip", PolicyLossParams(0.2, 0.28), "token-mean"),
    "gspo": ("grpo", {}, "gspo", PolicyLossParams(0.2, 0.28), "seq-mean-token-mean"),
    "rloo": ("rloo", {}, "ppo_clip", PolicyLossParams(), "token-mean"),
    "reinforce_pp": ("reinforce_pp", {}, "ppo_clip", PolicyLossParams(), "token-mean"),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", {}, "ppo_clip", PolicyLossParams(), "token-mean"),
    "remax": ("remax", {"baselines": torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])},
              "vanilla_pg", PolicyLossParams(), "token-mean"),
    "ppo": ("gae", {"values": "values"}, "ppo_clip", PolicyLossParams(), "token-mean"),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_algorithm_loss_differs_from_grpo_on_the_same_batch(name: str) -> None:
    _, _, _, _, _, values, _ = _batch()
    adv_name, extra, policy, params, agg = PRESETS[name]
    kw = {k: (values if v == "values" else v) for k, v in extra.items()}
    grpo_loss = _loss(_adv("grpo"), agg="seq-mean-token-mean")
    loss = _loss(_adv(adv_name, **kw), policy=policy, params=params, agg=agg)
    assert torch.isfinite(loss)
    assert abs(loss.item() - grpo_loss.item()) > 1e-4, (name, loss.item(), grpo_loss.item())
