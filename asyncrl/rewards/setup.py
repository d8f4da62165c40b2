"""The [reward] section -> the `Rewards` a role holds, and its checks for `asyncrl validate`.

Place in the dataflow: `build_rewards` (asyncrl/deploy/build.py) calls `rewards_from_config` once per Scorer and once
for the trainer's Evaluator; `asyncrl validate` calls `check_rewards`.

The reward of a sample is the weighted sum of its components (combine.py):

| config                                  | components                                                    |
|-----------------------------------------|---------------------------------------------------------------|
| `reward.fn = "..."` (or nothing: exact_match) | one function, unnamed: the total is its value           |
| `[[reward.functions]]` name, fn, weight | one per entry, named `name` (default: the rule's or function's |
|                                         | name), each weighted                                          |
| `reward.model = "folder"`               | "reward_model", weighted `reward.model_weight`; beside        |
|                                         | `reward.fn` (then named after its function) or the entries    |
"""

from __future__ import annotations

import math

from asyncrl.config.schema import Config, RewardConfig
from asyncrl.rewards.base import Component, FunctionSpec, Rewards
from asyncrl.rewards.combine import RESERVED_NAMES, RewardSet
from asyncrl.rewards.loader import FunctionComponent, check_reward, resolve_function

MODEL_NAME = "reward_model"


def default_name(spec: str) -> str:
    """A component's name when its entry gives none: 'gsm8k' -> 'gsm8k', 'pkg.mod:Scorer.correct' -> 'correct'."""
    return spec.rpartition(":")[2].rpartition(".")[2] if ":" in spec else spec


def function_specs(cfg: RewardConfig) -> list[FunctionSpec]:
    """The run's reward functions, named and weighted (no reward model among them)."""
    if cfg.functions:
        return [FunctionSpec(f.name or default_name(f.fn), f.fn, f.weight, f"reward.functions[{i}].fn")
                for i, f in enumerate(cfg.functions)]
    if cfg.fn or not cfg.model:
        spec = cfg.fn or "exact_match"
        return [FunctionSpec(default_name(spec) if cfg.model else "", spec, 1.0, "reward.fn")]
    return []


def check_config(cfg: Config) -> list[str]:
    """The [reward] section's check in `load_config` (asyncrl/config/checks.py): `check_rewards`, and no reward
    functions beside [env] (episodes bring their own reward)."""
    errors = check_rewards(cfg.reward)
    if cfg.env is not None and (cfg.reward.functions or cfg.reward.model):
        errors.append("reward.functions: env episodes bring their own reward and are not scored by reward "
                      "functions or reward.model — leave them empty with [env]")
    return errors


def check_cost(cfg: Config) -> list[str]:
    """`reward.cost_fn` (Safe-RLHF's cost signal) resolves in its isolation."""
    return check_reward(cfg.reward.cost_fn, cfg.reward.answer_key, "reward.cost_fn", isolation=cfg.reward.isolation)


def check_rewards(cfg: RewardConfig) -> list[str]:
    """Error lines for `asyncrl validate`: the functions resolve in their isolation, names are distinct, the
    reward model folder holds a one-label sequence classifier. (`reward.cost_fn` is checked with the
    algorithm that uses it.)"""
    errors: list[str] = []
    if cfg.fn and cfg.functions:
        errors.append("reward.fn: set either reward.fn or [[reward.functions]], not both — move it into a "
                      "[[reward.functions]] entry")
    specs = function_specs(cfg)
    seen: dict[str, str] = {MODEL_NAME: "reward.model"} if cfg.model else {}
    for i, spec in enumerate(specs if cfg.functions else []):
        where = f"reward.functions[{i}].name"
        if spec.name in RESERVED_NAMES:
            errors.append(f"{where}: {spec.name!r} is reserved (reward/{spec.name} is the weighted total) — "
                          f"choose another name")
        elif spec.name in seen:
            errors.append(f"{where}: {spec.name!r} is also the name of {seen[spec.name]} — every reward "
                          f"component needs its own name (metrics reward/<name>)")
        seen.setdefault(spec.name, where.removesuffix(".name"))
    for i, spec in enumerate(specs if cfg.functions else []):
        if not math.isfinite(spec.weight):
            errors.append(f"reward.functions[{i}].weight: {spec.weight} — a weight is a finite number")
    if not math.isfinite(cfg.model_weight):
        errors.append(f"reward.model_weight: {cfg.model_weight} — a weight is a finite number")
    for spec in specs:
        errors += check_reward(spec.fn, cfg.answer_key, spec.path, isolation=cfg.isolation)
    if cfg.model:
        from asyncrl.rewards.model import check_reward_model

        errors += check_reward_model(cfg.model)
    return errors


def rewards_from_config(cfg: RewardConfig, *, with_cost: bool = True, device: str = "cpu") -> Rewards:
    """The reward (and, `with_cost`, Safe-RLHF cost) as a role calls it: functions on threads of this process,
    or in worker processes that resolve them themselves (`reward.isolation`); the reward model in this process,
    on `device` (the hosting role's)."""
    specs = function_specs(cfg)
    cost_fn = cfg.cost_fn if with_cost else ""
    extra: list[Component] = []
    if cfg.model:
        from asyncrl.rewards.model import RewardModel

        extra.append(RewardModel(cfg.model, name=MODEL_NAME, weight=cfg.model_weight, batch_size=cfg.model_batch_size,
                                 max_len=cfg.model_max_len, transform=cfg.model_transform,
                                 chat_template=cfg.model_chat_template, dtype=cfg.model_dtype, device=device))
    if cfg.isolation == "process" and (specs or cost_fn):
        from asyncrl.rewards.process import ProcessRewards

        return ProcessRewards(specs, cfg.answer_key, cost_fn, timeout_s=cfg.timeout_s, workers=cfg.workers,
                              max_memory_mb=cfg.max_memory_mb, extra=extra)

    def component(spec: FunctionSpec) -> FunctionComponent:
        return FunctionComponent(resolve_function(spec.fn, cfg.answer_key, spec.path), name=spec.name,
                                 weight=spec.weight, timeout_s=cfg.timeout_s, max_concurrency=cfg.max_concurrency)

    cost = component(FunctionSpec("", cost_fn, 1.0, "reward.cost_fn")) if cost_fn else None
    return RewardSet([*(component(s) for s in specs), *extra], cost)
