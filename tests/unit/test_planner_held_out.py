"""The planner on settings it never saw, checked against real runs stored as fixtures (no Ray): calibrated on
the asynchronous run of a workload, it predicts that run within 10% (SELF) and each of the workload's other
recorded runs within 15% (HELD_OUT). Every run under tests/fixtures/planner_* is a case of
`test_each_recorded_run_is_predicted_within_the_stated_tolerance`, and a test fails when one is not; a case
that misses the tolerance is a strict xfail whose reason gives its measured error (so it fails, too, the day
it starts to pass). The runs were recorded on Ray, 2 CPUs (tests/e2e/test_planner_accuracy.py re-measures
them and can write them again: ASYNCRL_PLANNER_FIXTURES=DIR).

  first_digit  examples/first_digit (the README's run: 1 generator, k = 1, evaluation every 10 steps),
               30 steps: g<G>_k<K> = G generators, max_staleness K. Recorded with torch_threads = 1 and
               scorer actors, no role pinned
  first_digit_pinned
               the same, recorded with every [cluster] default (benchmarks/planner_validation.py --ray
               --generators 1,2 --max-staleness 0,1,2 --calibrate 1,1 --rounds 2 --steps 30 --set
               trainer.eval_every=10, its first round): with k >= 1 the trainer is pinned to one core, the
               generators, the buffer (hosting the scorer) and the driver to the other; each row has the
               processes' CPU (`<role>/cpu_cores`)
  first_digit_k1
               an older README run (k = 1, 24 steps), on itself only (tests/unit/test_planner_step.py
               checks what its costs are made of)
  overlap      the overlap benchmark's workload (benchmarks/overlap.py), 24 steps: k0 (synchronous), k2
  smollm       the SmolLM2-135M example at a quarter of its batch (2 prompts x 4 samples), 16 steps: k0, k1
"""

import functools
import statistics
from pathlib import Path

import msgspec
import pytest

from asyncrl.planning.planner import Costs, Setting, measured_throughput, simulate
from asyncrl.planning.planner import calibrate as calibrate_run
from asyncrl.telemetry.trace import read_trace, spans_from_trace
from tests.planner_fixture import prediction_error

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FIRST_DIGIT, OVERLAP = FIXTURES / "planner_first_digit", FIXTURES / "planner_overlap"
PINNED = FIXTURES / "planner_first_digit_pinned"
SMOLLM = FIXTURES / "planner_smollm"
SELF, HELD_OUT = 0.10, 0.15  # the stated goal (docs/observability.md, "The planner"); no case gets more


@functools.cache
def calibrate(run: Path, cores: float = 2.0) -> Costs:
    """Each fixture calibrated once per session (an asynchronous run's fit takes seconds)."""
    return calibrate_run(run, cores=cores)


def case(calibration: str, run: str, miss: str | None = None):
    """`run` predicted from the costs calibrated on `calibration` (both under tests/fixtures); `miss`, for a
    case known to miss its tolerance, starts with the measured error."""
    marks = () if miss is None else pytest.mark.xfail(strict=True, reason=f"measured error {miss}")
    return pytest.param(calibration, run, id=run, marks=marks)


# measured errors (predicted − measured throughput, over measured) of today's planner in the comments
CASES = [
    case("planner_first_digit/g1_k1", "planner_first_digit/g1_k1"),  # −0.0%
    case("planner_first_digit/g1_k1", "planner_first_digit/g1_k0"),  # −0.9%
    case("planner_first_digit/g1_k1", "planner_first_digit/g1_k2"),  # −7.6%
    case("planner_first_digit/g1_k1", "planner_first_digit/g2_k0"),  # +0.4%
    case("planner_first_digit/g1_k1", "planner_first_digit/g2_k1",
         "+25.1%: predicted too fast; with two generators the k = 1 chain waits more than the model has"),
    case("planner_first_digit/g1_k1", "planner_first_digit/g2_k2"),  # +7.1%
    case("planner_first_digit_pinned/g1_k1", "planner_first_digit_pinned/g1_k1"),  # −0.0%
    case("planner_first_digit_pinned/g1_k1", "planner_first_digit_pinned/g1_k0"),  # −1.0%
    case("planner_first_digit_pinned/g1_k1", "planner_first_digit_pinned/g1_k2"),  # +11.4%
    case("planner_first_digit_pinned/g1_k1", "planner_first_digit_pinned/g2_k0",
         "+36.7%: predicted too fast; a slow recorded round (the sweep's second round measured 39% more)"),
    case("planner_first_digit_pinned/g1_k1", "planner_first_digit_pinned/g2_k1",
         "+24.9%: predicted too fast; the k = 1 chain waits on the saturated generators' core more than the "
         "CPU floor says"),
    case("planner_first_digit_pinned/g1_k1", "planner_first_digit_pinned/g2_k2"),  # +9.6%
    case("planner_first_digit_k1", "planner_first_digit_k1"),  # +0.0%
    case("planner_overlap/k2", "planner_overlap/k2"),  # −0.0%
    case("planner_overlap/k2", "planner_overlap/k0"),  # +0.3%
    case("planner_smollm/k1", "planner_smollm/k1"),  # +0.0%
    case("planner_smollm/k1", "planner_smollm/k0"),  # +8.8%
]


@pytest.mark.parametrize(("calibration", "run"), CASES)
def test_each_recorded_run_is_predicted_within_the_stated_tolerance(calibration, run):
    tolerance = SELF if run == calibration else HELD_OUT
    error = prediction_error(calibrate(FIXTURES / calibration), FIXTURES / run)
    assert abs(error) <= tolerance, f"{run} from {calibration}: {error:+.1%}, tolerance {tolerance:.0%}"


def test_every_recorded_run_is_a_case():
    """A run stored under tests/fixtures/planner_* (a folder with a config.toml) that no case names would
    be left out silently; so would a case whose run is gone."""
    recorded = {str(p.parent.relative_to(FIXTURES)) for p in FIXTURES.glob("planner_*/**/config.toml")}
    assert recorded == {c.values[1] for c in CASES}
    assert all(c.values[0] in recorded for c in CASES)


def test_two_generators_pinned_to_the_core_beside_the_trainer_are_predicted_by_the_shared_core():
    """Two generators on the one core beside the trainer: each decodes at half speed, their sync is slower, and
    that core's CPU a step (the generators' and the buffer's grow with the generators) sets the step. Without
    those terms the planner saw twice the generation capacity and predicted k = 1 and 2 over 60% too fast
    (+82%, +72%); with them +25% and +10% (how they compare with the tolerance: the cases above)."""
    costs = calibrate(PINNED / "g1_k1")
    assert costs.gen_cores == 1.0 and costs.generators == 1 and costs.roles_cpu_s > costs.driver_cpu_s > 0
    floating = msgspec.structs.replace(costs, gen_cores=0.0, roles_cpu_s=0.0, driver_cpu_s=0.0)
    for run in ("g2_k1", "g2_k2"):
        assert prediction_error(floating, PINNED / run) > 0.6
        assert abs(prediction_error(costs, PINNED / run)) < prediction_error(floating, PINNED / run) / 2


def test_the_trainer_bound_real_model_run_gives_the_same_train_step_asynchronous_as_on_policy():
    # trainer-bound: T alone comes from the steps' own overlaps, as measured on-policy (2.45 s)
    assert calibrate(SMOLLM / "k1").train_s == pytest.approx(calibrate(SMOLLM / "k0").train_s, rel=0.10)


def test_the_latencies_an_on_policy_run_waits_on_are_measured_in_the_asynchronous_run():
    """The publish latency O and the hand-off H are on an on-policy step's critical path; an asynchronous
    run hides most of them, yet its generators' gate waits and the trainer's waited steps show them: about
    the values the on-policy run measures (H 0.032 s against 0.021 s: beside training the hand-off is
    slower), and without them the on-policy prediction is far too fast."""
    async_run, on_policy = calibrate(FIRST_DIGIT / "g1_k1"), calibrate(FIRST_DIGIT / "g1_k0")
    assert 0.5 < async_run.overhead_s / on_policy.overhead_s < 2.0
    assert 0.5 < async_run.handoff_s / on_policy.handoff_s < 2.0
    bare = msgspec.structs.replace(async_run, overhead_s=0.0, handoff_s=0.0)
    measured = measured_throughput(FIRST_DIGIT / "g1_k0", skip=3)
    assert simulate(bare, Setting(1, 0), 30).samples_per_s > 1.3 * measured


def test_the_train_step_alone_is_fitted_from_the_asynchronous_steps():
    """Each train step of an asynchronous run took longer the more of it ran beside generation; the line
    through (overlapped seconds, duration) gives the step alone: within 10% of the on-policy run's train
    span, where the step's median (every step slowed by its overlap) is well above it."""
    on_policy = calibrate(FIRST_DIGIT / "g1_k0").train_s
    assert calibrate(FIRST_DIGIT / "g1_k1").train_s == pytest.approx(on_policy, rel=0.10)
    overlap_alone = calibrate(OVERLAP / "k0").train_s
    assert calibrate(OVERLAP / "k2").train_s == pytest.approx(overlap_alone, rel=0.10)
    # the median asynchronous step, slowed by the generation beside it, is well above the step alone
    assert _median_train_span(OVERLAP / "k2") > 1.1 * overlap_alone


def _median_train_span(run: Path) -> float:
    spans = spans_from_trace(read_trace(run / "trace.json"))
    return statistics.median(s.duration for s in spans if s.kind == "train")
