"""bf16 mixed precision on Ray: the trainer actor plans the broadcast in the engines' dtype and its collective
sender converts the float32 master weights to bfloat16 bucket by bucket; the generators' bf16 engines load it."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_mixed_precision_run_on_ray_broadcasts_bf16(ray_cluster, make_config, tmp_path):
    from asyncrl.deploy.launch import run_with_ray
    from engines.hf import load_model

    cfg = make_config('trainer.mixed_precision="bf16"', 'rollout.dtype="bfloat16"', "trainer.total_steps=3",
                      "trainer.eval_every=0", "weight_sync.bucket_mb=0.01", f'run.output_dir="{tmp_path / "bf16"}"')
    rows = [r for r in run_with_ray(cfg) if "trainer/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    model = load_model(cfg.model.path)
    bf16_bytes = sum(2 * p.numel() for p in model.parameters())  # every tensor of the tiny model is floating
    assert {r["sync/bytes"] for r in rows} == {bf16_bytes}
    assert all(r["sync/buckets"] > 1 for r in rows)
    assert all(r["staleness/max"] <= cfg.staleness.max_staleness for r in rows)
