"""Weight transport from the Trainer to the generators: Protocols (base), bucketing, the collective
(gloo/NCCL) group, shared memory / CUDA IPC (ipc) and an in-process channel, and the group's membership (group:
open the store, join, leave, the in-process channel); the receiving halves an engine's own workers use (vllm: a
worker's membership; sglang: an update's header). See each module's docstring for its place in the dataflow."""

from transports.base import WeightReceiver, WeightSender, sync_stats
from transports.bucketing import pack_bucket, plan_buckets, unpack_bucket
from transports.collective import (
    CollectiveReceiver,
    CollectiveSender,
    WeightSyncGroup,
    create_store,
    join_group,
    resolve_backend,
)
from transports.ipc import IpcReceiver, IpcSender
from transports.local import LocalWeightChannel

__all__ = [
    "CollectiveReceiver",
    "CollectiveSender",
    "IpcReceiver",
    "IpcSender",
    "LocalWeightChannel",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncGroup",
    "create_store",
    "join_group",
    "pack_bucket",
    "plan_buckets",
    "resolve_backend",
    "sync_stats",
    "unpack_bucket",
]
