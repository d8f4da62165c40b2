"""The [reward] section: `[[reward.functions]]` entries become named, weighted components; every mistake in
them is one `asyncrl validate` line naming its TOML key; the resolved config round-trips through TOML."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.config import config_to_toml, load_config
from asyncrl.config.fields import ConfigError
from asyncrl.config.schema import RewardConfig
from asyncrl.rewards.base import FunctionSpec, Score
from asyncrl.rewards.setup import default_name, function_specs, rewards_from_config

TWO = '[{fn="prefix_match", name="prefix", weight=1.0}, {fn="contains", weight=0.5}]'


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "data"))


def errors_of(make_config, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        make_config(*overrides)
    return exc.value.errors


def test_weighted_functions_become_named_components_and_round_trip_through_toml(make_config, tmp_path):
    cfg = make_config('reward.fn=""', f"reward.functions={TWO}")
    assert function_specs(cfg.reward) == [FunctionSpec("prefix", "prefix_match", 1.0, "reward.functions[0].fn"),
                                          FunctionSpec("contains", "contains", 0.5, "reward.functions[1].fn")]
    path = tmp_path / "resolved.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg
    rewards = rewards_from_config(cfg.reward)
    [score] = asyncio.run(rewards.score([("1+2=", "3", {"answer": "3"})]))
    assert score == Score(total=1.5, components={"prefix": 1.0, "contains": 1.0})


def test_a_lone_function_is_unnamed_and_exact_match_is_the_default():
    assert function_specs(RewardConfig()) == [FunctionSpec("", "exact_match", 1.0, "reward.fn")]
    assert function_specs(RewardConfig(fn="gsm8k")) == [FunctionSpec("", "gsm8k", 1.0, "reward.fn")]
    # beside a reward model the function is a component of its own, named after it
    assert function_specs(RewardConfig(fn="pkg.mod:Judge.correct", model="rm")) == [
        FunctionSpec("correct", "pkg.mod:Judge.correct", 1.0, "reward.fn")]
    assert function_specs(RewardConfig(model="rm")) == []
    assert default_name("boxed") == "boxed" and default_name("a.b:c") == "c"


@pytest.mark.parametrize("overrides, line", [
    ((f"reward.functions={TWO}",), "reward.fn: set either reward.fn or [[reward.functions]], not both"),
    (('reward.fn=""', 'reward.functions=[{fn="contains"}, {fn="exact_match", name="contains"}]'),
     "reward.functions[1].name: 'contains' is also the name of reward.functions[0]"),
    (('reward.fn=""', 'reward.functions=[{fn="contains", name="mean"}]'),
     "reward.functions[0].name: 'mean' is reserved"),
    (('reward.fn=""', 'reward.functions=[{fn="contains", wieght=2}]'),
     "reward.functions[0].wieght: unknown key — did you mean 'weight'?"),
    (('reward.fn=""', 'reward.functions=[{name="x"}]'), "reward.functions[0].fn: missing required key"),
    (('reward.fn=""', 'reward.functions=[{fn="contians"}]'),
     "reward.functions[0].fn: unknown reward rule 'contians' — did you mean 'contains'?"),
    (('reward.fn=""', 'reward.functions=[{fn="contains", weight=inf}]'), "reward.functions[0].weight: inf"),
    (('reward.fn=""', 'reward.functions=[{fn="contains"}, {fn="asyncrl_unit_fixtures:trl_accuracy"}]',
      'reward.isolation="process"'), "reward.functions[1].fn: 'asyncrl_unit_fixtures:trl_accuracy' is batched"),
    (('reward.model="/no/such/folder"',), "reward.model: '/no/such/folder' is not a Hugging Face model folder"),
])
def test_each_reward_mistake_is_one_line_naming_its_key(make_config, overrides, line):
    errors = errors_of(make_config, *overrides)
    assert any(e.startswith(line) for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_a_causal_lm_folder_is_not_a_reward_model(make_config, tiny_model_dir):
    (line,) = errors_of(make_config, f'reward.model="{tiny_model_dir}"')
    assert line.startswith("reward.model:") and "not a sequence classifier" in line


def test_env_episodes_take_no_reward_functions(make_config):
    errors = errors_of(make_config, 'env.env="first_digit"', 'reward.fn=""', 'reward.functions=[{fn="contains"}]')
    assert any(e.startswith("reward.functions: env episodes bring their own reward") for e in errors)

