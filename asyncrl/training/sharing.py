"""Prompt sharing: the samples of one prompt run the prompt's tokens once (trainer.share_prompts).

Place in the dataflow: the Learner's policy forwards (training/logprobs.py `shared_prompt_logprobs`) turn one
collated micro-batch (training/batch.py `collate`: right-padded prompt + response rows) into this layout, run the
model over it and read one logprob per response token back at the batch's [B, L] positions.

A GRPO-style step trains `group_size` replies to each prompt, and a padded batch computes the prompt once per
reply. Here the samples of a micro-batch that share their prompt (the same token ids) become one row: the prompt's
P tokens, then each reply's tokens one after another.

    row       p0 p1 p2 | a0 a1 | b0 b1 b2 | pad
    segment    0  0  0 |  1  1 |  2  2  2 |  -1
    position   0  1  2 |  3  4 |  3  4  5 |   0

A token attends to the earlier tokens of its own segment and to the whole prompt (segment 0): the mask is causal
and block-diagonal over the replies, the position ids restart at P for each reply, so every reply token sees exactly
the keys, values and rotary positions it has in its padded row, and its logprob and gradient are the padded
forward's (to rounding). The logprob of a reply's first token is read from the prompt's last hidden state, which
every reply of the row shares: the backward sums their gradients into the prompt, as the padded batch's separate
copies of it would.

What it saves: a group of n replies of lengths r_i to a prompt of P tokens computes P + sum(r_i) tokens instead of
n x (P + max r_i) — for the README's job (P = 43, n = 8, r <= 12) ~3.5x fewer. What it costs: the mask is a dense
[R, 1, S, S] tensor (S = the longest row), fine for sdpa and eager attention; flash-attention has no such mask, and
there the Learner runs the padded forward (`supports`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# attention implementations that take a custom 4D mask: sdpa a boolean one (True: attend), eager an additive one
_MASK_KINDS = {"sdpa": "bool", "eager": "additive"}


def attention_kind(config: Any) -> str | None:
    """How attention under a transformers `config` takes a custom [B, 1, Q, K] mask ("bool" / "additive"), or None
    where it takes none (flash-attention, flex, no transformers config)."""
    impl = getattr(config, "_attn_implementation", None)
    return _MASK_KINDS.get(impl) if isinstance(impl, str) else None


@dataclass(frozen=True)
class SharedRows:
    """One micro-batch in the shared layout: R rows (one per distinct prompt) of S tokens."""

    input_ids: Tensor      # [R, S] the prompt, then each of its replies; 0 on padding
    position_ids: Tensor   # [R, S] 0..P-1 on the prompt, P.. again on every reply, 0 on padding
    segments: Tensor       # [R, S] 0 on the prompt, k on the row's k-th reply (k >= 1), -1 on padding
    src: Tensor            # [n] index into the flattened [R * S] hidden states of the one that predicts each read
                           # token of the batch (its response positions past column 0, in [B, L] row-major order)
    tokens: int            # real tokens in the rows (the forward's work without its padding)

    @property
    def cells(self) -> int:
        """R x S: the tokens the forward computes, padding included."""
        return self.input_ids.numel()

    def mask(self, kind: str) -> Tensor:
        """[R, 1, S, S] attention mask: query q sees key k <= q of its own segment or of the prompt. A padding
        query sees the prompt and the padding before it (its output is never read: the mask only keeps its
        softmax finite). kind "bool" (True: attend) or "additive" (0 / the float32 minimum)."""
        seg = self.segments
        s = seg.shape[1]
        causal = torch.ones((s, s), dtype=torch.bool, device=seg.device).tril()
        same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])     # [R, q, k]
        allowed = (causal[None] & same)[:, None]
        if kind == "bool":
            return allowed
        return torch.zeros(allowed.shape, dtype=torch.float32, device=seg.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min)


def share_prompts(input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> SharedRows:
    """A collated batch ([B, L] each: right-padded prompt + response rows, the response a contiguous run after the
    prompt) -> its shared layout. Rows whose prompts are the same token ids share one layout row, in the order of
    their first sample; a sample without reply tokens still keeps its prompt's row."""
    device = input_ids.device
    ids = input_ids.cpu()
    total = attention_mask.bool().sum(1).cpu()
    prompt = total - response_mask.bool().sum(1).cpu()
    rows: dict[tuple[int, ...], list[int]] = {}
    for b in range(ids.shape[0]):
        rows.setdefault(tuple(ids[b, : int(prompt[b])].tolist()), []).append(b)
    width = max(len(key) + sum(int(total[b] - prompt[b]) for b in members) for key, members in rows.items())
    r = len(rows)
    out_ids = torch.zeros((r, width), dtype=torch.long)
    positions = torch.zeros((r, width), dtype=torch.long)
    segments = torch.full((r, width), -1, dtype=torch.long)
    src_of: dict[int, list[int]] = {}
    for row, (key, members) in enumerate(rows.items()):
        p = len(key)
        if not p:
            raise ValueError("prompt sharing needs every sample's prompt to hold at least one token")
        out_ids[row, :p] = torch.tensor(key, dtype=torch.long)
        positions[row, :p] = torch.arange(p)
        segments[row, :p] = 0
        start = p
        for k, b in enumerate(members, start=1):
            n = int(total[b]) - p
            out_ids[row, start : start + n] = ids[b, p : p + n]
            positions[row, start : start + n] = torch.arange(p, p + n)
            segments[row, start : start + n] = k
            # response token j (column p + j) is predicted by the prompt's last state (j = 0), else by token j - 1
            base = row * width
            src_of[b] = [base + p - 1] + [base + start + j - 1 for j in range(1, n)]
            start += n
    src = [i for b in range(ids.shape[0]) for i in src_of.get(b, [])]
    real = int((segments >= 0).sum())
    return SharedRows(out_ids.to(device), positions.to(device), segments.to(device),
                      torch.tensor(src, dtype=torch.long, device=device), real)


def check_config(cfg: Any) -> list[str]:
    """trainer.share_prompts on: what it cannot run beside (one line each, with the fix)."""
    key, errors = "trainer.share_prompts: true", []
    if cfg.trainer.pack_sequences:
        errors.append(f"{key} and trainer.pack_sequences both lay out the micro-batch's tokens — choose one")
    if cfg.algorithm.routing_replay != "off":
        errors.append(f"{key}: routing replay records the padded layout's positions — set "
                      f"algorithm.routing_replay = 'off' or trainer.share_prompts = false")
    if cfg.trainer.router_aux_loss_coef > 0:
        errors.append(f"{key}: the router's load-balancing loss counts the padded layout's tokens — set "
                      f"trainer.router_aux_loss_coef = 0 or trainer.share_prompts = false")
    return errors
