"""The SGLang weight transport: the Trainer (rank 0) joins SGLang's own weight-update group and broadcasts one
typed tensor per entry of `WeightsMeta.tensors`; the engine reads each update's header (`read_header`).

Place in the dataflow: Trainer --(this module)--> SGLang scheduler processes. It is the transport
"per_tensor" of `transports.base.SENDERS`, chosen for engines whose receiving side speaks SGLang's
protocol (`engines.sglang_engine.SGLangEngine.weight_transport`). The receiving half runs in the engine
(`SGLangEngine.receive_weights`): it reads the header the sender wrote (`read_header`: the version, the meta
checked), then asks SGLang's schedulers to take the broadcast. Engines import this module's receiving names
(`GROUP_NAME`, `read_header`), never the collective group's internals.

Wire protocol of one update (SGLang's, not `transports.collective`'s header + buckets):
    group     SGLang ranks join with `init_weights_update_group(master_address, master_port, rank_offset,
              world_size, group_name, backend)` on the trainer's TCPStore; `join_sglang_sender` builds the
              same keys (PrefixStore(group_name) / "<group_name>/" / "<device>/") without touching torch's
              global group registry.
    header    before each update the sender sets the store key `asyncrl-sglang/<group_name>/<n>` to
              msgpack [version, meta_crc], so the engine learns the version and refuses a different meta.
    tensors   one broadcast from rank 0 per tensor, in `WeightsMeta.tensors` order, in the meta's dtype/shape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.messages import WeightsMeta
from transports.base import is_timeout, sync_stats
from transports.bucketing import check_matches, str_to_dtype
from transports.collective import close_process_group, meta_crc, resolve_backend

GROUP_NAME = "asyncrl_weights"


def header_key(group_name: str, index: int) -> str:
    """Store key of the header of the `index`-th update (0-based) of `group_name`."""
    return f"asyncrl-sglang/{group_name}/{index}"


def read_header(store: dist.Store, group_name: str, index: int, meta: WeightsMeta) -> int:
    """The receiving side: wait (the store's timeout) for the header of the `index`-th update of `group_name` and
    return its version; TimeoutError when the trainer wrote none in time, RuntimeError when its meta differs
    from `meta` (the group is then unusable). Blocking: call it off the event loop."""
    key = header_key(group_name, index)
    try:
        raw = store.get(key)
    except Exception as exc:
        if is_timeout(exc):
            raise TimeoutError(f"SGLang weight update: no header {key!r} from the trainer in time") from exc
        raise
    version, crc = msgspec.msgpack.decode(raw)
    if crc != meta_crc(meta):
        raise RuntimeError("SGLang weight update: the trainer's WeightsMeta differs from this engine's; hand "
                           "every member the trainer's meta (the group is unusable: form a new one)")
    return int(version)



class SGLangSenderGroup:
    """Rank 0's handle on an SGLang weight-update group: typed broadcasts, one per tensor."""

    def __init__(self, pg: Any, *, store: dist.Store, world_size: int, backend: str, timeout_s: float,
                 device: torch.device, group_name: str) -> None:
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = device
        self.group_name = group_name
        self.store = store
        self._pg = pg
        self._timeout = timedelta(seconds=timeout_s)
        self._lock = threading.Lock()
        self._broken: str | None = None

    def broadcast(self, tensors: list[Tensor]) -> None:
        """Broadcast each tensor from rank 0 (all issued, then all awaited, like SGLang's receiver)."""
        with self._lock:
            if self._pg is None:
                raise RuntimeError("SGLang weight-update group is closed")
            if self._broken is not None:
                raise RuntimeError(f"SGLang weight-update group is broken ({self._broken}): form a new one")
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self._timeout
            try:
                works = [self._pg.broadcast([t], opts) for t in tensors]
                for work in works:
                    work.wait(self._timeout)
            except Exception as exc:
                self._broken = "broadcast failed"
                if is_timeout(exc):
                    raise TimeoutError(f"SGLang weight update: broadcast not completed within {self.timeout_s}s "
                                       "(did every SGLang engine call update_weights_from_distributed?)") from exc
                raise RuntimeError(f"SGLang weight update: broadcast failed: {exc}") from exc

    def close(self) -> None:
        pg, self._pg = self._pg, None
        close_process_group(pg, "SGLang sender group")


def join_sglang_sender(*, store: dist.Store, world_size: int, backend: str, timeout_s: float,
                       group_name: str = GROUP_NAME, device: torch.device | str | None = None) -> SGLangSenderGroup:
    """Join SGLang's weight-update group as rank 0 over `store` (the TCPStore master at the host:port
    handed to the engines). Blocks (gloo) until every SGLang rank has called init_weights_update_group.

    The keys are those of SGLang's `init_custom_process_group` + torch's `_new_process_group_helper`:
    PrefixStore(group_name) / "<group_name>/" / "<device>/"; built here without registering the group
    in torch's global registry (the trainer may own a default group; a name can then be reused).
    """
    backend = resolve_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    base = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    try:
        if backend == "nccl":
            dev = torch.device(device if device is not None else "cuda")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", base), 0, world_size, options)
        else:
            dev = torch.device("cpu")
            pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", base), 0, world_size, timeout)
        pg._set_sequence_number_for_group()  # gloo: rank 0 publishes it, the other ranks wait for it
    except RuntimeError as exc:
        if is_timeout(exc):
            raise TimeoutError(f"SGLang weight-update group {group_name!r}: not all {world_size - 1} SGLang "
                               f"ranks joined within {timeout_s}s") from exc
        raise
    return SGLangSenderGroup(pg, store=store, world_size=world_size, backend=backend, timeout_s=timeout_s,
                             device=dev, group_name=group_name)


def broadcast_per_tensor(group: SGLangSenderGroup, tensors: Mapping[str, Tensor], meta: WeightsMeta) -> int:
    """Send `tensors` the way SGLang's update_weights_from_distributed receives them: one broadcast per
    entry of `meta.tensors`, in order, each in the meta's dtype (the engine's: a float32 master weight is
    converted on its way to the device) and shape. Returns the bytes sent."""
    check_matches(tensors, meta)
    ordered = [tensors[m.name].detach().to(group.device, str_to_dtype(m.dtype)).contiguous() for m in meta.tensors]
    group.broadcast(ordered)
    return sum(t.numel() * t.element_size() for t in ordered)


class PerTensorSender:
    """`WeightSender` (transports.base) for SGLang engines, on the Trainer (rank 0). It reads the
    trainer's tensors until its last broadcast is done, so it calls `released` only then."""

    def __init__(self, group: SGLangSenderGroup, meta: WeightsMeta) -> None:
        self.group = group
        self.meta = meta
        self._crc = meta_crc(meta)
        self._sent = 0

    def send(self, tensors: Mapping[str, Tensor], version: int, *,
             released: Callable[[], None] | None = None) -> dict[str, float]:
        start = time.perf_counter()
        check_matches(tensors, self.meta)
        header = msgspec.msgpack.encode([int(version), self._crc])
        self.group.store.set(header_key(self.group.group_name, self._sent), header)
        self._sent += 1
        nbytes = broadcast_per_tensor(self.group, tensors, self.meta)
        if released is not None:
            released()
        return sync_stats(nbytes, time.perf_counter() - start, len(self.meta.tensors))


def join_sender(*, store: dist.Store, host: str, port: int, world_size: int, backend: str, timeout_s: float,
                meta: WeightsMeta, group_name: str = "weights") -> PerTensorSender:
    """The "per_tensor" transport's sender (host and port are the engines' to use: rank 0 holds the store)."""
    if group_name != "weights":
        raise ValueError("the per_tensor transport (SGLang) cannot re-form its group: generators are not restarted")
    group = join_sglang_sender(store=store, world_size=world_size, backend=backend, timeout_s=timeout_s)
    return PerTensorSender(group, meta)
