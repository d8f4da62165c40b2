"""Token-budget micro-batches (asyncrl/training/micro.py, trainer.max_tokens_per_micro_batch): how samples are cut,
and that the cut changes nothing the loss sees — gradients, losses and the trained weights equal the padded
path's to float64 precision."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
from asyncrl.messages import Group
from asyncrl.training.learner import Learner
from asyncrl.training.micro import MicroBatching, in_order, padded_cells
from tests.unit.test_learner import PAD, VOCAB, _tiny_model, _traj


def test_the_budget_sorts_by_length_and_keeps_samples_times_longest_within_it() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(5, 300) for _ in range(64)]
    parts = MicroBatching(max_samples=8, max_tokens=600).split(lengths)
    assert sorted(i for p in parts for i in p) == list(range(64))            # every sample exactly once
    assert all(padded_cells(lengths, p) <= 600 for p in parts)
    widths = [max(lengths[i] for i in p) for p in parts]
    assert widths == sorted(widths, reverse=True)                              # longest first
    # similar lengths share a batch: far less padding than consecutive runs of the same number of batches
    runs = MicroBatching(max_samples=-(-64 // len(parts))).split(lengths)
    assert sum(padded_cells(lengths, p) for p in parts) < 0.75 * sum(padded_cells(lengths, p) for p in runs)


def test_the_cut_computes_the_fewest_tokens_not_the_fewest_forwards() -> None:
    """One long reply does not drag four short ones to its width (1,500 tokens in one forward) when two forwards
    compute 540; equal lengths still share one forward."""
    from asyncrl.training.micro import FORWARD_COST

    parts = MicroBatching(64, max_tokens=2048).split([60, 300, 60, 60, 60])
    assert parts == [[1], [0, 2, 3, 4]]
    assert MicroBatching(64, max_tokens=2048).split([100] * 8) == [list(range(8))]
    # brute force over every run cut of a sorted list: the programme's cut is the cheapest within the budget
    rng = random.Random(1)
    for _ in range(50):
        widths = sorted((rng.randint(1, 200) for _ in range(9)), reverse=True)
        got = MicroBatching(64, max_tokens=400).split(widths)
        cost = sum(padded_cells(widths, p) + FORWARD_COST for p in got)
        best = min(sum(len(r) * r[0] + FORWARD_COST for r in runs) for runs in _run_cuts(widths)
                   if all(len(r) * r[0] <= 400 or len(r) == 1 for r in runs))
        assert cost == best


def _run_cuts(widths):
    if not widths:
        yield []
        return
    for k in range(1, len(widths) + 1):
        for rest in _run_cuts(widths[k:]):
            yield [widths[:k], *rest]


def test_a_sample_longer_than_the_budget_runs_alone_and_off_means_runs_of_micro_batch_size() -> None:
    parts = MicroBatching(8, max_tokens=10).split([4, 30, 3, 2])
    assert parts[0] == [1] and sorted(i for p in parts for i in p) == [0, 1, 2, 3]
    assert MicroBatching(3).split([9, 1, 1, 1, 9]) == [[0, 1, 2], [3, 4]]


def test_a_count_is_met_by_splitting_the_costliest_micro_batches() -> None:
    lengths = [10, 10, 10, 10, 2, 2]
    parts = MicroBatching(8, max_tokens=100).split(lengths, count=3)
    assert len(parts) == 3 and sorted(i for p in parts for i in p) == list(range(6))
    assert parts == [[0, 1], [2], [3, 4, 5]]  # the one batch of all six, halved, then its costlier half halved
    with pytest.raises(ValueError, match="cannot cut"):
        MicroBatching(8, max_tokens=100).split(lengths, count=7)


def test_ranks_agree_on_the_count_whatever_their_lengths() -> None:
    lengths = [40, 40, 40, 40, 3, 3, 3, 3]       # rank 0's share needs 4 batches of 40 at a budget of 50, rank 1's 1
    b = MicroBatching(8, max_tokens=50)
    shards = [(0, 4), (4, 8)]
    counts = [len(b.agreed(lengths, shards, r)) for r in range(2)]
    assert counts == [4, 4]
    assert sorted(i for p in b.agreed(lengths, shards, 1) for i in p) == [0, 1, 2, 3]  # relative to the shard


def test_in_order_puts_rows_back_in_the_samples_order() -> None:
    parts = [[2, 0], [1]]
    rows = [torch.tensor([[2.0], [0.0]]), torch.tensor([[1.0]])]
    assert in_order(rows, parts).flatten().tolist() == [0.0, 1.0, 2.0]


def _spread_samples(learner: Learner, n: int = 12) -> list:
    """Lengths spread 2..24 tokens, loss-mask holes, mixed temperatures, behaviour logprobs near the policy's."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        p_len, r_len = 1 + i % 3, [1, 2, 20, 3, 1, 12, 2, 1, 6, 1, 16, 2][i % 12]
        prompt = torch.randint(1, VOCAB, (p_len,), generator=gen).tolist()
        response = torch.randint(1, VOCAB, (r_len,), generator=gen).tolist()
        temp = [1.0, 0.7, 1.3][i % 3]
        tf = torch.tensor(learner.teacher_forced_logprobs(prompt, response, temp))
        out.append(_traj(i, i // 3, prompt, response, loss_mask=(torch.rand(r_len, generator=gen) > 0.3).tolist(),
                         logprobs=(tf + 0.3 * torch.randn(r_len, generator=gen)).tolist(), temperature=temp,
                         reward=float(torch.rand((), generator=gen))))
    return out


def _learner(budget: int, **algorithm) -> Learner:
    trainer = TrainerConfig(lr=1e-2, grad_clip=0.5, micro_batch_size=64, mini_batches=2, epochs=2,
                            max_tokens_per_micro_batch=budget)
    return Learner(_tiny_model().double(), algorithm=AlgorithmConfig(**algorithm), trainer=trainer, pad_token_id=PAD,
                   max_new_tokens=24)


@pytest.mark.parametrize("algorithm", [
    dict(loss_agg="token-mean", decoupled=True, correction="token_tis"),   # a proximal forward, cut the same way
    dict(loss_agg="seq-mean-token-mean", entropy_coef=0.01),
    dict(loss_agg="seq-mean-token-sum-norm", policy_loss="gspo"),         # a sequence-level ratio
])
def test_steps_by_token_budget_train_the_weights_the_padded_steps_train(algorithm) -> None:
    padded, budget = _learner(0, **algorithm), _learner(40, **algorithm)
    samples = _spread_samples(padded)
    for step in range(3):
        groups = [Group(group_id=g, min_version=0, trajectories=samples[3 * g : 3 * g + 3]) for g in range(4)]
        m_pad, m_bud = padded.update(groups), budget.update(groups)
        assert m_bud["trainer/loss"] == pytest.approx(m_pad["trainer/loss"], rel=1e-12, abs=1e-14)
        assert m_bud["trainer/entropy"] == pytest.approx(m_pad["trainer/entropy"], rel=1e-12)
        assert m_bud["trainer/padded_share"] < 0.5 * m_pad["trainer/padded_share"]
    start = _tiny_model().double()
    with torch.no_grad():
        worst = max(float((a - b).abs().max()) for a, b in zip(padded.model.parameters(), budget.model.parameters()))
        moved = min(float((a - b).abs().max()) for a, b in zip(padded.model.parameters(), start.parameters())
                    if a.dim() == 2)
    assert moved > 1e-4 and worst < 1e-12, (moved, worst)


def logprob_passes(model, batch, ways) -> list:
    """For each (logprob function, its keywords) in `ways`: the batch's logprobs, entropy and the gradients of their
    sum (entropy with grad), from zeroed gradients."""
    results = []
    for fn, kw in ways:
        model.zero_grad(set_to_none=True)
        lp, ent = fn(model, batch.input_ids, batch.attention_mask, batch.response_mask, batch.temperature.double(),
                     entropy_grad=True, **kw)
        (lp.sum() + ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    return results


def test_packed_rows_give_the_padded_batchs_logprobs_entropy_and_gradients() -> None:
    """trainer.pack_sequences: the samples' real tokens in one row, position ids per sample — each token sees only
    its own sequence (HF's block-diagonal mask), so logprobs, entropy and gradients equal the padded forward's."""
    from asyncrl.training.batch import collate
    from asyncrl.training.logprobs import packed_logprobs, token_logprobs

    model = _tiny_model().double()
    samples = _spread_samples(_learner(0))
    batch = collate(samples, torch.zeros(len(samples)), PAD)
    (want_lp, want_ent, want_grads), *others = logprob_passes(
        model, batch, ((token_logprobs, {}), (packed_logprobs, {}), (packed_logprobs, {"chunk": 5})))
    for lp, ent, grads in others:
        assert torch.allclose(lp, want_lp, rtol=0, atol=1e-12) and torch.allclose(ent, want_ent, rtol=0, atol=1e-12)
        assert all(torch.allclose(g, w, rtol=0, atol=1e-10) for g, w in zip(grads, want_grads, strict=True))


@pytest.mark.parametrize("algorithm", [dict(loss_agg="seq-mean-token-mean", decoupled=True, correction="token_tis"),
                                       dict(loss_agg="seq-mean-token-sum-norm", policy_loss="gspo")])
def test_packed_steps_train_the_weights_the_padded_steps_train(algorithm) -> None:
    padded = _learner(0, **algorithm)
    packed = Learner(_tiny_model().double(), algorithm=AlgorithmConfig(**algorithm), pad_token_id=PAD,
                     max_new_tokens=24, trainer=msgspec.structs.replace(padded.trainer, pack_sequences=True,
                                                                       max_tokens_per_micro_batch=40))
    samples = _spread_samples(padded)
    for _ in range(2):
        groups = [Group(group_id=g, min_version=0, trajectories=samples[3 * g : 3 * g + 3]) for g in range(4)]
        m_pad, m_pack = padded.update(groups), packed.update(groups)
        assert m_pack["trainer/loss"] == pytest.approx(m_pad["trainer/loss"], rel=1e-12, abs=1e-14)
    with torch.no_grad():
        worst = max(float((a - b).abs().max()) for a, b in zip(padded.model.parameters(), packed.model.parameters()))
    assert worst < 1e-12
