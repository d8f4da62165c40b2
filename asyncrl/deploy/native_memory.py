"""A role's process: native memory that does not grow with every new tensor shape.

Place in the dataflow: each role's process calls `bound_native_memory()` once, first thing (RoleActor; an in-process
run's LocalDeployment), before it builds a model or runs a kernel. Nothing else reads it; `memory/<role>_peak_gb`
(asyncrl/telemetry/memory.py) shows its effect.

A run's train steps rarely see the same shapes twice: each step's replies have new lengths, so its micro-batches
(cut by `trainer.max_tokens_per_micro_batch` or padded to their longest) have new widths. Two things in a CPU
process kept memory for every shape, so the trainer's resting and peak memory crept up step after step (the
long-tail example's Learner alone, SmolLM2's shape, bf16 autocast: +0.1-0.15 GB a step, 3.6 GB at step 2 to 4.6 at
step 8 and on; live tensors constant):

- **kernel caches.** PyTorch's CPU matmuls go through ideep, which keeps each shape's computation in an LRU cache
  (`LRU_CACHE_CAPACITY`, 1024 by default), and oneDNN keeps each shape's primitive (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`,
  1024): a step of new widths adds some hundred of each, ~80 MB, until they fill. Capped at `KERNEL_CACHE_CAPACITY`
  each, more than one step's own shapes, the step time did not change (later steps have other widths anyway).
- **heap fragments.** glibc's malloc raises its mmap threshold up to 32 MiB as large blocks are freed, after which
  activations of every size are carved from the heap; blocks of ever-changing sizes leave free fragments between
  live ones that it cannot give back (1.1-1.5 GB free inside the heap by step 8). A fixed threshold of
  `MMAP_THRESHOLD` (`mallopt(M_MMAP_THRESHOLD)`, which also ends the adjustment) maps blocks above it of their own
  and unmaps them when freed; the heap keeps the small ones. Lower thresholds cost page faults: at 256 KiB the step
  took twice as long, at 4 MiB the same time.

Both together: the same Learner's peak 3.4 GB at step 2, flat at 3.6 GB from step 4 (8 steps), its resting memory
flat at 3.2 GB. A setting the user made wins: an environment variable already set is left alone
(`MALLOC_MMAP_THRESHOLD_` included, which glibc read at the process's start).
"""

from __future__ import annotations

import ctypes
import os

KERNEL_CACHE_CAPACITY = 128
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def bound_native_memory() -> bool:
    """Cap the kernel caches (by environment, read when the first kernel is made) and fix the mmap threshold (glibc
    only). Returns whether the threshold was set (False: not glibc, or the user's `MALLOC_MMAP_THRESHOLD_`)."""
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process runs on
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator, its own policy
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
