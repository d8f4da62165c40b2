"""Builds each role from the run's Config, inside whatever process will host it.

The same builders serve the in-process runtime (tests, debugging) and the Ray actors, so a role is
constructed identically in both; only how collaborators are reached differs (direct object vs proxy).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from typing import Any

import torch

from asyncrl.algorithms.advantages import LagrangeMultiplier
from asyncrl.algorithms.registry import advantage_needs
from asyncrl.config.schema import Config
from asyncrl.data.prompts import PromptEncoder, prompt_rows
from asyncrl.data.rows import PromptStream
from asyncrl.deploy.build_scoring import (  # noqa: F401 - the buffer's builders, found here with the others
    LazyDecode,
    build_buffer,
    build_reference,
    build_rewards,
    build_scorer,
    tokenizer_fns,
)
from asyncrl.deploy.placement import role_device
from asyncrl.messages import SamplingParams
from asyncrl.roles.evaluator import Evaluator
from asyncrl.roles.generator import Generator
from asyncrl.roles.trainer import Trainer
from asyncrl.roles.trainer_ranks import TrainerRank
from asyncrl.training import precision
from asyncrl.training.critic import Critic, load_value_model
from asyncrl.training.learner import Learner
from asyncrl.training.parallel import DataParallel
from engines.base import create_engine, traits
from engines.hf import load_model, load_tokenizer, torch_dtype

log = logging.getLogger(__name__)


def head_options(cfg: Config, engine: str | None = None) -> dict[str, Any]:
    """The engine keyword for rollout.lm_head_fp32 where engine `engine` (default rollout.engine) takes it
    (EngineTraits.fp32_head); nothing otherwise: vLLM and SGLang compute their logits in their own dtype."""
    return {"lm_head_fp32": True} if cfg.rollout.lm_head_fp32 and traits(engine or cfg.rollout.engine).fp32_head else {}


def derive_seed(base: int, *keys: object) -> int:
    """A stable 31-bit seed per (base, keys): each generator and role gets its own stream."""
    digest = hashlib.sha256(repr((base, *keys)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def training_sampling(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop_token_ids=list(r.stop_token_ids),
                          stop=list(r.stop), ignore_eos=r.ignore_eos)


def engine_dtype(cfg: Config) -> str:
    """The rollout engines' parameter dtype (rollout.dtype; auto = model.dtype), which the weight sync sends
    floating-point tensors in (`sync_dtype`)."""
    return precision.engine_dtype(cfg.model.dtype, cfg.rollout.dtype)


def sync_dtype(cfg: Config) -> torch.dtype:
    """`engine_dtype` as a torch.dtype: what the trainer's sender converts its weights to, bucket by bucket."""
    return torch_dtype(engine_dtype(cfg))


def trained_dtype(cfg: Config) -> str:
    """The dtype the trainer loads the models it trains in: float32 master weights under mixed precision."""
    return precision.master_dtype(cfg.model.dtype, cfg.trainer.mixed_precision)


def export_dtype(cfg: Config) -> str:
    """The dtype of the final HF folder (run.export_dtype): "auto" is model.dtype, the dtype the model is
    configured in, not the float32 master weights mixed precision trains."""
    return cfg.model.dtype if cfg.run.export_dtype == "auto" else cfg.run.export_dtype


def load_policy(cfg: Config) -> torch.nn.Module:
    """The trainer's policy from model.path, with LoRA adapters under [model.lora] (training/lora.py)."""
    model = load_model(cfg.model.path, dtype=trained_dtype(cfg), device=role_device(cfg, "trainer"))
    if cfg.model.lora is not None:
        from asyncrl.training.lora import apply_lora

        model = apply_lora(model, cfg.model.lora)
    return model


def build_generator(cfg: Config, generator_id: int, buffer: Any, *, shared_model: torch.nn.Module | None = None,
                    ) -> Generator:
    """A generator and its engine. `shared_model`: the trainer's module, for a torch engine that wraps it
    without a copy (in process with cluster.placement = "colocated": asyncrl/deploy/local.py)."""
    seed = derive_seed(cfg.run.seed, "generator", generator_id)
    tok, decode = tokenizer_fns(cfg.model.path)
    # algorithm.routing_replay: the engine records an MoE model's routing (the native engine: config checks);
    # rollout.lm_head_fp32 where the engine takes it
    options = {"record_routing": True} if cfg.algorithm.routing_replay != "off" else {}
    options.update(head_options(cfg))
    if shared_model is not None:
        from engines.hf import eos_token_ids
        from engines.torch_engine import TorchEngine

        engine = TorchEngine.from_model(shared_model, eos_token_ids=eos_token_ids(shared_model),
                                        max_prompt_len=cfg.data.max_prompt_len, seed=seed, detokenize=decode,
                                        kv_on_update=cfg.rollout.kv_on_update, **options)
    else:
        # an in-process engine on the generator's device (cluster.generator_gpus); vLLM / SGLang place their workers
        where = {"device": role_device(cfg, "generator")} if traits(cfg.rollout.engine).in_process else {}
        engine = create_engine(cfg.rollout.engine, model_path=cfg.model.path, dtype=engine_dtype(cfg),
                               max_prompt_len=cfg.data.max_prompt_len, seed=seed, detokenize=decode,
                               kv_on_update=cfg.rollout.kv_on_update, **where, **options)
    # one prompt order for the run, indexed by group id (every generator, and a resumed run, agree on it:
    # the same rows, screened by data.overlong the same way)
    encoder = PromptEncoder(tok, cfg.data)
    rows, filtered = prompt_rows(cfg, "train", encoder)
    stream = PromptStream(rows, seed=derive_seed(cfg.run.seed, "data"), shuffle=cfg.data.shuffle)
    generator = Generator(generator_id=generator_id, engine=engine, buffer=buffer, prompt_row=stream.row,
                          encode=encoder.encode, sampling=training_sampling(cfg), prompts_filtered=filtered,
                          concurrency=cfg.rollout.concurrency, weight_update=cfg.rollout.weight_update,
                          greedy_baseline=advantage_needs(cfg.algorithm.advantage).greedy_baseline,
                          group_seed=(lambda gid: derive_seed(cfg.run.seed, "group", gid))
                          if cfg.rollout.seed_groups else None, decode=decode)
    if cfg.env is not None:  # multi-turn environment episodes (asyncrl/envs)
        from asyncrl.envs.setup import episode_runner

        generator.episodes = episode_runner(cfg, engine, load_tokenizer(cfg.model.path))
    return generator


def build_learner(cfg: Config, model: torch.nn.Module, pad_id: int, parallel: DataParallel | None = None) -> Learner:
    """The policy learner with what the algorithm needs: critic (the estimator's AlgorithmNeeds, e.g. gae),
    reference (KL in the trainer), Lagrange multiplier (Safe-RLHF); `parallel`: this rank's trainer group."""
    a = cfg.algorithm
    critic = reference = lagrange = None
    device = role_device(cfg, "trainer")  # the critic and the reference follow the trainer
    if advantage_needs(a.advantage).critic:
        critic = Critic(load_value_model(cfg.critic.path or cfg.model.path, trained_dtype(cfg)), cfg.critic,
                        pad_token_id=pad_id, micro_batch_size=cfg.trainer.micro_batch_size, device=device,
                        mixed_precision=cfg.trainer.mixed_precision,
                        gradient_checkpointing=cfg.model.gradient_checkpointing,
                        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
                        routing_replay=a.routing_replay)
    if a.kl_mode != "off" and cfg.reference.where == "trainer" and cfg.model.lora is not None \
            and not cfg.reference.path:  # the policy with its adapters off is the initial policy: no second copy
        from asyncrl.training.lora import AdapterOffReference

        reference = AdapterOffReference(model, pad_token_id=pad_id, micro_batch_size=cfg.trainer.micro_batch_size,
                                        device=device, mixed_precision=cfg.trainer.mixed_precision,
                                        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
                                        logprob_chunk_tokens=cfg.trainer.logprob_chunk_tokens,
                                        lm_head_fp32=cfg.trainer.lm_head_fp32)
    elif a.kl_mode != "off" and cfg.reference.where == "trainer":
        reference = build_reference(cfg, device)
    if a.safe_rlhf:
        r = cfg.reward
        lagrange = LagrangeMultiplier(r.lagrange_init, r.lagrange_lr, r.cost_threshold,
                                      r.lagrange_max if r.lagrange_max > 0 else None)
    return Learner(model, algorithm=a, trainer=cfg.trainer, pad_token_id=pad_id,
                   max_new_tokens=cfg.rollout.max_new_tokens, critic=critic, reference=reference, lagrange=lagrange,
                   device=device, gradient_checkpointing=cfg.model.gradient_checkpointing, parallel=parallel,
                   # LoRA: the torch engine takes a subset of the weights; vLLM and SGLang get every weight
                   sync_all_weights=not traits(cfg.rollout.engine).subset_weights)


def build_trainer(cfg: Config, buffer: Any, parallel: DataParallel | None = None) -> Trainer:
    """The trainer (rank 0 of `parallel`'s group when given: its ranks are attached once they are all built)."""
    torch.manual_seed(derive_seed(cfg.run.seed, "trainer"))  # the same on every rank: the same critic head
    model = load_policy(cfg)
    tok, decode = tokenizer_fns(cfg.model.path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    # The evaluator gets a copy of its own (Trainer.eval_model, refreshed before each evaluation) where fsdp2 shards
    # `model` in place, and where the engines hold another dtype than the trained weights (bf16 rollouts of float32
    # master weights): it evaluates the policy as the generators run it, at their speed. Not with LoRA (the copy
    # would be a peft model, the sync's names the base model's): it evaluates the trainer's own module.
    sharded = parallel is not None and parallel.mode == "fsdp2"
    eval_dtype = engine_dtype(cfg)
    copied = cfg.trainer.eval_every > 0 and (sharded or (eval_dtype != trained_dtype(cfg) and cfg.model.lora is None))
    eval_model = copy.deepcopy(model).to(torch_dtype(eval_dtype)) if copied else None
    learner = build_learner(cfg, model, pad_id, parallel)
    evaluator = None
    if cfg.trainer.eval_every > 0:
        from engines.hf import eos_token_ids
        from engines.torch_engine import TorchEngine

        encoder = PromptEncoder(tok, cfg.data)
        rows, _ = prompt_rows(cfg, "eval", encoder)
        engine = TorchEngine.from_model(model if eval_model is None else eval_model, eos_token_ids=eos_token_ids(model),
                                        max_prompt_len=cfg.data.max_prompt_len,
                                        seed=derive_seed(cfg.run.seed, "eval"), detokenize=decode,
                                        **head_options(cfg, "torch"))
        if cfg.env is not None:  # held-out env episodes on the same engine and rows (they bring their rewards)
            from asyncrl.envs.setup import env_evaluator

            evaluator = env_evaluator(cfg, engine, tok, rows)
        else:
            evaluator = Evaluator(engine=engine, rows=rows, encode=encoder.encode, decode=decode,
                                  rewards=build_rewards(cfg.reward, with_cost=False,
                                                        device=role_device(cfg, "trainer")),
                                  max_new_tokens=cfg.rollout.max_new_tokens,
                                  temperature=cfg.rollout.temperature, seed=derive_seed(cfg.run.seed, "eval"),
                                  samples=cfg.logging.rollouts_every > 0)
    return Trainer(learner=learner, buffer=buffer, evaluator=evaluator, decode=decode,
                   rollouts_every=cfg.logging.rollouts_every, eval_model=eval_model)


def build_trainer_rank(cfg: Config, parallel: DataParallel) -> TrainerRank:
    """Trainer rank r > 0 (asyncrl/roles/trainer_ranks.py): a Learner built as rank 0's is."""
    torch.manual_seed(derive_seed(cfg.run.seed, "trainer"))
    model = load_policy(cfg)
    tok, _ = tokenizer_fns(cfg.model.path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    return TrainerRank(build_learner(cfg, model, pad_id, parallel), parallel.rank)
