"""Learner: the single-process training core — groups in, one policy version out.

Place in the dataflow: the Trainer role takes a step's groups off the train store and calls
`Learner.update(groups)`; afterwards it broadcasts `state_dict_for_sync()` to the generators, stamped with
`Learner.version`. No Ray, no queues here: this is plain torch, testable in-process. The algorithms are
the registered pure functions of `asyncrl/algorithms` (docs/algorithms.md); this file only feeds them.

One train step (ARCHITECTURE "Batch units"):

    groups ─► flatten (samples_per_step trajectories; "error" / greedy ones rejected)
           ─► prepare (no grad, once per step; every tensor response-aligned [N, T]):
                rewards (+ DAPO overlong shaping, reward_norm, reward_clip)
                proximal logprobs    (decoupled PPO or an off-policy correction: this policy, now; the
                                      gradient pass's own when it is the step's only one: `_first_pass`)
                reference logprobs   (KL: from the scorer's `ref_logprobs`, or a forward here)
                critic values        (an estimator that needs a critic: gae)
                advantages by `[algorithm] advantage` (KL as token rewards; Safe-RLHF: A_r − λ·A_c)
                off-policy weights and mask (proximal / behaviour, `[algorithm] correction`)
           ─► for epoch in epochs: for each of `mini_batches` mini-batches:
                  zero grads; for each micro-batch (`micro_batch_size` samples, or by the token budget
                  `max_tokens_per_micro_batch`: training/micro.py):
                      forward (logits / each trajectory's temperature) → logprobs (+ entropy)
                      → `policy_loss` vs the old policy (behaviour, or proximal if decoupled)
                        × off-policy weights (+ kl_coef·KL, − entropy_coef·entropy per token)
                      → `loss_agg` over the kept tokens of the whole mini-batch → backward
                  clip grad norm (`grad_clip`, 0 = off), optimizer step; critic: value loss, its step
           ─► Safe-RLHF multiplier update from the step's mean cost; version += 1

Schedule and LoRA: the AdamW learning rate follows `trainer.lr_scheduler` (training/schedule.py), stepped after
every optimizer step; under `[model.lora]` the model is a peft model whose adapters alone train, and the
weights the generators get are merged (training/lora.py).

Numerics (training/precision.py): with `trainer.mixed_precision = "bf16"` the model, its gradients and the AdamW
state are float32 and every forward runs under bfloat16 autocast (logprobs still float32); with
`model.gradient_checkpointing` the gradient passes of `compute_gradients` recompute each layer's activations.

Token positions: a sample is `prompt_ids + response_ids` right-padded to the micro-batch's longest; the
logprob at position t is that of token t predicted from t-1, so position 0 never carries one.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from asyncrl.algorithms import advantage_needs, get_advantage, get_loss_agg, get_policy_loss
from asyncrl.algorithms.advantages import (
    AdvantageInput,
    AdvantageParams,
    LagrangeMultiplier,
    lagrangian_advantages,
    overlong_penalty,
)
from asyncrl.algorithms.kl import kl_estimate
from asyncrl.algorithms.losses import PolicyLossParams
from asyncrl.algorithms.offpolicy import CorrectionParams, offpolicy_weights
from asyncrl.checkpoints.store import load_optimizer_state, load_scheduler_state, optimizer_state, scheduler_state
from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
from asyncrl.messages import Group, Trajectory
from asyncrl.training import lora, precision, schedule, sharded
from asyncrl.training.batch import (
    GradientStats,
    StepData,
    TokenBatch,
    collate,
    compiled,
    flatten_groups,
    gather_response,
    response_rows,
)
from asyncrl.training.critic import Critic, CriticStats, explained_variance
from asyncrl.training.logprobs import packed_logprobs, shared_prompt_logprobs, token_logprobs
from asyncrl.training.micro import MicroBatching, in_order, lengths
from asyncrl.training.optim import adamw, all_finite, match_fused
from asyncrl.training.parallel import SingleProcess
from asyncrl.training.reference import ReferencePolicy
from asyncrl.training.routing import RouterAuxLoss, RoutingReplay
from asyncrl.training.sharing import SharedRows, attention_kind, share_prompts

__all__ = ["GradientStats", "Learner", "StepData", "TokenBatch", "collate"]

logger = logging.getLogger(__name__)

_RATIO_KEYS = ("is_ratio_mean", "is_ratio_max", "is_ratio_min", "share_clipped", "share_masked")


class Learner:
    """Owns the policy model and its AdamW optimizer (and, when configured, the critic, the reference
    policy and the Safe-RLHF multiplier); `update` runs one train step (see module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        algorithm: AlgorithmConfig,
        trainer: TrainerConfig,
        pad_token_id: int,
        device: str | torch.device = "cpu",
        max_new_tokens: int | None = None,
        critic: Critic | None = None,
        reference: ReferencePolicy | None = None,
        lagrange: LagrangeMultiplier | None = None,
        gradient_checkpointing: bool = False,
        parallel: SingleProcess | None = None,
        sync_all_weights: bool = False,
    ) -> None:
        self.device = torch.device(device)
        # trainer.mixed_precision (training/precision.py): float32 master weights (and so float32 AdamW state),
        # forwards under autocast
        self.autocast = precision.autocast_dtype(trainer.mixed_precision)
        precision.check_autocast(self.device, self.autocast)
        self.model = model.to(self.device) if self.autocast is None else model.to(self.device, torch.float32)
        # Dropout off: the trainer's logprobs must be the engine's (which samples in eval mode).
        self.model.eval()
        # algorithm.routing_replay (training/routing.py): an MoE policy's routers, patched before any wrapping
        self.routing = RoutingReplay(self.model, algorithm.routing_replay) if algorithm.routing_replay != "off" \
            else None
        if reference is not None and reference.model is self.model and self.routing is not None \
                and self.routing.replay:  # LoRA's adapter-off reference is this module: its routers, this replay
            reference.routing = self.routing
        # trainer.router_aux_loss_coef: the MoE's load-balancing loss added to each gradient pass's loss
        self.router_aux = RouterAuxLoss(self.model, trainer.router_aux_loss_coef) \
            if trainer.router_aux_loss_coef > 0 else None
        self._checkpointing = gradient_checkpointing
        if gradient_checkpointing:  # model.gradient_checkpointing: active in compute_gradients only
            precision.enable_gradient_checkpointing(self.model)
        # trainer.num_ranks > 1 (training/parallel.py): each rank trains its share of every mini-batch through
        # `train_model` (DDP's wrapper; FSDP2 shards `model` in place, so the optimizer is built after this)
        # and so do the critic and the frozen reference (FSDP2 shards it; DDP keeps a replica)
        self.dp = parallel or SingleProcess()
        self.train_model = self.dp.wrap(self.model)
        # the gradient passes' module: compiled with trainer.compile (same parameters and names: batch.compiled)
        self.forward_model = compiled(self.train_model) if trainer.compile else self.train_model
        if critic is not None:
            critic.distribute(self.dp, compile=trainer.compile)
        if self.dp.world_size > 1 and reference is not None:
            self.dp.wrap(reference.model, trainable=False)
        self.algorithm = a = algorithm
        self.trainer = trainer
        self.pad_token_id = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.batching = MicroBatching(trainer.micro_batch_size, trainer.max_tokens_per_micro_batch)
        if trainer.share_prompts and attention_kind(getattr(self.model, "config", None)) is None:
            raise ValueError("trainer.share_prompts needs the policy's attention to take a custom mask (sdpa or "
                             "eager); this model's does not — set trainer.share_prompts = false")
        # Look the names up now: an unknown name fails at construction, listing the known ones.
        self._advantage_fn = get_advantage(a.advantage)
        self._needs = advantage_needs(a.advantage)
        self._policy_loss_fn = get_policy_loss(a.policy_loss)
        self._loss_agg_fn = get_loss_agg(a.loss_agg)
        self._adv_params = AdvantageParams(gamma=a.gamma, lam=a.lam, eps=a.adv_eps, whiten=a.whiten_advantages)
        self._loss_params = PolicyLossParams(clip_eps_low=a.clip_eps_low or a.clip_eps,
                                             clip_eps_high=a.clip_eps_high or a.clip_eps,
                                             dual_clip=a.dual_clip or None)
        self._correction = CorrectionParams(mode=a.correction, cap=a.correction_cap, low=a.correction_low,
                                            high=a.correction_high)
        # The proximal policy (this one, at the step's start) is needed as PPO's old policy (decoupled)
        # and as the target of every off-policy correction.
        self._need_prox = a.decoupled or a.correction != "none"
        if self._needs.critic and critic is None:
            raise ValueError(f"algorithm.advantage = {a.advantage!r} needs a critic (a value model)")
        if a.safe_rlhf and lagrange is None:
            raise ValueError("algorithm.safe_rlhf needs a LagrangeMultiplier")
        if a.loss_agg == "seq-mean-token-sum-norm" and not max_new_tokens:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs max_new_tokens (rollout.max_new_tokens)")
        self.critic = critic
        self.reference = reference
        self.lagrange = lagrange
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.skipped_in_a_row = 0  # train steps whose every optimizer step was skipped (non-finite norms)
        self.optimizer = adamw(self._params, trainer)
        self.scheduler = schedule.build_scheduler(self.optimizer, trainer)
        self.last_lr: float = self.optimizer.param_groups[0]["lr"]  # of the latest optimizer step: trainer/lr
        # LoRA: the sync sends merged weights, only the adapted layers' unless the engines need every weight
        self.lora, self._sync_all = lora.is_lora(self.model), sync_all_weights
        self.version: int = 0

    # ------------------------------------------------------------------ logprobs

    def sequence_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, temperature: float | Tensor,
        *, entropy_grad: bool = False, model: torch.nn.Module | None = None, rows: SharedRows | None = None,
    ) -> tuple[Tensor, Tensor]:
        """[B, L] each, temperature float or [B] -> (logprobs [B, L], entropy [B, L]); see
        training/logprobs.py (trainer.logprob_chunk_tokens, pack_sequences, share_prompts). `rows`: the batch's
        shared layout where the caller built it (trainer.share_prompts)."""
        model = self.model if model is None else model
        kwargs = {"entropy_grad": entropy_grad, "autocast": self.autocast, "chunk": self.trainer.logprob_chunk_tokens,
                  "float_head": self.trainer.lm_head_fp32}
        if self.trainer.share_prompts:
            return shared_prompt_logprobs(model, input_ids, attention_mask, response_mask, temperature, rows=rows,
                                          **kwargs)
        fn = packed_logprobs if self.trainer.pack_sequences else token_logprobs
        return fn(model, input_ids, attention_mask, response_mask, temperature, **kwargs)

    @torch.no_grad()
    def teacher_forced_logprobs(
        self, prompt_ids: list[int], response_ids: list[int], temperature: float
    ) -> list[float]:
        """The current policy's logprob of each response token given the prompt (one per response token)."""
        if not prompt_ids:
            raise ValueError("teacher_forced_logprobs needs at least one prompt token")
        ids = torch.tensor([prompt_ids + response_ids], dtype=torch.long, device=self.device)
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[0, len(prompt_ids):] = True
        logprobs, _ = self.sequence_logprobs(ids, torch.ones_like(ids), resp, temperature)
        return logprobs[0, len(prompt_ids):].tolist()

    @torch.no_grad()
    def _policy_rows(self, trajectories: list[Trajectory], width: int, parts: list[list[int]]) -> Tensor:
        """-> [N, width] the current policy's logprobs of every response token (no grad), micro-batch by
        micro-batch (`parts`: indices into `trajectories`)."""
        rows: list[Tensor] = []
        for idx in parts:
            part = [trajectories[i] for i in idx]
            batch = collate(part, torch.zeros(len(part)), self.pad_token_id, self.device)
            with self._routing(part, batch):
                logprobs, _ = self.sequence_logprobs(batch.input_ids, batch.attention_mask, batch.response_mask,
                                                     batch.temperature)
            rows.append(gather_response(batch, part, logprobs, width))
        return in_order(rows, parts)

    # ------------------------------------------------------------------ step preparation

    def prepare(self, trajectories: list[Trajectory], prox: Tensor | None = None) -> StepData:
        """Everything a step computes once, before its optimizer steps (no grad): see module doc. `prox`: the
        proximal logprobs [N, T] when the caller has them already (`_first_pass`)."""
        a, trajs = self.algorithm, trajectories
        behaviour, mask = response_rows(trajs)
        width = mask.shape[1]
        metrics: dict[str, float] = {}
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        baselines = self._baselines(trajs, metrics) if self._needs.greedy_baseline else None
        if a.overlong_buffer > 0:
            lengths = torch.tensor([len(t.response_ids) for t in trajs])
            shaping = overlong_penalty(lengths, self._max_len(), a.overlong_buffer, a.overlong_penalty)
            rewards = rewards + shaping
            metrics["dapo/overlong_penalty_mean"] = float(shaping.mean())
            metrics["dapo/overlong_share"] = float((shaping < 0).float().mean())
            if baselines is not None:
                b_len = torch.tensor([len(t.baseline_response_ids) for t in trajs])
                baselines = baselines + overlong_penalty(b_len, self._max_len(), a.overlong_buffer, a.overlong_penalty)
        rewards, baselines = self._normalise(rewards, baselines)
        rows: dict[str, Tensor] = {}
        if self._need_prox:
            rows["prox"] = prox if prox is not None else self._sharded_rows(self._policy_rows, trajs, width)
        token_rewards = None
        if a.kl_mode != "off":
            rows["ref"] = self._reference_rows(trajs, width)
            policy = rows.get("prox", behaviour)
            kl = kl_estimate(policy, rows["ref"], a.kl_estimator, mask=mask)
            metrics["kl/ref_mean"] = float(kl[mask].mean()) if mask.any() else 0.0
            if a.kl_mode == "reward":
                token_rewards = -a.kl_coef * kl
        values = self._sharded_rows(self.critic.values, trajs, width) if self.critic is not None else None
        group_ids = torch.tensor([t.group_id for t in trajs], dtype=torch.long)
        out = self._advantage_fn(AdvantageInput(rewards=rewards, group_ids=group_ids, mask=mask, values=values,
                                                token_rewards=token_rewards, baselines=baselines), self._adv_params)
        advantages, costs = out.advantages, None
        if a.safe_rlhf:
            advantages, costs = self._safety(trajs, group_ids, mask, advantages, metrics)
        if self._need_prox:
            weights, keep, cstats = offpolicy_weights(rows["prox"], behaviour, mask, self._correction)
            rows["weights"], rows["keep"] = weights, keep
            metrics.update({f"offpolicy/{k}": float(cstats[k]) for k in _RATIO_KEYS})
        if values is not None and out.returns is not None:
            metrics["critic/explained_variance"] = explained_variance(values, out.returns, mask)
            metrics["critic/value_mean"] = float(values[mask].mean()) if mask.any() else 0.0
            metrics["critic/return_mean"] = float(out.returns[mask].mean()) if mask.any() else 0.0
        return StepData(advantages=advantages, rows=rows, returns=out.returns, old_values=values,
                        rewards=rewards, costs=costs, metrics=metrics)

    def _sharded_rows(self, rows_of: Any, trajs: list[Trajectory], width: int) -> Tensor:
        """[N, width] = rows_of(trajectories, width, micro-batches), each rank forwarding its share
        (training/parallel.py) in as many micro-batches as every other rank (training/micro.py)."""
        lo, hi = self.dp.shard(0, len(trajs))
        parts = self.batching.agreed(lengths(trajs), self.dp.shards(0, len(trajs)), self.dp.rank,
                                     prompts=self._prompts(trajs))
        return self.dp.all_gather_rows(rows_of(trajs[lo:hi], width, parts))

    def _prompts(self, trajs: list[Trajectory]) -> list[list[int]] | None:
        """Each sample's prompt ids where the micro-batches are cut as shared rows (trainer.share_prompts)."""
        return [t.prompt_ids for t in trajs] if self.trainer.share_prompts else None

    def _max_len(self) -> int:
        if not self.max_new_tokens:
            raise ValueError("DAPO overlong shaping needs max_new_tokens (rollout.max_new_tokens)")
        return self.max_new_tokens

    def _baselines(self, trajs: list[Trajectory], metrics: dict[str, float]) -> Tensor:
        missing = [t.seq_id for t in trajs if t.baseline_reward is None]
        if missing:
            raise ValueError(f"advantage {self.algorithm.advantage!r} needs the greedy baseline reward of every "
                             f"sample; trajectory {missing[0]} has none (the generator samples it when the "
                             f"estimator declares greedy_baseline)")
        baselines = torch.tensor([t.baseline_reward for t in trajs], dtype=torch.float32)
        metrics["remax/baseline_reward"] = float(baselines.mean())
        return baselines

    def _normalise(self, rewards: Tensor, baselines: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """reward_norm then reward_clip; ReMax baselines get the same affine map, so r − b stays comparable."""
        a = self.algorithm
        if a.reward_norm != "none" and rewards.numel() > 1:
            std = rewards.std(correction=0) + a.adv_eps
            shift = rewards.mean() if a.reward_norm == "whiten" else torch.zeros(())
            rewards = (rewards - shift) / std
            baselines = None if baselines is None else (baselines - shift) / std
        if a.reward_clip > 0:
            rewards = rewards.clamp(-a.reward_clip, a.reward_clip)
            baselines = None if baselines is None else baselines.clamp(-a.reward_clip, a.reward_clip)
        return rewards, baselines

    def _reference_rows(self, trajs: list[Trajectory], width: int) -> Tensor:
        """[N, width] reference logprobs: the scorer's when every trajectory carries them, else computed here."""
        if all(len(t.ref_logprobs) == len(t.response_ids) for t in trajs):
            rows, _ = response_rows(trajs, [t.ref_logprobs for t in trajs])
            return (rows[:, :width] if rows.shape[1] >= width
                    else torch.nn.functional.pad(rows, (0, width - rows.shape[1])))
        if self.reference is None:
            bad = next(t.seq_id for t in trajs if len(t.ref_logprobs) != len(t.response_ids))
            raise ValueError(f"trajectory {bad} has no reference logprobs and the trainer holds no reference "
                             f"policy — check [reference] where (the scorer fills them when it is 'scorer')")
        return self._sharded_rows(self._reference_forward, trajs, width)

    def _reference_forward(self, trajs: list[Trajectory], width: int, parts: list[list[int]]) -> Tensor:
        assert self.reference is not None
        rows, _ = response_rows(trajs, self.reference.response_logprobs(trajs, parts))
        return torch.nn.functional.pad(rows, (0, width - rows.shape[1]))

    def _safety(self, trajs: list[Trajectory], group_ids: Tensor, mask: Tensor, adv_reward: Tensor,
                metrics: dict[str, float]) -> tuple[Tensor, Tensor]:
        """Safe-RLHF: cost advantages by the same estimator, combined with the current λ."""
        assert self.lagrange is not None
        costs = torch.tensor([t.cost for t in trajs], dtype=torch.float32)
        adv_cost = self._advantage_fn(AdvantageInput(rewards=costs, group_ids=group_ids, mask=mask),
                                      self._adv_params).advantages
        lam = self.lagrange.value
        metrics["safety/lambda"] = lam
        metrics["safety/cost_mean"] = float(costs.mean())
        metrics["safety/cost_threshold"] = self.lagrange.threshold
        return lagrangian_advantages(adv_reward, adv_cost, lam), costs

    # ------------------------------------------------------------------ gradients

    def compute_gradients(
        self,
        trajectories: list[Trajectory],
        advantages: Tensor,
        *,
        micro_batch_size: int | None = None,
        diagnose: bool = False,
        stats: GradientStats | None = None,
        rows: dict[str, Tensor] | None = None,
        measure_ratio: bool = False,
        global_counts: tuple[int, int] | None = None,
        first_pass: tuple[Tensor, Tensor] | None = None,
        parts: list[list[int]] | None = None,
    ) -> GradientStats:
        """Accumulate into each parameter's .grad the gradient of the aggregated loss of these samples
        (one mini-batch), one micro-batch at a time: `parts` (indices into `trajectories`; default: cut by
        `self.batching`, or in runs of `micro_batch_size` samples if given). Does not zero grads.

        trajectories (n), advantages [n] (one per sample) or [n, T] (response-aligned), rows: the
        StepData rows of these samples ([n, T] each: prox, ref, weights, keep). `diagnose` also measures
        approx KL and the logprob gap (valid only before any optimizer step of this train step);
        `measure_ratio` records the current / behaviour ratio (when no proximal policy was computed).
        `global_counts` (loss tokens, sequences) of the whole mini-batch when these samples are one rank's
        share of it (default: counted here). `first_pass`: (logprobs, entropy) of these samples as one micro-batch,
        already computed with grad by `_first_pass`. Adds into `stats` if given; returns it.
        """
        a = self.algorithm
        stats = stats if stats is not None else GradientStats()
        if first_pass is not None:
            parts = [list(range(len(trajectories)))]
        elif parts is None:
            batching = MicroBatching(micro_batch_size) if micro_batch_size else self.batching
            parts = batching.split(lengths(trajectories), prompts=self._prompts(trajectories))
        rows = rows or {}
        global_tokens, global_seqs = global_counts or _loss_counts(trajectories, rows)
        loss_total = 0.0
        # model.gradient_checkpointing and LoRA dropout: on for this pass only
        with precision.checkpointing(self.model), lora.adapter_dropout(self.model):
            for j, idx in enumerate(parts):
                part = [trajectories[i] for i in idx]
                # accumulate locally; only the last micro-batch's backward reduces over the ranks
                with self.dp.sync_gradients(self.train_model, sync=j == len(parts) - 1):
                    sl = torch.tensor(idx, dtype=torch.long)
                    batch = collate(part, advantages[sl], self.pad_token_id, self.device,
                                    extras={k: v[sl] for k, v in rows.items()})
                    shared = share_prompts(batch.input_ids, batch.attention_mask, batch.response_mask) \
                        if self.trainer.share_prompts else None
                    # the replayed routing stays in place through the backward (checkpointing recomputes there)
                    with self._routing(part, batch, count=diagnose) if first_pass is None else nullcontext(), \
                            self.router_aux.collecting() if self.router_aux is not None else nullcontext():
                        if first_pass is not None:
                            logprobs, entropy = first_pass
                        else:
                            logprobs, entropy = self.sequence_logprobs(batch.input_ids, batch.attention_mask,
                                                                       batch.response_mask, batch.temperature,
                                                                       entropy_grad=a.entropy_coef > 0,
                                                                       model=self.forward_model, rows=shared)
                        loss, loss_stats = self._micro_loss(batch, logprobs, entropy, global_tokens, global_seqs)
                        if self.router_aux is not None:  # packed: one row of real tokens, no mask
                            mask = None if self.trainer.pack_sequences else batch.attention_mask
                            loss = loss + self.router_aux.loss(mask, len(idx) / max(global_seqs, 1))
                        loss.backward()
                    loss_total += loss.item()
                    stats.record(batch, logprobs.detach(), entropy.detach(), loss_stats, self.version,
                                 diagnose=diagnose, measure_ratio=measure_ratio and "prox" not in batch.extras,
                                 computed=None if shared is None else (shared.cells, shared.tokens))
        stats.loss += loss_total
        return stats

    def _micro_loss(self, batch: TokenBatch, logprobs: Tensor, entropy: Tensor, global_tokens: int,
                    global_seqs: int) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's share of the mini-batch's aggregated loss (policy loss, correction weights, KL in the
        loss, entropy bonus), and the policy loss's statistics."""
        a = self.algorithm
        mask = batch.extras["keep"] if "keep" in batch.extras else batch.loss_mask
        old = batch.extras["prox"] if a.decoupled else batch.old_logprobs
        loss_tok, loss_stats = self._policy_loss_fn(logprobs, old, batch.advantages, mask, self._loss_params)
        if "weights" in batch.extras:
            loss_tok = loss_tok * batch.extras["weights"]
        if a.kl_mode == "loss":
            loss_tok = loss_tok + a.kl_coef * kl_estimate(logprobs, batch.extras["ref"], a.kl_estimator, mask=mask)
        if a.entropy_coef > 0:
            loss_tok = loss_tok - a.entropy_coef * torch.where(mask, entropy, 0.0)
        loss = self._loss_agg_fn(loss_tok, mask, global_tokens=global_tokens, global_seqs=global_seqs,
                                 norm_len=self.max_new_tokens)
        return loss, loss_stats

    def _optimizer_step(self) -> float:
        """Clip (if grad_clip > 0) and step; returns the pre-clip grad norm. A non-finite norm skips the step."""
        if self.trainer.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self._params, self.trainer.grad_clip)
        else:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        norm_f = float(self.dp.full_norm(norm))  # FSDP2: the norm of sharded gradients is a DTensor
        if math.isfinite(norm_f):
            self.optimizer.step()
        else:
            logger.warning("non-finite grad norm %s at version %d: optimizer step skipped", norm_f, self.version)
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        # skipped steps too: the schedule spans the run's optimizer steps exactly (torch warns when the very
        # first optimizer step was the skipped one: expected here)
        if math.isfinite(norm_f):
            self.scheduler.step()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
        return norm_f

    # ------------------------------------------------------------------ train step

    def update(self, groups: list[Group]) -> dict[str, float]:
        """One train step over all samples of `groups`; returns the step's metrics; version += 1."""
        t0 = time.perf_counter()
        trajs = flatten_groups(groups)
        n, n_mini = len(trajs), self.trainer.mini_batches
        if n_mini > n:
            raise ValueError(f"trainer.mini_batches={n_mini} exceeds the {n} samples of this step")
        first = self._first_pass(trajs) if self._prox_from_first_pass(trajs) else None
        data = self.prepare(trajs, prox=None if first is None else first[2])
        bounds = [(i * n) // n_mini for i in range(n_mini + 1)]
        sizes, prompts = lengths(trajs), self._prompts(trajs)

        stats, norms, cstats = GradientStats(), [], CriticStats()
        for epoch in range(self.trainer.epochs):
            for k in range(n_mini):
                lo, hi = bounds[k], bounds[k + 1]
                a, b = self.dp.shard(lo, hi)  # this rank's share of the mini-batch (all of it in one process)
                parts = self.batching.agreed(sizes, self.dp.shards(lo, hi), self.dp.rank, prompts=prompts)
                self.optimizer.zero_grad(set_to_none=True)
                self.compute_gradients(trajs[a:b], data.advantages[a:b], diagnose=(epoch == 0 and k == 0),
                                       stats=stats, rows=data.slice(a, b), measure_ratio=epoch == 0,
                                       global_counts=_loss_counts(trajs[lo:hi], data.slice(lo, hi)),
                                       first_pass=first[:2] if first is not None and epoch == k == 0 else None,
                                       parts=parts)
                norms.append(self._optimizer_step())
                if self.critic is not None:
                    assert data.old_values is not None and data.returns is not None
                    self.critic.compute_gradients(trajs[a:b], data.old_values[a:b], data.returns[a:b], cstats,
                                                  global_tokens=sum(sum(t.loss_mask) for t in trajs[lo:hi]),
                                                  parts=parts)
                    self.critic.step(cstats)
        self.optimizer.zero_grad(set_to_none=True)
        self.dp.reduce_stats(stats)  # every rank's share -> the step's (sums, max, min)
        self.dp.reduce_stats(cstats, only=("loss", "tokens", "clipped"))  # steps, grad_norm: the same on every rank
        steps = len(norms)
        if self.lagrange is not None and data.costs is not None:
            data.metrics["safety/lambda_next"] = self.lagrange.update(float(data.costs.mean()))
        logger.debug("update: version %d -> %d, %d samples, %d optimizer steps",
                     self.version, self.version + 1, n, steps)
        skipped = sum(not math.isfinite(x) for x in norms)
        self._check_skips(skipped == steps)
        self._check_finite()
        self.version += 1
        metrics = self._metrics(trajs, data, stats, cstats, norms, time.perf_counter() - t0)
        metrics["trainer/skipped_steps"] = float(skipped)
        return metrics

    def _prox_from_first_pass(self, trajs: list[Trajectory]) -> bool:
        """Whether this step's proximal logprobs can come from its gradient pass: with one epoch of one mini-batch
        in one micro-batch, that pass runs the step's starting weights on the very batch the proximal forward would
        (the same tensors, eval mode), so its detached logprobs are the proximal ones and the no-grad forward is
        skipped. Not with LoRA (adapter dropout is on in the gradient pass only), gradient checkpointing (its
        forward belongs inside the checkpointing context), several ranks (each forwards a share) or the router aux
        loss (collected in the gradient pass)."""
        t = self.trainer
        return (self._need_prox and t.epochs == 1 and t.mini_batches == 1 and self.dp.world_size == 1
                and not self.lora and not self._checkpointing and self.router_aux is None
                and len(self.batching.split(lengths(trajs), prompts=self._prompts(trajs))) == 1)

    def _first_pass(self, trajs: list[Trajectory]) -> tuple[Tensor, Tensor, Tensor]:
        """-> (logprobs [N, L], entropy [N, L]) with grad, as `compute_gradients` computes them for its one
        micro-batch, and the proximal rows [N, T] (their detached response-aligned copy)."""
        batch = collate(trajs, torch.zeros(len(trajs)), self.pad_token_id, self.device)
        with self._routing(trajs, batch, count=True):  # no checkpointing on this path: the backward recomputes nothing
            logprobs, entropy = self.sequence_logprobs(batch.input_ids, batch.attention_mask, batch.response_mask,
                                                       batch.temperature,
                                                       entropy_grad=self.algorithm.entropy_coef > 0,
                                                       model=self.forward_model)
        width = max(max(len(t.response_ids) for t in trajs), 1)  # response_rows' width
        return logprobs, entropy, gather_response(batch, trajs, logprobs, width)

    def _routing(self, trajs: list[Trajectory], batch: TokenBatch, count: bool = False) -> Any:
        """The context of a forward over `batch`: the MoE routing replayed and counted (algorithm.routing_replay)."""
        if self.routing is None:
            return nullcontext()
        return self.routing.forward(trajs, batch, packed=self.trainer.pack_sequences, count=count)

    def _check_skips(self, all_skipped: bool) -> None:
        """Count train steps whose every optimizer step was skipped (non-finite gradients); stop the run
        after `trainer.max_skipped_steps` of them in a row, rather than train nothing forever."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if all_skipped else 0
        limit = self.trainer.max_skipped_steps
        if limit and self.skipped_in_a_row >= limit:
            raise RuntimeError(f"{self.skipped_in_a_row} train steps in a row had only non-finite gradient "
                               f"norms (last at version {self.version}); lower trainer.lr, check the rewards, "
                               "or raise trainer.max_skipped_steps")

    def _check_finite(self) -> None:
        """The weights about to be broadcast are finite (a NaN never reaches the generators)."""
        if self.dp.world_size == 1 and all_finite(list(self.model.parameters())):  # one pass, not one per tensor
            return
        name = self.dp.all_finite(self.model)
        if name is not None:
            raise RuntimeError(f"parameter {name} is not finite after the update of version {self.version}; "
                               "the weights are not broadcast (lower trainer.lr or set trainer.grad_clip)")

    def _metrics(self, trajs: list[Trajectory], data: StepData, stats: GradientStats, cstats: CriticStats,
                 norms: list[float], step_s: float) -> dict[str, float]:
        n, steps = len(trajs), len(norms)
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        _, mask = response_rows(trajs)
        out = {
            "trainer/loss": stats.loss / steps,
            "trainer/grad_norm": sum(norms) / steps,
            "trainer/clip_frac": stats.clipped / max(stats.tokens, 1),
            "trainer/entropy": stats.entropy_sum / max(stats.tokens, 1),
            "trainer/approx_kl": stats.kl_sum / max(stats.kl_tokens, 1),
            "trainer/logprob_gap": stats.gap_sum / max(stats.gap_tokens, 1),
            "trainer/logprob_gap_tokens": float(stats.gap_tokens),
            "trainer/logprob_diff": stats.diff_sum / max(stats.kl_tokens, 1),
            "trainer/ratio_mean": stats.ratio_sum / max(stats.tokens, 1),
            "trainer/ratio_max": stats.ratio_max,
            "trainer/response_len": sum(len(t.response_ids) for t in trajs) / n,
            "trainer/truncation_rate": sum(t.truncated for t in trajs) / n,
            "trainer/reward_mean": float(rewards.mean()),
            "trainer/reward_std": float(rewards.std(correction=0)),
            "trainer/adv_abs_mean": float(data.advantages[mask].abs().mean()) if mask.any() else 0.0,
            "trainer/tokens": float(sum(sum(t.loss_mask) for t in trajs)),
            "trainer/samples": float(n),
            "trainer/padded_share": stats.padded / max(stats.cells, 1),
            "trainer/optimizer_steps": float(steps),
            "trainer/step_s": step_s,
            "trainer/lr": self.last_lr,
        }
        if "offpolicy/is_ratio_mean" not in data.metrics:  # no proximal policy: the loss's own ratio
            has = stats.is_tokens > 0
            out.update({
                "offpolicy/is_ratio_mean": stats.is_sum / stats.is_tokens if has else 0.0,
                "offpolicy/is_ratio_max": stats.is_max if has else 0.0,
                "offpolicy/is_ratio_min": stats.is_min if has else 0.0,
                "offpolicy/share_clipped": 0.0,
                "offpolicy/share_masked": 0.0,
            })
        if self.critic is not None:
            out["critic/value_loss"] = cstats.loss / max(cstats.steps, 1)
            out["critic/vf_clip_frac"] = cstats.clipped / max(cstats.tokens, 1)
            out["critic/grad_norm"] = cstats.grad_norm / max(cstats.steps, 1)
        if self.routing is not None:
            out.update(self.routing.metrics())
        if self.router_aux is not None:
            out.update(self.router_aux.metrics())
        out.update(data.metrics)
        return out

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> tuple[dict[str, dict[str, Tensor]], dict[str, Any]]:
        """Everything an exact resume needs, as tensor groups (safetensors) and a msgspec-encodable state: the
        policy (LoRA: its adapter) with its AdamW state and LR schedule, the critic and its optimizer, the Lagrange
        multiplier, the version. Sharded (trainer.parallel = "fsdp2"): the state only; every rank writes its
        tensors (training/sharded.py)."""
        state: dict[str, Any] = {"version": self.version, "lora": self.lora,
                                 "scheduler": scheduler_state(self.scheduler)}
        if self.lagrange is not None:
            state["lagrange"] = self.lagrange.state_dict()
        if self.dp.mode == "fsdp2":
            return {}, state
        opt_tensors, state["optimizer"] = optimizer_state(self.optimizer)
        policy = lora.adapter_state(self.model) if self.lora else dict(self.model.state_dict())
        tensors = {"policy": policy, "optimizer": opt_tensors}
        if self.critic is not None:
            tensors["critic"] = dict(self.critic.model.state_dict())
            tensors["critic_optimizer"], state["critic_optimizer"] = optimizer_state(self.critic.optimizer)
        return tensors, state

    def restore_state(self, tensors: dict[str, dict[str, Tensor]], state: dict[str, Any],
                      shards: Path | None = None) -> None:
        """The inverse of `checkpoint_state` (a learner built from the same config): whole tensors from
        `tensors`, or, for a sharded checkpoint, the shards in folder `shards` (a collective: every rank loads)."""
        if bool(state.get("lora", False)) != self.lora:
            raise ValueError("checkpoint and config disagree on LoRA: resume with the run's own [model.lora]")
        if "policy" not in tensors:  # a sharded checkpoint: any number of ranks wrote it, any number load it
            if shards is None:
                raise ValueError("a sharded checkpoint (no policy tensors) needs its shards folder")
            sharded.load(self, shards, state[sharded.STATE_KEY])
        elif ("critic" in tensors) != (self.critic is not None):
            raise ValueError("checkpoint and config disagree on the critic (algorithm.advantage changed?)")
        elif self.dp.mode == "fsdp2":  # whole tensors (1 process, DDP) into this rank's slices
            sharded.load_full(self, tensors, state)
        else:
            if self.lora:
                lora.load_adapter_state(self.model, tensors["policy"])
            else:
                self.model.load_state_dict(tensors["policy"])
            load_optimizer_state(self.optimizer, tensors["optimizer"], state["optimizer"])
            if self.critic is not None:
                self.critic.model.load_state_dict(tensors["critic"])
                load_optimizer_state(self.critic.optimizer, tensors["critic_optimizer"], state["critic_optimizer"])
        match_fused(self.optimizer)  # a checkpoint of the other implementation (or of FSDP2's) resumes here too
        if "scheduler" in state:  # (a checkpoint written before schedules: the schedule starts afresh)
            load_scheduler_state(self.scheduler, state["scheduler"])
        if self.lagrange is not None and "lagrange" in state:
            self.lagrange.load_state_dict(state["lagrange"])
        self.version = int(state["version"])

    # ------------------------------------------------------------------ weights

    def state_dict_for_sync(self) -> Mapping[str, Tensor]:
        """Named parameters (tied ones once) + persistent buffers, detached: what the weight broadcast sends.
        With trainer.parallel = "fsdp2" a collective: every rank calls it, rank 0 sends the result. LoRA: the
        merged weights under the base model's names, the adapted layers' alone unless `sync_all_weights`."""
        if self.lora:
            return lora.MergedWeights(self.model, targeted_only=not self._sync_all)
        return self.dp.full_state_dict(self.model)


def _loss_counts(trajs: list[Trajectory], rows: dict[str, Tensor]) -> tuple[int, int]:
    """(loss tokens, sequences) of an optimizer step's samples: the denominators of every `loss_agg`."""
    tokens = int(rows["keep"].sum()) if "keep" in rows else sum(sum(t.loss_mask) for t in trajs)
    return tokens, len(trajs)
