"""A role's process: kernel caches that do not grow with every new tensor shape.

Place in the dataflow: each role's process calls `bound_native_memory()` once, first thing (RoleActor; an in-process
run's LocalDeployment), before it builds a model or runs a kernel. Nothing else reads it; `memory/<role>_peak_gb`
(asyncrl/telemetry/memory.py) shows its effect, benchmarks/trainer_memory.py measures it.

A run's train steps rarely see the same shapes twice: each step's replies have new lengths, so its micro-batches
(cut by `trainer.max_tokens_per_micro_batch`, or padded to their longest) have new widths. PyTorch's CPU matmuls
(bf16 autocast included) go through ideep, which keeps each shape's computation in an LRU cache
(`LRU_CACHE_CAPACITY`, 1024 entries by default), and oneDNN keeps each shape's primitive
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1024): a step of new widths adds some hundred entries to each, ~80 MB a step,
until they fill — the trainer's resting and peak memory crept up step after step while its live tensors stayed
the same. Capped at `KERNEL_CACHE_CAPACITY` each (more than one step's own shapes; a later step meets few of them
again) they stop growing, and the step was no slower — a little faster in each pair measured (benchmarks/README.md,
trainer_memory.py).

What is left of the growth is glibc's heap: blocks of ever-changing sizes leave free fragments between live ones.
A fixed mmap threshold (`mallopt(M_MMAP_THRESHOLD)`, or `MALLOC_MMAP_THRESHOLD_`) maps large blocks of their own and
returns them on free, but each is then new pages to fault in: at 4 MiB the README job's step took 18% longer for no
lower peak, so malloc is left as it is; a user may set it in the environment.

A setting the user made wins: an environment variable already set is left alone.
"""

from __future__ import annotations

import os

KERNEL_CACHE_CAPACITY = 128
CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_native_memory() -> None:
    """Cap ideep's and oneDNN's kernel caches at `KERNEL_CACHE_CAPACITY` entries unless the environment names them
    already (each library reads its variable when it makes its first kernel)."""
    for name in CACHES:
        os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))
