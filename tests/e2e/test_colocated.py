"""Colocated placement end to end on the tiny model: every step trains its samples, the generators sleep from
before each train step until after the weight sync (evaluation included), so no generation span overlaps a
train or eval span, and the rows carry the sleep/wake times and each role's peak memory. In process and on Ray."""

from __future__ import annotations

import json

import pytest

from asyncrl.telemetry.metrics import read_metrics
from asyncrl.telemetry.trace import read_trace, spans_from_trace
from tests.conftest import documented_metric_keys

pytestmark = pytest.mark.slow  # whole runs

MEMORY = ("memory/generator_peak_gb", "memory/trainer_peak_gb", "memory/scorer_peak_gb", "memory/buffer_peak_gb")


def _train_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]


def check_colocated_run(cfg, run_dir, steps: int) -> None:
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["trainer/samples"] == cfg.samples_per_step for r in rows)  # every step trained its samples
    for r in rows:
        for key in documented_metric_keys("Colocated placement"):
            assert r[key] >= 0, key
        assert all(r[key] > 0 for key in MEMORY)
        assert r["overlap_ratio"] == 0 and r["buffer/failed"] == 0
        assert r["staleness/max"] <= cfg.staleness.max_staleness
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["overlap_ratio"] == 0 and summary["colocate/sleep_s/mean"] >= 0
    assert all(summary[key] >= max(r[key] for r in rows) for key in MEMORY)

    spans = spans_from_trace(read_trace(run_dir / "trace.json"))
    # the evaluation of version 0 runs before generation starts, the others inside a step
    device_work = [s for s in spans if s.kind == "train" or (s.kind == "eval" and s.version > 0)]
    generating = [s for s in spans if s.kind == "generate"]
    assert len([s for s in device_work if s.kind == "train"]) == steps and generating
    for work in device_work:
        assert not any(g.start < work.end and work.start < g.end for g in generating), work
        for gen in range(cfg.rollout.num_generators):  # and inside a sleep of every generator
            asleep = [s for s in spans if s.role == f"generator/{gen}" and s.kind == "asleep"]
            assert any(a.start <= work.start and work.end <= a.end for a in asleep), (work, gen)


def test_colocated_in_process_run_never_generates_while_it_trains_or_evaluates(make_config, tmp_path):
    from asyncrl.deploy.local import run_local

    run_dir = tmp_path / "colocated"
    cfg = make_config('cluster.placement="colocated"', "trainer.total_steps=4", "rollout.num_generators=2",
                      "run.save_checkpoint=false", "logging.live=false", f'run.output_dir="{run_dir}"')
    run_local(cfg)
    check_colocated_run(cfg, run_dir, steps=4)
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/greedy_reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]  # eval_every = 2: each while the generators slept
    # the engines wrapped the trainer's module (asyncrl/deploy/local.py): each sample's version names the weights that
    # sampled it, so the trainer's logprobs of its on-policy tokens equal the engine's (a sample labelled one
    # version behind the weights it came from would differ by a whole optimizer step)
    gaps = [(r["trainer/logprob_gap"], r["trainer/logprob_gap_tokens"]) for r in _train_rows(run_dir)]
    assert sum(n for _, n in gaps) > 0 and all(gap < 1e-4 for gap, n in gaps if n), gaps


def test_colocated_engines_in_process_wrap_the_trainers_module_and_a_sync_copies_nothing(make_config, tmp_path):
    import asyncio

    import torch

    from asyncrl.deploy.local import LocalDeployment

    cfg = make_config('cluster.placement="colocated"', "rollout.num_generators=2", "trainer.eval_every=0",
                      f'run.output_dir="{tmp_path}"')
    d = LocalDeployment(cfg)
    try:
        model = d.trainer_obj.learner.model
        assert all(g.engine.model is model for g in d.generator_objs)
        asyncio.run(d.setup_weight_sync())
        d.channel.send(dict(model.state_dict()), 1)
        tensors, version, _ = d.generator_objs[0].receiver.receive()
        assert (tensors, version) == ({}, 1)
    finally:
        asyncio.run(d.shutdown())
    apart = LocalDeployment(make_config("trainer.eval_every=0", f'run.output_dir="{tmp_path}"'))
    try:  # disaggregated in process: each engine holds its own copy
        own = apart.generator_objs[0].engine.model
        assert own is not apart.trainer_obj.learner.model
        assert all(torch.equal(a, b) for a, b in zip(own.state_dict().values(),
                                                     apart.trainer_obj.learner.model.state_dict().values()))
    finally:
        asyncio.run(apart.shutdown())


@pytest.mark.ray
def test_colocated_ray_run_sleeps_the_generator_actors_around_every_train_step(ray_cluster, make_config, tmp_path):
    from asyncrl.deploy.launch import run_with_ray

    run_dir = tmp_path / "colocated-ray"
    cfg = make_config('cluster.placement="colocated"', "trainer.total_steps=3", "trainer.eval_every=0",
                      "run.save_checkpoint=false", "logging.live=false", f'run.output_dir="{run_dir}"')
    run_with_ray(cfg)
    check_colocated_run(cfg, run_dir, steps=3)
