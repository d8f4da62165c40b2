"""The weight-version chain (asyncrl/telemetry/chain.py): each link from the spans, which versions count, and
report.md's section; on a stored run, the chain that made two generators on one core slow."""

from pathlib import Path

import pytest

from asyncrl.report import write_report
from asyncrl.telemetry.chain import LINKS, weight_chain
from asyncrl.telemetry.spans import Span
from asyncrl.telemetry.trace import TraceWriter, read_trace, spans_from_trace
from tests.unit.test_report import write_run

PINNED = Path(__file__).resolve().parents[1] / "fixtures" / "planner_first_digit_pinned"
MS = 0.001


def k1_run(steps: int = 10, *, wait_ms: float = 5.0, receive: bool = True) -> list[Span]:
    """A max_staleness-1 run of 100 ms steps: step s waits `wait_ms` for its groups until 100s ms, then trains for
    90 ms. Version s (made by step s - 1, which ended at e = 100s - 10 ms) is sent from e + 2 for 10 ms (received
    at e + 11), swapped from e + 12 to e + 20 and sampled from e + 21 to e + 60; step s + 1 has its groups at
    e + 110."""
    spans = []
    for s in range(steps + 2):
        t = 100 * MS * s
        spans += [Span(role="trainer", kind="wait_gate", start=t - wait_ms * MS, end=t, version=s),
                  Span(role="trainer", kind="train", start=t, end=t + 90 * MS, version=s)]
    for s in range(1, steps + 1):
        e = 100 * MS * s - 10 * MS  # train step s - 1's end
        spans += [Span(role="trainer", kind="weights_send", start=e + 2 * MS, end=e + 12 * MS, version=s),
                  Span(role="generator/0", kind="weights_swap", start=e + 12 * MS, end=e + 20 * MS, version=s),
                  Span(role="generator/0", kind="generate", start=e + 21 * MS, end=e + 50 * MS, version=s),
                  Span(role="generator/0", kind="generate", start=e + 25 * MS, end=e + 60 * MS, version=s)]
        if receive:
            spans.append(Span(role="generator/0", kind="weights_recv", start=e + 3 * MS, end=e + 11 * MS,
                              version=s))
    return spans


def test_each_link_of_a_chain_the_trainer_waits_for():
    chain = weight_chain(k1_run(wait_ms=5.0), max_staleness=1)
    assert chain is not None and chain.critical
    got = {name: round(s / MS, 6) for name, s in chain.links.items()}
    assert got == {"trainer's send begins": 2.0, "broadcast": 9.0, "swap": 9.0, "to first generation": 1.0,
                   "generation": 39.0, "hand-off": 50.0}
    assert list(chain.links) == list(LINKS) and chain.total_s == pytest.approx(110 * MS)
    assert chain.waited == chain.versions == 7  # versions 4..10 (steps 0-2 left out: the pipeline filling)
    assert chain.gate_wait_s == pytest.approx(5 * MS) and chain.longest() == "hand-off"


def test_without_receive_or_swap_spans_the_link_before_ends_them():
    chain = weight_chain(k1_run(receive=False), max_staleness=1)
    assert chain is not None
    assert chain.links["broadcast"] == pytest.approx(10 * MS) and chain.links["swap"] == pytest.approx(8 * MS)
    engine_swaps = weight_chain([s for s in k1_run() if s.kind != "weights_swap"], max_staleness=1)  # vLLM, SGLang
    assert engine_swaps is not None and engine_swaps.links["swap"] == 0.0
    assert engine_swaps.links["to first generation"] == pytest.approx(10 * MS)


def test_with_two_generators_the_chain_follows_the_one_whose_groups_ended_last():
    """generator/1 swaps later (e + 30) and samples from e + 35 to e + 55, before generator/0's last group ends
    (e + 60): the chain is generator/0's, and no link goes backwards as it would across the two (generator/0's
    first group, e + 21, starts before generator/1's swap ends)."""
    spans = k1_run()
    for s in range(1, 11):
        e = 100 * MS * s - 10 * MS
        spans += [Span(role="generator/1", kind="weights_recv", start=e + 3 * MS, end=e + 25 * MS, version=s),
                  Span(role="generator/1", kind="weights_swap", start=e + 25 * MS, end=e + 30 * MS, version=s),
                  Span(role="generator/1", kind="generate", start=e + 35 * MS, end=e + 55 * MS, version=s)]
    got = {name: round(x / MS, 6) for name, x in weight_chain(spans, max_staleness=1).links.items()}
    assert got == {"trainer's send begins": 2.0, "broadcast": 9.0, "swap": 9.0, "to first generation": 1.0,
                   "generation": 39.0, "hand-off": 50.0}
    later = [x for x in spans if not (x.role == "generator/0" and x.kind == "generate")]  # now generator/1 is last
    got = {name: round(x / MS, 6) for name, x in weight_chain(later, max_staleness=1).links.items()}
    assert got == {"trainer's send begins": 2.0, "broadcast": 23.0, "swap": 5.0, "to first generation": 5.0,
                   "generation": 20.0, "hand-off": 55.0}


def test_a_chain_the_trainer_never_waits_for_is_off_the_critical_path():
    chain = weight_chain(k1_run(wait_ms=0.0), max_staleness=1)
    assert chain is not None and not chain.critical and chain.waited == 0 and chain.gate_wait_s == 0.0


def test_no_chain_on_policy_or_without_a_weight_sync():
    assert weight_chain(k1_run(), max_staleness=0) is None
    assert weight_chain([s for s in k1_run() if s.kind != "weights_send"], max_staleness=1) is None


def test_two_generators_on_one_core_wait_on_their_generation():
    """The stored first_digit runs (pinned, k = 1): one generator's chain fits the update but for ~20 ms; with two
    sharing the core beside the trainer's, generation at a version takes about three times as long and the
    trainer waits several times longer."""
    one = weight_chain(spans_from_trace(read_trace(PINNED / "g1_k1" / "trace.json")), max_staleness=1)
    two = weight_chain(spans_from_trace(read_trace(PINNED / "g2_k1" / "trace.json")), max_staleness=1)
    assert one is not None and two is not None and one.critical and two.critical
    assert one.longest() == two.longest() == "generation"
    assert two.links["generation"] > 2.5 * one.links["generation"] and two.gate_wait_s > 3 * one.gate_wait_s


def test_report_has_the_chain_of_an_asynchronous_run(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path)  # max_staleness = 1
    writer = TraceWriter(tmp_path / "trace.json", origin=0.0)
    writer.add_spans(k1_run())
    writer.close()
    text = write_report(tmp_path).read_text()
    assert "## The weight-version chain (max_staleness 1)" in text
    assert "| generation | 39.0 | 35% |" in text and "| **whole chain** | **110.0** | |" in text
    assert "on 7 of 7 steps (median 5.0 ms; update 90.0 ms)" in text and "its longest link is hand-off" in text
