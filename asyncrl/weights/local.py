"""An in-process weight channel: Trainer and Generators in one process (no Ray, no collective group).

Place in the dataflow: the same Trainer -> Generators edge as `collective.py`, for running the
runtime in one process and for tests. Unlike the collective broadcast, sender and receivers need
not meet: the sender publishes the latest version, and any number of receivers take a copy of
whatever is latest when they ask.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from torch import Tensor

from asyncrl.weights.base import sync_stats


class LocalWeightChannel:
    """Both a `WeightSender` and a `WeightReceiver`. Thread-safe.

    `send` stores detached clones (the trainer may keep updating its parameters in place);
    `receive` returns fresh clones (the caller may hand them to an engine that keeps them).
    `receive` waits up to `timeout_s` for the first version; it never waits for a newer one.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._tensors: dict[str, Tensor] | None = None
        self._version = -1

    @property
    def version(self) -> int:
        """The latest published version; -1 before the first send."""
        with self._cond:
            return self._version

    def send(self, tensors: Mapping[str, Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        copies = {name: t.detach().clone() for name, t in tensors.items()}
        nbytes = sum(t.numel() * t.element_size() for t in copies.values())
        with self._cond:
            self._tensors = copies
            self._version = version
            self._cond.notify_all()
        return sync_stats(nbytes, time.perf_counter() - start, 1)

    def receive(self, after_version: int = -1) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        """The latest weights, waiting (up to `timeout_s`) until their version is > `after_version`."""
        start = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._tensors is not None and self._version > after_version,
                                       timeout=self.timeout_s):
                raise TimeoutError(f"local weight channel: no version > {after_version} was sent "
                                   f"within {self.timeout_s}s")
            latest, version = self._tensors, self._version
        assert latest is not None
        # Clone outside the lock: `send` swaps in a new dict, it never mutates `latest`.
        copies = {name: t.clone() for name, t in latest.items()}
        nbytes = sum(t.numel() * t.element_size() for t in copies.values())
        return copies, version, sync_stats(nbytes, time.perf_counter() - start, 1)


    def receiver(self) -> "LocalReceiver":
        """A receiver that, like a collective member, waits for the broadcast after the one it had."""
        return LocalReceiver(self)


class LocalReceiver:
    """A `WeightReceiver` view of a LocalWeightChannel that remembers the last version it took."""

    def __init__(self, channel: LocalWeightChannel) -> None:
        self.channel = channel
        self.last_version = -1

    def receive(self) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        tensors, version, stats = self.channel.receive(after_version=self.last_version)
        self.last_version = version
        return tensors, version, stats
