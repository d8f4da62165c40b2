"""An in-process weight channel: Trainer and Generators in one process (no Ray, no collective group).

Place in the dataflow: the same Trainer -> Generators edge as `collective.py`, for running the
runtime in one process and for tests. Unlike the collective broadcast, sender and receivers need
not meet: the sender publishes the latest version, and any number of receivers take a copy of
whatever is latest when they ask.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from transports.base import sync_stats
from transports.bucketing import wire_dtype


class LocalWeightChannel:
    """A `WeightSender`; `receiver()` gives each generator its `WeightReceiver`. Thread-safe.

    `send` stores detached copies (the trainer may keep updating its parameters in place), its floating-point
    tensors converted to `dtype` (the engines' dtype, rollout.dtype; None: as sent) in that same copy, like the
    collective sender's packing (transports/bucketing.py `wire_dtype`); `receive` returns fresh clones (the
    caller may hand them to an engine that keeps them). `receive` waits up to `timeout_s` (armed: until
    `close()`) for a version newer than the caller's.
    `shared`: the receivers' engines wrap the sender's own module (colocated in one process), so a send
    copies nothing and a receive returns no tensors, only the version (the engine re-reads its module).
    """

    def __init__(self, timeout_s: float = 60.0, dtype: torch.dtype | None = None, *, shared: bool = False) -> None:
        self.timeout_s = timeout_s
        self.dtype = dtype
        self.shared = shared  # the receivers' engines wrap the sender's module: a send names the version only
        self._cond = threading.Condition()
        self._tensors: dict[str, Tensor] | None = None
        self._version = -1
        self._sends = 0  # sends so far: a receiver takes one per send, as a collective member takes each broadcast
        self._closed = False

    @property
    def version(self) -> int:
        """The latest published version; -1 before the first send."""
        with self._cond:
            return self._version

    def send(self, tensors: Mapping[str, Tensor], version: int, *,
             released: Callable[[], None] | None = None) -> dict[str, float]:
        start = time.perf_counter()
        copies = {} if self.shared else {name: t.detach().to(wire_dtype(t.dtype, self.dtype), copy=True)
                                         for name, t in tensors.items()}
        if released is not None:
            released()  # the copies are the channel's own
        nbytes = sum(t.numel() * t.element_size() for t in copies.values())
        with self._cond:
            self._tensors = copies
            self._version = version
            self._sends += 1
            self._cond.notify_all()
        return sync_stats(nbytes, time.perf_counter() - start, 1)

    def close(self) -> None:
        """Wake every waiting receiver with an error (the run is over)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def receive(self, after_version: int = -1, *, armed: bool = False,
                after_sends: int | None = None) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        """The latest weights, waiting until their version is > `after_version` (or, given `after_sends`, until
        more than that many sends were made): up to `timeout_s`, or, `armed`, until `close()`. Stats time the
        copy, not the wait."""
        def ready() -> bool:
            newer = self._version > after_version or (after_sends is not None and self._sends > after_sends)
            return self._closed or (self._tensors is not None and newer)

        with self._cond:
            if not self._cond.wait_for(ready, timeout=None if armed else self.timeout_s):
                raise TimeoutError(f"local weight channel: no version > {after_version} was sent "
                                   f"within {self.timeout_s}s")
            if self._closed:
                raise RuntimeError("local weight channel is closed")
            latest, version = self._tensors, self._version
        start = time.perf_counter()
        assert latest is not None
        # Clone outside the lock: `send` swaps in a new dict, it never mutates `latest`.
        copies = {name: t.clone() for name, t in latest.items()}
        nbytes = sum(t.numel() * t.element_size() for t in copies.values())
        return copies, version, sync_stats(nbytes, time.perf_counter() - start, 1)

    def receiver(self) -> "LocalReceiver":
        """A receiver that, like a collective member, waits for the broadcast after the one it had."""
        return LocalReceiver(self)


class LocalReceiver:
    """A `WeightReceiver` view of a LocalWeightChannel that remembers the last version it took and counts the sends
    it took part in. Receives are made after their send (`arms_early` False), one per send; the channel keeps only
    the latest weights, so a receive made late, after the next send too, takes that next version already — and the
    receive for that next send then returns at once (one send still untaken) instead of waiting for a newer one."""

    arms_early = False  # see WeightReceiver.arms_early

    def __init__(self, channel: LocalWeightChannel) -> None:
        self.channel = channel
        self.last_version = -1
        with channel._cond:
            self.taken = channel._sends  # sends counted from its joining on, as a new collective member's

    def receive(self, *, armed: bool = False) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        tensors, version, stats = self.channel.receive(after_version=self.last_version, armed=armed,
                                                       after_sends=self.taken)
        self.last_version = version
        self.taken += 1
        return tensors, version, stats
