"""The collective weight-sync group: a bucketed, version-stamped broadcast from the Trainer (rank 0).

Place in the dataflow: Trainer --(`CollectiveSender.send`)--> Generators (`CollectiveReceiver.receive`).
A Ray deployment forms the group once, before training (`RayDeployment.setup_weight_sync` in
asyncrl/deploy/launch.py: the trainer's actor starts the store with `create_store`, then every member calls
`join_group` at once) and each actor hands its sender or receiver to its role. In-process runs use
`LocalWeightChannel` (local.py) instead.

Why a standalone group: vLLM/SGLang workers (and a multi-GPU trainer) already own the default
process group, so this group never calls `init_process_group` nor touches the default group. It is a
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) built directly over a `TCPStore` on 127.0.0.1
with an OS-chosen port, behind a `PrefixStore` so several groups (or a re-formed group) can share
one store.

Protocol of one broadcast (`WeightSyncGroup.broadcast_weights`), every member taking part:
    0. the source announces broadcast n (every member counts its broadcasts) by pushing n onto each
       receiver's queue in the store; a receiver pops its queue before it enters any collective, blocking
       in the store's server until the push arrives (no polling): up to the group's timeout, or, armed
       (`receive(armed=True)`, called while the trainer still trains), until the source starts or the
       group is closed (`close()` pushes CLOSED onto the member's own queue). So receivers need not be
       called at the moment of the send, and they join it without a round trip through the driver; the
       pop empties the queue, so the store (on the trainer) holds nothing per broadcast however long the run;
    1. rank 0 broadcasts an int64 header [version, n_buckets, total_bytes, meta_crc]; receivers
       learn the version and check that they hold the same `WeightsMeta` as the source;
    2. one broadcast per bucket: the source packs the bucket into one flat buffer (converting each tensor to
       the meta's dtype, the engines', as it copies it in: float32 master weights go out as bfloat16), receivers
       broadcast into a preallocated staging buffer and unpack it into staging tensors (views). The
       source calls `released()` once its last bucket is packed, so the trainer may change its
       weights while that bucket is still on the wire.
Buffers travel as their uint8 view, so any dtype (bfloat16, bool, ...) goes over any backend
bit-identically.

Joining (`join_group`) is a rendezvous: it blocks until every rank arrives, so every member must be asked
to join together. Every collective has an explicit timeout, so a member that never arrives turns into a
`TimeoutError` on the others, not a hang. After any collective error the group is marked broken: close
it and form a new one (with a fresh `group_name`). The Controller's supervision does that when a generator
dies (docs/checkpoints.md, Supervision): every member closes its old group and joins `weights-<n>`, whose
announcements live under its own prefix and whose broadcast count starts from 0.
"""

from __future__ import annotations

import logging
import mmap
import socket
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.messages import WeightsMeta
from transports.base import is_timeout, sync_stats
from transports.bucketing import (
    bucket_metas,
    check_matches,
    empty_bucket,
    meta_numel,
    pack_bucket,
    str_to_dtype,
    unpack_bucket,
)

if TYPE_CHECKING:  # the C++ base of ProcessGroupGloo/NCCL (not torch.distributed.Backend, a str enum)
    from torch._C._distributed_c10d import Backend as C10dBackend

logger = logging.getLogger(__name__)

SOURCE_RANK = 0  # the Trainer
# A receiver waits for an announcement with a blocking `queue_pop` on a clone of the store (a connection of its
# own, so the member's other store calls, and `close()`'s push of CLOSED, are not queued behind the wait). The
# pop returns the moment the source's push reaches the server, and costs nothing while it waits: the store-polling
# wait it replaces checked every 0.5-10 ms, about 2 ms of the generator's CPU a step on first_digit, on the core
# the per-version chain needs. An armed pop waits in rounds of ARMED_WAIT, long enough that libtorch's two
# "[c10d] waitForInput ... timed out" warnings per timeout never fill a console; a pop's timeout is a plain wait's
# error.
ARMED_WAIT = timedelta(days=1)
CLOSED = b"closed"  # what close() pushes onto the member's own announcement queue: an armed wait ends at once
# how often transports/ipc.py's waits check their store (its announcements are still polled)
ANNOUNCE_POLL_MIN_S = 0.0005
ANNOUNCE_POLL_MAX_S = 0.01
BACKENDS = ("auto", "gloo", "nccl", "ipc")


def resolve_backend(name: str) -> str:
    """"auto" -> "nccl" when CUDA is available, else "gloo"; "nccl" without CUDA is a ValueError; "ipc" (the
    shared-memory transport, transports/ipc.py, no collective group) stays "ipc"."""
    if name not in BACKENDS:
        raise ValueError(f"weight-sync backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight-sync backend 'nccl' needs CUDA, which is not available: use 'gloo' or 'auto'")
    return name


def create_store(world_size: int, timeout_s: float, host: str = "127.0.0.1") -> tuple[dist.TCPStore, int]:
    """Start the rendezvous store (master side) listening on `host` only, port chosen by the OS.

    torch's TCPStore master listens on every interface whatever host it is given, so the listening socket is
    made here, bound to `host` (loopback for a local run; the node's address when peers are on other
    nodes), and handed to the store. Returns (store, port). Keep the store object alive as long as the
    group lives: the store dies with it. `wait_for_workers=False` so creating the store never blocks.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
    )
    return store, port


def join_group(
    *,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    store: dist.Store | None = None,
    device: torch.device | str | None = None,
    group_name: str = "weights",
) -> WeightSyncGroup:
    """Join the weight-sync group as `rank` (0 = the Trainer, the broadcast source).

    Blocks until all `world_size` members have joined: every member must be asked to join together. Pass
    `store` where this process holds the master store (from `create_store`); otherwise a client store
    connects to host:port. `group_name` separates groups sharing a store.
    Raises TimeoutError if the others do not arrive within `timeout_s`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    backend = resolve_backend(backend)
    if backend == "ipc":
        raise ValueError("weight-sync backend 'ipc' forms no collective group: join with transports.ipc")
    timeout = timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"asyncrl/{group_name}", store)
        if backend == "nccl":
            dev = torch.device(device if device is not None else "cuda")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
            pg = _make_nccl(prefixed, rank, world_size, timeout)
        else:
            dev = torch.device("cpu")
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    except RuntimeError as exc:
        if is_timeout(exc):
            raise TimeoutError(
                f"weight-sync join (rank {rank} of {world_size}, store {host}:{port}): not all members "
                f"joined within {timeout_s}s; the controller must send the join to every member together"
            ) from exc
        raise
    group = WeightSyncGroup(pg, rank=rank, world_size=world_size, backend=backend,
                            timeout_s=timeout_s, device=dev, store=store, group_name=group_name)
    if backend == "nccl":
        group.barrier()  # NCCL communicators are lazy; connect now, while every member is joining
    return group


def _make_nccl(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> C10dBackend:
    if not dist.is_nccl_available():
        raise ValueError("weight-sync backend 'nccl': this torch build has no NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def meta_crc(meta: WeightsMeta) -> int:
    """A fingerprint of the meta, so a receiver holding a different plan fails loudly, not silently."""
    return zlib.crc32(msgspec.msgpack.encode(meta))


def close_process_group(pg: Any, what: str) -> None:
    """Tear a standalone process group down, best effort: abort(), else shutdown(); None is a no-op."""
    if pg is None:
        return
    for method in ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception:  # teardown is best effort; the group is unusable either way
            logger.debug("%s: %s() failed", what, method, exc_info=True)


def _queue(rank: int) -> str:
    """The store queue a receiver's announcements arrive on."""
    return f"to/{rank}"


CLOSED_POLL_S = 0.05  # a gloo broadcast in flight notices its group's close() this fast (WeightSyncGroup._finish)


class WeightSyncGroup:
    """One member's handle on the weight-sync group. Calls are serialised by a lock: collectives must
    be issued in the same order on every member."""

    def __init__(self, pg: C10dBackend, *, rank: int, world_size: int, backend: str, timeout_s: float,
                 device: torch.device, store: dist.Store | None = None, group_name: str = "weights") -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = device
        self._pg: C10dBackend | None = pg
        self._store = store  # keeps a master store (and the connection) alive with the group
        self._timeout = timedelta(seconds=timeout_s)
        self._lock = threading.Lock()
        self._broken: str | None = None
        # announcements of the weight broadcasts (see the module doc): their own prefix under the group's name, so
        # a re-formed group (a fresh name, its broadcast count from 0) never sees an older group's keys
        self._announce = dist.PrefixStore(f"asyncrl/{group_name}/announce", store) if store is not None else None
        # a receiver's blocking pops of its announcement queue run on a connection of their own (module doc)
        self._waiter = self._announce.clone() if self._announce is not None and rank != SOURCE_RANK else None
        self._broadcasts = 0  # broadcast_weights calls so far; every member counts the same
        # the source packs bucket i into one of these and bucket i+1 into the other while i is on the wire; kept
        # across syncs (2 x the largest bucket): a fresh large buffer per bucket is fresh pages to fault in each time
        self._pack_buffers: list[Tensor] = []
        # a receiver's CPU staging memory per bucket, reused by the next sync once nothing views the last one's
        # tensors (`_staging`): (the memory, a weak reference to the storage handed out over it)
        self._kept: dict[int, tuple[mmap.mmap, Any]] = {}
        self._in_flight: Any = None  # the last broadcast posted (`close` tears the group down after it ends)

    @property
    def is_source(self) -> bool:
        return self.rank == SOURCE_RANK

    def _broadcast(self, tensor: Tensor, what: str) -> None:
        """Broadcast `tensor` (uint8 view) from the source; any failure marks the group broken."""
        self._finish(self._start(tensor, what), what)

    def _start(self, tensor: Tensor, what: str) -> Any:
        """Post the broadcast of `tensor` (uint8 view) and return its work (None for no bytes); `_finish` waits.
        The transfer runs on the backend's own thread meanwhile, so the caller can prepare the next bucket."""
        if self._pg is None:
            raise RuntimeError("weight-sync group is closed")
        if self._broken is not None:
            raise RuntimeError(f"weight-sync group is broken ({self._broken}): close it and form a new one")
        if tensor.numel() == 0:
            return None
        try:
            self._in_flight = self._pg.broadcast(tensor.view(torch.uint8), SOURCE_RANK, self._timeout)
        except Exception as exc:
            raise self._failed(what, exc) from exc
        return self._in_flight

    def _finish(self, work: Any, what: str) -> None:
        """Wait for a posted broadcast. gloo: `close()` is noticed within CLOSED_POLL_S (a member died:
        supervision makes every member leave) ends the wait at once; a blocking wait on gloo cannot be
        interrupted and would hold this member, and every sync queued behind it, until the group's timeout.
        The abandoned op runs on in gloo's thread, which keeps its tensors alive until it ends."""
        if work is None:
            return
        if self.backend == "gloo":
            done = threading.Event()  # set by gloo's thread the moment the op ends: no polling delay
            work.get_future().add_done_callback(lambda _: done.set())
            deadline = time.monotonic() + self.timeout_s
            while not done.wait(CLOSED_POLL_S):
                if self._pg is None:
                    self._broken = f"{what} abandoned on rank {self.rank}"
                    raise RuntimeError("weight-sync group is closed")
                if time.monotonic() >= deadline:
                    raise self._failed(what, TimeoutError("timed out"))
        try:
            work.wait(self._timeout)  # gloo: completed, so this raises the op's own error if it failed
        except Exception as exc:
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: BaseException) -> Exception:
        self._broken = f"{what} failed on rank {self.rank}"
        if is_timeout(exc):
            return TimeoutError(f"weight sync: {what} not completed within {self.timeout_s}s on rank {self.rank}")
        return RuntimeError(f"weight sync: {what} failed on rank {self.rank}: {exc}")

    def barrier(self) -> None:
        """A 1-byte broadcast every member must join (used to connect lazy NCCL communicators)."""
        with self._lock:
            self._broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device), "barrier")

    def broadcast_weights(
        self, tensors: Mapping[str, Tensor] | None, meta: WeightsMeta, version: int | None, *, armed: bool = False,
        released: Callable[[], None] | None = None,
    ) -> tuple[dict[str, Tensor] | None, int, dict[str, float]]:
        """Broadcast one version of the weights from rank 0; every member calls it together.

        Source: `tensors` (matching `meta`) and `version` are required; returns (None, version, stats).
        Receivers: `tensors` is ignored; `version` is the expected version or None for any; returns
        (staging tensors on this member's device, the source's version, stats). A receiver waits up to the
        group's timeout for the source to start, or, `armed`, until it does (or the group is closed).
        Source: `released()` is called once the source no longer reads `tensors` (the last bucket is
        packed into its own buffer), before that bucket's broadcast: the caller may change them from then on.
        """
        with self._lock:
            if self.is_source:
                start = time.perf_counter()
                if tensors is None or version is None:
                    raise ValueError("the weight-sync source (rank 0) needs tensors and a version")
                check_matches(tensors, meta)
                n, self._broadcasts = self._broadcasts, self._broadcasts + 1
                self._announce_set(n)  # the last receiver to see it deletes it (`_announce_seen`)
                self._send(tensors, meta, version, released)
                return None, version, sync_stats(meta.total_bytes, time.perf_counter() - start, len(meta.buckets))
            if self._broken is not None:
                raise RuntimeError(f"weight-sync group is broken ({self._broken}): close it and form a new one")
            n, self._broadcasts = self._broadcasts, self._broadcasts + 1
            self._announce_wait(n, armed)
            start = time.perf_counter()  # the transfer, not the armed wait before it
            received_version, staged = self._receive(meta)
            stats = sync_stats(meta.total_bytes, time.perf_counter() - start, len(meta.buckets))
        if version is not None and received_version != version:
            raise ValueError(f"weight sync: expected version {version}, the source sent {received_version}")
        return staged, received_version, stats

    def _announce_set(self, n: int) -> None:
        """Push n onto every receiver's announcement queue."""
        if self._announce is None:
            return
        try:
            for rank in range(self.world_size):
                if rank != SOURCE_RANK:
                    self._announce.queue_push(_queue(rank), str(n))
        except Exception as exc:
            self._broken = f"announcing broadcast {n} failed on rank {self.rank}"
            raise RuntimeError(f"weight sync: announcing broadcast {n} failed: {exc}") from exc

    def _announce_wait(self, n: int, armed: bool) -> None:
        """Wait for the source to announce broadcast n: up to the group's timeout, or (`armed`) for as long
        as it takes, until the group is closed."""
        if self._announce is None:
            return
        while True:
            waiter = self._waiter  # a receiver's; None once the group is closed
            if self._pg is None or waiter is None:
                raise RuntimeError("weight-sync group is closed")
            waiter.set_timeout(ARMED_WAIT if armed else self._timeout)
            try:
                got = waiter.queue_pop(_queue(self.rank))
                break
            except Exception as exc:
                if self._pg is None:
                    raise RuntimeError("weight-sync group is closed") from exc
                if armed and is_timeout(exc):
                    continue  # another round: an armed wait has no deadline
                if is_timeout(exc):
                    self._broken = f"header failed on rank {self.rank}"  # it counted a broadcast that never came
                    raise TimeoutError(f"weight sync: header not completed within {self.timeout_s}s on rank "
                                       f"{self.rank} (the source never announced its broadcast)") from exc
                self._broken = f"waiting for broadcast {n} failed on rank {self.rank}"
                raise RuntimeError(f"weight sync: waiting for broadcast {n} failed: {exc}") from exc
        if got == CLOSED:
            raise RuntimeError("weight-sync group is closed")
        if got != str(n).encode():
            self._broken = f"announcement {got!r} out of order on rank {self.rank}"
            raise RuntimeError(f"weight sync: rank {self.rank} expected the announcement of broadcast {n}, "
                               f"the source announced {got.decode(errors='replace')}")

    def _header(self, version: int, meta: WeightsMeta) -> Tensor:
        values = [version, len(meta.buckets), meta.total_bytes, meta_crc(meta)]
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _send(self, tensors: Mapping[str, Tensor], meta: WeightsMeta, version: int,
              released: Callable[[], None] | None = None) -> None:
        def pack(index: int) -> Tensor:
            metas = bucket_metas(meta, index)
            parts = [tensors[m.name] for m in metas]
            # into the bucket's buffer in the meta's (the engines') dtype: the conversion happens in the copy
            out = self._pack_buffer(index % 2, sum(meta_numel(m) for m in metas), str_to_dtype(metas[0].dtype),
                                    parts[0].device)
            flat = pack_bucket(parts, out=out).to(self.device)
            if released is not None and index == len(meta.buckets) - 1:
                released()  # pack_bucket copies (on CUDA the copy is queued before any later kernel)
            return flat

        if released is not None and not meta.buckets:
            released()
        n = len(meta.buckets)
        flat = pack(0) if n else None  # before the header: one bucket is released at once
        self._broadcast(self._header(version, meta), "header")
        for index in range(n):
            what = f"bucket {index + 1}/{n}"
            work = self._start(flat, what)  # type: ignore[arg-type]
            try:  # the next bucket is packed while this one is on the wire
                following = pack(index + 1) if index + 1 < n else None
            finally:
                self._finish(work, what)
            flat = following

    def _pack_buffer(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D view of pack buffer `slot` of `numel` `dtype` elements on `device` (the source tensors'), the
        buffer growing to the largest bucket."""
        nbytes = numel * dtype.itemsize
        while len(self._pack_buffers) <= slot:
            self._pack_buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
        buf = self._pack_buffers[slot]
        if buf.numel() < nbytes or buf.device != device:
            buf = self._pack_buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype)

    def _receive(self, meta: WeightsMeta) -> tuple[int, dict[str, Tensor]]:
        header = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._broadcast(header, "header")
        version, n_buckets, total_bytes, crc = header.tolist()
        expected = [len(meta.buckets), meta.total_bytes, meta_crc(meta)]
        if [n_buckets, total_bytes, crc] != expected:
            # The source goes on sending buckets this member cannot size: the group is unusable.
            self._broken = "weights meta mismatch"
            raise RuntimeError(
                f"weight sync: the source's weights meta (buckets={n_buckets}, bytes={total_bytes}) differs "
                f"from this member's (buckets={expected[0]}, bytes={expected[1]}): hand every member the "
                "trainer's WeightsMeta"
            )
        staged: dict[str, Tensor] = {}
        flat = self._staging(meta, 0) if n_buckets else None
        for index in range(n_buckets):
            what = f"bucket {index + 1}/{n_buckets}"
            work = self._start(flat, what)  # type: ignore[arg-type]
            try:  # the next bucket's staging buffer is made while this one arrives
                following = self._staging(meta, index + 1) if index + 1 < n_buckets else None
            finally:
                self._finish(work, what)
            metas = bucket_metas(meta, index)
            staged.update(zip((m.name for m in metas), unpack_bucket(flat, metas)))  # type: ignore[arg-type]
            flat = following
        return version, staged

    def _staging(self, meta: WeightsMeta, index: int) -> Tensor:
        """A staging buffer for bucket `index`. On the CPU: the memory of the last sync's bucket once its caller
        let go of every tensor viewing it (their one storage is freed, so nobody can see it change), else new
        memory whose pages are touched here, not inside the broadcast that fills it (fresh pages cost a fault
        each: on 2 cores several times the broadcast of the same bytes). On CUDA the caching allocator hands
        freed blocks out again by itself."""
        if self.device.type != "cpu":
            return empty_bucket(meta, index, self.device)
        from torch.multiprocessing import reductions

        shape = empty_bucket(meta, index, "meta")  # dtype and size, no memory
        nbytes = shape.numel() * shape.element_size()
        kept = self._kept.get(index)
        fresh = kept is None or len(kept[0]) != nbytes or not kept[1].expired()
        memory = mmap.mmap(-1, max(nbytes, 1)) if fresh else kept[0]  # type: ignore[index]
        flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(shape.dtype)
        self._kept[index] = (memory, reductions.StorageWeakRef(flat.untyped_storage()))
        if fresh:
            flat.zero_()
        return flat

    def close(self) -> None:
        """Tear the group down (best effort, idempotent). Members blocked in a collective get an error: an armed
        receiver at once (CLOSED, pushed onto its own queue), a gloo broadcast in flight within CLOSED_POLL_S
        (`_finish`). Tearing the process group down blocks the whole interpreter until an op in flight ends (a
        peer that died: the group's timeout), so with one in flight the teardown waits for it on a thread of its
        own."""
        pg, self._pg = self._pg, None
        self._store = None
        if pg is None:
            return
        if self._waiter is not None and self._announce is not None:
            try:  # wakes this member's wait for an announcement, if one is under way
                self._announce.queue_push(_queue(self.rank), CLOSED)
            except Exception:  # the store is gone (the trainer died): a wait on it has failed already
                logger.debug("weight-sync group rank %d: waking its wait failed", self.rank, exc_info=True)
            self._waiter = None  # its connection closes once a wait under way has returned
        what, work = f"weight-sync group rank {self.rank}", self._in_flight
        if work is None or work.is_completed():
            close_process_group(pg, what)
            return

        def after_the_op() -> None:
            while not work.is_completed():
                time.sleep(0.05)
            close_process_group(pg, what)

        threading.Thread(target=after_the_op, name="weight-group-close", daemon=True).start()

    def __enter__(self) -> WeightSyncGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CollectiveSender:
    """`WeightSender` over a `WeightSyncGroup`, on rank 0 (the Trainer)."""

    def __init__(self, group: WeightSyncGroup, meta: WeightsMeta) -> None:
        if not group.is_source:
            raise ValueError(f"CollectiveSender must run on rank {SOURCE_RANK}, this member is rank {group.rank}")
        self.group = group
        self.meta = meta

    def send(self, tensors: Mapping[str, Tensor], version: int, *,
             released: Callable[[], None] | None = None) -> dict[str, float]:
        """`released()` once the last bucket is packed into its own buffer, before its broadcast: the
        broadcast of the packed copy goes on while the trainer updates its weights."""
        _, _, stats = self.group.broadcast_weights(tensors, self.meta, version, released=released)
        return stats

    def close(self) -> None:
        """End the group (a member died: it is re-formed under a fresh name); a send in flight raises."""
        self.group.close()


class CollectiveReceiver:
    """`WeightReceiver` over a `WeightSyncGroup`, on ranks >= 1 (the generators). `receive()` blocks
    until the source sends; armed, it waits for the source's announcement of the broadcast without a
    timeout (until the group is closed), then joins it."""

    arms_early = True

    def __init__(self, group: WeightSyncGroup, meta: WeightsMeta) -> None:
        if group.is_source:
            raise ValueError(f"CollectiveReceiver cannot run on rank {SOURCE_RANK}, the broadcast source")
        self.group = group
        self.meta = meta
        self.last_version: int | None = None

    def receive(self, *, armed: bool = False) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        """The next broadcast. `armed`: called ahead of the send, so wait for it without the group's timeout."""
        staged, version, stats = self.group.broadcast_weights(None, self.meta, None, armed=armed)
        assert staged is not None  # receivers always get tensors
        if self.last_version is not None and version < self.last_version:
            logger.warning("weight sync: version went back from %d to %d", self.last_version, version)
        self.last_version = version
        return staged, version, stats

    def close(self) -> None:
        """End the group (a member died: it is re-formed under a fresh name); an armed receive raises."""
        self.group.close()


def join_sender(*, store: dist.Store, host: str, port: int, world_size: int, backend: str, timeout_s: float,
                meta: WeightsMeta, group_name: str = "weights") -> CollectiveSender:
    """The "bucketed" transport's sender: join the group as rank 0 over the store this process holds."""
    group = join_group(host=host, port=port, rank=0, world_size=world_size, backend=backend,
                       timeout_s=timeout_s, store=store, group_name=group_name)
    return CollectiveSender(group, meta)
