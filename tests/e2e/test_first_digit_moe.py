"""The mixture-of-experts example (examples/first_digit_moe: a tiny Qwen3-MoE, the trainer replaying the engine's
routing) learns in one process and trains through Ray (8 steps) with the routing carried generator -> trainer.
Measured at run.seed 0, --local: held-out greedy 0.06 (step 0) -> 0.40, 0.53, 0.77, 1.0, 1.0, 1.0 (steps 10-60);
routing/agreement 1.0 at step 1 (on-policy), then 0.40-0.62 over steps 2-4 while lr 3e-3 moves the router fast,
0.78-0.98 later (max_staleness 1: the engine's router is one version older); a constant output scores 0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]  # 60 steps in one process (~25 s), 8 on Ray (~25 s)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "first_digit_moe" / "config.toml"
HELD_OUT = 0.8


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from asyncrl.config import load_config
    from engines.hf import ensure_model

    path = tmp_path_factory.mktemp("first_digit_moe") / "model"
    ensure_model(load_config(EXAMPLE, [f'model.path="{path}"']).model)
    return path


def _train_rows(run_dir: Path) -> list[dict]:
    from asyncrl.telemetry.metrics import read_metrics

    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]


def test_the_moe_example_learns_in_one_process_replaying_the_engines_routing(moe_model, tmp_path):
    from asyncrl.cli import main
    from asyncrl.telemetry.metrics import read_metrics

    run_dir = tmp_path / "run"
    assert main(["launch", str(EXAMPLE), "--local", "--set", f'model.path="{moe_model}"',
                 "--set", f'run.output_dir="{run_dir}"', "--set", "logging.live=false"]) == 0
    evals = [r["eval/greedy_reward"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval/greedy_reward" in r]
    assert evals[0] <= 0.2 and evals[-1] >= HELD_OUT, evals
    train = _train_rows(run_dir)
    assert len(train) == 60
    for r in train:
        # every position the engine fed carries its record: 5 prompt tokens and a reply's first token of 2 (of
        # one token, the prompt alone: 5 of 6)
        assert 5 / 6 - 1e-9 <= r["routing/recorded_share"] <= 6 / 7 + 1e-9
        assert 0.0 < r["routing/agreement"] <= 1.0
        assert r["trainer/logprob_gap"] < 1e-4  # replayed: the trainer computes the engine's logprobs
    assert train[0]["routing/agreement"] == 1.0  # on-policy, both in float32: the trainer routes as the engine did
    # one version stale (max_staleness 1): the trainer's router has moved since the engine routed; replay hides it
    assert min(r["routing/agreement"] for r in train[1:]) < 0.9
    config = json.loads((run_dir / "checkpoint" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 4, 2)
    # the trace's counters: the agreement and the gaps, one sample a step, as the metrics rows hold them
    events = json.loads((run_dir / "trace.json").read_text())
    agreement = [e["args"]["value"] for e in events if e.get("name") == "routing/agreement" and e["ph"] == "C"]
    assert agreement == pytest.approx([r["routing/agreement"] for r in train])
    assert sum(e.get("name") == "trainer/logprob_diff" for e in events) == len(train)


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_the_moe_example_trains_through_ray_with_the_routing_carried_to_the_trainer(ray_cluster, moe_model, tmp_path):
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", str(EXAMPLE), "--address", ray_cluster,
         "--set", f'model.path="{moe_model}"', "--set", f'run.output_dir="{run_dir}"',
         "--set", "trainer.total_steps=8", "--set", "trainer.eval_every=0", "--set", "logging.live=false"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = _train_rows(run_dir)
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(5 / 6 - 1e-9 <= r["routing/recorded_share"] <= 6 / 7 + 1e-9 for r in train)
    assert all(r["trainer/logprob_gap"] < 1e-4 for r in train)
    # the updates moved the routers (the engine routes one version behind) and every step still replays
    assert train[0]["routing/agreement"] == 1.0 and min(r["routing/agreement"] for r in train[1:]) < 1.0
