"""LoRA through peft (asyncrl/training/lora.py): only the adapters train, the engines get the merged weights, the
checkpoint holds the adapter and the export both the merged model and the adapter; the LR schedule follows
transformers.get_scheduler and resumes; run.export_dtype writes the dtype asked."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

pytest.importorskip("peft")

from asyncrl.checkpoints import store as checkpoint  # noqa: E402
from asyncrl.config import ConfigError, config_from_dict  # noqa: E402
from asyncrl.config.schema import AlgorithmConfig, LoraConfig, TinyModelConfig, TrainerConfig  # noqa: E402
from asyncrl.deploy.build import export_dtype  # noqa: E402
from asyncrl.messages import Group, SamplingParams, Trajectory  # noqa: E402
from asyncrl.roles.trainer import Trainer  # noqa: E402
from asyncrl.training import lora  # noqa: E402
from asyncrl.training.learner import Learner  # noqa: E402
from engines import hf  # noqa: E402
from engines.torch_engine import TorchEngine  # noqa: E402
from engines.torch_model import unsupported_reason  # noqa: E402

torch.set_num_threads(1)

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama (untied LM head) written offline."""
    path = tmp_path_factory.mktemp("lora") / "tiny-llama"
    hf.build_tiny_model(path, TinyModelConfig(arch="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                              intermediate_size=64, vocab="0123456789+=", init_std=0.2))
    return path


def _policy(path: Path, **lora_kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return lora.apply_lora(hf.load_model(path), LoraConfig(**{"rank": 4, "alpha": 8.0, **lora_kw}))


def _learner(path: Path, *, sync_all_weights: bool = False, **trainer_kw) -> Learner:
    trainer = TrainerConfig(**{"lr": 5e-2, "grad_clip": 1.0, "micro_batch_size": 8, "total_steps": 4, **trainer_kw})
    return Learner(_policy(path), algorithm=AlgorithmConfig(), trainer=trainer, pad_token_id=hf.PAD_ID,
                   sync_all_weights=sync_all_weights)


def _groups(step: int, n: int = 8) -> list[Group]:
    """Fixed samples (the same for every learner): rewards favour responses that start with token 7."""
    gen = torch.Generator().manual_seed(step)
    trajs = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        response = torch.randint(3, 14, (3,), generator=gen).tolist()
        trajs.append(Trajectory(seq_id=step * n + i, group_id=step * 2 + i // 4, group_size=4, prompt_ids=prompt,
                                response_ids=response, loss_mask=[True] * 3, behavior_logprobs=[-2.5] * 3,
                                versions=[step] * 3, min_version=step, max_version=step, finish_reason="length",
                                reward=float(response[0] == 7) + 0.1 * i))
    return [Group(group_id=g, min_version=step, trajectories=[t for t in trajs if t.group_id == g])
            for g in sorted({t.group_id for t in trajs})]


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_only_adapter_weights_train_and_the_frozen_base_is_untouched(llama_dir):
    learner = _learner(llama_dir)
    base = {k: v.clone() for k, v in learner.model.named_parameters() if "lora_" not in k}
    adapters = {k: v.clone() for k, v in learner.model.named_parameters() if "lora_" in k}
    optimized = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for k, p in learner.model.named_parameters() if "lora_" in k}
    assert all(p.requires_grad == ("lora_" in k) for k, p in learner.model.named_parameters())
    for step in range(2):
        learner.update(_groups(step))
    now = dict(learner.model.named_parameters())
    assert all(torch.equal(now[k], v) for k, v in base.items())
    assert all(not torch.equal(now[k], v) for k, v in adapters.items() if ".lora_B." in k)  # B starts at 0


def test_the_sync_sends_the_merged_weights_under_the_base_names_and_leaves_the_trainers_module_unmerged(llama_dir):
    learner = _learner(llama_dir, sync_all_weights=True)  # (vLLM, SGLang: every weight)
    learner.update(_groups(0))
    before = _logits(learner.model, PROMPTS[0])
    merged = copy.deepcopy(learner.model).merge_and_unload().state_dict()
    sent = learner.state_dict_for_sync()
    assert set(sent) == set(merged) == set(hf.load_model(llama_dir).state_dict())
    for name, tensor in merged.items():
        torch.testing.assert_close(sent[name], tensor, atol=1e-6, rtol=0)
    layers = lora.lora_layers(learner.model)
    assert len(layers) == 14 and not any(layer.merged for layer in layers.values())
    torch.testing.assert_close(_logits(learner.model, PROMPTS[0]), before, atol=0, rtol=0)
    assert all(not torch.equal(merged[f"{n}.weight"], layer.get_base_layer().weight) for n, layer in layers.items())
    # the torch engine takes a subset: only the adapted layers travel (the rest is the base it loaded)
    learner._sync_all = False
    subset = learner.state_dict_for_sync()
    assert set(subset) == {f"{n}.weight" for n in layers} and all(torch.equal(subset[k], sent[k]) for k in subset)


def test_a_torch_engine_generates_with_the_merged_weights_after_a_sync(llama_dir):
    learner = _learner(llama_dir)
    for step in range(3):
        learner.update(_groups(step))
    engine = TorchEngine(llama_dir, eos_token_ids=[])
    try:
        assert engine.fast  # the engine's fast path, on the base model loaded from model.path
        engine.load_weights(dict(learner.state_dict_for_sync()), version=3)
        out = asyncio.run(engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=4)))
    finally:
        asyncio.run(engine.close())
    base = hf.load_model(llama_dir)
    moved = 0.0
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert set(c.versions) == {3}
            want = torch.tensor(learner.teacher_forced_logprobs(prompt, c.response_ids, 1.0))
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)
            full = _logits(base, prompt + c.response_ids)[len(prompt) - 1:-1].log_softmax(-1)
            base_lp = full.gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1)
            moved = max(moved, float((base_lp - want).abs().max()))
    assert moved > 1e-2  # the adapters changed the policy: the comparison above can fail


def test_the_torch_engine_on_the_trainers_peft_module_takes_the_hf_fallback_and_computes_the_adapted_policy(llama_dir):
    learner = _learner(llama_dir)
    learner.update(_groups(0))
    assert "adapter layers" in unsupported_reason(learner.model)
    engine = TorchEngine.from_model(learner.model, eos_token_ids=[])
    try:
        assert not engine.fast
        out = asyncio.run(engine.generate(PROMPTS[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=3)))
    finally:
        asyncio.run(engine.close())
    for c in out[0]:
        want = torch.tensor(learner.teacher_forced_logprobs(PROMPTS[0], c.response_ids, 1.0))
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)


def test_the_adapter_off_reference_gives_the_base_models_logprobs(llama_dir):
    learner = _learner(llama_dir)
    learner.update(_groups(0))
    reference = lora.AdapterOffReference(learner.model, pad_token_id=hf.PAD_ID)
    trajs = [t for g in _groups(1) for t in g.trajectories]
    got = reference.response_logprobs(trajs)
    base = hf.load_model(llama_dir)
    for t, row in zip(trajs, got):
        full = _logits(base, t.prompt_ids + t.response_ids)[len(t.prompt_ids) - 1:-1].log_softmax(-1)
        want = full.gather(-1, torch.tensor(t.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(row), want, atol=1e-5, rtol=0)
    policy = learner.teacher_forced_logprobs(trajs[0].prompt_ids, trajs[0].response_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(policy, got[0])) > 1e-3  # the adapters are back on afterwards


def test_gradient_checkpointing_under_lora_gives_the_same_update(llama_dir):
    from asyncrl.training import precision

    sent = []
    for checkpointing in (False, True):
        learner = Learner(_policy(llama_dir), algorithm=AlgorithmConfig(), trainer=TrainerConfig(lr=5e-2),
                          pad_token_id=hf.PAD_ID, gradient_checkpointing=checkpointing)
        assert bool(precision.checkpointed_modules(learner.model)) == checkpointing
        learner.update(_groups(0))
        sent.append(dict(learner.state_dict_for_sync()))
    assert all(torch.allclose(sent[0][k], sent[1][k], atol=1e-6, rtol=0) for k in sent[0])


def test_adapter_dropout_is_on_only_inside_gradient_passes(llama_dir):
    model = _policy(llama_dir, dropout=0.5)
    dropouts = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n]
    model.eval()
    assert dropouts and not any(m.training for m in dropouts)
    with lora.adapter_dropout(model):
        assert all(m.training for m in dropouts)
        assert not model.training
    assert not any(m.training for m in dropouts)


@pytest.mark.parametrize("name", ["cosine", "linear", "constant_with_warmup"])
def test_the_lr_follows_transformers_get_scheduler_and_a_resumed_learner_continues_it_exactly(llama_dir, tmp_path,
                                                                                             name):
    from transformers import get_scheduler

    kw = dict(lr_scheduler=name, warmup_steps=1, mini_batches=2, epochs=2, total_steps=4)
    # the schedule over the run's 4 x 2 x 2 optimizer steps, warming up over one train step's 4
    dummy = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-2)
    expected_sched = get_scheduler(name, dummy, num_warmup_steps=4, num_training_steps=16)
    expected = []
    for _ in range(16):
        expected.append(dummy.param_groups[0]["lr"])
        dummy.step()
        expected_sched.step()

    whole = _learner(llama_dir, **kw)
    seen = []
    for step in range(4):
        seen.append(whole.update(_groups(step))["trainer/lr"])  # the lr of the step's last optimizer step
    assert seen == pytest.approx([expected[4 * s + 3] for s in range(4)], abs=1e-12)
    assert expected[0] == 0.0 and max(expected) == pytest.approx(5e-2)

    first = _learner(llama_dir, **kw)
    for step in range(2):
        first.update(_groups(step))
    tensors, state = first.checkpoint_state()
    assert set(tensors["policy"]) == set(lora.adapter_state(first.model))  # the adapter, not the base
    path = checkpoint.save(tmp_path / "ck", step=2, version=2, config_text="", tensors=tensors, state=state)
    ck = checkpoint.load(path)
    resumed = _learner(llama_dir, **kw)
    resumed.restore_state(ck.tensors, ck.state)
    lrs = [resumed.update(_groups(step))["trainer/lr"] for step in (2, 3)]
    assert lrs == pytest.approx(seen[2:], abs=1e-12)
    final, want = resumed.state_dict_for_sync(), whole.state_dict_for_sync()
    assert all(torch.allclose(final[k], want[k], atol=1e-6, rtol=0) for k in want)


def test_a_full_fine_tune_checkpoint_does_not_load_into_a_lora_learner(llama_dir):
    plain = Learner(hf.load_model(llama_dir), algorithm=AlgorithmConfig(), trainer=TrainerConfig(),
                    pad_token_id=hf.PAD_ID)
    tensors, state = plain.checkpoint_state()
    with pytest.raises(ValueError, match=r"disagree on LoRA.*\[model.lora\]"):
        _learner(llama_dir).restore_state(tensors, state)


def test_the_export_writes_the_merged_model_in_export_dtype_and_the_adapter_beside_it(llama_dir, tmp_path):
    from peft import PeftModel

    learner = _learner(llama_dir)
    learner.update(_groups(0))
    trainer = Trainer(learner=learner, buffer=None)
    out = Path(trainer.save_checkpoint(str(tmp_path / "checkpoint"), hf.load_tokenizer(llama_dir)))
    ids = PROMPTS[2]
    want = _logits(learner.model, ids)
    torch.testing.assert_close(_logits(hf.load_model(out), ids), want, atol=1e-5, rtol=0)  # a plain HF folder
    assert json.loads((out / lora.ADAPTER_DIR / "adapter_config.json").read_text())["r"] == 4
    adapted = PeftModel.from_pretrained(hf.load_model(llama_dir), str(out / lora.ADAPTER_DIR))
    torch.testing.assert_close(_logits(adapted, ids), want, atol=1e-5, rtol=0)
    assert not any(layer.merged for layer in lora.lora_layers(learner.model).values())

    half = Path(trainer.save_checkpoint(str(tmp_path / "bf16"), dtype="bfloat16"))
    stored = safetensors.torch.load_file(str(next(half.glob("*.safetensors"))))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())  # the training weights are not cast


def test_export_dtype_auto_is_the_models_configured_dtype_also_under_mixed_precision(tiny_model_dir, tmp_path):
    def cfg(**run):
        raw = {"model": {"path": str(tiny_model_dir), "dtype": "bfloat16"}, "data": {"source": "x:y"},
               "trainer": {"mixed_precision": "bf16"}, "run": run}
        return config_from_dict(raw, cross_checks=False)

    assert export_dtype(cfg()) == "bfloat16"  # not the float32 master weights
    assert export_dtype(cfg(export_dtype="float16")) == "float16"
    learner = Learner(hf.load_model(tiny_model_dir), algorithm=AlgorithmConfig(),
                      trainer=TrainerConfig(mixed_precision="bf16"), pad_token_id=hf.PAD_ID)
    out = Path(Trainer(learner=learner, buffer=None).save_checkpoint(str(tmp_path / "ck"), dtype=export_dtype(cfg())))
    stored = safetensors.torch.load_file(str(next(out.glob("*.safetensors"))))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("sets, expected", [
    ({"model.lora.rank": 0}, "model.lora.rank: expected an integer >= 1, got 0"),
    ({"model.lora.target_modules": ["q_proj", "qkv"]},
     "model.lora.target_modules: unknown module 'qkv' — the model's linear layers are: down_proj, gate_proj, "
     "k_proj, o_proj, q_proj, up_proj, v_proj (or 'all-linear')"),
    ({"trainer.warmup_steps": 2}, "trainer.warmup_steps: 2 with trainer.lr_scheduler = 'constant', which has no "
     "warmup — use lr_scheduler = 'constant_with_warmup' (or 'linear' / 'cosine'), or warmup_steps = 0"),
    ({"trainer.lr_scheduler": "cosine", "trainer.warmup_steps": 9},
     "trainer.warmup_steps: 9 is longer than the run (trainer.total_steps = 3) — use at most 3, e.g. a tenth of it"),
    ({"trainer.num_ranks": 2, "trainer.parallel": "fsdp2"}, "model.lora: several trainer ranks train adapters with "
     "trainer.parallel = 'ddp', not 'fsdp2' — set trainer.parallel = 'ddp'"),
])
def test_bad_lora_and_schedule_settings_are_one_config_error_each(make_config, sets, expected):
    overrides = {"model.lora.rank": 4, **sets}
    with pytest.raises(ConfigError) as info:
        make_config(*(f"{k}={json.dumps(v)}" for k, v in overrides.items()))
    assert len(info.value.errors) == 1 and info.value.errors[0].startswith(expected), info.value.errors


def test_lora_with_two_ddp_trainer_ranks_is_a_valid_config(make_config):
    cfg = make_config("model.lora.rank=4", "trainer.num_ranks=2", 'trainer.parallel="ddp"')
    assert (cfg.trainer.num_ranks, cfg.trainer.parallel, cfg.model.lora.rank) == (2, "ddp", 4)


def test_a_trainer_side_reference_under_lora_is_the_policy_with_its_adapters_off_not_a_second_model(make_config):
    from asyncrl.deploy.build import build_learner, build_reference, load_policy

    cfg = make_config("model.lora.rank=4", 'algorithm.kl_mode="loss"', "algorithm.kl_coef=0.5",
                      'reference.where="trainer"')
    learner = build_learner(cfg, load_policy(cfg), hf.PAD_ID)
    assert isinstance(learner.reference, lora.AdapterOffReference) and learner.reference.model is learner.model
    assert not learner._sync_all  # the torch engine: the adapted layers alone travel
    learner.update(_groups(0))
    trajs = [t for g in _groups(1) for t in g.trajectories]
    base = torch.tensor(build_reference(cfg).response_logprobs(trajs))  # the base, loaded again from model.path
    torch.testing.assert_close(learner.prepare(trajs).rows["ref"], base, atol=1e-5, rtol=0)
    policy = torch.tensor([learner.teacher_forced_logprobs(t.prompt_ids, t.response_ids, 1.0) for t in trajs])
    assert float((policy - base).abs().max()) > 1e-3  # the adapters moved the policy, and are on again
    # a reference.path of its own is loaded as before
    other = build_learner(make_config("model.lora.rank=4", 'algorithm.kl_mode="loss"', 'reference.where="trainer"',
                                      f'reference.path="{cfg.model.path}"'), load_policy(cfg), hf.PAD_ID)
    assert type(other.reference).__name__ == "ReferencePolicy"
