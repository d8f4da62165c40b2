"""Learner: the single-process training core — groups in, one policy version out.

Place in the dataflow: the Trainer role takes a step's groups off the train queue and calls
`Learner.update(groups)`; afterwards it broadcasts `state_dict_for_sync()` to the generators, stamped with
`Learner.version`. No Ray, no queues here: this is plain torch, testable in-process.

One train step (ARCHITECTURE "Batch units"):

    groups ─► flatten (samples_per_step trajectories; "error" ones rejected)
           ─► advantages [N] by `[algorithm] advantage` from rewards and group ids
           ─► for epoch in epochs: for each of `mini_batches` mini-batches:
                  zero grads; for each micro-batch of `micro_batch_size` samples:
                      forward (logits / each trajectory's temperature) → logprobs
                      → `[algorithm] policy_loss` vs behaviour logprobs → `[algorithm] loss_agg`
                        with global_tokens = loss tokens of the whole mini-batch → backward
                  clip grad norm (`grad_clip`, 0 = off), optimizer step
           ─► version += 1

Token positions: a sample is `prompt_ids + response_ids` right-padded to the micro-batch's longest; the
logprob at position t is that of token t predicted from t-1, so position 0 never carries one.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.algorithms import approx_kl_k3, entropy_from_logits, get_advantage, get_loss_agg, get_policy_loss
from asyncrl.config_schema import AlgorithmConfig, TrainerConfig
from asyncrl.messages import Group, Trajectory

logger = logging.getLogger(__name__)


@dataclass
class TokenBatch:
    """Padded tensors of a few trajectories; B samples, L = longest prompt + response."""

    input_ids: Tensor       # [B, L] int64, right-padded with pad_token_id
    attention_mask: Tensor  # [B, L] int64, 1 on real tokens
    response_mask: Tensor   # [B, L] bool, positions holding response tokens
    loss_mask: Tensor       # [B, L] bool, response positions the loss trains on
    old_logprobs: Tensor    # [B, L] behaviour logprobs on loss positions, 0 elsewhere
    advantages: Tensor      # [B, L] float32, the sample's advantage at every position
    versions: Tensor        # [B, L] int64, policy version of each response token, -1 elsewhere
    temperature: Tensor     # [B] float32, the temperature each sample was generated with


def collate(trajectories: list[Trajectory], advantages: Tensor, pad_token_id: int, device: str | torch.device = "cpu") -> TokenBatch:
    """trajectories (B of them), advantages [B] -> TokenBatch on `device`."""
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    b, width = len(trajectories), max(lengths)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    response = torch.zeros((b, width), dtype=torch.bool)
    loss = torch.zeros((b, width), dtype=torch.bool)
    old = torch.zeros((b, width), dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        p, n = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : p + n] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention[i, : p + n] = 1
        response[i, p : p + n] = True
        if n:
            lm = torch.tensor(t.loss_mask, dtype=torch.bool)
            loss[i, p : p + n] = lm
            # Behaviour logprobs of env-written tokens may be placeholders: keep only trained ones.
            old[i, p : p + n] = torch.where(lm, torch.tensor(t.behavior_logprobs, dtype=torch.float32), 0.0)
            versions[i, p : p + n] = torch.tensor(t.versions, dtype=torch.long)
    adv = advantages.to(torch.float32).view(b, 1).expand(b, width).clone()
    temperature = torch.tensor([t.temperature for t in trajectories], dtype=torch.float32)
    return TokenBatch(*(x.to(device) for x in (input_ids, attention, response, loss, old, adv, versions, temperature)))


@dataclass
class GradientStats:
    """Sums over the forward passes of one or more `compute_gradients` calls (metrics are ratios of these)."""

    loss: float = 0.0            # sum of aggregated losses (per call: the mini-batch loss)
    tokens: int = 0              # loss tokens seen by forward passes
    clipped: float = 0.0         # clip_frac x tokens, summed
    ratio_sum: float = 0.0       # ratio_mean x tokens, summed
    ratio_max: float = 0.0
    entropy_sum: float = 0.0     # over loss tokens
    kl_sum: float = 0.0          # k3(behaviour || current) over loss tokens of diagnosed calls
    kl_tokens: int = 0
    gap_sum: float = 0.0         # |current - behaviour| over diagnosed on-policy loss tokens
    gap_tokens: int = 0


class Learner:
    """Owns the policy model and its AdamW optimizer; `update` runs one train step (see module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        algorithm: AlgorithmConfig,
        trainer: TrainerConfig,
        pad_token_id: int,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device)
        # Dropout off: the trainer's logprobs must be the engine's (which samples in eval mode).
        self.model.eval()
        self.algorithm = algorithm
        self.trainer = trainer
        self.pad_token_id = pad_token_id
        # Look the names up now: an unknown name fails at construction, listing the known ones.
        self._advantage_fn = get_advantage(algorithm.advantage)
        self._policy_loss_fn = get_policy_loss(algorithm.policy_loss)
        self._loss_agg_fn = get_loss_agg(algorithm.loss_agg)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self._params, lr=trainer.lr, betas=(trainer.betas[0], trainer.betas[1]), weight_decay=trainer.weight_decay
        )
        self.version: int = 0

    # ------------------------------------------------------------------ logprobs

    def sequence_logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, temperature: float | Tensor
    ) -> tuple[Tensor, Tensor]:
        """input_ids, attention_mask, response_mask [B, L] (right-padded prompt+response), temperature
        (float or [B]) -> (logprobs [B, L], entropy [B, L]); both 0 outside response_mask.

        logprobs[b, t] = log_softmax(logits[b, t-1] / T_b)[input_ids[b, t]] in float32 over the full
        vocabulary (with grad if enabled); entropy of the same distribution, without grad.
        """
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).reshape(-1, 1, 1)
        logits = logits[:, :-1].float() / temp                                       # [B, L-1, V]
        targets = input_ids[:, 1:].unsqueeze(-1)                                     # [B, L-1, 1]
        tok_logp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        with torch.no_grad():
            entropy = entropy_from_logits(logits)
        zero_col = tok_logp.new_zeros(tok_logp.shape[0], 1)
        logprobs = torch.cat([zero_col, tok_logp], dim=1)                            # [B, L]
        entropy = torch.cat([zero_col, entropy], dim=1)
        mask = response_mask.bool()
        return torch.where(mask, logprobs, 0.0), torch.where(mask, entropy, 0.0)

    @torch.no_grad()
    def teacher_forced_logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float) -> list[float]:
        """The current policy's logprob of each response token given the prompt (one per response token)."""
        if not prompt_ids:
            raise ValueError("teacher_forced_logprobs needs at least one prompt token")
        ids = torch.tensor([prompt_ids + response_ids], dtype=torch.long, device=self.device)
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[0, len(prompt_ids):] = True
        logprobs, _ = self.sequence_logprobs(ids, torch.ones_like(ids), resp, temperature)
        return logprobs[0, len(prompt_ids):].tolist()

    # ------------------------------------------------------------------ gradients

    def compute_gradients(
        self,
        trajectories: list[Trajectory],
        advantages: Tensor,
        *,
        micro_batch_size: int | None = None,
        diagnose: bool = False,
        stats: GradientStats | None = None,
    ) -> GradientStats:
        """Accumulate into each parameter's .grad the gradient of the aggregated loss of these samples
        (one mini-batch), one micro-batch of `micro_batch_size` samples at a time. Does not zero grads.

        trajectories (n), advantages [n]. `diagnose` also measures approx KL and the logprob gap (valid
        only before any optimizer step of this train step). Adds into `stats` if given; returns it.
        """
        stats = stats if stats is not None else GradientStats()
        mbs = micro_batch_size or self.trainer.micro_batch_size
        global_tokens = sum(sum(t.loss_mask) for t in trajectories)
        loss_total = 0.0
        for start in range(0, len(trajectories), mbs):
            batch = collate(trajectories[start : start + mbs], advantages[start : start + mbs], self.pad_token_id, self.device)
            logprobs, entropy = self.sequence_logprobs(
                batch.input_ids, batch.attention_mask, batch.response_mask, batch.temperature
            )
            loss_tok, loss_stats = self._policy_loss_fn(
                logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, clip_eps=self.algorithm.clip_eps
            )
            loss = self._loss_agg_fn(loss_tok, batch.loss_mask, global_tokens=global_tokens, global_seqs=len(trajectories))
            loss.backward()
            loss_total += loss.item()
            self._record(stats, batch, logprobs.detach(), entropy, loss_stats, diagnose)
        stats.loss += loss_total
        return stats

    def _record(
        self, stats: GradientStats, batch: TokenBatch, logprobs: Tensor, entropy: Tensor,
        loss_stats: dict[str, Tensor], diagnose: bool,
    ) -> None:
        mask = batch.loss_mask
        n = int(mask.sum())
        stats.tokens += n
        stats.clipped += float(loss_stats.get("clip_frac", 0.0)) * n
        stats.ratio_sum += float(loss_stats.get("ratio_mean", 0.0)) * n
        stats.ratio_max = max(stats.ratio_max, float(loss_stats.get("ratio_max", 0.0)))
        stats.entropy_sum += float(entropy[mask].sum())
        if diagnose:
            # Tokens were sampled from the behaviour policy, so k3(behaviour, current) estimates KL(mu || pi).
            stats.kl_sum += float(approx_kl_k3(batch.old_logprobs, logprobs)[mask].sum())
            stats.kl_tokens += n
            on_policy = mask & (batch.versions == self.version)
            stats.gap_sum += float((logprobs - batch.old_logprobs).abs()[on_policy].sum())
            stats.gap_tokens += int(on_policy.sum())

    def _optimizer_step(self) -> float:
        """Clip (if grad_clip > 0) and step; returns the pre-clip grad norm. A non-finite norm skips the step."""
        if self.trainer.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self._params, self.trainer.grad_clip)
        else:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        norm_f = float(norm)
        if math.isfinite(norm_f):
            self.optimizer.step()
        else:
            logger.warning("non-finite grad norm %s at version %d: optimizer step skipped", norm_f, self.version)
        return norm_f

    # ------------------------------------------------------------------ train step

    def update(self, groups: list[Group]) -> dict[str, float]:
        """One train step over all samples of `groups`; returns the `trainer/*` metrics; version += 1."""
        t0 = time.perf_counter()
        trajs = _flatten(groups)
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        group_ids = torch.tensor([t.group_id for t in trajs], dtype=torch.long)
        advantages = self._advantage_fn(rewards, group_ids).to(torch.float32)
        n, n_mini = len(trajs), self.trainer.mini_batches
        if n_mini > n:
            raise ValueError(f"trainer.mini_batches={n_mini} exceeds the {n} samples of this step")
        bounds = [(i * n) // n_mini for i in range(n_mini + 1)]

        stats, norms = GradientStats(), []
        for epoch in range(self.trainer.epochs):
            for k in range(n_mini):
                lo, hi = bounds[k], bounds[k + 1]
                self.optimizer.zero_grad(set_to_none=True)
                self.compute_gradients(trajs[lo:hi], advantages[lo:hi], diagnose=(epoch == 0 and k == 0), stats=stats)
                norms.append(self._optimizer_step())
        self.optimizer.zero_grad(set_to_none=True)
        steps = len(norms)
        logger.debug("update: version %d -> %d, %d samples, %d optimizer steps", self.version, self.version + 1, n, steps)
        self.version += 1

        loss_tokens = sum(sum(t.loss_mask) for t in trajs)
        return {
            "trainer/loss": stats.loss / steps,
            "trainer/grad_norm": sum(norms) / steps,
            "trainer/clip_frac": stats.clipped / max(stats.tokens, 1),
            "trainer/entropy": stats.entropy_sum / max(stats.tokens, 1),
            "trainer/approx_kl": stats.kl_sum / max(stats.kl_tokens, 1),
            "trainer/logprob_gap": stats.gap_sum / max(stats.gap_tokens, 1),
            "trainer/logprob_gap_tokens": float(stats.gap_tokens),
            "trainer/ratio_mean": stats.ratio_sum / max(stats.tokens, 1),
            "trainer/ratio_max": stats.ratio_max,
            "trainer/response_len": sum(len(t.response_ids) for t in trajs) / n,
            "trainer/truncation_rate": sum(t.truncated for t in trajs) / n,
            "trainer/reward_mean": float(rewards.mean()),
            "trainer/reward_std": float(rewards.std(correction=0)),
            "trainer/adv_abs_mean": float(advantages.abs().mean()),
            "trainer/tokens": float(loss_tokens),
            "trainer/samples": float(n),
            "trainer/optimizer_steps": float(steps),
            "trainer/step_s": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------ weights

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Named parameters (tied ones once) + persistent buffers, detached: what the weight broadcast sends."""
        out = {name: p.detach() for name, p in self.model.named_parameters()}
        persistent = set(self.model.state_dict().keys())
        for name, buf in self.model.named_buffers():
            if name in persistent:
                out[name] = buf.detach()
        return out


def _flatten(groups: list[Group]) -> list[Trajectory]:
    """All trajectories of the groups, in order; raises ValueError on anything that must not be trained."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        raise ValueError("update() got no trajectories")
    for t in trajs:
        if t.finish_reason == "error":
            raise ValueError(f"trajectory {t.seq_id} has finish_reason='error' ({t.error!r}); failed samples are never trained")
        if t.temperature <= 0:
            raise ValueError(f"trajectory {t.seq_id} was sampled greedily (temperature={t.temperature}); greedy samples are never trained")
        if not t.prompt_ids:
            raise ValueError(f"trajectory {t.seq_id} has an empty prompt")
        n = len(t.response_ids)
        if not (len(t.loss_mask) == len(t.behavior_logprobs) == len(t.versions) == n):
            raise ValueError(
                f"trajectory {t.seq_id}: response_ids ({n}), loss_mask ({len(t.loss_mask)}), behavior_logprobs "
                f"({len(t.behavior_logprobs)}) and versions ({len(t.versions)}) must have one entry per response token"
            )
    return trajs
