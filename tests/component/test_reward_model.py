"""`reward.model`: a one-label sequence classifier from a local folder scores prompt + completion in padded
batches; its values are those of a plain forward pass on each text alone, whatever the batch size, and it
adds up with the reward functions as the component "reward_model"."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import RewardConfig, RewardFunctionConfig
from asyncrl.rewards.base import Call, Score
from asyncrl.rewards.model import RewardModel, check_reward_model
from asyncrl.rewards.setup import rewards_from_config
from tests.reward_models import build_reward_model

TEXTS = [("1+2=", "3"), ("9+9=", "18"), ("1=", "1+1+1+1+1+1+1"), ("7+0=", "")]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm") / "rm")


def direct(path: Path, texts: list[str]) -> list[float]:
    """The reference: each text alone, no padding, straight through transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
    with torch.inference_mode():
        return [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]


def calls() -> list[Call]:
    return [Call(p, c, {}) for p, c in TEXTS]


def test_reward_model_values_equal_a_plain_forward_pass_whatever_the_batch_size(rm_dir):
    expected = direct(rm_dir, [p + c for p, c in TEXTS])
    assert len(set(round(v, 4) for v in expected)) == len(TEXTS)  # the texts score apart: the check can fail
    for batch_size in (1, 3, 8):
        got = asyncio.run(RewardModel(str(rm_dir), batch_size=batch_size).values(calls()))
        assert got == pytest.approx(expected, abs=1e-5)


def test_sigmoid_transform_and_a_long_text_read_from_its_end(rm_dir):
    expected = direct(rm_dir, [p + c for p, c in TEXTS])
    got = asyncio.run(RewardModel(str(rm_dir), transform="sigmoid").values(calls()))
    assert got == pytest.approx([1 / (1 + math.exp(-v)) for v in expected], abs=1e-6)
    long = Call("1+1+1+1+1+1+1+1+1=", "9", {})
    [cut] = asyncio.run(RewardModel(str(rm_dir), max_len=8).values([long]))
    assert cut == pytest.approx(direct(rm_dir, [(long.prompt + long.completion)[-8:]])[0], abs=1e-5)


def test_the_reward_model_is_a_weighted_component_beside_the_functions(rm_dir):
    cfg = RewardConfig(functions=[RewardFunctionConfig(fn="exact_match", name="correct", weight=2.0)],
                       model=str(rm_dir), model_weight=0.5)
    out = asyncio.run(rewards_from_config(cfg).score([Call("1+2=", "3", {"answer": "3"})]))
    [rm_value] = direct(rm_dir, ["1+2=3"])
    assert out == [Score(total=pytest.approx(2.0 + 0.5 * rm_value, abs=1e-5),
                         components={"correct": 1.0, "reward_model": pytest.approx(rm_value, abs=1e-5)})]


def test_a_folder_that_is_not_a_one_label_classifier_is_refused(rm_dir, tiny_model_dir, tmp_path):
    assert check_reward_model(str(rm_dir)) == []
    two = build_reward_model(tiny_model_dir, tmp_path / "two", labels=2)
    assert "has 2 labels" in check_reward_model(str(two))[0]
    assert "not a sequence classifier" in check_reward_model(str(tiny_model_dir))[0]
    with pytest.raises(ValueError, match="has 2 labels"):
        RewardModel(str(two))
    config = json.loads((rm_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
