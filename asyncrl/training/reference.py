"""The frozen reference policy of the KL term: teacher-forced logprobs of the behaviour tokens.

Place in the dataflow: with `[reference] where = "scorer"` (default) each Scorer holds one and fills
`Trajectory.ref_logprobs` before a group goes to the train store — off the trainer's critical path, the
forward overlaps training; with `where = "trainer"` the Learner holds it and runs it at the start of a
step. Either way the logprobs are log_softmax(logits / T) of the sampled tokens, T the trajectory's own
temperature, exactly as the Learner computes the policy's, so KL estimates compare like with like.
"""

from __future__ import annotations

import logging

import torch

from asyncrl.messages import Trajectory
from asyncrl.training import precision
from asyncrl.training.batch import collate, gather_response
from asyncrl.training.logprobs import token_logprobs
from asyncrl.training.micro import MicroBatching, lengths
from asyncrl.training.routing import RoutingReplay, replay_on, replayed

log = logging.getLogger(__name__)


class ReferencePolicy:
    """A frozen causal LM (no grads, eval mode) answering `response_logprobs`."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, micro_batch_size: int = 64,
                 device: str | torch.device = "cpu", mixed_precision: str = "no",
                 max_tokens_per_micro_batch: int = 0, logprob_chunk_tokens: int = 0,
                 lm_head_fp32: bool = True) -> None:
        self.device = torch.device(device)
        self.autocast = precision.autocast_dtype(mixed_precision)  # the policy's autocast (training/precision.py)
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.pad_token_id = pad_token_id
        self.batching = MicroBatching(micro_batch_size, max_tokens_per_micro_batch)  # the policy's (micro.py)
        self.tokens_scored = 0
        self.chunk = logprob_chunk_tokens  # the policy's trainer.logprob_chunk_tokens (training/logprobs.py)
        self.float_head = lm_head_fp32     # the policy's trainer.lm_head_fp32: KL compares like with like
        self.routing: RoutingReplay | None = None  # an MoE reference under routing replay (`replay_routing`)

    def replay_routing(self, mode: str) -> None:
        """algorithm.routing_replay: an MoE reference forwards each recorded position through the experts the engine
        used, as the policy's forwards do (a dense one, or another mode: nothing changes)."""
        self.routing = replay_on(self.model, mode)

    @classmethod
    def load(cls, path: str, *, dtype: str, pad_token_id: int, micro_batch_size: int = 64,
             mixed_precision: str = "no", device: str | torch.device = "cpu",
             max_tokens_per_micro_batch: int = 0, logprob_chunk_tokens: int = 0,
             routing_replay: str = "off", lm_head_fp32: bool = True) -> "ReferencePolicy":
        """Under mixed precision the frozen model needs no float32 master copy: it is loaded in the autocast
        dtype, whatever `dtype` (model.dtype) says, and runs under the policy's autocast."""
        from engines.hf import load_model

        dtype = precision.reference_dtype(dtype, mixed_precision)
        log.info("reference policy: loading %s (%s)", path, dtype)
        ref = cls(load_model(path, dtype=dtype, device=device), pad_token_id=pad_token_id,
                  micro_batch_size=micro_batch_size, device=device, mixed_precision=mixed_precision,
                  max_tokens_per_micro_batch=max_tokens_per_micro_batch, logprob_chunk_tokens=logprob_chunk_tokens,
                  lm_head_fp32=lm_head_fp32)
        ref.replay_routing(routing_replay)
        return ref

    @torch.no_grad()
    def response_logprobs(self, trajectories: list[Trajectory],
                          parts: list[list[int]] | None = None) -> list[list[float]]:
        """One list per trajectory: the reference logprob of each response token (empty for no tokens);
        `parts`: the micro-batches (indices into `trajectories`; default: cut by `self.batching`)."""
        out: list[list[float]] = [[] for _ in trajectories]
        for idx in parts if parts is not None else self.batching.split(lengths(trajectories)):
            part = [trajectories[i] for i in idx]
            batch = collate(part, torch.zeros(len(part)), self.pad_token_id, self.device)
            with replayed(self.routing, part, batch):
                logprobs, _ = token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                             batch.response_mask, batch.temperature, autocast=self.autocast,
                                             chunk=self.chunk, float_head=self.float_head)
            width = max(len(t.response_ids) for t in part)
            rows = gather_response(batch, part, logprobs, max(width, 1))
            for k, (i, t) in enumerate(zip(idx, part)):
                out[i] = rows[k, : len(t.response_ids)].tolist()
            self.tokens_scored += sum(len(t.response_ids) for t in part)
        return out
