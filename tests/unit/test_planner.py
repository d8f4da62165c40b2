"""The planner: calibration from a run directory's spans, the simulation against the closed forms,
and the recommendation rule."""

import pytest

from asyncrl.planner import Costs, Prediction, Setting, calibrate, closed_form, plan, recommend, simulate
from asyncrl.telemetry.metrics import MetricsWriter
from asyncrl.telemetry.spans import Span
from asyncrl.telemetry.trace import TraceWriter


def costs(**kw):
    base = dict(gen_a=0.5, gen_b=0.0, train_s=1.0, send_s=0.0, swap_s=0.0, overhead_s=0.0, score_s=0.0,
                num_scorers=1, contention=1.0, contention_measured=False, cores=2.0, threads=1,
                prompts_per_step=4, group_size=2, concurrency=4)
    return Costs(**{**base, **kw})


def test_on_policy_simulation_matches_its_closed_form_and_is_never_stale():
    c = costs(gen_a=0.3, gen_b=0.05, send_s=0.1, swap_s=0.05, overhead_s=0.02, score_s=0.01)
    p = simulate(c, Setting(1, 0), steps=20)
    assert p.staleness_hist == {0: 1.0}
    assert p.samples_per_s == pytest.approx(closed_form(c, Setting(1, 0)), rel=0.02)


def test_async_hides_the_faster_phase_behind_the_slower_one():
    c = costs(gen_a=0.5, train_s=1.0)  # 4 groups at once take 0.5 s; training 1 s
    sync = simulate(c, Setting(1, 0), steps=40)
    async_ = simulate(c, Setting(1, 1), steps=40)
    assert sync.step_s == pytest.approx(1.5, rel=0.01)
    assert async_.step_s == pytest.approx(1.0, rel=0.03)       # generation fully overlapped
    assert async_.trainer_busy == pytest.approx(1.0, rel=0.03)
    assert 0.9 < async_.staleness_mean <= 1.0                  # generators run one version ahead


def test_contention_slows_both_phases_when_they_overlap():
    free = simulate(costs(contention=1.0), Setting(1, 1), steps=30)
    shared = simulate(costs(contention=1.5), Setting(1, 1), steps=30)
    assert free.step_s == pytest.approx(1.0, rel=0.03)
    # generation (0.5 s alone) takes 0.75 s beside training, which does 0.5 s of its work meanwhile,
    # then the remaining 0.5 s alone: 1.25 s per step instead of 1.0
    assert shared.step_s == pytest.approx(1.25, rel=0.03)


def test_staleness_never_exceeds_the_bound_and_reaches_it_when_training_is_slow():
    c = costs(gen_a=0.05, train_s=1.0)
    for k in (1, 2, 4):
        p = simulate(c, Setting(2, k), steps=30)
        assert max(p.staleness_hist) == k


def test_batching_curve_makes_more_concurrency_pay_off():
    # per-group time a + b·m: with a dominant intercept, 4 in flight finish ~4x faster than 1 at a time
    c = costs(gen_a=1.0, gen_b=0.1, train_s=0.01)
    wide = simulate(c, Setting(1, 1), steps=10)
    narrow = simulate(costs(gen_a=1.0, gen_b=0.1, train_s=0.01, concurrency=1), Setting(1, 1), steps=10)
    assert wide.samples_per_s > 2.5 * narrow.samples_per_s


def test_recommend_prefers_lower_staleness_among_near_ties():
    def pred(g, k, sps, stale):
        return Prediction(setting=Setting(g, k), samples_per_s=sps, closed_form_samples_per_s=sps, step_s=1.0,
                          generator_busy=0.5, trainer_busy=0.5, staleness_mean=stale, staleness_hist={})
    preds = [pred(1, 0, 80.0, 0.0), pred(1, 1, 100.0, 1.0), pred(1, 2, 101.0, 1.9), pred(2, 1, 99.5, 1.0)]
    assert recommend(preds).setting == Setting(1, 1)


def write_run(run_dir, n_steps=6):
    """A synthetic on-policy run: each step 4 groups generated together (0.4 s), then 1 s of training."""
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(
        "[rollout]\ngroup_size = 2\nconcurrency = 4\n[trainer]\nprompts_per_step = 4\n"
        "[cluster]\ntorch_threads = 1\n[reward]\nnum_scorers = 1\n[staleness]\nmax_staleness = 0\n")
    trace = TraceWriter(run_dir / "trace.json", origin=0.0)
    t = 0.0
    with MetricsWriter(run_dir / "metrics.jsonl") as writer:
        for step in range(n_steps):
            in_flight = 1 + step % 4        # vary the batch so the batching curve can be fitted
            gen_s = 0.2 + 0.05 * in_flight  # a = 0.2, b = 0.05
            spans = [Span(role="generator/0", kind="generate", start=t, end=t + gen_s, version=step)
                     for _ in range(in_flight)]
            spans.append(Span(role="trainer", kind="wait_gate", start=t, end=t + gen_s, version=step))
            spans.append(Span(role="trainer", kind="train", start=t + gen_s, end=t + gen_s + 1.0, version=step))
            spans.append(Span(role="trainer", kind="weights_send", start=t + gen_s + 1.0, end=t + gen_s + 1.1,
                              version=step + 1))
            trace.add_spans(spans)
            t_end = t + gen_s + 1.2
            writer.write({"step": step + 1, "time/elapsed_s": t_end, "time/step_s": t_end - t,
                          "reward/mean": 0.5, "trainer/samples": 8})
            t = t_end
    trace.close()


def test_calibrate_recovers_the_costs_of_a_synthetic_run(tmp_path):
    write_run(tmp_path / "run")
    c = calibrate(tmp_path / "run", cores=2)
    assert c.gen_a == pytest.approx(0.2, abs=1e-6) and c.gen_b == pytest.approx(0.05, abs=1e-6)
    assert c.train_s == pytest.approx(1.0) and c.send_s == pytest.approx(0.1)
    assert c.overhead_s == pytest.approx(0.1, abs=1e-6)
    assert (c.prompts_per_step, c.group_size, c.concurrency, c.steps) == (4, 2, 4, 6)
    assert not c.contention_measured and c.contention == 1.0  # on-policy: nothing overlapped
    preds = plan(c, [1, 2], [0, 1], steps=6)
    assert [p.setting for p in preds] == [Setting(1, 0), Setting(1, 1), Setting(2, 0), Setting(2, 1)]


def test_calibrate_names_the_missing_file(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match="trace.json"):
        calibrate(tmp_path / "run")


def test_contention_is_fitted_so_the_simulation_reproduces_the_calibration_run():
    from asyncrl.planner import fit_contention

    c = costs()
    target = simulate(costs(contention=1.7), Setting(1, 1), steps=20).samples_per_s
    assert fit_contention(c, Setting(1, 1), target, steps=20) == pytest.approx(1.7, rel=1e-3)
    assert fit_contention(c, Setting(1, 1), 10 * target, steps=20) == 1.0   # faster than possible: no slowdown
    assert fit_contention(c, Setting(1, 1), target / 100, steps=20) == 4.0  # capped


def test_mean_in_flight_integrates_the_running_count_over_each_span():
    from asyncrl.planner import _mean_in_flight

    spans = [Span(role="generator/0", kind="generate", start=s, end=e) for s, e in ((0, 2), (1, 2), (3, 4))]
    assert _mean_in_flight(spans) == [1.5, 2.0, 1.0]
