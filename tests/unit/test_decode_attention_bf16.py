"""SlotDecoder's CPU decode attention in bf16 (the K q^T form that reads the cache as it lies) computes what
attention computes: against fp32 attention on the same bf16 values, with and without a padding mask."""

from __future__ import annotations

import torch

from engines.torch_model import SlotDecoder


def reference(q, k, v, mask):
    scores = q.float() @ k.float().transpose(1, 2)
    if mask is not None:
        scores = scores + mask.float()
    return scores.softmax(-1) @ v.float()


def test_bf16_decode_attention_matches_fp32_attention_on_strided_cache_slices():
    dec = SlotDecoder.__new__(SlotDecoder)  # only _decode_attention is used: no model needed
    dec.use_sdpa = False
    g = torch.Generator().manual_seed(0)
    n, group, d, width, max_len = 12, 3, 64, 37, 64
    cache = torch.randn(n, max_len, d, generator=g).bfloat16()
    k = cache[:, :width]  # a strided slice of the cache, as in a decode step
    v = torch.randn(n, max_len, d, generator=g).bfloat16()[:, :width]
    q = torch.randn(n, group, d, generator=g).bfloat16() * 0.125
    mask = torch.zeros(n, 1, width, dtype=torch.bfloat16)
    mask[: n // 2, :, width - 5:] = float("-inf")  # half the rows hold 5 fewer positions
    for m in (None, mask):
        out = dec._decode_attention(q, k, v, m)
        assert out.dtype == torch.bfloat16 and out.shape == (n, group, d)
        torch.testing.assert_close(out.float(), reference(q, k, v, m), atol=2e-2, rtol=2e-2)
    # the mask matters: padded positions change the result when unmasked
    assert not torch.allclose(dec._decode_attention(q, k, v, None)[: n // 2].float(),
                              dec._decode_attention(q, k, v, mask)[: n // 2].float(), atol=1e-3)
