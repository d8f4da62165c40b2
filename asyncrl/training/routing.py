"""The trainer's side of rollout routing replay (algorithm.routing_replay) for mixture-of-experts policies.

Place in the dataflow: the native engine records the experts each position was routed to (engines/routing.py);
the trajectories carry them (`routed_experts`); here the Learner's forwards over a micro-batch either replay them
("rollout": the experts the engine used, the router's own weights for them, so the router trains) or only compare
them with the trainer's own routing ("measure"). Either way the forward's own choices are recorded and counted
against the engine's: `routing/agreement` is the share of (position, MoE layer) decisions on which the trainer's
router picks the same set of experts as the engine's did, `routing/recorded_share` the share of the forwarded
positions that carried a record. Positions without a record (padding, env-written tokens, the last response
token) are left to the trainer's router and not counted.

`RouterAuxLoss` (trainer.router_aux_loss_coef): the load-balancing loss an MoE was pretrained with, added to the
policy loss so that RL does not collapse the routing onto a few experts.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import Tensor

from asyncrl.messages import Trajectory
from asyncrl.training.batch import TokenBatch, routing_rows
from engines.routing import Routing, moe_routers, stack_layers


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


def replayed(routing: RoutingReplay | None, trajectories: list[Trajectory], batch: TokenBatch) -> Any:
    """The context of a forward of a frozen reference or a critic over `batch` (padded rows): the engine's routing
    of `trajectories` replayed where `routing` is set (`replay_on`), else nothing."""
    if routing is None:
        return nullcontext()
    return routing.forward(trajectories, batch, packed=False)


def replay_on(model: torch.nn.Module, mode: str) -> RoutingReplay | None:
    """A reference policy's or critic's RoutingReplay: with algorithm.routing_replay = "rollout" and an MoE model
    they route each recorded position as the engine did, as the policy does; None for a dense model or another
    mode (they are not diagnosed: routing/agreement is the policy's)."""
    if mode != "rollout" or not moe_routers(model):
        return None
    return RoutingReplay(model, mode)


class RouterAuxLoss:
    """trainer.router_aux_loss_coef > 0: the load-balancing loss of `model`'s family (its modeling module's own
    `load_balancing_loss_func`: Switch Transformer's, experts x Σ_e share of top-k assignments to e x mean router
    probability of e, over the forward's real tokens and layers), from the router logits of each gradient forward.

    A forward hook keeps the routers' logits while `collecting()` is open; `loss()` turns them into the aux loss
    and stops collecting, before the backward, whose checkpointed recomputation runs the routers again. A
    micro-batch's aux loss is weighted by its share of the step's sequences, so that the step's term is the mean
    over its micro-batches as a whole batch's would be when they are alike (the loss is not linear in the batch).
    """

    def __init__(self, model: torch.nn.Module, coef: float) -> None:
        routers = moe_routers(model)
        if not routers:
            raise ValueError(f"trainer.router_aux_loss_coef = {coef}: the model has no MoE router (a dense model "
                             f"has no load to balance) — set it to 0")
        self.fn = getattr(sys.modules[type(routers[0]).__module__], "load_balancing_loss_func", None)
        if self.fn is None:
            raise ValueError(f"trainer.router_aux_loss_coef: {type(routers[0]).__name__}'s model family defines no "
                             f"load_balancing_loss_func")
        self.coef, self.num_experts, self.top_k = coef, routers[0].num_experts, routers[0].top_k
        self._logits: list[Tensor] | None = None
        self.total = self.weight = 0.0  # Σ weight x aux loss and Σ weight since metrics()
        for router in routers:
            router.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: Any, output: tuple[Tensor, ...]) -> None:
        if self._logits is not None:
            self._logits.append(output[0])  # [tokens, experts], with grad: the router trains through it

    @contextmanager
    def collecting(self) -> Iterator[None]:
        self._logits = []
        try:
            yield
        finally:
            self._logits = None

    def loss(self, attention_mask: Tensor | None, share: float) -> Tensor:
        """coef x share x the aux loss of the forward run inside `collecting()` (attention_mask [B, L] of its
        rows, None for a packed row of real tokens only); ends the collection."""
        if not self._logits:
            raise RuntimeError("RouterAuxLoss.loss: no router ran inside collecting()")
        logits, self._logits = tuple(self._logits), None
        aux = self.fn(logits, self.num_experts, self.top_k, attention_mask)
        self.total += share * float(aux)
        self.weight += share
        return self.coef * share * aux

    def metrics(self) -> dict[str, float]:
        """`trainer/router_aux_loss`: the step's aux loss (before the coefficient), its micro-batches' weighted
        mean; {} where no gradient forward ran since the previous call."""
        out = {"trainer/router_aux_loss": self.total / self.weight} if self.weight else {}
        self.total = self.weight = 0.0
        return out
