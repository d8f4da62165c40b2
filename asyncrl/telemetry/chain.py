"""The weight-version chain of an asynchronous run, link by link, from its trace (`asyncrl report`).

With `max_staleness = k`, the groups of train step s + k may be sampled at version s at the oldest. Version s
is what train step s - 1 made, so between the end of that update and the start of step s + k the weights and
the groups go once round the whole pipeline:

  the trainer's send begins   train step s-1 ends ──► its `weights_send` of version s starts
  broadcast                   that send starts ──► the generator has received version s (`weights_recv`;
                              in a trace without receive spans, the send's end)
  swap                        ──► its engine holds it (`weights_swap`; 0 for an engine whose own workers receive
                              and swap, vLLM or SGLang: its receive holds both)
  to first generation         ──► its first group sampled at version s starts (`generate`)
  generation                  ──► its last group sampled at version s ends
  hand-off                    ──► the trainer has step s + k's groups (the end of its `wait_gate`): scoring,
                              the buffer, the take; on a step the trainer did not wait for, also the time the
                              groups sat ready

"The generator" is the one whose group of version s ended last (with several generators, the one the trainer
waited for; its links then never go backwards, as they would across generators that swap at different times).
Meanwhile the trainer does its own part (the release of the weights, k updates, its metrics). Where the chain
is longer, the trainer waits at the gate for the difference: its `wait_gate` span. `weight_chain` measures
each link per version (median over the versions whose step s + k the trainer waited for, longer than
`WAITED_S`: there the chain was the critical path; over every version when it waited on fewer than
`MIN_WAITED` steps) and names the longest. On-policy runs (k = 0) have no overlap and no chain to report.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

import msgspec

from asyncrl.telemetry.spans import Span

WAITED_S = 0.001  # a trainer gate wait longer than this: the chain was on the step's critical path
MIN_WAITED = 3  # fewer waits than this: the links' medians are over every version
SKIP_STEPS = 3  # the first steps (the pipeline filling, first compilations) are left out

LINKS: tuple[str, ...] = ("trainer's send begins", "broadcast", "swap", "to first generation", "generation",
                          "hand-off")


class WeightChain(msgspec.Struct, frozen=True):
    """Median seconds of each link (`LINKS` order) over the `waited` versions whose step the trainer waited for
    (`gate_wait_s`: its median wait over those), or over all `versions` when those are fewer than MIN_WAITED;
    `update_s`: the median `train` span."""

    max_staleness: int
    links: dict[str, float]
    versions: int
    waited: int
    gate_wait_s: float
    update_s: float

    @property
    def critical(self) -> bool:
        """Whether the trainer waited often enough for the links to be those of the critical path."""
        return self.waited >= MIN_WAITED

    @property
    def total_s(self) -> float:
        return sum(self.links.values())

    def longest(self) -> str:
        return max(self.links, key=lambda k: self.links[k])


def weight_chain(spans: Iterable[Span], max_staleness: int) -> WeightChain | None:
    """The chain of a run with `max_staleness` >= 1 from its spans; None on-policy, or when no version went
    the whole way round (no weight sync recorded, a run of a few steps)."""
    if max_staleness < 1:
        return None
    sends: dict[int, tuple[float, float]] = {}  # version -> (first start, last end) of the trainer's send
    # (generator, what, version) -> the latest end (receive, swap, generation), the first start (generation)
    last: dict[tuple[str, str, int], float] = {}
    first: dict[tuple[str, int], float] = {}
    train_end: dict[int, float] = {}
    gate: dict[int, Span] = {}
    updates: list[float] = []
    for s in spans:
        kind, role = s.kind, s.role.split("/")[0]
        if role == "trainer":
            if kind == "train":
                train_end[s.version] = s.end
                updates.append(s.duration)
            elif kind == "wait_gate":
                gate[s.version] = s
            elif kind == "weights_send":
                a, b = sends.get(s.version, (s.start, s.end))
                sends[s.version] = (min(a, s.start), max(b, s.end))
        elif role == "generator" and kind in ("weights_recv", "weights_swap", "generate"):
            key = (s.role, kind, s.version)
            last[key] = max(s.end, last.get(key, s.end))
            if kind == "generate":
                first[(s.role, s.version)] = min(s.start, first.get((s.role, s.version), s.start))
    ended: dict[int, tuple[float, str]] = {}  # version -> (the end of its last group, the generator that ran it)
    for (gen, kind, v), end in last.items():
        if kind == "generate" and end >= ended.get(v, (end, gen))[0]:
            ended[v] = (end, gen)
    rows: list[tuple[list[float], float]] = []  # per version: its links, the trainer's wait for its step
    for v in sorted(sends):
        step = v + max_staleness
        if v - 1 < SKIP_STEPS or step not in gate or v - 1 not in train_end or v not in ended:
            continue
        gen_end, gen = ended[v]
        received = last.get((gen, "weights_recv", v), sends[v][1])  # a trace without receive spans: the send's end
        swapped = last.get((gen, "weights_swap", v), received)  # vLLM / SGLang: the workers swap as they receive
        marks = [train_end[v - 1], sends[v][0], received, swapped, first[(gen, v)], gen_end, gate[step].end]
        rows.append(([b - a for a, b in zip(marks, marks[1:])], gate[step].duration))
    if not rows:
        return None
    waited = [r for r in rows if r[1] > WAITED_S]
    chosen = waited if len(waited) >= MIN_WAITED else rows
    links = {name: statistics.median(r[0][i] for r in chosen) for i, name in enumerate(LINKS)}
    return WeightChain(max_staleness=max_staleness, links=links, versions=len(rows), waited=len(waited),
                       gate_wait_s=statistics.median(r[1] for r in waited) if waited else 0.0,
                       update_s=statistics.median(updates[SKIP_STEPS:] or updates))


def chain_lines(chain: WeightChain) -> list[str]:
    """report.md's section: a table of the links and one line saying what it means."""
    k = chain.max_staleness
    total = chain.total_s
    lines = [f"## The weight-version chain (max_staleness {k})", "",
             f"From the end of the update that made version s to the trainer holding step s + {k}'s groups "
             f"(docs/observability.md, \"The weight-version chain\"); median over "
             + (f"the {chain.waited} of {chain.versions} versions whose step the trainer waited for:"
                if chain.critical else f"all {chain.versions} versions:"),
             "", "| link | median ms | share |", "|---|---|---|"]
    lines += [f"| {name} | {1000 * s:.1f} | {s / total:.0%} |" if total > 0 else f"| {name} | {1000 * s:.1f} | - |"
              for name, s in chain.links.items()]
    lines += [f"| **whole chain** | **{1000 * total:.1f}** | |", ""]
    if chain.critical:
        lines.append(f"The trainer waited for its groups on {chain.waited} of {chain.versions} steps (median "
                     f"{1000 * chain.gate_wait_s:.1f} ms; update {1000 * chain.update_s:.1f} ms): the chain sets the "
                     f"pace there, and its longest link is {chain.longest()}. A larger max_staleness gives it one "
                     f"more update of slack each (at the price of older samples).")
    else:
        waits = f"waited for its groups on only {chain.waited} of {chain.versions} steps" if chain.waited else \
            "never waited for its groups"
        lines.append(f"The trainer {waits} (update {1000 * chain.update_s:.1f} ms): the chain "
                     f"is off the critical path"
                     + (f"; max_staleness {k - 1} might keep the same pace with fresher samples." if k > 1 else "."))
    return lines
