"""`--local` runs on dataset layouts other than plain text: verl-style conversational rows (prompt =
chat messages, answer nested under reward_model) rendered with the model's chat template."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # trains a tiny model in process, like the other e2e runs

# Renders the messages' contents and, as its generation prompt, "=": "5382" becomes "5382=", the
# first_digit prompt, only through the template (the tiny vocabulary is digits, '+' and '=').
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def _templated_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the session's tiny model whose tokenizer has a chat template."""
    model = tmp_path / "tiny-chat"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return model


def _verl_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        digits = "".join(str(rng.randrange(10)) for _ in range(4))
        rows.append({"data_source": "first_digit", "prompt": [{"role": "user", "content": digits}],
                     "reward_model": {"style": "rule", "ground_truth": digits[0]},
                     "extra_info": {"index": i}})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_local_run_trains_on_conversational_rows_through_the_chat_template(make_config, tiny_model_dir, tmp_path):
    from asyncrl.deploy.build import build_generator
    from asyncrl.deploy.local import run_local
    from engines.hf import load_tokenizer

    model = _templated_model(tiny_model_dir, tmp_path)
    train = _write_jsonl(tmp_path / "train.jsonl", _verl_rows(64, seed=0))
    held_out = _write_jsonl(tmp_path / "eval.jsonl", _verl_rows(8, seed=1))
    cfg = make_config(f'model.path="{model}"', 'data.source=""', f'data.path="{train}"',
                      f'data.eval_path="{held_out}"', 'reward.answer_key="reward_model.ground_truth"',
                      "trainer.total_steps=2", f'run.output_dir="{tmp_path / "run"}"')

    # the generators prompt with the template's rendering: exactly the first_digit prompt "5382="
    tok = load_tokenizer(model)
    generator = build_generator(cfg, 0, buffer=None)
    row = {"prompt": [{"role": "user", "content": "5382"}]}
    assert generator.encode(row).ids == tok.encode("5382=", add_special_tokens=False)
    asyncio.run(generator.engine.close())

    rows = [r for r in run_local(cfg) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # every group was scored against its nested answer: none failed (a missing answer key fails groups)
    assert rows[-1]["buffer/failed"] == 0 and rows[-1]["scorer/reward_errors"] == 0
    assert rows[-1]["data/filtered_overlong"] == 0 and rows[-1]["data/truncated_prompts"] == 0
    assert "eval/greedy_reward" in rows[-1]
    ledger = [json.loads(line) for line in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
    prompts = {g[1] for r in ledger for g in r["groups"]}
    assert prompts and all(len(p) == 4 and p.isdigit() for p in prompts)  # the plain text, no template markup
