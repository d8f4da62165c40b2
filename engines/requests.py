"""What the native engine's scheduler keeps per request, per sequence and per staged weight swap.

Place in the dataflow: `TorchEngine.generate` builds a `Request` (one call: prompts x n samples, one
future) and `load_weights` a `Swap`; `engines.scheduler` turns each admitted prompt into n `Sequence`s,
appends sampled tokens to them, and resolves the request's future on the caller's own event loop once
every sequence has finished.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from asyncrl.messages import Completion, SamplingParams
from engines.routing import pack_routing


@dataclass(eq=False)
class Request:
    """One generate() call: prompts x n sequences, resolved together."""

    prompts: list[list[int]]                  # as the engine sees them (truncated to max_prompt_len)
    truncated: list[bool]
    params: SamplingParams
    stop_ids: frozenset[int]                  # eos ids + params.stop_token_ids
    detokenize: Callable[[list[int]], str] | None  # set when params.stop has stop strings
    loop: asyncio.AbstractEventLoop           # the caller's loop: the future resolves there
    future: asyncio.Future
    admitted: int = 0                         # prompts admitted so far (each with its n samples)
    cancelled: bool = False                   # the caller stopped waiting: drop it at the next boundary
    results: list[list[Completion | None]] = field(init=False)
    pending: int = field(init=False)          # sequences not finished yet

    def __post_init__(self) -> None:
        self.results = [[None] * self.params.n for _ in self.prompts]
        self.pending = len(self.prompts) * self.params.n

    def resolve(self, result=None, error: BaseException | None = None) -> None:
        """Set the future's result (or error) from any thread, on the caller's loop."""
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future, result, error)
        except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
            pass


def _resolve(fut: asyncio.Future, result, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


@dataclass(eq=False)
class Sequence:
    """One sample of one prompt while it runs; `finish` is set once it is done."""

    req: Request
    prompt_idx: int
    sample_idx: int
    gen: torch.Generator | None  # own random stream of a seeded request (None: the engine's stream)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_reused: bool = False      # kept K/V computed under older weights across a swap
    finish: str | None = None
    # an MoE model's routing (record_routing): [positions, layers, k] chunks in position order, the prompt's
    # from its prefill (shared by the n samples), then one per decode step (the position of the token it fed)
    routing: list[torch.Tensor] = field(default_factory=list)

    @property
    def prompt(self) -> list[int]:
        return self.req.prompts[self.prompt_idx]

    def finish_reason(self, token: int) -> str | None:
        """Why the sequence ends after sampling `token` (already appended), or None to go on."""
        params = self.req.params
        if token in self.req.stop_ids:
            return "stop"
        if params.stop and self.req.detokenize is not None:
            text = self.req.detokenize(self.tokens)
            if any(stop in text for stop in params.stop):
                return "stop"
        if len(self.tokens) >= params.max_new_tokens:
            return "length"
        return None

    def completion(self) -> Completion:
        return Completion(
            prompt_ids=list(self.prompt), response_ids=self.tokens, logprobs=self.logprobs,
            versions=self.versions, finish_reason=self.finish or "abort",
            prompt_truncated=self.req.truncated[self.prompt_idx], kv_reused=self.kv_reused,
            **(pack_routing(torch.cat(self.routing)) if self.routing else {}),
        )


@dataclass(eq=False)
class Swap:
    """A staged weight update; `load_weights` waits on `done`."""

    copy: Callable[[], None]  # copies the staged tensors into the module (validated by the engine)
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def sequence_seed(seed: int, prompt_idx: int, sample_idx: int) -> int:
    """A distinct 63-bit seed per (request seed, prompt, sample): a seeded sample's stream depends on
    nothing else in the batch."""
    mixed = seed * 0x9E3779B97F4A7C15 + prompt_idx * 0xBF58476D1CE4E5B9 + sample_idx * 0x94D049BB133111EB
    return (mixed + 1) % (1 << 63)
