"""The train step's speed-ups leave its results unchanged: each is compared with the straightforward code it
replaced (benchmarks/train_step.py measures what each one saves)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algorithms import entropy_from_logits
from asyncrl.messages import Group, Trajectory
from asyncrl.training import schedule
from asyncrl.training.batch import collate, gather_response, response_rows
from asyncrl.training.logprobs import _takes_logits_to_keep, token_logprobs
from asyncrl.training.optim import match_fused
from tests.unit.test_learner import PAD, VOCAB, _learner, _traj

torch.set_num_threads(1)


def _samples(n: int = 9, seed: int = 0) -> list[Trajectory]:
    """Ragged prompts and responses (one empty), loss masks with holes, placeholder logprobs on masked tokens."""
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        p_len, r_len = 1 + i % 4, (0 if i == 3 else 1 + (5 * i) % 7)
        mask = (torch.rand(r_len, generator=gen) > 0.3).tolist()
        trajs.append(_traj(i, i // 3, torch.randint(1, VOCAB, (p_len,), generator=gen).tolist(),
                           torch.randint(1, VOCAB, (r_len,), generator=gen).tolist(), loss_mask=mask,
                           logprobs=torch.randn(r_len, generator=gen).tolist(),
                           versions=torch.randint(0, 3, (r_len,), generator=gen).tolist(),
                           temperature=[1.0, 0.7][i % 2]))
    return trajs


def _loop_collate(trajectories, advantages, pad_token_id, extras):
    """The per-sample collate the vectorised one replaced (kept here as the reference)."""
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    b, width = len(trajectories), max(lengths)
    out = {"input_ids": torch.full((b, width), pad_token_id, dtype=torch.long),
           "attention_mask": torch.zeros((b, width), dtype=torch.long),
           "response_mask": torch.zeros((b, width), dtype=torch.bool),
           "loss_mask": torch.zeros((b, width), dtype=torch.bool),
           "old_logprobs": torch.zeros((b, width)), "advantages": torch.zeros((b, width)),
           "versions": torch.full((b, width), -1, dtype=torch.long)}
    ex = {k: torch.zeros((b, width), dtype=v.dtype) for k, v in extras.items()}
    for i, t in enumerate(trajectories):
        p, n = len(t.prompt_ids), len(t.response_ids)
        out["input_ids"][i, : p + n] = torch.tensor(t.prompt_ids + t.response_ids)
        out["attention_mask"][i, : p + n] = 1
        out["response_mask"][i, p : p + n] = True
        if n:
            lm = torch.tensor(t.loss_mask, dtype=torch.bool)
            out["loss_mask"][i, p : p + n] = lm
            out["old_logprobs"][i, p : p + n] = torch.where(lm, torch.tensor(t.behavior_logprobs), 0.0)
            out["versions"][i, p : p + n] = torch.tensor(t.versions)
            out["advantages"][i, p : p + n] = advantages[i] if advantages.dim() == 1 else advantages[i, :n]
            for k, v in extras.items():
                ex[k][i, p : p + n] = v[i, :n]
    return out, ex


def test_vectorised_collate_builds_the_same_batch_as_the_per_sample_loop():
    trajs = _samples()
    gen = torch.Generator().manual_seed(1)
    width = max(len(t.response_ids) for t in trajs) + 2   # rows wider than the longest response, as in a step
    extras = {"prox": torch.randn(len(trajs), width, generator=gen), "keep": torch.rand(len(trajs), width) > 0.5}
    for adv in (torch.randn(len(trajs), generator=gen), torch.randn(len(trajs), width, generator=gen)):
        batch = collate(trajs, adv, PAD, extras=extras)
        want, want_extras = _loop_collate(trajs, adv, PAD, extras)
        for name, tensor in want.items():
            assert torch.equal(getattr(batch, name), tensor), name
        for name, tensor in want_extras.items():
            assert torch.equal(batch.extras[name], tensor), name
        assert torch.equal(batch.temperature, torch.tensor([t.temperature for t in trajs]))


def test_response_rows_and_gather_response_match_the_per_sample_loop():
    trajs = _samples()
    rows, mask = response_rows(trajs)
    for i, t in enumerate(trajs):
        n = len(t.response_ids)
        assert rows[i, :n].tolist() == torch.tensor(t.behavior_logprobs).tolist() and not rows[i, n:].any()
        assert mask[i, :n].tolist() == t.loss_mask and not mask[i, n:].any()
    batch = collate(trajs, torch.zeros(len(trajs)), PAD)
    values = torch.randn(batch.input_ids.shape)
    got = gather_response(batch, trajs, values, rows.shape[1] + 1)
    for i, t in enumerate(trajs):
        p, n = len(t.prompt_ids), len(t.response_ids)
        assert torch.equal(got[i, :n], values[i, p : p + n]) and not got[i, n:].any()


def _groups(trajs: list[Trajectory], seed: int) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    trajs = [t for t in trajs if t.response_ids]
    for i, t in enumerate(trajs):
        t.reward, t.group_id = float(torch.rand((), generator=gen)), i // 4
    return [Group(group_id=g, min_version=0, trajectories=trajs[4 * g : 4 * g + 4])
            for g in range((len(trajs) + 3) // 4)]


def _float64_learner(**trainer_kw):
    learner = _learner(grad_clip=1.0, micro_batch_size=3, **trainer_kw)
    learner.model.double()
    return learner


def _use_default_adamw(learner) -> None:
    """The optimizer the learner had before: torch's default AdamW (a per-parameter loop on CPU)."""
    t = learner.trainer
    learner.optimizer = torch.optim.AdamW(learner._params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    learner.scheduler = schedule.build_scheduler(learner.optimizer, t)


def test_the_learner_steps_with_fused_adamw_to_the_weights_of_the_default_adamw():
    fused, default = _float64_learner(mini_batches=2), _float64_learner(mini_batches=2)
    _use_default_adamw(default)
    assert fused.optimizer.param_groups[0]["fused"] and not default.optimizer.param_groups[0]["fused"]
    for step in range(3):
        groups = _groups(_samples(13, seed=step), seed=step)
        fused.update(groups)
        default.update(groups)
    for a, b in zip(fused.model.parameters(), default.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_a_default_adamw_checkpoint_resumes_fused_with_the_same_next_step():
    writer, fused = _float64_learner(), _float64_learner()
    _use_default_adamw(writer)
    groups = _groups(_samples(13), seed=0)
    writer.update(groups)
    tensors, state = writer.checkpoint_state()
    # (the state holds the writer's own tensors, as a save reads them: copies, as a load gives)
    fused.restore_state({k: {n: t.clone() for n, t in group.items()} for k, group in tensors.items()}, state)
    assert fused.optimizer.param_groups[0]["fused"] is True
    writer.update(groups)
    fused.update(groups)
    for a, b in zip(fused.model.parameters(), writer.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_match_fused_leaves_fused_off_where_a_parameter_has_no_fused_kernel(monkeypatch):
    from torch.utils import _foreach_utils

    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([p], fused=True)
    monkeypatch.setattr(_foreach_utils, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    match_fused(optimizer)
    assert optimizer.param_groups[0]["fused"] is None


def _full_vocab_logprobs(model, input_ids, attention_mask, response_mask, temperature):
    """The computation over every position's logits that the response-only one replaced (the reference)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1] / temperature.reshape(-1, 1, 1)
    tok = logits.gather(-1, input_ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, dim=-1)
    zero = tok.new_zeros(tok.shape[0], 1)
    logprobs, entropy = torch.cat([zero, tok], 1), torch.cat([zero, entropy_from_logits(logits)], 1)
    return torch.where(response_mask, logprobs, 0.0), torch.where(response_mask, entropy, 0.0)


class _NoKeywords(torch.nn.Module):
    """A causal LM whose forward takes no `logits_to_keep`."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_logprobs_and_entropy_from_the_response_rows_equal_the_full_vocabulary_computation():
    """The whole head from the earliest response column (logits_to_keep), the whole head over every column, and the
    head fused with the log-softmax in chunks of 3 rows (recomputed in the backward) give the full-vocabulary
    computation's logprobs, entropy and gradients."""
    model = _learner().model.double()
    trajs = [t for t in _samples(9) if t.response_ids]
    batch = collate(trajs, torch.zeros(len(trajs)), PAD)
    assert _takes_logits_to_keep(model) and not _takes_logits_to_keep(_NoKeywords(model))
    results = []
    for fn in (_full_vocab_logprobs, token_logprobs, lambda m, *a, **k: token_logprobs(_NoKeywords(m), *a, **k),
               lambda m, *a, **k: token_logprobs(m, *a, chunk=3, **k)):
        model.zero_grad(set_to_none=True)
        kw = {} if fn is _full_vocab_logprobs else {"entropy_grad": True}
        logprobs, entropy = fn(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                               batch.temperature.double(), **kw)
        (logprobs.sum() + entropy.sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (want_lp, want_ent, want_grads), *others = results
    assert "forward" not in vars(model.lm_head)  # the fused head is gone after its forward
    for lp, ent, grads in others:
        assert lp.shape == want_lp.shape and lp[batch.response_mask].ne(0).all()
        assert torch.allclose(lp, want_lp, rtol=0, atol=1e-12) and torch.allclose(ent, want_ent, rtol=0, atol=1e-12)
        for g, want in zip(grads, want_grads, strict=True):
            assert torch.allclose(g, want, rtol=0, atol=1e-10)


def test_the_fused_finite_check_names_the_first_non_finite_parameter_and_passes_huge_finite_ones():
    learner = _learner()
    params = dict(learner.model.named_parameters())
    with torch.no_grad():
        params["model.norm.weight"].fill_(3e38)  # finite, but its sum overflows: the exact check clears it
    learner._check_finite()
    with torch.no_grad():
        params["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="model.layers.1.mlp.up_proj.weight is not finite"):
        learner._check_finite()


@pytest.mark.parametrize("algorithm", [
    dict(decoupled=True),
    dict(decoupled=True, correction="token_tis", entropy_coef=0.01),
    dict(correction="seq_mask", correction_low=0.9, correction_high=1.1),
    dict(decoupled=True, correction="token_mask", kl_mode="reward", kl_coef=0.1),
], ids=["decoupled", "decoupled-token-tis-entropy", "seq-mask", "decoupled-token-mask-kl-reward"])
def test_proximal_logprobs_from_the_gradient_pass_give_the_two_forward_step(algorithm):
    from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
    from asyncrl.training.learner import Learner
    from tests.unit.test_learner import _tiny_model

    def learner():
        model = _tiny_model().double()
        return Learner(model, algorithm=AlgorithmConfig(**algorithm),
                       trainer=TrainerConfig(lr=1e-2, grad_clip=1.0, micro_batch_size=16), pad_token_id=PAD)

    one, two = learner(), learner()
    two._prox_from_first_pass = lambda n: False  # the proximal forward of its own, as before
    forwards = {"one": 0, "two": 0}
    for name, lrn in (("one", one), ("two", two)):
        lrn.model.register_forward_hook(lambda *a, name=name: forwards.__setitem__(name, forwards[name] + 1))
    for step in range(3):
        trajs = _samples(13, seed=step)
        for t in trajs:  # behaviour logprobs near the policy's, so corrections clip and mask some tokens
            t.behavior_logprobs = [x * 0.05 - 3.2 for x in t.behavior_logprobs]
            t.ref_logprobs = [-3.0] * len(t.response_ids)
        groups = _groups(trajs, seed=step)
        got, want = one.update(groups), two.update(groups)
        assert got.keys() == want.keys()
        for key in got:
            if key != "trainer/step_s":
                assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
    assert forwards == {"one": 3, "two": 6}
    for a, b in zip(one.model.parameters(), two.model.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("trainer", [dict(mini_batches=2), dict(epochs=2), dict(micro_batch_size=4)])
def test_the_proximal_forward_stays_where_the_gradient_pass_is_not_the_steps_only_one(trainer):
    from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
    from asyncrl.training.learner import Learner
    from tests.unit.test_learner import _tiny_model

    cfg = TrainerConfig(**{"micro_batch_size": 16, **trainer})
    learner = Learner(_tiny_model(), algorithm=AlgorithmConfig(decoupled=True), trainer=cfg, pad_token_id=PAD)
    samples = [_traj(i, 0, [5] * 3, [6] * 4) for i in range(12)]
    assert not learner._prox_from_first_pass(samples)
    assert Learner(_tiny_model(), algorithm=AlgorithmConfig(), trainer=TrainerConfig(micro_batch_size=16),
                   pad_token_id=PAD)._prox_from_first_pass(samples) is False  # no proximal policy at all
