"""Bucketing: how a state dict is cut into flat buffers for the weight broadcast.

Place in the dataflow: the Trainer plans the buckets once from its state dict (`plan_buckets` ->
`WeightsMeta`); the deployment hands that meta to every member when the group forms. Each broadcast then sends one flat
buffer per bucket (`pack_bucket` on the source, `unpack_bucket` on the receivers). One big buffer per
bucket instead of one collective per parameter keeps the number of collectives small, and a bounded
bucket size keeps the staging memory small.

Invariants (tested in tests/unit/test_bucketing.py):
- tensors keep the order they were given in (a state dict's insertion order is stable across
  processes that build the same model), and buckets hold consecutive tensors;
- a bucket holds at most `bucket_bytes` bytes, except a single tensor larger than that, which gets a
  bucket of its own;
- a bucket never mixes dtypes, so its flat buffer is one dtype and unpacking is a view, never a cast.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from asyncrl.messages import TensorMeta, WeightsMeta

NamedTensors = Mapping[str, Tensor] | Sequence[tuple[str, Tensor]]


def dtype_to_str(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (the form `TensorMeta.dtype` carries on the wire)."""
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    """"float32" (or "torch.float32") -> torch.float32; ValueError for anything that is not a dtype."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in weights meta (expected e.g. 'float32')")
    return dtype


def tensor_meta(name: str, tensor: Tensor) -> TensorMeta:
    """The wire description of one named tensor."""
    return TensorMeta(name=name, shape=list(tensor.shape), dtype=dtype_to_str(tensor.dtype))


def meta_numel(meta: TensorMeta) -> int:
    numel = 1
    for dim in meta.shape:
        numel *= dim
    return numel


def meta_nbytes(meta: TensorMeta) -> int:
    """Bytes the tensor described by `meta` occupies."""
    return meta_numel(meta) * str_to_dtype(meta.dtype).itemsize


def bucket_metas(meta: WeightsMeta, bucket: int) -> list[TensorMeta]:
    """The TensorMetas of bucket number `bucket`, in broadcast order."""
    return [meta.tensors[i] for i in meta.buckets[bucket]]


def bucket_nbytes(meta: WeightsMeta, bucket: int) -> int:
    return sum(meta_nbytes(m) for m in bucket_metas(meta, bucket))


def _named_items(named: NamedTensors) -> list[tuple[str, Tensor]]:
    items: Iterable[tuple[str, Tensor]] = named.items() if isinstance(named, Mapping) else named
    out = list(items)
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("plan_buckets: tensor names must be unique")
    return out


def plan_buckets(named: NamedTensors, bucket_bytes: int) -> WeightsMeta:
    """Describe `named` tensors (a state dict or (name, tensor) pairs) as buckets of <= bucket_bytes.

    Consecutive tensors share a bucket while they have the same dtype and fit; a tensor larger than
    `bucket_bytes` gets a bucket of its own. Order is the input order.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    tensors: list[TensorMeta] = []
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_dtype: str | None = None
    for index, (name, tensor) in enumerate(_named_items(named)):
        meta = tensor_meta(name, tensor)
        nbytes = meta_nbytes(meta)
        tensors.append(meta)
        fits = current_bytes + nbytes <= bucket_bytes
        if current and (meta.dtype != current_dtype or not fits):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += nbytes
        current_dtype = meta.dtype
    if current:
        buckets.append(current)
    total = sum(meta_nbytes(m) for m in tensors)
    return WeightsMeta(tensors=tensors, buckets=buckets, total_bytes=total)


def pack_bucket(tensors: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """Concatenate same-dtype tensors into one contiguous 1-D tensor: a new buffer on their device, or `out`
    (1-D, their dtype and total size) when given."""
    if not tensors:
        raise ValueError("pack_bucket needs at least one tensor")
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype:
            raise ValueError(f"pack_bucket: a bucket mixes dtypes ({dtype} and {t.dtype})")
    flat = [t.detach().reshape(-1) for t in tensors]
    return torch.cat(flat) if out is None else torch.cat(flat, out=out)


def unpack_bucket(flat: Tensor, metas: Sequence[TensorMeta]) -> list[Tensor]:
    """Split a flat buffer back into tensors shaped as `metas` (views into `flat`, no copies)."""
    if flat.dim() != 1:
        raise ValueError(f"unpack_bucket expects a 1-D buffer, got shape {tuple(flat.shape)}")
    numels = [meta_numel(m) for m in metas]
    if sum(numels) != flat.numel():
        raise ValueError(f"unpack_bucket: metas describe {sum(numels)} elements, buffer has {flat.numel()}")
    out: list[Tensor] = []
    offset = 0
    for meta, numel in zip(metas, numels):
        if str_to_dtype(meta.dtype) != flat.dtype:
            raise ValueError(f"unpack_bucket: {meta.name} is {meta.dtype}, buffer is {flat.dtype}")
        out.append(flat[offset : offset + numel].view(meta.shape))
        offset += numel
    return out


def empty_bucket(meta: WeightsMeta, bucket: int, device: torch.device | str | None = None) -> Tensor:
    """A staging flat buffer for bucket number `bucket` (what a receiver broadcasts into)."""
    metas = bucket_metas(meta, bucket)
    dtype = str_to_dtype(metas[0].dtype)
    return torch.empty(sum(meta_numel(m) for m in metas), dtype=dtype, device=device)


def check_matches(tensors: Mapping[str, Tensor], meta: WeightsMeta) -> None:
    """Raise ValueError (one line) if `tensors` lacks a tensor of `meta` or has another shape/dtype."""
    for m in meta.tensors:
        t = tensors.get(m.name)
        if t is None:
            raise ValueError(f"weights meta names {m.name!r}, which the tensors to send do not contain")
        if list(t.shape) != m.shape or dtype_to_str(t.dtype) != m.dtype:
            raise ValueError(
                f"tensor {m.name!r} is {dtype_to_str(t.dtype)}{list(t.shape)}, "
                f"weights meta says {m.dtype}{m.shape}: re-plan the buckets"
            )
