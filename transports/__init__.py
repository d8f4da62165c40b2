"""Weight transport from the Trainer to the generators: Protocols (base), bucketing, the collective
(gloo/NCCL) group, shared memory / CUDA IPC (ipc) and an in-process channel, and the group's membership (group:
open the store, join, leave, the in-process channel); the receiving halves an engine's own workers use (vllm: a
worker's membership; sglang: an update's header). See each module's docstring for its place in the dataflow."""

import importlib
from typing import Any

# name -> the module that defines it. Imported when first asked for (PEP 562): `transports.group`, which the launcher
# uses to form the weight group, and `transports.base` need no torch; the transports themselves do.
_HOMES = {
    "WeightReceiver": "base", "WeightSender": "base", "sync_stats": "base",
    "pack_bucket": "bucketing", "plan_buckets": "bucketing", "unpack_bucket": "bucketing",
    "CollectiveReceiver": "collective", "CollectiveSender": "collective", "WeightSyncGroup": "collective",
    "create_store": "collective", "join_group": "collective", "resolve_backend": "collective",
    "IpcReceiver": "ipc", "IpcSender": "ipc",
    "LocalWeightChannel": "local",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'transports' has no attribute {name!r}")
    return getattr(importlib.import_module(f"transports.{_HOMES[name]}"), name)
