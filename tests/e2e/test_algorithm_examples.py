"""Every algorithm example (`examples/<algo>/config.toml`) runs end to end through `asyncrl launch --local`
on the tiny test model for a couple of steps, and its metrics show what the algorithm adds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.telemetry.metrics import read_metrics
from tests.conftest import documented_metric_keys

pytestmark = pytest.mark.slow  # one asyncrl launch per algorithm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# metric keys each example must log on every train step, besides the common ones
EXPECTED = {
    "ppo": ["critic/value_loss", "critic/explained_variance", "critic/vf_clip_frac", "critic/value_mean",
            "critic/return_mean", "critic/grad_norm"],
    "grpo": ["kl/ref_mean"],
    "drgrpo": [],
    "dapo": ["dapo/groups_filtered", "dapo/groups_filtered_total", "dapo/overlong_penalty_mean",
             "dapo/overlong_share", "offpolicy/share_clipped"],
    "gspo": ["offpolicy/share_masked"],
    "rloo": [],
    "reinforce_pp": ["kl/ref_mean"],
    "remax": ["remax/baseline_reward"],
    "safe_rlhf": ["safety/cost_mean", "safety/lambda", "safety/lambda_next", "safety/cost_threshold"],
}
COMMON = ["reward/mean", "trainer/loss", "trainer/clip_frac", "trainer/entropy", "offpolicy/is_ratio_mean",
          "offpolicy/is_ratio_max", "offpolicy/is_ratio_min", "offpolicy/share_clipped", "offpolicy/share_masked"]


def test_every_algorithm_key_docs_metrics_md_documents_is_checked_in_some_example():
    assert documented_metric_keys("Algorithms") <= set(COMMON).union(*EXPECTED.values())


@pytest.mark.parametrize("algo", sorted(EXPECTED))
def test_algorithm_example_runs_through_asyncrl_launch(algo, tiny_model_dir, tmp_path):
    run_dir = tmp_path / algo
    rc = main(["launch", str(EXAMPLES / algo / "config.toml"), "--local",
               "--set", f'model.path="{tiny_model_dir}"', "--set", f'run.output_dir="{run_dir}"',
               "--set", "trainer.total_steps=2", "--set", "trainer.prompts_per_step=2",
               "--set", "rollout.group_size=4", "--set", "rollout.concurrency=4",
               "--set", "trainer.eval_every=0", "--set", "trainer.micro_batch_size=8"])
    assert rc == 0
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for key in COMMON + EXPECTED[algo]:
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    for r in rows:
        assert 0.0 <= r["offpolicy/share_clipped"] <= 1.0 and 0.0 <= r["offpolicy/share_masked"] <= 1.0
        assert r["offpolicy/is_ratio_min"] <= r["offpolicy/is_ratio_mean"] <= r["offpolicy/is_ratio_max"]
    if algo == "ppo":
        assert all(r["critic/value_loss"] > 0 and r["critic/explained_variance"] <= 1.0 for r in rows)
        assert (run_dir / "checkpoint" / "critic" / "config.json").is_file()
    if algo == "dapo":
        assert all(r["dapo/overlong_penalty_mean"] <= 0.0 for r in rows)
        # the step windows add up to the total, which is the buffer's one count of filtered groups
        assert sum(r["dapo/groups_filtered"] for r in rows) == rows[-1]["dapo/groups_filtered_total"]
        assert all(r["dapo/groups_filtered_total"] == r["buffer/filtered"] for r in rows)
    if algo == "safe_rlhf":
        # the multiplier moves by the measured cost and carries over to the next step and the checkpoint
        assert rows[1]["safety/lambda"] == pytest.approx(rows[0]["safety/lambda_next"])
        saved = json.loads((run_dir / "checkpoint" / "safety.json").read_text())
        assert saved["value"] == pytest.approx(rows[1]["safety/lambda_next"])
