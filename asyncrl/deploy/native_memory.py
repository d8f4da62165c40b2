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

glibc's arenas: a process gets up to 8 heaps per core, one per thread that allocates (glibc's M_ARENA_MAX), and each
keeps the blocks its threads freed. A role's process runs its work on several threads (the trainer's update and
weight send on asyncio's worker pool, Ray's own threads), so a step's activations land in whichever arena the thread
of that step holds, and every arena keeps a step's worth of freed blocks. `MALLOC_ARENAS` (2) of them for the whole
process, set before it starts (`arena_env`; `bound_native_memory` caps what is left to cap in a process that started
without it, such as an in-process run's): on the long-reply example the trainer's process rested at 3.9 GiB instead
of 5.0 and peaked at 4.46 instead of 5.35 over 6 steps, its steps no slower (benchmarks/README.md).

A setting the user made wins: an environment variable already set is left alone.
"""

from __future__ import annotations

import ctypes
import os

KERNEL_CACHE_CAPACITY = 128
MALLOC_ARENAS = 2
M_ARENA_MAX = -8  # glibc's malloc.h
CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_native_memory() -> None:
    """Cap ideep's and oneDNN's kernel caches at `KERNEL_CACHE_CAPACITY` entries unless the environment names them
    already (each library reads its variable when it makes its first kernel), and glibc's arenas at
    `MALLOC_ARENAS` unless MALLOC_ARENA_MAX is set (read by glibc at the process's start)."""
    for name in CACHES:
        os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))
    if "MALLOC_ARENA_MAX" not in os.environ:
        limit_arenas(MALLOC_ARENAS)


def arena_env() -> dict[str, str]:
    """MALLOC_ARENA_MAX for a role's process where the user did not set it: glibc reads it when the process starts,
    before Ray's own threads take their arenas (a later `limit_arenas` caps only the arenas made after it). The
    local cluster's processes inherit it from the driver (asyncrl/deploy/launch.py `start_ray`); on a cluster of
    its own each actor gets it in its runtime_env (`actor_options`)."""
    return {} if "MALLOC_ARENA_MAX" in os.environ else {"MALLOC_ARENA_MAX": str(MALLOC_ARENAS)}


def limit_arenas(n: int) -> bool:
    """glibc's mallopt(M_ARENA_MAX, n): threads that allocate from now on share at most `n` heaps. False where
    the C library is not glibc (musl, macOS: nothing to do)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, n))
