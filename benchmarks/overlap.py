"""Overlap benchmark: asynchronous vs synchronous training of the same workload, against the ideal overlap.

    python benchmarks/overlap.py                # Ray, 2 CPUs, 5 rounds of 40 steps: about 8 minutes
    python benchmarks/overlap.py --local        # in-process deployment instead of Ray
    python benchmarks/overlap.py --quick        # tiny smoke run (used by the test); says nothing about the target
    python benchmarks/overlap.py --defaults --rounds 3   # what a user gets: no cluster.* key set (about 5 minutes)

Issue 7's goal: with the same model, task and number of trained samples, asynchronous training
(max_staleness >= 1) reaches at least 0.95 of the ideal speed-up over synchronous training
(max_staleness = 0), where the ideal is (G + T) / max(G, T): G = generation time per step and T =
training time per step, both measured in the synchronous run.

Runs, in one process (same Ray cluster, same model folder, same seed), --rounds rounds of
  sync        max_staleness = 0, torch_threads = 1 per role   -> G, T and the baseline throughput
  async       max_staleness = K (--staleness, default 2), torch_threads = 1 per role (same threads as sync)
in the order sync, async in odd rounds and async, sync in even ones (a steady drift of the machine's speed
then favours neither side), then one
  sync-2t     max_staleness = 0, torch_threads = 2: each phase gets both cores while the other waits
The figure is the round whose share of the ideal is the median one (the lower of the two middle ones for an
even number of rounds).

Why max_staleness 2 and `rollout.weight_update = "between_requests"` by default (both runs get the same
config; in the synchronous run no group is in flight when weights arrive, so the setting changes nothing
there): with K = 1 the generator's whole chain for the next step (receive, swap, admit, generate, score,
the trainer's prefetch) must fit inside one update, on a core that also carries the scorer, the replay buffer,
the Controller and Ray's processes; at G/T ~ 0.85 that left a gate wait in the async step in many rounds.
K = 2 gives the chain a second update of slack, and swapping between requests (the groups in flight are
within the bound at the version they started with) avoids the in-flight swap's KV recompute, which cost
23-31 ms of generation per step with K = 2 in flight. `--staleness 1` and `--set
rollout.weight_update=in_flight` measure the other settings.

Definitions (per train step, the first --warmup steps excluded from every figure):
  G   the trainer's wait for the step's groups (`trainer/gate_wait_s`): generation + scoring, which the
      synchronous trainer cannot hide
  T   the rest of the step: `time/step_s` - G (update, weight send and swap, controller work)
  throughput  trained samples / summed `time/step_s`

Why Ray by default: each role is its own process, so generation and training really run on different
cores. In the in-process deployment (`--local`) they share one interpreter: torch ops release the GIL,
but the engine's per-step Python and the scorer do not, so the overlap is partial (measure it with
--local to see).
The workload (model size, tokens, prompts) is chosen so that 0.75 <= G/T <= 1.33 on this 2-core machine
(G/T 0.78-0.86 with the defaults: the trainer is the bottleneck and the generator keeps some slack for its
weight receive and swap); the script prints G/T and warns when a run lands outside that band.

Equal work in every run: responses ignore the model's eos (`rollout.ignore_eos`), so each one has exactly
--tokens tokens. Without it the three runs' policies drift apart and so do their response lengths (mean 17
vs 29 tokens in one pair of runs), and G and T of one run would not describe the other's work.

--defaults: every run leaves [cluster] at its defaults (scorer_placement, torch_threads and auto_affinity
decide by themselves: asyncrl/deploy/auto.py) and starts its own local cluster, as `asyncrl launch` does; the async run
takes the config's max_staleness and weight_update unless --staleness / --weight-update say otherwise. The sync
runs set cluster.torch_threads to --sync-threads (1: what the async run's roles get on 2 cores) so that G and
T describe the threads the async run has; sync-2t is then the untouched defaults at max_staleness 0 (every
role may use both cores and measures which count is faster). The "train cpu/wall" column is the trainer's
process CPU per wall second of its updates: below 1, something took its core (another role, Ray, another job).

Placement (Ray, default): `cluster.affinity` pins the trainer to core 1 and the generator, replay buffer
and the Controller (with Ray's own processes) to core 0 (PINNED below), in every run; --no-pin lets every
process float, which on this machine let the light roles and Ray's own threads preempt the trainer 4-10%
of its update time. The scorer runs inside the buffer's actor (`cluster.scorer_placement = "buffer"`, every
run): as its own actor, its process cost core 0 about 50 ms of CPU a step (actor calls, Ray's per-process
work) against 7 ms of scoring, and the synchronous run does that work while the trainer trains, the
asynchronous one beside generation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.telemetry.summary import train_rows

CONFIG = """
[model]
path = "{model_dir}"
[model.build_tiny]
hidden_size = {hidden}
num_layers = {layers}
num_heads = 4
num_kv_heads = 2
intermediate_size = {mlp}
vocab = "0123456789+="
max_positions = 96

[data]
source = "asyncrl.tasks.digits:first_digit"
max_prompt_len = 16

[rollout]
num_generators = 1
concurrency = {prompts}
group_size = {group}
max_new_tokens = {tokens}
ignore_eos = true
weight_update = "{weight_update}"

[reward]
fn = "prefix_match"

[trainer]
total_steps = {steps}
prompts_per_step = {prompts}
micro_batch_size = {micro}
epochs = {epochs}
lr = 1e-3
eval_every = 0

{cluster}

[logging]
live = false

[run]
output_dir = "{run_dir}"
save_checkpoint = false
save_every_s = 0
seed = 0
"""


def measure(rows: list[dict], warmup: int) -> dict[str, float]:
    """G, T and throughput of a run's train rows, the first `warmup` steps left out."""
    steps = train_rows(rows)[warmup:]
    if not steps:
        raise RuntimeError("no train steps left after the warm-up; raise --steps")
    wall = sum(r["time/step_s"] for r in steps)
    gen = statistics.mean(r["trainer/gate_wait_s"] for r in steps)
    step = wall / len(steps)
    return {"G": gen, "T": step - gen, "step_s": step,
            "samples_per_s": sum(r["trainer/samples"] for r in steps) / wall,
            "staleness_mean": statistics.mean(r.get("staleness/mean", 0.0) for r in steps),
            "overlap": statistics.mean(r.get("overlap_ratio", 0.0) for r in steps)}


# The pinned layout (default on Ray): the trainer, whose step is the longer one (G < T), gets core 1 to
# itself; the generator, the replay buffer (hosting the scorer), the Controller and Ray's own processes (they
# start from the Controller's process and inherit its CPUs) share core 0, where generation leaves slack.
# With the Controller beside the trainer, its per-step work and Ray's threads descheduled the update 4-9%
# of its time (train span wall vs process CPU); here 0.3-1%. The same layout in every run, so G and T are
# measured under it too.
PINNED = {"trainer": [1], "controller": [0], "generator": [0], "scorer": [0], "buffer": [0]}


TUNED = """[cluster]
num_cpus = {cpus}
generator_cpus = 0.5
scorer_cpus = 0.25
trainer_cpus = 0.5
buffer_cpus = 0.25
scorer_placement = "buffer"
"""


def cluster_toml(args: argparse.Namespace) -> str:
    """The [cluster] tables of every run: none with --defaults (every cluster.* key at its default, as a user
    gets it); else the tuned placement (the scorers in the buffer's actor, PINNED unless --no-pin)."""
    if args.defaults:
        return ""
    text = TUNED.format(cpus=args.cpus)
    if not args.pin:  # nothing pinned: not by hand, not automatically (cluster.auto_affinity)
        return text + "auto_affinity = false\n"
    return text + "[cluster.affinity]\n" + "".join(f"{role} = {cpus}\n" for role, cpus in PINNED.items())


def run(name: str, args: argparse.Namespace, root: Path, overrides: list[str]) -> dict[str, float]:
    from asyncrl.deploy.launch import run_with_ray
    from asyncrl.deploy.local import run_local

    text = CONFIG.format(cluster=cluster_toml(args), model_dir=root / "model", run_dir=root / name,
                         hidden=args.hidden, layers=args.layers, mlp=args.hidden * 2, prompts=args.prompts,
                         group=args.group, tokens=args.tokens, weight_update=args.weight_update, steps=args.steps,
                         micro=args.micro, epochs=args.epochs)
    path = root / f"{name}.toml"
    path.write_text(text)
    cfg = load_config(path, overrides)
    t0 = time.time()
    rows = (run_local if args.local else run_with_ray)(cfg)
    out = measure(rows, args.warmup)
    out["run_s"] = time.time() - t0
    placed = root / name / "placement.json"  # Ray: each role's torch threads and CPUs as it ran
    out["placement"] = json.loads(placed.read_text()) if placed.exists() else {}
    out["train_cpu_share"] = train_cpu_share(root / name / "trace.json", args.warmup)
    out["threads"] = str(cfg.cluster.torch_threads)  # as configured (placement.json: as the roles got it)
    return out


def train_cpu_share(trace: Path, warmup: int) -> float:
    """The trainer process's CPU seconds per wall second of its updates (`train` spans after the warm-up): below
    1 when something took its core from it (another role, Ray, another job on the machine); nan without a trace."""
    from asyncrl.telemetry.trace import read_trace, spans_from_trace

    if not trace.exists():
        return float("nan")
    spans = [s for s in spans_from_trace(read_trace(trace)) if s.kind == "train" and s.version > warmup]
    wall = sum(s.duration for s in spans)
    return sum(max(s.cpu_s, 0.0) for s in spans) / wall if wall > 0 else float("nan")


def threads_of(out: dict) -> str:
    """"trainer/generator" torch threads as the run's roles reported them (placement.json), else as configured."""
    p = out.get("placement", {})
    return "/".join(str(p[r]["torch_threads"]) for r in ("trainer", "generator 0") if r in p) or out["threads"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", action="store_true", help="in-process deployment instead of Ray")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (no meaningful figures)")
    ap.add_argument("--staleness", type=int, default=None,
                    help="max_staleness of the async run (default 2; with --defaults the config's default)")
    ap.add_argument("--weight-update", default=None, choices=["in_flight", "between_requests"],
                    help="rollout.weight_update of every run (see the module docstring; default between_requests, "
                    "with --defaults the config's default)")
    ap.add_argument("--defaults", action="store_true",
                    help="what a user gets without tuning: no cluster.* key set (placement, affinity, threads "
                    "automatic), each run starts its own local cluster; the sync runs set cluster.torch_threads to "
                    "the async run's per-role threads (--sync-threads) so G and T describe the same threads, and "
                    "sync-2t is the untouched defaults at max_staleness 0")
    ap.add_argument("--sync-threads", type=int, default=1,
                    help="--defaults: cluster.torch_threads of the sync runs (the threads the async run's roles get "
                    "on this machine: 1 each on 2 cores)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="sync and async runs alternate this many times (the machine's speed drifts between runs); "
                    "default 5 (1 with --quick)")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40,
                    help="train steps per run (longer runs average out the machine's drift within a run)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=28,
                    help="new tokens per response (ignore_eos: every response has exactly this many; "
                    "raises G more than T)")
    ap.add_argument("--epochs", type=int, default=1, help="trainer epochs per step (raises T)")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per step (raises T more than G)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--micro", type=int, default=64)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run (e.g. rollout.kv_on_update=keep); repeatable")
    ap.add_argument("--out", default=None, help="keep the run directories here (trace.json, metrics)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let every process float over the cores (default on Ray: cluster.affinity, see PINNED)")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    from asyncrl.config.schema import RolloutConfig, StalenessConfig

    if args.staleness is None:
        args.staleness = StalenessConfig().max_staleness if args.defaults else 2
    if args.weight_update is None:
        args.weight_update = RolloutConfig().weight_update if args.defaults else "between_requests"
    if args.local or args.defaults or (os.cpu_count() or 1) < 2:
        args.pin = False  # in process there is one process to pin; on one CPU nothing to separate
    if args.quick:
        args.pin = False
        args.local, args.steps, args.warmup, args.hidden, args.layers = True, 3, 1, 32, 1
        args.tokens, args.epochs, args.prompts, args.group, args.micro = 2, 1, 2, 2, 4
    started = False
    os.environ.setdefault("RAY_worker_niceness", "0")  # see below
    if not args.local and not args.defaults:  # --defaults: every run starts its own cluster, as `asyncrl launch`
        import ray

        # Ray starts its workers at niceness 15 by default; with other jobs on the machine they would
        # lose the cores to them while the driver (the Controller) does not. Same priority for all.
        if args.pin:  # the driver (Controller) and the cluster it starts: see PINNED
            from asyncrl.deploy.auto import pin_cpus

            pin_cpus(PINNED["controller"], "controller")
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=256 * 2**20, log_to_driver=False)
        started = True
    one = ["cluster.torch_threads=1", *args.sets]
    sync_one = [f"cluster.torch_threads={args.sync_threads}", *args.sets] if args.defaults else one
    async_one = list(args.sets) if args.defaults else one
    two = ["staleness.max_staleness=0", *args.sets, *([] if args.defaults else ["cluster.torch_threads=2"])]
    rounds: list[tuple[dict[str, float], dict[str, float]]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
            root = Path(args.out or tmp)
            root.mkdir(parents=True, exist_ok=True)
            for i in range(1, args.rounds + 1):
                pair = {"sync": ["staleness.max_staleness=0", *sync_one],
                        "async": [f"staleness.max_staleness={args.staleness}", *async_one]}
                order = ["sync", "async"] if i % 2 else ["async", "sync"]  # ABBA: a steady drift favours neither
                out = {name: run(f"{name}-{i}", args, root, pair[name]) for name in order}
                sync, asyn = out["sync"], out["async"]
                rounds.append((sync, asyn))
            sync2 = run("sync-2t", args, root, two)
    finally:
        if started:
            import ray

            ray.shutdown()
    print(f"deployment: {'in-process (--local)' if args.local else 'Ray'}, {args.cpus} CPUs; model hidden "
          f"{args.hidden} x {args.layers} layers; {args.prompts} prompts x {args.group} samples per step, "
          f"{args.tokens} new tokens (eos ignored), {args.epochs} epoch(s); {args.steps} steps, first {args.warmup} "
          f"excluded; weight_update {args.weight_update}; "
          + ("config defaults for cluster.* (placement, affinity, threads automatic)" if args.defaults
             else f"pinned {PINNED}" if args.pin else "not pinned")
          + (f"; overrides {args.sets}" if args.sets else ""))
    print()
    print("| round | run | max_staleness | threads/role | G s | T s | G/T | step s | samples/s | vs sync | ideal | "
          "share of ideal | staleness mean | overlap | train cpu/wall | run s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    shares = []
    for i, (sync, asyn) in enumerate(rounds, 1):
        G, T = sync["G"], sync["T"]
        ideal = (G + T) / max(G, T)
        speedup = asyn["samples_per_s"] / sync["samples_per_s"]
        shares.append((speedup / ideal, speedup, ideal, G / T))
        band = "" if 0.75 <= G / T <= 1.33 else " (outside 0.75..1.33)"
        print(f"| {i} | sync | 0 | {threads_of(sync)} | {G:.3f} | {T:.3f} | {G / T:.2f}{band} | {sync['step_s']:.3f} | "
              f"{sync['samples_per_s']:.1f} | 1.00x | | | {sync['staleness_mean']:.2f} | {sync['overlap']:.2f} | "
              f"{sync['train_cpu_share']:.2f} | {sync['run_s']:.0f} |")
        print(f"| {i} | async | {args.staleness} | {threads_of(asyn)} | | | | {asyn['step_s']:.3f} | "
              f"{asyn['samples_per_s']:.1f} | "
              f"{speedup:.2f}x | {ideal:.3f} | **{speedup / ideal:.3f}** | {asyn['staleness_mean']:.2f} | "
              f"{asyn['overlap']:.2f} | {asyn['train_cpu_share']:.2f} | {asyn['run_s']:.0f} |")
    last_sync = rounds[-1][0]
    print(f"| - | sync-2t | 0 | {threads_of(sync2)} | | | | {sync2['step_s']:.3f} | {sync2['samples_per_s']:.1f} | "
          f"{sync2['samples_per_s'] / last_sync['samples_per_s']:.2f}x (vs round {len(rounds)}) | | | "
          f"{sync2['staleness_mean']:.2f} | {sync2['overlap']:.2f} | {sync2['train_cpu_share']:.2f} | "
          f"{sync2['run_s']:.0f} |")
    print()
    # The round whose share of the ideal is the median one (rounds alternate sync and async, so a change of
    # the machine's speed between two runs moves one round's share, not the figure).
    share, speedup, ideal, gt = sorted(shares)[(len(shares) - 1) // 2]
    print(f"share of the ideal speed-up (G + T) / max(G, T), per round: "
          f"{', '.join(f'{s[0]:.3f}' for s in shares)}; median {share:.3f} (target 0.95): "
          f"async / sync = {speedup:.3f} against the ideal {ideal:.3f} (G/T = {gt:.2f})")
    print(f"async (round {len(rounds)}) / sync with both cores per phase (sync-2t) = "
          f"{rounds[-1][1]['samples_per_s'] / sync2['samples_per_s']:.3f}")
    if any(not 0.75 <= s[3] <= 1.33 for s in shares):
        print("warning: a round's G/T is outside 0.75..1.33: tune --tokens / --epochs / --prompts")
    result = {"benchmark": "overlap", "value": round(speedup, 4), "unit": "async/sync throughput",
              "baseline": round(ideal, 4), "ratio": round(share, 4), "target": 0.95}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
