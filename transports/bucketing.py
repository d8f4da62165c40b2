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

Dtypes: the plan describes the tensors as the receivers' engines hold them. Planned with `dtype` (the engines'
dtype, `rollout.dtype`), every floating-point tensor is described in it (`wire_dtype`), whatever the source holds
(float32 master weights under mixed precision); the source converts while packing, each tensor straight into its
slice of the bucket's reusable buffer (`pack_bucket(out=)`): one conversion per bucket, never a converted copy of
the whole model. Integer and bool tensors travel as they are.
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


def wire_dtype(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of `dtype` travels in when the engines hold `target` (None: as it is): floating-point
    tensors take the engines' dtype, others keep theirs."""
    return target if target is not None and dtype.is_floating_point else dtype


def tensor_meta(name: str, tensor: Tensor, dtype: torch.dtype | None = None) -> TensorMeta:
    """The wire description of one named tensor (in `wire_dtype(tensor.dtype, dtype)`)."""
    return TensorMeta(name=name, shape=list(tensor.shape), dtype=dtype_to_str(wire_dtype(tensor.dtype, dtype)))


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


def plan_buckets(named: NamedTensors, bucket_bytes: int, dtype: torch.dtype | None = None) -> WeightsMeta:
    """Describe `named` tensors (a state dict or (name, tensor) pairs) as buckets of <= bucket_bytes.

    Consecutive tensors share a bucket while they have the same (wire) dtype and fit; a tensor larger than
    `bucket_bytes` gets a bucket of its own. Order is the input order. `dtype`: the receivers' engines' dtype;
    floating-point tensors are described (and sent) in it (see the module doc).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    tensors: list[TensorMeta] = []
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_dtype: str | None = None
    for index, (name, tensor) in enumerate(_named_items(named)):
        meta = tensor_meta(name, tensor, dtype)
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
    """Concatenate tensors into one contiguous 1-D tensor: a new buffer on their device (same-dtype tensors),
    or `out` (1-D, their total size) when given. An `out` of another dtype (the engines', see the module doc)
    receives each tensor converted on the way, straight into its slice: no converted copy of a tensor first."""
    if not tensors:
        raise ValueError("pack_bucket needs at least one tensor")
    flat = [t.detach().reshape(-1) for t in tensors]
    if out is None:
        for t in flat:
            if t.dtype != flat[0].dtype:
                raise ValueError(f"pack_bucket: a bucket mixes dtypes ({flat[0].dtype} and {t.dtype})")
        return torch.cat(flat)
    if all(t.dtype == out.dtype for t in flat):
        return torch.cat(flat, out=out)
    total = sum(t.numel() for t in flat)
    if out.dim() != 1 or out.numel() != total:
        raise ValueError(f"pack_bucket: out holds {out.numel()} elements, the tensors {total}")
    offset = 0
    for t in flat:
        if t.dtype.is_floating_point != out.dtype.is_floating_point:
            raise ValueError(f"pack_bucket: cannot pack {t.dtype} into a {out.dtype} buffer")
        out[offset : offset + t.numel()].copy_(t)  # the conversion, in place
        offset += t.numel()
    return out


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
    """Raise ValueError (one line) if `tensors` lacks a tensor of `meta` or has another shape, or a dtype
    that does not convert to the meta's (floating-point tensors send in the meta's floating-point dtype)."""
    for m in meta.tensors:
        t = tensors.get(m.name)
        if t is None:
            raise ValueError(f"weights meta names {m.name!r}, which the tensors to send do not contain")
        want = str_to_dtype(m.dtype)
        converts = t.dtype.is_floating_point and want.is_floating_point
        if list(t.shape) != m.shape or not (t.dtype == want or converts):
            raise ValueError(
                f"tensor {m.name!r} is {dtype_to_str(t.dtype)}{list(t.shape)}, "
                f"weights meta says {m.dtype}{m.shape}: re-plan the buckets"
            )
