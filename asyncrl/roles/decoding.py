"""Token ids to the text a reward function sees, many sequences at once: the decode's own batch call (`decode.many`,
asyncrl.deploy.build.tokenizer_fns: the Rust tokenizer's batch decode where it gives the same text) where it has one,
else one call per sequence. The generator decodes what it sampled; the scorer what arrives without text."""

from __future__ import annotations

from typing import Callable


def decode_many(decode: Callable[[list[int]], str], seqs: list[list[int]]) -> list[str]:
    many = getattr(decode, "many", None)
    if many is not None and seqs:
        return list(many(seqs))
    return [decode(ids) for ids in seqs]
