"""Numerics of the trainer's models: mixed precision, gradient checkpointing, and the dtype of each copy.

Place in the dataflow: `asyncrl.deploy.build` loads the trained models (policy, critic) in `master_dtype`, the frozen
reference in `reference_dtype` and the generators' engines in `engine_dtype`; the Learner, the Critic and the
ReferencePolicy run every forward inside `autocast(...)`; the Learner and the Critic wrap their gradient passes
in `checkpointing(model)`. The weight broadcast converts the master weights to the engines' dtype bucket by
bucket as it packs them (transports/bucketing.py `wire_dtype`), never as a converted copy of the whole model.

    trainer.mixed_precision = "bf16"   parameters, gradients and AdamW state in float32 (the master weights);
                                       the forward (and so the backward) matmuls in bfloat16 under torch.autocast;
                                       the logprob / entropy / value maths after the model stays float32
                                       (training/batch.py upcasts the logits before the log-softmax)
    model.gradient_checkpointing       HF gradient checkpointing (non-reentrant) of every decoder layer: its
                                       activations are recomputed in the backward pass instead of kept

HF checkpoints a layer only while the layer (older releases: the base model) is in training mode, and the trainer
keeps its models in eval mode: the trainer's logprobs must be the engine's, so no dropout. `checkpointing(model)`
therefore flips the training flag of just the modules that carry `gradient_checkpointing` (the decoder layers and
the base model), not of their submodules, for the span of one gradient pass: attention dropout and nn.Dropout
stay off, and the no-grad forwards (a step's preparation, evaluation on the shared module) run as before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

log = logging.getLogger(__name__)

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"no": None, "bf16": torch.bfloat16}


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    """trainer.mixed_precision -> the autocast dtype of the trainer's forwards (None: no autocast)."""
    try:
        return AUTOCAST_DTYPES[mixed_precision]
    except KeyError:
        raise ValueError(f"trainer.mixed_precision: unknown value {mixed_precision!r}; expected "
                         f"{' or '.join(map(repr, AUTOCAST_DTYPES))}") from None


def master_dtype(model_dtype: str, mixed_precision: str) -> str:
    """The dtype the trained models (policy, critic) are loaded and kept in: float32 under mixed precision."""
    return model_dtype if autocast_dtype(mixed_precision) is None else "float32"


def reference_dtype(model_dtype: str, mixed_precision: str) -> str:
    """The frozen reference's dtype: it keeps no master copy, so under mixed precision it is loaded in the
    autocast dtype (its forward runs under the same autocast as the policy's)."""
    dtype = autocast_dtype(mixed_precision)
    return model_dtype if dtype is None else str(dtype).removeprefix("torch.")


def engine_dtype(model_dtype: str, rollout_dtype: str) -> str:
    """rollout.dtype, "auto" meaning model.dtype: the rollout engines' parameter dtype, and so the dtype the
    weight sync sends floating-point tensors in."""
    return model_dtype if rollout_dtype == "auto" else rollout_dtype


def check_autocast(device: torch.device, dtype: torch.dtype | None) -> None:
    """One clear line where the trainer's device cannot autocast to `dtype` (a GPU without bfloat16); one warning
    where it can only emulate it (a CPU without bfloat16 instructions: slower than float32, not faster)."""
    if dtype is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"trainer.mixed_precision: 'bf16' needs a GPU with bfloat16 support and {name} has "
                         "none — set it to 'no'")
    if dtype is torch.bfloat16 and device.type == "cpu" and not cpu_has_bf16():
        _warn_once("trainer.mixed_precision = 'bf16' on a CPU without bfloat16 instructions (AVX512-BF16 or AMX): "
                   "its matrix products are emulated and slower than float32; 'no' (and rollout.dtype = 'float32') "
                   "trains faster here")


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX512-BF16 or AMX): where bf16 pays on a CPU."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    """torch.autocast on `device`'s type in `dtype` (CPU included), or nothing for dtype None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def enable_gradient_checkpointing(model: torch.nn.Module, key: str = "model.gradient_checkpointing") -> None:
    """Turn on HF gradient checkpointing of `model` (non-reentrant: it needs no grad on the inputs, so no
    input-embedding hook is left behind to touch the engine's forwards on a shared module)."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{key}: {type(model).__name__} does not support gradient checkpointing — set it to false")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    disable_hook = getattr(model, "disable_input_require_grads", None)
    if disable_hook is not None:
        disable_hook()


def checkpointed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose training flag decides whether HF checkpoints (those with gradient_checkpointing on)."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


@contextlib.contextmanager
def checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """For one gradient pass: the checkpointed modules in training mode, their submodules as they were (see
    the module doc); a no-op for a model without gradient checkpointing."""
    modules = checkpointed_modules(model)
    before = [m.training for m in modules]
    for m in modules:
        m.training = True  # this module only: its children keep eval mode (no dropout)
    try:
        yield
    finally:
        for m, was in zip(modules, before):
            m.training = was
