"""The planner: calibration from a run directory's spans, the simulation against the closed forms,
and the recommendation rule."""

import pytest

from asyncrl.planning.planner import Costs, Prediction, Setting, calibrate, closed_form, plan, recommend, simulate
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


def start_run(run_dir):
    """A run directory with the synthetic runs' config (4 prompts x 2 samples, on-policy) and its trace."""
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(
        '[model]\npath = "runs/models/tiny"\n'
        "[rollout]\ngroup_size = 2\nconcurrency = 4\n[trainer]\nprompts_per_step = 4\n"
        "[cluster]\ntorch_threads = 1\n[reward]\nnum_scorers = 1\n[staleness]\nmax_staleness = 0\n")
    return TraceWriter(run_dir / "trace.json", origin=0.0)


def write_run(run_dir, n_steps=6):
    """A synthetic on-policy run: each step 4 groups generated together (0.4 s), then 1 s of training."""
    trace = start_run(run_dir)
    t = 0.0
    with MetricsWriter(run_dir / "metrics.jsonl") as writer:
        for step in range(n_steps):
            in_flight = 1 + step % 4        # vary the batch so the batching curve can be fitted
            gen_s = 0.2 + 0.05 * in_flight  # a = 0.2, b = 0.05
            spans = [Span(role="generator/0", kind="generate", start=t, end=t + gen_s, version=step)
                     for _ in range(in_flight)]
            # process CPU: the gate phase computed 40% of its wall time, training all of it
            spans.append(Span(role="trainer", kind="wait_gate", start=t, end=t + gen_s, version=step,
                              cpu_s=0.4 * gen_s))
            spans.append(Span(role="trainer", kind="train", start=t + gen_s, end=t + gen_s + 1.0, version=step,
                              cpu_s=1.0))
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
    from asyncrl.planning.planner import fit_contention, steady_throughput

    c = costs()
    # the throughput as a run's is measured: without its first 3 steps
    target = steady_throughput(costs(contention=1.7), Setting(1, 1), steps=20)
    assert fit_contention(c, Setting(1, 1), target, steps=20) == pytest.approx(1.7, rel=1e-3)
    assert fit_contention(c, Setting(1, 1), 10 * target, steps=20) == 1.0   # faster than possible: no slowdown
    assert fit_contention(c, Setting(1, 1), target / 100, steps=20) == 4.0  # capped


def test_mean_in_flight_integrates_the_running_count_over_each_span():
    from asyncrl.planning.planner import _mean_in_flight

    spans = [Span(role="generator/0", kind="generate", start=s, end=e) for s, e in ((0, 2), (1, 2), (3, 4))]
    assert _mean_in_flight(spans) == [1.5, 2.0, 1.0]


def test_one_interpreter_lock_turns_overlap_into_taking_turns():
    # in process every role shares one interpreter lock: capacity 1 core, whatever the machine has
    c = costs(gen_a=0.5, train_s=1.0, cores=2.0)
    apart = simulate(c, Setting(1, 1), steps=40)
    shared = simulate(costs(gen_a=0.5, train_s=1.0, cores=2.0, shared_interpreter=True), Setting(1, 1), steps=40)
    assert apart.step_s == pytest.approx(1.0, rel=0.03)
    # generation (0.5 s) at half speed beside training: both progress 0.5 s of work in 1 s, then the
    # remaining 0.5 s of training alone — the same 1.5 s as generating and training in turn
    assert shared.step_s == pytest.approx(1.5, rel=0.03)
    cf = closed_form(costs(gen_a=0.5, train_s=1.0, cores=2.0, shared_interpreter=True), Setting(1, 1))
    assert cf == pytest.approx(shared.samples_per_s, rel=0.03)


def test_a_second_generator_adds_capacity_only_with_cores_of_its_own():
    # generation-bound (2 slots per generator, 4 groups per step, training almost free)
    def sps(g, shared):
        c = costs(gen_a=1.0, train_s=0.01, concurrency=2, cores=2.0, shared_interpreter=shared)
        return simulate(c, Setting(g, 1), steps=20).samples_per_s

    assert sps(2, shared=False) == pytest.approx(2 * sps(1, shared=False), rel=0.1)
    assert sps(2, shared=True) == pytest.approx(sps(1, shared=True), rel=0.05)


def test_generators_pinned_beside_the_trainer_share_their_cores_and_not_the_trainers():
    """Pinned (the automatic affinity with k >= 1: the trainer on cores of its own, the generators on the rest),
    a second generator on the one core beside the trainer adds no capacity and halves each generator's speed,
    while training is slowed no more than beside the first; on-policy nothing is pinned (the old model)."""
    def sps(g, k, gen_cores):
        c = costs(gen_a=1.0, train_s=0.01, concurrency=2, cores=2.0, gen_cores=gen_cores)
        return simulate(c, Setting(g, k), steps=20).samples_per_s

    assert sps(2, 1, gen_cores=1.0) == pytest.approx(sps(1, 1, gen_cores=1.0), rel=0.05)  # no capacity added
    assert sps(2, 1, gen_cores=0.0) == pytest.approx(2 * sps(1, 1, gen_cores=0.0), rel=0.1)  # not pinned: 2x
    assert sps(2, 0, gen_cores=1.0) == pytest.approx(sps(2, 0, gen_cores=0.0))  # k = 0 is never pinned
    # training-bound: the trainer's slowdown beside generation is the calibration run's, one generator or two
    def step(g):
        c = costs(gen_a=0.1, train_s=1.0, contention=1.5, contention_measured=True, gen_cores=1.0)
        return simulate(c, Setting(g, 2), steps=20).step_s

    assert step(2) == pytest.approx(step(1), rel=0.05)


def test_the_shared_cores_cpu_a_step_is_a_floor_under_a_pinned_step():
    """Pinned, the generators and the buffer did roles_cpu_s of CPU a step on the one core beside the trainer, the
    driver driver_cpu_s: with G generators a step takes at least (G·roles_cpu_s + driver_cpu_s) / core, however
    fast generation and training alone would be; on-policy (not pinned) no floor."""
    c = costs(gen_a=0.01, train_s=0.05, gen_cores=1.0, roles_cpu_s=0.04, driver_cpu_s=0.01)
    assert simulate(c, Setting(1, 1), steps=20).step_s == pytest.approx(0.05, rel=0.05)  # training-bound
    assert simulate(c, Setting(2, 1), steps=20).step_s == pytest.approx(2 * 0.04 + 0.01, rel=0.01)  # the floor
    assert simulate(c, Setting(2, 0), steps=20).step_s < 0.09  # on-policy: floating, no floor


def test_calibrate_reads_each_processs_cpu_a_step_from_the_rows():
    from asyncrl.planning.planner import _cpu_per_step

    rows = [{"time/step_s": 0.1, "generator/cpu_cores": 0.5, "buffer/cpu_cores": 0.25, "controller/cpu_cores": 0.1}
            for _ in range(8)]
    assert _cpu_per_step(rows, ("generator", "buffer")) == pytest.approx(0.075)
    assert _cpu_per_step(rows, ("controller",)) == pytest.approx(0.01)
    assert _cpu_per_step([{"time/step_s": 0.1}] * 8, ("generator",)) == 0.0  # an older or in-process run


def test_calibrate_reads_the_cores_the_generators_were_pinned_to(tmp_path):
    import json

    from asyncrl.planning.planner import _pinned_generator_cores

    def placement(rows=None, **cpus):
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        where = {role.replace("_", " "): {"cpus": c, "pid": 1} for role, c in cpus.items()}
        (run / "placement.json").write_text(json.dumps(where))
        return _pinned_generator_cores(run, rows)

    assert placement(trainer=[1], buffer=[0], generator_0=[0], generator_1=[0]) == 1.0
    assert placement(trainer=[2, 3], buffer=[0, 1], generator_0=[0, 1]) == 2.0
    assert placement(trainer=[0, 1], buffer=[0, 1], generator_0=[0, 1]) == 0.0  # floating: not pinned
    assert placement(trainer=[0, 1], buffer=[0], generator_0=[0]) == 0.0  # the trainer shares the generator's
    assert _pinned_generator_cores(tmp_path / "no-such-run") == 0.0  # no placement.json: an older or local run
    # the trainer's tuner kept its own core (trainer/cpus 1), or spread over both: then nothing is apart
    assert placement([{"trainer/cpus": 2.0}, {"trainer/cpus": 1.0}], trainer=[1], generator_0=[0]) == 1.0
    assert placement([{"trainer/cpus": 1.0}, {"trainer/cpus": 2.0}], trainer=[1], generator_0=[0]) == 0.0


def test_calibrate_marks_an_in_process_run_and_keeps_its_alone_costs(tmp_path):
    from asyncrl.planning.planner import measure_cpu_shares

    write_run(tmp_path / "run")
    c = calibrate(tmp_path / "run", cores=2, shared_interpreter=True)
    assert c.shared_interpreter and not c.contention_measured
    assert c.gate_cpu_share == 1.0 and c.train_cpu_share == 1.0  # CPU shares are opt-in
    # the trainer's spans carried process CPU seconds (through trace.json): in process, every role's
    assert measure_cpu_shares(tmp_path / "run") == pytest.approx((0.4, 1.0))
    shares = calibrate(tmp_path / "run", cores=2, shared_interpreter=True, cpu_shares=True)
    assert shares.gate_cpu_share == pytest.approx(0.4) and shares.train_cpu_share == pytest.approx(1.0)
    # in processes of their own the trainer's process saw only its own CPU: not a measure of the others
    apart = calibrate(tmp_path / "run", cores=2, shared_interpreter=False, cpu_shares=True)
    assert apart.gate_cpu_share == 1.0 and apart.train_cpu_share == 1.0
    # on-policy: nothing overlapped, so no slowdown is divided out of the measured spans
    assert c.train_s == pytest.approx(1.0) and c.gen_a == pytest.approx(0.2, abs=1e-6)


def test_measured_throughput_leaves_out_the_warm_up_steps(tmp_path):
    from asyncrl.planning.planner import measured_throughput

    with MetricsWriter(tmp_path / "metrics.jsonl") as writer:
        writer.write({"step": 0, "eval/greedy_reward": 0.1})  # evaluation-only row: not a train step
        for step, seconds in enumerate([2.0, 1.0, 1.0, 1.0], start=1):
            writer.write({"step": step, "time/step_s": seconds, "reward/mean": 0.5, "trainer/samples": 8})
    assert measured_throughput(tmp_path) == pytest.approx(32 / 5.0)
    assert measured_throughput(tmp_path, skip=1) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="cannot skip 4"):
        measured_throughput(tmp_path, skip=4)


def _validation_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_validation.py"
    spec = importlib.util.spec_from_file_location("planner_validation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validation_pools_the_rounds_of_a_setting_without_their_warm_up(tmp_path):
    script = _validation_script()
    for name, seconds in (("round-1", [3.0, 1.0, 1.0]), ("round-2", [3.0, 2.0, 2.0])):
        (tmp_path / name / "point").mkdir(parents=True)
        (tmp_path / name / "sweep.json").write_text("[]")
        with MetricsWriter(tmp_path / name / "point" / "metrics.jsonl") as writer:
            for step, s in enumerate(seconds, start=1):
                writer.write({"step": step, "time/step_s": s, "reward/mean": 0.5, "trainer/samples": 6})
    # rounds in numeric order; each run leaves out its first step: 4 steps x 6 samples in 1+1+2+2 s
    assert script.sweep_dirs(tmp_path) == [tmp_path / "round-1", tmp_path / "round-2"]
    runs = [d / "point" for d in script.sweep_dirs(tmp_path)]
    assert script.pooled_throughput(runs, skip=1) == pytest.approx(24 / 6.0)
    with pytest.raises(SystemExit, match="cannot leave out 3"):
        script.pooled_throughput(runs, skip=3)
    with pytest.raises(SystemExit, match="not a validation sweep"):
        script.sweep_dirs(tmp_path / "round-1" / "point")


def test_a_phase_that_mostly_waits_overlaps_training_almost_for_free():
    # in process: generation + scoring computes 30% of its 0.5 s, training all of its 1 s
    c = costs(gen_a=0.5, train_s=1.0, cores=2.0, shared_interpreter=True, gate_cpu_share=0.3)
    p = simulate(c, Setting(1, 1), steps=40)
    # both want 1.3 cores of the one: each at 1/1.3 while they overlap — generation ends after 0.65 s,
    # training has done 0.5 s of its work then and does the other 0.5 s alone: 1.15 s per step (1.5 in turns)
    assert p.step_s == pytest.approx(1.15, rel=0.03)
    assert closed_form(c, Setting(1, 1)) == pytest.approx(p.samples_per_s, rel=0.03)


def test_span_cpu_seconds_survive_the_trace_round_trip():
    from asyncrl.telemetry.spans import SpanRecorder, chrome_trace_events
    from asyncrl.telemetry.trace import spans_from_trace

    rec = SpanRecorder("trainer")
    rec.record("train", 1.0, 2.0, 3, cpu_s=0.75)
    rec.record("wait_gate", 0.0, 1.0, 3)  # not measured
    back = spans_from_trace(chrome_trace_events(rec.drain()))
    assert [(s.kind, s.version, s.cpu_s) for s in back] == [("train", 3, 0.75), ("wait_gate", 3, -1.0)]


def test_a_spread_of_step_times_makes_k1_wait_on_the_gate_and_k2_absorbs_it():
    # generation nearly as long as training; each step 0.7x or 1.3x its median at random
    steady = costs(gen_a=0.9, train_s=1.0)
    jittery = costs(gen_a=0.9, train_s=1.0, train_jitter=[0.7, 1.3], gen_jitter=[0.7, 1.3])
    assert simulate(steady, Setting(1, 1), steps=60).step_s == pytest.approx(1.0, rel=0.03)
    k1 = simulate(jittery, Setting(1, 1), steps=60)
    k2 = simulate(jittery, Setting(1, 2), steps=60)
    # a slow generation beside a fast update leaves the trainer waiting with k = 1; a second version of
    # slack lets the generator make it up, so k = 2 gets (nearly) the mean train time back
    assert k1.step_s > 1.05 and k2.step_s < k1.step_s - 0.03
    assert k2.step_s == pytest.approx(1.0, rel=0.04)
    # the same seeds every call: predictions repeat exactly
    assert simulate(jittery, Setting(1, 1), steps=60) == k1


def write_jittery_run(run_dir, train_s, handoff):
    """An on-policy run: 4 groups generated together in 0.4 s, `handoff` s before the trainer has them,
    then train_s[step] of training."""
    trace = start_run(run_dir)
    t = 0.0
    with MetricsWriter(run_dir / "metrics.jsonl") as writer:
        for step, train in enumerate(train_s):
            spans = [Span(role="generator/0", kind="generate", start=t, end=t + 0.4, version=step) for _ in range(4)]
            wait_end = t + 0.4 + handoff
            spans.append(Span(role="trainer", kind="wait_gate", start=t, end=wait_end, version=step))
            spans.append(Span(role="trainer", kind="train", start=wait_end, end=wait_end + train, version=step))
            trace.add_spans(spans)
            t_end = wait_end + train
            writer.write({"step": step + 1, "time/elapsed_s": t_end, "time/step_s": t_end - t,
                          "reward/mean": 0.5, "trainer/samples": 8})
            t = t_end
    trace.close()


def test_calibrate_measures_the_hand_off_and_the_spread_of_an_on_policy_run(tmp_path):
    train = [3.0, 3.0, 3.0, 0.8, 1.0, 1.2, 1.0, 0.8, 1.2, 1.0]  # the first 3 (warm-up) are left out
    write_jittery_run(tmp_path / "run", train, handoff=0.15)
    c = calibrate(tmp_path / "run", cores=2)
    assert c.handoff_s == pytest.approx(0.15, abs=1e-6)
    assert c.train_s == pytest.approx(1.0) and sorted(c.train_jitter) == [0.8, 0.8, 1.0, 1.0, 1.0, 1.2, 1.2]
    assert c.gen_jitter == [1.0] * 7  # every version's groups took what the batching fit says
    # the on-policy step the model rebuilds: 0.4 generation + 0.15 hand-off + 1.0 mean training
    p = simulate(c, Setting(1, 0), steps=40)
    assert p.step_s == pytest.approx(1.55, rel=0.03)
    assert closed_form(c, Setting(1, 0)) == pytest.approx(8 / 1.55, rel=0.01)
