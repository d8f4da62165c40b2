"""Durable training checkpoints: atomic, verified folders of safetensors + msgpack, never unpickled.

Place in the dataflow: when a checkpoint is due (`run.save_every` steps, `run.save_every_s` seconds:
asyncrl/checkpoints/policy.py) the Controller asks every role for its state (the trainer's weights, optimizer,
scheduler and RNG; the buffer's and gate's counters) and hands it to `save`, which writes
`RUN_DIR/checkpoints/step_<N:08d>/`; `--resume` reads the newest valid one with
`latest_valid` + `load` and gives each role back its part. `export_hf` writes the separate, derived
Hugging Face folder that inference tools load.

Layout of one checkpoint (one writer per checkpoint root)::

    step_00000120/
        <group>.safetensors   one per `tensors` group (e.g. "model", "optimizer", "rng")
        shards/...            files the caller's `write` adds (a sharded trainer's: asyncrl/training/sharded.py)
        state.msgpack         the msgspec-encodable `state` (msgpack keeps floats exact, NaN and inf too)
        manifest.json         `Manifest`: format, step, policy version, config hash, size + sha256 per file

Invariants (each has a test in tests/unit/test_checkpoint.py):

1. Atomic: files are written into `.tmp-step_<N>-<random>/` beside the final folder, each fsynced, the
   manifest last; the folder is fsynced, renamed to `step_<N>` (atomic on POSIX) and the parent fsynced.
   A save that fails at any point leaves no `step_<N>` and touches no other checkpoint; a crash leaves
   only a `.tmp-*` folder, which the next save deletes.
2. Verified: `verify` recomputes the size and sha256 of every listed file; the manifest carries a sha256
   of itself and must be in canonical form, so a change to any byte of any file is detected.
   `latest_valid` skips (and logs) partial or corrupted folders; `load` verifies before reading anything.
3. Never unpickled: tensors go through safetensors, everything else through msgspec; no `torch.load`.
   Python tuples come back as lists (the optimizer and RNG helpers restore theirs).
4. `keep_last` never deletes the newest valid checkpoints: after a save it keeps the new one plus the
   newest `keep_last - 1` older ones that verify, and deletes only older ones beyond those. A valid
   `step_<N>` is never overwritten (saving the same step again raises); an invalid one is replaced.

Cost: `verify` reads every byte, so `latest_valid` followed by `load` reads the newest checkpoint twice,
and pruning verifies up to `keep_last - 1` older ones after each save.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import Tensor

# torch and safetensors' torch half are imported where tensors are read or written: the launcher and the buffer's
# process find, verify and read the state of checkpoints without them (their import is over a second of CPU)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"  # the checkpoint root inside a run directory
MANIFEST = "manifest.json"
STATE = "state.msgpack"
TENSOR_SUFFIX = ".safetensors"
_STEP_DIR = re.compile(r"step_(\d+)")
_GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_TMP_PREFIX = ".tmp-"


class CheckpointError(Exception):
    """A checkpoint is missing, partial or corrupted (the message names the file), or cannot be written."""


class FileEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bytes: int   # size on disk: a truncated file fails fast, before hashing
    sha256: str  # hex digest of the whole file


class Manifest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format_version: int          # layout of the folder; `verify` refuses any other
    step: int                    # trainer steps completed; the folder is step_<step:08d>
    version: int                 # policy version of the saved weights (what resumed generators start from)
    config_sha256: str           # sha256 of the resolved config TOML text: resume can refuse a changed config
    created: float               # unix time of the save, for people reading the folder
    files: dict[str, FileEntry]  # every file but the manifest, by path relative to the folder
    checksum: str = ""           # sha256 of this manifest encoded with checksum="": covers the fields above


@dataclass(frozen=True)
class Checkpoint:
    """What `load` returns: the verified manifest, every tensor group (on CPU) and the decoded state."""

    path: Path
    manifest: Manifest
    tensors: dict[str, dict[str, Tensor]]
    state: dict[str, Any]


def config_sha256(config_text: str) -> str:
    """The hash a manifest records for the resolved config TOML text."""
    return hashlib.sha256(config_text.encode()).hexdigest()


def save(root: str | Path, *, step: int, version: int, config_text: str,
         tensors: dict[str, dict[str, Tensor]] | None = None, state: dict[str, Any] | None = None,
         keep_last: int = 0, write: Callable[[Path], dict[str, Any] | None] | None = None) -> Path:
    """Write checkpoint `step` under `root` atomically and return its folder; then keep only the newest
    `keep_last` valid checkpoints (0 or negative: keep all). `tensors[group]` goes to
    `<group>.safetensors` (moved to CPU, made contiguous; the caller's tensors are not changed), `state`
    to `state.msgpack`. `write(folder)`, when given, runs first with the temporary folder: it writes files
    of its own into it (every trainer rank's shards) and returns more `state` (or None); every file it left
    is fsynced and listed in the manifest like the others, so `verify` covers it. Raises CheckpointError if
    `step_<step>` already exists and verifies."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / f"step_{step:08d}"
    replacing = _reason_invalid(final) if final.exists() else None  # why the folder there is no good
    if final.exists() and replacing is None:
        raise CheckpointError(f"{final} already exists and verifies; refusing to overwrite a good checkpoint")
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}step_{step:08d}-", dir=root))
    try:
        files: dict[str, FileEntry] = {}
        if write is not None:  # first: what it returns joins the state
            state = {**(state or {}), **(write(tmp) or {})}
            files = _seal_tree(tmp, reserved={STATE, MANIFEST, *(f"{g}{TENSOR_SUFFIX}" for g in tensors or {})})
        if tensors:
            import safetensors.torch
        for group, named in (tensors or {}).items():
            if not _GROUP_NAME.fullmatch(group):
                raise CheckpointError(f"tensor group name {group!r} must match {_GROUP_NAME.pattern}")
            safetensors.torch.save_file(_for_disk(group, named), str(tmp / f"{group}{TENSOR_SUFFIX}"))
            files[f"{group}{TENSOR_SUFFIX}"] = _seal(tmp / f"{group}{TENSOR_SUFFIX}")
        try:
            encoded = msgspec.msgpack.encode(state or {})
        except (TypeError, msgspec.EncodeError) as e:
            raise CheckpointError(f"checkpoint state is not msgspec-encodable: {e}") from e
        _write(tmp / STATE, encoded)
        files[STATE] = _seal(tmp / STATE)
        manifest = Manifest(format_version=FORMAT_VERSION, step=step, version=version,
                            config_sha256=config_sha256(config_text), created=time.time(), files=files)
        _write(tmp / MANIFEST, _encode_manifest(manifest))
        fsync_dir(tmp)
        if replacing is not None:  # a partial or corrupted folder from an earlier run
            log.warning("replacing invalid checkpoint %s: %s", final, replacing)
            _discard(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved checkpoint %s (%d files, %d bytes)", final, len(files) + 1,
             sum(f.bytes for f in files.values()))
    _prune(root, final, keep_last)
    return final


def verify(path: str | Path) -> Manifest:
    """The manifest of the checkpoint at `path` once every listed file has its recorded size and sha256;
    else CheckpointError naming the file and what is wrong with it."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        raw = manifest_path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{manifest_path}: cannot read the manifest (partial checkpoint?): {e}") from e
    try:
        manifest = msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as e:
        raise CheckpointError(f"{manifest_path}: corrupted manifest: {e}") from e
    if _encode_manifest(manifest) != raw:
        raise CheckpointError(f"{manifest_path}: corrupted manifest (checksum or encoding does not match)")
    if manifest.format_version != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format_version {manifest.format_version}, "
                              f"this asyncrl reads {FORMAT_VERSION}")
    match = _STEP_DIR.fullmatch(path.name)
    if match and int(match[1]) != manifest.step:
        raise CheckpointError(f"{manifest_path}: records step {manifest.step} but the folder is {path.name}")
    for rel, entry in manifest.files.items():
        file = path / rel
        if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
            raise CheckpointError(f"{manifest_path}: lists a file outside the checkpoint: {rel!r}")
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if (size := file.stat().st_size) != entry.bytes:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry.bytes} (truncated?)")
        if (digest := file_sha256(file)) != entry.sha256:
            raise CheckpointError(f"{file}: sha256 {digest[:12]}…, the manifest says {entry.sha256[:12]}…")
    return manifest


def latest_valid(root: str | Path) -> Path | None:
    """The checkpoint under `root` with the highest step that verifies, or None; logs why each newer
    folder was skipped."""
    for _, path in reversed(list_checkpoints(root)):
        reason = _reason_invalid(path)
        if reason is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, reason)
    return None


def step_of(path: str | Path) -> int:
    """The step of checkpoint folder `path` (`step_<N>`), from its name."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint folder (step_<N>)")
    return int(match[1])


def clear(root: str | Path) -> list[str]:
    """Remove every checkpoint folder under `root` (valid or not) and the leftovers of interrupted saves;
    returns the removed folders' names. Each folder is renamed away first (`_discard`), so none is ever
    seen half-deleted under its own name."""
    found = list_checkpoints(root)
    for _, path in found:
        _discard(path)
    for leftover in Path(root).glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return [path.name for _, path in found]


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Every `step_<N>` folder under `root` (valid or not) as (N, path), by increasing N."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found)


def load(path: str | Path) -> Checkpoint:
    """Verify the checkpoint at `path`, then read every tensor group (onto CPU) and the state."""
    import safetensors.torch

    path = Path(path)
    manifest = verify(path)
    tensors = {rel.removesuffix(TENSOR_SUFFIX): safetensors.torch.load_file(str(path / rel))
               for rel in manifest.files if rel.endswith(TENSOR_SUFFIX) and "/" not in rel}  # shards/: their reader's
    state = msgspec.msgpack.decode((path / STATE).read_bytes()) if STATE in manifest.files else {}
    return Checkpoint(path=path, manifest=manifest, tensors=tensors, state=state)


def read_state(path: str | Path, *, verified: bool = False) -> tuple[Manifest, dict[str, Any]]:
    """Verify the checkpoint at `path` and read its manifest and state only (no tensors: what the
    Controller needs to resume the buffer and its own totals). `verified`: the caller verified it just now
    (`latest_valid`), so every byte is not hashed again."""
    path = Path(path)
    manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=Manifest) if verified else verify(path)
    state = msgspec.msgpack.decode((path / STATE).read_bytes()) if STATE in manifest.files else {}
    return manifest, state


# ---------------------------------------------------------------- trainer state without pickle


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """optimizer.state_dict() split into tensors (`state.<param>.<key>`, `param_groups.<i>.<key>`; the
    optimizer's own tensors, not copies) and a msgspec-encodable meta with everything else."""
    from torch import Tensor

    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        per_param[str(idx)] = {}
        for key, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"state.{idx}.{key}"] = value
            else:  # e.g. a float `step`, or SGD's momentum_buffer=None
                per_param[str(idx)][key] = value
    groups = []
    for i, group in enumerate(sd["param_groups"]):
        values, tuples = {}, []
        for key, value in group.items():
            if isinstance(value, Tensor):  # a tensor lr (capturable / fused setups)
                tensors[f"param_groups.{i}.{key}"] = value
            elif isinstance(value, tuple):  # betas: msgspec writes tuples as lists
                values[key], tuples = list(value), [*tuples, key]
            else:
                values[key] = value
        groups.append({"values": values, "tuples": tuples})
    return tensors, {"state": per_param, "param_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """The inverse of `optimizer_state`: load the pieces into `optimizer` (built over the same parameters)."""
    state = {int(idx): dict(entry) for idx, entry in meta["state"].items()}
    groups = [{k: tuple(v) if k in g["tuples"] else v for k, v in g["values"].items()} for g in meta["param_groups"]]
    for name, value in tensors.items():
        kind, index, key = name.split(".", 2)
        if kind == "state":
            state[int(index)][key] = value
        elif kind == "param_groups":
            groups[int(index)][key] = value
        else:
            raise CheckpointError(f"optimizer tensor {name!r} is neither state.* nor param_groups.*")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """scheduler.state_dict(), checked to be msgspec-encodable (LambdaLR keeps None or a callable object's
    __dict__ per lambda, so plain functions and functools.partial pass)."""
    state = scheduler.state_dict()
    try:
        msgspec.msgpack.encode(state)
    except (TypeError, msgspec.EncodeError) as e:
        raise CheckpointError(f"{type(scheduler).__name__} state is not msgspec-encodable: {e}") from e
    return state


def load_scheduler_state(scheduler: Any, state: dict[str, Any]) -> None:
    """The inverse of `scheduler_state`."""
    scheduler.load_state_dict(state)


def rng_state() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This process's torch (CPU, and every CUDA device when CUDA is available), Python `random` and
    numpy global RNG states, as tensors and a msgspec-encodable meta."""
    import torch

    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"torch.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    meta = {"python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
            "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                      "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                      "gauss": float(np_state["gauss"])}}
    return tensors, meta


def set_rng_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """The inverse of `rng_state`. CUDA states are set for the devices present; a mismatch is logged."""
    import torch

    torch.set_rng_state(tensors["torch.cpu"])
    cuda_names = sorted((k for k in tensors if k.startswith("torch.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    cuda = [tensors[k] for k in cuda_names]
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda) != present:
        log.warning("checkpoint holds RNG states for %d CUDA devices, this process has %d", len(cuda), present)
    for i, s in enumerate(cuda[:present]):
        torch.cuda.set_rng_state(s, i)
    py = meta["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npm = meta["numpy"]
    np.random.set_state({"bit_generator": npm["bit_generator"],
                         "state": {"key": np.array(npm["key"], dtype=np.uint32), "pos": npm["pos"]},
                         "has_gauss": npm["has_gauss"], "gauss": npm["gauss"]})


def export_hf(model: Any, out_dir: str | Path, *, tokenizer: Any = None, dtype: str | None = None,
              copy_model: bool = True) -> Path:
    """Write an HF folder (config + safetensors [+ tokenizer]) of a copy of `model` cast to `dtype`
    ("float32" | "bfloat16" | "float16"; None = as is); `model` itself is not changed. The copy costs
    one model's memory on its device (`copy_model=False`: `model` is the caller's throwaway copy, cast in
    place). The folder appears whole: it is written beside `out_dir` and renamed into place, replacing an
    older export."""
    from engines.hf import torch_dtype

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{out.name}-", dir=out.parent))
    try:
        copied = copy.deepcopy(model) if copy_model else model
        if dtype is not None:
            copied = copied.to(torch_dtype(dtype))
        copied.save_pretrained(tmp, safe_serialization=True)
        del copied
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out.exists():
            _discard(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------- internals


def _for_disk(group: str, named: dict[str, Tensor]) -> dict[str, Tensor]:
    """CPU, contiguous, detached tensors that share no storage (safetensors refuses shared ones, e.g.
    tied embeddings): a second tensor on an already seen storage is cloned."""
    from torch import Tensor

    out, seen = {}, set()
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise CheckpointError(f"tensors[{group!r}][{name!r}] is a {type(t).__name__}, not a Tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _encode_manifest(manifest: Manifest) -> bytes:
    """The canonical bytes of `manifest` with its checksum filled in (compact JSON: no byte is
    insignificant, so `verify` can demand an exact match)."""
    body = msgspec.json.encode(msgspec.structs.replace(manifest, checksum=""))
    return msgspec.json.encode(msgspec.structs.replace(manifest, checksum=hashlib.sha256(body).hexdigest()))


def _reason_invalid(path: Path) -> str | None:
    try:
        verify(path)
    except CheckpointError as e:
        return str(e)
    return None


def _prune(root: Path, newest: Path, keep_last: int) -> None:
    """Keep `newest` and the newest `keep_last - 1` valid checkpoints older than it; delete the older
    rest. Invalid folders inside the kept window stay for inspection; later steps are not touched."""
    if keep_last <= 0:
        return
    kept = 1
    step = int(_STEP_DIR.fullmatch(newest.name)[1])
    for other_step, path in reversed(list_checkpoints(root)):
        if other_step >= step:
            continue
        if kept < keep_last:
            if _reason_invalid(path) is None:
                kept += 1
            continue
        try:
            _discard(path)
            log.info("deleted checkpoint %s (keep_last=%d)", path, keep_last)
        except OSError as e:  # the new checkpoint is durable; an old one that will not go is only disk space
            log.warning("could not delete old checkpoint %s: %s", path, e)


def _discard(path: Path) -> None:
    """Rename `path` to a `.tmp-` name (it vanishes at once, so no half-deleted checkpoint is ever seen
    under its own name), then delete it."""
    doomed = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}delete-{path.name}-", dir=path.parent))
    os.replace(path, doomed)  # onto the empty folder mkdtemp made
    shutil.rmtree(doomed)


def _remove_leftovers(root: Path) -> None:
    for p in root.iterdir():
        if p.name.startswith(_TMP_PREFIX):
            log.warning("removing leftover %s (an interrupted save or delete)", p)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _seal(path: Path) -> FileEntry:
    """Fsync a written file and record its size and digest (read back from what was written)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        digest, size = _hash(f)
    return FileEntry(bytes=size, sha256=digest)


def _seal_tree(folder: Path, reserved: set[str]) -> dict[str, FileEntry]:
    """Seal every file under `folder` (subfolders too, each fsynced) -> {path relative to `folder`: entry};
    a file named like one `save` writes itself (`reserved`) is refused."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            rel = (Path(dirpath) / name).relative_to(folder).as_posix()
            if rel in reserved:
                raise CheckpointError(f"{folder / rel}: `write` left a file the checkpoint writes itself")
            files[rel] = _seal(folder / rel)
        if Path(dirpath) != folder:
            fsync_dir(Path(dirpath))
    return files


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB chunks."""
    with open(path, "rb") as f:
        return _hash(f)[0]


def _hash(f: Any) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    while chunk := f.read(1 << 20):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
