"""Weight transport from the Trainer to the generators: Protocols (base), bucketing, the collective
(gloo/NCCL) group and an in-process channel. See each module's docstring for its place in the dataflow."""

from asyncrl.weights.base import WeightReceiver, WeightSender, sync_stats
from asyncrl.weights.bucketing import pack_bucket, plan_buckets, unpack_bucket
from asyncrl.weights.collective import (
    CollectiveReceiver,
    CollectiveSender,
    WeightSyncGroup,
    create_store,
    join_group,
    resolve_backend,
)
from asyncrl.weights.local import LocalWeightChannel

__all__ = [
    "CollectiveReceiver",
    "CollectiveSender",
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
