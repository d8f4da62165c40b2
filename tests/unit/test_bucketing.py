"""Bucketing of a state dict for the weight broadcast: plan invariants and bit-exact pack/unpack."""

from __future__ import annotations

import msgspec
import pytest
import torch

from asyncrl.messages import WeightsMeta
from transports.bucketing import (
    bucket_metas,
    bucket_nbytes,
    check_matches,
    dtype_to_str,
    meta_numel,
    pack_bucket,
    plan_buckets,
    str_to_dtype,
    unpack_bucket,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(8, 4, generator=g),                       # 128 B
        "norm": torch.randn(4, generator=g),                           # 16 B
        "big": torch.randn(64, generator=g),                           # 256 B > bucket
        "proj": torch.randn(4, 4, generator=g).to(torch.bfloat16),     # 32 B
        "proj_b": torch.randn(4, generator=g).to(torch.bfloat16),      # 8 B
        "steps": torch.arange(3, dtype=torch.int64),                   # 24 B
        "bias": torch.randn(2, 3, generator=g),                        # 24 B
    }


def test_plan_keeps_input_order_and_covers_every_tensor_once():
    state = _state()
    meta = plan_buckets(state, bucket_bytes=150)
    assert [m.name for m in meta.tensors] == list(state)
    flat_indices = [i for bucket in meta.buckets for i in bucket]
    assert flat_indices == list(range(len(state)))  # consecutive tensors, buckets in order
    assert meta.total_bytes == sum(t.numel() * t.element_size() for t in state.values())


def test_plan_respects_bucket_bytes_except_for_a_single_oversized_tensor():
    meta = plan_buckets(_state(), bucket_bytes=150)
    for b, bucket in enumerate(meta.buckets):
        if len(bucket) > 1:
            assert bucket_nbytes(meta, b) <= 150
    big = [m.name for m in meta.tensors].index("big")
    assert [big] in meta.buckets


def test_plan_never_mixes_dtypes_in_a_bucket():
    meta = plan_buckets(_state(), bucket_bytes=10_000)
    for b in range(len(meta.buckets)):
        assert len({m.dtype for m in bucket_metas(meta, b)}) == 1
    # With room for everything, only dtype changes split: f32 | bf16 | i64 | f32.
    assert len(meta.buckets) == 4


def test_plan_accepts_named_pairs_and_rejects_bad_input():
    pairs = list(_state().items())
    assert plan_buckets(pairs, 64) == plan_buckets(dict(pairs), 64)
    with pytest.raises(ValueError):
        plan_buckets(pairs, 0)
    with pytest.raises(ValueError):
        plan_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 64)


def test_meta_survives_msgspec_round_trip():
    meta = plan_buckets(_state(), bucket_bytes=64)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=WeightsMeta) == meta


@pytest.mark.parametrize("bucket_bytes", [1, 64, 150, 1 << 20])
def test_pack_unpack_round_trip_is_bit_identical(bucket_bytes):
    state = _state()
    meta = plan_buckets(state, bucket_bytes)
    out: dict[str, torch.Tensor] = {}
    for b, bucket in enumerate(meta.buckets):
        metas = bucket_metas(meta, b)
        flat = pack_bucket([state[m.name] for m in metas])
        assert flat.dim() == 1 and flat.is_contiguous()
        # Round-trip through raw bytes, as the broadcast does.
        received = torch.empty_like(flat)
        received.view(torch.uint8).copy_(flat.view(torch.uint8))
        out.update(zip((m.name for m in metas), unpack_bucket(received, metas)))
    assert list(out) == list(state)
    for name, t in state.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


def test_pack_handles_non_contiguous_tensors():
    t = torch.arange(12.0).reshape(3, 4).t()
    flat = pack_bucket([t])
    metas = plan_buckets({"t": t}, 1 << 10).tensors
    assert torch.equal(unpack_bucket(flat, metas)[0], t)


def test_pack_rejects_mixed_dtypes_and_unpack_rejects_wrong_sizes():
    with pytest.raises(ValueError):
        pack_bucket([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    metas = plan_buckets({"a": torch.zeros(3)}, 64).tensors
    with pytest.raises(ValueError):
        unpack_bucket(torch.zeros(4), metas)


def test_a_plan_in_the_engines_dtype_describes_floats_in_it_and_leaves_integers_alone():
    state = _state()
    meta = plan_buckets(state, bucket_bytes=150, dtype=torch.bfloat16)
    dtypes = {m.name: m.dtype for m in meta.tensors}
    assert dtypes == {name: "int64" if name == "steps" else "bfloat16" for name in state}
    assert meta.total_bytes == sum(t.numel() * (8 if t.dtype == torch.int64 else 2) for t in state.values())
    for b in range(len(meta.buckets)):  # still one dtype per bucket, still bounded (in wire bytes)
        assert len({m.dtype for m in bucket_metas(meta, b)}) == 1
        assert bucket_nbytes(meta, b) <= 150 or len(meta.buckets[b]) == 1
    check_matches(state, meta)  # float32 sources are sendable against a bfloat16 plan


def test_packing_float32_into_a_bf16_buffer_equals_converting_each_tensor():
    state = _state()
    meta = plan_buckets(state, bucket_bytes=1 << 20, dtype=torch.bfloat16)
    for b in range(len(meta.buckets)):
        metas = bucket_metas(meta, b)
        parts = [state[m.name] for m in metas]
        out = torch.empty(sum(meta_numel(m) for m in metas), dtype=str_to_dtype(metas[0].dtype))
        flat = pack_bucket(parts, out=out)
        assert flat.data_ptr() == out.data_ptr()  # into the reusable buffer, no new one
        for m, got in zip(metas, unpack_bucket(flat, metas)):
            want = state[m.name].to(str_to_dtype(m.dtype))
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), m.name


def test_conversion_never_crosses_between_floats_and_integers():
    meta = plan_buckets({"steps": torch.arange(3)}, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="re-plan"):
        check_matches({"steps": torch.zeros(3)}, meta)
    with pytest.raises(ValueError, match="cannot pack"):
        pack_bucket([torch.arange(3), torch.zeros(2)], out=torch.empty(5))
    with pytest.raises(ValueError, match="elements"):
        pack_bucket([torch.zeros(3)], out=torch.empty(4, dtype=torch.bfloat16))


def test_dtype_strings_round_trip():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8):
        assert str_to_dtype(dtype_to_str(dtype)) is dtype
    assert dtype_to_str(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError):
        str_to_dtype("Tensor")


def test_a_receivers_cpu_staging_memory_is_reused_only_once_nothing_views_the_last_sync():
    from transports.collective import WeightSyncGroup

    meta = plan_buckets({"a": torch.zeros(300, dtype=torch.bfloat16), "b": torch.zeros(5, 7)}, 256)
    group = WeightSyncGroup(None, rank=1, world_size=2, backend="gloo", timeout_s=1.0, device=torch.device("cpu"))
    first = group._staging(meta, 0)
    first.fill_(3)
    address, dtype = first.data_ptr(), first.dtype
    kept = first[:10]  # a caller still holds a view (an engine that keeps the tensors)
    del first
    second = group._staging(meta, 0)
    assert second.data_ptr() != address and torch.all(kept == 3)  # new memory: the held view never changes
    assert second.dtype == dtype and torch.all(second == 0)  # fresh memory is touched (zeroed) up front
    address = second.data_ptr()
    del kept, second
    third = group._staging(meta, 0)
    assert third.data_ptr() == address  # nothing views it any more: the same memory again
    assert group._staging(meta, 1).dtype == torch.float32  # each bucket its own memory, in its dtype
