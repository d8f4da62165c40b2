"""The IPC weight transport: the Trainer's weights reach generators on its own host (its own device) through memory
every member maps, with no broadcast.

Place in the dataflow: Trainer --(`IpcSender.send`)--> Generators (`IpcReceiver.receive`): the edge of
`collective.py`, with its interface and semantics (versions, `sync_stats`, armed receives, `close()`, groups
re-formed under a fresh name), chosen by `weight_sync.backend = "ipc"`. A Ray deployment forms the group like
the collective one (`RayDeployment.setup_weight_sync` in asyncrl/deploy/launch.py; each member in
`RoleActor.join_weight_group`, asyncrl/deploy/actors.py) on the trainer's rendezvous store (`collective.create_store`).
Only generators whose own process loads the weights (the torch engine) can take part: vLLM and SGLang workers
receive through their own groups, which the config check says (asyncrl/deploy/placement.py `check_backend`).

The shared buffer (the *arena*). The sender owns one flat uint8 buffer laid out by the broadcast's bucket plan
(`plan_buckets` -> `WeightsMeta`, `arena_layout`): a header, then each bucket at an aligned offset, so a bucket
is one dtype and its tensors are views. It lives on the trainer's device:
- CUDA: device memory, opened by each receiver through its CUDA IPC handle;
- CPU: a shared-memory file, mapped by each receiver by its name.
Both are torch.multiprocessing's own reductions (`reduce_tensor`, `rebuild_cuda_tensor`,
`rebuild_storage_filename`). CPU storages always go by file name (torch's "file_system" strategy), whatever the
process's sharing strategy: the default one hands a file descriptor over a socket that only the sender's child
processes can connect to, and Ray actors are not its children. The handles go once per group, pickled into the
trainer's store under `asyncrl/<group_name>/ipc/` (the trainer's own TCPStore on loopback, which every member
already trusts with the group), never per sync.

Joining (every member at once; blocks until all have, like `collective.join_group`):
    sender    allocates the arena; sets `handle/<r>` = (its meta's fingerprint, the arena pickled for receiver r:
              each pickle holds one reference, which receiver r takes over); waits for every `joined/<r>`, then
              deletes both keys. A receiver that reports another fingerprint fails the join
    receiver  waits for `handle/<r>`, maps the arena, checks the fingerprint and the arena's size against its own
              WeightsMeta, sets `joined/<r>` to its fingerprint (or to the reason it failed, then raises)

One sync n (every member counts its syncs from 0 in a group):
    sender    head := WRITING; copies each tensor into its view of the arena; `released()` (the trainer may change
              its weights from here on); head := n; waits for the device; sets `sync/<n>` = version; waits until
              `ack/<n>` counts every receiver (up to `timeout_s`); deletes both keys. Returns: every receiver
              holds its own copy, as a broadcast has returned once every member holds the data
    receiver  waits for `sync/<n>` (up to `timeout_s`; armed, until the transport is closed); copies the whole
              arena into a buffer of its own (on the CPU the last receive's once its caller let go of it:
              `_staging`), checks the head (below), adds 1 to `ack/<n>`, and returns views of its copy: the
              caller owns them (the engine may load them a decode step later)

Invariant: a receiver never returns a torn version (bytes of two versions). The sender starts sync n + 1 only
after every receiver acknowledged sync n (`send` returns then, and sends are serialised), and a sender whose ack
wait failed is broken: it never writes the arena again (a late receiver may still be copying). Acks rather than
double buffering: a second arena would cost another copy of the model on a device that colocated roles share, and
overlap nothing, since the step pipeline waits for every receive anyway. The head word re-checks the invariant at
run time, as a seqlock: the receiver's copy must start with head = n and the arena's head must still be n after
the copy has finished, else it raises instead of returning a mix.

Errors: every wait has `timeout_s` (weight_sync.timeout_s) and a timeout raises one line naming the wait; the
side that timed out is broken (close it, form a new group under a fresh `group_name`, as supervision does when a
generator dies). `close()` on either side makes a pending send or receive raise within ANNOUNCE_POLL_MAX_S.
"""

from __future__ import annotations

import copyreg
import io
import logging
import mmap
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.multiprocessing import reductions

from asyncrl.messages import WeightsMeta
from transports.base import sync_stats
from transports.bucketing import bucket_metas, bucket_nbytes, check_matches, str_to_dtype, unpack_bucket
from transports.collective import ANNOUNCE_POLL_MAX_S, ANNOUNCE_POLL_MIN_S, meta_crc

logger = logging.getLogger(__name__)

HEADER_BYTES = 256  # the head word (int64) and padding, so the first bucket starts aligned
ALIGN = 256  # bucket offsets: any dtype's view is aligned, and CUDA copies start on a 256-byte boundary
WRITING = -1  # the head while the sender writes a version


def arena_layout(meta: WeightsMeta) -> tuple[list[int], int]:
    """(byte offset of each bucket in the arena, the arena's size): the same on every member for the same meta."""
    offsets, end = [], HEADER_BYTES
    for index in range(len(meta.buckets)):
        offsets.append(end)
        end += -(-bucket_nbytes(meta, index) // ALIGN) * ALIGN
    return offsets, end


class Arena:
    """A flat uint8 buffer laid out by `arena_layout`: its head word and, per tensor of the meta, a view."""

    def __init__(self, flat: Tensor, meta: WeightsMeta) -> None:
        offsets, size = arena_layout(meta)
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != size:
            raise ValueError(f"the shared buffer holds {flat.numel()} bytes, this member's weights meta lays out "
                             f"{size}: hand every member the trainer's WeightsMeta")
        self.flat = flat
        self.head = flat[:8].view(torch.int64)
        self.views: dict[str, Tensor] = {}
        for index, offset in enumerate(offsets):
            metas = bucket_metas(meta, index)
            bucket = flat[offset: offset + bucket_nbytes(meta, index)].view(str_to_dtype(metas[0].dtype))
            self.views.update(zip((m.name for m in metas), unpack_bucket(bucket, metas)))


# -- handles: torch.multiprocessing's reductions, CPU storages always by file name (see the module doc) ---------
def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple:
    """torch's "file_system" branch of `reductions.reduce_storage`: move the storage into a named shared-memory
    file (once) and take one reference for the receiver, which `rebuild_storage_filename` hands over to it."""
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    return reductions.rebuild_storage_filename, (type(storage), *metadata)


class _HandlePickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Tensor] = reductions.reduce_tensor
    dispatch_table[torch.TypedStorage] = reductions.reduce_typed_storage
    dispatch_table[torch.UntypedStorage] = _reduce_storage_by_name


def share(obj: Any) -> bytes:
    """`obj` pickled with its tensors as handles to their memory (CUDA IPC, or a shared-memory file on the CPU)."""
    out = io.BytesIO()
    _HandlePickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def open_shared(data: bytes) -> Any:
    """The object `share` pickled, its tensors mapping the sharer's memory (in another process)."""
    return pickle.loads(data)  # noqa: S301 - our own sender's bytes, from the trainer's store on loopback


def _default_device(device: torch.device | str | None) -> torch.device:
    """Where the arena goes: `device`, else the current CUDA device where this process sees one (Ray gives a GPU
    only to roles placed on it), else the CPU."""
    if device is not None:
        dev = torch.device(device)
        return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _poll(ready: Callable[[], bool], *, deadline: float | None, closed: Callable[[], bool],
          on_timeout: Callable[[], Exception], what: str) -> None:
    """Wait until `ready()`: sleeping ANNOUNCE_POLL_MIN_S, doubling up to ANNOUNCE_POLL_MAX_S, between checks (the
    collective's announcement wait, for the same reasons); raise `on_timeout()` past `deadline` (None: no
    deadline), RuntimeError once `closed()` or when the store fails (the trainer is gone)."""
    sleep_s = ANNOUNCE_POLL_MIN_S
    while True:
        if closed():
            raise RuntimeError("weight-sync group is closed")
        try:
            if ready():
                return
        except Exception as exc:
            raise RuntimeError(f"weight sync (ipc): {what} failed: the store is unreachable ({exc})") from exc
        if deadline is not None and time.monotonic() >= deadline:
            raise on_timeout()
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, ANNOUNCE_POLL_MAX_S)


def _group_store(store: dist.Store, group_name: str) -> dist.PrefixStore:
    return dist.PrefixStore(f"asyncrl/{group_name}/ipc", store)


class _Member:
    """What both sides share: the store, the arena, the sync count, the lock, closed / broken."""

    def __init__(self, arena: Arena, meta: WeightsMeta, *, store: dist.PrefixStore, keep: dist.Store,
                 rank: int, world_size: int, timeout_s: float, group_name: str) -> None:
        self.meta = meta
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.group_name = group_name
        self.device = arena.flat.device
        self._arena: Arena | None = arena
        self._store = store
        self._keep: dist.Store | None = keep  # the TCPStore itself (a master store dies with its object)
        self._syncs = 0  # syncs so far in this group; every member counts the same
        self._lock = threading.Lock()
        self._broken: str | None = None

    @property
    def closed(self) -> bool:
        return self._arena is None

    def _usable(self) -> Arena:
        arena = self._arena
        if arena is None:
            raise RuntimeError("weight-sync group is closed")
        if self._broken is not None:
            raise RuntimeError(f"weight-sync group is broken ({self._broken}): close it and form a new one")
        return arena

    def close(self) -> None:
        """Leave the group (best effort, idempotent): a pending send or receive raises; the memory is unmapped
        once a copy in progress has let go of it."""
        self._arena, self._keep = None, None


class IpcSender(_Member):
    """`WeightSender` over the arena, on rank 0 (the Trainer); `join_sender` builds it."""

    def send(self, tensors: Mapping[str, Tensor], version: int, *,
             released: Callable[[], None] | None = None) -> dict[str, float]:
        """Write `tensors` into the arena as `version`, announce it, and return once every receiver acknowledged
        its copy. `released()` once they are copied into the arena, before the receivers copy it."""
        with self._lock:
            arena = self._usable()
            check_matches(tensors, self.meta)
            start = time.perf_counter()
            n = self._syncs
            with torch.no_grad():
                arena.head.fill_(WRITING)
                for name, view in arena.views.items():
                    view.copy_(tensors[name])
                if released is not None:
                    released()  # the arena holds the copy (on CUDA queued before any later kernel of the trainer)
                arena.head.fill_(n)
            _synchronize(self.device)  # receivers read the arena from other processes: the copies must be done
            self._syncs += 1
            try:
                self._store.set(f"sync/{n}", str(version).encode())
            except Exception as exc:
                self._broken = f"announcing sync {n} failed"
                raise RuntimeError(f"weight sync (ipc): announcing version {version} failed: {exc}") from exc
            self._wait_acks(n, version)
            return sync_stats(self.meta.total_bytes, time.perf_counter() - start, len(self.meta.buckets))

    def _wait_acks(self, n: int, version: int) -> None:
        receivers = self.world_size - 1
        acked = 0

        def ready() -> bool:
            nonlocal acked
            acked = self._store.add(f"ack/{n}", 0)
            return acked >= receivers

        def timed_out() -> Exception:
            return TimeoutError(f"weight sync (ipc): {acked} of {receivers} receivers copied version {version} within "
                                f"{self.timeout_s}s; the sender is broken (a late receiver may still read the shared "
                                f"buffer): form a new group")

        try:
            _poll(ready, deadline=time.monotonic() + self.timeout_s, closed=lambda: self.closed, on_timeout=timed_out,
                  what=f"waiting for the copies of version {version}")
        except BaseException:
            self._broken = f"version {version} was not acknowledged"
            raise
        self._store.delete_key(f"sync/{n}")  # every receiver read it: the store holds no key per sync
        self._store.delete_key(f"ack/{n}")


class IpcReceiver(_Member):
    """`WeightReceiver` over the arena, on ranks >= 1 (the generators); `join_receiver` builds it. `receive()`
    waits for the sender's announcement (armed: without a timeout, until closed) and copies the arena."""

    arms_early = True  # a receive waits for the announcement in the store, so it may be asked before the send
    last_version: int | None = None  # the version of the last receive (a warning if one goes back)
    _memory: mmap.mmap | None = None  # CPU staging memory kept for reuse (`_staging`)
    _handed_out: reductions.StorageWeakRef | None = None  # the storage over it that the last receive returned

    def receive(self, *, armed: bool = False) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        """The next version: (tensors of this receiver's own copy, version, stats timing the copy, not the wait)."""
        with self._lock:
            self._usable()
            n = self._syncs
            self._syncs += 1
            try:
                version = self._wait_announced(n, armed)
                start = time.perf_counter()
                staged = self._copy(n)
                self._store.add(f"ack/{n}", 1)
            except BaseException as exc:
                if not self.closed:
                    self._broken = f"sync {n} failed: {type(exc).__name__}"
                raise
            stats = sync_stats(self.meta.total_bytes, time.perf_counter() - start, len(self.meta.buckets))
        if self.last_version is not None and version < self.last_version:
            logger.warning("weight sync: version went back from %d to %d", self.last_version, version)
        self.last_version = version
        return staged, version, stats

    def _wait_announced(self, n: int, armed: bool) -> int:
        def timed_out() -> Exception:
            return TimeoutError(f"weight sync (ipc): no version announced within {self.timeout_s}s on rank "
                                f"{self.rank} (the trainer never sent)")

        deadline = None if armed else time.monotonic() + self.timeout_s
        _poll(lambda: self._store.check([f"sync/{n}"]), deadline=deadline, closed=lambda: self.closed,
              on_timeout=timed_out, what="waiting for the next version")
        return int(self._store.get(f"sync/{n}"))

    def _copy(self, n: int) -> dict[str, Tensor]:
        arena = self._arena
        if arena is None:
            raise RuntimeError("weight-sync group is closed")
        own = self._staging(arena.flat)
        own.copy_(arena.flat)
        _synchronize(self.device)
        started, ended = int(own[:8].view(torch.int64)[0]), int(arena.head[0])
        if started != n or ended != n:  # the seqlock of the module doc: never hand out a mix of two versions
            raise RuntimeError(f"weight sync (ipc): the shared buffer changed during the copy of sync {n} (head "
                               f"{started} before, {ended} after) on rank {self.rank}: a sender overwrote it early")
        return dict(Arena(own, self.meta).views)

    def _staging(self, flat: Tensor) -> Tensor:
        """A buffer of this receiver's own to copy `flat` into. On the CPU: the memory of the last receive once its
        caller let go of every tensor viewing it (their one storage is freed, so nobody can see it change), else
        new memory: fresh pages cost a fault each, which on 2 cores is several times the copy itself. On CUDA the
        caching allocator hands freed blocks out again by itself."""
        if flat.device.type != "cpu":
            return torch.empty_like(flat)
        if self._memory is None or not self._handed_out.expired():
            self._memory = mmap.mmap(-1, flat.numel())  # anonymous, page-aligned; faulted in by the first copy
        own = torch.frombuffer(self._memory, dtype=torch.uint8)  # a storage of its own, holding the mapping
        self._handed_out = reductions.StorageWeakRef(own.untyped_storage())
        return own


# -- joining -----------------------------------------------------------------------------------------------------
def _client_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.Store:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def _join_timeout(rank: int, world_size: int, host: str, port: int, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"weight-sync join (ipc, rank {rank} of {world_size}, store {host}:{port}): not all members "
                        f"joined within {timeout_s}s; the controller must send the join to every member together")


def join_sender(*, store: dist.Store | None, host: str, port: int, world_size: int, backend: str = "ipc",
                timeout_s: float, meta: WeightsMeta, group_name: str = "weights",
                device: torch.device | str | None = None) -> IpcSender:
    """The "ipc" transport's sender (`transports.base.SENDERS`): allocate the arena on `device` (default: see
    `_default_device`), hand every receiver its handle and return once all have mapped it. `store`: the master
    store this process holds (`create_store`), or None to connect to host:port."""
    if backend != "ipc":
        raise ValueError(f"the ipc transport's sender was asked for backend {backend!r}: it takes 'ipc' only")
    dev = _default_device(device)
    keep = store if store is not None else _client_store(host, port, world_size, timeout_s)
    kv = _group_store(keep, group_name)
    _, size = arena_layout(meta)
    flat = torch.zeros(size, dtype=torch.uint8, device=dev)
    flat[:8].view(torch.int64).fill_(WRITING)  # no version yet
    crc = meta_crc(meta)
    for rank in range(1, world_size):  # one pickle per receiver: each takes over the reference its pickle holds
        kv.set(f"handle/{rank}", share((crc, flat)))
    arena = Arena(flat, meta)  # after sharing: on the CPU the first pickle moved the storage into a shared file
    replies: dict[int, bytes] = {}

    def ready() -> bool:
        for rank in range(1, world_size):
            if rank not in replies and kv.check([f"joined/{rank}"]):
                replies[rank] = kv.get(f"joined/{rank}")
        return len(replies) == world_size - 1

    _poll(ready, deadline=time.monotonic() + timeout_s, closed=lambda: False, what="joining",
          on_timeout=lambda: _join_timeout(0, world_size, host, port, timeout_s))
    for rank in range(1, world_size):
        kv.delete_key(f"handle/{rank}")
        kv.delete_key(f"joined/{rank}")
    wrong = {rank: reply.decode() for rank, reply in replies.items() if reply != str(crc).encode()}
    if wrong:
        rank, reply = min(wrong.items())
        raise RuntimeError(f"weight sync (ipc): rank {rank} did not join: {reply}")
    return IpcSender(arena, meta, store=kv, keep=keep, rank=0, world_size=world_size, timeout_s=timeout_s,
                     group_name=group_name)


def join_receiver(*, host: str, port: int, rank: int, world_size: int, timeout_s: float, meta: WeightsMeta,
                  store: dist.Store | None = None, group_name: str = "weights") -> IpcReceiver:
    """Join as receiver `rank` (>= 1): map the sender's arena; blocks until the sender has shared it."""
    if not 1 <= rank < world_size:
        raise ValueError(f"an ipc receiver's rank must be in [1, {world_size}), got {rank}")
    keep = store if store is not None else _client_store(host, port, world_size, timeout_s)
    kv = _group_store(keep, group_name)
    _poll(lambda: kv.check([f"handle/{rank}"]), deadline=time.monotonic() + timeout_s, closed=lambda: False,
          what="joining", on_timeout=lambda: _join_timeout(rank, world_size, host, port, timeout_s))
    try:
        crc, flat = open_shared(kv.get(f"handle/{rank}"))
        if crc != meta_crc(meta):
            raise ValueError("the trainer's weights meta differs from this member's: hand every member the "
                             "trainer's WeightsMeta")
        arena = Arena(flat, meta)
    except Exception as exc:
        reason = str(exc) if isinstance(exc, ValueError) else (
            f"cannot open the trainer's shared buffer ({type(exc).__name__}: {exc}); ipc needs every member on the "
            "trainer's host and, on CUDA, its GPU")
        kv.set(f"joined/{rank}", reason.encode())
        raise RuntimeError(f"weight sync (ipc), rank {rank}: {reason}") from exc
    kv.set(f"joined/{rank}", str(crc).encode())
    return IpcReceiver(arena, meta, store=kv, keep=keep, rank=rank, world_size=world_size, timeout_s=timeout_s,
                       group_name=group_name)
