"""Two generators end to end on the tiny model, on Ray and in process (`--local`): both generate and both
have samples trained, and every per-generator key of docs/metrics.md ("Generators") is written for each."""

from __future__ import annotations

import pytest

from tests.conftest import documented_metric_keys

pytestmark = pytest.mark.slow

# written in every train row for every generator (the staleness keys: in the steps that trained its samples)
EVERY_ROW = ("tokens_per_s", "samples_per_s", "in_flight", "busy_share")


def _check_both_generators(rows: list[dict], steps: int, prompts: int, group_size: int) -> None:
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == steps
    for i in (0, 1):
        for key in EVERY_ROW:
            assert all(f"generator/{i}/{key}" in r for r in train), (i, key)
        documented = {key.replace("<i>", str(i)) for key in documented_metric_keys("Generators")}
        assert documented <= set().union(*train), sorted(documented - set().union(*train))
        assert sum(r[f"generator/{i}/samples_per_s"] * r["time/step_s"] for r in train) > 0  # it generated
        assert sum(r.get(f"generator/{i}/trained_samples", 0) for r in train) > 0  # and was trained on
        assert all(r[f"generator/{i}/staleness/max"] <= r["staleness/max"] for r in train
                   if f"generator/{i}/staleness/max" in r)
    trained = sum(r.get(f"generator/{i}/trained_samples", 0) for r in train for i in (0, 1))
    assert trained == steps * prompts * group_size  # every trained sample counted for its one generator


@pytest.mark.ray
def test_two_generators_on_ray_both_generate_and_report_their_own_metrics(ray_cluster, make_config, tmp_path):
    from asyncrl.deploy.launch import run_with_ray

    cfg = make_config("rollout.num_generators=2", "trainer.total_steps=4", "trainer.eval_every=0",
                      "run.save_checkpoint=false", "logging.live=false", f'run.output_dir="{tmp_path / "ray"}"')
    _check_both_generators(run_with_ray(cfg), 4, cfg.trainer.prompts_per_step, cfg.rollout.group_size)


def test_two_generators_in_process_both_generate_and_report_their_own_metrics(make_config, tmp_path):
    from asyncrl.deploy.local import run_local

    cfg = make_config("rollout.num_generators=2", "trainer.total_steps=4", "trainer.eval_every=0",
                      "run.save_checkpoint=false", "logging.live=false", f'run.output_dir="{tmp_path / "local"}"')
    _check_both_generators(run_local(cfg), 4, cfg.trainer.prompts_per_step, cfg.rollout.group_size)
