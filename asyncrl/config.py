"""Load, validate and describe a run's config (the schema lives in `config_schema.py`, reading and field-by-field
conversion in `config_fields.py`).

Place in the dataflow: the CLI calls `load_config(path, overrides)` before anything else starts; the
Controller builds every role from the returned `Config`, places actors with `plan_resources`, and writes
`config_to_toml(cfg)` into the run directory. `asyncrl launch --dry-run` prints `derived(cfg)`.

Validation reports every problem at once, one line each, naming the TOML path and the fix:
1. TOML syntax (one line, `file:line`), `extends` and `${env:VAR}` (`config_include.py`), then
   `--set section.key=value` overrides (values parsed as TOML, falling back to a plain string);
2. field by field: unknown keys (with a did-you-mean), missing required keys, and each value converted
   alone with `msgspec.convert` against its annotated type (msgspec stops at the first error, so a whole
   struct is never converted in one go); the field's `Meta(description=...)` is quoted as the hint;
3. cross-field checks (batch divisibility, queue capacities, data/reward/engine/algorithm names, CPU
   placement, ...). A check is skipped when a field it reads already failed in step 2, so one mistake
   gives one line.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import msgspec

from asyncrl.config_fields import ConfigError, convert_struct, drop_none, parse_value
from asyncrl.config_include import blame, escape_interpolation, forget, read_config
from asyncrl.config_schema import Config
from asyncrl.config_trackers import check_trackers

if TYPE_CHECKING:  # the registry imports torch; config loading imports it only when it checks algorithms
    from asyncrl.algorithms.registry import AlgorithmNeeds

__all__ = ["ActorPlan", "ConfigError", "apply_overrides", "config_from_dict", "config_to_toml", "cross_check",
           "cuda_available", "derived", "load_config", "plan_resources", "read_run_config"]

log = logging.getLogger(__name__)

ENGINE_FALLBACK = ["torch", "vllm", "sglang"]
SLEEPING_FALLBACK = ["torch"]  # engines.base.SLEEPING_ENGINES
ALGORITHM_FALLBACK = {"advantage": ["grpo"], "policy_loss": ["ppo_clip"], "loss_agg": ["token-mean"]}


class ActorPlan(msgspec.Struct, frozen=True, kw_only=True):
    """How many actors of one role to start, the logical CPUs and GPUs each asks Ray for, and its device."""

    role: str
    count: int
    cpus: float  # per actor
    gpus: float = 0.0  # per actor (asyncrl/deploy/placement.py)
    device: str = "cpu"
    resources: dict[str, float] = {}  # custom Ray resources per actor (cluster.resources.<role>)

    @property
    def total_cpus(self) -> float:
        return self.count * self.cpus


def load_config(path: str | Path, overrides: Sequence[str] = (), *, cross_checks: bool = True) -> Config:
    """Read a TOML config, apply `section.key=value` overrides, validate everything; raise ConfigError.

    `cross_checks=False` checks each field (unknown keys, types, bounds) but not the cross-field checks,
    which look at the machine a run starts on (model and data paths, reward imports, CUDA, CPU ids)."""
    raw, origins = read_config(Path(path))
    errors = apply_overrides(raw, overrides)
    for item in overrides:
        forget(origins, item.partition("=")[0].strip())
    try:
        cfg = config_from_dict(raw, cross_checks=cross_checks)
    except ConfigError as exc:
        errors += exc.errors
    if errors:
        raise ConfigError(blame(errors, origins, Path(path)))  # a value a base file set: that file and line
    return cfg


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run wrote into RUN_DIR/config.toml, for the readers of a finished run (`asyncrl report`,
    `asyncrl plan`): checked field by field, each error naming the file; a field the file lacks (a run
    written before it existed) takes its default. No cross-field checks: a finished run is read on
    whatever machine holds its directory, not the one it ran on."""
    path = Path(run_dir) / "config.toml"
    try:
        return load_config(path, cross_checks=False)
    except ConfigError as exc:
        if not path.is_file():
            raise
        raise ConfigError([f"{path}: {line}" for line in exc.errors]) from None


def config_from_dict(raw: dict[str, Any], *, cross_checks: bool = True) -> Config:
    """Validate a TOML-shaped dict (field by field, then cross-field); raise ConfigError listing all."""
    errors: list[str] = []
    broken: set[str] = set()
    cfg = convert_struct(Config, raw, "", errors, broken)
    if cross_checks:
        errors += cross_check(cfg, broken)
    if errors:
        raise ConfigError(errors)
    return cfg


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> list[str]:
    """Set each `a.b.c=value` in `raw` (in place); return one error line per malformed override."""
    errors: list[str] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            errors.append(f"--set {item}: expected section.key=value, e.g. trainer.lr=1e-4")
            continue
        node = raw
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                errors.append(f"--set {item}: {'.'.join(parts[: depth + 1])} is a value, not a table")
                break
        else:
            node[parts[-1]] = parse_value(text.strip())
    return errors


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML text (no `extends`, a literal `${` escaped); `load_config` of it gives back an
    equal Config."""
    return msgspec.toml.encode(escape_interpolation(drop_none(msgspec.to_builtins(cfg)))).decode()


def plan_resources(cfg: Config) -> list[ActorPlan]:
    """The actors a run starts, with the logical CPUs each asks for (cluster.*_cpus)."""
    from asyncrl.deploy.auto import scorers_in_buffer
    from asyncrl.deploy.placement import role_device, role_gpus

    c = cfg.cluster

    def plan(role: str, count: int, cpus: float) -> ActorPlan:
        return ActorPlan(role=role, count=count, cpus=cpus, gpus=role_gpus(cfg, role), device=role_device(cfg, role),
                         resources=dict(getattr(c.resources, role)))

    return [
        plan("generator", cfg.rollout.num_generators, c.generator_cpus),
        # scorers in the buffer actor's process (scorer_placement, asyncrl/deploy/auto.py) ask for nothing
        plan("scorer", 0 if scorers_in_buffer(cfg) else cfg.reward.num_scorers, c.scorer_cpus),
        plan("trainer", cfg.trainer.num_ranks, c.trainer_cpus),  # rank 0 and the other trainer ranks
        plan("buffer", 1, c.buffer_cpus),
    ]


def derived(cfg: Config) -> dict[str, object]:
    """Numbers that follow from the config, for `asyncrl launch --dry-run`."""
    sps = cfg.samples_per_step
    mini = sps // cfg.trainer.mini_batches
    in_flight = (cfg.staleness.max_staleness + 1) * cfg.trainer.prompts_per_step
    from asyncrl.deploy.placement import weight_backend

    plans = plan_resources(cfg)
    return {
        "samples_per_step": sps,
        "optimizer_steps_per_train_step": cfg.trainer.epochs * cfg.trainer.mini_batches,
        "samples_per_mini_batch": mini,
        "micro_batches_per_mini_batch": math.ceil(mini / cfg.trainer.micro_batch_size),
        "max_groups_in_flight": in_flight,
        "max_samples_in_flight": in_flight * cfg.rollout.group_size,
        "rollout_queue_capacity_samples": cfg.buffer.rollout_capacity,
        "train_store_capacity_groups": cfg.buffer.train_capacity,
        "actors": [{"role": p.role, "count": p.count, "cpus_each": p.cpus, "gpus_each": p.gpus, "device": p.device}
                   for p in plans],
        "cpus_requested": sum(p.total_cpus for p in plans),
        "cpus_available": cfg.cluster.num_cpus if not cfg.cluster.address else None,
        "gpus_requested": sum(p.count * p.gpus for p in plans),
        "placement": cfg.cluster.placement,
        "weight_sync_backend": weight_backend(cfg),
    }


def cuda_available() -> bool:
    """Whether torch sees a GPU (imports torch lazily; no torch means no CUDA)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def gpu_count() -> int:
    """How many GPUs torch sees here."""
    import torch

    return int(torch.cuda.device_count())


# -- cross-field checks ---------------------------------------------------------------------------------


def cross_check(cfg: Config, broken: set[str] | None = None) -> list[str]:
    """Run every cross-field check whose fields converted cleanly; one line per problem.

    `broken` holds TOML paths that already failed field validation; a check reading any of them (or a
    table above or below them) is skipped rather than reporting a consequence of the same mistake.
    """
    broken = broken or set()
    errors: list[str] = []
    for paths, check in _CHECKS:
        if any(b == p or b.startswith(p + ".") or p.startswith(b + ".") for b in broken for p in paths):
            continue
        try:
            errors += check(cfg)
        except Exception as exc:  # a user module raising on import must not become a traceback
            errors.append(f"{paths[0]}: check failed: {type(exc).__name__}: {exc}")
    return errors


def _available(module: str, attr: str, fallback: list[str]) -> list[str]:
    """Names from a registry module that may not exist yet (or may not import here)."""
    try:
        return list(getattr(importlib.import_module(module), attr)())
    except Exception as exc:  # noqa: BLE001 — any failure means "use the known defaults"
        log.debug("cannot list names from %s.%s (%s); using %s", module, attr, exc, fallback)
        return list(fallback)


def _advantage_needs(name: str) -> AlgorithmNeeds | None:
    """What estimator `name` declares it needs (asyncrl/algorithms/registry.py); None when the name is
    unknown (`_check_algorithm` reports it) or the registry does not import here (the checks that read
    the needs are then skipped, as `_available` falls back to the known names)."""
    try:
        lookup = importlib.import_module("asyncrl.algorithms.registry").advantage_needs
    except Exception as exc:  # noqa: BLE001 — any failure means "no registry to ask"
        log.debug("cannot ask the advantage registry what %r needs (%s)", name, exc)
        return None
    try:
        return lookup(name)
    except KeyError:
        return None


def _estimators_where(fits: Callable[[AlgorithmNeeds], bool]) -> str:
    """The registered estimators whose needs pass `fits`, quoted, for an error's "use ..." hint."""
    registry = importlib.import_module("asyncrl.algorithms.registry")
    return " / ".join(repr(n) for n in registry.available_advantages() if fits(registry.advantage_needs(n)))


def _unknown(path: str, what: str, name: str, known: list[str]) -> list[str]:
    if name in known:
        return []
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return [f"{path}: unknown {what} {name!r} — {hint}available: {', '.join(sorted(known))}"]


def _check_data(cfg: Config) -> list[str]:
    from asyncrl.data.rows import check_data

    return check_data(cfg.data)


def _check_reward(cfg: Config) -> list[str]:
    from asyncrl.rewards.setup import check_rewards

    errors = check_rewards(cfg.reward)
    if cfg.env is not None and (cfg.reward.functions or cfg.reward.model):
        errors.append("reward.functions: env episodes bring their own reward and are not scored by reward "
                      "functions or reward.model — leave them empty with [env]")
    return errors


def _check_engine(cfg: Config) -> list[str]:
    known = _available("engines.base", "available_engines", ENGINE_FALLBACK)
    return _unknown("rollout.engine", "engine", cfg.rollout.engine, known)


def _check_algorithm(cfg: Config) -> list[str]:
    module = "asyncrl.algorithms.registry"
    errors = _unknown("algorithm.advantage", "advantage estimator", cfg.algorithm.advantage,
                      _available(module, "available_advantages", ALGORITHM_FALLBACK["advantage"]))
    errors += _unknown("algorithm.policy_loss", "policy loss", cfg.algorithm.policy_loss,
                       _available(module, "available_policy_losses", ALGORITHM_FALLBACK["policy_loss"]))
    errors += _unknown("algorithm.loss_agg", "loss aggregation", cfg.algorithm.loss_agg,
                       _available(module, "available_loss_aggs", ALGORITHM_FALLBACK["loss_agg"]))
    return errors


def _check_algorithm_options(cfg: Config) -> list[str]:
    """Combinations of [algorithm], [critic], [reference] and the cost fields of [reward] that cannot run;
    what the estimator needs comes from its registry entry (`AlgorithmNeeds`), not from its name."""
    a, errors = cfg.algorithm, []
    needs, group_size = _advantage_needs(a.advantage), cfg.rollout.group_size
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
                      f"{_estimators_where(lambda n: n.min_group_size <= group_size)}")
    if a.safe_rlhf and not cfg.reward.cost_fn:
        errors.append("algorithm.safe_rlhf: needs a cost signal — set reward.cost_fn (e.g. 'longer_than_answer' "
                      "or 'pkg.module:function') and reward.cost_threshold")
    if a.safe_rlhf and needs is not None and (needs.critic or needs.greedy_baseline):
        errors.append(f"algorithm.safe_rlhf: the cost advantage needs a critic-free estimator without a greedy "
                      f"baseline, got advantage {a.advantage!r} — use "
                      f"{_estimators_where(lambda n: not (n.critic or n.greedy_baseline))}")
    if cfg.reward.cost_fn:
        from asyncrl.rewards import check_reward

        errors += check_reward(cfg.reward.cost_fn, cfg.reward.answer_key, "reward.cost_fn",
                               isolation=cfg.reward.isolation)
    for section, path, used in (("critic", cfg.critic.path, needs is not None and needs.critic),
                                ("reference", cfg.reference.path, a.kl_mode != "off")):
        if used and path and not (Path(path) / "config.json").is_file():
            errors.append(f"{section}.path: {path!r} is not a Hugging Face model folder (no config.json) — "
                          f"leave it empty to start from model.path")
    if a.kl_mode != "off" and a.kl_coef == 0:
        log.warning("algorithm.kl_mode = %r with kl_coef = 0: the reference model runs but changes nothing", a.kl_mode)
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
    return errors


def _check_backend(cfg: Config) -> list[str]:
    backend, engine = cfg.weight_sync.backend, cfg.rollout.engine
    if backend == "nccl" and not cuda_available():
        return ["weight_sync.backend: 'nccl' needs CUDA and torch sees no GPU here — use 'gloo' or 'auto'"]
    known = _available("engines.base", "available_engines", ENGINE_FALLBACK)  # an unknown one: _check_engine
    if backend == "ipc" and engine in known and engine not in _available("engines.base", "ipc_engines", ["torch"]):
        return [f"weight_sync.backend: 'ipc' is unsupported with rollout.engine = {engine!r} (its workers receive "
                f"through their own group) — use 'auto', 'gloo' or 'nccl', or rollout.engine = 'torch'"]
    return []


def _check_devices(cfg: Config) -> list[str]:
    """cluster.placement and *_gpus against the weight backend and this machine (asyncrl/deploy/placement.py)."""
    from asyncrl.deploy.placement import check_placement, uses_gpus

    cuda = cuda_available() if uses_gpus(cfg) or cfg.weight_sync.backend == "nccl" else False
    errors = check_placement(cfg, cuda=cuda, gpus_here=gpu_count() if cuda else 0)
    if cfg.weight_sync.backend == "nccl" and not cuda:  # _check_backend says it
        errors = [e for e in errors if not e.startswith("weight_sync.backend = 'nccl' broadcasts between GPUs")]
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


def _check_schedule(cfg: Config) -> list[str]:
    from asyncrl.training.schedule import check_schedule

    return check_schedule(cfg.trainer)


def _check_lora(cfg: Config) -> list[str]:
    """[model.lora]: peft installed, one trainer rank, target modules the model has (training/lora.py)."""
    if cfg.model.lora is None:
        return []  # (the check imports torch and transformers)
    from asyncrl.training.lora import check_lora

    return check_lora(cfg)


def _check_placement(cfg: Config) -> list[str]:
    if cfg.cluster.address:
        return []  # an existing cluster: Ray knows its size, we do not
    plans = plan_resources(cfg)
    need = sum(p.total_cpus for p in plans)
    if need <= cfg.cluster.num_cpus + 1e-9:
        return []
    parts = ", ".join(f"{p.count} {p.role}{'s' if p.count != 1 else ''} x {p.cpus:g}" for p in plans if p.count)
    return [f"cluster.num_cpus: the plan needs {need:g} CPUs ({parts}) but the local cluster has "
            f"{cfg.cluster.num_cpus:g} — lower cluster.generator_cpus (or another cluster.*_cpus) "
            f"or raise cluster.num_cpus"]


def _check_colocated(cfg: Config) -> list[str]:
    """Colocated placement puts the generators' engines to sleep around every train step: the engine must be
    one that can (engines.base.sleeping_engines(), names only: no engine is imported)."""
    if cfg.cluster.placement != "colocated":
        return []
    sleeping = _available("engines.base", "sleeping_engines", SLEEPING_FALLBACK)
    if cfg.rollout.engine in sleeping:
        return []
    return [f"cluster.placement: 'colocated' needs an engine that releases its K/V cache while the trainer trains, "
            f"which rollout.engine = {cfg.rollout.engine!r} does not do in asyncrl — use rollout.engine = "
            f"{' or '.join(map(repr, sleeping))}, or cluster.placement = 'disaggregated'"]


def _check_env(cfg: Config) -> list[str]:
    """[env]: the class resolves with async reset/step and takes env.kwargs; episodes fit the context."""
    if cfg.env is None:
        return []
    from asyncrl.envs.base import check_env, resolve_env, turn_stops

    e = cfg.env
    errors = check_env(e.env, e.kwargs)
    if not errors:
        try:
            turn_stops(resolve_env(e.env))
        except ValueError as exc:
            errors.append(str(exc))
    needs = _advantage_needs(cfg.algorithm.advantage)
    if needs is not None and needs.greedy_baseline:
        errors.append(f"env.env: advantage {cfg.algorithm.advantage!r} needs a greedy completion of each prompt as "
                      f"its baseline, which env episodes do not produce — use another algorithm.advantage "
                      f"(e.g. 'grpo') with [env]")
    if cfg.reward.cost_fn:
        errors.append("reward.cost_fn: env episodes bring their own reward and are not scored by reward.cost_fn — "
                      "leave it empty with [env] (return a cost-shaped reward from the env instead)")
    if e.max_episode_tokens >= cfg.data.max_prompt_len:
        errors.append(f"env.max_episode_tokens: {e.max_episode_tokens} leaves no room for the initial observation in "
                      f"data.max_prompt_len = {cfg.data.max_prompt_len} (the engine keeps the last max_prompt_len "
                      f"tokens of an episode's context) — raise data.max_prompt_len or lower env.max_episode_tokens")
    if not errors and (Path(cfg.model.path) / "tokenizer_config.json").is_file():
        from asyncrl.envs.transcript import HFCodec, resolve_format
        from engines.hf import load_tokenizer

        try:
            resolve_format(HFCodec(load_tokenizer(cfg.model.path)), e.chat_template)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


_Check = Callable[[Config], list[str]]
# (paths the check reads, check): a path that failed field validation skips the checks reading it.
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


_CHECKS: list[tuple[tuple[str, ...], _Check]] = [
    (("data",), _check_data),
    (("reward", "env"), _check_reward),
    (("rollout.engine",), _check_engine),
    (("algorithm",), _check_algorithm),
    (("algorithm", "critic", "reference", "reward", "rollout.group_size", "rollout.max_new_tokens"),
     _check_algorithm_options),
    (("trainer.mini_batches", "trainer.prompts_per_step", "rollout.group_size"), _check_batches),
    (("trainer", "rollout.group_size", "run.save_every", "run.save_checkpoint", "cluster.placement",
      "cluster.trainer_gpus"), _check_ranks),
    (("buffer", "trainer.prompts_per_step", "rollout.group_size"), _check_buffers),
    (("model",), _check_model),
    (("weight_sync.backend", "rollout.engine"), _check_backend),
    (("cluster", "weight_sync.backend", "rollout.engine", "rollout.num_generators"), _check_devices),
    (("rollout.top_k",), _check_top_k),
    (("rollout.top_p", "rollout.top_k"), _check_sampling),
    (("trainer.betas",), _check_betas),
    (("trainer.lr_scheduler", "trainer.warmup_steps", "trainer.total_steps"), _check_schedule),
    (("model", "trainer.num_ranks"), _check_lora),
    (("cluster", "rollout.num_generators", "reward.num_scorers"), _check_placement),
    (("cluster.affinity", "cluster.address"), _check_affinity),
    (("cluster.placement", "rollout.engine"), _check_colocated),
    (("env", "data.max_prompt_len", "algorithm.advantage", "reward.cost_fn"), _check_env),
    (("logging",), lambda cfg: check_trackers(cfg.logging)),
]
