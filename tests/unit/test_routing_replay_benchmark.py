"""benchmarks/routing_replay.py's figures from a run's metrics rows, and that each setting is the example with
overrides that load. (The benchmark itself launches eight runs: not run here; the recording micro-benchmark's
engine path is tests/unit/test_moe_models.py's.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _row(gap: float, gap_tokens: int, diff: float, agree: float | None = None) -> dict:
    row = {"time/step_s": 0.5, "reward/mean": 0.25, "trainer/logprob_gap": gap,
           "trainer/logprob_gap_tokens": gap_tokens, "trainer/logprob_diff": diff, "trainer/ratio_max": 1.5,
           "trainer/busy_share": 0.4, "generation/tokens_per_s": 1000.0}
    return row if agree is None else {**row, "routing/agreement": agree}


def test_the_gap_is_the_mean_over_steps_with_on_policy_tokens_and_the_diff_over_every_step(monkeypatch):
    bench = load_benchmark(monkeypatch, ROOT / "benchmarks" / "routing_replay.py")
    rows = [_row(0.0, 0, 0.2, 0.7), _row(1e-3, 10, 0.1, 0.8), {"eval/greedy_reward": 0.9, "eval/sampled_reward": 0.5},
            _row(3e-3, 5, 0.3, 0.9)]
    r = bench.run_figures(rows)
    assert r["steps"] == 3 and r["gap_steps"] == 2 and r["gap"] == pytest.approx(2e-3)  # the step without: left out
    assert r["diff"] == pytest.approx(0.2) and r["agreement"] == pytest.approx(0.8) and r["greedy"] == 0.9
    assert r["trainer_s"] == pytest.approx(0.2)
    dense = bench.run_figures([_row(1e-3, 10, 1e-3)])
    assert dense["agreement"] is None  # a dense model routes nothing
    pair = {"gap_off": 3e-3, "gap_on": 2e-3, "gap_dense": 1e-3, "agreement": 0.99, "tokens": 100.0,
            "generate_s": 10.0, "generate_recording_s": 10.2, "recording_cost": 0.02, "positions": 20,
            "routing_bytes": 320, "trajectory_bytes": 500, "trajectory_bytes_routed": 823}
    line = bench.report({0: {"dense": {**dense, "wall_s": 1.0}, "rollout": {**r, "wall_s": 1.0}}}, pair)
    assert line["value"] == pytest.approx(2e-3) and line["baseline"] == pytest.approx(1e-3) and line["ratio"] == 2.0
    assert line["gap_off"] == 3e-3 and line["routing_bytes_per_position"] == 16.0
    assert set(line["runs"]) == {"k0/dense", "k0/rollout"}
    json.dumps(line, allow_nan=False)  # the last line is strict JSON
    with pytest.raises(ValueError, match="no training step"):
        bench.run_figures([{"eval/greedy_reward": 0.4}])


def test_every_setting_loads_with_the_benchmarks_moe_and_the_engine_in_bf16(monkeypatch):
    from asyncrl.config import load_config

    bench = load_benchmark(monkeypatch, ROOT / "benchmarks" / "routing_replay.py")
    args = argparse.Namespace(experts=16, top_k=4, expert_width=32)
    modes = set()
    for name, (config, sets) in bench.SETTINGS.items():
        shape = bench.moe_shape(args) if config == bench.MOE else []
        cfg = load_config(ROOT / config, [*sets, *shape, 'rollout.dtype="bfloat16"', "staleness.max_staleness=2"])
        tiny = cfg.model.build_tiny
        assert tiny is not None and cfg.rollout.dtype == "bfloat16" and cfg.model.dtype == "float32"
        if config == bench.MOE:
            assert (tiny.arch, tiny.num_experts, tiny.experts_per_token) == ("qwen3_moe", 16, 4)
            assert "e16k4w32" in cfg.model.path
        else:
            assert tiny.arch == "qwen2" and cfg.algorithm.routing_replay == "off"
        modes.add((name, cfg.algorithm.routing_replay))
    assert modes == {("dense", "off"), ("moe-off", "off"), ("measure", "measure"), ("rollout", "rollout")}
