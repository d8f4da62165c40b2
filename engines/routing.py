"""Mixture-of-experts routing: a model's routers, the experts each token was routed to, and replaying them.

Place in the dataflow: the native engine records, for every position a forward runs, the experts each MoE layer
chose (`Routing.recording`); the trajectory carries them to the trainer, whose forward then uses those experts
(`Routing.replaying`) instead of the ones its own router would pick — rollout routing replay: the engine (bf16, other
batch shapes, weights of an older version) and the trainer (fp32) can pick different experts for the same token,
and then the trained log-probability is not the one that sampled it.

Routers are transformers 5's `*TopKRouter` modules of the MoE blocks (`mlp.gate` in Qwen2-MoE, Qwen3-MoE, Mixtral,
OLMoE): `weight` [experts, hidden], `top_k`, and `forward(h) -> (logits, scores, indices)` over the flattened
tokens, scores being the chosen experts' routing weights. Replaying keeps the router's own logits and weights:
the scores are the router's probabilities of the replayed experts, normalised as that family normalises them, so
the router still trains through the experts it is told to use. Routing is stored per layer as [positions, top_k]
small integers (`ROUTING_DTYPE`); a row of -1 is a position with no record (env observation tokens, a token the
engine never ran): the trainer's own router decides there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

ROUTING_DTYPE = torch.int16  # expert ids up to 32767; -1 = no record

# router class -> whether its top-k weights are cast back to the logits' dtype (Mixtral keeps float32). Each
# normalises the chosen weights where its `norm_topk_prob` says so (Mixtral always). tests/unit/test_routing.py
# holds each to its router's own forward, bit for bit.
ROUTER_CASTS = {"Qwen3MoeTopKRouter": True, "Qwen2MoeTopKRouter": True, "OlmoeTopKRouter": True,
                "MixtralTopKRouter": False}


def _family(router: torch.nn.Module) -> str | None:
    """The router's class in `ROUTER_CASTS`, looked up along its bases (peft's LoRA on the router's weight turns the
    class into a `Parametrized...` subclass); None if unknown."""
    return next((c.__name__ for c in type(router).__mro__ if c.__name__ in ROUTER_CASTS), None)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of `model`'s MoE layers in forward order; [] for a dense model. ValueError for a router of a
    family whose replay is not known (`ROUTER_CASTS`)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    unknown = sorted({type(m).__name__ for m in found if _family(m) is None})
    if unknown:
        raise ValueError(f"routing: unsupported MoE router {', '.join(unknown)} (known: {', '.join(ROUTER_CASTS)})")
    return found


def _scores(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The routing weights `router` gives experts `indices` [tokens, k] for its `logits` [tokens, experts]."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", True):
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype) if ROUTER_CASTS[_family(router) or ""] else top


class Routing:
    """Installed on a model's routers (`Routing(model)`; `remove()` restores them): inside `recording()` each
    forward's routing is kept, the router's own choice per layer; inside `replaying(routing)` each router uses the
    recorded experts instead. The state lives on this object, not in a context of one call, so that a forward's
    recomputation in the backward (gradient checkpointing) routes as the forward did while `replaying` is open."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("routing: the model has no MoE router (a dense model routes nothing)")
        if any("forward" in vars(r) for r in self.routers):
            raise ValueError("routing: the model's routers are patched already (one Routing per model)")
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].num_experts
        self.forced: torch.Tensor | None = None  # [tokens, layers, k] while replaying
        self.recorded: list[torch.Tensor] | None = None  # [tokens, k] per layer and forward, while recording
        for layer, router in enumerate(self.routers):
            router.forward = self._forward_of(layer, router)  # type: ignore[method-assign]

    def _forward_of(self, layer: int, router: torch.nn.Module):
        own_forward = type(router).forward

        def forward(hidden: torch.Tensor):
            logits, scores, own = own_forward(router, hidden)
            if self.recorded is not None:
                self.recorded.append(own.detach())  # the router's own dtype: `stack_layers` converts once
            if self.forced is None:
                return logits, scores, own
            forced = self.forced[:, layer].to(device=own.device, dtype=own.dtype)
            if forced.shape[0] != own.shape[0]:
                raise ValueError(f"routing replay: {forced.shape[0]} recorded tokens for a forward of {own.shape[0]}")
            indices = torch.where(forced[:, :1] < 0, own, forced)
            return logits, _scores(router, logits, indices), indices

        return forward

    def remove(self) -> None:
        for router in self.routers:
            del router.forward  # the class's method again

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Keep the routers' own choices of the forwards run inside: the yielded list gets one [tokens, k] tensor
        (expert ids in the router's dtype) per layer and forward, in call order; `stack_layers` makes them records."""
        self.recorded = []
        try:
            yield self.recorded
        finally:
            self.recorded = None

    @contextmanager
    def replaying(self, routing: torch.Tensor) -> Iterator[None]:
        """Route each token of the forwards (and their recomputation in the backward) run inside to the experts in
        `routing` [tokens, layers, k] (the forward's flattened tokens: batch x sequence in order); rows of -1 are
        left to the router."""
        layers = len(self.routers)
        if routing.dim() != 3 or routing.shape[1] != layers or routing.shape[2] != self.top_k:
            raise ValueError(f"routing replay: routing of shape {tuple(routing.shape)} for a model of {layers} MoE "
                             f"layers x top-{self.top_k}: want [tokens, {layers}, {self.top_k}]")
        if routing.numel() and (int(routing.max()) >= self.num_experts or int(routing.min()) < -1):
            raise ValueError(f"routing replay: expert ids must be in [0, {self.num_experts}) or -1 (no record), "
                             f"got {int(routing.min())}..{int(routing.max())}")
        self.forced = routing
        try:
            yield
        finally:
            self.forced = None


def stack_layers(recorded: Sequence[torch.Tensor], layers: int) -> list[torch.Tensor]:
    """`Routing.recording`'s list (layer after layer, forward after forward) as one [tokens, layers, k] tensor
    (`ROUTING_DTYPE`) per forward. Forwards of one length (a decode step's: one token each) are stacked and
    converted in one go, not forward by forward."""
    if len(recorded) % layers:
        raise ValueError(f"routing: {len(recorded)} layer records is not a whole number of {layers}-layer forwards")
    if not recorded:
        return []
    if len({r.shape[0] for r in recorded}) == 1:
        every = torch.stack(list(recorded)).to(ROUTING_DTYPE)  # [forwards x layers, tokens, k]
        return list(every.view(-1, layers, *every.shape[1:]).transpose(1, 2).unbind(0))
    return [torch.stack(list(recorded[i : i + layers]), dim=1).to(ROUTING_DTYPE)
            for i in range(0, len(recorded), layers)]


def pack_routing(routing: torch.Tensor) -> dict:
    """[positions, layers, k] -> the `routed_experts` / `routing_shape` fields of a Completion or Trajectory."""
    if routing.dim() != 3:
        raise ValueError(f"routing: want [positions, layers, top_k], got shape {tuple(routing.shape)}")
    data = routing.to(ROUTING_DTYPE).contiguous().cpu().numpy().astype("<i2").tobytes()
    return {"routed_experts": data, "routing_shape": [int(routing.shape[1]), int(routing.shape[2])]}


def unpack_routing(data: bytes, shape: Sequence[int]) -> torch.Tensor:
    """`routed_experts` bytes with their `routing_shape` [layers, k] -> [positions, layers, k] (`ROUTING_DTYPE`)."""
    import numpy as np

    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"routing: routing_shape must be [layers, top_k], got {list(shape)}")
    row = 2 * shape[0] * shape[1]
    if len(data) % row:
        raise ValueError(f"routing: {len(data)} bytes is not a whole number of positions of {list(shape)} int16")
    flat = np.frombuffer(data, dtype="<i2").astype(np.int16)
    return torch.from_numpy(flat.copy()).view(-1, shape[0], shape[1])
