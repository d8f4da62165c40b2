"""PPO's critic: a value model trained by the Trainer beside the policy (`algorithm.advantage = "gae"`).

Place in the dataflow: inside the Trainer's `Learner`. At the start of a step `values` scores every
response token of the step (no grad: the GAE input and the `old_values` of the clipped value loss);
after GAE, each mini-batch accumulates the clipped value loss against the returns (`compute_gradients`)
and takes one AdamW step (`step`), next to the policy's optimizer step. Micro-batching follows the
trainer's. The model is the policy's backbone loaded from `[critic] path` (default model.path) as
`AutoModelForTokenClassification(num_labels=1)`: the LM head is dropped and a fresh scalar head added.

Value positions match logprob positions (see batch.py): the value of response token t is the head's
output on the token before it — the value of the state in which token t was chosen.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from asyncrl.algorithms.value import value_loss
from asyncrl.config.schema import CriticConfig
from asyncrl.messages import Trajectory
from asyncrl.training import precision
from asyncrl.training.batch import collate, compiled, gather_response
from asyncrl.training.micro import MicroBatching, in_order, lengths
from asyncrl.training.parallel import SingleProcess
from asyncrl.training.routing import replay_on, replayed

log = logging.getLogger(__name__)


def load_value_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    """The model in `path` with a fresh 1-output token-classification head (a value head)."""
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    from engines.hf import torch_dtype

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialised" is the point, not a warning
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForTokenClassification.from_pretrained(
            str(path), num_labels=1, dtype=torch_dtype(dtype), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model


@dataclass
class CriticStats:
    loss: float = 0.0         # sum of aggregated value losses (one per optimizer step)
    tokens: int = 0
    clipped: float = 0.0      # vf_clip_frac x tokens, summed
    steps: int = 0
    grad_norm: float = 0.0    # summed over optimizer steps


class Critic:
    """The value model and its AdamW optimizer. `mixed_precision` and `gradient_checkpointing` as the policy's
    (training/precision.py): float32 master weights and bfloat16 autocast; activations recomputed in backward."""

    def __init__(self, model: torch.nn.Module, cfg: CriticConfig, *, pad_token_id: int,
                 micro_batch_size: int, device: str | torch.device = "cpu", mixed_precision: str = "no",
                 gradient_checkpointing: bool = False, max_tokens_per_micro_batch: int = 0,
                 routing_replay: str = "off") -> None:
        self.device = torch.device(device)
        self.autocast = precision.autocast_dtype(mixed_precision)
        precision.check_autocast(self.device, self.autocast)
        self.model = model.to(self.device) if self.autocast is None else model.to(self.device, torch.float32)
        self.model.eval()  # dropout off, as for the policy
        # algorithm.routing_replay = "rollout" on an MoE backbone: the engine's experts, as in the policy's forwards
        self.routing = replay_on(self.model, routing_replay)
        if gradient_checkpointing:
            precision.enable_gradient_checkpointing(self.model)
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.batching = MicroBatching(micro_batch_size, max_tokens_per_micro_batch)  # the policy's (micro.py)
        self.dp: SingleProcess = SingleProcess()
        self.train_model = self.forward_model = self.model  # forward_model: compiled by `distribute(compile=True)`
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self._params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def distribute(self, dp: SingleProcess, *, compile: bool = False) -> None:
        """Train as one rank of the trainer group, sharded like the policy (training/parallel.py; one process: as is),
        through a torch.compile'd forward with `compile` (trainer.compile, training/batch.py); called by the Learner
        before any step (the optimizer is rebuilt: FSDP2 replaces the parameters)."""
        if dp.world_size > 1:
            self.dp = dp
            self.train_model = dp.wrap(self.model)
            self._params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(self._params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.forward_model = compiled(self.train_model) if compile else self.train_model

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                 model: torch.nn.Module | None = None) -> Tensor:
        """[B, L] each -> values [B, L] at response positions (0 elsewhere), float32."""
        with precision.autocast(self.device, self.autocast):
            net = self.model if model is None else model  # (not `model or`: a compiled module has no len())
            out = net(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        out = out[..., 0].to(torch.promote_types(out.dtype, torch.float32))  # [B, L]
        values = torch.cat([out.new_zeros(out.shape[0], 1), out[:, :-1]], dim=1)
        return torch.where(response_mask.bool(), values, 0.0)

    @torch.no_grad()
    def values(self, trajectories: list[Trajectory], width: int, parts: list[list[int]] | None = None) -> Tensor:
        """-> [N, width] response-aligned values of the current critic (no grad); `parts`: the micro-batches
        (indices into `trajectories`; default: cut by `self.batching`)."""
        parts = parts if parts is not None else self.batching.split(lengths(trajectories))
        rows = []
        for idx in parts:
            part = [trajectories[i] for i in idx]
            batch = collate(part, torch.zeros(len(part)), self.pad_token_id, self.device)
            with replayed(self.routing, part, batch):
                values = self._forward(batch.input_ids, batch.attention_mask, batch.response_mask)
            rows.append(gather_response(batch, part, values, width))
        return in_order(rows, parts)

    def compute_gradients(self, trajectories: list[Trajectory], old_values: Tensor, returns: Tensor,
                          stats: CriticStats, global_tokens: int | None = None,
                          parts: list[list[int]] | None = None) -> None:
        """Accumulate the gradient of the token-mean clipped value loss of these samples (one mini-batch, or
        this rank's share of it: then `global_tokens` counts the loss tokens of the whole mini-batch).

        old_values, returns [n, T] response-aligned; `parts` as for `values`. Does not zero grads."""
        if global_tokens is None:
            global_tokens = sum(sum(t.loss_mask) for t in trajectories)
        global_tokens = max(global_tokens, 1)
        clip = self.cfg.value_clip if self.cfg.value_clip > 0 else None
        total = 0.0
        with precision.checkpointing(self.model):  # model.gradient_checkpointing: on for this pass only
            parts = parts if parts is not None else self.batching.split(lengths(trajectories))
            for j, idx in enumerate(parts):
                part = [trajectories[i] for i in idx]
                with self.dp.sync_gradients(self.train_model, sync=j == len(parts) - 1):  # reduce once, at the end
                    sl = torch.tensor(idx, dtype=torch.long)
                    batch = collate(part, torch.zeros(len(part)), self.pad_token_id, self.device,
                                    extras={"old_values": old_values[sl], "returns": returns[sl]})
                    with replayed(self.routing, part, batch):  # through the backward: checkpointing recomputes
                        values = self._forward(batch.input_ids, batch.attention_mask, batch.response_mask,
                                               self.forward_model)
                        loss_tok, vstats = value_loss(values, batch.extras["old_values"], batch.extras["returns"],
                                                      batch.loss_mask, clip)
                        loss = loss_tok.sum() / global_tokens
                        loss.backward()
                    total += loss.item()
                    n = int(batch.loss_mask.sum())
                    stats.tokens += n
                    stats.clipped += float(vstats["vf_clip_frac"]) * n
        stats.loss += total

    def step(self, stats: CriticStats) -> None:
        """Clip (if grad_clip > 0) and step; a non-finite norm skips the step."""
        if self.cfg.grad_clip > 0:
            norm = float(self.dp.full_norm(torch.nn.utils.clip_grad_norm_(self._params, self.cfg.grad_clip)))
        else:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = float(self.dp.full_norm(torch.nn.utils.get_total_norm(grads))) if grads else 0.0
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            log.warning("critic: non-finite grad norm %s, optimizer step skipped", norm)
        self.optimizer.zero_grad(set_to_none=True)
        stats.steps += 1
        stats.grad_norm += norm

    def save(self, path: str | Path) -> str:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        return str(out)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 − Var(returns − values) / Var(returns) over mask tokens; 0 when Var(returns) = 0."""
    if not mask.any():
        return 0.0
    r, v = returns[mask].double(), values[mask].double()
    var_r = r.var(correction=0)
    return float(1.0 - (r - v).var(correction=0) / var_r) if var_r > 0 else 0.0
