"""LoRA through `peft` (`[model.lora]`): the policy trains low-rank adapters, the generators get merged weights.

Place in the dataflow: `asyncrl.deploy.build` wraps the trainer's freshly loaded policy with `apply_lora` (a peft
`PeftModel`: every base weight frozen, an adapter B·A on each targeted linear layer) before the Learner takes it,
so the Learner's optimizer, gradient clipping and resumable checkpoints see the adapter parameters alone. From
there on:

    weight sync   `MergedWeights`: the weights under the BASE model's names (`model.layers.0.self_attn.q_proj.weight`),
                  each targeted layer's `W + (alpha / rank)·B·A` computed when the sender reads it (peft's
                  `get_delta_weight`), never by merging into the trainer's module: the engines load them unchanged.
                  With the torch engine only the targeted layers travel (`targeted_only`: the rest is the base the
                  engines loaded from model.path, which never changes); vLLM and SGLang get every weight.
    reference     with `reference.where = "trainer"` and no `reference.path`, `AdapterOffReference` is the policy's
                  own module with its adapters switched off (peft `disable_adapter`): no second copy of the model.
    checkpoints   a resumable checkpoint holds the adapter weights (`adapter_state`), with the optimizer and the
                  LR schedule; the base comes from model.path again on resume.
    export        `export_lora`: RUN_DIR/checkpoint is the merged model as a plain HF folder (peft
                  `merge_and_unload` of a copy, cast to run.export_dtype) and RUN_DIR/checkpoint/adapter the
                  adapter alone (peft `save_pretrained`, in its trained dtype), loadable with
                  `PeftModel.from_pretrained(base, path)`.
    evaluation    on the trainer's module, through the torch engine's HF fallback (its fast path reads the base
                  weights alone: engines/torch_model.py `unsupported_reason`).

Several trainer ranks (`trainer.num_ranks` > 1) train the adapters with `trainer.parallel = "ddp"`: DDP
reduces the adapter gradients alone (the frozen base takes none) and each rank holds the whole model, as a single
process does; FSDP2 is refused by the config check.

Adapter dropout (`model.lora.dropout`) is on only inside the Learner's gradient passes (`adapter_dropout`); every
other forward — generation, the step's proximal and reference logprobs — runs without it, as the Learner keeps
its model in eval mode. peft is an optional dependency: `pip install 'asyncrl[lora]'`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from asyncrl.training.parallel import _sync_dict
from asyncrl.training.reference import ReferencePolicy

if TYPE_CHECKING:
    from asyncrl.config.schema import Config, LoraConfig

log = logging.getLogger(__name__)

OUTPUT_LAYERS = ("lm_head",)  # the LM head is tied to the embeddings in many models: no adapter there
ADAPTER_DIR = "adapter"  # the adapter folder inside the exported checkpoint


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (the policy under `[model.lora]`); peft is not imported for the answer."""
    peft = sys.modules.get("peft")  # not imported yet: no peft model exists in this process
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The names (last component) of `model`'s linear layers that can take an adapter, the LM head left out."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in OUTPUT_LAYERS})


def check_targets(model: torch.nn.Module, cfg: LoraConfig) -> str | None:
    """One error line when `cfg.target_modules` names a module `model` has no linear layer of; else None."""
    known = linear_module_names(model)
    if cfg.target_modules == "all-linear":
        return None if known else "model.lora.target_modules: the model has no linear layer to adapt"
    unknown = [t for t in cfg.target_modules if t not in known]
    if not unknown and cfg.target_modules:
        return None
    what = f"unknown module {', '.join(map(repr, unknown))}" if unknown else "empty list"
    return f"model.lora.target_modules: {what} — the model's linear layers are: {', '.join(known)} (or 'all-linear')"


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` wrapped by peft with `cfg`'s adapters (B = 0 at the start: the same function as `model`); the base
    weights frozen. Adapters on a float16 / bfloat16 base are kept in float32 (peft's autocast_adapter_dtype)."""
    import peft

    error = check_targets(model, cfg)
    if error is not None:
        raise ValueError(error)
    targets: Any = cfg.target_modules if cfg.target_modules == "all-linear" else list(cfg.target_modules)
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    log.info("LoRA rank %d on %d layers: %d trainable parameters of %d (%.2f%%)", cfg.rank,
             len(lora_layers(wrapped)), trainable, total, 100 * trainable / max(total, 1))
    return wrapped


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The adapted layers of a peft model by their name in the base model (e.g. `model.layers.0.mlp.up_proj`)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_weight(layer: torch.nn.Module) -> Tensor:
    """W + Σ scale·B·A over the layer's active adapters (peft's delta), a new tensor: the layer is not changed. W is a
    linear layer's weight, or the one parameter a `ParamWrapper` adapts (an MoE's fused experts, its router)."""
    base = layer.get_param() if hasattr(layer, "parameter_name") else layer.get_base_layer().weight
    weight = base.detach()
    for adapter in layer.active_adapters:
        weight = weight + layer.get_delta_weight(adapter)
    return weight


def adapted_weights(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The weights the adapters change, by their base-model name, each with its LoRA layer: `<layer>.weight` of an
    adapted linear layer; `<module>.<parameter>` of a parameter peft adapts in place (`ParamWrapper`: an MoE's
    fused expert weights and router weight, which peft's all-linear reaches in transformers 5; nested wrappers, one
    per parameter, under `base_layer`)."""
    out = {}
    for name, layer in lora_layers(model).items():
        owner = ".".join(p for p in name.split(".") if p != "base_layer")
        out[f"{owner}.{getattr(layer, 'parameter_name', 'weight')}"] = layer
    return out


class MergedWeights(Mapping[str, Tensor]):
    """A peft policy's weights as the base model names them, every adapter merged (see the module doc).

    Lazy: a targeted layer's merged weight is computed each time it is read, so a sync never holds a merged copy
    of the whole model; the other tensors are the module's own (detached). The weight sender reads it the way it
    reads a plain state dict: until it releases the weights, before the next update changes them."""

    def __init__(self, model: torch.nn.Module, *, targeted_only: bool = False) -> None:
        adapted = adapted_weights(model)
        self._entries: dict[str, Tensor | torch.nn.Module] = {}
        if targeted_only:
            self._entries = dict(adapted)
            return
        for key, tensor in _sync_dict(model.get_base_model(), lambda t: t.detach()).items():
            parts = key.split(".")
            if any(p.startswith("lora_") for p in parts):  # lora_A, lora_B, ...: merged into the weight
                continue
            key = ".".join(p for p in parts if p != "base_layer")
            self._entries[key] = adapted.get(key, tensor)

    def __getitem__(self, name: str) -> Tensor:
        entry = self._entries[name]
        return entry if isinstance(entry, Tensor) else merged_weight(entry)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def adapter_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter weights (peft's names, without the adapter name): what a resumable checkpoint keeps."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """The inverse of `adapter_state`; every adapter weight must be there (a partial state is an error)."""
    from peft import set_peft_model_state_dict

    expected = set(adapter_state(model))
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"the checkpoint's adapter does not fit model.lora: {len(missing)} weights missing "
                         f"({', '.join(missing[:3])}), {len(unexpected)} unexpected ({', '.join(unexpected[:3])}) — "
                         "resume with the run's own [model.lora]")
    set_peft_model_state_dict(model, dict(tensors))


@contextlib.contextmanager
def adapter_dropout(model: torch.nn.Module) -> Iterator[None]:
    """For one gradient pass: the adapters' dropout modules in training mode (the Learner keeps its model in eval
    mode so that its logprobs are the engines'); a no-op without them (dropout 0 or no adapters)."""
    modules = [m for name, m in model.named_modules()
               if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name.split(".")]
    for m in modules:
        m.training = True
    try:
        yield
    finally:
        for m in modules:
            m.training = False


class AdapterOffReference(ReferencePolicy):
    """The frozen reference as the LoRA policy's own module with its adapters switched off: the base weights,
    which never train. Used by the Learner on its training thread, so nothing else runs on the module meanwhile."""

    def __init__(self, policy: torch.nn.Module, *, pad_token_id: int, micro_batch_size: int = 64,
                 device: str | torch.device = "cpu", mixed_precision: str = "no",
                 max_tokens_per_micro_batch: int = 0, logprob_chunk_tokens: int = 0,
                 lm_head_fp32: bool = True) -> None:
        # not ReferencePolicy.__init__: it freezes and moves its model, and this one is the policy
        from asyncrl.training import precision
        from asyncrl.training.micro import MicroBatching

        self.device = torch.device(device)
        self.autocast = precision.autocast_dtype(mixed_precision)
        self.model = policy
        self.pad_token_id = pad_token_id
        self.batching = MicroBatching(micro_batch_size, max_tokens_per_micro_batch)
        self.tokens_scored = 0
        self.chunk = logprob_chunk_tokens
        self.float_head = lm_head_fp32
        self.routing = None  # an MoE policy's routers carry the Learner's RoutingReplay: it hands it over (replay)

    def response_logprobs(self, trajectories: list[Any], parts: list[list[int]] | None = None) -> list[list[float]]:
        with self.model.disable_adapter():
            return super().response_logprobs(trajectories, parts)


def export_lora(model: torch.nn.Module, out_dir: str | Path, *, tokenizer: Any = None,
                dtype: str | None = None) -> Path:
    """RUN_DIR/checkpoint for a LoRA policy: the merged model as an HF folder in `dtype` (None: as trained) with
    the adapter folder `adapter/` inside it; `model` itself is not changed (a copy is merged: one model's memory)."""
    from asyncrl.checkpoints.store import export_hf

    merged = copy.deepcopy(model).merge_and_unload()
    out = export_hf(merged, out_dir, tokenizer=tokenizer, dtype=dtype, copy_model=False)
    del merged
    model.save_pretrained(out / ADAPTER_DIR)
    return out


# ---------------------------------------------------------------- config checks


def check_lora(cfg: Config) -> list[str]:
    """Config errors of `[model.lora]` (asyncrl/config/loader.py runs this with the cross-field checks)."""
    import importlib.util

    lora = cfg.model.lora
    if lora is None:
        return []
    errors = []
    if importlib.util.find_spec("peft") is None:
        errors.append("model.lora: LoRA needs the peft package — pip install 'asyncrl[lora]'")
    if cfg.trainer.num_ranks > 1 and cfg.trainer.parallel != "ddp":
        errors.append(f"model.lora: several trainer ranks train adapters with trainer.parallel = 'ddp', not "
                      f"{cfg.trainer.parallel!r} — set trainer.parallel = 'ddp' (the base is frozen: each rank's "
                      "full copy is what DDP needs anyway) or trainer.num_ranks = 1")
    model = _meta_model(cfg)
    if model is not None and (error := check_targets(model, lora)) is not None:
        errors.append(error)
    return errors


def _meta_model(cfg: Config) -> torch.nn.Module | None:
    """The configured architecture without weights (meta device), to list its linear layers; None when there is
    nothing to read yet (asyncrl/config/loader.py reports a missing model folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, tiny = Path(cfg.model.path), cfg.model.build_tiny
    with torch.device("meta"):
        if (folder / "config.json").is_file():
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
        if tiny is not None:
            from engines.hf import _build_model

            return _build_model(tiny, vocab_size=len(tiny.vocab) + 8)
    return None
