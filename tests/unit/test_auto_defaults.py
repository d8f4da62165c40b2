"""The automatic defaults of [cluster] (asyncrl/deploy/auto.py, asyncrl/deploy/thread_tuner.py): where the scorers
run, which role gets how many torch threads, when the roles are pinned, and the tuner that picks a thread count from
measured speed."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncrl.deploy.auto import (
    AUTO_GENERATOR_NICE,
    auto_affinity,
    available_cpus,
    decide_threads,
    local_threads,
    lower_priority,
    pin_cpus,
    resolve_ray,
    scorers_in_buffer,
    split_cores,
    thread_candidates,
    trainer_spread,
)
from asyncrl.deploy.thread_tuner import Layout, ThreadTuner, TunedUpdater, trainer_layouts


def test_the_defaults_are_automatic(make_config):
    cfg = make_config()
    assert cfg.cluster.torch_threads == "auto" and cfg.cluster.scorer_placement == "auto"
    assert cfg.cluster.auto_affinity is True
    assert make_config("cluster.torch_threads=3").cluster.torch_threads == 3  # an int is still honoured
    assert make_config('cluster.torch_threads="auto"').cluster.torch_threads == "auto"


@pytest.mark.parametrize(("overrides", "in_buffer"), [
    ((), True),                                                     # a light rule reward: in the buffer actor
    (("reward.num_scorers=2",), False),                             # scorers meant to score in parallel
    (("reward.num_scorers=2", 'reward.isolation="process"'), True),  # ... which process workers do anyway
    (({"reward": {"model": "/some/rm"}},), False),                  # a reward model: a process of its own
    (({"cluster": {"scorer_gpus": 1.0}},), False),
    (("cluster.affinity.scorer=[0]",), False),
    (('cluster.scorer_placement="actor"',), False),                 # explicit settings are honoured
    (('cluster.scorer_placement="buffer"', "reward.num_scorers=2"), True),
])
def test_scorer_placement_auto_puts_a_light_reward_in_the_buffer_actor(make_config, overrides, in_buffer):
    from asyncrl.deploy.plan import plan_resources

    cfg = _config(make_config, *overrides)
    assert scorers_in_buffer(cfg) is in_buffer
    scorers = {p.role: p.count for p in plan_resources(cfg)}["scorer"]
    assert scorers == (0 if in_buffer else cfg.reward.num_scorers)
    assert resolve_ray(cfg, [0], starts_cluster=False).cluster.scorer_placement == ("buffer" if in_buffer else "actor")


def _config(make_config, *overrides):
    """make_config with `--set` strings; a dict {section: {key: value}} is set on the loaded config instead (a
    reward model path or a GPU this machine lacks would fail the load's checks)."""
    import msgspec

    cfg = make_config(*[o for o in overrides if isinstance(o, str)])
    for o in overrides:
        if isinstance(o, dict):
            for section, values in o.items():
                cfg = msgspec.structs.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section),
                                                                                       **values)})
    return cfg


def test_split_cores_follows_the_busy_shares():
    assert split_cores(2) == (1, 1)
    assert split_cores(1) == (1, 1)                      # one core: both get it
    assert split_cores(8) == (4, 4)
    assert split_cores(8, trainer_busy=3.0, generator_busy=1.0) == (6, 2)
    assert split_cores(4, trainer_busy=1.0, generator_busy=0.0) == (3, 1)  # never below one core each
    assert split_cores(4, trainer_busy=0.0, generator_busy=1.0) == (1, 3)


def test_threads_on_policy_give_each_phase_every_core(make_config):
    cfg = make_config("staleness.max_staleness=0")
    assert decide_threads(cfg, 2, "trainer") == 2 and decide_threads(cfg, 2, "generator") == 2
    assert decide_threads(cfg, 2, "buffer") == 1 and decide_threads(cfg, 2, "scorer") == 1
    two = make_config("staleness.max_staleness=0", "rollout.num_generators=2")
    assert decide_threads(two, 8, "generator") == 4  # the generators decode at the same time: split over them
    assert decide_threads(two, 8, "trainer") == 8
    assert local_threads(cfg, 2) == 2


def test_threads_with_overlap_split_the_cores(make_config):
    cfg = make_config("staleness.max_staleness=1")
    assert decide_threads(cfg, 2, "trainer") == 1 and decide_threads(cfg, 2, "generator") == 1
    # from 4 cores on, one is left to the light roles (buffer, scorers, Controller, Ray)
    assert decide_threads(cfg, 8, "trainer") == 4 and decide_threads(cfg, 8, "generator") == 3
    assert decide_threads(cfg, 9, "trainer", trainer_busy=3, generator_busy=1) == 6
    assert decide_threads(cfg, 9, "generator", trainer_busy=3, generator_busy=1) == 2
    assert local_threads(cfg, 2) == 1
    # pinned to cores of its own (cluster.affinity): every one of them, whatever the staleness
    pinned = make_config("staleness.max_staleness=1", "cluster.affinity.trainer=[1]", "cluster.affinity.generator=[0]")
    assert decide_threads(pinned, 3, "trainer") == 3
    # an explicit count wins everywhere
    fixed = make_config("staleness.max_staleness=0", "cluster.torch_threads=1")
    assert decide_threads(fixed, 8, "trainer") == 1 and local_threads(fixed, 8) == 1
    assert thread_candidates(fixed, 8, "trainer") == [1]


def test_thread_candidates_offer_one_and_the_decided_count(make_config):
    k0 = make_config("staleness.max_staleness=0")
    assert thread_candidates(k0, 2, "trainer") == [1, 2] and thread_candidates(k0, 2, "generator") == [1, 2]
    assert thread_candidates(k0, 2, "buffer") == [1]
    assert thread_candidates(make_config("staleness.max_staleness=1"), 2, "trainer") == [1]


def test_auto_affinity_gives_the_trainer_a_core_when_the_roles_would_preempt_it(make_config):
    cfg = make_config("staleness.max_staleness=1")
    pins = auto_affinity(cfg, [0, 1])
    assert pins == {"trainer": [1], "generator": [0], "scorer": [0], "buffer": [0], "controller": [0]}
    three = auto_affinity(cfg, [0, 1, 2])  # trainer 2 of 3 cores (the split), the rest on the other
    assert three["trainer"] == [1, 2] and three["generator"] == [0]
    # no pinning: room for every role, phases that alternate, an explicit affinity, opted out, a remote cluster
    assert auto_affinity(cfg, list(range(8))) == {} and auto_affinity(cfg, list(range(4))) == {}
    assert auto_affinity(make_config("staleness.max_staleness=0"), [0, 1]) == {}
    assert auto_affinity(make_config("staleness.max_staleness=1", "cluster.affinity.trainer=[0]"), [0, 1]) == {}
    assert auto_affinity(make_config("staleness.max_staleness=1", "cluster.auto_affinity=false"), [0, 1]) == {}
    assert auto_affinity(make_config("staleness.max_staleness=1", 'cluster.address="10.0.0.1:6379"'), [0, 1]) == {}
    assert auto_affinity(_config(make_config, "staleness.max_staleness=1", {"cluster": {"trainer_gpus": 1.0}}),
                         [0, 1]) == {}
    # explicit threads that overfill the cores are pinned too
    assert auto_affinity(make_config("staleness.max_staleness=1", "cluster.torch_threads=1"), [0, 1])["trainer"] == [1]
    resolved = resolve_ray(cfg, [0, 1])
    assert resolved.cluster.affinity.trainer == [1] and resolved.cluster.affinity.controller == [0]
    assert resolve_ray(cfg, [0, 1], starts_cluster=False).cluster.affinity.trainer == []  # a joined cluster
    # after pinning, each role's process sees its own cores: one thread each on two
    assert decide_threads(resolved, 1, "trainer") == 1 and decide_threads(resolved, 1, "generator") == 1


def test_generators_pinned_beside_the_light_roles_run_at_a_lower_priority(make_config, monkeypatch):
    cfg = make_config("staleness.max_staleness=1")
    assert cfg.cluster.generator_nice == "auto"
    assert resolve_ray(cfg, [0, 1]).cluster.generator_nice == AUTO_GENERATOR_NICE  # pinned beside them
    assert resolve_ray(cfg, list(range(8))).cluster.generator_nice == 0  # room for every role: nothing pinned
    assert resolve_ray(cfg, [0, 1], starts_cluster=False).cluster.generator_nice == 0  # a joined cluster
    assert resolve_ray(make_config("staleness.max_staleness=1", "cluster.generator_nice=3"),
                       list(range(8))).cluster.generator_nice == 3  # an int is kept whatever the placement
    added: list[int] = []
    monkeypatch.setattr("asyncrl.deploy.auto.os.nice", lambda n: added.append(n) or n)
    resolved = resolve_ray(cfg, [0, 1])
    assert [lower_priority(resolved, kind) for kind in ("trainer", "buffer", "generator")] == [0, 0, 10]
    assert lower_priority(cfg, "generator") == 0  # unresolved "auto" (no Ray driver decided it): unchanged
    assert added == [10]


def test_thread_tuner_alternates_the_candidates_then_keeps_the_faster():
    speed = {1: 1.0, 2: 0.6}  # seconds per unit
    tuner = ThreadTuner([2, 1], window=2, windows=2, skip=1)
    seen = []
    for _ in range(1 + 2 * 2 * 2):
        seen.append(tuner.current)
        tuner.record(speed[tuner.current] * 10, units=10)
    assert seen == [1, 1, 1, 2, 2, 1, 1, 2, 2]  # warm-up, then windows of 2 in turn
    assert tuner.chosen == 2 and tuner.current == 2
    assert tuner.seconds_per_unit() == {1: pytest.approx(1.0), 2: pytest.approx(0.6)}
    slow_two = ThreadTuner([1, 2], window=1, windows=3, skip=0)
    while slow_two.chosen is None:
        slow_two.record(0.4 if slow_two.current == 2 else 0.3)
    assert slow_two.chosen == 1
    assert ThreadTuner([3]).chosen == 3  # one candidate: nothing to measure
    with pytest.raises(ValueError):
        ThreadTuner([0, 2])


def test_tuned_updater_runs_each_update_with_the_tuners_threads_on_its_own_thread():
    class Learner:
        version = 7

        def __init__(self):
            self.threads = []

        def update(self, groups):
            self.threads.append(torch.get_num_threads())
            return {"trainer/loss": 0.5}

    learner = Learner()
    tuned = TunedUpdater(learner, ThreadTuner([1, 2], window=1, windows=2, skip=0))
    before = torch.get_num_threads()
    rows = []
    for _ in range(5):  # a worker thread per update, as asyncio.to_thread may give
        t = threading.Thread(target=lambda: rows.append(tuned.update([])))
        t.start()
        t.join()
    assert learner.threads[:4] == [1, 2, 1, 2]
    assert [r["trainer/torch_threads"] for r in rows] == [float(n) for n in learner.threads]
    assert rows[0]["trainer/loss"] == 0.5 and tuned.version == 7  # the learner's attributes pass through
    assert torch.get_num_threads() == before  # the caller's own thread is left alone


def test_a_trainer_the_automatic_affinity_pinned_may_also_try_every_core(make_config):
    """Pinned by the automatic affinity (not by the user), the trainer's tuner gets one more layout: every CPU of
    the run, with as many threads (or the explicit torch_threads)."""
    cfg = make_config("staleness.max_staleness=1")
    assert trainer_spread(cfg, resolve_ray(cfg, [0, 1])) == [0, 1]
    assert trainer_spread(cfg, resolve_ray(cfg, [0, 1, 2])) == [0, 1, 2]
    assert trainer_spread(cfg, resolve_ray(cfg, list(range(8)))) == []  # room for every role: nothing pinned
    user = make_config("staleness.max_staleness=1", "cluster.affinity.trainer=[1]", "cluster.affinity.generator=[0]")
    assert trainer_spread(user, resolve_ray(user, [0, 1])) == []  # the user's pins are kept as they are
    on_policy = make_config("staleness.max_staleness=0")
    assert trainer_spread(on_policy, resolve_ray(on_policy, [0, 1])) == []
    ranks = make_config("staleness.max_staleness=1", "trainer.num_ranks=2")
    assert trainer_spread(ranks, resolve_ray(ranks, [0, 1])) == []
    assert trainer_layouts([1], [1], [0, 1]) == [Layout(1, (1,)), Layout(2, (0, 1))]
    assert trainer_layouts([2], [1], [0, 1], fixed=2) == [Layout(2, (1,)), Layout(2, (0, 1))]
    assert trainer_layouts([1, 2], [0, 1], []) == [1, 2]  # not pinned: thread counts only
    assert trainer_layouts([1], [0, 1], [0, 1]) == [1]  # already on every core


def test_a_decisive_tuner_stops_once_one_candidate_is_clearly_slower():
    """`decisive`: after one window of each, the slowest one's quickest unit at that multiple of the fastest's ends
    the measuring (an outlier such as an evaluation step does not decide it); closer than that, every window runs."""
    tuner = ThreadTuner([1, 2], window=2, windows=3, skip=0, decisive=1.3)
    for seconds in (10.0, 30.0, 6.0, 6.5):  # 1: its quickest 10 s (30: an evaluation); 2: 6 s
        tuner.record(seconds)
    assert tuner.chosen == 2
    close = ThreadTuner([1, 2], window=2, windows=3, skip=0, decisive=1.3)
    for seconds in (10.0, 11.0, 8.0, 9.0):
        close.record(seconds)
    assert close.chosen is None  # 1.25x: the other windows run
    while close.chosen is None:
        close.record(10.0 if close.current == 1 else 8.0)
    assert close.chosen == 2 and len(close.samples[1]) == 6


@pytest.mark.skipif(len(available_cpus()) < 2, reason="one CPU: no layout to move to")
def test_tuned_updater_judges_layouts_by_the_steps_pace_and_pins_the_process(monkeypatch):
    """Layout candidates: before each update the process is pinned to the layout's CPUs; per_step, the tuner is
    given the time from one update's start to the next (the step the layout ran), not the update alone."""
    cpus = available_cpus()
    home, every = Layout(1, (cpus[-1],)), Layout(len(cpus), tuple(cpus))
    clock = iter([0.0, 0.1, 10.0, 10.1, 16.0, 16.1, 26.0, 26.1, 32.0, 32.1])  # two perf_counter calls an update
    monkeypatch.setattr("asyncrl.deploy.thread_tuner.time.perf_counter", lambda: next(clock))

    class Learner:
        def update(self, groups):
            return {"trainer/loss": 0.5}

    try:
        tuned = TunedUpdater(Learner(), ThreadTuner([home, every], window=1, windows=2, skip=0), per_step=True)
        first = tuned.update([])
        pinned = available_cpus()  # the process on the home layout's one core
        rows = [first, *(tuned.update([]) for _ in range(4))]
        after = available_cpus()
    finally:
        pin_cpus(cpus, "trainer")  # this test's process (every thread of it) back where it was
    # steps of 10 s on its own core and 6 s on every core: home, every, home, every, then every for good
    assert [r["trainer/cpus"] for r in rows] == [1.0, len(cpus), 1.0, len(cpus), len(cpus)]
    assert [r["trainer/torch_threads"] for r in rows] == [1.0, len(cpus), 1.0, len(cpus), len(cpus)]
    assert tuned.tuner.chosen == every and tuned.tuner.samples[home] == [10.0, 10.0]
    assert pinned == [cpus[-1]] and after == cpus


def test_a_layout_the_process_cannot_move_to_is_dropped_and_the_trainer_stays_where_it_runs(monkeypatch, caplog):
    cpus = available_cpus()
    home, elsewhere = Layout(1, tuple(cpus)), Layout(2, (max(cpus) + 1,))

    def refuse(cpus, who):
        raise RuntimeError(f"cluster.affinity.{who} = {cpus}: Invalid argument")

    monkeypatch.setattr("asyncrl.deploy.thread_tuner.pin_cpus", refuse)

    class Learner:
        def update(self, groups):
            return {"trainer/loss": 0.5}

    tuned = TunedUpdater(Learner(), ThreadTuner([elsewhere, home], window=1, windows=2, skip=0), per_step=True)
    rows = [tuned.update([]) for _ in range(3)]
    assert tuned.tuner.chosen == home and [r["trainer/cpus"] for r in rows] == [float(len(cpus))] * 3
    assert "cannot move to CPUs" in caplog.text


def test_the_native_engine_decodes_with_the_tuners_threads_and_keeps_the_faster(tmp_path):
    import asyncio

    from asyncrl.config.schema import TinyModelConfig
    from asyncrl.messages import SamplingParams
    from engines import hf
    from engines.torch_engine import TorchEngine

    hf.build_tiny_model(tmp_path, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=64))
    engine = TorchEngine(str(tmp_path), seed=0)
    tuner = ThreadTuner([1, 2], window=2, windows=2, skip=1)
    engine.scheduler.tuner = tuner
    threads_seen = []
    engine.scheduler.on_step = lambda step: threads_seen.append(torch.get_num_threads())  # on the engine's thread
    try:
        out = asyncio.run(engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=12, ignore_eos=True)))
    finally:
        asyncio.run(engine.close())
    assert all(len(c[0].response_ids) == 12 for c in out)
    assert tuner.chosen in (1, 2) and len(tuner.samples[1]) == 4 and len(tuner.samples[2]) == 4
    # each decode step ran with the count the tuner asked for: warm-up and windows of 2, then the faster one
    assert threads_seen[:9] == [1, 1, 1, 2, 2, 1, 1, 2, 2]
    assert set(threads_seen[9:]) <= {tuner.chosen} and engine.scheduler.num_threads == tuner.chosen


def test_a_compiled_trainer_keeps_the_threads_it_starts_with(make_config, monkeypatch):
    """trainer.compile: its compiled code is specialised to the thread count, so the tuner would compile the model
    again for each count it tries; the trainer is left untuned (a generator is tuned as before)."""
    from types import SimpleNamespace

    from asyncrl.deploy import actors

    monkeypatch.setattr(actors, "available_cpus", lambda: [0, 1])
    learner = object()
    for compile, tuned in ((False, True), (True, False)):
        cfg = make_config("staleness.max_staleness=0", f"trainer.compile={str(compile).lower()}")
        assert thread_candidates(cfg, 2, "trainer") == [1, 2]
        role = SimpleNamespace(pipeline=SimpleNamespace(learner=learner))
        actors.tune_threads(cfg, "trainer", role, spread=[0, 1])
        assert isinstance(role.pipeline.learner, TunedUpdater) is tuned
        assert (role.pipeline.learner is learner) is not tuned
