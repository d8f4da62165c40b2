"""The builders put every model of a role on that role's device (asyncrl/deploy/placement.py): the trainer's policy,
critic and reference, a scorer's reference and the generators' engines; here, with no GPU asked for, the CPU.
Runs every builder path that takes a device, so a signature that lost it fails here, not in a Ray run."""

from __future__ import annotations

import torch

CPU = torch.device("cpu")


def test_every_model_a_role_builds_sits_on_the_roles_device(make_config, tmp_path):
    from asyncrl.deploy.build import build_learner, build_reference, build_scorer
    from engines.hf import load_model

    cfg = make_config("algorithm.advantage=gae", 'algorithm.kl_mode="loss"', 'reference.where="trainer"',
                      f'run.output_dir="{tmp_path}"')
    learner = build_learner(cfg, load_model(cfg.model.path, dtype=cfg.model.dtype), pad_id=0)
    assert learner.device == CPU and learner.critic is not None and learner.reference is not None
    assert {p.device for p in learner.model.parameters()} == {CPU}
    assert learner.critic.device == CPU and learner.reference.device == CPU
    assert build_reference(cfg, "cpu").device == CPU
    scorer_cfg = make_config('algorithm.kl_mode="loss"', 'reference.where="scorer"', f'run.output_dir="{tmp_path}"')
    scorer = build_scorer(scorer_cfg, 0, buffer=None)
    try:
        assert scorer.reference is not None and scorer.reference.device == CPU
    finally:
        scorer.rewards.close()
