"""The policy's optimizer and the finite check of its weights: the fast implementations of the train step.

Place in the dataflow: the Trainer's `Learner` (training/learner.py) builds its AdamW here, steps it once per
mini-batch, and checks the weights are finite before they are broadcast to the generators. What each choice saves
is measured by benchmarks/train_step.py (benchmarks/README.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.config.schema import TrainerConfig

__all__ = ["adamw", "all_finite", "match_fused"]


def adamw(params: list[Tensor], trainer: TrainerConfig) -> torch.optim.AdamW:
    """The policy's AdamW: the fused kernel where every parameter is a plain floating tensor on a device that has
    one (CPU included: at 135M parameters a step takes 0.24 s instead of 2.3 s with the default per-parameter
    loop, benchmarks/train_step.py); FSDP2's sharded DTensors keep torch's default implementation."""
    fused = bool(params) and all(_fusable(p) for p in params)
    return torch.optim.AdamW(params, lr=trainer.lr, betas=(trainer.betas[0], trainer.betas[1]),
                             weight_decay=trainer.weight_decay, fused=fused or None)


def _fusable(p: Tensor) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return (not hasattr(p, "to_local") and p.is_floating_point()
            and p.device.type in _get_fused_kernels_supported_devices())


def match_fused(optimizer: torch.optim.Optimizer) -> None:
    """After loading a state dict: each param group runs the implementation its parameters allow (the loaded groups
    carry the writer's `fused` flag), and a fused group's `step` counters live on its parameters' device, as the
    fused kernel needs."""
    for group in optimizer.param_groups:
        group["fused"] = all(_fusable(p) for p in group["params"]) or None
        if group["fused"]:
            group["foreach"] = None
            for p in group["params"]:
                st = optimizer.state.get(p, {})
                if isinstance(st.get("step"), Tensor):
                    st["step"] = st["step"].to(dtype=torch.float32, device=p.device)


def all_finite(params: list[Tensor]) -> bool:
    """True when every parameter is finite (a sum is finite only if every term is, barring an overflow of
    huge finite values, which the caller's exact per-parameter check then clears)."""
    if not params:
        return True
    sums = torch._foreach_norm(params, 1)  # |p|_1 per tensor: NaN or inf exactly when p holds one (or overflows)
    return bool(torch.isfinite(torch.stack(sums).sum()))
