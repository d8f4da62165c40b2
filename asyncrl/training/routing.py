"""The trainer's side of rollout routing replay (algorithm.routing_replay) for mixture-of-experts policies.

Place in the dataflow: the native engine records the experts each position was routed to (engines/routing.py);
the trajectories carry them (`routed_experts`); here the Learner's forwards over a micro-batch either replay them
("rollout": the experts the engine used, the router's own weights for them, so the router trains) or only compare
them with the trainer's own routing ("measure"). Either way the forward's own choices are recorded and counted
against the engine's: `routing/agreement` is the share of (position, MoE layer) decisions on which the trainer's
router picks the same set of experts as the engine's did, `routing/recorded_share` the share of the forwarded
positions that carried a record. Positions without a record (padding, env-written tokens, the last response
token) are left to the trainer's router and not counted.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
from torch import Tensor

from asyncrl.messages import Trajectory
from asyncrl.training.batch import TokenBatch, routing_rows
from engines.routing import Routing, stack_layers


class RoutingReplay:
    """Installed on the policy model (before any wrapping: the routers' forwards are patched in place)."""

    def __init__(self, model: torch.nn.Module, mode: str) -> None:
        if mode not in ("measure", "rollout"):
            raise ValueError(f"algorithm.routing_replay must be 'off', 'measure' or 'rollout', got {mode!r}")
        try:
            self.routing = Routing(model)
        except ValueError as exc:
            raise ValueError(f"algorithm.routing_replay = {mode!r}: {exc}") from None
        self.replay = mode == "rollout"
        self.shape = (len(self.routing.routers), self.routing.top_k)
        self.agree = self.decisions = self.recorded = self.positions = 0

    @contextmanager
    def forward(self, trajectories: list[Trajectory], batch: TokenBatch, *, packed: bool,
                count: bool = False) -> Iterator[None]:
        """Around one micro-batch's forward (and its backward: gradient checkpointing recomputes the forward
        there): the engine's routing of `trajectories` at `batch`'s positions replayed (rollout), and with
        `count` the forward's own choices compared with it."""
        rows = routing_rows(trajectories, batch.input_ids.shape[1], self.shape)
        real = batch.attention_mask.bool().cpu()
        flat = rows[real] if packed else rows.reshape(-1, *self.shape)  # the forward's flattened tokens, in order
        with ExitStack() as stack:
            if self.replay:
                stack.enter_context(self.routing.replaying(flat.to(batch.input_ids.device)))
            recorded = stack.enter_context(self.routing.recording()) if count else None
            yield
            if recorded is not None:
                self._count(flat, real, recorded, packed)

    def _count(self, engine: Tensor, real: Tensor, recorded: list[Tensor], packed: bool) -> None:
        forwards = stack_layers(recorded, self.shape[0])
        own = forwards[0].cpu()  # the micro-batch's forward (a recompute in the backward would follow it)
        keep = engine[:, 0, 0] >= 0
        if not packed:
            keep &= real.reshape(-1)
        self.positions += int(real.sum())
        self.recorded += int(keep.sum())
        same = (own[keep].sort(-1).values == engine[keep].to(own.dtype).sort(-1).values).all(-1)
        self.agree += int(same.sum())
        self.decisions += same.numel()

    def metrics(self) -> dict[str, float]:
        """The counts since the previous call, as the step's metrics; {} where nothing was counted."""
        out = {}
        if self.decisions:
            out["routing/agreement"] = self.agree / self.decisions
        if self.positions:
            out["routing/recorded_share"] = self.recorded / self.positions
        self.agree = self.decisions = self.recorded = self.positions = 0
        return out
