"""Padded token batches shared by the policy, critic and reference.

Place in the dataflow: the Trainer's `Learner` (policy, critic) and the Scorer's `ReferencePolicy` turn a
few `Trajectory`s into one right-padded [B, L] batch with `collate`, run a model over it (the policy's
logprobs: training/logprobs.py) and read one number per response token at the same positions: position t of
a response holds what the model said after reading tokens < t (logprob of token t, value of the state before
token t).

Step-level quantities (advantages, reference / proximal logprobs, values) live response-aligned as
[N, T] tensors (row i = trajectory i, column j = its j-th response token); `collate` scatters the rows of
its samples into the batch's [B, L] positions (`extras`), and `gather_response` goes back. `StepData` holds a
train step's rows, `GradientStats` the sums its gradient passes measure (the Learner's, training/learner.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from asyncrl.algorithms import approx_kl_k3
from asyncrl.messages import Group, Trajectory


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
    diff_sum: float = 0.0        # |current - behaviour| over the same tokens (stale ones included)
    gap_sum: float = 0.0         # |current - behaviour| over diagnosed on-policy loss tokens
    gap_tokens: int = 0
    # off-policy ratio current / behaviour, measured on first-epoch passes when no proximal policy is computed
    is_tokens: int = 0
    is_sum: float = 0.0
    is_max: float = 0.0
    is_min: float = math.inf
    cells: int = 0               # B x L of every forward: the tokens computed, padding included
    padded: int = 0              # of those, padding

    def record(self, batch: TokenBatch, logprobs: Tensor, entropy: Tensor, loss_stats: dict[str, Tensor],
               version: int, *, diagnose: bool, measure_ratio: bool,
               computed: tuple[int, int] | None = None) -> None:
        """Add one micro-batch's forward (detached logprobs / entropy [B, L], its loss's stats) to the sums;
        `version`: the learner's, for the on-policy logprob gap; `computed`: (cells, real tokens) of the forward
        where it ran another layout than the batch's (trainer.share_prompts)."""
        mask = batch.loss_mask
        n = int(mask.sum())
        cells, real = computed or (batch.input_ids.numel(), int(batch.attention_mask.sum()))
        self.cells += cells
        self.padded += cells - real
        self.tokens += n
        self.clipped += float(loss_stats.get("clip_frac", 0.0)) * n
        self.ratio_sum += float(loss_stats.get("ratio_mean", 0.0)) * n
        self.ratio_max = max(self.ratio_max, float(loss_stats.get("ratio_max", 0.0)))
        self.entropy_sum += float(entropy[mask].sum())
        if measure_ratio and n:
            ratio = (logprobs - batch.old_logprobs).clamp(-20, 20).exp()[mask]
            self.is_tokens += n
            self.is_sum += float(ratio.sum())
            self.is_max = max(self.is_max, float(ratio.max()))
            self.is_min = min(self.is_min, float(ratio.min()))
        if diagnose:
            # Tokens were sampled from the behaviour policy, so k3(behaviour, current) estimates KL(mu || pi).
            self.kl_sum += float(approx_kl_k3(batch.old_logprobs, logprobs)[mask].sum())
            self.kl_tokens += n
            self.diff_sum += float((logprobs - batch.old_logprobs).abs()[mask].sum())
            on_policy = mask & (batch.versions == version)
            self.gap_sum += float((logprobs - batch.old_logprobs).abs()[on_policy].sum())
            self.gap_tokens += int(on_policy.sum())


@dataclass
class StepData:
    """What `prepare` computes once per train step; every tensor response-aligned [N, T]."""

    advantages: Tensor                       # [N, T] float32, 0 off the loss mask
    rows: dict[str, Tensor] = field(default_factory=dict)  # prox / ref / weights / keep, as needed
    returns: Tensor | None = None            # gae value targets
    old_values: Tensor | None = None         # critic values at the step's start
    rewards: Tensor | None = None            # [N] after shaping / normalisation
    costs: Tensor | None = None              # [N] Safe-RLHF costs
    metrics: dict[str, float] = field(default_factory=dict)

    def slice(self, lo: int, hi: int) -> dict[str, Tensor]:
        return {k: v[lo:hi] for k, v in self.rows.items()}


@dataclass
class TokenBatch:
    """Padded tensors of a few trajectories; B samples, L = longest prompt + response."""

    input_ids: Tensor       # [B, L] int64, right-padded with pad_token_id
    attention_mask: Tensor  # [B, L] int64, 1 on real tokens
    response_mask: Tensor   # [B, L] bool, positions holding response tokens
    loss_mask: Tensor       # [B, L] bool, response positions the loss trains on
    old_logprobs: Tensor    # [B, L] behaviour logprobs on loss positions, 0 elsewhere
    advantages: Tensor      # [B, L] float32, the sample's advantage at each of its response positions
    versions: Tensor        # [B, L] int64, policy version of each response token, -1 elsewhere
    temperature: Tensor     # [B] float32, the temperature each sample was generated with
    extras: dict[str, Tensor] = field(default_factory=dict)  # [B, L] each, scattered from [B, T] rows


def response_rows(trajectories: list[Trajectory], values: list[list[float]] | None = None, *,
                  dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """-> (rows [N, T], loss mask [N, T] bool), T = longest response; rows from `values` (one list per
    trajectory, one entry per response token; default: the behaviour logprobs), 0 past each response."""
    lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.long)
    width = max(int(lengths.max()) if len(trajectories) else 0, 1)
    filled = torch.arange(width) < lengths[:, None]                        # [N, T], row-major = token order
    src = values if values is not None else [t.behavior_logprobs for t in trajectories]
    rows = torch.zeros((len(trajectories), width), dtype=dtype)
    mask = torch.zeros((len(trajectories), width), dtype=torch.bool)
    # one tensor per field from the flattened lists (not one per trajectory: this runs every train step)
    rows[filled] = torch.tensor([x for row in src for x in row], dtype=dtype)
    mask[filled] = torch.tensor([x for t in trajectories for x in t.loss_mask], dtype=torch.bool)
    return rows, mask


def collate(trajectories: list[Trajectory], advantages: Tensor, pad_token_id: int,
            device: str | torch.device = "cpu", extras: dict[str, Tensor] | None = None) -> TokenBatch:
    """trajectories (B of them), advantages [B] (one per sample) or [B, T] (response-aligned), extras
    {name: [B, T] response-aligned} -> TokenBatch on `device` (advantages and extras at [B, L] positions)."""
    prompt = torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.long)
    resp = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.long)
    b, width = len(trajectories), int((prompt + resp).max())
    cols = torch.arange(width)
    # Boolean-mask assignment fills positions in row-major order, which is each sample's token order: every
    # field is built from one flattened list rather than a tensor per sample (collate runs every micro-batch).
    attention = cols < (prompt + resp)[:, None]
    response = attention & (cols >= prompt[:, None])
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    input_ids[attention] = torch.tensor([x for t in trajectories for x in (*t.prompt_ids, *t.response_ids)],
                                        dtype=torch.long)
    lm = torch.tensor([x for t in trajectories for x in t.loss_mask], dtype=torch.bool)
    loss = torch.zeros((b, width), dtype=torch.bool)
    loss[response] = lm
    # Behaviour logprobs of env-written tokens may be placeholders: keep only trained ones.
    old = torch.zeros((b, width), dtype=torch.float32)
    old[response] = torch.where(lm, torch.tensor([x for t in trajectories for x in t.behavior_logprobs],
                                                 dtype=torch.float32), 0.0)
    versions = torch.full((b, width), -1, dtype=torch.long)
    versions[response] = torch.tensor([x for t in trajectories for x in t.versions], dtype=torch.long)
    filled = torch.arange(int(resp.max()) if b else 0) < resp[:, None]    # [B, T]: the response-aligned cells
    adv = torch.zeros((b, width), dtype=torch.float32)
    if advantages.dim() == 1:
        adv[response] = advantages.to(torch.float32).repeat_interleave(resp)
    else:
        adv[response] = advantages[:, : filled.shape[1]][filled].to(torch.float32)
    out_extras = {}
    for k, v in (extras or {}).items():
        out_extras[k] = torch.zeros((b, width), dtype=v.dtype)
        out_extras[k][response] = v[:, : filled.shape[1]][filled]
    temperature = torch.tensor([t.temperature for t in trajectories], dtype=torch.float32)
    tensors = (input_ids, attention.long(), response, loss, old, adv, versions, temperature)
    return TokenBatch(*(x.to(device) for x in tensors), extras={k: v.to(device) for k, v in out_extras.items()})


def routing_rows(trajectories: list[Trajectory], width: int, shape: tuple[int, int]) -> Tensor:
    """The engine's routing of each sample at the batch's positions: [B, width, layers, k] (`ROUTING_DTYPE`), -1
    where a position has no record (padding, a sample without routing, the last response token, which no forward
    of the engine fed). ValueError for a sample whose routing does not fit the model or its tokens."""
    from engines.routing import ROUTING_DTYPE, unpack_routing

    out = torch.full((len(trajectories), width, *shape), -1, dtype=ROUTING_DTYPE)
    for i, t in enumerate(trajectories):
        if not t.routing_shape:
            continue
        if tuple(t.routing_shape) != tuple(shape):
            raise ValueError(f"routing replay: sample {t.seq_id} was routed over {t.routing_shape[0]} layers x "
                             f"top-{t.routing_shape[1]}; the trained model has {shape[0]} x top-{shape[1]}")
        rows = unpack_routing(t.routed_experts, t.routing_shape)
        tokens = len(t.prompt_ids) + len(t.response_ids)
        if not tokens - 1 <= rows.shape[0] <= tokens:
            raise ValueError(f"routing replay: sample {t.seq_id} carries the routing of {rows.shape[0]} positions "
                             f"for {tokens} tokens (want {tokens - 1} or {tokens})")
        out[i, : rows.shape[0]] = rows
    return out


def gather_response(batch: TokenBatch, trajectories: list[Trajectory], values: Tensor, width: int) -> Tensor:
    """values [B, L] at the batch's positions -> [B, width] response-aligned rows (0 past a response)."""
    resp = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.long)
    out = torch.zeros((len(trajectories), width), dtype=values.dtype)
    out[torch.arange(width) < resp[:, None]] = values.detach()[batch.response_mask].cpu()
    return out


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """trainer.compile: `model` behind torch.compile with dynamic shapes (a step's batch size and padded width
    change from step to step: one graph for all of them rather than one per shape). The wrapper holds `model`'s own
    parameters; whatever reads or writes them (the optimizer, the weight sync, checkpoints) keeps using `model`."""
    return torch.compile(model, dynamic=True)


def flatten_groups(groups: list[Group]) -> list[Trajectory]:
    """All trajectories of the groups, in order; raises ValueError on anything that must not be trained."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        raise ValueError("update() got no trajectories")
    for t in trajs:
        if t.finish_reason == "error":
            raise ValueError(f"trajectory {t.seq_id} has finish_reason='error' ({t.error!r}); "
                             f"failed samples are never trained")
        if t.temperature <= 0:
            raise ValueError(f"trajectory {t.seq_id} was sampled greedily (temperature={t.temperature}); "
                             f"greedy samples are never trained")
        if not t.prompt_ids:
            raise ValueError(f"trajectory {t.seq_id} has an empty prompt")
        n = len(t.response_ids)
        if not (len(t.loss_mask) == len(t.behavior_logprobs) == len(t.versions) == n):
            raise ValueError(
                f"trajectory {t.seq_id}: response_ids ({n}), loss_mask ({len(t.loss_mask)}), behavior_logprobs "
                f"({len(t.behavior_logprobs)}) and versions ({len(t.versions)}) must have one entry per response token"
            )
    return trajs
