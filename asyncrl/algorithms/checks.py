"""The [algorithm] section's checks in `load_config` (asyncrl/config/checks.py): the estimator, loss and
aggregation are registered names, and the combinations of [algorithm], [critic] and [reference] can run. What
an estimator needs comes from its registry entry (`AlgorithmNeeds`: asyncrl/algorithms/registry.py), not from its
name."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from asyncrl.algorithms.registry import (
    AlgorithmNeeds,
    advantage_needs,
    available_advantages,
    available_loss_aggs,
    available_policy_losses,
)
from asyncrl.config.checks import unknown
from asyncrl.config.schema import Config

log = logging.getLogger(__name__)


def needs_of(name: str) -> AlgorithmNeeds | None:
    """What estimator `name` declares it needs; None when the name is unknown (`check_names` reports it)."""
    try:
        return advantage_needs(name)
    except KeyError:
        return None


def estimators_where(fits: Callable[[AlgorithmNeeds], bool]) -> str:
    """The registered estimators whose needs pass `fits`, quoted, for an error's "use ..." hint."""
    return " / ".join(repr(n) for n in available_advantages() if fits(advantage_needs(n)))


def check_names(cfg: Config) -> list[str]:
    a = cfg.algorithm
    return (unknown("algorithm.advantage", "advantage estimator", a.advantage, available_advantages())
            + unknown("algorithm.policy_loss", "policy loss", a.policy_loss, available_policy_losses())
            + unknown("algorithm.loss_agg", "loss aggregation", a.loss_agg, available_loss_aggs()))


def check_options(cfg: Config) -> list[str]:
    """Combinations of [algorithm], [critic], [reference] and the cost fields of [reward] that cannot run."""
    a, errors = cfg.algorithm, []
    needs, group_size = needs_of(a.advantage), cfg.rollout.group_size
    if a.dual_clip and a.dual_clip <= 1:
        errors.append(f"algorithm.dual_clip: {a.dual_clip:g} must be > 1 (e.g. 3.0), or 0 to turn dual clipping off")
    if a.correction in ("token_tis", "seq_tis") and not a.decoupled and a.policy_loss != "vanilla_pg":
        errors.append(f"algorithm.correction: {a.correction!r} weights each token by proximal / behaviour, which "
                      f"the {a.policy_loss!r} ratio against the behaviour policy already contains — set "
                      f"algorithm.decoupled = true (ratio against the proximal policy), or use a *_mask correction")
    if a.overlong_buffer >= cfg.rollout.max_new_tokens:
        errors.append(f"algorithm.overlong_buffer: {a.overlong_buffer} must be below rollout.max_new_tokens = "
                      f"{cfg.rollout.max_new_tokens} — responses longer than max_new_tokens - overlong_buffer "
                      f"are penalised")
    if a.dynamic_sampling and cfg.rollout.group_size < 2:
        errors.append("algorithm.dynamic_sampling: every group of rollout.group_size = 1 has zero reward variance "
                      "and would be dropped — use rollout.group_size >= 2")
    if needs is not None and group_size < needs.min_group_size:
        errors.append(f"algorithm.advantage: {a.advantage!r} compares the samples of a group and needs "
                      f"rollout.group_size >= {needs.min_group_size} (got {group_size}) — raise it, or use "
                      f"{estimators_where(lambda n: n.min_group_size <= group_size)}")
    if a.safe_rlhf and not cfg.reward.cost_fn:
        errors.append("algorithm.safe_rlhf: needs a cost signal — set reward.cost_fn (e.g. 'longer_than_answer' "
                      "or 'pkg.module:function') and reward.cost_threshold")
    if a.safe_rlhf and needs is not None and (needs.critic or needs.greedy_baseline):
        errors.append(f"algorithm.safe_rlhf: the cost advantage needs a critic-free estimator without a greedy "
                      f"baseline, got advantage {a.advantage!r} — use "
                      f"{estimators_where(lambda n: not (n.critic or n.greedy_baseline))}")
    for section, path, used in (("critic", cfg.critic.path, needs is not None and needs.critic),
                                ("reference", cfg.reference.path, a.kl_mode != "off")):
        if used and path and not (Path(path) / "config.json").is_file():
            errors.append(f"{section}.path: {path!r} is not a Hugging Face model folder (no config.json) — "
                          f"leave it empty to start from model.path")
    if a.kl_mode != "off" and a.kl_coef == 0:
        log.warning("algorithm.kl_mode = %r with kl_coef = 0: the reference model runs but changes nothing", a.kl_mode)
    return errors
