"""The rollout-engine contract and the lazy name → engine registry.

Place in the dataflow: a Generator role holds one `RolloutEngine`. It sends token-id prompts and
`SamplingParams` to `generate` and wraps the returned `Completion`s into Trajectories; the weight
receiver calls `load_weights` after each broadcast from the Trainer, which bumps `version` so that
every later token is stamped with the new policy version.

Engines are chosen by name from config (`rollout.engine`). vLLM and SGLang are registered as lazy
import paths, so importing this module never imports them; only `create_engine("vllm", ...)` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

from asyncrl.messages import Completion, SamplingParams, WeightsMeta
from asyncrl.registry import Registry

if TYPE_CHECKING:
    import torch


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates token ids from token ids with one policy version loaded at a time."""

    version: int
    """Policy version of the weights currently loaded; 0 = initial weights."""

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions (the n samples share one prefill).

        Each completion's `logprobs` are log_softmax(logits / T) over the full vocabulary at the sampled
        token, and its `versions` the engine version that sampled each token.
        """
        ...

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `tensors` (named as in the model's state_dict; a subset is allowed) into the model and set
        `version`. A swap never lands inside a decode step: an engine either waits for running calls or,
        with in-flight updates (the torch engine), applies it at the next decode-step boundary so that
        running sequences go on under the new version. Blocks the calling thread until it has landed."""
        ...

    async def close(self) -> None:
        """Release the engine's resources; generate() fails afterwards."""
        ...


@runtime_checkable
class SleepableEngine(RolloutEngine, Protocol):
    """An engine that can give its device memory back between generations (optional; check with isinstance,
    or `can_sleep(name)` before one is built). With `cluster.placement = "colocated"` the Generator puts it to
    sleep before each train step and wakes it after the weight sync, so that the trainer can use the memory."""

    async def sleep(self) -> None:
        """Release the K/V cache (and buffers derived from it) and hand the memory back to the device. Only
        while idle: with a sequence in flight it raises RuntimeError and changes nothing. The weights stay, and
        `load_weights` still works; `generate` raises until `wake()`."""
        ...

    async def wake(self) -> None:
        """Make `generate` work again (the cache is allocated again as requests need it)."""
        ...


@runtime_checkable
class CollectiveWeightEngine(RolloutEngine, Protocol):
    """An engine whose own worker processes join the trainer's weight-sync group (vLLM, SGLang), so a
    broadcast lands where the model lives instead of in the generator's process (optional; check with
    isinstance). The group and its wire format are `transports.collective`'s."""

    async def join_weight_group(self, *, host: str, port: int, rank: int, world_size: int, backend: str,
                                timeout_s: float, meta: WeightsMeta) -> None:
        """Join the group as `rank` (all members join together; the call blocks until they have)."""
        ...

    async def receive_weights(self) -> tuple[int, dict[str, float]]:
        """Take part in one broadcast, load the weights in place, reset prefix caches, set `version`.
        Returns (version, stats with the `sync/*` keys)."""
        ...


ENGINES: Registry[type] = Registry("rollout engine")
ENGINES.register_lazy("torch", "engines.torch_engine:TorchEngine")
ENGINES.register_lazy("vllm", "engines.vllm_engine:VLLMEngine")
ENGINES.register_lazy("sglang", "engines.sglang_engine:SGLangEngine")

@dataclass(frozen=True)
class EngineTraits:
    """What the runtime asks of a rollout engine, by its registered name, without importing it: every question of
    the kind "is the engine torch?" is one of these (kept here, not on the classes, so that asking imports none)."""

    transport: str        # the wire format its receiving side speaks: a sender in `transports.base.SENDERS`
    in_process: bool      # generates in the generator's own process, on the device it is given (`device=`), and
                          # that process receives the weights (so a restarted generator re-forms the weight group);
                          # False: it places workers of its own that hold their own group membership (vLLM, SGLang)
    ipc: bool             # takes `weight_sync.backend = "ipc"` (transports/ipc.py: the receiver's copy goes straight
                          # to `load_weights`; vLLM / SGLang workers join groups of their own)
    sleeps: bool          # implements `SleepableEngine` (what cluster.placement = "colocated" needs); vLLM's sleep
                          # mode is CUDA-only and SGLang's release_memory_occupation needs a GPU: neither is wired
    subset_weights: bool  # loads a subset of the weights (under LoRA the ones the adapters change); False: every one
    wraps_module: bool    # can wrap the trainer's module in place, without a copy (colocated in one process)
    records_routing: bool = False  # records an MoE model's routing per position (`record_routing`, for
                          # algorithm.routing_replay); vLLM's needs its V2 model runner (Triton: not on a CPU),
                          # refused with one error at its start where missing
    fp32_head: bool = False  # takes `lm_head_fp32=True` (rollout.lm_head_fp32): the LM head's product in float32 on
                          # bfloat16 / float16 weights; vLLM and SGLang compute their logits in their own dtype


ENGINE_TRAITS: dict[str, EngineTraits] = {
    "torch": EngineTraits(transport="bucketed", in_process=True, ipc=True, sleeps=True, subset_weights=True,
                          wraps_module=True, records_routing=True, fp32_head=True),
    "vllm": EngineTraits(transport="bucketed", in_process=False, ipc=False, sleeps=False, subset_weights=False,
                         wraps_module=False, records_routing=True),
    "sglang": EngineTraits(transport="per_tensor", in_process=False, ipc=False, sleeps=False, subset_weights=False,
                           wraps_module=False),
}


def traits(engine: str) -> EngineTraits:
    """The traits of the engine registered as `engine`; KeyError naming the known ones."""
    if engine not in ENGINE_TRAITS:
        raise KeyError(f"rollout engine {engine!r} declares no traits (engines/base.py ENGINE_TRAITS); known: "
                       f"{', '.join(sorted(ENGINE_TRAITS))}")
    return ENGINE_TRAITS[engine]


# views of the table, by name
WEIGHT_TRANSPORTS = {name: t.transport for name, t in ENGINE_TRAITS.items()}
IPC_ENGINES = frozenset(name for name, t in ENGINE_TRAITS.items() if t.ipc)
SLEEPING_ENGINES = frozenset(name for name, t in ENGINE_TRAITS.items() if t.sleeps)


def can_sleep(engine: str) -> bool:
    """Whether the engine registered as `engine` can release its memory while the trainer trains."""
    return engine in SLEEPING_ENGINES


def sleeping_engines() -> list[str]:
    """The names of the engines that can sleep (what `cluster.placement = "colocated"` accepts)."""
    return sorted(SLEEPING_ENGINES)


def weight_transport(engine: str) -> str:
    """The weight transport the trainer must send with to generators running `engine`."""
    if engine not in WEIGHT_TRANSPORTS:
        raise KeyError(f"rollout engine {engine!r} declares no weight transport; known: "
                       f"{', '.join(sorted(WEIGHT_TRANSPORTS))}")
    return WEIGHT_TRANSPORTS[engine]


def ipc_engines() -> list[str]:
    """Engines that can take `weight_sync.backend = "ipc"` (asyncrl/deploy/placement.py `check_backend` checks it)."""
    return sorted(IPC_ENGINES)


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Raise ValueError with one line for an empty prompt or a token id outside the vocabulary."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; an engine needs at least one prompt token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")


def available_engines() -> list[str]:
    """Names `create_engine` accepts (registered; an optional one may still fail to import)."""
    return ENGINES.names()


def create_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine registered as `name` with `kwargs`. Unknown name: KeyError listing known names."""
    cls = ENGINES.get(name)
    return cls(**kwargs)
