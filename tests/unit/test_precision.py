"""The trainer's numerics (asyncrl/training/precision.py): bf16 mixed precision keeps float32 master weights and
AdamW state while the forwards run in bfloat16; gradient checkpointing recomputes activations without changing
the loss, the gradients or generation on the shared module; the dtype of each copy follows the config."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.config.schema import AlgorithmConfig, CriticConfig, TrainerConfig
from asyncrl.messages import Group, SamplingParams, Trajectory
from asyncrl.training import precision
from asyncrl.training.critic import Critic, load_value_model
from asyncrl.training.learner import Learner
from asyncrl.training.reference import ReferencePolicy
from engines.torch_engine import TorchEngine

torch.set_num_threads(1)

PAD, VOCAB, EOS = 0, 24, 2
TINY_VOCAB = 16  # the conftest tiny model folder's: 4 special tokens + "0123456789+="


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _learner(model: torch.nn.Module | None = None, *, gradient_checkpointing: bool = False, **trainer) -> Learner:
    tcfg = TrainerConfig(**{"lr": 1e-2, "grad_clip": 0.0, "micro_batch_size": 4, **trainer})
    return Learner(model if model is not None else _model(), algorithm=AlgorithmConfig(), trainer=tcfg,
                   pad_token_id=PAD, gradient_checkpointing=gradient_checkpointing)


def _samples(n: int = 6, seed: int = 0, vocab: int = VOCAB) -> list[Trajectory]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (2 + i % 3,), generator=gen).tolist()
        response = torch.randint(3, vocab, (1 + i % 4,), generator=gen).tolist()
        out.append(Trajectory(seq_id=i, group_id=i // 2, group_size=2, prompt_ids=prompt, response_ids=response,
                              loss_mask=[True] * len(response), behavior_logprobs=[-3.0] * len(response),
                              versions=[0] * len(response), min_version=0, max_version=0, finish_reason="stop",
                              reward=float(i % 2)))
    return out


def _groups(trajs: list[Trajectory]) -> list[Group]:
    return [Group(group_id=g, min_version=0, trajectories=[t for t in trajs if t.group_id == g])
            for g in sorted({t.group_id for t in trajs})]


def _output_dtypes(module: torch.nn.Module) -> tuple[list[torch.dtype], torch.utils.hooks.RemovableHandle]:
    seen: list[torch.dtype] = []
    handle = module.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen, handle


# -- mixed precision ------------------------------------------------------------------------------

def test_bf16_mixed_precision_keeps_float32_weights_and_adam_state_while_the_forward_runs_in_bf16():
    learner = _learner(_model().to(torch.bfloat16), mixed_precision="bf16")  # loaded in bf16: made float32
    params = list(learner.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    before = [p.detach().clone() for p in params]
    seen, handle = _output_dtypes(learner.model.model.layers[0].mlp.down_proj)
    metrics = learner.update(_groups(_samples()))
    handle.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the matmuls ran under bf16 autocast
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, learner.model.parameters()))  # it trained
    state = [s for s in learner.optimizer.state.values()]
    assert state and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in state)
    assert torch.isfinite(torch.tensor(metrics["trainer/loss"]))


def test_bf16_logprobs_stay_float32_and_close_to_the_float32_forward():
    fp32, mixed = _learner(_model()), _learner(_model(), mixed_precision="bf16")
    t = _samples(1)[0]
    want = torch.tensor(fp32.teacher_forced_logprobs(t.prompt_ids, t.response_ids, 1.0))
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[0, len(t.prompt_ids):] = True
    with torch.no_grad():
        got, entropy = mixed.sequence_logprobs(ids, torch.ones_like(ids), resp, 1.0)
    assert got.dtype == entropy.dtype == torch.float32
    assert torch.allclose(got[0, len(t.prompt_ids):], want, atol=5e-2)
    assert not torch.equal(got[0, len(t.prompt_ids):], want)  # bf16 matmuls: close, not the same


def _sharp_model() -> torch.nn.Module:
    """`_model` with a real LM's logit scale (tens, where bf16 rounds a logit by up to 1/16), not a fresh one's."""
    model = _model()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def _float_head_logprobs(model: torch.nn.Module, ids: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
    """What trainer.lm_head_fp32 computes, by hand: the body under bf16 autocast, then hidden x head in float32."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    logits = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp[resp[:, 1:]]


@pytest.mark.parametrize("layout", [{}, {"logprob_chunk_tokens": 3}, {"pack_sequences": True},
                                    {"share_prompts": True}])
def test_under_bf16_the_lm_head_runs_in_float32_unless_turned_off(layout):
    """trainer.lm_head_fp32 (default on): the body's matmuls in bf16, the head's product in float32 — in every
    layout of the forward; off, the head's logits are bf16 and its logprobs are the rounded ones."""
    t = _samples(4)[3]                                         # 4 response tokens
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[0, len(t.prompt_ids):] = True
    want = _float_head_logprobs(_sharp_model(), ids, resp)
    for on in (True, False):
        learner = _learner(_sharp_model(), mixed_precision="bf16", lm_head_fp32=on, **layout)
        assert all(p.dtype == torch.float32 for p in learner.model.parameters())
        seen, handle = _output_dtypes(learner.model.lm_head)  # the plain head's logits (fused: its [n, 2] rows)
        with torch.no_grad():
            got, _ = learner.sequence_logprobs(ids, torch.ones_like(ids), resp, 1.0)
        handle.remove()
        got = got[0, resp[0].clone().index_fill_(0, torch.tensor([0]), False)]
        if not layout:
            assert set(seen) == {torch.float32 if on else torch.bfloat16}
        # packing's one row runs attention over other shapes: its bf16 body rounds elsewhere
        close = torch.allclose(got, want, atol=1e-2 if layout.get("pack_sequences") else 1e-5)
        assert close if on else not torch.allclose(got, want, atol=1e-3), (on, (got - want).abs().max())


def test_a_bf16_reference_runs_its_head_in_float32_on_its_upcast_weight(tiny_model_dir):
    """The frozen reference keeps bf16 weights under mixed precision; with lm_head_fp32 its head's product is
    float32 all the same (the weight upcast for it), as the policy's is."""
    trajs = _samples(3, vocab=TINY_VOCAB)
    got = {}
    for on in (True, False):
        ref = ReferencePolicy.load(str(tiny_model_dir), dtype="float32", pad_token_id=PAD, mixed_precision="bf16",
                                   lm_head_fp32=on)
        seen, handle = _output_dtypes(ref.model.lm_head)
        got[on] = ref.response_logprobs(trajs)
        handle.remove()
        assert ref.model.lm_head.weight.dtype == torch.bfloat16
        assert set(seen) == ({torch.float32} if on else {torch.bfloat16})
    for t, row in zip(trajs, got[True]):
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[0, len(t.prompt_ids):] = True
        want = _float_head_logprobs(ref.model, ids, resp)
        assert torch.allclose(torch.tensor(row), want, atol=1e-5)


def test_bf16_on_a_cpu_that_only_emulates_it_warns_once(monkeypatch, caplog):
    """bf16 pays on a CPU with AVX512-BF16 or AMX; elsewhere its products are emulated (slower than float32): one
    warning naming the settings, not an error (the run is still correct)."""
    precision._warn_once.cache_clear()
    for native in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda native=native: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        caplog.clear()
        for _ in range(2):
            precision.check_autocast(torch.device("cpu"), torch.bfloat16)
            precision.check_autocast(torch.device("cpu"), None)
        warned = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
        assert len(warned) == (0 if native else 1), warned
    assert "trainer.mixed_precision" in warned[0] and "rollout.dtype" in warned[0]
    precision._warn_once.cache_clear()


def test_mixed_precision_no_keeps_the_model_in_its_own_dtype():
    learner = _learner(_model().to(torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in learner.model.parameters())
    seen, handle = _output_dtypes(learner.model.model.layers[0].mlp.down_proj)
    learner.update(_groups(_samples()))
    handle.remove()
    assert set(seen) == {torch.bfloat16}


def test_the_critic_trains_float32_weights_under_bf16_autocast_with_gradient_checkpointing(tiny_model_dir):
    critic = Critic(load_value_model(str(tiny_model_dir), "bfloat16"), CriticConfig(lr=1e-2), pad_token_id=PAD,
                    micro_batch_size=4, mixed_precision="bf16", gradient_checkpointing=True)
    assert precision.checkpointed_modules(critic.model)
    assert all(p.dtype == torch.float32 for p in critic.model.parameters())
    trajs = _samples(vocab=TINY_VOCAB)
    width = max(len(t.response_ids) for t in trajs)
    seen, handle = _output_dtypes(critic.model.score)
    values = critic.values(trajs, width)
    assert values.dtype == torch.float32 and set(seen) == {torch.bfloat16}
    before = [p.detach().clone() for p in critic.model.parameters()]
    from asyncrl.training.critic import CriticStats

    stats = CriticStats()
    critic.compute_gradients(trajs, values, values + 1.0, stats)
    critic.step(stats)
    handle.remove()
    assert any(not torch.equal(b, p) for b, p in zip(before, critic.model.parameters()))
    assert all(p.dtype == torch.float32 for p in critic.model.parameters())


def test_the_reference_loads_in_bf16_under_mixed_precision_and_runs_under_autocast(tiny_model_dir):
    ref = ReferencePolicy.load(str(tiny_model_dir), dtype="float32", pad_token_id=PAD, mixed_precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in ref.model.parameters())
    fp32 = ReferencePolicy.load(str(tiny_model_dir), dtype="float32", pad_token_id=PAD)
    assert all(p.dtype == torch.float32 for p in fp32.model.parameters())
    trajs = _samples(3, vocab=TINY_VOCAB)
    got, want = ref.response_logprobs(trajs), fp32.response_logprobs(trajs)
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=5e-2)


def test_the_dtype_of_each_copy_follows_model_dtype_rollout_dtype_and_mixed_precision():
    assert precision.master_dtype("bfloat16", "bf16") == "float32"
    assert precision.master_dtype("bfloat16", "no") == "bfloat16"
    assert precision.reference_dtype("float32", "bf16") == "bfloat16"
    assert precision.reference_dtype("float16", "no") == "float16"
    assert precision.engine_dtype("float32", "auto") == "float32"
    assert precision.engine_dtype("float32", "bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="trainer.mixed_precision"):
        precision.autocast_dtype("fp8")


def test_rollout_lm_head_fp32_reaches_the_native_engines_only(make_config, tiny_model_dir):
    """rollout.lm_head_fp32 (default on) is a keyword of the engines that take it (EngineTraits.fp32_head): the
    native engine's fast path on bf16 weights then keeps a float32 head; vLLM and SGLang are not given it."""
    from asyncrl.deploy.build import head_options

    cfg = make_config('rollout.dtype="bfloat16"')
    assert head_options(cfg) == {"lm_head_fp32": True}
    assert head_options(cfg, "vllm") == head_options(cfg, "sglang") == {}
    assert head_options(make_config('rollout.dtype="bfloat16"', "rollout.lm_head_fp32=false")) == {}
    for options, on in ((head_options(cfg), True), ({}, False)):
        engine = TorchEngine(str(tiny_model_dir), dtype="bfloat16", **options)
        try:
            assert engine.scheduler.backend.fp32_head is on
        finally:
            asyncio.run(engine.close())


def test_a_model_without_gradient_checkpointing_support_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match="model.gradient_checkpointing: .*set it to false"):
        precision.enable_gradient_checkpointing(torch.nn.Linear(2, 2))


# -- gradient checkpointing -----------------------------------------------------------------------

def _grads(learner: Learner, trajs: list[Trajectory]) -> tuple[float, list[torch.Tensor]]:
    learner.optimizer.zero_grad(set_to_none=True)
    stats = learner.compute_gradients(trajs, torch.linspace(-1, 1, len(trajs)))
    return stats.loss, [p.grad.clone() for p in learner.model.parameters()]


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_gradient_checkpointing_recomputes_activations_and_leaves_loss_and_gradients_unchanged(mixed_precision):
    plain = _learner(_model(), mixed_precision=mixed_precision)
    ckpt = _learner(_model(), gradient_checkpointing=True, mixed_precision=mixed_precision)
    trajs = _samples()
    calls: dict[str, int] = {}
    for name, learner in (("plain", plain), ("ckpt", ckpt)):
        mlp = learner.model.model.layers[0].mlp
        forward = mlp.forward  # counted by wrapping it (the recompute does not run the module's forward hooks)

        def counted(*args, name=name, forward=forward, **kwargs):
            calls[name] += 1
            return forward(*args, **kwargs)

        calls[name] = 0
        mlp.forward = counted
        loss, grads = _grads(learner, trajs)
        del mlp.forward
        if name == "plain":
            want_loss, want_grads = loss, grads
    micro_batches = -(-len(trajs) // 4)
    assert calls == {"plain": micro_batches, "ckpt": 2 * micro_batches}  # forward, then recomputed in backward
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-7)
    # outside the gradient pass the module is back in eval mode everywhere (no dropout, no checkpointing)
    assert not any(m.training for m in ckpt.model.modules())


@pytest.mark.parametrize("fast", [True, False])
def test_generation_on_a_gradient_checkpointed_trainer_module_matches_the_plain_one(fast):
    plain = _learner(_model())
    ckpt = _learner(_model(), gradient_checkpointing=True)
    trajs = _samples()
    _grads(ckpt, trajs)  # a gradient pass first: it must leave nothing behind that generation trips on
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True)

    async def generate(learner: Learner) -> tuple[list[list[int]], torch.Tensor]:
        engine = TorchEngine.from_model(learner.model, eos_token_ids=[EOS], fast=fast)
        try:
            out = [c for group in await engine.generate([[5, 6, 7, 8, 9, 10], [8, 9]], params) for c in group]
            return [c.response_ids for c in out], torch.tensor([c.logprobs for c in out])
        finally:
            await engine.close()

    (got, got_lp), (want, want_lp) = asyncio.run(generate(ckpt)), asyncio.run(generate(plain))
    assert got == want and all(len(r) == 6 for r in got)
    assert torch.allclose(got_lp, want_lp, atol=1e-5)  # every step saw the whole context (its KV cache)


def test_evaluation_runs_in_the_engines_dtype_on_a_copy_refreshed_from_the_master_weights(make_config):
    """bf16 rollouts of float32 master weights: the trainer's evaluation generates with a bf16 copy of the policy
    (the policy as the generators run it, at their speed), refreshed from the masters before each evaluation; with
    one dtype on both sides, or with LoRA, it evaluates the trainer's own module."""
    from asyncrl.deploy.build import build_buffer, build_trainer

    cfg = make_config('trainer.mixed_precision="bf16"', 'rollout.dtype="bfloat16"')
    trainer = build_trainer(cfg, build_buffer(cfg))
    master = trainer.learner.model
    assert trainer.eval_model is not None and trainer.evaluator is not None
    assert {p.dtype for p in trainer.eval_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    assert trainer.evaluator.engine.model is trainer.eval_model
    with torch.no_grad():
        for p in master.parameters():
            p.add_(0.25)  # what a train step would do: the copy must follow before the next evaluation
    out = asyncio.run(trainer.evaluate())
    assert "eval/greedy_reward" in out
    for (name, a), b in zip(master.named_parameters(), trainer.eval_model.parameters(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b), name
    # between evaluations the engine sleeps: its K/V cache is the trainer's memory again; the next one wakes it
    engine = trainer.evaluator.engine
    assert engine.asleep and engine.scheduler.backend.slots == 0
    assert asyncio.run(trainer.evaluate()) == out and engine.asleep  # the same policy, the same greedy replies
    for overrides in ((), ('trainer.mixed_precision="bf16"',), ('trainer.mixed_precision="bf16"',
                                                                  'rollout.dtype="bfloat16"', "model.lora.rank=4")):
        cfg = make_config(*overrides)
        assert build_trainer(cfg, build_buffer(cfg)).eval_model is None, overrides
