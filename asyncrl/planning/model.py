"""The planner's model: the costs it is calibrated with, and the prediction it makes from them.

Place in the dataflow: `asyncrl.planning.planner.calibrate` (a finished run) ──► **`Costs`** ──► `simulate` (a
discrete-event simulation of the runtime's protocol, asyncrl/planning/planner.py's module docstring has the model in
one screen) and `closed_form` ──► `Prediction` ──► `asyncrl plan`'s table. Kept apart from the calibration
so each file stays readable; asyncrl.planning.planner re-exports every name here.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence

import msgspec

REPLICATES = 8    # simulations averaged per prediction when the costs carry a spread (seeds 0..7)


class Costs(msgspec.Struct, kw_only=True):
    """What a run measured, in seconds, with contention from its own overlap taken out."""

    gen_a: float                  # per-group generation time at 0 groups in flight (intercept)
    gen_b: float                  # extra seconds per group for each other group in flight (batching slope)
    train_s: float                # one train step (forward, backward, optimizer) alone on its cores
    send_s: float                 # the trainer's weight send
    swap_s: float                 # a generator's weight swap (generation stops meanwhile)
    # the controller's latency from a sync's end to the publish of the new version (admission opens then);
    # it runs beside the next train step, which the trainer starts as soon as the send released the weights
    overhead_s: float
    # the trainer's own time from a train step's end to its next take: the send's release of the weights
    # (the next update must not change them under it), the step's metrics and the hand-off of the step
    # asked for ahead. Serial on the trainer, unlike the rest of the sync
    release_s: float = 0.0
    eval_s: float = 0.0           # one held-out evaluation (the trainer idles from publish to its end)
    eval_every: int = 0           # evaluate after every this many steps (and after the last); 0: never
    # latency from a group's generation end to the trainer having it, beyond the scoring modelled: the
    # hand-offs (publish, admit, put, the scorer's take, the trainer's take) and the spread of the groups'
    # starts and ends. Measured in an on-policy run (the part of its gate wait that the generation and
    # scoring model does not explain), in an asynchronous one on the steps the trainer waited for (from
    # the step's last group scored to the wait's end); 0 when it never waited
    handoff_s: float = 0.0
    # each step's train time and each version's generation time over their medians in the calibration
    # run (warm-up left out): the spread the simulation draws from. Empty: every step takes the median
    train_jitter: list[float] = []
    gen_jitter: list[float] = []
    score_s: float                # scorer seconds per sample (a group of n costs n·score_s)
    num_scorers: int              # scorers pulling from the rollout queue (first free takes the next group)
    contention: float             # slowdown of training beside one generating, scoring or handing-off role (>= 1)
    contention_measured: bool     # True: fitted to an asynchronous run; False: on-policy run, assumed 1
    # True: T alone came from the asynchronous run's own steps (each step's duration against the seconds
    # of it beside generation), so the f fitted with it says alone how the roles' threads slow each other;
    # False: the threads' demand over the cores is a floor under the slowdown
    train_alone_fitted: bool = False
    cores: float
    shared_interpreter: bool = False  # every role in one process (--local): one interpreter lock, capacity 1
    # process CPU seconds per wall second (in process, measured on the trainer's spans; else 1): while
    # the trainer waits on the gate (generation + scoring), and while it trains. Below 1, a phase spends
    # part of its time waiting (thread hand-offs, the OS) and that part overlaps with the others for free
    gate_cpu_share: float = 1.0
    train_cpu_share: float = 1.0
    threads: int                  # torch threads per role
    # the cores the generators (and the light roles: buffer, scorers, Controller) were pinned to apart from the
    # trainer's in the calibration run (`cluster.auto_affinity` pins them when the roles overlap, k >= 1); 0:
    # not pinned. Pinned, a setting's generators share those cores (`generator_share`) and the trainer, on
    # cores of its own, is slowed no more by a second generator than by the first
    gen_cores: float = 0.0
    generators: int = 1           # the calibration run's generators (whose sharing its costs already carry)
    # pinned, the CPU seconds a step cost on those cores in the calibration run (its rows' `<role>/cpu_cores`
    # times the step; 0 when the run has none): the generators' and the buffer's (calls from each generator),
    # and the driver's. `shared_core_floor` makes them a floor under a setting's step
    roles_cpu_s: float = 0.0
    driver_cpu_s: float = 0.0
    prompts_per_step: int
    group_size: int
    concurrency: int
    steps: int = 0                # train steps of that run (the default length of a prediction)
    source: str = ""              # the run directory calibrated from


def capacity(costs: Costs) -> float:
    """Cores the computing roles share: 1 when they share one interpreter lock, else the machine's."""
    return 1.0 if costs.shared_interpreter else costs.cores


def cpu_demand(costs: Costs, gate_roles: int, training: bool) -> float:
    """Cores wanted by `gate_roles` generators/scorers and (if `training`) the trainer computing at once."""
    c = costs
    return c.threads * (gate_roles * c.gate_cpu_share + (c.train_cpu_share if training else 0.0))


def pinned(costs: Costs, setting: Setting) -> bool:
    """Whether the runtime pins the roles in `setting` as it did in the pinned calibration run: the automatic
    affinity pins only when generation and training overlap (max_staleness >= 1)."""
    return costs.gen_cores > 0 and setting.max_staleness >= 1


def generator_share(costs: Costs, setting: Setting) -> float:
    """Pinned: how much slower each generator computes than in the calibration run, its generators' threads
    over the cores they share against the calibration run's (2 generators of 1 thread on the 1 core beside the
    trainer: 2x). 1 when not pinned (the cores-wide demand in `cpu_demand` covers that)."""
    if not pinned(costs, setting):
        return 1.0
    crowd = lambda g: max(1.0, g * costs.threads / costs.gen_cores)  # noqa: E731
    return crowd(setting.num_generators) / crowd(costs.generators)


def shared_core_floor(costs: Costs, setting: Setting) -> float:
    """Pinned: the least seconds a step of `setting` takes for the work on the cores the generators share with
    the buffer and the driver: the calibration run's generator and buffer CPU a step, scaled by the generators
    (each generator decodes with its own per-step overhead, and calls the buffer on its own: 2 generators
    measured 1.9x and 1.7x of one on first_digit), plus the driver's, over those cores. 0 when not pinned or
    the calibration run has no CPU figures."""
    if not pinned(costs, setting) or costs.roles_cpu_s <= 0:
        return 0.0
    scale = setting.num_generators / costs.generators
    return (costs.roles_cpu_s * scale + costs.driver_cpu_s) / costs.gen_cores


def overlap_slowdown(costs: Costs, roles: int = 1, threaded: int | None = None) -> float:
    """The slowdown of `roles` generating, scoring or handing-off roles and training computing at once.
    The fitted contention f is the slowdown beside one such role: the cores shared as if that role kept
    f·C − (the trainer's demand) of them busy (itself and the processes serving it: the buffer, the
    Controller, Ray's); each further role keeps as many busy. Never less than the cores the roles' threads
    want over the cores they share (`threaded`: the roles among them that compute with torch threads,
    generators and scorers; default all)."""
    c, cap = costs, capacity(costs)
    trainer = c.threads * c.train_cpu_share
    per_role = max(0.0, c.contention * cap - trainer)
    # f fitted with T alone known already says how much the roles' threads slow each other; else the
    # threads' demand over the cores is the floor
    floor = 1.0 if c.train_alone_fitted else cpu_demand(c, roles if threaded is None else threaded, True) / cap
    return max(1.0, (trainer + roles * per_role) / cap, floor)


class Setting(msgspec.Struct, frozen=True):
    num_generators: int
    max_staleness: int


class Prediction(msgspec.Struct, kw_only=True):
    setting: Setting
    samples_per_s: float          # discrete-event simulation
    closed_form_samples_per_s: float
    step_s: float
    generator_busy: float
    trainer_busy: float
    staleness_mean: float
    staleness_hist: dict[int, float]   # staleness -> share of trained groups


def _mean(values: Sequence[float], default: float = 0.0) -> float:
    return sum(values) / len(values) if values else default


# ---------------------------------------------------------------------------------------------
# prediction


def closed_form(costs: Costs, setting: Setting) -> float:
    """Trained samples/s in the two regimes that have one: on-policy (k = 0) generation and training
    alternate; with k >= 1 they overlap fully and the slower one sets the pace (steady state, the gate
    never binding)."""
    c, P, G = costs, costs.prompts_per_step, setting.num_generators
    evals = c.eval_s / c.eval_every if c.eval_every > 0 else 0.0  # amortised per step
    # on-policy the next generation waits for the publish; else only the trainer's release is serial
    sync = max(c.send_s + c.swap_s + c.overhead_s, c.release_s)
    cycle = (sync if setting.max_staleness == 0 else c.release_s) + evals
    # G generators decoding at once share the cores (pinned: the cores beside the trainer's)
    shared = max(1.0, cpu_demand(c, G, False) / capacity(c)) * generator_share(c, setting)
    if setting.max_staleness == 0:
        per_gen = min(c.concurrency, math.ceil(P / G))
        waves = math.ceil(P / (G * per_gen))
        # all P groups finish together, then the scorers work through their P·n samples
        gen_phase = waves * (c.gen_a + c.gen_b * per_gen) * shared + P * c.group_size * c.score_s / c.num_scorers
        return P * c.group_size / (gen_phase + c.handoff_s + c.train_s * _mean(c.train_jitter, 1.0) + cycle)
    m = c.concurrency
    gen_rate = G * m / (c.gen_a + c.gen_b * m) / shared  # groups/s with every slot busy
    score_rate = c.num_scorers / max(c.score_s * c.group_size, 1e-12)
    if c.shared_interpreter:  # decoding and scoring take turns on the one interpreter lock
        g = P / gen_rate + P / score_rate
    else:  # generation and scoring pipeline: the slower sets the pace
        g = P / min(gen_rate, score_rate)
    t = c.train_s * _mean(c.train_jitter, 1.0)  # each phase's work per step, alone
    # both run at 1/f while they overlap; the shorter one's work is done after min·f seconds, during
    # which the longer one did min of its own: step = max + min·(f − 1), plus the trainer's serial part
    f = overlap_slowdown(c, c.generators if pinned(c, setting) else G)
    step = max(max(g, t) + min(g, t) * (f - 1.0) + cycle, shared_core_floor(c, setting))
    return P * c.group_size / step


def simulate(costs: Costs, setting: Setting, steps: int) -> Prediction:
    """The discrete-event simulation (`simulate_once`), averaged over REPLICATES seeds when the costs
    carry a spread (the same seeds every call, so predictions are repeatable and comparable)."""
    if not (costs.train_jitter or costs.gen_jitter):
        return simulate_once(costs, setting, steps)
    runs = [simulate_once(costs, setting, steps, seed=i) for i in range(REPLICATES)]
    hist: dict[int, float] = {}
    for r in runs:
        for s, share in r.staleness_hist.items():
            hist[s] = hist.get(s, 0.0) + share / len(runs)
    step_s = _mean([r.step_s for r in runs])  # every replicate trains the same samples: pool their time
    return Prediction(
        setting=setting, samples_per_s=costs.prompts_per_step * costs.group_size / step_s,
        closed_form_samples_per_s=runs[0].closed_form_samples_per_s, step_s=step_s,
        generator_busy=_mean([r.generator_busy for r in runs]), trainer_busy=_mean([r.trainer_busy for r in runs]),
        staleness_mean=_mean([r.staleness_mean for r in runs]), staleness_hist=dict(sorted(hist.items())))


def simulate_once(costs: Costs, setting: Setting, steps: int, seed: int | None = None) -> Prediction:
    """Discrete-event simulation of `steps` train steps of the real protocol (see the module docstring).
    With a `seed`, each train step takes train_s times a factor drawn from `train_jitter`, and each
    generator's groups of one weights version take their time times a factor drawn from `gen_jitter`."""
    c, P, k, G = costs, costs.prompts_per_step, setting.max_staleness, setting.num_generators
    rng = random.Random(seed) if seed is not None else None

    def draw(factors: list[float]) -> float:
        return rng.choice(factors) if rng is not None and factors else 1.0

    gen_factor = [draw(c.gen_jitter) for _ in range(G)]
    # pinned (k >= 1): the generators share the cores beside the trainer's; the trainer's own cores see as many
    # generating roles beside them as in the calibration run, however many generators share the other cores
    share, beside = generator_share(c, setting), (c.generators if pinned(c, setting) else G)
    t = 0.0
    published = 0
    engine_version = [0] * G
    inflight: list[dict[int, float]] = [{} for _ in range(G)]   # group id -> remaining work (0..1]
    admitted_at: dict[int, int] = {}
    next_gid = 0
    score_q: list[list[list[float]]] = [[] for _ in range(c.num_scorers)]  # per scorer: [group id, work left]
    scored: list[tuple[float, int]] = []                        # (time accepted, group id), a heap
    accepted_ids: set[int] = set()
    stall = [(0.0, 0.0)] * G                                    # (from, until): swapping weights
    trainer = {"phase": "wait", "left": 0.0, "step": 0}
    publish_at: list[float] = []  # the publishes under way, in version order
    gen_busy = trainer_busy = 0.0
    hist: dict[int, int] = {}

    def eval_due(version: int) -> bool:
        return c.eval_every > 0 and (version % c.eval_every == 0 or version == steps)

    while published < steps or trainer["step"] < steps:  # (the last step's release and evaluation too)
        # admission: as many groups as the gate and the generator's slots allow, engine version first
        for g in range(G):
            # accepted + running = every group admitted so far (none are filtered or fail here)
            room = (engine_version[g] + k + 1) * P - next_gid
            slots = c.concurrency - len(inflight[g])
            for _ in range(max(0, min(room, slots))):
                inflight[g][next_gid] = 1.0
                admitted_at[next_gid] = engine_version[g]
                next_gid += 1
        if trainer["phase"] == "eval_wait" and published > trainer["step"]:
            trainer.update(phase="eval", left=c.eval_s)  # the evaluation reads the published weights
        if trainer["phase"] == "wait" and trainer["step"] < steps:
            need = range(trainer["step"] * P, (trainer["step"] + 1) * P)
            if all(i in accepted_ids for i in need):
                for i in need:
                    s = trainer["step"] - admitted_at[i]
                    hist[s] = hist.get(s, 0) + 1
                trainer.update(phase="train", left=c.train_s * draw(c.train_jitter))
        generating = [g for g in range(G) if inflight[g] and not stall[g][0] <= t < stall[g][1]]
        scoring = sum(1 for q in score_q if q)
        # groups on their way to the trainer (the hand-off: puts, takes, the buffer's and the Controller's
        # work) compute too: as one more role beside training while any is under way
        handing = 1 if scored else 0
        busy_roles = min(len(generating), beside) + scoring + handing
        if busy_roles and trainer["phase"] == "train":
            slow = overlap_slowdown(c, busy_roles, threaded=busy_roles - handing)
        else:
            slow = max(1.0, cpu_demand(c, busy_roles - handing, False) / capacity(c))
        # next event
        events = [scored[0][0]] if scored else []
        events += [t + q[0][1] * slow for q in score_q if q]  # a group scored (and the contention changes)
        rates = {}
        for g in generating:
            rate = 1.0 / ((c.gen_a + c.gen_b * len(inflight[g])) * slow * gen_factor[g] * share)
            rates[g] = rate
            events.append(t + min(inflight[g].values()) / rate)
        events += [x for g in range(G) for x in stall[g] if x > t]
        if trainer["phase"] == "train":
            events.append(t + trainer["left"] * slow)
        elif trainer["phase"] in ("post", "eval"):
            events.append(t + trainer["left"])
        events += publish_at[:1]
        if not events:
            raise RuntimeError(f"simulation stalled at step {trainer['step']} (setting {setting})")
        t_next = max(min(events), t)
        dt = t_next - t
        if generating:
            gen_busy += dt * len(generating) / G
        if trainer["phase"] in ("train", "post", "eval"):
            trainer_busy += dt
        for q in score_q:  # each scorer's head group progresses at the slowdown of the moment, as generation
            if q:
                q[0][1] -= dt / slow
                while q and q[0][1] <= 1e-9:
                    heapq.heappush(scored, (t_next + c.handoff_s, int(q.pop(0)[0])))
        for g in generating:
            for gid in list(inflight[g]):
                inflight[g][gid] -= dt * rates[g]
                if inflight[g][gid] <= 1e-9:
                    del inflight[g][gid]
                    # the scorer with the least work queued takes it
                    j = min(range(c.num_scorers), key=lambda i: sum(w for _, w in score_q[i]))
                    score_q[j].append([gid, c.score_s * c.group_size])
        while scored and scored[0][0] <= t_next + 1e-12:
            accepted_ids.add(heapq.heappop(scored)[1])
        if trainer["phase"] == "train":
            trainer["left"] -= dt / slow
            if trainer["left"] <= 1e-9:
                trainer.update(phase="post", left=c.release_s)
                # generators keep decoding while the weights arrive, then stop for the swap; the controller
                # publishes the version after it (and after the version before)
                # the sync's receiving end runs on the cores the generators share: each receives, swaps and
                # notes its version at once with the others, the publish after the last
                send, swap, publish = c.send_s * share, c.swap_s * share, c.overhead_s * share
                stall = [(t_next + send, t_next + send + swap)] * G
                publish_at.append(max([t_next + send + swap + publish, *publish_at[-1:]]))
        elif trainer["phase"] in ("post", "eval"):
            trainer["left"] -= dt
            if trainer["left"] <= 1e-9:
                if trainer["phase"] == "post" and eval_due(trainer["step"] + 1):
                    trainer.update(phase="eval_wait")
                else:
                    trainer.update(phase="wait", step=trainer["step"] + 1)
        while publish_at and publish_at[0] <= t_next + 1e-12:
            publish_at.pop(0)
            published += 1
            engine_version = [published] * G
            gen_factor = [draw(c.gen_jitter) for _ in range(G)]
        t = t_next
    total = sum(hist.values())
    t = max(t, steps * shared_core_floor(c, setting))  # the shared cores cannot do a step's work faster
    return Prediction(
        setting=setting, samples_per_s=steps * P * c.group_size / t,
        closed_form_samples_per_s=closed_form(c, setting), step_s=t / steps,
        generator_busy=gen_busy / t, trainer_busy=trainer_busy / t,
        staleness_mean=sum(s * n for s, n in hist.items()) / total,
        staleness_hist={s: n / total for s, n in sorted(hist.items())},
    )
