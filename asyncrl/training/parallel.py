"""Data-parallel training: one trainer rank's view of the trainer group (`trainer.num_ranks`, `trainer.parallel`).

Place in the dataflow: every trainer rank holds a `Learner` built with a `DataParallel` (rank 0 in its Trainer,
the others in a TrainerRank: asyncrl/roles/trainer_ranks.py); rank 0 takes the step's groups off the train store
and hands the whole step (token ids: kilobytes) to every rank, so every rank knows every sample's loss mask,
reward and group. The compute is what is split:

    prepare   each rank forwards its contiguous 1/W of the step (proximal / reference logprobs, critic values),
              `all_gather_rows` joins the rows; advantages (group statistics, whitening) are then computed from
              identical inputs on every rank, so every rank holds the step's full StepData.
    update    mini-batch k = samples [lo, hi) as in one process; rank r trains `shard(lo, hi)`, its 1/W of it,
              micro-batch by micro-batch. The loss of every micro-batch divides by the counts of the WHOLE
              mini-batch (global_tokens / global_seqs over all ranks: known on every rank, since every rank
              holds the step), and the gradients are SUMMED over ranks (DDP: a sum comm hook; FSDP2: gradient
              divide factor 1 with sum-only reductions), so Σ_ranks Σ_micro-batches loss = the one-process
              loss, term for term. Only the last micro-batch's backward synchronises (DDP `no_sync`, FSDP2
              `set_requires_gradient_sync`): accumulating into already-reduced gradients would count them W
              times.
    metrics   the per-rank GradientStats are reduced (sums, max, min) before the step's metrics are formed.
    weights   `full_state_dict` gathers each parameter (FSDP2: `full_tensor()`, a collective every rank
              joins, in the same order); only rank 0 packs and broadcasts what it gathered, and under FSDP2
              its evaluator's unsharded copy of the policy takes them (`copy_weights`).
    state     DDP: rank 0's replica is every rank's, so rank 0 writes the checkpoint and the HF export.
              FSDP2: every rank writes its shards of a checkpoint, and every rank joins the gather of the HF
              export, which rank 0 writes (training/sharded.py).

Equal work on every rank is an invariant, not a hope: FSDP2 all-gathers in every forward and DDP/FSDP2 reduce in
the synchronising backward, so ranks must run the same number of forwards and backwards. `shard` therefore
requires W to divide every mini-batch (checked in config: trainer.mini_batches × trainer.num_ranks divides
prompts_per_step × group_size), and equal shards give equal micro-batch counts.

Modes: "ddp" keeps a full replica per rank (the model is wrapped in DistributedDataParallel; the unwrapped
module keeps its parameter names for the broadcast, checkpoints and the HF export); "fsdp2" shards every decoder
layer and then the root with `fully_shard` (parameters become DTensors; memory per rank ~1/W, and on rank 0 the
gathered weights of the last update, plus the evaluator's copy when trainer.eval_every > 0).

The group is the process's default group (`init_process_group` over a TCPStore, gloo on CPU, NCCL on GPU):
FSDP2's DeviceMesh needs a registered group, and a trainer process hosts no engine that owns one. It is passed
explicitly everywhere (`DataParallel.group`); the weight-sync group stays the separate standalone group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)

Mode = Literal["ddp", "fsdp2"]
_MAX_FIELDS = ("ratio_max", "is_max")
_MIN_FIELDS = ("is_min",)


def _sum_hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP accepts only no or GradBucket annotations
    """DDP comm hook: sum (not average) each gradient bucket over the ranks; see the module doc."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _full(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective: every rank calls it); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class SingleProcess:
    """The trainer of one process: every operation is the identity (the Learner's default)."""

    rank, world_size = 0, 1
    mode: str = "single"

    def wrap(self, model: torch.nn.Module, *, trainable: bool = True) -> torch.nn.Module:
        return model

    def shard(self, lo: int, hi: int) -> tuple[int, int]:
        return lo, hi

    def shards(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Every rank's `shard(lo, hi)`, in rank order."""
        return [(lo, hi)]

    def all_gather_rows(self, rows: Tensor) -> Tensor:
        return rows

    def reduce_stats(self, stats: Any, only: tuple[str, ...] | None = None) -> None:
        return None

    def sync_gradients(self, model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def full_norm(self, norm: Tensor) -> Tensor:
        return norm

    def all_finite(self, model: torch.nn.Module) -> str | None:
        return next((n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, Tensor]:
        return _sync_dict(model, lambda t: t.detach())


class DataParallel(SingleProcess):
    """Rank `rank` of `world_size` trainer ranks in process group `group`, training in `mode` (module doc)."""

    def __init__(self, mode: Mode, group: Any, rank: int, world_size: int, device: torch.device) -> None:
        if mode not in ("ddp", "fsdp2"):
            raise ValueError(f"trainer.parallel must be 'ddp' or 'fsdp2', got {mode!r}")
        self.mode, self.group, self.rank, self.world_size = mode, group, rank, world_size
        self.device = torch.device(device)
        self._mesh: Any = None

    @classmethod
    def join(cls, mode: Mode, *, store: dist.Store, rank: int, world_size: int, timeout_s: float,
             device: str | torch.device = "cpu") -> DataParallel:
        """Form the trainer group (blocks until all `world_size` ranks joined; ask them together). `store`: a
        TCPStore every rank reaches (rank 0 may hold the master, transports.create_store)."""
        dev = torch.device(device)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, store=dist.PrefixStore("asyncrl/trainer", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        log.info("trainer rank %d/%d joined the %s group (%s)", rank, world_size, backend, mode)
        return cls(mode, dist.group.WORLD, rank, world_size, dev)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ models

    def wrap(self, model: torch.nn.Module, *, trainable: bool = True) -> torch.nn.Module:
        """-> the module to run training forwards through. DDP: a DistributedDataParallel around `model` (a
        frozen model stays a plain replica); FSDP2: `model` itself, sharded in place (build the optimizer
        after this: its parameters are new DTensor parameters)."""
        if self.mode == "ddp":
            if not trainable:
                return model
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            ddp = DistributedDataParallel(model, device_ids=ids, process_group=self.group)
            ddp.register_comm_hook(self.group, _sum_hook)
            return ddp
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        for mod in model.modules():
            if isinstance(mod, FSDPModule):
                mod.set_gradient_divide_factor(1.0)          # sum over ranks, as DDP's hook
                mod.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return model

    @property
    def mesh(self) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.group, self.device.type)
        return self._mesh

    # ------------------------------------------------------------------ the step

    def shard(self, lo: int, hi: int) -> tuple[int, int]:
        """This rank's contiguous equal share of samples [lo, hi)."""
        n = hi - lo
        if n % self.world_size:
            raise ValueError(f"{n} samples do not split evenly over trainer.num_ranks={self.world_size}: make "
                             "trainer.mini_batches × trainer.num_ranks divide prompts_per_step × group_size")
        return self.shards(lo, hi)[self.rank]

    def shards(self, lo: int, hi: int) -> list[tuple[int, int]]:
        per = (hi - lo) // self.world_size
        return [(lo + r * per, lo + (r + 1) * per) for r in range(self.world_size)]

    def all_gather_rows(self, rows: Tensor) -> Tensor:
        """[n/W, T] on each rank -> [n, T], rank order (the rows of `shard(0, n)` of every rank)."""
        local = rows.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts).to(rows.device)

    def reduce_stats(self, stats: Any, only: tuple[str, ...] | None = None) -> None:
        """Reduce a GradientStats / CriticStats dataclass in place over the ranks: sums, and max/min fields
        (`only`: just these fields; the others are equal on every rank already)."""
        names = [f.name for f in dataclasses.fields(stats) if only is None or f.name in only]
        sums = [n for n in names if n not in _MAX_FIELDS + _MIN_FIELDS]
        maxes = [n for n in names if n in _MAX_FIELDS]
        mins = [n for n in names if n in _MIN_FIELDS]
        for op, chosen in ((dist.ReduceOp.SUM, sums), (dist.ReduceOp.MAX, maxes), (dist.ReduceOp.MIN, mins)):
            if not chosen:
                continue
            t = torch.tensor([float(getattr(stats, n)) for n in chosen], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=op, group=self.group)
            for n, v in zip(chosen, t.tolist()):
                setattr(stats, n, type(getattr(stats, n))(v))

    @contextlib.contextmanager
    def sync_gradients(self, model: torch.nn.Module, sync: bool) -> Iterator[None]:
        """Backwards inside accumulate locally (`sync` False) or reduce over the ranks (`sync` True)."""
        if self.mode == "ddp":
            with (contextlib.nullcontext() if sync else model.no_sync()):
                yield
            return
        model.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def full_norm(self, norm: Tensor) -> Tensor:
        """A grad norm over sharded gradients (a DTensor) -> its full value on every rank."""
        return _full(norm)

    def all_finite(self, model: torch.nn.Module) -> str | None:
        """The name of the first parameter not finite on some rank, the same answer on every rank; else None."""
        names = [n for n, _ in model.named_parameters()]
        bad = torch.tensor([0.0 if bool(torch.isfinite(_local(p)).all()) else 1.0
                            for _, p in model.named_parameters()], device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return next((n for n, b in zip(names, bad.tolist()) if b), None)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, Tensor]:
        """The weights to broadcast, unsharded: every rank calls this (FSDP2 gathers each parameter, in the same
        order on every rank); only rank 0 uses the result."""
        return _sync_dict(model, lambda t: _full(t.detach()))


@torch.no_grad()
def copy_weights(model: torch.nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy full weights (a `full_state_dict`) into an unsharded `model` of the same architecture, in place:
    the evaluator's own copy of a sharded policy takes rank 0's gathered weights so."""
    for name, dst in _sync_dict(model, lambda t: t).items():
        dst.copy_(weights[name])


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sync_dict(model: torch.nn.Module, full: Any) -> dict[str, Tensor]:
    """Named parameters (tied ones once) + persistent buffers: what the weight broadcast sends."""
    out = {name: full(p) for name, p in model.named_parameters()}
    persistent = set(model.state_dict().keys())
    for name, buf in model.named_buffers():
        if name in persistent:
            out[name] = full(buf)
    return out


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one (HF causal LMs: `model.layers`); none found: root only."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []
