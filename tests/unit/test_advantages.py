"""GRPO advantages: the vectorised estimator against a slow reference and a hand-worked example."""

from __future__ import annotations

import statistics

import pytest
import torch

from asyncrl.algorithms import available_advantages, get_advantage, grpo_advantages

torch.set_num_threads(1)


def _reference_grpo(rewards: list[float], group_ids: list[int], eps: float = 1e-6, norm_by_std: bool = True) -> list[float]:
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


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_slow_reference_on_random_groups(seed: int, norm_by_std: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 1, 2, 3, 5, 8] + torch.randint(1, 9, (4,), generator=gen).tolist()
    group_ids, rewards = [], []
    for g, size in enumerate(sizes):
        gid = int(torch.randint(0, 10_000, (1,), generator=gen)) * 100 + g  # unsorted, sparse ids
        if g == 3:  # an all-equal group
            vals = [0.7] * size
        else:
            vals = torch.randint(0, 3, (size,), generator=gen).float().mul(0.5).tolist()
        group_ids += [gid] * size
        rewards += vals
    perm = torch.randperm(len(rewards), generator=gen).tolist()  # members of a group interleaved
    group_ids = [group_ids[i] for i in perm]
    rewards = [rewards[i] for i in perm]

    got = grpo_advantages(torch.tensor(rewards), torch.tensor(group_ids), norm_by_std=norm_by_std)
    want = torch.tensor(_reference_grpo(rewards, group_ids, norm_by_std=norm_by_std))
    assert got.shape == (len(rewards),)
    assert torch.allclose(got, want, atol=1e-5), (got, want)


def test_grpo_hand_worked_example() -> None:
    # rewards [1, 0, 0, 1]: mean 0.5; unbiased std = sqrt((4 * 0.25) / 3) = 0.57735; 0.5 / 0.57735 = 0.86603
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([7, 7, 7, 7]))
    assert torch.allclose(adv, torch.tensor([0.86603, -0.86603, -0.86603, 0.86603]), atol=1e-4)


def test_grpo_single_sample_and_all_equal_groups_get_exactly_zero() -> None:
    rewards = torch.tensor([3.0, 0.1, 0.1, 0.1, 1.0, 0.0])
    group_ids = torch.tensor([0, 1, 1, 1, 2, 2])
    adv = grpo_advantages(rewards, group_ids)
    assert not torch.isnan(adv).any()
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4] > 0.5 and adv[5] < -0.5


def test_grpo_is_registered_and_unknown_names_list_known_ones() -> None:
    assert "grpo" in available_advantages()
    assert get_advantage("grpo") is grpo_advantages
    with pytest.raises(KeyError, match="grpo"):
        get_advantage("no-such-estimator")


def test_grpo_keeps_float_dtype_and_accepts_integer_rewards() -> None:
    adv = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.dtype == torch.float32
    # [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.70711, so advantages are ±0.5 / 0.70711 = ±0.70711
    assert torch.allclose(adv, torch.tensor([0.70711, -0.70711]), atol=1e-4)
