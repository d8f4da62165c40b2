"""asyncrl's train step (`Learner.update`) vs the bare forward/backward/AdamW step of the same batch.

Place in the dataflow: none, this measures the Trainer role's step alone. The Trainer takes a step's groups off
the train store and calls `Learner.update(groups)` (asyncrl/training/learner.py); this script calls exactly that,
with realistic `Group`/`Trajectory` messages, and times it against the loop a user writes by hand on the same
batch, the same model (the same initial weights) and the same torch threads:

    bare step = GRPO advantages from the rewards (group mean/std) -> one forward of the padded batch ->
                logprob of each sampled token -> PPO-clip vs the behaviour logprobs, token-mean over the loss
                mask -> backward -> clip_grad_norm_ -> AdamW step -> zero_grad

The floor is fair: the bare step computes its logprobs with the Learner's own `token_logprobs`
(asyncrl/training/logprobs.py: the LM head from the earliest response column on, or fused with the log-softmax in
chunks under trainer.logprob_chunk_tokens) and steps the Learner's own AdamW (asyncrl/training/optim.py `adamw`:
the fused kernel where the Learner's is fused), so "asyncrl's step vs bare" is what the runtime adds around the
same maths: building tensors from messages, the algorithm registry's functions, statistics and metrics.

The bare side gets its padded tensors built once, before timing (a hand-written loop holds its batch as tensors
already); asyncrl's side starts from the messages, as the Trainer does. Both train on every call (the weights
move, the work per step does not). Timed calls are interleaved (bare, asyncrl, asyncrl, bare, ...) after warm-up,
so load from other processes hits both sides alike, and each figure is the median of `--repeats` calls.

A second pass, not timed against the bare step, splits asyncrl's step into sections with `time.perf_counter`
wrappers around the Learner's own functions (flatten, prepare, collate, forward + logprobs, policy loss, loss
aggregation, backward, per-micro-batch statistics, clip + optimizer, finite check, metrics); "other" is the rest of
`update` (Python between them, zero_grad, loss counts). The bare step gets the same split.

The JSON line: value = asyncrl steps/s, baseline = bare steps/s, ratio = value / baseline = bare s / asyncrl s;
target 0.91 (asyncrl's step within 1.1x of the bare one).

    python benchmarks/train_step.py                   # first_digit's tiny Qwen2, 128 samples, 1 thread
    python benchmarks/train_step.py --threads 2
    python benchmarks/train_step.py --model small     # SmolLM2-135M's shape (random init), 16 samples
    python benchmarks/train_step.py --decoupled       # decoupled PPO (a proximal policy every step)
    python benchmarks/train_step.py --model small --mixed-precision bf16  # both sides under bf16 autocast
    python benchmarks/train_step.py --model small --logprob-chunk 256  # the head fused with the log-softmax
    python benchmarks/train_step.py --compare fused_adamw  # + a learner with torch's default AdamW, interleaved
    python benchmarks/train_step.py --model small --share-prompts --compare share_prompts  # + the padded layout
    python benchmarks/train_step.py --decoupled --compare prox_from_gradient_pass
    python benchmarks/train_step.py --compile         # + the bare step on a torch.compile'd model, interleaved
    python benchmarks/train_step.py --quick           # smoke run (used by the test)

--compile asks whether compiling pays, compile time included. A third side runs the bare step on
`torch.compile(model, dynamic=True)` (a copy of the same weights). Before timing it takes one step on each of
`--compile-widths` batches of other padded widths (shorter prompts, other seeds), as a run's steps differ: the
first call of each is timed, and their sum less as many eager bare steps is the compile time (tracing, codegen and
any recompilation a new width causes). The steady compiled step is then timed interleaved with the others, on the
main batch; break-even is compile time / (eager bare - compiled) steps. A fourth side is asyncrl's own Learner with
`trainer.compile` (its gradient forward compiled the same way), warmed up on the same batches: its compile time, its
step against the eager Learner's and against the compiled bare step, and its break-even. Each side compiles from
scratch (inductor's caches off, `--compile-cache` to allow them): what a run pays on a machine's first compile; a
later run of the same model on the same machine reuses the disk cache and compiles 3-4x faster.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.config.schema import AlgorithmConfig, TrainerConfig  # noqa: E402
from asyncrl.messages import Group, Trajectory  # noqa: E402
from asyncrl.training import learner as learner_module  # noqa: E402
from asyncrl.training import precision, schedule  # noqa: E402
from asyncrl.training.batch import GradientStats  # noqa: E402
from asyncrl.training.learner import Learner  # noqa: E402
from asyncrl.training.logprobs import shared_prompt_logprobs, token_logprobs  # noqa: E402
from asyncrl.training.optim import adamw  # noqa: E402
from asyncrl.training.sharing import share_prompts  # noqa: E402

PAD = 0
TARGET = 1 / 1.1

# name -> (transformers config class, kwargs, vocabulary size, default samples, prompt lengths, response lengths)
MODELS: dict[str, dict[str, Any]] = {
    # examples/tiny.toml + first_digit's 12-character vocabulary (+ specials): 16 tokens
    "tiny": dict(arch="qwen2", vocab=16, hidden=64, inter=128, layers=2, heads=4, kv=2,
                 samples=128, prompt=(5, 8), response=(1, 3)),
    # SmolLM2-135M's shape (Llama, hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152), random weights
    "small": dict(arch="llama", vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv=3,
                  samples=16, prompt=(24, 40), response=(8, 24)),
    # --quick: a 1-layer model, a few samples
    "quick": dict(arch="qwen2", vocab=16, hidden=32, inter=64, layers=1, heads=4, kv=2,
                  samples=8, prompt=(3, 5), response=(1, 3)),
}


def build_model(spec: dict[str, Any], seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if spec["arch"] == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cls(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["inter"],
              num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"],
              max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=PAD)
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def build_groups(model: torch.nn.Module, spec: dict[str, Any], samples: int, group_size: int,
                 seed: int) -> list[Group]:
    """Groups of trajectories, a random prompt per group (its samples' replies to it, as GRPO's) and random
    responses, the model's own logprobs as behaviour logprobs (an on-policy step, as with staleness 0), rewards
    0/1."""
    gen = torch.Generator().manual_seed(seed)
    vocab = spec["vocab"]
    trajs = []
    for i in range(samples):
        if i % group_size == 0:
            p = int(torch.randint(spec["prompt"][0], spec["prompt"][1] + 1, (1,), generator=gen))
            prompt = torch.randint(1, vocab, (p,), generator=gen).tolist()
        r = int(torch.randint(spec["response"][0], spec["response"][1] + 1, (1,), generator=gen))
        response = torch.randint(1, vocab, (r,), generator=gen).tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, p - 1 : p + r - 1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
        trajs.append(Trajectory(
            seq_id=i, group_id=i // group_size, group_size=group_size, prompt_ids=prompt, response_ids=response,
            loss_mask=[True] * r, behavior_logprobs=logp, versions=[0] * r, min_version=0, max_version=0,
            finish_reason="stop", reward=float(torch.rand((), generator=gen) > 0.5), temperature=1.0,
        ))
    return [Group(group_id=g, min_version=0, trajectories=trajs[g * group_size : (g + 1) * group_size])
            for g in range(samples // group_size)]


class BareStep:
    """The hand-written GRPO step on pre-padded tensors (module doc)."""

    def __init__(self, model: torch.nn.Module, groups: list[Group], algorithm: AlgorithmConfig,
                 trainer: TrainerConfig) -> None:
        trajs = [t for g in groups for t in g.trajectories]
        width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
        self.input_ids = torch.full((len(trajs), width), PAD, dtype=torch.long)
        self.attention = torch.zeros((len(trajs), width), dtype=torch.long)
        self.mask = torch.zeros((len(trajs), width), dtype=torch.bool)   # the response tokens' positions
        self.old = torch.zeros((len(trajs), width))
        for i, t in enumerate(trajs):
            p, n = len(t.prompt_ids), len(t.response_ids)
            self.input_ids[i, : p + n] = torch.tensor(t.prompt_ids + t.response_ids)
            self.attention[i, : p + n] = 1
            self.mask[i, p : p + n] = True
            self.old[i, p : p + n] = torch.tensor(t.behavior_logprobs)
        self.temperature = torch.tensor([t.temperature for t in trajs])
        self.rewards = torch.tensor([t.reward for t in trajs]).view(len(groups), -1)
        self.model, self.algorithm, self.trainer = model, algorithm, trainer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, trainer)
        self.timer: Callable[[str], Any] = _no_timer
        # trainer.share_prompts: the Learner's layout, built once like the padded tensors
        self.shared = share_prompts(self.input_ids, self.attention, self.mask) if trainer.share_prompts else None

    def __call__(self) -> None:
        eps, t = self.algorithm.clip_eps, self.timer
        with t("advantages"):
            r = self.rewards
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + self.algorithm.adv_eps)).view(-1, 1)
        with t("forward + logprobs"):
            kwargs = {"autocast": precision.autocast_dtype(self.trainer.mixed_precision),
                      "chunk": self.trainer.logprob_chunk_tokens, "float_head": self.trainer.lm_head_fp32}
            if self.shared is not None:
                kwargs["rows"] = self.shared
            fn = shared_prompt_logprobs if self.shared is not None else token_logprobs
            logp, _ = fn(self.model, self.input_ids, self.attention, self.mask, self.temperature, **kwargs)
        with t("policy loss + agg"):
            ratio = (logp - self.old).exp()
            loss_tok = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
            loss = (loss_tok * self.mask).sum() / self.mask.sum()
        with t("backward"):
            loss.backward()
        with t("clip + optimizer"):
            torch.nn.utils.clip_grad_norm_(self.params, self.trainer.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


class _Sections:
    """perf_counter sums by section name; nested sections are subtracted from their parent."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []

    def __call__(self, name: str) -> Any:
        sections = self

        class _Ctx:
            def __enter__(self) -> None:
                sections._stack.append([time.perf_counter(), 0.0])

            def __exit__(self, *exc: object) -> None:
                start, inner = sections._stack.pop()
                spent = time.perf_counter() - start
                sections.total[name] += spent - inner
                if sections._stack:
                    sections._stack[-1][1] += spent

        return _Ctx()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self(name):
                return fn(*args, **kwargs)
        return timed


class _NoTimer:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _no_timer(name: str) -> _NoTimer:
    return _NoTimer()


def instrument(learner: Learner, sections: _Sections) -> Callable[[], None]:
    """Wrap the Learner's pieces in timed sections; returns the undo."""
    undo: list[Callable[[], None]] = []

    def patch(owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        setattr(owner, attr, sections.wrap(name, original))
        had = attr in vars(owner) if not isinstance(owner, type) else True
        undo.append(lambda: setattr(owner, attr, original) if had else delattr(owner, attr))

    patch(learner_module, "flatten_groups", "flatten")
    patch(learner, "prepare", "prepare")
    patch(learner_module, "collate", "collate")
    patch(learner, "sequence_logprobs", "forward + logprobs")
    patch(learner, "_policy_loss_fn", "policy loss + agg")
    patch(learner, "_loss_agg_fn", "policy loss + agg")
    patch(torch.autograd, "backward", "backward")
    if hasattr(GradientStats, "record"):
        patch(GradientStats, "record", "statistics")
    else:  # the Learner before the statistics moved to GradientStats (the script also times older code)
        patch(learner, "_record", "statistics")
    patch(learner, "_optimizer_step", "clip + optimizer")
    patch(learner, "_check_finite", "finite check")
    patch(learner, "_metrics", "metrics")

    def restore() -> None:
        for u in reversed(undo):
            u()
    return restore


def breakdown(learner: Learner, bare: BareStep, groups: list[Group], repeats: int) -> tuple[dict, dict]:
    """Median seconds per section of each side over `repeats` instrumented calls (medians: the sections need
    not add up to the step's median)."""
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    for i in range(repeats):
        for side in _order(i):
            sections = _Sections()
            if side == "asyncrl":
                restore = instrument(learner, sections)
                try:
                    with sections("other"):
                        learner.update(groups)
                finally:
                    restore()
                ours.append(sections.total)
            else:
                bare.timer = sections
                try:
                    with sections("other"):
                        bare()
                finally:
                    bare.timer = _no_timer
                theirs.append(sections.total)
    return _medians(ours), _medians(theirs)


def width_variants(model: torch.nn.Module, spec: dict[str, Any], samples: int, group_size: int,
                   widths: int) -> list[list[Group]]:
    """`widths` batches: the first `widths - 1` with prompts up to 1, 2, ... tokens shorter than the spec's longest
    and other seeds (other padded widths, as a run's steps differ in length), the main batch (seed 1) last. A
    variant whose padded width another batch has already is drawn again with the next seed (a few tries)."""
    lo, hi = spec["prompt"]
    main = build_groups(model, spec, samples, group_size, seed=1)
    seen, batches = {_padded_width(main)}, []
    for j in range(widths - 1, 0, -1):
        shape = dict(spec, prompt=(lo, max(lo, hi - j)))
        for seed in range(1 + j, 1 + j + 20 * widths, widths):
            groups = build_groups(model, shape, samples, group_size, seed=seed)
            if _padded_width(groups) not in seen:
                break
        seen.add(_padded_width(groups))
        batches.append(groups)
    return [*batches, main]


def _padded_width(groups: list[Group]) -> int:
    return max(len(t.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories)


def compiled_bare(model: torch.nn.Module, batches: list[list[Group]], algorithm: AlgorithmConfig,
                  trainer: TrainerConfig) -> tuple[BareStep, list[float], list[int]]:
    """The bare step on a torch.compile'd copy of `model`, after one step on each of `batches` (width_variants).
    Returns it (on the last batch), the first call's seconds for each batch and each batch's padded width."""
    compiled = torch.compile(copy.deepcopy(model), dynamic=True)
    firsts, padded = [], []
    for groups in batches:
        step = BareStep(compiled, groups, algorithm, trainer)
        t0 = time.perf_counter()
        step()
        firsts.append(time.perf_counter() - t0)
        padded.append(step.input_ids.shape[1])
    return step, firsts, padded


def compiled_learner(model: torch.nn.Module, batches: list[list[Group]], algorithm: AlgorithmConfig,
                     trainer: TrainerConfig) -> tuple[Learner, list[float]]:
    """A Learner with `trainer.compile` on a copy of `model`, after one update on each of `batches`; returns it and
    each first update's seconds."""
    learner = Learner(copy.deepcopy(model), algorithm=algorithm, trainer=msgspec.structs.replace(trainer, compile=True),
                      pad_token_id=PAD)
    firsts = []
    for groups in batches:
        t0 = time.perf_counter()
        learner.update(groups)
        firsts.append(time.perf_counter() - t0)
    return learner, firsts


def break_even(compile_s: float, eager_s: float, compiled_s: float) -> float | None:
    """Steps after which compiling has paid for itself (None: the compiled step is not faster)."""
    return compile_s / (eager_s - compiled_s) if compiled_s < eager_s else None


def _medians(calls: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(c.get(k, 0.0) for c in calls) for k in {k for c in calls for k in c}}


def _default_adamw(learner: Learner) -> None:
    t = learner.trainer
    learner.optimizer = torch.optim.AdamW(learner._params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    learner.scheduler = schedule.build_scheduler(learner.optimizer, t)


def _proximal_forward(learner: Learner) -> None:
    learner._prox_from_first_pass = lambda n: False  # type: ignore[method-assign]


def _padded_prompts(learner: Learner) -> None:
    learner.trainer = msgspec.structs.replace(learner.trainer, share_prompts=False)


# --compare: the speed-ups that can be turned off on a built Learner (the others replaced code outright; their
# before/after figures are in benchmarks/README.md)
LEVERS: dict[str, Callable[[Learner], None]] = {"fused_adamw": _default_adamw,
                                                "prox_from_gradient_pass": _proximal_forward,
                                                "share_prompts": _padded_prompts}


def _order(i: int, sides: list[str] | None = None) -> list[str]:
    """bare, asyncrl, asyncrl, bare, ... (three sides: rotated): the call after a switch of model pays for memory
    the other side freed (about 20 ms at the tiny shape), so each side takes each place equally often."""
    sides = sides or ["bare", "asyncrl"]
    if len(sides) == 2:
        return sides if i % 2 == 0 else sides[::-1]
    k = i % len(sides)
    return sides[k:] + sides[:k]


def gc_counter() -> dict[int, int]:
    """Counts of the garbage collector's runs from now on, by generation (gc.callbacks)."""
    import gc

    counts: dict[int, int] = defaultdict(int)

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            counts[info["generation"]] += 1
    gc.callbacks.append(on_gc)
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["tiny", "small"], default="tiny")
    p.add_argument("--samples", type=int, default=None, help="samples per step (default: the model's)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=60, help="timed calls per side (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--decoupled", action="store_true", help="algorithm.decoupled = true (proximal logprobs)")
    p.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                   help="trainer.mixed_precision of both sides: bf16 runs the forward (and backward) under bf16 "
                        "autocast, fp32 master weights (the bare side too)")
    p.add_argument("--logprob-chunk", type=int, default=0,
                   help="trainer.logprob_chunk_tokens of both sides (0: the whole LM head at once)")
    p.add_argument("--share-prompts", action="store_true",
                   help="trainer.share_prompts on both sides: each group's prompt computed once (training/sharing.py)")
    p.add_argument("--compare", choices=sorted(LEVERS), default=None,
                   help="also time a second asyncrl learner with this speed-up turned off, interleaved with the others")
    p.add_argument("--compile", action="store_true",
                   help="also time the bare step on a torch.compile'd model, with its compile time (module doc)")
    p.add_argument("--compile-cache", action="store_true",
                   help="let each compile use inductor's caches (the second side then reuses the first's graphs; "
                        "default: both compile from scratch, as on a machine's first run)")
    p.add_argument("--compile-widths", type=int, default=4,
                   help="batches of different padded widths the compiled model sees before timing (default 4)")
    p.add_argument("--quick", action="store_true", help="a 1-layer model, 8 samples, 3 repeats")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    name = "quick" if args.quick else args.model
    spec = MODELS[name]
    samples = args.samples or spec["samples"]
    group_size = min(args.group_size, samples)
    repeats, warmup = (3, 1) if args.quick else (args.repeats, args.warmup)
    if samples % group_size:
        raise SystemExit(f"--samples {samples} must be a multiple of --group-size {group_size}")

    model = build_model(spec, seed=0)
    groups = build_groups(model, spec, samples, group_size, seed=1)
    algorithm = AlgorithmConfig(advantage="grpo", policy_loss="ppo_clip", loss_agg="token-mean", clip_eps=0.2,
                                decoupled=args.decoupled)
    trainer = TrainerConfig(lr=1e-4, grad_clip=1.0, mini_batches=1, micro_batch_size=samples,
                            mixed_precision=args.mixed_precision, logprob_chunk_tokens=args.logprob_chunk,
                            share_prompts=args.share_prompts)
    learner = Learner(copy.deepcopy(model), algorithm=algorithm, trainer=trainer, pad_token_id=PAD)
    bare = BareStep(model, groups, algorithm, trainer)
    collections = gc_counter()

    params = sum(p.numel() for p in model.parameters())
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories)
    print(f"model {name}: {params:,} parameters, {samples} samples, {tokens / samples:.1f} tokens/sample, "
          f"{args.threads} thread(s), decoupled={args.decoupled}, mixed_precision={args.mixed_precision}, "
          f"share_prompts={args.share_prompts}, "
          f"{repeats} timed calls per side")

    for _ in range(warmup):
        bare()
        learner.update(groups)
    times: dict[str, list[float]] = {"bare": [], "asyncrl": []}
    step = {"bare": bare, "asyncrl": lambda: learner.update(groups)}
    if args.compare:
        off = Learner(copy.deepcopy(model), algorithm=algorithm, trainer=trainer, pad_token_id=PAD)
        LEVERS[args.compare](off)
        times[f"{args.compare} off"] = []
        step[f"{args.compare} off"] = lambda: off.update(groups)
        for _ in range(warmup):
            off.update(groups)
    if args.compile:
        batches = width_variants(model, spec, samples, group_size, max(args.compile_widths, 1))
        # both sides compile the same model's forward: without this the second would reuse the first's graphs
        # (in memory and on disk), and with a warm disk cache from an earlier run both compile times would be short
        torch._inductor.config.force_disable_caches = not args.compile_cache
        compiled, firsts, padded = compiled_bare(model, batches, algorithm, trainer)
        torch._dynamo.reset()
        ours_compiled, our_firsts = compiled_learner(model, batches, algorithm, trainer)
        times["bare compiled"], times["asyncrl compiled"] = [], []
        step["bare compiled"] = compiled
        step["asyncrl compiled"] = lambda: ours_compiled.update(groups)
        for _ in range(warmup):
            compiled()
            ours_compiled.update(groups)
    for i in range(repeats):  # interleaved, so load from other processes hits both sides alike
        for side in _order(i, list(step)):
            t0 = time.perf_counter()
            step[side]()
            times[side].append(time.perf_counter() - t0)
    bare_s, ours_s = statistics.median(times["bare"]), statistics.median(times["asyncrl"])
    print(f"\nbare step     {bare_s * 1e3:8.2f} ms (median)")
    p90 = statistics.quantiles(times["asyncrl"], n=10)[-1] if repeats > 1 else ours_s
    print(f"asyncrl step  {ours_s * 1e3:8.2f} ms (median)  = {ours_s / bare_s:.2f}x the bare step "
          f"(p90 {p90 / bare_s:.2f}x)")
    print(f"garbage collector runs during the run, by generation: {dict(sorted(collections.items()))}")
    if args.compare:
        off_s = statistics.median(times[f"{args.compare} off"])
        print(f"asyncrl with {args.compare} off  {off_s * 1e3:8.2f} ms (median)  = {off_s / bare_s:.2f}x the bare "
              f"step, {off_s / ours_s:.2f}x asyncrl's")
    extra: dict[str, Any] = {}
    if args.compile:
        comp_s, ours_comp_s = statistics.median(times["bare compiled"]), statistics.median(times["asyncrl compiled"])
        compile_s = max(sum(firsts) - len(firsts) * bare_s, 0.0)
        our_compile_s = max(sum(our_firsts) - len(our_firsts) * ours_s, 0.0)
        steps, our_steps = break_even(compile_s, bare_s, comp_s), break_even(our_compile_s, ours_s, ours_comp_s)
        print(f"bare compiled {comp_s * 1e3:8.2f} ms (median)  = {comp_s / bare_s:.2f}x the eager bare step; "
              f"compile {compile_s:.1f} s over {len(firsts)} batches of padded widths {padded} (first calls "
              + ", ".join(f"{f:.1f}" for f in firsts) + " s); "
              + (f"pays for itself after {steps:,.0f} steps" if steps is not None else "never pays for itself"))
        print(f"asyncrl with trainer.compile {ours_comp_s * 1e3:8.2f} ms (median)  = {ours_comp_s / ours_s:.2f}x the "
              f"eager asyncrl step, {ours_comp_s / comp_s:.2f}x the compiled bare step; compile {our_compile_s:.1f} s "
              "(first calls " + ", ".join(f"{f:.1f}" for f in our_firsts) + " s); "
              + (f"pays for itself after {our_steps:,.0f} steps" if our_steps is not None
                 else "never pays for itself"))
        extra = {"compiled_ms": round(comp_s * 1e3, 3), "compile_s": round(compile_s, 2),
                 "compile_break_even_steps": None if steps is None else round(steps),
                 "asyncrl_compiled_ms": round(ours_comp_s * 1e3, 3), "asyncrl_compile_s": round(our_compile_s, 2),
                 "asyncrl_compiled_over_bare_compiled": round(ours_comp_s / comp_s, 3),
                 "asyncrl_compile_break_even_steps": None if our_steps is None else round(our_steps)}

    ours, theirs = breakdown(learner, bare, groups, max(repeats // 2, 1))
    print("\nwhere the time goes (ms per step, instrumented calls, median of each section):")
    print(f"{'section':<22}{'asyncrl':>10}{'bare':>10}")
    for key in sorted(set(ours) | set(theirs), key=lambda k: -ours.get(k, 0.0)):
        print(f"{key:<22}{ours.get(key, 0.0) * 1e3:>10.2f}{theirs.get(key, 0.0) * 1e3:>10.2f}")
    print(f"{'total':<22}{sum(ours.values()) * 1e3:>10.2f}{sum(theirs.values()) * 1e3:>10.2f}")

    result = {"benchmark": "train_step", "value": round(1 / ours_s, 3), "unit": "steps/s",
              "baseline": round(1 / bare_s, 3), "ratio": round(bare_s / ours_s, 3), "target": round(TARGET, 3), **extra}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
