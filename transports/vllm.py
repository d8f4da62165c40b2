"""The bucketed broadcast's receiving half inside a vLLM engine's worker process.

Place in the dataflow: Trainer --(`transports.collective`, bucketed broadcast)--> **a vLLM worker** (this
member, held by `engines.vllm_worker.AsyncrlWorkerExtension`) --(model_runner.reload_weights)--> the model vLLM
samples from. The worker joins the trainer's group as one rank (`join`), takes part in each broadcast into
staging tensors (`receive`) and ends its part when the group is re-formed or the engine closes (`leave`). The
worker runs each of these on a thread of its own (a collective that blocked vLLM's busy loop would stop
generation). Engines import this module, never the collective group's internals.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from asyncrl.messages import WeightsMeta


class WorkerMember:
    """One vLLM worker's membership of the weight-sync group."""

    def __init__(self) -> None:
        self.group: Any = None
        self.meta: WeightsMeta | None = None

    def join(self, *, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
             meta: WeightsMeta, device: Any = None) -> None:
        """Join as `rank` (every member joins together); `device`: the worker's GPU (None on gloo)."""
        from transports.collective import join_group

        self.meta = meta
        self.group = join_group(host=host, port=port, rank=rank, world_size=world_size, backend=backend,
                                timeout_s=timeout_s, device=device)

    def receive(self) -> tuple[dict[str, Tensor], int, dict[str, float]]:
        """Take part in one broadcast: (the staged tensors by checkpoint name, their version, stats)."""
        if self.group is None or self.meta is None:
            raise RuntimeError("asyncrl worker: receive before joining the weight-sync group")
        return self.group.broadcast_weights(None, self.meta, None)

    def leave(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
