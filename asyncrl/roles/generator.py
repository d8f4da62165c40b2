"""Generator role: admits prompt groups through the staleness gate, samples them with the rollout engine,
and puts the finished trajectories on the rollout queue.

Place in the dataflow: PromptStream ──► **Generator** (engine) ──► rollout queue (ReplayBuffer) ──► Scorer.
Weights arrive from the Trainer through a WeightReceiver into a staging copy while generation goes on;
the engine swaps them in at a decode-step boundary (in flight) or once the groups in flight are done
(between requests), never in the middle of a forward pass.

Colocated placement (`cluster.placement = "colocated"`): the step pipeline calls `sleep()` before each train
step and `wake()` after the weight sync. `sleep` stops admitting, lets every group whose sampling has begun
finish (groups admitted meanwhile, e.g. by an admit that was waiting, hold their slot and are sampled after
`wake`: nothing admitted is dropped), then the engine releases its K/V cache (`SleepableEngine`). While asleep
no group and no `generate` call reaches the engine; weights still arrive and land in it.

The role is three parts, each testable alone with fakes: the admission loop here (admit through the gate,
sample, put), the weight slot (asyncrl/roles/weight_slot.py: receive, stage, swap) and the sleep gate
(asyncrl/roles/sleep_gate.py: who uses the engine, sleep and wake).

A plain async class: no Ray here. The Ray actor in `asyncrl/deploy/actors.py` only adds lifecycle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable, NamedTuple, Protocol

import msgspec

from asyncrl.aio import Coalescer, until_either
from asyncrl.data.prompts import Prompt
from asyncrl.messages import Completion, SamplingParams, Trajectory
from asyncrl.roles.decoding import decode_many
from asyncrl.roles.sleep_gate import SleepGate
from asyncrl.roles.weight_slot import WeightSlot
from asyncrl.telemetry.memory import peak_memory_metrics
from asyncrl.telemetry.metrics import (
    Max,
    Mean,
    Metric,
    ProcessCpu,
    Rate,
    RoleStats,
    Share,
    Sum,
    Total,
    Window,
    process_cpu_metrics,
    rss_mb,
)
from asyncrl.telemetry.spans import SpanRecorder
from engines.base import RolloutEngine
from transports.base import WeightReceiver

log = logging.getLogger(__name__)


class GroupSource(Protocol):
    """The part of the ReplayBuffer a generator talks to."""

    async def admit(self, max_groups: int, version: int, timeout: float | None = None,
                    holder: str | None = None) -> list[int]:
        """`holder` names this generator: if it dies, the groups it still holds are released (supervision)."""
        ...
    async def put_rollouts(self, trajs: list[Trajectory]) -> None:
        """Whole groups only: each group's trajectories together, one group after another."""
        ...
    async def release_groups(self, group_ids: list[int], reason: str, detail: str = "") -> None:
        """`detail`: why, in a few words (the run's no-progress error quotes the last distinct ones)."""
        ...
    async def note_held(self, version: int, holder: str | None = None) -> None:
        """This generator (`holder`) holds `version` now: its admit waiting at an older version goes on at
        `version` (other generators' admits return early, to ask again at their own)."""
        ...


class _Begun(NamedTuple):
    """A group `Generator._begin_together` posted (row, its JSON, prompt, completions), or why it could not."""

    row: dict[str, Any] | None = None
    row_json: bytes = b""
    prompt: Prompt | None = None
    completions: Awaitable[list[list[Completion]]] | None = None
    error: Exception | None = None


class Generator:
    # this role's process's CPU for its window (`<role>/cpu_cores`): given by the Ray actor built for it (RoleActor)
    process_cpu: ProcessCpu | None = None

    def __init__(
        self,
        *,
        generator_id: int,
        engine: RolloutEngine,
        buffer: GroupSource,
        prompt_row: Callable[[int], dict[str, Any]],
        encode: Callable[[dict[str, Any]], Prompt],
        sampling: SamplingParams,
        concurrency: int = 16,
        weight_update: str = "in_flight",
        greedy_baseline: bool = False,
        group_seed: Callable[[int], int] | None = None,
        recorder: SpanRecorder | None = None,
        prompts_filtered: int = 0,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.generator_id = generator_id
        self.engine = engine
        self.buffer = buffer
        self.prompt_row = prompt_row  # group id -> its dataset row (asyncrl.data.rows.PromptStream.row)
        self.encode = encode  # row -> its Prompt (asyncrl.data.prompts.PromptEncoder.encode)
        # token ids -> the text the reward function sees (asyncrl.deploy.build.tokenizer_fns): each completion leaves
        # with its text, so the scorer needs no tokenizer of its own (None: the scorer decodes)
        self.decode = decode
        self.sampling = sampling
        self.concurrency = concurrency
        self.recorder = recorder or SpanRecorder(f"generator/{generator_id}")
        self.holder = f"generator/{generator_id}"  # its name at the buffer (a restarted actor gets a fresh one)
        self.episodes: Any = None  # an asyncrl.envs.EpisodeRunner: play env episodes instead of completions
        # the estimator's AlgorithmNeeds.greedy_baseline (ReMax): also decode each prompt greedily into
        # baseline_response_ids, which the scorer scores into baseline_reward
        self.greedy_baseline = greedy_baseline
        # rollout.seed_groups: group id -> the seed of its samples' own random streams (reproducible runs)
        self.group_seed = group_seed
        self._stopped = asyncio.Event()
        self.weights = WeightSlot(engine, self.recorder, on_held=self._note_held, stopped=self._stopped,
                                  weight_update=weight_update, name=f"generator {generator_id}")
        self.gate = SleepGate(engine, self.recorder, stopped=self._stopped, name=f"generator {generator_id}")
        self._failure: BaseException | None = None  # an uncontained group-task error: ends run()
        self.tokens_generated = 0  # since the start; stats() reports each window's increment
        self.samples_generated = 0  # trajectories sampled, since the start
        self.prompts_truncated = 0  # prompts cut to max_prompt_len (data.overlong = "truncate_left"), since the start
        self.prompts_filtered = prompts_filtered  # dataset rows left out at load (data.overlong = "filter")
        self._window = Window()
        # groups that finish while a put is in flight go to the buffer together, in the next put (one actor
        # call for a burst instead of one per group)
        self._puts = Coalescer(lambda trajs: self.buffer.put_rollouts(trajs))
        # groups whose sampling is not over: `concurrency` bounds these (a group waiting for its put holds no
        # engine slot; the gate bounds how many groups are admitted at all)
        self._sampling = 0
        self._slot_freed = asyncio.Event()
        # the newest version noted to the buffer (`_note_held`): with in-flight updates that is done when the
        # weights arrive, before the swap lands, so that the admit round trip overlaps the swap; groups the
        # buffer admits at it are sampled only once the engine holds it (`WeightSlot.until_holding`)
        self._noted = -1

    # -- weights (asyncrl/roles/weight_slot.py) -----------------------------------------------------
    @property
    def receiver(self) -> WeightReceiver | None:
        """The weight-sync group's receiving half, set by the deployment when this generator joins it."""
        return self.weights.receiver

    @receiver.setter
    def receiver(self, receiver: WeightReceiver | None) -> None:
        self.weights.receiver = receiver

    @property
    def weight_group(self) -> str:
        """The name of the weight-sync group `receiver` belongs to (supervision re-forms it under a new name)."""
        return self.weights.group

    @weight_group.setter
    def weight_group(self, name: str) -> None:
        self.weights.group = name

    @property
    def weight_update(self) -> str:
        return self.weights.weight_update

    @weight_update.setter
    def weight_update(self, mode: str) -> None:
        self.weights.weight_update = mode

    @property
    def swap_s_total(self) -> float:
        return self.weights.swap_s_total

    async def receive_weights(self, *, armed: bool = False, group: str | None = None) -> dict[str, Any]:
        """Take part in one broadcast: receive into staging off the event loop (generation goes on).
        Called by the step pipeline (asyncrl/pipeline.py, `StepPipeline`).

        `armed` (only where `can_arm_receive()`): called ahead of the trainer's send; wait for it as long as
        it takes, without the group's timeout. `group`: the group the caller made this receive for; refused
        if this generator is in another one (a group re-formed meanwhile must not count it)."""
        return dict(await self.weights.receive(armed, group))

    def can_arm_receive(self) -> bool:
        """Whether `receive_weights()` may be called before the trainer sends (`WeightSlot.can_arm`)."""
        return self.weights.can_arm()

    def _note_held(self, version: int) -> None:
        """Tell the buffer this generator holds `version` (or will, once the swap under way lands), so the run
        loop's admit, waiting at the older version, goes on at the new one (not only after the controller's
        publish, a few round trips later). Fire and forget: publish wakes it anyway."""
        self._noted = max(self._noted, version)
        task = asyncio.ensure_future(self.buffer.note_held(version, holder=self.holder))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or log.warning("generator %d: note_held(%d) failed: %r", self.generator_id,
                                              version, t.exception()))

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample outside the training loop (inspection, checks, agent loops) on the newest weights; while the
        generator sleeps (colocated placement), waits for `wake`."""
        if not await self.gate.use():
            raise RuntimeError(f"generator {self.generator_id} stopped")
        try:
            await self.weights.apply_pending()
            return await self.engine.generate(prompts, params)
        finally:
            self.gate.let_go()

    # -- sleep / wake (colocated placement: asyncrl/roles/sleep_gate.py) --------------------------------
    async def sleep(self) -> None:
        """Stop admitting, wait until no group is being sampled, then let the engine release its K/V cache.
        Groups admitted but not begun wait for `wake` with their slots held. A no-op while asleep."""
        await self.gate.sleep()

    async def wake(self) -> None:
        """Let the engine take its memory back and resume admitting and sampling. A no-op while awake."""
        await self.gate.wake()

    @property
    def asleep(self) -> bool:
        return not self.gate.awake

    # -- main loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Generate until stop(), keeping up to `concurrency` groups being sampled.

        Each admitted group is its own task; the engine batches the decode steps of all of them
        (continuous batching), so a group whose sampling ends frees its slot for the next admission at once
        (its put to the buffer may still be under way).
        Weights: with `weight_update == "in_flight"` a received update is swapped into the engine at its
        next decode-step boundary (sequences carry on and span versions); with "between_requests" the
        loop stops admitting, lets the groups in flight finish, then swaps.
        """
        inflight: set[asyncio.Future] = set()
        try:
            while not self._stopped.is_set():
                if self._failure is not None:
                    raise self._failure
                if not self.gate.awake:  # asleep (colocated placement): admit nothing until wake
                    await self.gate.until_awake_or_stopped()
                    continue
                if self.weights.pending is not None and (self.weight_update == "between_requests"
                                                         or not self._sampling):
                    while self._sampling and not self._stopped.is_set():
                        await self._until_slot_freed()
                    await self.weights.apply_pending()
                free = self.concurrency - self._sampling
                if free <= 0:
                    await self._until_slot_freed()
                    continue
                version = self.engine.version
                t0 = self.recorder.begin("wait_gate")
                group_ids = await self.buffer.admit(free, version, timeout=0.5, holder=self.holder)
                self.recorder.record("wait_gate", t0, time.time(), version)
                # the buffer admits at the version this generator noted (`note_held`) while the admit waited,
                # which the engine may still be swapping to: sampled once it holds it, at the engine's version
                if group_ids and self.engine.version < self._noted:
                    await self.weights.until_holding(self._noted)
                    if self._stopped.is_set():  # the run ends: these stay running at the gate (as at a crash)
                        break
                version = self.engine.version
                begun = self._begin_together(group_ids)  # their engine calls posted at once (an exact batch)
                for gid in group_ids:  # [] on timeout, a newer published version, or a closed gate
                    self._sampling += 1  # given back by the task once its sampling is over
                    task = asyncio.ensure_future(self._generate_groups([gid], version, begun.get(gid)))
                    inflight.add(task)
                    task.add_done_callback(lambda t: self._group_done(t, inflight))
        finally:
            if inflight:
                _, pending = await asyncio.wait(inflight, timeout=10)
                for task in pending:
                    task.cancel()

    async def _until_slot_freed(self) -> None:
        """Until a group's sampling ends (its slot is free), a group task failed, or stop()."""
        self._slot_freed.clear()
        await until_either(self._slot_freed, self._stopped)

    def _free_slot(self) -> None:
        self._sampling -= 1
        self._slot_freed.set()

    def _group_done(self, task: asyncio.Future, inflight: set[asyncio.Future]) -> None:
        """A group task ended. Its expected faults are contained inside it; anything else (the buffer refusing
        a put while the run goes on) would leave its group running at the gate forever, so it ends `run`
        with that error (the runtime reports a dead generator loop) instead of vanishing unretrieved."""
        inflight.discard(task)
        self._slot_freed.set()  # a failure below ends the loop's wait too
        if task.cancelled() or task.exception() is None:
            return
        if self._stopped.is_set():  # the run is over: nothing waits for this group any more
            log.warning("generator %d: a group failed at shutdown: %r", self.generator_id, task.exception())
        elif self._failure is None:
            self._failure = task.exception()

    async def _play_groups(self, group_ids: list[int], version: int, done_sampling: Callable[[], None]) -> None:
        """Env episodes (asyncrl/envs/runner.py): env faults are contained per episode by the runner."""
        try:
            rows = [self.prompt_row(gid) for gid in group_ids]
            t0 = self.recorder.begin("generate", "env episodes")
            groups = await asyncio.gather(*[self.episodes.run_group(gid, row, self.sampling.n, self.generator_id)
                                            for gid, row in zip(group_ids, rows)])
            self.recorder.record("generate", t0, time.time(), version)
        except Exception as exc:  # contained: the groups fail, their slots return, the run goes on
            log.warning("generator %d: episodes of %d groups failed: %s", self.generator_id, len(group_ids), exc)
            await self._release_failed(group_ids, f"env episodes: {type(exc).__name__}: {exc}")
            return
        done_sampling()
        trajs = [t for group in groups for t in group]
        self.tokens_generated += sum(sum(t.loss_mask) for t in trajs)
        self.samples_generated += len(trajs)
        await self._put_rollouts(trajs, version)

    async def _generate_groups(self, group_ids: list[int], version: int, begun: _Begun | None = None) -> None:
        """Sample the admitted groups (waiting for `wake` while asleep) and queue their rollouts. The run loop
        counted them in `_sampling`; the slot is given back once sampling is over (or failed). `begun`: the
        group's engine call, posted by `_begin_together` (which counted it as an engine user)."""
        slot = True

        def free_slot() -> None:
            nonlocal slot
            if slot:
                slot = False
                self._free_slot()

        try:
            if begun is None and not await self.gate.use():  # stopped while asleep: the slots go back
                free_slot()
                await self._release_failed(group_ids, "generator stopped before sampling")
                return
            held = True

            def done_sampling() -> None:  # once the engine's part is over (the put after it may wait on the queue)
                nonlocal held
                if held:
                    held = False
                    self.gate.let_go()
                free_slot()

            try:
                await self._sample_groups(group_ids, version, done_sampling, begun)
            finally:
                done_sampling()
        finally:
            free_slot()

    async def _sample_groups(self, group_ids: list[int], version: int, done_sampling: Callable[[], None],
                             begun: _Begun | None = None) -> None:
        if self.episodes is not None:  # multi-turn environment episodes instead of single completions
            await self._play_groups(group_ids, version, done_sampling)
            return
        try:  # a bad row, a failing encode or engine error fails these groups, never the loop
            if begun is not None and begun.error is not None:
                raise begun.error
            prepared = [begun[:3]] if begun is not None else [self._prepare(gid) for gid in group_ids]
            rows, row_jsons, prompts = map(list, zip(*prepared))
            t0 = self.recorder.begin("generate")
            completions, baselines = (await begun.completions, [[]]) if begun is not None and begun.completions \
                else await self._sample([p.ids for p in prompts], group_ids)
            self.recorder.record("generate", t0, time.time(), version)
        except Exception as exc:  # contained: the groups fail, their slots return, the run goes on
            log.warning("generator %d: generation of %d groups failed: %s", self.generator_id, len(group_ids), exc)
            await self._release_failed(group_ids, f"generation: {type(exc).__name__}: {exc}")
            return
        done_sampling()
        self.prompts_truncated += sum(p.truncated for p in prompts)
        trajs: list[Trajectory] = []
        for gid, prompt, row_json, group, base in zip(group_ids, prompts, row_jsons, completions, baselines):
            for j, c in enumerate(group):
                trajs.append(self._trajectory(gid, j, prompt, row_json, c))
                trajs[-1].baseline_response_ids = base
        self._attach_texts(trajs)
        self.tokens_generated += sum(len(t.response_ids) for t in trajs)
        self.samples_generated += len(trajs)
        await self._put_rollouts(trajs, version)

    async def _put_rollouts(self, trajs: list[Trajectory], version: int) -> None:
        """Queue finished rollouts (waits for room). After stop() the buffer is closing and refuses puts
        (QueueClosed, or its Ray-wrapped form): the run is over, so the rollouts are dropped quietly."""
        t0 = self.recorder.begin("wait_queue", "rollout queue full")
        try:
            await self._puts.add(trajs)
        except Exception as exc:
            if not self._stopped.is_set():
                raise
            log.debug("generator %d: %d rollouts dropped at shutdown (%s)", self.generator_id, len(trajs),
                      type(exc).__name__)
            return
        self.recorder.record("wait_queue", t0, time.time(), version)

    async def _release_failed(self, group_ids: list[int], why: str) -> None:
        """Return the slots of failed groups (the buffer counts them: `buffer/failed`, and keeps `why`); after stop()
        a closing buffer may refuse, which no longer matters."""
        try:
            await self.buffer.release_groups(group_ids, "failed", why)
        except Exception:
            if not self._stopped.is_set():
                raise

    def _prepare(self, gid: int) -> tuple[dict[str, Any], bytes, Prompt]:
        row = self.prompt_row(gid)  # its row, the row's JSON (for its trajectories), its encoded prompt
        return row, json.dumps(row).encode(), self.encode(row)

    def _sampling_of(self, group_ids: list[int]) -> SamplingParams:
        if self.group_seed is not None and len(group_ids) == 1:
            return msgspec.structs.replace(self.sampling, seed=self.group_seed(group_ids[0]))
        return self.sampling

    def _begin_together(self, group_ids: list[int]) -> dict[int, _Begun]:
        """Post the engine calls of groups admitted together at once, before their tasks start, so every run
        batches them alike however the loop's thread is delayed (an exact resume). Native engine (`submit_many`),
        completions, no greedy baseline, awake; else {}. A group whose row, prompt or engine check fails carries
        its error to its own task. Each group counts as an engine user (`SleepGate.hold`)."""
        submit = getattr(self.engine, "submit_many", None)
        if (len(group_ids) < 2 or submit is None or self.episodes is not None or self.greedy_baseline
                or not self.gate.awake):
            return {}
        out: dict[int, _Begun] = {}
        ready: list[tuple[int, dict[str, Any], bytes, Prompt]] = []
        for gid in group_ids:
            try:
                ready.append((gid, *self._prepare(gid)))
            except Exception as exc:  # noqa: BLE001 - contained by the group's own task
                out[gid] = _Begun(error=exc)
        try:
            waits = submit([([p.ids], self._sampling_of([gid])) for gid, _, _, p in ready])
        except Exception as exc:  # noqa: BLE001 - nothing was posted: every group fails with it, as its own call would
            out.update({gid: _Begun(error=exc) for gid, _, _, _ in ready})
        else:
            out.update({gid: _Begun(row, row_json, p, w) for (gid, row, row_json, p), w in zip(ready, waits)})
        self.gate.hold(len(out))
        return out

    async def _sample(self, prompts: list[list[int]],
                      group_ids: list[int]) -> tuple[list[list[Completion]], list[list[int]]]:
        """The training samples of each prompt and, with `greedy_baseline` (ReMax), its greedy completion (else []).

        Both requests go to the engine together, so its continuous batching decodes them in the same
        batch; the greedy completion is never trained, only scored (the ReMax baseline). With `group_seed`,
        the samples of a single group draw from streams seeded by its id: the same tokens whatever the
        batch, the generator or the run (an exact resume regenerates a group in flight as it was)."""
        sampling = self._sampling_of(group_ids)
        if not self.greedy_baseline:
            return await self.engine.generate(prompts, sampling), [[] for _ in prompts]
        greedy = msgspec.structs.replace(self.sampling, n=1, temperature=0.0, seed=None)
        completions, greedy_out = await asyncio.gather(self.engine.generate(prompts, sampling),
                                                       self.engine.generate(prompts, greedy))
        return completions, [g[0].response_ids for g in greedy_out]

    def _attach_texts(self, trajs: list[Trajectory]) -> None:
        """Each trajectory's `response_text` (and a ReMax baseline's `baseline_text`, once a group), decoded here."""
        if self.decode is None or not trajs:
            return
        for t, text in zip(trajs, decode_many(self.decode, [t.response_ids for t in trajs])):
            t.response_text = text
        baselines: dict[int, str] = {}
        for t in trajs:
            if t.baseline_response_ids:
                if t.group_id not in baselines:
                    baselines[t.group_id] = self.decode(t.baseline_response_ids)
                t.baseline_text = baselines[t.group_id]

    def _trajectory(self, group_id: int, j: int, prompt: Prompt, row_json: bytes, c: Completion) -> Trajectory:
        n = self.sampling.n
        return Trajectory(
            seq_id=group_id * n + j,  # group ids are unique per run (the gate hands them out)
            group_id=group_id,
            group_size=n,
            prompt_ids=c.prompt_ids,
            response_ids=c.response_ids,
            loss_mask=[True] * len(c.response_ids),
            behavior_logprobs=c.logprobs,
            versions=c.versions,
            min_version=min(c.versions) if c.versions else self.engine.version,
            max_version=max(c.versions) if c.versions else self.engine.version,
            finish_reason=c.finish_reason,
            truncated=c.finish_reason == "length",
            prompt_truncated=c.prompt_truncated or prompt.truncated,
            temperature=self.sampling.temperature,
            prompt_text=prompt.text,
            row_json=row_json,
            kv_reused=c.kv_reused,
            routed_experts=c.routed_experts,
            routing_shape=c.routing_shape,
            generator_id=self.generator_id,
        )

    def stop(self) -> None:
        self._stopped.set()

    def stats(self) -> RoleStats:
        """This generator's window, since its previous `stats()` call: tokens and samples sampled (all
        generators' and its own, `generator/<i>/...`), the generation stall from weight swaps (the engine's
        own pause record where it keeps one, else the time `load_weights` took), its process's peak memory,
        and its spans."""
        engine_stats = self.engine.stats() if hasattr(self.engine, "stats") else {}
        stall = self._window.take("stall_s", engine_stats.get("engine/swap_pause_s/sum", self.swap_s_total))
        tokens = self._window.take("tokens", self.tokens_generated)
        samples = self._window.take("samples", self.samples_generated)
        truncated = self._window.take("prompts_truncated", self.prompts_truncated)
        own = f"generator/{self.generator_id}"
        occupancy: dict[str, Metric] = {}
        if "engine/decode_forwards" in engine_stats and "engine/decode_tokens" in engine_stats:
            forwards = self._window.take("decode_forwards", engine_stats["engine/decode_forwards"])
            batch = self._window.take("decode_tokens", engine_stats["engine/decode_tokens"]) / max(forwards, 1.0)
            slots = self.concurrency * self.sampling.n  # sequences the generator may hold at once
            if forwards:  # weighted by decode forwards: a mean over every decode step of every generator
                occupancy = {"generation/decode_batch": Mean(batch, weight=forwards),
                             "generation/occupancy": Mean(batch / slots, weight=forwards)}
        loop = getattr(self.engine, "scheduler", None)  # the native engine's: its threads, where a tuner picks them
        threads = loop.num_threads if getattr(loop, "tuner", None) is not None else 0
        return RoleStats(metrics={
            "generation/tokens_per_s": Rate(tokens),
            f"{own}/tokens_per_s": Rate(tokens),
            f"{own}/samples_per_s": Rate(samples),
            "generation/stall_s": Sum(stall),
            "generation/stall_s_total": Total(stall),
            "generation/stall_share": Share(stall),  # of the generators' time in the step's window
            **occupancy,
            "generator/rss_mb": Max(rss_mb()),
            **process_cpu_metrics("generator", self.process_cpu),
            **({"generator/torch_threads": Max(threads)} if threads else {}),
            "data/truncated_prompts": Total(truncated),
            "data/filtered_overlong": Max(self.prompts_filtered),  # the same rows in every generator
            **peak_memory_metrics("generator", f"generator/{self.generator_id}"),
        }, spans=self.recorder.drain())
