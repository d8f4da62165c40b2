"""Checkpoints and the HF export of a sharded trainer group (`trainer.parallel = "fsdp2"`, training/parallel.py).

Place in the dataflow: Controller `_save` ──► Trainer.save_state (rank 0) ──► checkpoint.save, which first hands
its temporary folder to rank 0's `write`: rank 0 asks every rank (asyncrl/roles/trainer_ranks.py) to `save` its
shards into `<folder>/shards/`, then seals them into the manifest beside its own files (rng, state.msgpack), so
the checkpoint stays atomic and `verify` covers every shard. `--resume` (and the automatic resume after a dead
trainer) ──► Trainer.load_state ──► every rank verifies the checkpoint and `load`s it. The final HF export
gathers the full weights (`full_copy`, a collective) and rank 0 alone writes one Hugging Face folder.

Format: torch.distributed.checkpoint (DCP) over its Hugging Face safetensors storage. Every rank writes one
file, `shards/shard-<rank + 1>-model-00001-of-00001.safetensors`, holding its own pieces of every tensor, each
with its offset in the full tensor (JSON in the safetensors header); a replicated tensor (AdamW's `step`) is
written once. There is no pickled metadata file, so asyncrl/checkpoints/store.py's "never unpickled" holds.
Keys: `policy/<fqn>`, `optimizer/<fqn>/<exp_avg|exp_avg_sq|step>`, and `critic/...`, `critic_optimizer/...`
for PPO's value model. The optimizers' settings (lr, betas, ... of each param group) are not tensors: they go
into state.msgpack under `sharded` (`save` returns them), with the writers' count.

Load: DCP reads into this learner's own state dict (this rank's pieces under FSDP2, whole tensors otherwise),
fetching for each piece the saved pieces that overlap it. A checkpoint written by W ranks therefore loads into
any number of FSDP2 ranks, into DDP ranks and into one process; and a checkpoint of whole tensors (1 process,
DDP) loads into FSDP2 ranks (`load_full`: each rank keeps its slice).

Every function here except `load_full` and `load` into one process is a collective of the trainer group:
every rank calls it, in the same order (the invariant of asyncrl/roles/trainer_ranks.py).
"""

from __future__ import annotations

import logging
import warnings
from copy import deepcopy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.checkpoints.store import CheckpointError

if TYPE_CHECKING:
    from asyncrl.training.learner import Learner

log = logging.getLogger(__name__)

SHARDS = "shards"      # the checkpoint's sub-folder holding every rank's shard files
STATE_KEY = "sharded"  # state.msgpack: {"world_size": W, "param_groups": {"optimizer": [...], ...}}


def _parts(learner: Learner) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    """(name, model, its optimizer) of every trained model: the policy, and PPO's critic."""
    out = [("policy", learner.model, learner.optimizer)]
    if learner.critic is not None:
        out.append(("critic", learner.critic.model, learner.critic.optimizer))
    return out


def _opt_key(name: str) -> str:
    """The optimizer's key of part `name` (asyncrl/checkpoints/store.py's tensor groups name them so too)."""
    return "optimizer" if name == "policy" else f"{name}_optimizer"


def _group(learner: Learner) -> Any:
    return getattr(learner.dp, "group", None) if dist.is_initialized() else None


def _state_dicts(learner: Learner) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer, dict, dict]]:
    """(name, model, optimizer, model state dict, optimizer state dict keyed by parameter name) of each part;
    this rank's pieces (DTensors under FSDP2). The tensors are the model's and optimizer's own, not copies."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return [(name, model, opt, *get_state_dict(model, opt)) for name, model, opt in _parts(learner)]


def _flat(dicts: list[tuple[str, Any, Any, dict, dict]]) -> dict[str, Tensor]:
    """Every tensor of `_state_dicts`, under the keys of the module doc; a tied weight (one tensor under two
    names: embeddings and lm_head) under its first name only (loading it fills both)."""
    flat: dict[str, Tensor] = {}
    for name, model, _, msd, osd in dicts:
        tied = _tied_names(model)
        flat.update({f"{name}/{k}": v for k, v in msd.items() if k not in tied})
        for fqn, entry in osd["state"].items():
            for key, value in entry.items():
                if not isinstance(value, Tensor):
                    raise CheckpointError(f"{name} optimizer state {fqn}.{key} is a {type(value).__name__}, not a "
                                          f"tensor: sharded checkpoints hold tensors only")
                flat[f"{_opt_key(name)}/{fqn}/{key}"] = value
    return flat


def _tied_names(model: torch.nn.Module) -> set[str]:
    """The names under which a parameter seen under an earlier name appears again (tied weights; their state
    dict entries are distinct tensors on the same storage)."""
    seen: set[int] = set()
    tied = set()
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(n)
        seen.add(id(p))
    return tied


def _param_groups(osd: dict) -> list[dict[str, Any]]:
    """An optimizer's param-group settings, msgspec-encodable (tuples such as betas listed by name)."""
    out = []
    for group in osd["param_groups"]:
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}
        if any(isinstance(v, Tensor) for v in values.values()):
            raise CheckpointError("an optimizer setting is a tensor (capturable / fused?): not supported by sharded "
                                  "checkpoints")
        out.append({"values": values, "tuples": [k for k, v in group.items() if isinstance(v, tuple)]})
    return out


def _hf_storage() -> tuple[Any, Any]:
    """DCP's safetensors writer and reader classes; an older torch without them is one line."""
    import inspect

    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

        ok = "save_distributed" in inspect.signature(HuggingFaceStorageWriter).parameters
    except ImportError:
        ok = False
    if not ok:
        raise CheckpointError(f"sharded checkpoints (trainer.parallel = 'fsdp2') need torch.distributed.checkpoint's "
                              f"HuggingFaceStorageWriter(save_distributed=...), which torch {torch.__version__} lacks "
                              f"— upgrade torch (tested with 2.13), or use trainer.parallel = 'ddp'")
    return HuggingFaceStorageWriter, HuggingFaceStorageReader


def save(learner: Learner, folder: str | Path) -> dict[str, Any]:
    """Every rank: write this rank's shards of the models and optimizers into `folder` (fsynced). -> the state
    to record beside them ({STATE_KEY: ...}; the same on every rank)."""
    from torch.distributed.checkpoint import save as dcp_save

    writer, _ = _hf_storage()
    dicts = _state_dicts(learner)
    dcp_save(_flat(dicts), storage_writer=writer(str(folder), save_distributed=True), process_group=_group(learner))
    return {STATE_KEY: {"world_size": learner.dp.world_size,
                        "param_groups": {_opt_key(name): _param_groups(osd) for name, _, _, _, osd in dicts}}}


def load(learner: Learner, folder: str | Path, meta: dict[str, Any]) -> None:
    """Every rank: load the shards in `folder` (written by `meta["world_size"]` ranks) into this learner's models
    and optimizers, whatever its own sharding. A checkpoint of other models (another config) is refused,
    naming the tensors that differ, before anything is loaded."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import set_state_dict

    folder = Path(folder)
    reader = _hf_storage()[1](str(folder))
    dicts = _state_dicts(learner)
    flat = _flat(dicts)
    _check_keys(folder, reader.read_metadata().state_dict_metadata, flat)
    if meta["world_size"] != learner.dp.world_size:
        log.info("%s: written by %d trainer ranks, loaded by %d (resharded)", folder, meta["world_size"],
                 learner.dp.world_size)
    group = _group(learner)
    with warnings.catch_warnings():  # one process reading several ranks' shards: intended, not worth a warning
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp_load(flat, storage_reader=reader, process_group=group, no_dist=group is None)  # into the tensors, in place
    for name, model, opt, msd, osd in dicts:
        saved = meta["param_groups"][_opt_key(name)]
        if len(saved) != len(osd["param_groups"]):
            raise CheckpointError(f"{folder}: {name}'s optimizer has {len(saved)} param groups in the checkpoint, "
                                  f"{len(osd['param_groups'])} here")
        for group_sd, g in zip(osd["param_groups"], saved):
            group_sd.update({k: tuple(v) if k in g["tuples"] else v for k, v in g["values"].items()})
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def _check_keys(folder: Path, saved: dict[str, Any], flat: dict[str, Tensor]) -> None:
    """The checkpoint holds exactly this learner's tensors, with their full shapes (one line when not)."""
    missing, extra = sorted(set(flat) - set(saved)), sorted(set(saved) - set(flat))
    shapes = sorted(k for k in set(flat) & set(saved) if tuple(saved[k].size) != tuple(flat[k].shape))
    if missing or extra or shapes:
        found = [f"missing {missing[:3]}" if missing else "", f"not in this learner {extra[:3]}" if extra else "",
                 f"other shapes {shapes[:3]}" if shapes else ""]
        raise CheckpointError(f"{folder}: the checkpoint's tensors are not this learner's "
                              f"({'; '.join(filter(None, found))}) — resume with the config that wrote it (model, "
                              f"algorithm.advantage)")


def load_full(learner: Learner, tensors: dict[str, dict[str, Tensor]], state: dict[str, Any]) -> None:
    """Each rank: load a checkpoint of whole tensors (written by one process or DDP rank 0:
    asyncrl/checkpoints/store.py's `policy`, `optimizer`, ... groups) into this rank's slices of a sharded learner.
    No collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    options = StateDictOptions(full_state_dict=True)
    for name, model, opt in _parts(learner):
        names = [n for n, p in model.named_parameters() if p.requires_grad]  # the optimizer's order (Learner)
        osd = _named_optimizer_state(tensors[_opt_key(name)], state[_opt_key(name)], names)
        set_state_dict(model, opt, model_state_dict=tensors[name], optim_state_dict=osd, options=options)


def _named_optimizer_state(tensors: dict[str, Tensor], meta: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """checkpoint.optimizer_state's pieces (parameters by index) -> an optimizer state dict keyed by name."""
    state: dict[str, dict[str, Any]] = {names[int(i)]: dict(entry) for i, entry in meta["state"].items()}
    for key, value in tensors.items():
        kind, index, field = key.split(".", 2)
        if kind != "state":
            raise CheckpointError(f"optimizer tensor {key!r}: a tensor setting, not supported with trainer.parallel "
                                  f"= 'fsdp2'")
        state[names[int(index)]][field] = value
    groups = []
    for g in meta["param_groups"]:
        values = {k: tuple(v) if k in g["tuples"] else v for k, v in g["values"].items()}
        values["params"] = [names[int(i)] for i in values["params"]]
        groups.append(values)
    return {"state": state, "param_groups": groups}


def full_copy(model: torch.nn.Module, rank: int) -> torch.nn.Module | None:
    """Every rank: gather `model`'s full weights (onto CPU, rank 0 only). -> on rank 0 an unsharded copy of the
    Hugging Face model holding them (what `save_pretrained` writes), elsewhere None."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # fully_shard's FSDP<cls> base
    with torch.device("meta"):
        copy = cls(deepcopy(model.config))  # the export may write into its config (dtype): not the live model's
    copy.load_state_dict(full, assign=True)  # the gathered tensors themselves: no second copy
    if hasattr(copy, "tie_weights"):
        copy.tie_weights()
    return copy
