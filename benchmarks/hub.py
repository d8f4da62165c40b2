"""Hub benchmark: trajectories per second through the replay buffer's actor (the hub) with realistic payloads,
and the Controller's own time as a share of wall in a real `asyncrl launch`.

    python benchmarks/hub.py                  # A: three payload sizes x three paths; B: first_digit, 40 steps on Ray
    python benchmarks/hub.py --steps 80       # B longer (A's steps: --hub-steps)
    python benchmarks/hub.py --no-launch      # A only (the JSON line then carries A's figures)
    python benchmarks/hub.py --quick          # tiny smoke run (used by the test); says nothing about speed

A. Hub throughput. The same loop runs through three hubs, in this order, per payload size:
  - `in-process`: the ReplayBuffer object itself, every role a coroutine of one event loop (no Ray): the cost
    of the hub's own logic (gate, queues, holders) with no process boundary;
  - `plain Ray`: a plain Ray actor holding two bounded asyncio queues (rollouts, then scored groups) and no
    logic: the cost of the actor calls and of reading and writing the payload's blobs alone (the baseline);
  - `hub`: the buffer actor exactly as `asyncrl launch` builds it (asyncrl.deploy.actors.RemoteRoleActor "buffer"
    with the options of asyncrl.deploy.launch.actor_options, called through asyncrl.deploy.actors.RayProxy).
Producers (`--producers` Ray actors, like generators) admit groups at their version (`admit(free, version,
holder=)`), build each group's trajectories from a template of the payload size and put each group
(`put_rollouts`); `--scorers` scorer actors take whole groups (`get_rollouts(batch, holder=)`), assemble and
score them (reward 1.0: no reward function runs) and `accept_groups`; a consumer actor, like the trainer,
`take_step`s, then `publish`es the next version and tells every producer (its weight swap, then `note_held`).
On both Ray paths the hub is called through RayProxy and answers as RoleActor.call does, so trajectories and
groups cross every actor boundary as one msgpack blob per call (asyncrl/deploy/wire.py), as between asyncrl's
roles in processes of their own. The plain path does the same calls without a gate (producers number their
groups themselves). Each trajectory crosses an actor boundary four times (generator -> hub -> scorer -> hub ->
trainer). Per payload: prompt / response token ids (prompt ids shared by a group), a logprob, a version and a
loss-mask entry per response token; `MB/s` counts the msgpack-encoded bytes of the trajectories trained per
second. Figures are over the consumer's steps after `--warmup` untimed steps; P = 16 prompts x G = 8 samples a
step, staleness 1, the buffer's default capacities.

B. The Controller's share of wall. `examples/first_digit/config.toml` through `asyncrl launch`'s own path
(`asyncrl.deploy.launch.run_with_ray`, its own local Ray cluster), `--steps` steps, evaluation and checkpoint off.
Every metrics row carries `time/controller_s`: CPU seconds of the driver's event-loop thread in the step's
window (the Controller, the step pipeline, supervision, the watch and the Ray calls they make). Its share of
wall is sum(time/controller_s) / sum(time/step_s) over the steps after the first; the median per step is
printed too. Target <= 2%. Beside it, each process's CPU in cores (`<role>/cpu_cores`, `controller/cpu_cores`:
the driver's whole process, Ray's threads beside the event loop included; JSON `driver_cores`).

What Ray alone takes of it. After the run, on a fresh local cluster of 2 CPUs, the driver's event loop (uvloop,
as `asyncrl launch` runs it) awaits a no-op method of an async actor, one call at a time: its CPU per round
trip (`time.thread_time`, median of 5 batches of 200 after 50 warm-up calls; JSON `ray_call_us`). The run's rows
count the actor calls the driver submitted (`controller/actor_calls`: the train step, the weight send, each
receive, the publish, the heartbeats; median a step, JSON `calls_per_step`). Their product over the median step
is the share of wall those calls take by themselves (JSON `ray_floor_share`, %): a floor under the Controller's
share for this protocol on this machine, whatever the Controller does besides.

The last line is the result JSON: value = the Controller's share of wall in %, baseline = 2.0 (the budget, %),
ratio = baseline / value (lower shares are better: the target is met when ratio >= 1.0), and beside them the
hub's trajectories/s at the medium payload (`hub_traj_per_s`), the plain Ray actor's (`plain_traj_per_s`)
and their ratio (`hub_vs_plain`). With --no-launch: value = hub trajectories/s, baseline = plain Ray's,
ratio = value / baseline, target none (0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages (asyncrl, buffers)
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from asyncrl.messages import Group, Trajectory  # noqa: E402
from buffers.grouping import GroupAssembler  # noqa: E402

CONFIG = ROOT / "examples" / "first_digit" / "config.toml"
PAYLOADS = {"small": (100, 200), "medium": (300, 600), "large": (500, 1000)}  # (prompt ids, response ids)
PROMPTS_PER_STEP, GROUP_SIZE, STALENESS = 16, 8, 1
TARGET_SHARE = 2.0  # % of wall


def template(prompt_len: int, response_len: int, seed: int = 0) -> Trajectory:
    """One trajectory of the payload size, with ids and logprobs as a generator fills them."""
    rng = random.Random(seed)
    return Trajectory(seq_id=0, group_id=0, group_size=GROUP_SIZE,
                      prompt_ids=[rng.randrange(32_000) for _ in range(prompt_len)],
                      response_ids=[rng.randrange(32_000) for _ in range(response_len)],
                      loss_mask=[True] * response_len,
                      behavior_logprobs=[-rng.random() * 5 for _ in range(response_len)],
                      versions=[0] * response_len, min_version=0, max_version=0, finish_reason="stop",
                      prompt_text="x" * (4 * prompt_len), row_json=b'{"answer": "7"}')


class Producer:
    """A generator without an engine: admits groups at its version and puts each group's trajectories."""

    def __init__(self, hub: Any, index: int, payload: tuple[int, int], gated: bool, concurrency: int = 16) -> None:
        self.hub, self.index, self.gated, self.concurrency = hub, index, gated, concurrency
        self.template = template(*payload, seed=index)
        self.version = 0
        self.holder = f"generator/{index}#0"
        self._next = index << 40  # the plain path numbers its own groups
        self.stopped = False

    async def set_version(self, version: int) -> None:
        """The new weights landed (the trainer's broadcast): admit at `version` from now on."""
        self.version = version
        if self.gated:
            await self.hub.note_held(version, holder=self.holder)

    async def run(self) -> None:
        while not self.stopped:
            if self.gated:
                ids = await self.hub.admit(self.concurrency, self.version, timeout=0.5, holder=self.holder)
            else:
                ids = list(range(self._next, self._next + self.concurrency))
                self._next += self.concurrency
            if not ids:  # a newer version published and no room at ours: yield until the swap lands
                await asyncio.sleep(0)  # (in process the admit returned without giving up the loop)
            await asyncio.gather(*[self.hub.put_rollouts(self._group(gid)) for gid in ids])

    def _group(self, gid: int) -> list[Trajectory]:
        v = self.version
        return [msgspec.structs.replace(self.template, seq_id=gid * GROUP_SIZE + j, group_id=gid, min_version=v,
                                        max_version=v, generator_id=self.index) for j in range(GROUP_SIZE)]


class Scorer:
    """A scorer without a reward function: whole groups in, assembled, accepted."""

    def __init__(self, hub: Any, index: int, batch: int = 256) -> None:
        self.hub, self.batch, self.holder = hub, batch, f"scorer/{index}#0"
        self.assembler = GroupAssembler()
        self.stopped = False

    async def run(self) -> None:
        while not self.stopped:
            trajs = await self.hub.get_rollouts(self.batch, 0.5, self.holder)
            if not trajs:  # closed (the run is over): in process that returned without giving up the loop
                await asyncio.sleep(0)
            done = []
            for t in trajs:
                t.reward = 1.0
                group = self.assembler.add(t)
                if group is not None:
                    done.append(group)
            if done:
                await self.hub.accept_groups(done)


class Consumer:
    """The trainer's side: take a step's groups, publish the next version, tell the producers."""

    def __init__(self, hub: Any, producers: list[Any]) -> None:
        self.hub, self.producers = hub, producers

    async def run(self, steps: int, warmup: int) -> tuple[int, float]:
        """(trajectories taken after the warm-up, their seconds)."""
        count, t0 = 0, time.perf_counter()
        for step in range(steps + warmup):
            if step == warmup:
                count, t0 = 0, time.perf_counter()
            groups = await self.hub.take_step(step)
            count += sum(len(g.trajectories) for g in groups)
            await self.hub.publish(step + 1)
            await asyncio.gather(*[p.set_version(step + 1) for p in self.producers])
        return count, time.perf_counter() - t0


class PlainHub:
    """The baseline: two bounded queues (rollout groups, scored groups), no logic. On Ray it is hosted by
    `PlainHubActor`, which unpacks and packs what crosses as the hub's actor does."""

    def __init__(self, capacity_groups: int, prompts_per_step: int) -> None:
        self.rollouts: asyncio.Queue = asyncio.Queue(capacity_groups)
        self.train: asyncio.Queue = asyncio.Queue()
        self.p = prompts_per_step

    async def put_rollouts(self, trajs: list[Trajectory]) -> None:
        await self.rollouts.put(trajs)

    async def get_rollouts(self, max_items: int, timeout: float | None = None, holder: str = "") -> list[Trajectory]:
        try:
            out = list(await asyncio.wait_for(self.rollouts.get(), timeout))
        except asyncio.TimeoutError:
            out = []
        while out and not self.rollouts.empty() and len(out) + GROUP_SIZE <= max_items:
            out.extend(self.rollouts.get_nowait())
        return out

    async def accept_groups(self, groups: list[Group]) -> None:
        for g in groups:
            self.train.put_nowait(g)

    async def take_step(self, step: int) -> list[Group]:
        return [await self.train.get() for _ in range(self.p)]

    async def publish(self, version: int) -> None:
        pass


class PlainHubActor:
    """The plain hub as a Ray actor called through RayProxy: `call(method, *args)` as RoleActor.call answers it
    (asyncrl.deploy.actors._invoke: the packed argument decoded, the reply encoded)."""

    def __init__(self, capacity_groups: int, prompts_per_step: int) -> None:
        self.hub = PlainHub(capacity_groups, prompts_per_step)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from asyncrl.deploy.actors import _invoke

        return await _invoke(self.hub, method, args, kwargs)


def hub_config(producers: int, scorers: int, quick: bool):
    from asyncrl.config import load_config

    sets = [f"trainer.prompts_per_step={PROMPTS_PER_STEP}", f"rollout.group_size={GROUP_SIZE}",
            f"staleness.max_staleness={STALENESS}", f"rollout.num_generators={producers}",
            f"reward.num_scorers={scorers}", 'cluster.scorer_placement="actor"']
    if quick:
        sets = [s.replace(f"={PROMPTS_PER_STEP}", "=4") if "prompts_per_step" in s else s for s in sets]
    return load_config(CONFIG, sets)


def run_in_process(cfg, payload: tuple[int, int], producers: int, scorers: int, steps: int,
                   warmup: int) -> tuple[int, float]:
    """The ReplayBuffer object itself, every role a coroutine of one event loop."""
    from asyncrl.deploy.build import build_buffer

    async def main() -> tuple[int, float]:
        hub = build_buffer(cfg)
        prods = [Producer(hub, i, payload, gated=True) for i in range(producers)]
        roles = [*prods, *[Scorer(hub, i) for i in range(scorers)]]
        loops = [asyncio.ensure_future(r.run()) for r in roles]
        try:
            return await Consumer(hub, prods).run(steps, warmup)
        finally:
            for role in roles:
                role.stopped = True
            await hub.close()  # wakes every waiter; a put after it raises QueueClosed, which ends that loop
            await asyncio.wait(loops, timeout=5)
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
    return asyncio.run(main())


def run_on_ray(cfg, payload: tuple[int, int], producers: int, scorers: int, steps: int, warmup: int,
               gated: bool) -> tuple[int, float]:
    """The hub actor as `asyncrl launch` builds it (gated), or the plain actor; the roles as Ray actors."""
    import ray

    from asyncrl.deploy.actors import ActorCalls, RayProxy, RemoteRoleActor
    from asyncrl.deploy.launch import actor_options
    from asyncrl.deploy.plan import plan_resources

    opts = {"num_cpus": 0, "max_concurrency": 1000}
    if gated:
        plan = {p.role: p for p in plan_resources(cfg)}["buffer"]
        handle = RemoteRoleActor.options(**actor_options(plan)).remote("buffer", cfg)
        hub: Any = RayProxy(handle)
    else:
        handle = ray.remote(PlainHubActor).options(**opts).remote(cfg.buffer.rollout_capacity // GROUP_SIZE,
                                                                  cfg.trainer.prompts_per_step)
        hub = RayProxy(handle)
    # the roles in actors of their own: trajectories and groups cross as blobs (RayProxy), as between asyncrl's roles
    prods = [ray.remote(Producer).options(**opts).remote(hub, i, payload, gated) for i in range(producers)]
    scs = [ray.remote(Scorer).options(**opts).remote(hub, i) for i in range(scorers)]
    consumer = ray.remote(Consumer).options(**opts).remote(hub, [ActorCalls(p) for p in prods])
    loops: list[Any] = []
    try:
        loops = [a.run.remote() for a in [*prods, *scs]]  # they run until their actors are killed below
        return ray.get(consumer.run.remote(steps, warmup))
    finally:
        for actor in [consumer, *prods, *scs, handle]:
            ray.kill(actor)
        for ref in loops:  # retrieved: their ActorDiedError is expected, not an unhandled error to print
            try:
                ray.get(ref, timeout=10)
            except Exception:
                pass


def _by_value() -> None:
    """Loaded from a file (the smoke test), not run as a script: the actors' workers cannot import this module by
    name, so its classes travel by value."""
    if __name__ != "__main__":
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])


def bench_hub(args: argparse.Namespace) -> dict[str, dict[str, tuple[float, float]]]:
    """{payload: {path: (trajectories/s, MB/s)}}, printed as a table."""
    import ray

    cfg = hub_config(args.producers, args.scorers, args.quick)
    _by_value()
    payloads = {"tiny": (8, 16)} if args.quick else PAYLOADS
    ray.init(address="local", num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, object_store_memory=256 * 2**20)
    out: dict[str, dict[str, tuple[float, float]]] = {}
    try:
        print(f"A. hub throughput: {args.producers} producers, {args.scorers} scorers, P = "
              f"{cfg.trainer.prompts_per_step} x G = {GROUP_SIZE}, {args.hub_steps} steps after {args.warmup}")
        print(f"{'payload':<8} {'prompt+resp ids':>15} {'KB/traj':>8} {'path':<11} {'traj/s':>9} {'MB/s':>8} "
              f"{'vs plain Ray':>12}")
        for name, payload in payloads.items():
            nbytes = len(msgspec.msgpack.encode(template(*payload)))
            runs = {"in-process": run_in_process(cfg, payload, args.producers, args.scorers, args.hub_steps,
                                                 args.warmup),
                    "plain Ray": run_on_ray(cfg, payload, args.producers, args.scorers, args.hub_steps,
                                            args.warmup, gated=False),
                    "hub": run_on_ray(cfg, payload, args.producers, args.scorers, args.hub_steps, args.warmup,
                                      gated=True)}
            out[name] = {path: (count / s, count * nbytes / s / 1e6) for path, (count, s) in runs.items()}
            plain = out[name]["plain Ray"][0]
            for path, (tps, mbs) in out[name].items():
                print(f"{name:<8} {f'{payload[0]}+{payload[1]}':>15} {nbytes / 1e3:>8.1f} {path:<11} {tps:>9.0f} "
                      f"{mbs:>8.1f} {tps / plain:>11.2f}x", flush=True)
    finally:
        ray.shutdown()
    return out


def controller_share(rows: list[dict]) -> tuple[float, float, int]:
    """(share of wall in %, median controller seconds per step, steps counted): the steps after the first."""
    steps = [r for r in rows if "time/controller_s" in r][1:]
    if not steps:
        raise RuntimeError("no metrics row with time/controller_s after the first step")
    busy = sum(r["time/controller_s"] for r in steps)
    wall = sum(r["time/step_s"] for r in steps)
    return 100 * busy / wall, statistics.median(r["time/controller_s"] for r in steps), len(steps)


def bench_controller(args: argparse.Namespace) -> dict[str, float]:
    from asyncrl.config import load_config
    from asyncrl.deploy.launch import run_with_ray

    root = Path(tempfile.mkdtemp(prefix="hub-"))
    steps = 4 if args.quick else args.steps
    sets = [f"trainer.total_steps={steps}", "trainer.eval_every=0", "run.save_checkpoint=false", "run.save_every_s=0",
            "logging.live=false", f'run.output_dir="{root / "run"}"', *args.set]
    if args.quick:
        sets += ["trainer.prompts_per_step=4", "rollout.group_size=4", "rollout.concurrency=4",
                 "trainer.micro_batch_size=16", "model.build_tiny.hidden_size=32",
                 "model.build_tiny.intermediate_size=64", f'model.path="{root / "tiny-model"}"']
    cfg = load_config(args.config, sets)
    t0 = time.time()
    rows = run_with_ray(cfg)
    wall = time.time() - t0
    share, median_s, counted = controller_share(rows)
    step_s = statistics.median(r["time/step_s"] for r in rows if "time/step_s" in r)
    print(f"B. the Controller: {args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config}"
          f" on Ray, {steps} steps ({wall:.1f} s with setup)")
    print(f"   step (median)              {step_s * 1e3:8.1f} ms")
    print(f"   controller CPU (median)    {median_s * 1e3:8.2f} ms a step")
    print(f"   share of wall              {share:8.2f} %  over {counted} steps (target <= {TARGET_SHARE:g} %)")
    # beside it, each process's CPU (docs/metrics.md, Process CPU): the driver's whole process (Ray's threads too)
    # and the roles' processes, in cores over the steps after the first
    cores = {role: statistics.median(r[f"{role}/cpu_cores"] for r in rows[1:] if f"{role}/cpu_cores" in r)
             for role in ("controller", "trainer", "generator", "buffer")
             if any(f"{role}/cpu_cores" in r for r in rows[1:])}
    print("   process CPU (cores, median) " + ", ".join(f"{role} {c:.2f}" for role, c in cores.items()))
    calls = statistics.median(r["controller/actor_calls"] for r in rows[1:] if "controller/actor_calls" in r)
    call_s = ray_round_trip_cpu(200 if not args.quick else 20, batches=5 if not args.quick else 2)
    floor = 100 * calls * call_s / step_s
    print(f"   actor calls (median)       {calls:8.1f} a step")
    print(f"   Ray round trip             {call_s * 1e6:8.0f} us of the loop's CPU (a no-op call, fresh cluster)")
    print(f"   those calls alone          {floor:8.2f} % of the step (a floor under the share)")
    return {"share": share, "median_s": median_s, "step_s": step_s,
            "driver_cores": round(cores.get("controller", 0.0), 3), "calls_per_step": calls,
            "ray_call_us": round(call_s * 1e6, 1), "ray_floor_share": round(floor, 3)}


class _Noop:
    async def noop(self) -> None:
        return None


def ray_round_trip_cpu(calls: int, batches: int, warmup: int = 50) -> float:
    """CPU seconds of the driver's event-loop thread per awaited actor call (a no-op on an async actor), on a
    fresh local cluster of 2 CPUs and the loop `asyncrl launch` runs (asyncrl.aio.run_loop: uvloop): the median
    over `batches` batches of `calls` calls made one at a time."""
    import ray

    from asyncrl.aio import run_loop

    _by_value()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, object_store_memory=128 * 2**20)
    try:
        actor = ray.remote(_Noop).options(max_concurrency=4).remote()

        async def measure() -> float:
            for _ in range(warmup):
                await actor.noop.remote()
            per_call = []
            for _ in range(batches):
                t0 = time.thread_time()
                for _ in range(calls):
                    await actor.noop.remote()
                per_call.append((time.thread_time() - t0) / calls)
            return statistics.median(per_call)

        return run_loop(measure())
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG, help="B's run (default: the first example)")
    ap.add_argument("--steps", type=int, default=40, help="B's train steps")
    ap.add_argument("--hub-steps", type=int, default=30, help="A's timed consumer steps per payload and path")
    ap.add_argument("--warmup", type=int, default=3, help="A's untimed steps first")
    ap.add_argument("--producers", type=int, default=2, help="A's generator-like actors")
    ap.add_argument("--scorers", type=int, default=1, help="A's scorer-like actors")
    ap.add_argument("--no-launch", action="store_true", help="A only")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: a tiny payload, a few steps")
    ap.add_argument("--set", action="append", default=[], help="B's extra config overrides (key=value)")
    args = ap.parse_args(argv)
    if args.quick:
        args.hub_steps, args.warmup, args.producers = 3, 1, 1

    hub = bench_hub(args)
    name = "tiny" if args.quick else "medium"
    hub_tps, plain_tps = hub[name]["hub"][0], hub[name]["plain Ray"][0]
    extra = {"hub_traj_per_s": round(hub_tps, 1), "plain_traj_per_s": round(plain_tps, 1),
             "hub_vs_plain": round(hub_tps / plain_tps, 3)}
    if args.no_launch:
        result = {"benchmark": "hub", "value": round(hub_tps, 1), "unit": "trajectories/s",
                  "baseline": round(plain_tps, 1), "ratio": round(hub_tps / plain_tps, 3), "target": 0}
    else:
        b = bench_controller(args)
        result = {"benchmark": "hub", "value": round(b["share"], 3), "unit": "% of wall (controller)",
                  "baseline": TARGET_SHARE, "ratio": round(TARGET_SHARE / max(b["share"], 1e-9), 3),
                  "target": 1.0, "driver_cores": b["driver_cores"], "calls_per_step": b["calls_per_step"],
                  "ray_call_us": b["ray_call_us"], "ray_floor_share": b["ray_floor_share"], **extra}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
