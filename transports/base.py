"""The weight-transport Protocols and the transports by name: how new policy weights go from the Trainer
to the generators.

Place in the dataflow: after each update the step pipeline (asyncrl/pipeline.py) calls
`WeightSender.send(state, version, released=...)` on the Trainer; every Generator calls
`WeightReceiver.receive(armed=...)` and hands the returned staging tensors to its engine's `load_weights`.
Transports, sender and receiver side together in this package:

| name | sender | receiver | between |
|---|---|---|---|
| `local` | `local.LocalWeightChannel` | `local.LocalReceiver` | roles in one process (`--local`, tests) |
| `bucketed` | `collective.CollectiveSender` | `collective.CollectiveReceiver`; vLLM: `vllm.WorkerMember` | processes |
| `per_tensor` | `sglang.PerTensorSender` | `SGLangEngine`, with `sglang.read_header` | SGLang's weight-update group |
| `ipc` | `ipc.IpcSender` | `ipc.IpcReceiver` | processes on one host / one GPU: memory every member maps |

`bucketed` is a bucketed broadcast over a gloo/NCCL group, which a vLLM engine's worker joins as a member.
`ipc` shares one buffer laid out by the same bucket plan (shared memory on the CPU, CUDA IPC on a GPU).

A Ray deployment picks the sender by the name the rollout engine declares (`engines.base.weight_transport`)
from `SENDERS`, or `ipc` with `weight_sync.backend = "ipc"` (engines that declare `ipc` support:
`engines.base.IPC_ENGINES`); in-process runs always use `local`. Joining and leaving the group, for either
deployment: transports/group.py.

Stats returned by both sides (one meaning each; docs/metrics.md defines the per-step keys):
    sync/seconds   wall time of the transfer on this member
    sync/bytes     bytes of tensor data transferred
    sync/gbps      sync/bytes / sync/seconds / 1e9
    sync/buckets   number of flat buffers the data went in
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from asyncrl.registry import Registry

if TYPE_CHECKING:
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


def is_timeout(exc: BaseException) -> bool:
    """torch.distributed reports timeouts as RuntimeErrors; recognise them by their text."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


@runtime_checkable
class WeightSender(Protocol):
    """The Trainer's side: publish one version of the weights."""

    def send(self, tensors: Mapping[str, Tensor], version: int, *,
             released: Callable[[], None] | None = None) -> dict[str, float]:
        """Send `tensors` stamped with `version`; return sync stats. Blocks until sent.

        `released()` is called (from the sending thread) once the sender no longer reads `tensors`: from
        then on the trainer may update them while the send goes on with its own copy. A sender that reads
        them to the end calls it last (or not at all): the caller treats the end of `send`, returned or
        raised, as the release too."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """A Generator's side: take the next published weights."""

    arms_early: bool
    """Whether `receive(armed=True)` is worth calling before the send: True where the transfer is a
    collective every member must join (the generator's receive then joins the moment the send starts, with
    no round trip through the Controller); False for the in-process channel, whose copy is instant and
    whose waiting thread would come from the event loop's shared pool."""

    def receive(self, *, armed: bool = False) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        """Return (staging tensors the caller owns and may hand to engine.load_weights, version, stats).

        `armed`: called ahead of the send (while the trainer still trains), so wait for it as long as it
        takes (until the transport is closed) instead of the transport's timeout; stats time the transfer,
        not that wait."""
        ...


class JoinSender(Protocol):
    """Builds the Trainer's sender of one transport, once every member joins (they all call together)."""

    def __call__(self, *, store: Any, host: str, port: int, world_size: int, backend: str,
                 timeout_s: float, meta: Any, group_name: str = "weights") -> WeightSender:
        """`group_name`: a group re-formed after a generator died gets a fresh one (supervision)."""
        ...


SENDERS: Registry[JoinSender] = Registry("weight transport")
SENDERS.register_lazy("bucketed", "transports.collective:join_sender")
SENDERS.register_lazy("per_tensor", "transports.sglang:join_sender")
SENDERS.register_lazy("ipc", "transports.ipc:join_sender")
