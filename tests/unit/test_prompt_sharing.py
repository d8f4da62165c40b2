"""Prompt sharing (asyncrl/training/sharing.py, trainer.share_prompts): the layout, and that it changes nothing the
loss sees — logprobs, entropy, gradients and the trained weights equal the padded path's to float64 precision."""

from __future__ import annotations

import msgspec
import pytest
import torch

from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
from asyncrl.messages import Group
from asyncrl.training.batch import collate
from asyncrl.training.learner import Learner
from asyncrl.training.logprobs import shared_prompt_logprobs, token_logprobs
from asyncrl.training.sharing import attention_kind, share_prompts
from tests.unit.test_learner import PAD, VOCAB, _tiny_model, _traj
from tests.unit.test_micro_batches import logprob_passes


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    """HF's RMSNorm computes in float32 whatever its input (a float64 model's too). The shared layout sums a prompt's
    gradient over its replies before the norm's backward, the padded one after, so the float32 rounding lands
    elsewhere (~1e-8 relative): with the norm in the model's dtype the comparison sees the layout alone."""
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)


def test_samples_of_one_prompt_share_a_row_and_each_reply_restarts_at_the_prompts_end() -> None:
    samples = [_traj(0, 0, [5, 6, 7], [8, 9]), _traj(1, 1, [4], [3]), _traj(2, 0, [5, 6, 7], [1, 2, 3])]
    batch = collate(samples, torch.zeros(3), PAD)
    rows = share_prompts(batch.input_ids, batch.attention_mask, batch.response_mask)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3], [4, 3, 0, 0, 0, 0, 0, 0]]
    assert rows.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, -1, -1, -1, -1, -1, -1]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 0, 0, 0, 0, 0, 0]]
    # each reply token is predicted by the state before it: the prompt's last for a reply's first token
    assert rows.src.tolist() == [2, 3, 8, 2, 5, 6]         # sample 0's 8, 9; sample 1's 3; sample 2's 1, 2, 3
    assert (rows.tokens, rows.cells) == (10, 16)
    seen = rows.mask("bool")[0, 0]
    assert seen[6].tolist() == [True, True, True, False, False, True, True, False]   # reply 2's 2nd token
    assert seen[4].tolist() == [True, True, True, True, True, False, False, False]   # reply 1's 2nd token
    additive = rows.mask("additive")
    assert torch.equal(additive == 0, rows.mask("bool")) and additive.min() == torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="at least one token"):
        share_prompts(torch.tensor([[3, 4]]), torch.tensor([[1, 1]]), torch.tensor([[True, True]]))


def test_a_token_budget_cuts_rows_of_a_prompt_and_its_replies_not_samples() -> None:
    """Under trainer.share_prompts the budget holds rows x the widest row, the tokens the shared forward computes:
    a prompt's samples stay together, and a prompt whose replies outgrow the budget fills several rows."""
    from asyncrl.training.micro import MicroBatching

    a, b, c = [1] * 10, [2] * 6, [3] * 4                       # three prompts of 10, 6 and 4 tokens
    prompts = [a, b, a, c, b, a, c, a]
    replies = [30, 2, 25, 3, 5, 1, 2, 2]                       # prompt a's replies: 30 + 25 + 1 + 2 > the budget
    lengths = [len(p) + r for p, r in zip(prompts, replies, strict=True)]
    parts = MicroBatching(64, max_tokens=60).split(lengths, prompts=prompts)
    assert sorted(i for part in parts for i in part) == list(range(8))
    for part in parts:
        rows: dict[tuple, int] = {}
        for i in part:
            rows[tuple(prompts[i])] = rows.get(tuple(prompts[i]), len(prompts[i])) + replies[i]
        assert len(rows) * max(rows.values()) <= 60, (part, rows)
    together = [sorted(part) for part in parts if 1 in part]
    assert together and {1, 4} <= set(together[0]) and any({3, 6} <= set(p) for p in parts)  # b's, c's samples
    assert sum(any(prompts[i] == a for i in part) for part in parts) == 2   # a's replies: 10 + 30 + 25 > 60
    # trainer ranks: both shares cut into as many micro-batches
    shards = [(0, 4), (4, 8)]
    counts = {len(MicroBatching(64, 60).agreed(lengths, shards, r, prompts=prompts)) for r in (0, 1)}
    assert len(counts) == 1


def _grouped_samples(learner: Learner, groups: int = 4, per_group: int = 3) -> list:
    """`groups` prompts of 1..4 tokens, each with `per_group` replies of spread lengths (1..16 tokens), loss-mask
    holes, the prompt's temperature, behaviour logprobs near the policy's."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for g in range(groups):
        prompt = torch.randint(1, VOCAB, (1 + g % 4,), generator=gen).tolist()
        temp = [1.0, 0.7, 1.3][g % 3]
        for k in range(per_group):
            r_len = [1, 9, 3, 16, 2][(g + 2 * k) % 5]
            response = torch.randint(1, VOCAB, (r_len,), generator=gen).tolist()
            tf = torch.tensor(learner.teacher_forced_logprobs(prompt, response, temp))
            out.append(_traj(len(out), g, prompt, response,
                             loss_mask=(torch.rand(r_len, generator=gen) > 0.3).tolist(),
                             logprobs=(tf + 0.3 * torch.randn(r_len, generator=gen)).tolist(), temperature=temp,
                             reward=float(torch.rand((), generator=gen))))
    return out


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompts_give_the_padded_batchs_logprobs_entropy_and_gradients(attention) -> None:
    """The samples arrive interleaved (prompts of groups 0-3 in turn) and one prompt stands alone: each reply sees
    its prompt and itself at the padded row's positions, so every number equals the padded forward's."""
    model = _tiny_model().double()
    model.config._attn_implementation = attention
    assert attention_kind(model.config) == {"sdpa": "bool", "eager": "additive"}[attention]
    samples = _grouped_samples(_learner(False))
    samples = [samples[i] for i in (0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8)]          # sample 11 left out: 3 alone
    batch = collate(samples, torch.zeros(len(samples)), PAD)
    (want_lp, want_ent, want_grads), *others = logprob_passes(
        model, batch, ((token_logprobs, {}), (shared_prompt_logprobs, {}), (shared_prompt_logprobs, {"chunk": 5})))
    # eager attention's softmax runs in float32 (as the norm does, fixture), over keys in another order: there the
    # numbers agree to its rounding, where a wrong mask or position would be off by whole percents
    def close(got, want, atol):
        return torch.allclose(got, want, rtol=0, atol=atol) if attention == "sdpa" else \
            float((got - want).norm()) <= 1e-6 * float(want.norm())

    for lp, ent, grads in others:
        assert close(lp, want_lp, 1e-12) and close(ent, want_ent, 1e-12)
        assert all(close(g, w, 1e-10) for g, w in zip(grads, want_grads, strict=True))
    rows = share_prompts(batch.input_ids, batch.attention_mask, batch.response_mask)
    assert rows.input_ids.shape[0] == 4 and rows.tokens < int(batch.attention_mask.sum())


def test_a_model_whose_head_cannot_be_fused_reads_the_shared_rows_from_its_whole_head() -> None:
    """torch.compile or final-logit soft-capping keep the plain head: the shared forward computes every row's logits
    and reads the ones that predict a reply token (Qwen2 applies no soft-capping: the attribute only turns the
    fused head off here)."""
    from asyncrl.training.logprobs import _output_head

    model = _tiny_model().double()
    model.config.final_logit_softcapping = 30.0
    assert _output_head(model) is None
    samples = _grouped_samples(_learner(False))
    batch = collate(samples, torch.zeros(len(samples)), PAD)
    args = (model, batch.input_ids, batch.attention_mask, batch.response_mask, batch.temperature.double())
    (want, want_ent), (got, got_ent) = token_logprobs(*args), shared_prompt_logprobs(*args)
    assert torch.allclose(got, want, rtol=0, atol=1e-12) and torch.allclose(got_ent, want_ent, rtol=0, atol=1e-12)


def _learner(share: bool, budget: int = 0, **algorithm) -> Learner:
    trainer = TrainerConfig(lr=1e-2, grad_clip=0.5, micro_batch_size=64, mini_batches=2, epochs=2,
                            max_tokens_per_micro_batch=budget, share_prompts=share)
    return Learner(_tiny_model().double(), algorithm=AlgorithmConfig(**algorithm), trainer=trainer, pad_token_id=PAD,
                   max_new_tokens=24)


@pytest.mark.parametrize(("budget", "algorithm"), [
    (0, dict(loss_agg="token-mean", decoupled=True, correction="token_tis")),   # a proximal forward, shared too
    (40, dict(loss_agg="seq-mean-token-mean", entropy_coef=0.01)),              # prompts split over micro-batches
    (0, dict(loss_agg="seq-mean-token-sum-norm", policy_loss="gspo")),          # a sequence-level ratio
])
def test_steps_with_shared_prompts_train_the_weights_the_padded_steps_train(budget, algorithm) -> None:
    padded, shared = _learner(False, budget, **algorithm), _learner(True, budget, **algorithm)
    samples = _grouped_samples(padded)
    for _ in range(2):
        groups = [Group(group_id=g, min_version=0, trajectories=samples[3 * g : 3 * g + 3]) for g in range(4)]
        m_pad, m_shared = padded.update(groups), shared.update(groups)
        assert m_shared["trainer/loss"] == pytest.approx(m_pad["trainer/loss"], rel=1e-12, abs=1e-14)
        # the padded share is of the tokens each forward computed: the shared rows hold less padding
        assert m_shared["trainer/padded_share"] < m_pad["trainer/padded_share"]
    with torch.no_grad():
        worst = max(float((a - b).abs().max()) for a, b in zip(padded.model.parameters(), shared.model.parameters()))
    assert worst < 1e-12


def test_a_model_whose_attention_takes_no_mask_is_refused_at_construction() -> None:
    model = _tiny_model()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="share_prompts needs the policy's attention"):
        Learner(model, algorithm=AlgorithmConfig(), trainer=TrainerConfig(share_prompts=True), pad_token_id=PAD)


def test_the_config_refuses_what_cannot_run_beside_it() -> None:
    from asyncrl.config.schema import Config
    from asyncrl.training.sharing import check_config

    cfg = msgspec.convert({"model": {"path": "m"}, "data": {"path": "d"},
                           "trainer": {"share_prompts": True, "pack_sequences": True, "router_aux_loss_coef": 0.01},
                           "algorithm": {"routing_replay": "rollout"}}, Config)
    lines = check_config(cfg)
    assert len(lines) == 3 and all(line.startswith("trainer.share_prompts: true") for line in lines)
    assert "pack_sequences" in lines[0] and "routing_replay" in lines[1] and "router_aux_loss_coef" in lines[2]
