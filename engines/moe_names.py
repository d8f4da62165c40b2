"""A mixture-of-experts model's weights under its checkpoint's names, from the trainer's fused ones.

Place in the dataflow: transformers 5 holds an MoE layer's experts as fused 3-D parameters
(`mlp.experts.gate_up_proj` [experts, 2 x intermediate, hidden], `mlp.experts.down_proj` [experts, hidden,
intermediate]) and converts them back to the checkpoint's per-expert tensors when it saves; the trainer's state dict,
which the weight sync sends, has the fused names. vLLM loads weights by the checkpoint's names
(`model.layers.0.mlp.experts.3.gate_proj.weight`; Mixtral: `block_sparse_moe.experts.3.w1.weight`), so its engine
(engines/vllm_engine.py, and its worker for a broadcast) turns the fused tensors into those — views, no copy — before
vLLM reloads them. The native engine loads the trainer's names as they are.

gate_up_proj holds the gate projection's rows first, then the up projection's (transformers' own conversion
concatenates [gate_proj, up_proj]); tests/vllm_engine holds the split to the checkpoint file bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

# model_type -> (the MoE block's name in the checkpoint, gate / up / down projection names of one expert)
CHECKPOINT_EXPERTS = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
_FUSED = re.compile(r"^(?P<layer>.*)\.mlp\.(?P<rest>experts\.(?:gate_up_proj|down_proj)|gate\.weight)$")


def checkpoint_tensors(named: Mapping[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """`named` (the trainer's names) with every fused expert tensor split into the checkpoint's per-expert ones and
    the router renamed where the checkpoint names it otherwise; a dense model's (or an unknown family's) unchanged."""
    if model_type not in CHECKPOINT_EXPERTS:
        return dict(named)
    block, gate, up, down = CHECKPOINT_EXPERTS[model_type]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, rest = f"{match['layer']}.{block}", match["rest"]
        if rest == "gate.weight":
            out[f"{prefix}.gate.weight"] = tensor
        elif rest == "experts.gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.{gate}.weight"] = tensor[e, :half]
                out[f"{prefix}.experts.{e}.{up}.weight"] = tensor[e, half:]
        else:
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.{down}.weight"] = tensor[e]
    return out


def checkpoint_shapes(shapes: Mapping[str, tuple[int, ...]], model_type: str) -> dict[str, tuple[int, ...]]:
    """The names and shapes `checkpoint_tensors` makes of tensors of these names and shapes."""
    fake = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    return {name: tuple(t.shape) for name, t in checkpoint_tensors(fake, model_type).items()}
