"""A whole in-process run (no Ray) with bf16 mixed precision and bf16 engines: the trainer keeps float32 master
weights, the generators' engines hold bfloat16, and after each sync the engine's weights are exactly the
trainer's converted to bfloat16."""

from __future__ import annotations

import torch

from asyncrl.control.controller import Controller
from asyncrl.deploy.launch import run_loop
from asyncrl.deploy.local import LocalDeployment
from engines.hf import ensure_model, load_model


def test_a_bf16_mixed_precision_run_trains_float32_weights_and_syncs_them_to_bf16_engines(make_config, tmp_path):
    cfg = make_config('trainer.mixed_precision="bf16"', 'rollout.dtype="bfloat16"', "trainer.total_steps=3",
                      "trainer.eval_every=2", "model.gradient_checkpointing=true",
                      f'run.output_dir="{tmp_path / "bf16"}"')
    ensure_model(cfg.model)
    deployment = LocalDeployment(cfg)
    learner = deployment.trainer_obj.learner
    engine = deployment.generator_objs[0].engine
    engine_model = engine.model  # the engine drops its reference when the run closes it
    initial = load_model(cfg.model.path)

    rows = run_loop(Controller(cfg, deployment).run())

    assert [r["step"] for r in rows if "trainer/loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if r.get("eval/prompts")] == [0, 2, 3]  # generated on the float32 module
    params = dict(learner.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert all(s["exp_avg"].dtype == torch.float32 for s in learner.optimizer.state.values())
    assert any(not torch.equal(p, dict(initial.named_parameters())[n]) for n, p in params.items())  # it trained
    # the generator received every version, the last one included, in its own dtype
    assert engine.version == learner.version == 3
    # the channel sent bfloat16: half the bytes of the trainer's float32 weights
    sent = learner.state_dict_for_sync()
    assert all(t.is_floating_point() for t in sent.values())
    assert {r["sync/bytes"] for r in rows if "sync/bytes" in r} == {sum(2 * t.numel() for t in sent.values())}
    got = dict(engine_model.named_parameters())
    assert got.keys() == params.keys()
    for name, p in params.items():
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], p.detach().to(torch.bfloat16)), name
