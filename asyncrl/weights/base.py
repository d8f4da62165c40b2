"""The weight-transport Protocols: how new policy weights go from the Trainer to the generators.

Place in the dataflow: after each train step the Trainer calls `WeightSender.send(tensors, version)`;
every Generator calls `WeightReceiver.receive()` and hands the returned staging tensors to its
engine's `load_weights`. Two implementations:

- `collective.CollectiveSender` / `CollectiveReceiver`: a bucketed broadcast over a standalone
  gloo/NCCL group (actors in separate processes). Every member takes part in each broadcast; a
  receiver may be called ahead of the send and waits for it (`arms_early`), and the sender says when
  it stops reading the weights (`releases_early`).
- `local.LocalWeightChannel`: an in-process channel (running the runtime without Ray, and tests).

Stats returned by both sides (one meaning each; docs/metrics.md defines the per-step keys):
    sync/seconds   wall time of the transfer on this member
    sync/bytes     bytes of tensor data transferred
    sync/gbps      sync/bytes / sync/seconds / 1e9
    sync/buckets   number of flat buffers the data went in
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor

STAT_SECONDS = "sync/seconds"
STAT_BYTES = "sync/bytes"
STAT_GBPS = "sync/gbps"
STAT_BUCKETS = "sync/buckets"


def sync_stats(nbytes: int, seconds: float, buckets: int) -> dict[str, float]:
    """The stats dict both transports return; seconds is floored so gbps stays finite."""
    seconds = max(seconds, 1e-9)
    return {
        STAT_SECONDS: seconds,
        STAT_BYTES: float(nbytes),
        STAT_GBPS: nbytes / seconds / 1e9,
        STAT_BUCKETS: float(buckets),
    }


@runtime_checkable
class WeightSender(Protocol):
    """The Trainer's side: publish one version of the weights."""

    def send(self, tensors: Mapping[str, Tensor], version: int) -> dict[str, float]:
        """Send `tensors` stamped with `version`; return sync stats. Blocks until sent."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """A Generator's side: take the next (collective) or latest (local) published weights."""

    def receive(self) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        """Return (staging tensors the caller owns and may hand to engine.load_weights, version, stats)."""
        ...
