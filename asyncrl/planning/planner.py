"""`asyncrl plan`: predict throughput, busy shares and staleness for generator counts and staleness bounds.

Place in the dataflow: a finished run directory (trace.json spans, metrics.jsonl, config.toml) ──►
`calibrate` ──► `Costs` (measured per-group generation cost with its batching curve, per-step training,
weight-sync and controller costs, CPU contention) ──► `plan`: for each (generators, max_staleness)
setting (a closed form for the two regimes, and a discrete-event simulation of the real protocol) ──►
a table and a recommendation.

The model, in one screen:
  generation   a generator with m groups in flight finishes each at rate 1 / (a + b·m) per second
               (continuous batching: one decode step serves every sequence in flight; a, b are fitted
               to the measured generate spans against how many groups were in flight meanwhile)
  admission    the gate's rule: accepted + running < (engine version + k + 1) · P, at most `concurrency`
               groups in flight per generator
  training     step s waits for groups sP .. (s+1)P-1 (admission order), trains T seconds, then spends R
               seconds before its next take (the send's release of the weights, hand-offs): the part of
               the step serial on the trainer. Meanwhile the send takes W, every generator stops for the
               swap S, and the version is published O seconds later (the Controller, after the previous
               one). An evaluation (E seconds, every eval_every steps) starts at that publish; the next
               step waits for its end
  scoring      each scorer takes the next generated group and scores its n samples, σ seconds each;
               the group reaches the trainer H seconds later (hand-offs: put, take, publish → admit; the
               part of an on-policy run's gate wait that generation and scoring do not explain; in an
               asynchronous run, the time from a waited-for step's last group scored to the trainer's take)
  spread       each train step takes T times a factor drawn from the calibration run's train spans over
               their median, each version's generation its time times a factor drawn likewise (the
               residuals of the batching fit); a prediction is the mean of several seeded simulations.
               The spread is what makes k = 1 wait on the gate when generation is nearly as long as
               training (a slow generation can not be made up within one step) while k = 2 absorbs it
  contention   while generation, scoring or a hand-off (a group between its scoring and the trainer: one
               more role) runs beside training, all of them slow down: by f beside one such role, the value
               under which the simulation of an asynchronous calibration run reproduces its measured
               throughput (from an on-policy run f is not observable: 1); beside r roles by
               (threads + r·(f·C − threads)) / C, as if each kept f·C − threads of the C cores busy. Unless
               T alone came from the steps' own fit (below), never less than (r + 1)·threads / C for r
               roles computing with `torch_threads` threads each. In the in-process deployment every
               role shares one interpreter lock and C is 1 whatever the machine has: the Python work of
               the roles (engine scheduler, scorer, optimizer loop) serialises, so overlap buys little
               and a second generator adds no capacity (measured on a quiet machine; under other jobs'
               load the scorer's hand-offs wait for the CPU too, and overlap pays off more). Opt-in,
               r counts each role by its CPU share: in process, the process CPU seconds per wall second
               the trainer saw while it waited on the gate (generation + scoring) and while it trained
  pinning      a calibration run whose generators were pinned to cores apart from the trainer's (placement.json;
               the automatic affinity does so when generation and training overlap, k >= 1): in a setting with
               k >= 1, G generators share those cores, each slower by its threads' crowding there against the
               calibration run's (2 generators of 1 thread on the 1 core beside the trainer: 2x), and so are
               their receive, swap and the publish after them; the trainer, on its own cores, is slowed as
               beside the calibration run's generators however many there are. On-policy nothing is pinned.
               And a step takes at least the CPU seconds the calibration run's generators and buffer spent a
               step there (its rows' <role>/cpu_cores), times G over its generators, plus the driver's, over
               those cores: the shared cores saturate (first_digit, 2 cores: a second generator doubled the
               generators' CPU a step and the trainer waited)
Calibration run: on Ray an asynchronous one (k >= 1, such as the README's first run). It shows the
contention, which an on-policy run cannot; its steps give T alone (each train step's duration against the
seconds of it spent beside generation: the line's intercept); its generators' gate waits show O and the
steps the trainer waited for show H. In process an on-policy run (k = 0): every phase alone, its spans the
uncontended costs (the trainer's gate wait is generation + scoring, its train span is T); there the roles
share one interpreter lock, which the model has as capacity 1.
Staleness of a trained group = the step that trains it − the engine version it was admitted at.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from asyncrl.config import read_run_config
from asyncrl.deploy.auto import overlap_threads
from asyncrl.planning.model import (  # noqa: F401 (re-exported: the planner's public names live here too)
    REPLICATES,
    Costs,
    Prediction,
    Setting,
    _mean,
    capacity,
    closed_form,
    cpu_demand,
    overlap_slowdown,
    simulate,
    simulate_once,
)
from asyncrl.telemetry.metrics import read_metrics
from asyncrl.telemetry.spans import Span, intersection_length
from asyncrl.telemetry.summary import summarize_rows
from asyncrl.telemetry.trace import read_trace, spans_from_trace

TIE_SHARE = 0.02  # settings within 2% of the best predicted throughput count as tied
GATE_OPEN_S = 0.003  # a generation starting this soon after its generator's gate wait ended: the gate opened it
# a trainer gate wait longer than both of these waited for its groups (else they were ready: no hand-off seen)
WAITED_S, WAITED_SHARE = 0.001, 0.1
JITTER_WARMUP = 3  # first steps of a calibration run left out of T and the spread (first-call allocations)
MIN_FIT_STEPS = 8  # train steps (after warm-up) an asynchronous run needs for the per-step fit of T alone


# ---------------------------------------------------------------------------------------------
# calibration


def _median(values: Sequence[float], default: float = 0.0) -> float:
    return float(statistics.median(values)) if values else default


def _mean_in_flight(spans: list[Span]) -> list[float]:
    """For each span, the mean number of the spans (itself included) running during it: a sweep over
    the start/end points and a running integral of the count, O(n log n)."""
    points = sorted({p for s in spans for p in (s.start, s.end)})
    delta = [0] * (len(points) + 1)
    for s in spans:
        delta[bisect.bisect_left(points, s.start)] += 1
        delta[bisect.bisect_left(points, s.end)] -= 1
    integral, count = [0.0], 0  # integral[i] = ∫ count dt from points[0] to points[i]
    for i in range(1, len(points)):
        count += delta[i - 1]
        integral.append(integral[-1] + count * (points[i] - points[i - 1]))

    def at(t: float) -> float:
        return integral[bisect.bisect_left(points, t)]

    return [(at(s.end) - at(s.start)) / s.duration if s.duration > 0 else 1.0 for s in spans]


def _in_flight_fit(gen: list[Span]) -> tuple[float, float]:
    """Least-squares fit duration = a + b·m̄ over generate spans, m̄ = mean groups in flight on the
    same generator during the span (itself included). b = 0 without spread in m̄."""
    by_role: dict[str, list[Span]] = {}
    for s in gen:
        by_role.setdefault(s.role, []).append(s)
    xs, ys = [], []
    for spans in by_role.values():
        spans = [s for s in spans if s.duration > 0]
        xs += _mean_in_flight(spans)
        ys += [s.duration for s in spans]
    if not xs:
        raise ValueError("the run has no generate spans to calibrate generation from")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var < 1e-6 * len(xs):  # every group ran beside the same number of others: no batching curve
        return my, 0.0
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
    a = max(1e-6, my - b * mx)
    return a, b


def _cpu_share(spans: list[Span], shared_interpreter: bool) -> float:
    """Process CPU seconds per wall second over the trainer's `spans` that measured it: in process every
    role's CPU, so over the gate wait that is generation + scoring. 1 (all computing) when not measured,
    or when the roles ran in processes of their own (the trainer's process then saw only its own CPU)."""
    measured = [s for s in spans if s.role == "trainer" and s.cpu_s >= 0 and s.duration > 0]
    wall = sum(s.duration for s in measured)
    if not shared_interpreter or wall <= 0:
        return 1.0
    return min(1.0, max(0.05, sum(s.cpu_s for s in measured) / wall))


def measure_cpu_shares(run_dir: str | Path) -> tuple[float, float] | None:
    """(gate, train): the process CPU seconds per wall second of an in-process run while its trainer
    waited on the gate and while it trained; None if its trace has no CPU times. On a quiet machine an
    on-policy run measures about 1 for both; well below 1 flags a calibration run starved by other jobs."""
    spans = spans_from_trace(read_trace(Path(run_dir) / "trace.json"))
    if not any(s.role == "trainer" and s.cpu_s >= 0 for s in spans):
        return None
    return (_cpu_share([s for s in spans if s.kind == "wait_gate"], True),
            _cpu_share([s for s in spans if s.kind == "train"], True))


def _overlaps(span: Span, others: list[tuple[float, float]]) -> float:
    return intersection_length([(span.start, span.end)], others) / max(span.duration, 1e-12)


def calibrate(run_dir: str | Path, *, cores: float | None = None, shared_interpreter: bool = False,
              cpu_shares: bool = False) -> Costs:
    """Measure the costs of the run in `run_dir` (needs trace.json, metrics.jsonl, config.toml).
    `shared_interpreter`: the run was in-process (`--local`), every role behind one interpreter lock.
    `cpu_shares`: count each phase by the process CPU share measured with it (`measure_cpu_shares`)
    instead of as fully computing — experimental: a share below 1 can mean waiting on hand-offs (which
    overlaps for free) or being starved by other jobs (which does not), and one run cannot tell which."""
    run_dir = Path(run_dir)
    hints = {"trace.json": "calibrate from a run made with [logging] trace = true (the default)",
             "metrics.jsonl": "is it a run directory?", "config.toml": "is it a run directory?"}
    for name, hint in hints.items():
        if not (run_dir / name).exists():
            raise FileNotFoundError(f"{run_dir / name} is missing: {hint}")
    cfg = read_run_config(run_dir)
    spans = spans_from_trace(read_trace(run_dir / "trace.json"))
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    if len(rows) < 2:
        raise ValueError(f"{run_dir} has fewer than 2 train steps: too short to calibrate from")
    kind = lambda k: [s for s in spans if s.kind == k]  # noqa: E731
    gen, train = kind("generate"), kind("train")
    train_by_step = {s.version: s.duration for s in train}
    gen_iv = [(s.start, s.end) for s in gen]
    train_iv = [(s.start, s.end) for s in train]
    score = kind("score")
    cores = float(cores or os.cpu_count() or 1)
    threads = overlap_threads(cfg, int(cores))
    # Measured durations include the slowdown of whatever ran beside them; `o_*` is the mean share of
    # each kind's time spent beside the other phase, used below to take that slowdown back out.
    busy_iv = gen_iv + [(s.start, s.end) for s in score]
    o_train = _mean([_overlaps(s, busy_iv) for s in train])
    o_gen = _mean([_overlaps(s, train_iv) for s in gen])
    o_score = _mean([_overlaps(s, train_iv) for s in score])
    train_med = _median([train_by_step[k] for k in _after_warmup(train_by_step)])
    a, b = _in_flight_fit(gen)
    steps = len(rows)
    swap = [s.duration for s in kind("weights_swap")]
    # scorer seconds per sample: its busy time over the samples generated (one generate span = one group)
    scored_samples = max(1, len(gen)) * cfg.rollout.group_size
    score_per_sample = sum(s.duration for s in score) / scored_samples
    send_s, swap_s = _median([s.duration for s in kind("weights_send")]), _median(swap)
    setting = Setting(cfg.rollout.num_generators, cfg.staleness.max_staleness)
    eval_every = cfg.trainer.eval_every
    costs = Costs(
        gen_a=a, gen_b=b, train_s=train_med, send_s=send_s, swap_s=swap_s,
        overhead_s=_publish_latency(gen, train, send_s + swap_s, kind("wait_gate")),
        release_s=_release(train, kind("wait_gate"), lambda v: eval_every > 0 and v % eval_every == 0),
        eval_s=_mean([s.duration for s in kind("eval") if s.version > 0]),  # version 0: before the loop
        eval_every=eval_every,
        score_s=score_per_sample, num_scorers=cfg.reward.num_scorers,
        contention=1.0, contention_measured=False, cores=cores, threads=threads,
        shared_interpreter=shared_interpreter,
        gate_cpu_share=_cpu_share(kind("wait_gate"), shared_interpreter) if cpu_shares else 1.0,
        train_cpu_share=_cpu_share(train, shared_interpreter) if cpu_shares else 1.0,
        prompts_per_step=cfg.trainer.prompts_per_step, group_size=cfg.rollout.group_size,
        concurrency=cfg.rollout.concurrency, steps=steps, source=str(run_dir),
        gen_cores=_pinned_generator_cores(run_dir, rows) if setting.max_staleness >= 1 else 0.0,
        generators=setting.num_generators,
        roles_cpu_s=_cpu_per_step(rows, ("generator", "buffer")), driver_cpu_s=_cpu_per_step(rows, ("controller",)),
    )
    costs = msgspec.structs.replace(
        costs, train_jitter=_spread(train_by_step, train_med),
        gen_jitter=_spread({v: _median(r) for v, r in _fit_residuals(gen, a, b).items()}, 1.0),
        handoff_s=(_handoff(costs, gen, kind("wait_gate")) if setting.max_staleness == 0
                   else _handoff_async(costs, gen, kind("wait_gate"), train_med)))
    # the warm-up steps left out, as from T and the spread: the costs have no term for first-call work
    measured = summarize_rows(rows[JITTER_WARMUP:] if len(rows) > 2 * JITTER_WARMUP else rows).get(
        "throughput/samples_per_s")
    if setting.max_staleness == 0 or not measured:
        return costs  # on-policy: generation and training never overlap, contention is not observable
    # Fixed point: the costs alone depend on f (divide the slowdown out of the overlapped share), and f
    # is fitted with those costs. A few rounds settle it.
    alone_by_step = _train_alone(train, busy_iv)
    if alone_by_step:  # T from the steps themselves: each step's work alone, the overlap's cost taken out
        t_alone = _median([alone_by_step[k] for k in _after_warmup(alone_by_step)])
        costs = msgspec.structs.replace(costs, train_s=t_alone, train_jitter=_spread(alone_by_step, t_alone),
                                        train_alone_fitted=True)
    f = 1.0
    for _ in range(4):
        # the slowdown while overlapped: the fitted f, and at least the roles' share of the cores
        slow = overlap_slowdown(msgspec.structs.replace(costs, contention=f))
        # `share` is the wall share overlapped: that part did 1/slow of its work per second, the rest all
        # of it, so the work alone is value·((1 − share) + share / slow)
        alone = lambda value, share: value * ((1.0 - share) + share / slow)  # noqa: E731
        costs = msgspec.structs.replace(costs, gen_a=alone(a, o_gen), gen_b=alone(b, o_gen),
                                        score_s=alone(score_per_sample, o_score))
        if not alone_by_step:
            costs = msgspec.structs.replace(costs, train_s=alone(train_med, o_train))
        f = fit_contention(costs, setting, measured, steps)
    return msgspec.structs.replace(costs, contention=f, contention_measured=True)


def _cpu_per_step(rows: list[dict], roles: tuple[str, ...]) -> float:
    """The median over the steps (warm-up left out) of the CPU seconds `roles`' processes spent a step
    (`<role>/cpu_cores` times `time/step_s`); 0 when a row lacks them (a run in process, or an older one)."""
    keys = [f"{role}/cpu_cores" for role in roles]
    rows = rows[JITTER_WARMUP:] if len(rows) > 2 * JITTER_WARMUP else rows
    per_step = [sum(r[k] for k in keys) * r["time/step_s"] for r in rows
                if all(k in r for k in keys) and "time/step_s" in r]
    return _median(per_step) if per_step else 0.0


def _pinned_generator_cores(run_dir: Path, rows: list[dict] | None = None) -> float:
    """The cores the run's generators were pinned to apart from the trainer's (RUN_DIR/placement.json, written
    by a Ray run: each role's `cpus`); 0 when they were not pinned, shared cores with the trainer, the run
    has no placement.json (in process, or an older run), or the trainer ended on more CPUs than it started
    pinned to (`trainer/cpus` of the last row in `rows`: its tuner kept every core, asyncrl/deploy/thread_tuner.py)."""
    try:
        where = json.loads((run_dir / "placement.json").read_text())
    except (OSError, ValueError):
        return 0.0
    cpus = lambda prefix: {c for role, w in where.items() if role.startswith(prefix) for c in w.get("cpus") or []}  # noqa: E731
    generators, trainer = cpus("generator"), cpus("trainer")
    everything = cpus("")
    if not generators or not trainer or generators & trainer or generators == everything:
        return 0.0
    if rows and rows[-1].get("trainer/cpus", 0.0) > len(trainer):  # spread over the generators' cores too
        return 0.0
    return float(len(generators))


def _train_alone(train: list[Span], busy_iv: list[tuple[float, float]]) -> dict[int, float] | None:
    """Asynchronous run: each train step's time alone. Step s took d_s of wall, ov_s of it beside generation
    or scoring; while beside them it did 1/f of its work per second, so d_s = T_s + ov_s·(1 − 1/f). The
    least-squares line through (ov_s, d_s), warm-up left out, gives the slope β = 1 − 1/f, and each step's
    work alone is d_s − β·ov_s. None when the steps' overlaps do not spread enough to fit a slope (then the
    overlapped share is divided out with the fitted f instead)."""
    steps = {s.version: s for s in train if s.role == "trainer" and s.duration > 0}
    ov = {v: intersection_length([(s.start, s.end)], busy_iv) for v, s in steps.items()}
    fit = _after_warmup({v: s.duration for v, s in steps.items()})
    if len(fit) < MIN_FIT_STEPS:
        return None
    xs, ys = [ov[v] for v in fit], [steps[v].duration for v in fit]
    mx, my = _mean(xs), _mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var <= (0.05 * my) ** 2 * len(xs):  # overlaps within ±5% of a step of each other: no slope to see
        return None
    beta = min(1.0, max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var))
    return {v: max(1e-6, steps[v].duration - beta * ov[v]) for v in steps}


def _fit_residuals(gen: list[Span], a: float, b: float) -> dict[int, list[float]]:
    """Per weights version, each generate span's duration over the batching fit a + b·m̄ (m̄: groups in
    flight beside it): the spread that the number in flight does not explain."""
    by_role: dict[str, list[Span]] = {}
    for sp in gen:
        if sp.duration > 0:
            by_role.setdefault(sp.role, []).append(sp)
    out: dict[int, list[float]] = {}
    for spans in by_role.values():
        for sp, m in zip(spans, _mean_in_flight(spans)):
            out.setdefault(sp.version, []).append(sp.duration / max(a + b * m, 1e-12))
    return out


def _after_warmup(by_step: dict[int, float]) -> list[int]:
    """The steps of a calibration run in order, its first JITTER_WARMUP left out when enough remain."""
    steps = sorted(by_step)
    return steps[JITTER_WARMUP:] if len(steps) > 2 * JITTER_WARMUP else steps


def _spread(by_step: dict[int, float], base: float) -> list[float]:
    """Each step's value over `base` (the cost the simulation multiplies), in step order, the warm-up
    left out: what the simulation draws a step's factor from."""
    values = [by_step[k] for k in _after_warmup(by_step) if by_step[k] > 0]
    return [round(v / base, 4) for v in values] if base > 0 and len(values) >= 2 else []


def _release(train: list[Span], waits: list[Span], eval_due: Callable[[int], bool]) -> float:
    """The trainer's mean time from the end of train step s to the start of its take of step s + 1 (the
    send's release, the hand-off of the step asked for ahead), steps followed by an evaluation left out.
    Means, not medians, for the serial latencies: the planner predicts mean throughput, and a run's slow
    steps (other jobs' load) are part of what it measured."""
    ends = {s.version: s.end for s in train if s.role == "trainer"}
    return max(0.0, _mean([w.start - ends[w.version - 1] for w in waits
                             if w.role == "trainer" and w.version - 1 in ends and not eval_due(w.version)]))


def _publish_latency(gen: list[Span], train: list[Span], sync_s: float, waits: list[Span]) -> float:
    """The mean over versions of the first generation of version v after the end of train step v - 1,
    less the sync (send + swap) the model has already: the controller's latency to publish, and the
    admission after it. Only the versions whose first generation followed a generator's gate wait count
    (when there are any): there the publish opened the gate; a generator still busy with older groups
    starts the new version later than its publish (an asynchronous run's versions, some of them)."""
    ends = {s.version + 1: s.end for s in train if s.role == "trainer"}
    first: dict[int, float] = {}
    for s in gen:
        if s.version in ends:
            first[s.version] = min(first.get(s.version, math.inf), s.start)
    gate_ends = sorted(w.end for w in waits if w.role.startswith("generator"))
    opened = {v: t for v, t in first.items() if _near(gate_ends, t, GATE_OPEN_S)}
    return max(0.0, _mean([t - ends[v] - sync_s for v, t in (opened or first).items()]))


def _near(points: list[float], t: float, within: float) -> bool:
    """Whether a sorted `points` has one in [t - within, t]."""
    i = bisect.bisect_right(points, t)
    return i > 0 and t - points[i - 1] <= within


def _handoff_async(costs: Costs, gen: list[Span], waits: list[Span], train_s: float) -> float:
    """Asynchronous run: the hand-off latency H seen on the steps where the trainer waited on the gate.
    The groups of step s are the s-th P generate spans in admission (start) order; the scorers take them
    as they end (n·σ each, one after the other); a waiting trainer took the step H after its last group
    was scored. Steps the trainer did not wait for (its groups were ready before it asked) do not show H
    and are left out, as are the warm-up steps (first calls); none such: 0 (H then does not limit the run,
    nor shows in its costs)."""
    c, P = costs, costs.prompts_per_step
    spans = sorted((s for s in gen if s.duration > 0), key=lambda s: s.start)
    ready, done = {}, 0.0
    per_group = c.group_size * c.score_s / max(1, c.num_scorers)
    for s in sorted(spans, key=lambda s: s.end):  # scored in the order they end
        done = max(done, s.end) + per_group
        ready[id(s)] = done
    residuals = []
    steps = _after_warmup({w.version: w.duration for w in waits if w.role == "trainer"})
    for w in waits:
        group = spans[w.version * P:(w.version + 1) * P]
        if (w.role != "trainer" or w.version not in steps or len(group) < P
                or w.duration <= max(WAITED_S, WAITED_SHARE * train_s)):
            continue
        residuals.append(w.end - max(ready[id(s)] for s in group))
    return max(0.0, _mean(residuals))


def _handoff(costs: Costs, gen: list[Span], waits: list[Span]) -> float:
    """On-policy run: the mean over steps of the trainer's gate wait minus what the model explains for
    that step (the publish after the trainer's release, then each generator's groups: a + b·m per wave of
    at most `concurrency`; then the scorers' P·n samples), at least 0."""
    c = costs
    per_gen: dict[int, dict[str, int]] = {}
    for sp in gen:
        per_gen.setdefault(sp.version, {})
        per_gen[sp.version][sp.role] = per_gen[sp.version].get(sp.role, 0) + 1
    score = c.prompts_per_step * c.group_size * c.score_s / max(1, c.num_scorers)
    residuals = []
    for w in waits:
        if w.role != "trainer" or w.version not in per_gen:
            continue
        gen_phase = 0.0
        for n in per_gen[w.version].values():
            m = min(n, c.concurrency)
            gen_phase = max(gen_phase, math.ceil(n / m) * (c.gen_a + c.gen_b * m))
        publish = max(0.0, c.send_s + c.swap_s + c.overhead_s - c.release_s) if w.version > 0 else 0.0
        residuals.append(w.duration - publish - gen_phase - score)
    return max(0.0, _mean(residuals))


def steady_throughput(costs: Costs, setting: Setting, steps: int, warmup: int = JITTER_WARMUP) -> float:
    """Predicted trained samples/s of a run of `steps` steps without its first `warmup` (as a run's
    throughput is measured): the simulated run less its simulated first `warmup` steps (the pipeline's
    fill, which weighs on a run of a few long steps). The whole run when it is not longer than 2·warmup."""
    whole = simulate(costs, setting, steps).step_s
    if steps <= 2 * warmup:
        return costs.prompts_per_step * costs.group_size / whole
    start = simulate(costs, setting, warmup).step_s
    return costs.prompts_per_step * costs.group_size / ((steps * whole - warmup * start) / (steps - warmup))


def fit_contention(costs: Costs, setting: Setting, measured: float, steps: int, *, top: float = 4.0) -> float:
    """The slowdown f in [1, top] under which the simulation of the calibration run's own setting gives
    its measured throughput (bisection: throughput falls as f grows); 1 or `top` at the ends."""
    def sps(f: float) -> float:
        return steady_throughput(msgspec.structs.replace(costs, contention=f), setting, steps)

    lo, hi = 1.0, top
    if sps(lo) <= measured:
        return lo
    if sps(hi) >= measured:
        return hi
    while hi - lo > 1e-3:  # f to a thousandth: a finer f moves the prediction by less than the spread
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sps(mid) > measured else (lo, mid)
    return (lo + hi) / 2


def recommend(predictions: Sequence[Prediction]) -> Prediction:
    """Highest predicted throughput; among settings within TIE_SHARE of it, the lowest mean staleness,
    then the fewest generators (less memory, less off-policy data for the same speed)."""
    best = max(p.samples_per_s for p in predictions)
    tied = [p for p in predictions if p.samples_per_s >= (1 - TIE_SHARE) * best]
    return min(tied, key=lambda p: (round(p.staleness_mean, 3), p.setting.num_generators, p.setting.max_staleness))


def plan(costs: Costs, generators: Sequence[int], staleness: Sequence[int], steps: int) -> list[Prediction]:
    return [simulate(costs, Setting(g, k), steps) for g in generators for k in staleness]


def format_plan(costs: Costs, predictions: Sequence[Prediction]) -> str:
    """The table and recommendation `asyncrl plan` prints."""
    c = costs
    contention_note = ("fitted so that the simulation reproduces the calibration run" if c.contention_measured
                       else "not observable in an on-policy run: calibrate from an asynchronous one")
    lines = [
        f"calibrated from {c.source}: generation a={c.gen_a:.4f}s + b={c.gen_b:.4f}s per group in flight, "
        f"train {c.train_s:.4f}s, send {c.send_s:.4f}s, swap {c.swap_s:.4f}s, release {c.release_s:.4f}s, "
        f"publish {c.overhead_s:.4f}s, eval {c.eval_s:.4f}s/{c.eval_every or '-'} steps, "
        f"score {c.score_s * 1e3:.3f} ms/sample x {c.num_scorers} scorer(s), hand-off {c.handoff_s:.4f}s"
        f"{'' if c.handoff_s or not c.contention_measured else ' (the trainer never waited on the gate)'}",
        f"spread drawn from (value / median, per step): train {_range(c.train_jitter)}, generation "
        f"{_range(c.gen_jitter)}" + (f"; each prediction the mean of {REPLICATES} simulations"
                                     if c.train_jitter or c.gen_jitter else ""),
        f"contention beside one generating, scoring or handing-off role: x{c.contention:.2f} "
        f"({contention_note}; each further role adds as much CPU demand; "
        + ("train time alone fitted from the steps' overlaps" if c.train_alone_fitted else
           f"at least the CPU the roles computing at once want (gate phase {c.gate_cpu_share:.2f}, training "
           f"{c.train_cpu_share:.2f} core-seconds per second, x {c.threads} thread(s)) / {capacity(c):g} core(s)")
        + f"{'; one interpreter lock shared by every role (in-process run)' if c.shared_interpreter else ''})",
        "",
        "| generators | max_staleness | samples/s (sim) | samples/s (closed form) | step s | generator busy "
        "| trainer busy | staleness mean | staleness histogram |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in predictions:
        hist = " ".join(f"{s}:{share:.0%}" for s, share in p.staleness_hist.items())
        lines.append(f"| {p.setting.num_generators} | {p.setting.max_staleness} | {p.samples_per_s:.2f} | "
                     f"{p.closed_form_samples_per_s:.2f} | {p.step_s:.3f} | {p.generator_busy:.2f} | "
                     f"{p.trainer_busy:.2f} | {p.staleness_mean:.2f} | {hist} |")
    r = recommend(predictions)
    lines += ["", f"recommended: rollout.num_generators={r.setting.num_generators} "
                  f"staleness.max_staleness={r.setting.max_staleness} "
                  f"({r.samples_per_s:.2f} samples/s predicted, mean staleness {r.staleness_mean:.2f}; "
                  f"ties within {TIE_SHARE:.0%} go to lower staleness)"]
    return "\n".join(lines)


def _range(factors: list[float]) -> str:
    if not factors:
        return "none"
    q = sorted(factors)
    return f"p10 {q[len(q) // 10]:.2f} / p90 {q[(9 * len(q)) // 10]:.2f} ({len(q)} steps)"


def measured_throughput(run_dir: str | Path, *, skip: int = 0) -> float | None:
    """Trained samples/s of a finished run (the figure the planner predicts), leaving out its first
    `skip` train steps (warm-up: first-call allocations and kernel selection, which the model has no
    term for)."""
    rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "reward/mean" in r]
    if skip >= len(rows):
        raise ValueError(f"{run_dir}: cannot skip {skip} of its {len(rows)} train steps")
    return summarize_rows(rows[skip:]).get("throughput/samples_per_s")

