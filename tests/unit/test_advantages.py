"""Advantage estimators: each against a slow reference (Python loops), hand-worked examples from the papers'
definitions, degenerate groups, the Safe-RLHF pieces and DAPO's overlong shaping."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from asyncrl.algorithms import (
    AdvantageInput,
    AdvantageParams,
    LagrangeMultiplier,
    available_advantages,
    get_advantage,
    grpo_advantages,
    lagrangian_advantages,
    masked_whiten,
    overlong_penalty,
)
from asyncrl.algorithms.advantages import compute_grpo

torch.set_num_threads(1)

ALL = ["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae"]


# ------------------------------------------------------------------------- slow references


def _reference_grpo(
    rewards: list[float], group_ids: list[int], eps: float = 1e-6, norm_by_std: bool = True
) -> list[float]:
    """Obviously correct, one group at a time."""
    out = [0.0] * len(rewards)
    for g in set(group_ids):
        idx = [i for i, x in enumerate(group_ids) if x == g]
        vals = [rewards[i] for i in idx]
        if len(vals) == 1 or max(vals) == min(vals):
            continue  # no signal: advantage 0
        mean = sum(vals) / len(vals)
        std = statistics.stdev(vals)  # unbiased (n - 1)
        for i in idx:
            out[i] = (rewards[i] - mean) / (std + eps) if norm_by_std else rewards[i] - mean
    return out


def _reference_rloo(rewards: list[float], group_ids: list[int]) -> list[float]:
    out = [0.0] * len(rewards)
    for i, g in enumerate(group_ids):
        others = [rewards[j] for j, h in enumerate(group_ids) if h == g and j != i]
        if others and max(others + [rewards[i]]) != min(others + [rewards[i]]):
            out[i] = rewards[i] - sum(others) / len(others)
    return out


def _positions(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def _reference_token_rewards(inp: AdvantageInput, seq_rewards: list[float]) -> list[list[float]]:
    """Per row, the rewards of its mask steps: token rewards, plus the sequence reward on the last step."""
    rows = []
    for i in range(inp.mask.shape[0]):
        pos = _positions(inp.mask, i)
        r = [float(inp.token_rewards[i, t]) if inp.token_rewards is not None else 0.0 for t in pos]
        if r:
            r[-1] += seq_rewards[i]
        rows.append(r)
    return rows


def _reference_returns(rows: list[list[float]], gamma: float) -> list[list[float]]:
    out = []
    for r in rows:
        g, ret = 0.0, [0.0] * len(r)
        for k in reversed(range(len(r))):
            g = r[k] + gamma * g
            ret[k] = g
        out.append(ret)
    return out


def _reference_whiten(rows: list[list[float]], eps: float) -> list[list[float]]:
    flat = [x for r in rows for x in r]
    mean = sum(flat) / len(flat)
    var = statistics.variance(flat) if len(flat) > 1 else 0.0
    return [[(x - mean) / math.sqrt(var + eps) for x in r] for r in rows]


def _reference_gae(rows: list[list[float]], values: list[list[float]], gamma: float, lam: float) -> list[list[float]]:
    out = []
    for r, v in zip(rows, values):
        adv, last = [0.0] * len(r), 0.0
        for k in reversed(range(len(r))):
            next_v = v[k + 1] if k + 1 < len(r) else 0.0
            delta = r[k] + gamma * next_v - v[k]
            last = delta + gamma * lam * last
            adv[k] = last
        out.append(adv)
    return out


def _scatter(rows: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, r in enumerate(rows):
        for t, x in zip(_positions(mask, i), r):
            out[i, t] = x
    return out


def _random_input(seed: int, t: int = 9) -> AdvantageInput:
    """Groups of size 1, an all-equal group, unsorted sparse ids, interleaved members; masks with a prompt
    offset, holes and an empty row; garbage (NaN / inf) off the mask."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 1, 2, 3, 5] + torch.randint(1, 6, (3,), generator=gen).tolist()
    group_ids, rewards = [], []
    for g, size in enumerate(sizes):
        gid = int(torch.randint(0, 10_000, (1,), generator=gen)) * 100 + g
        vals = [0.7] * size if g == 3 else torch.randint(0, 3, (size,), generator=gen).float().mul(0.5).tolist()
        group_ids += [gid] * size
        rewards += vals
    perm = torch.randperm(len(rewards), generator=gen)
    b = len(rewards)
    start = torch.randint(0, 3, (b,), generator=gen)
    length = torch.randint(1, t - 2, (b,), generator=gen)
    pos = torch.arange(t)[None, :]
    mask = (pos >= start[:, None]) & (pos < (start + length)[:, None])
    mask &= torch.rand(b, t, generator=gen) > 0.2  # holes (environment-written tokens)
    mask[0] = False  # a row without loss tokens
    token_rewards = torch.where(mask, -0.1 * torch.rand(b, t, generator=gen), torch.tensor(float("nan")))
    values = torch.where(mask, torch.randn(b, t, generator=gen), torch.tensor(float("inf")))
    return AdvantageInput(
        rewards=torch.tensor(rewards)[perm],
        group_ids=torch.tensor(group_ids)[perm],
        mask=mask,
        values=values,
        token_rewards=token_rewards,
        baselines=torch.rand(b, generator=gen),
    )


def _seq_rewards(inp: AdvantageInput) -> list[float]:
    out = []
    for i in range(inp.mask.shape[0]):
        extra = sum(float(inp.token_rewards[i, t]) for t in _positions(inp.mask, i))
        out.append(float(inp.rewards[i]) + extra)
    return out


def _check_output(adv: torch.Tensor, inp: AdvantageInput) -> None:
    assert adv.dtype == torch.float32 and adv.shape == inp.mask.shape
    assert torch.isfinite(adv).all()
    assert (adv[~inp.mask] == 0).all()


# ------------------------------------------------------------------- estimators vs references


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_helper_matches_slow_reference_on_random_groups(seed: int, norm_by_std: bool) -> None:
    inp = _random_input(seed)
    rewards, group_ids = inp.rewards.tolist(), inp.group_ids.tolist()
    got = grpo_advantages(inp.rewards, inp.group_ids, norm_by_std=norm_by_std)
    want = torch.tensor(_reference_grpo(rewards, group_ids, norm_by_std=norm_by_std))
    assert got.shape == (len(rewards),)
    assert torch.allclose(got, want, atol=1e-5), (got, want)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "remax"])
def test_outcome_estimators_match_slow_reference(seed: int, name: str) -> None:
    inp = _random_input(seed)
    r, g = _seq_rewards(inp), inp.group_ids.tolist()
    seq = {
        "grpo": lambda: _reference_grpo(r, g),
        "drgrpo": lambda: _reference_grpo(r, g, norm_by_std=False),
        "rloo": lambda: _reference_rloo(r, g),
        "remax": lambda: [x - float(b) for x, b in zip(r, inp.baselines)],
    }[name]()
    want = _scatter([[a] * len(_positions(inp.mask, i)) for i, a in enumerate(seq)], inp.mask)
    out = get_advantage(name)(inp, AdvantageParams())
    _check_output(out.advantages, inp)
    assert out.returns is None
    assert torch.allclose(out.advantages.double(), want, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_slow_reference(seed: int, gamma: float) -> None:
    inp = _random_input(seed)
    rows = _reference_token_rewards(inp, inp.rewards.tolist())
    want = _scatter(_reference_whiten(_reference_returns(rows, gamma), 1e-6), inp.mask)
    out = get_advantage("reinforce_pp")(inp, AdvantageParams(gamma=gamma))
    _check_output(out.advantages, inp)
    assert torch.allclose(out.advantages.double(), want, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_pp_baseline_matches_slow_reference(seed: int) -> None:
    inp = _random_input(seed)
    rewards, group_ids = inp.rewards.tolist(), inp.group_ids.tolist()
    centred = []
    for i, g in enumerate(group_ids):
        vals = [rewards[j] for j, h in enumerate(group_ids) if h == g]
        centred.append(rewards[i] - sum(vals) / len(vals) if max(vals) != min(vals) else 0.0)
    rows = _reference_token_rewards(inp, centred)
    want = _scatter(_reference_whiten(_reference_returns(rows, 0.95), 1e-6), inp.mask)
    out = get_advantage("reinforce_pp_baseline")(inp, AdvantageParams(gamma=0.95))
    _check_output(out.advantages, inp)
    assert torch.allclose(out.advantages.double(), want, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("whiten", [False, True])
def test_gae_matches_slow_reference_skipping_masked_positions(seed: int, whiten: bool) -> None:
    inp = _random_input(seed)
    rows = _reference_token_rewards(inp, inp.rewards.tolist())
    values = [[float(inp.values[i, t]) for t in _positions(inp.mask, i)] for i in range(inp.mask.shape[0])]
    adv_rows = _reference_gae(rows, values, 0.9, 0.7)
    ret = _scatter([[a + v for a, v in zip(ar, vr)] for ar, vr in zip(adv_rows, values)], inp.mask)
    want = _scatter(_reference_whiten(adv_rows, 1e-6) if whiten else adv_rows, inp.mask)
    out = get_advantage("gae")(inp, AdvantageParams(gamma=0.9, lam=0.7, whiten=whiten))
    _check_output(out.advantages, inp)
    assert torch.allclose(out.advantages.double(), want, atol=1e-5)
    assert out.returns is not None and (out.returns[~inp.mask] == 0).all()
    assert torch.allclose(out.returns.double(), ret, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_masked_whiten_matches_reference_and_keeps_the_mean_when_asked(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=gen) * 3 + 2
    mask = torch.rand(4, 6, generator=gen) > 0.3
    rows = [[float(x[i, t]) for t in _positions(mask, i)] for i in range(4)]
    want = _scatter(_reference_whiten(rows, 1e-6), mask)
    assert torch.allclose(masked_whiten(x, mask).double(), want, atol=1e-5)
    kept = masked_whiten(x, mask, shift_mean=False)
    mean = x[mask].double().mean()
    assert torch.allclose(kept.double(), torch.where(mask, want + mean, 0.0), atol=1e-5)
    assert (kept[~mask] == 0).all()


# -------------------------------------------------------------------- hand-worked examples


def _one_token_each(rewards: list[float], group_ids: list[int], **kw) -> AdvantageInput:
    n = len(rewards)
    return AdvantageInput(torch.tensor(rewards), torch.tensor(group_ids), torch.ones(n, 1, dtype=torch.bool), **kw)


def test_grpo_hand_worked_example() -> None:
    # rewards [1, 0, 0, 1]: mean 0.5; unbiased std = sqrt((4 * 0.25) / 3) = 0.57735; 0.5 / 0.57735 = 0.86603
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([7, 7, 7, 7]))
    assert torch.allclose(adv, torch.tensor([0.86603, -0.86603, -0.86603, 0.86603]), atol=1e-4)
    # Registered form: the same on every loss token, 0 off the mask; a token reward of -0.5 on sample 0
    # makes its reward 0.5: rewards [0.5, 0, 0, 1], mean 0.375, std sqrt((.015625+.140625*2+.390625)/3)=0.47871
    mask = torch.tensor([[True, True], [True, False], [False, True], [True, True]])
    tok = torch.tensor([[-0.25, -0.25], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    out = compute_grpo(AdvantageInput(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([7] * 4), mask,
                                      token_rewards=tok), AdvantageParams())
    want = torch.tensor([[0.26112, 0.26112], [-0.78335, 0.0], [0.0, -0.78335], [1.30558, 1.30558]])
    assert torch.allclose(out.advantages, want, atol=1e-4)


def test_drgrpo_hand_worked_example() -> None:
    # rewards [1, 0, 0, 1] minus their mean 0.5, no std: ±0.5
    out = get_advantage("drgrpo")(_one_token_each([1.0, 0.0, 0.0, 1.0], [7] * 4), AdvantageParams())
    assert out.advantages.flatten().tolist() == [0.5, -0.5, -0.5, 0.5]


def test_rloo_hand_worked_example() -> None:
    # group [3, 1, 2]: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0.   A lone sample: 0.
    out = get_advantage("rloo")(_one_token_each([3.0, 1.0, 2.0, 5.0], [0, 0, 0, 1]), AdvantageParams())
    assert out.advantages.flatten().tolist() == [1.5, -1.5, 0.0, 0.0]


def test_reinforce_pp_hand_worked_example() -> None:
    # 3 loss tokens (a hole between the first two), token rewards [0.1, 0, 0], sequence reward 1 on the last,
    # gamma 0.5: returns-to-go 1, 0 + 0.5*1 = 0.5, 0.1 + 0.5*0.5 = 0.35 -> [0.35, 0.5, 1.0];
    # mean 0.616667, unbiased var ((-.266667)^2 + (-.116667)^2 + .383333^2) / 2 = 0.115833, std 0.340343:
    # whitened [-0.78352, -0.34279, 1.12631].
    mask = torch.tensor([[True, False, True, True]])
    tok = torch.tensor([[0.1, 9.0, 0.0, 0.0]])  # 9.0 sits off the mask: ignored
    inp = AdvantageInput(torch.tensor([1.0]), torch.tensor([0]), mask, token_rewards=tok)
    out = get_advantage("reinforce_pp")(inp, AdvantageParams(gamma=0.5))
    assert torch.allclose(out.advantages, torch.tensor([[-0.78352, 0.0, -0.34279, 1.12631]]), atol=1e-4)


def test_reinforce_pp_baseline_hand_worked_example() -> None:
    # group [1, 0] -> [0.5, -0.5]; a lone sample (reward 3) -> 0; whitened over the 3 tokens [0.5, -0.5, 0]:
    # mean 0, unbiased var 0.5/2 = 0.25, std 0.5 -> [1, -1, 0].
    out = get_advantage("reinforce_pp_baseline")(_one_token_each([1.0, 0.0, 3.0], [4, 4, 5]), AdvantageParams())
    assert torch.allclose(out.advantages.flatten(), torch.tensor([1.0, -1.0, 0.0]), atol=1e-5)


def test_remax_hand_worked_example_and_missing_baselines() -> None:
    # rewards [1, 0.2], greedy-rollout rewards [0.5, 0.5] -> [0.5, -0.3]
    out = get_advantage("remax")(_one_token_each([1.0, 0.2], [0, 1], baselines=torch.tensor([0.5, 0.5])),
                                 AdvantageParams())
    assert torch.allclose(out.advantages.flatten(), torch.tensor([0.5, -0.3]))
    with pytest.raises(ValueError, match="remax needs AdvantageInput.baselines"):
        get_advantage("remax")(_one_token_each([1.0], [0]), AdvantageParams())


def test_gae_hand_worked_example_skips_a_hole() -> None:
    # mask [T, F, T, T], values [0.5, (x), 0.2, 0.4], reward 1 at the end, gamma 0.9, lambda 0.8:
    # deltas backwards: 1 + 0 - 0.4 = 0.6; 0 + 0.9*0.4 - 0.2 = 0.16; 0 + 0.9*0.2 - 0.5 = -0.32
    # A3 = 0.6; A2 = 0.16 + 0.72*0.6 = 0.592; A1 = -0.32 + 0.72*0.592 = 0.10624; returns = A + V.
    mask = torch.tensor([[True, False, True, True]])
    values = torch.tensor([[0.5, 123.0, 0.2, 0.4]])
    out = get_advantage("gae")(AdvantageInput(torch.tensor([1.0]), torch.tensor([0]), mask, values=values),
                               AdvantageParams(gamma=0.9, lam=0.8))
    assert torch.allclose(out.advantages, torch.tensor([[0.10624, 0.0, 0.592, 0.6]]), atol=1e-6)
    assert torch.allclose(out.returns, torch.tensor([[0.60624, 0.0, 0.792, 1.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="gae needs AdvantageInput.values"):
        get_advantage("gae")(AdvantageInput(torch.tensor([1.0]), torch.tensor([0]), mask), AdvantageParams())


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value() -> None:
    # lambda = gamma = 1: A_t = (sum of rewards from t) - V_t (Monte Carlo advantage).
    mask = torch.tensor([[True, True, True]])
    values = torch.tensor([[0.3, -0.2, 0.7]])
    tok = torch.tensor([[0.1, 0.2, 0.0]])
    out = get_advantage("gae")(AdvantageInput(torch.tensor([1.0]), torch.tensor([0]), mask, values=values,
                                              token_rewards=tok), AdvantageParams())
    assert torch.allclose(out.advantages, torch.tensor([[1.3 - 0.3, 1.2 + 0.2, 1.0 - 0.7]]), atol=1e-6)


# ----------------------------------------------------------------------- degenerate groups


def test_grpo_single_sample_and_all_equal_groups_get_exactly_zero() -> None:
    rewards = torch.tensor([3.0, 0.1, 0.1, 0.1, 1.0, 0.0])
    group_ids = torch.tensor([0, 1, 1, 1, 2, 2])
    adv = grpo_advantages(rewards, group_ids)
    assert not torch.isnan(adv).any()
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4] > 0.5 and adv[5] < -0.5


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_give_exact_zero_on_singletons_and_all_equal_groups(name: str) -> None:
    # 0.1 three times: a float mean that is not exactly 0.1 must still give exactly 0.
    inp = _one_token_each([3.0, 0.1, 0.1, 0.1, -2.0], [0, 1, 1, 1, 2])
    out = get_advantage(name)(inp, AdvantageParams())
    assert out.advantages.flatten().tolist() == [0.0] * 5


@pytest.mark.parametrize("name", ALL)
def test_every_estimator_handles_an_empty_batch_and_rows_without_loss_tokens(name: str) -> None:
    empty = AdvantageInput(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 3, dtype=torch.bool),
                           values=torch.zeros(0, 3), baselines=torch.zeros(0))
    assert get_advantage(name)(empty, AdvantageParams()).advantages.shape == (0, 3)
    no_tokens = AdvantageInput(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.zeros(2, 3, dtype=torch.bool),
                               values=torch.zeros(2, 3), baselines=torch.zeros(2))
    out = get_advantage(name)(no_tokens, AdvantageParams())
    assert out.advantages.abs().sum() == 0


# -------------------------------------------------------------------- registry and errors


def test_estimators_are_registered_and_unknown_names_list_known_ones() -> None:
    assert set(ALL) <= set(available_advantages())
    assert get_advantage("grpo") is compute_grpo
    with pytest.raises(KeyError, match="grpo"):
        get_advantage("no-such-estimator")


def test_grpo_keeps_float_dtype_and_accepts_integer_rewards() -> None:
    adv = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.dtype == torch.float32
    # [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.70711, so advantages are ±0.5 / 0.70711 = ±0.70711
    assert torch.allclose(adv, torch.tensor([0.70711, -0.70711]), atol=1e-4)


def test_bad_shapes_and_params_fail_with_one_clear_line() -> None:
    with pytest.raises(ValueError, match="mask must be"):
        compute_grpo(AdvantageInput(torch.zeros(3), torch.zeros(3, dtype=torch.long),
                                    torch.ones(2, 4, dtype=torch.bool)), AdvantageParams())
    with pytest.raises(ValueError, match="values must be"):
        get_advantage("gae")(AdvantageInput(torch.zeros(2), torch.zeros(2, dtype=torch.long),
                                            torch.ones(2, 4, dtype=torch.bool), values=torch.zeros(2, 3)),
                             AdvantageParams())
    with pytest.raises(ValueError, match="gamma"):
        AdvantageParams(gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        AdvantageParams(lam=-0.1)


# ------------------------------------------------------------------- DAPO overlong shaping


def test_overlong_penalty_hand_worked_example() -> None:
    # max_len 10, cache 4: free up to 6 tokens, then -(L - 6)/4 * penalty, -penalty from 10 on.
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10, 12]), max_len=10, cache_len=4, penalty=2.0)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=0)


# ---------------------------------------------------------------------------- Safe-RLHF


def test_lagrangian_advantages_hand_worked_example() -> None:
    a_r, a_c = torch.tensor([[2.0, 1.0]]), torch.tensor([[1.0, 2.0]])
    # lambda 1: (2 - 1)/2 = 0.5, (1 - 2)/2 = -0.5; lambda 0: the reward advantage unchanged
    assert torch.allclose(lagrangian_advantages(a_r, a_c, 1.0), torch.tensor([[0.5, -0.5]]))
    assert torch.equal(lagrangian_advantages(a_r, a_c, 0.0), a_r)
    with pytest.raises(ValueError, match=">= 0"):
        lagrangian_advantages(a_r, a_c, -1.0)


def test_lagrange_multiplier_ascends_on_violation_projects_at_zero_and_caps() -> None:
    lm = LagrangeMultiplier(init=1.0, lr=0.1, threshold=0.5)
    assert lm.update(1.5) == pytest.approx(1.1)   # cost above threshold: 1 + 0.1 * (1.5 - 0.5)
    assert lm.update(0.0) == pytest.approx(1.05)  # below: 1.1 + 0.1 * (0 - 0.5)
    assert lm.update(-100.0) == 0.0               # projected onto lambda >= 0
    capped = LagrangeMultiplier(init=0.0, lr=1.0, threshold=0.0, max_value=2.0)
    assert capped.update(5.0) == 2.0
    restored = LagrangeMultiplier(init=0.0, lr=0.1, threshold=0.5)
    restored.load_state_dict(capped.state_dict())
    assert restored.value == 2.0
    with pytest.raises(ValueError, match="lr"):
        LagrangeMultiplier(init=0.0, lr=0.0, threshold=0.0)
