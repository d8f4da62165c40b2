"""Cross-field checks of a loaded config: one line per problem, naming the TOML path and the fix.

Place in the dataflow: `load_config` (asyncrl/config/loader.py) runs `cross_check` after every field converted.
A check reads several keys; it is skipped when one of them already failed its own conversion, so one mistake
gives one line. `CHECKS` lists them in the order their lines are reported, each with the keys it reads.

Who owns a check: the code that reads its keys. The checks of keys that only the configuration relates (batch
sizes against each other, queue capacities, ranks, the model folder, sampling, AdamW's betas, CPU ids) are
here; every other check lives in its subsystem (the dataset's in asyncrl/data/rows.py, the rewards' in
asyncrl/rewards/setup.py, the algorithms' in asyncrl/algorithms/checks.py, placement and engines in
asyncrl/deploy/, ...) and `CHECKS` names it by import path ('module:function'), as the engine registry names
engines: the configuration imports none of them until it checks, so it stays below everything it configures
(asyncrl/config/__init__.py). A check that applies only when a table is set (`[env]`, `[model.lora]`) has a
condition that keeps its module (and what it imports: torch, transformers, peft) unimported otherwise.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Callable

from asyncrl.config.schema import Config
from asyncrl.config.trackers import check_trackers
from asyncrl.registry import import_path

log = logging.getLogger(__name__)

Check = Callable[[Config], list[str]]


def unknown(path: str, what: str, name: str, known: list[str]) -> list[str]:
    """The line for a name that is not among `known` (an engine, an estimator, ...), with a did-you-mean."""
    if name in known:
        return []
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return [f"{path}: unknown {what} {name!r} — {hint}available: {', '.join(sorted(known))}"]


def cross_check(cfg: Config, broken: set[str] | None = None) -> list[str]:
    """Run every cross-field check whose fields converted cleanly; one line per problem.

    `broken` holds TOML paths that already failed field validation; a check reading any of them (or a
    table above or below them) is skipped rather than reporting a consequence of the same mistake.
    """
    broken = broken or set()
    errors: list[str] = []
    for paths, check, applies in CHECKS:
        if any(b == p or b.startswith(p + ".") or p.startswith(b + ".") for b in broken for p in paths):
            continue
        try:
            if applies is not None and not applies(cfg):
                continue
            errors += (import_path(check) if isinstance(check, str) else check)(cfg)
        except Exception as exc:  # a user module raising on import must not become a traceback
            errors.append(f"{paths[0]}: check failed: {type(exc).__name__}: {exc}")
    return errors


def _check_batches(cfg: Config) -> list[str]:
    sps, n = cfg.samples_per_step, cfg.trainer.mini_batches
    if sps % n == 0:
        return []
    fit = max(d for d in range(1, n + 1) if sps % d == 0)
    return [f"trainer.mini_batches: {n} does not divide samples_per_step = trainer.prompts_per_step x "
            f"rollout.group_size = {cfg.trainer.prompts_per_step} x {cfg.rollout.group_size} = {sps} "
            f"— use a divisor of {sps}, e.g. {fit}"]


def _check_ranks(cfg: Config) -> list[str]:
    """trainer.num_ranks > 1 (asyncrl/training/parallel.py): equal shares of every mini-batch; one device per
    rank."""
    t, errors = cfg.trainer, []
    w = t.num_ranks
    if w == 1:
        return errors
    sps = cfg.samples_per_step
    mini = sps // t.mini_batches
    if sps % t.mini_batches == 0 and mini % w:
        errors.append(f"trainer.num_ranks: {w} does not divide a mini-batch of samples_per_step / trainer.mini_batches "
                      f"= {sps} / {t.mini_batches} = {mini} samples (each rank trains an equal share) — use a divisor "
                      f"of {mini}, e.g. {max(d for d in range(1, w + 1) if mini % d == 0)}, or fewer mini_batches")
    if cfg.cluster.placement == "colocated":
        errors.append(f"trainer.num_ranks: {w} trainer ranks cannot share the one colocated device — use "
                      f"cluster.placement = 'disaggregated' with several ranks, or trainer.num_ranks = 1")
    elif 0 < cfg.cluster.trainer_gpus < 1:
        errors.append(f"cluster.trainer_gpus: {cfg.cluster.trainer_gpus:g} with trainer.num_ranks = {w}: each trainer "
                      f"rank needs a GPU of its own (NCCL refuses two ranks on one GPU) — set cluster.trainer_gpus = 1")
    return errors


def _check_buffers(cfg: Config) -> list[str]:
    errors: list[str] = []
    sps, pps = cfg.samples_per_step, cfg.trainer.prompts_per_step
    if cfg.buffer.rollout_capacity < sps:
        errors.append(f"buffer.rollout_capacity: {cfg.buffer.rollout_capacity} trajectories is less than one step "
                      f"(trainer.prompts_per_step x rollout.group_size = {sps}) — raise it to at least {sps}")
    if cfg.buffer.train_capacity < pps:
        errors.append(f"buffer.train_capacity: {cfg.buffer.train_capacity} groups is less than one step "
                      f"(trainer.prompts_per_step = {pps}) — raise it to at least {pps}")
    return errors


def _check_model(cfg: Config) -> list[str]:
    errors: list[str] = []
    m, tiny = cfg.model, cfg.model.build_tiny
    folder = Path(m.path)
    if tiny is None and not folder.exists():
        errors.append(f"model.path: folder {m.path!r} does not exist — point it at a local Hugging Face model "
                      f"folder, or add a [model.build_tiny] table to write a tiny model there")
    elif tiny is None and not (folder / "config.json").is_file():
        errors.append(f"model.path: {m.path!r} has no config.json — it must be a Hugging Face model folder")
    if tiny is not None:
        if tiny.hidden_size % tiny.num_heads:
            errors.append(f"model.build_tiny.num_heads: {tiny.num_heads} does not divide "
                          f"model.build_tiny.hidden_size = {tiny.hidden_size}")
        elif (tiny.hidden_size // tiny.num_heads) % 2:
            errors.append(f"model.build_tiny.num_heads: head size hidden_size / num_heads = "
                          f"{tiny.hidden_size // tiny.num_heads} must be even (rotary embeddings)")
        if tiny.num_heads % tiny.num_kv_heads:
            errors.append(f"model.build_tiny.num_kv_heads: {tiny.num_kv_heads} does not divide "
                          f"model.build_tiny.num_heads = {tiny.num_heads}")
        if tiny.experts_per_token > tiny.num_experts:
            errors.append(f"model.build_tiny.experts_per_token: {tiny.experts_per_token} is more than "
                          f"model.build_tiny.num_experts = {tiny.num_experts}")
    return errors


def _check_top_k(cfg: Config) -> list[str]:
    if cfg.rollout.top_k == 0:
        return ["rollout.top_k: 0 is not a valid top-k — use -1 (off, right for training) or a value >= 1"]
    return []


def _check_sampling(cfg: Config) -> list[str]:
    r = cfg.rollout
    if r.top_p < 1 or r.top_k > 0:
        log.warning("rollout.top_p = %s, rollout.top_k = %s: truncated sampling changes the distribution the "
                    "behaviour logprobs describe; keep top_p = 1 and top_k = -1 for training", r.top_p, r.top_k)
    return []


def _check_betas(cfg: Config) -> list[str]:
    if all(0 <= b < 1 for b in cfg.trainer.betas):
        return []
    return [f"trainer.betas: {cfg.trainer.betas} — each of AdamW's [b1, b2] must be in [0, 1), e.g. [0.9, 0.999]"]


def _check_affinity(cfg: Config) -> list[str]:
    """CPU ids must exist here when the cluster is local (a remote cluster's nodes are checked there)."""
    aff, errors = cfg.cluster.affinity, []
    if cfg.cluster.address:
        return errors
    count = os.cpu_count() or 1
    for role in ("trainer", "generator", "scorer", "buffer", "controller"):
        missing = sorted({c for c in getattr(aff, role) if c >= count})
        if missing:
            errors.append(f"cluster.affinity.{role}: CPU {', '.join(map(str, missing))} does not exist on this "
                          f"machine (CPUs 0-{count - 1})")
    return errors


# (the keys a check reads, the check or its 'module:function', when it applies: None = always)
CHECKS: list[tuple[tuple[str, ...], Check | str, Callable[[Config], bool] | None]] = [
    (("data",), "asyncrl.data.rows:check_config", None),
    (("reward", "env"), "asyncrl.rewards.setup:check_config", None),
    (("rollout.engine",), "asyncrl.deploy.placement:check_engine", None),
    (("algorithm",), "asyncrl.algorithms.checks:check_names", None),
    (("algorithm", "critic", "reference", "reward", "rollout.group_size", "rollout.max_new_tokens"),
     "asyncrl.algorithms.checks:check_options", None),
    (("reward.cost_fn", "reward.answer_key", "reward.isolation"), "asyncrl.rewards.setup:check_cost",
     lambda cfg: bool(cfg.reward.cost_fn)),
    (("trainer.mini_batches", "trainer.prompts_per_step", "rollout.group_size"), _check_batches, None),
    (("trainer", "rollout.group_size", "run.save_every", "run.save_checkpoint", "cluster.placement",
      "cluster.trainer_gpus"), _check_ranks, None),
    (("buffer", "trainer.prompts_per_step", "rollout.group_size"), _check_buffers, None),
    (("model",), _check_model, None),
    (("weight_sync.backend", "rollout.engine"), "asyncrl.deploy.placement:check_backend", None),
    (("cluster", "weight_sync.backend", "rollout.engine", "rollout.num_generators"),
     "asyncrl.deploy.placement:check_devices", None),
    (("rollout.top_k",), _check_top_k, None),
    (("rollout.top_p", "rollout.top_k"), _check_sampling, None),
    (("trainer.betas",), _check_betas, None),
    (("trainer.lr_scheduler", "trainer.warmup_steps", "trainer.total_steps"),
     "asyncrl.training.schedule:check_config", None),
    (("model", "trainer.num_ranks"), "asyncrl.training.lora:check_lora", lambda cfg: cfg.model.lora is not None),
    (("cluster", "rollout.num_generators", "reward.num_scorers"), "asyncrl.deploy.plan:check_cpus", None),
    (("cluster.affinity", "cluster.address"), _check_affinity, None),
    (("cluster.placement", "rollout.engine"), "asyncrl.deploy.placement:check_colocated", None),
    (("env", "data.max_prompt_len", "algorithm.advantage", "reward.cost_fn"), "asyncrl.envs.base:check_config",
     lambda cfg: cfg.env is not None),
    (("logging",), lambda cfg: check_trackers(cfg.logging), None),
    (("algorithm.routing_replay", "rollout.engine", "model"), "asyncrl.deploy.placement:check_routing",
     lambda cfg: cfg.algorithm.routing_replay != "off"),
    (("trainer.router_aux_loss_coef", "model"), "asyncrl.deploy.placement:check_router_aux",
     lambda cfg: cfg.trainer.router_aux_loss_coef > 0),
    (("trainer.share_prompts", "trainer.pack_sequences", "algorithm.routing_replay", "trainer.router_aux_loss_coef"),
     "asyncrl.training.sharing:check_config", lambda cfg: cfg.trainer.share_prompts),
]
