"""What an advantage estimator needs (critic, greedy baseline, group size) is declared at its registration;
config validation, the builders, the Learner and the embedding API ask the registry, never the name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from asyncrl.algorithms import compute_grpo
from asyncrl.algorithms.registry import (
    AlgorithmNeeds,
    advantage_needs,
    available_advantages,
    get_advantage,
    register_advantage,
    unregister_advantage,
)
from asyncrl.config import ConfigError

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]

BUILT_IN = {
    "grpo": AlgorithmNeeds(min_group_size=2),
    "drgrpo": AlgorithmNeeds(min_group_size=2),
    "rloo": AlgorithmNeeds(min_group_size=2),
    "reinforce_pp": AlgorithmNeeds(),
    "reinforce_pp_baseline": AlgorithmNeeds(min_group_size=2),
    "remax": AlgorithmNeeds(greedy_baseline=True),
    "gae": AlgorithmNeeds(critic=True),
}


@pytest.fixture
def estimator():
    """estimator(needs) -> the name of a throwaway estimator (grpo's maths) declaring `needs`; removed after."""
    names: list[str] = []

    def register(needs: AlgorithmNeeds) -> str:
        name = f"throwaway_{len(names)}"
        register_advantage(name, needs=needs)(compute_grpo)
        names.append(name)
        return name

    yield register
    for name in names:
        unregister_advantage(name)


def errors_of(make_config, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        make_config(*overrides)
    return info.value.errors


# -- the declarations ------------------------------------------------------------------------------

def test_every_built_in_estimator_declares_what_it_needs():
    assert set(BUILT_IN) == set(available_advantages())
    assert {name: advantage_needs(name) for name in BUILT_IN} == BUILT_IN


def test_needs_of_an_unknown_estimator_name_the_known_ones():
    with pytest.raises(KeyError, match="unknown advantage estimator 'gaee'; known: .*gae"):
        advantage_needs("gaee")


def test_a_group_size_below_one_cannot_be_declared():
    with pytest.raises(ValueError, match="min_group_size must be >= 1"):
        AlgorithmNeeds(min_group_size=0)


def test_an_estimator_registered_without_needs_needs_nothing_and_unregisters_with_its_needs(estimator):
    name = estimator(AlgorithmNeeds())
    assert get_advantage(name) is compute_grpo and advantage_needs(name) == AlgorithmNeeds()
    with pytest.raises(ValueError, match="registered twice"):
        register_advantage(name, needs=AlgorithmNeeds(critic=True))(compute_grpo)
    assert advantage_needs(name) == AlgorithmNeeds()  # the failed second registration changed nothing
    unregister_advantage(name)
    assert name not in available_advantages()
    with pytest.raises(KeyError):
        advantage_needs(name)
    register_advantage(name)(compute_grpo)  # the fixture removes it again


# -- config validation asks the registry -----------------------------------------------------------

def test_validation_checks_the_critic_path_of_an_estimator_that_declares_a_critic(make_config, estimator):
    with_critic, without = estimator(AlgorithmNeeds(critic=True)), estimator(AlgorithmNeeds())
    (line,) = errors_of(make_config, f"algorithm.advantage={with_critic}", "critic.path=/nonexistent")
    assert line.startswith("critic.path: '/nonexistent' is not a Hugging Face model folder")
    assert make_config(f"algorithm.advantage={without}", "critic.path=/nonexistent").critic.path == "/nonexistent"


def test_validation_asks_the_declared_minimum_group_size(make_config, estimator):
    name = estimator(AlgorithmNeeds(min_group_size=5))  # the tiny config samples groups of 4
    (line,) = errors_of(make_config, f"algorithm.advantage={name}")
    assert line.startswith(f"algorithm.advantage: '{name}' compares the samples of a group and needs "
                           f"rollout.group_size >= 5 (got 4) — raise it, or use ")
    assert "'grpo'" in line and f"'{name}'" not in line.split("or use ")[1]
    assert make_config(f"algorithm.advantage={name}", "rollout.group_size=5", "trainer.micro_batch_size=5")


def test_safe_rlhf_refuses_an_estimator_that_declares_a_critic_or_a_greedy_baseline(make_config, estimator):
    cost = ("algorithm.safe_rlhf=true", "reward.cost_fn=longer_than_answer")
    for needs in (AlgorithmNeeds(critic=True), AlgorithmNeeds(greedy_baseline=True)):
        name = estimator(needs)
        (line,) = errors_of(make_config, f"algorithm.advantage={name}", *cost)
        assert line.startswith("algorithm.safe_rlhf: the cost advantage needs a critic-free estimator")
        assert "'rloo'" in line and "'gae'" not in line and "'remax'" not in line
    assert make_config(f"algorithm.advantage={estimator(AlgorithmNeeds())}", *cost).algorithm.safe_rlhf


def test_env_episodes_refuse_an_estimator_that_declares_a_greedy_baseline(make_config, estimator):
    name = estimator(AlgorithmNeeds(greedy_baseline=True))
    (line,) = errors_of(make_config, f"algorithm.advantage={name}", 'env.env="guess"', "data.max_prompt_len=128")
    assert line.startswith(f"env.env: advantage '{name}' needs a greedy completion of each prompt")


# -- building and running ask the registry ---------------------------------------------------------

def test_build_gives_the_learner_a_critic_exactly_when_the_estimator_declares_one(make_config, estimator):
    from asyncrl.deploy.build import build_learner
    from engines.hf import load_model

    for needs in (AlgorithmNeeds(critic=True), AlgorithmNeeds()):
        cfg = make_config(f"algorithm.advantage={estimator(needs)}")
        learner = build_learner(cfg, load_model(cfg.model.path, dtype=cfg.model.dtype), pad_id=0)
        assert (learner.critic is not None) == needs.critic


def test_the_learner_refuses_to_start_without_a_critic_the_estimator_declares(make_config, estimator):
    from asyncrl.training.learner import Learner
    from engines.hf import load_model

    cfg = make_config(f"algorithm.advantage={estimator(AlgorithmNeeds(critic=True))}")
    with pytest.raises(ValueError, match="needs a critic"):
        Learner(load_model(cfg.model.path), algorithm=cfg.algorithm, trainer=cfg.trainer, pad_token_id=0)


def test_build_hands_the_generator_the_declared_greedy_baseline(make_config, estimator):
    from asyncrl.deploy.build import build_generator

    for needs in (AlgorithmNeeds(greedy_baseline=True), AlgorithmNeeds()):
        cfg = make_config(f"algorithm.advantage={estimator(needs)}")
        assert build_generator(cfg, 0, buffer=None).greedy_baseline is needs.greedy_baseline


def test_the_embedding_runtime_refuses_an_estimator_that_declares_a_greedy_baseline(make_config, estimator):
    from asyncrl.runtime import Runtime

    name = estimator(AlgorithmNeeds(greedy_baseline=True))
    with pytest.raises(ValueError, match=f"^algorithm.advantage: '{name}' needs a greedy baseline"):
        Runtime(make_config(f"algorithm.advantage={name}"))
    Runtime(make_config(f"algorithm.advantage={estimator(AlgorithmNeeds())}"))  # not entered: starts nothing


# -- nobody compares estimator names ----------------------------------------------------------------

_NAME_TEST = re.compile(r"""\.advantage\s*(==|!=|\bin\b|\bnot in\b)"""
                        r"""|(==|!=)\s*["'](%s)["']|["'](%s)["']\s*(==|!=)"""
                        r"""|\bin\s*[(\[{][^)\]}]*["'](%s)["']""" % (("|".join(BUILT_IN),) * 3))


def test_no_code_outside_the_algorithms_package_compares_estimator_names():
    offenders = []
    for folder in ("asyncrl", "engines", "buffers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(ROOT / "asyncrl" / "algorithms"):
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _NAME_TEST.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "ask asyncrl.algorithms.registry.advantage_needs instead:\n" + "\n".join(offenders)


def test_the_name_check_catches_the_comparisons_it_forbids():
    for line in ('if a.advantage == "gae":', "x = cfg.algorithm.advantage in ('grpo', 'rloo')",
                 'if name == "remax":', 'if "rloo" != name:', 'if adv in ("drgrpo", "x"):'):
        assert _NAME_TEST.search(line), line
    assert not _NAME_TEST.search('"""(`algorithm.advantage = "gae"`)"""')
