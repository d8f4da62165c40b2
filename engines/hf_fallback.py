"""Fallback backend of the native engine: any HF causal LM through its own forward.

Place in the dataflow: `TorchEngine` picks this backend when `engines.torch_model.unsupported_reason`
names something the fast `SlotDecoder` does not compute (another architecture, rope scaling, sliding
windows), when built with `fast=False` or when it records an MoE model's routing (`record_routing`);
`engines.scheduler` drives it through the same slot contract (capacity / prefill / decode / move / refresh /
release, see engines/torch_model.py). Each slot holds its own DynamicCache and every decode step runs one HF
forward per sequence: correct for any model, slower.
"""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch

from engines.routing import Routing, stack_layers


@contextmanager
def _eval_mode(model: torch.nn.Module):
    """Dropout off for the forwards inside (a module shared with a trainer may be in train mode); a module in eval
    mode already is left alone: `train()` walks every submodule, a cost per call."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train(True)


class HFDecoder:
    """Fallback backend: the HF module's own forward, one DynamicCache and one forward per sequence."""

    def __init__(self, model: torch.nn.Module, device: torch.device, record_routing: bool = False) -> None:
        self.model = model
        self.device = device
        # an MoE model's routing per forward (engines/routing.py): after `prefill`, `routing_out[c]` is context
        # c's [len, layers, k]; after `decode`, `routing_out[j]` is slot j's [1, layers, k]; None: not recorded
        self.routing = Routing(model) if record_routing else None
        self.routing_out: list[torch.Tensor] = []
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._caches: list = []
        self._lens: list[int] = []

    def capacity(self, slots: int, length: int) -> None:
        missing = slots - len(self._caches)
        self._caches += [None] * max(0, missing)
        self._lens += [0] * max(0, missing)

    def release(self) -> None:
        """Drop every slot's cache (the engine sleeps); `capacity` adds slots again."""
        self._caches, self._lens = [], []

    def refresh(self) -> None:
        """Nothing to do: HF's own forward reads the swapped parameters directly (no derived tables)."""

    def move(self, src: int, dst: int) -> None:
        self._caches[dst], self._lens[dst] = self._caches[src], self._lens[src]
        self._caches[src] = None

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    def _step(self, ids: list[int], start: int, cache) -> torch.Tensor:
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        ids_t = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=ids_t, position_ids=pos, use_cache=True, **{self._cache_kw: cache})
        return out.logits[0, -1]

    @contextmanager
    def _forwards(self) -> Iterator[None]:
        """Around one prefill's or decode step's forwards (one per sequence): eval mode, and the routing of each
        forward, in call order, into `routing_out`."""
        self.routing_out = []
        with _eval_mode(self.model), (self.routing.recording() if self.routing else nullcontext()) as rec:
            yield
            if self.routing is not None:
                self.routing_out = stack_layers(rec, len(self.routing.routers))

    def prefill(
        self, contexts: list[list[int]], start: int, repeats: list[int], logits: bool = True
    ) -> torch.Tensor | None:
        out, slot = [], start
        with self._forwards():
            for ctx, r in zip(contexts, repeats):
                cache = self._new_cache()
                out.append(self._step(ctx, 0, cache))
                for j in range(r):
                    self._caches[slot + j] = cache if j == 0 else copy.deepcopy(cache)
                    self._lens[slot + j] = len(ctx)
                slot += r
        return torch.stack(out) if logits else None

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        out = []
        with self._forwards():
            for j, tok in enumerate(tokens.tolist()):
                out.append(self._step([tok], self._lens[j], self._caches[j]))
                self._lens[j] += 1
        return torch.stack(out)
