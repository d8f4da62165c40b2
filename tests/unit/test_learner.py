"""Learner: micro-batching leaves the gradient unchanged, padding leaves logprobs unchanged, it learns."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
from asyncrl.messages import Group, Trajectory
from asyncrl.training.learner import Learner, collate

torch.set_num_threads(1)

PAD = 0
VOCAB = 24
METRIC_KEYS = {
    "trainer/loss", "trainer/grad_norm", "trainer/clip_frac", "trainer/entropy", "trainer/approx_kl",
    "trainer/logprob_gap", "trainer/logprob_gap_tokens", "trainer/logprob_diff", "trainer/ratio_mean",
    "trainer/ratio_max",
    "trainer/response_len", "trainer/truncation_rate", "trainer/reward_mean", "trainer/reward_std",
    "trainer/adv_abs_mean", "trainer/tokens", "trainer/samples", "trainer/padded_share", "trainer/optimizer_steps",
    "trainer/skipped_steps",
    "trainer/step_s", "trainer/lr",
    # the off-policy ratio distribution is logged every step, whatever the algorithm
    "offpolicy/is_ratio_mean", "offpolicy/is_ratio_max", "offpolicy/is_ratio_min", "offpolicy/share_clipped",
    "offpolicy/share_masked",
}


def _tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(cfg)


def _learner(seed: int = 0, **trainer_kw) -> Learner:
    trainer = TrainerConfig(**{"lr": 1e-3, "grad_clip": 0.0, "micro_batch_size": 64, **trainer_kw})
    return Learner(_tiny_model(seed), algorithm=AlgorithmConfig(), trainer=trainer, pad_token_id=PAD)


def _traj(seq_id: int, group_id: int, prompt: list[int], response: list[int], *, loss_mask=None,
          logprobs=None, versions=None, reward: float = 0.0, temperature: float = 1.0, **kw) -> Trajectory:
    n = len(response)
    versions = versions if versions is not None else [0] * n
    return Trajectory(
        seq_id=seq_id, group_id=group_id, group_size=1, prompt_ids=prompt, response_ids=response,
        loss_mask=loss_mask if loss_mask is not None else [True] * n,
        behavior_logprobs=logprobs if logprobs is not None else [-1.0] * n,
        versions=versions, min_version=min(versions, default=0), max_version=max(versions, default=0),
        finish_reason=kw.pop("finish_reason", "stop"), reward=reward, temperature=temperature, **kw,
    )


def _ragged_samples(learner: Learner, n: int = 8, seed: int = 0) -> tuple[list[Trajectory], torch.Tensor]:
    """n samples of different prompt/response lengths, loss masks with holes, temperatures, and
    behaviour logprobs near the current policy's (so some ratios are clipped, most are not)."""
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        p_len, r_len = 1 + i % 4, 1 + (7 * i) % 11
        prompt = torch.randint(1, VOCAB, (p_len,), generator=gen).tolist()
        response = torch.randint(1, VOCAB, (r_len,), generator=gen).tolist()
        loss_mask = (torch.rand(r_len, generator=gen) > 0.3).tolist()
        temp = [1.0, 0.7, 1.3][i % 3]
        tf = torch.tensor(learner.teacher_forced_logprobs(prompt, response, temp))
        logprobs = (tf + 0.3 * torch.randn(r_len, generator=gen)).tolist()
        trajs.append(_traj(i, i // 2, prompt, response, loss_mask=loss_mask, logprobs=logprobs, temperature=temp))
    return trajs, torch.randn(n, generator=gen)


def _grads(learner: Learner, trajs, adv, micro_batch_size: int) -> list[torch.Tensor]:
    learner.optimizer.zero_grad(set_to_none=True)
    learner.compute_gradients(trajs, adv, micro_batch_size=micro_batch_size)
    return [p.grad.clone() for p in learner.model.parameters()]


def test_token_mean_gradient_is_the_same_for_1_and_4_micro_batches() -> None:
    learner = _learner()
    trajs, adv = _ragged_samples(learner)
    tokens_per_micro = [sum(sum(t.loss_mask) for t in trajs[i : i + 2]) for i in range(0, 8, 2)]
    assert len(set(tokens_per_micro)) > 1, "micro-batches must differ in loss tokens for this test to bite"

    full = _grads(learner, trajs, adv, micro_batch_size=8)
    accumulated = _grads(learner, trajs, adv, micro_batch_size=2)
    for g_full, g_acc in zip(full, accumulated):
        assert torch.allclose(g_full, g_acc, rtol=1e-4, atol=1e-6)

    # The mean of per-micro-batch token means is a different gradient: the test above can fail.
    parts = [_grads(learner, trajs[i : i + 2], adv[i : i + 2], micro_batch_size=2) for i in range(0, 8, 2)]
    mean_of_means = [sum(gs) / 4 for gs in zip(*parts)]
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(mean_of_means, full))
    assert worst > 1e-2


def test_sequence_logprobs_with_right_padding_equal_unpadded_forwards() -> None:
    learner = _learner()
    trajs, _ = _ragged_samples(learner, n=5)
    batch = collate(trajs, torch.zeros(5), PAD)
    with torch.no_grad():
        logprobs, entropy = learner.sequence_logprobs(batch.input_ids, batch.attention_mask, batch.response_mask,
                                                      batch.temperature)
    assert batch.attention_mask.eq(0).any(), "the batch must contain padding"
    for i, t in enumerate(trajs):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = learner.model(input_ids=ids).logits[0].float() / t.temperature
        logp_all = torch.log_softmax(logits[:-1], dim=-1)
        p = len(t.prompt_ids)
        want = logp_all[p - 1 :].gather(-1, ids[0, p:, None]).squeeze(-1)
        got = logprobs[i, p : p + len(t.response_ids)]
        assert torch.allclose(got, want, atol=1e-5)
        assert torch.allclose(
            torch.tensor(learner.teacher_forced_logprobs(t.prompt_ids, t.response_ids, t.temperature)), want, atol=1e-5
        )
        want_ent = -(logp_all[p - 1 :].exp() * logp_all[p - 1 :]).sum(-1)
        assert torch.allclose(entropy[i, p : p + len(t.response_ids)], want_ent, atol=1e-5)
    assert (logprobs[~batch.response_mask] == 0).all()


def _sample_bandit_group(
    learner: Learner, prompt: list[int], target: int, n: int, gen: torch.Generator, group_id: int
) -> Group:
    with torch.no_grad():
        logits = learner.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    tokens = torch.multinomial(logp.exp(), n, replacement=True, generator=gen).tolist()
    trajs = [
        _traj(group_id * n + i, group_id, prompt, [tok], logprobs=[float(logp[tok])],
              versions=[learner.version], reward=float(tok == target))
        for i, tok in enumerate(tokens)
    ]
    return Group(group_id=group_id, min_version=learner.version, trajectories=trajs)


def test_update_raises_the_reward_of_a_one_token_bandit() -> None:
    learner = _learner(lr=2e-2, grad_clip=1.0)
    prompt, target = [3, 4, 5], 7
    gen = torch.Generator().manual_seed(0)

    def p_target() -> float:
        return math.exp(learner.teacher_forced_logprobs(prompt, [target], 1.0)[0])

    p0 = p_target()
    for step in range(30):
        metrics = learner.update([_sample_bandit_group(learner, prompt, target, 16, gen, step)])
        assert metrics["trainer/logprob_gap_tokens"] == 16  # every token on-policy
        assert metrics["trainer/logprob_gap"] < 1e-4
    assert p0 < 0.15
    assert p_target() > 0.8
    assert learner.version == 30


def test_update_reports_every_metric_finite_and_counts_optimizer_steps() -> None:
    learner = _learner(mini_batches=2, epochs=3, micro_batch_size=3, grad_clip=0.5)
    trajs, _ = _ragged_samples(learner)
    trajs = [_traj(t.seq_id, t.group_id, t.prompt_ids, t.response_ids, loss_mask=t.loss_mask,
                   logprobs=t.behavior_logprobs, temperature=t.temperature, reward=float(i % 3), truncated=i < 2)
             for i, t in enumerate(trajs)]
    metrics = learner.update([Group(group_id=0, min_version=0, trajectories=trajs)])
    assert set(metrics) == METRIC_KEYS
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["trainer/optimizer_steps"] == 6 and metrics["trainer/skipped_steps"] == 0
    assert metrics["trainer/samples"] == 8
    assert metrics["trainer/tokens"] == sum(sum(t.loss_mask) for t in trajs)
    assert metrics["trainer/truncation_rate"] == pytest.approx(2 / 8)
    assert metrics["trainer/response_len"] == pytest.approx(sum(len(t.response_ids) for t in trajs) / 8)
    assert metrics["trainer/approx_kl"] > 0 and metrics["trainer/logprob_gap"] > 0  # behaviour was perturbed
    assert metrics["trainer/grad_norm"] > 0
    assert learner.version == 1


def test_logprob_gap_counts_only_tokens_of_the_learners_current_version_and_diff_every_token() -> None:
    learner = _learner()
    prompt, response = [1, 2], [3, 4, 5]
    exact = learner.teacher_forced_logprobs(prompt, response, 1.0)
    stale = _traj(0, 0, prompt, response, logprobs=[x - 1.0 for x in exact], versions=[-5, -5, -5], reward=1.0)
    fresh = _traj(1, 0, prompt, response, logprobs=exact, versions=[0, 0, -5], reward=0.0)
    metrics = learner.update([Group(group_id=0, min_version=-5, trajectories=[stale, fresh])])
    assert metrics["trainer/logprob_gap_tokens"] == 2
    assert metrics["trainer/logprob_gap"] < 1e-5
    # every token: the stale sample's three are 1.0 off, the fresh one's last (stale) is exact too
    assert metrics["trainer/logprob_diff"] == pytest.approx(3.0 / 6, abs=1e-5)

    only_stale = _traj(2, 1, prompt, response, versions=[0, 0, 0])  # version 0 < learner's version 1
    metrics = learner.update([Group(group_id=1, min_version=0, trajectories=[only_stale, only_stale])])
    assert metrics["trainer/logprob_gap_tokens"] == 0 and metrics["trainer/logprob_gap"] == 0.0


def test_error_and_greedy_trajectories_are_rejected_before_training() -> None:
    learner = _learner()
    before = [p.clone() for p in learner.model.parameters()]
    ok = _traj(0, 0, [1], [2], reward=1.0)
    failed = _traj(1, 0, [1], [], finish_reason="error", error="env crashed")
    with pytest.raises(ValueError, match="finish_reason='error'"):
        learner.update([Group(group_id=0, min_version=0, trajectories=[ok, failed])])
    greedy = _traj(2, 0, [1], [2], temperature=0.0)
    with pytest.raises(ValueError, match="greedy"):
        learner.update([Group(group_id=0, min_version=0, trajectories=[ok, greedy])])
    assert learner.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))


def test_unknown_algorithm_names_fail_at_construction() -> None:
    with pytest.raises(KeyError, match="ppo_clip"):
        Learner(_tiny_model(), algorithm=AlgorithmConfig(policy_loss="nope"), trainer=TrainerConfig(), pad_token_id=PAD)


def test_state_dict_for_sync_holds_parameters_and_persistent_buffers_detached() -> None:
    learner = _learner()
    sd = learner.state_dict_for_sync()
    names = [n for n, _ in learner.model.named_parameters()]
    assert set(names) <= set(sd)
    assert not any("inv_freq" in n for n in sd)  # rotary cache is a non-persistent buffer
    assert set(sd) <= set(learner.model.state_dict())
    assert all(not t.requires_grad for t in sd.values())
    param = dict(learner.model.named_parameters())[names[0]]
    assert sd[names[0]].data_ptr() == param.data_ptr()  # a view, not a copy


def test_steps_with_only_non_finite_gradients_are_counted_and_stop_the_run_after_max_skipped_steps() -> None:
    learner = _learner(max_skipped_steps=2)
    trajs, _ = _ragged_samples(learner)
    group = Group(group_id=0, min_version=0, trajectories=trajs)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    real = learner.compute_gradients

    def nan_gradients(*args, **kwargs):
        real(*args, **kwargs)
        for p in learner.model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))

    learner.compute_gradients = nan_gradients
    assert learner.update([group])["trainer/skipped_steps"] == 1  # counted, the weights untouched
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    with pytest.raises(RuntimeError, match="2 train steps in a row had only non-finite gradient norms"):
        learner.update([group])
    learner.compute_gradients = real
    learner.skipped_in_a_row = 0
    assert learner.update([group])["trainer/skipped_steps"] == 0


def test_weights_that_are_not_finite_are_never_broadcast() -> None:
    learner = _learner()
    trajs, _ = _ragged_samples(learner)
    with torch.no_grad():
        next(learner.model.parameters()).fill_(float("inf"))
    with pytest.raises(RuntimeError, match="is not finite after the update"):
        learner.update([Group(group_id=0, min_version=0, trajectories=trajs)])
    assert learner.version == 0  # no new version to send
