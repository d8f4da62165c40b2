"""Micro-batches: which of a mini-batch's samples share one forward (and backward).

Place in the dataflow: the Learner (training/learner.py) cuts every pass over samples — the gradient passes, the
proximal and reference forwards, the critic's — into micro-batches with one `MicroBatching`; each micro-batch is
`collate`d into one right-padded [B, L] batch (training/batch.py), L its longest sample.

Two ways to cut, by `trainer.max_tokens_per_micro_batch`:

    0 (default)   consecutive runs of `trainer.micro_batch_size` samples, in the step's order;
    > 0           a token budget, as verl's dynamic batch size: the samples sorted by length (prompt + response,
                  longest first) and cut into runs whose B x L (the padded tokens the forward computes) stays
                  within the budget, choosing the cut that computes the fewest tokens (padding included, plus
                  FORWARD_COST tokens' worth per forward for what every forward costs whatever its size: an exact
                  dynamic programme over the sorted order, where the best cut is always a set of runs). Similar
                  lengths share a batch, so the padding is small however widely the lengths spread, and a long
                  reply does not drag a batch of short ones to its width; a sample longer than the budget gets a
                  micro-batch of its own (never dropped).

The loss does not depend on the cut: every micro-batch's loss divides by the counts of the whole mini-batch
(asyncrl/algorithms/losses.py), so Σ over micro-batches is the same sum whatever sample lands where.

With trainer.share_prompts the budget cuts the shared layout's rows instead of samples (training/sharing.py: a
prompt once, then replies to it): a prompt's samples fill rows of at most the budget, and rows x the widest row
(the tokens the shared forward computes) stays within it, so the samples of a prompt share their forward.

Trainer ranks (training/parallel.py) must run equally many forwards. Every rank holds the whole step, so each one
computes the cut of every rank's share (`agreed`) and takes the largest count; a rank that needs fewer splits its
costliest micro-batches in two until it has as many (a share of n samples never needs more than n).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.messages import Trajectory

# What one more forward costs beyond its tokens (the autocast casts of the weights, the Python of a pass), in
# tokens' worth: the cut prefers one batch with a little padding to two without.
FORWARD_COST = 64


def lengths(trajectories: Sequence[Trajectory]) -> list[int]:
    """Each sample's tokens in a forward: prompt + response."""
    return [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]


def padded_cells(lengths_: Sequence[int], part: Sequence[int]) -> int:
    """B x L of the micro-batch `part` (indices into `lengths_`): the tokens its padded forward computes."""
    return len(part) * max((lengths_[i] for i in part), default=0)


def in_order(rows: Sequence[Tensor], parts: Sequence[Sequence[int]]) -> Tensor:
    """Each micro-batch's rows ([len(part), ...], in its part's order) -> one tensor in the samples' order."""
    out = torch.cat(list(rows))
    order = torch.tensor([i for part in parts for i in part], dtype=torch.long)
    return out[torch.argsort(order)]


@dataclass(frozen=True)
class MicroBatching:
    """max_samples: trainer.micro_batch_size; max_tokens: trainer.max_tokens_per_micro_batch (0: off)."""

    max_samples: int
    max_tokens: int = 0

    def split(self, lengths_: Sequence[int], count: int | None = None,
              prompts: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """Sample lengths -> micro-batches as lists of indices into `lengths_`; every index exactly once.
        `count` (>= what the budget alone gives, <= len(lengths_)): cut into exactly that many. `prompts` (each
        sample's prompt ids; trainer.share_prompts): under a token budget the units cut are the shared layout's
        rows, a prompt and replies to it (`_shared_rows`), so a prompt's samples share a micro-batch."""
        n = len(lengths_)
        if not self.max_tokens:
            parts = [list(range(s, min(s + self.max_samples, n))) for s in range(0, n, self.max_samples)]
            if count is not None and count != len(parts):
                raise ValueError(f"{n} samples make {len(parts)} micro-batches of {self.max_samples}, not {count}")
            return parts
        if prompts is not None:
            rows, widths = _shared_rows(lengths_, prompts, self.max_tokens)
        else:
            rows, widths = [[i] for i in range(n)], list(lengths_)
        order = sorted(range(len(rows)), key=lambda r: -widths[r])   # stable: equal widths keep the step's order
        parts = [[i for r in order[a:b] for i in rows[r]]
                 for a, b in _cheapest_runs([widths[r] for r in order], self.max_tokens)]
        if count is not None:
            if not len(parts) <= count <= n:
                raise ValueError(f"cannot cut {n} samples into {count} micro-batches (the budget gives {len(parts)})")
            while len(parts) < count:
                k = max((j for j in range(len(parts)) if len(parts[j]) > 1),
                        key=lambda j: padded_cells(lengths_, parts[j]))
                half = (len(parts[k]) + 1) // 2
                parts[k : k + 1] = [parts[k][:half], parts[k][half:]]
        return parts

    def agreed(self, lengths_: Sequence[int], shards: Sequence[tuple[int, int]], rank: int,
               prompts: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """The micro-batches of shard `rank` (indices relative to its start), as many as the share that needs the
        most: `lengths_` (and `prompts`, as in `split`) cover every shard (all ranks' samples, [lo, hi) ranges)."""
        def share(a: int, b: int) -> Sequence[Sequence[int]] | None:
            return None if prompts is None else prompts[a:b]

        lo, hi = shards[rank]
        if len(shards) == 1:
            return self.split(lengths_[lo:hi], prompts=share(lo, hi))
        count = max(len(self.split(lengths_[a:b], prompts=share(a, b))) for a, b in shards)
        return self.split(lengths_[lo:hi], count, prompts=share(lo, hi))


def _shared_rows(lengths_: Sequence[int], prompts: Sequence[Sequence[int]],
                 budget: int) -> tuple[list[list[int]], list[int]]:
    """trainer.share_prompts: the samples as rows of the shared layout (training/sharing.py) -> (rows as lists of
    sample indices, each row's tokens: its prompt once plus its replies). A prompt's samples, longest reply first,
    fill rows of at most `budget` tokens (a reply too long for one with others gets a row of its own)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(i)
    rows, widths = [], []
    for prompt, members in by_prompt.items():
        row: list[int] = []
        width = len(prompt)
        for i in sorted(members, key=lambda i: -lengths_[i]):
            reply = lengths_[i] - len(prompt)
            if row and width + reply > budget:
                rows.append(row)
                widths.append(width)
                row, width = [], len(prompt)
            row.append(i)
            width += reply
        rows.append(row)
        widths.append(width)
    return rows, widths


def _cheapest_runs(widths: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """widths sorted longest first -> the runs [a, b) covering them with (b - a) x widths[a] <= budget (a run of
    one always allowed) whose sum of (b - a) x widths[a] + FORWARD_COST is least. O(n x the longest run)."""
    n = len(widths)
    best = [0.0] + [float("inf")] * n        # best[b]: the cheapest cut of widths[:b]
    start = [0] * (n + 1)
    for b in range(1, n + 1):
        for a in range(b - 1, -1, -1):       # the run [a, b): its width is widths[a]
            if a < b - 1 and (b - a) * widths[a] > budget:
                break                        # wider still as a moves left
            cost = best[a] + (b - a) * widths[a] + FORWARD_COST
            if cost < best[b]:
                best[b], start[b] = cost, a
    runs, b = [], n
    while b:
        runs.append((start[b], b))
        b = start[b]
    return runs[::-1]
