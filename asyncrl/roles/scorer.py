"""Scorer role: takes whole groups off the rollout queue, computes rewards, assembles the groups and hands
them to training — or returns their admission slots when they are filtered or failed.

Place in the dataflow: rollout queue ──► **Scorer** (reward functions, reward model) ──► train store ──► Trainer.
The reward runs behind `Rewards` (asyncrl/rewards/base.py): weighted components — functions on worker
threads or the event loop of this process, or, with `reward.isolation = "process"`, in worker processes that
a hung or crashing reward cannot take down with it, and a reward model. Each call carries the sample's
finish reason and token count. The total fills `Trajectory.reward`, the named components
`Trajectory.reward_components`. A reward call that raises, returns garbage, hangs past `reward.timeout_s`
or dies with its worker fails its sample; the group it belongs to completes as a failed group (slots
returned to the gate, counted) and the run goes on.

Algorithm extras (docs/algorithms.md), each off unless configured:
- Safe-RLHF: the cost function is called like the reward function (same containment) and fills
  `Trajectory.cost`
  — also for episodes that bring their own reward (`env_reward`, e.g. submitted to `asyncrl.Runtime`).
- ReMax: a group whose trajectories carry the generator's greedy completion (`baseline_response_ids`)
  gets it scored once, into every member's `baseline_reward`.
- KL to a reference: with a `ReferencePolicy` the scorer fills `Trajectory.ref_logprobs` (a forward pass
  on a worker thread, off the trainer's critical path).
- Dynamic sampling (DAPO) / `filter_zero_variance`: a group whose rewards are all equal is released as
  "filtered"; the gate then admits a fresh prompt in its place, so the step still gets its full
  `prompts_per_step` groups.

A plain async class: no Ray here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from asyncrl.messages import Group, Trajectory
from asyncrl.rewards.base import Call, Rewards
from asyncrl.roles.decoding import decode_many
from asyncrl.telemetry.memory import peak_memory_metrics
from asyncrl.telemetry.metrics import Max, ProcessCpu, Rate, RoleStats, Sum, Total, Window, process_cpu_metrics, rss_mb
from asyncrl.telemetry.spans import SpanRecorder
from buffers.grouping import GroupAssembler

if TYPE_CHECKING:
    from asyncrl.training.reference import ReferencePolicy

log = logging.getLogger(__name__)


class ScoreSink(Protocol):
    """The part of the ReplayBuffer a scorer talks to."""

    async def get_rollouts(self, max_items: int, timeout: float | None = None,
                           holder: str | None = None) -> list[Trajectory]:
        """Whole groups only, up to `max_items` trajectories (always at least the oldest group); `holder`
        names this scorer: if it dies, the groups it took are released (supervision)."""
        ...
    async def accept_groups(self, groups: list[Group]) -> None: ...
    async def release_groups(self, group_ids: list[int], reason: str, detail: str = "") -> None:
        """`detail`: why, in a few words (the run's no-progress error quotes the last distinct ones)."""
        ...


class Scorer:
    # this role's process's CPU for its window (`<role>/cpu_cores`): given by the Ray actor built for it (RoleActor)
    process_cpu: ProcessCpu | None = None

    def __init__(
        self,
        *,
        scorer_id: int,
        buffer: ScoreSink,
        rewards: Rewards,
        decode: Callable[[list[int]], str],
        filter_zero_variance: bool = False,
        batch: int = 256,
        recorder: SpanRecorder | None = None,
        reference: ReferencePolicy | None = None,
    ) -> None:
        self.scorer_id = scorer_id
        self.buffer = buffer
        self.rewards = rewards  # the reward (and cost) function; closed when `run` ends
        self.decode = decode
        self.filter_zero_variance = filter_zero_variance
        self.batch = batch  # trajectories per get_rollouts: whole groups, at least one
        self.reference = reference
        self.recorder = recorder or SpanRecorder(f"scorer/{scorer_id}")
        self.assembler = GroupAssembler()
        self.holder = f"scorer/{scorer_id}"  # its name at the buffer (a restarted actor gets a fresh one)
        self._stopped = asyncio.Event()
        # since the start (stats() reports each window's increment); groups accepted, filtered or failed
        # are counted once, by the buffer
        self.counts = {"scored": 0, "reward_errors": 0, "cost_errors": 0, "baselines_scored": 0,
                       "baseline_errors": 0}
        self._window = Window()

    async def run(self) -> None:
        try:
            while not self._stopped.is_set():
                t0 = self.recorder.begin("wait_queue", "rollout queue")
                trajs = await self.buffer.get_rollouts(self.batch, timeout=0.5, holder=self.holder)
                self.recorder.record("wait_queue", t0, time.time())
                if trajs:
                    await self.score_batch(trajs)
        finally:  # nothing scores after the loop: its reward workers (reward.isolation = "process") end too
            self.rewards.close()

    async def score_batch(self, trajs: list[Trajectory]) -> None:
        t0 = self.recorder.begin("score", "reward fn")
        done: list[Group] = []
        await self._score_all(trajs)
        if self.reference is not None:
            await self._fill_ref_logprobs(trajs)
        for traj in trajs:
            group = self.assembler.add(traj)
            if group is not None:
                done.append(group)
        for g in done:
            if g.trajectories[0].baseline_response_ids and all(t.finish_reason != "error" for t in g.trajectories):
                await self._score_baseline(g)
        self.recorder.record("score", t0, time.time())
        accepted: list[Group] = []
        released: dict[tuple[str, str], list[int]] = {}  # (kind, why) -> group ids
        for g in done:
            errors = [t.error or "a sample ended with finish_reason 'error'" for t in g.trajectories
                      if t.finish_reason == "error"]
            if errors:
                released.setdefault(("failed", errors[0]), []).append(g.group_id)
            elif self.filter_zero_variance and len({t.reward for t in g.trajectories}) == 1:
                why = f"zero reward variance: every reward of the group is {g.trajectories[0].reward:g}"
                released.setdefault(("filtered", why), []).append(g.group_id)
            else:
                accepted.append(g)
        t0 = self.recorder.begin("wait_queue", "train store")
        for (kind, why), ids in sorted(released.items()):  # failed before filtered
            await self.buffer.release_groups(ids, kind, why)
        if accepted:
            await self.buffer.accept_groups(accepted)
        self.recorder.record("wait_queue", t0, time.time())

    async def _score_all(self, trajs: list[Trajectory]) -> None:
        """Rewards (and costs) of a batch, through `Rewards.score`; a call that raises, returns garbage, hangs
        or dies with its worker fails its sample."""
        scored: list[Trajectory] = []
        rows: dict[bytes, dict[str, Any]] = {}  # a group's samples share their row: parsed once
        for traj in trajs:
            self.counts["scored"] += 1
            if traj.finish_reason == "error":
                continue
            if traj.env_reward is not None and not self.rewards.has_cost:  # an env episode brings its own reward
                traj.reward = traj.env_reward
                continue
            scored.append(traj)
            if traj.row_json not in rows:
                rows[traj.row_json] = json.loads(traj.row_json) if traj.row_json else {}
        texts = self._texts(scored)
        # (trajectory, completion, row); each sample its own copy of the row, as the reward function may change it
        todo = [(t, text, dict(rows[t.row_json])) for t, text in zip(scored, texts)]
        # an episode submitted to asyncrl.Runtime brings its reward: only its cost is ours
        need_reward = [(t, c, r) for t, c, r in todo if t.env_reward is None]
        for t, _, _ in todo:
            if t.env_reward is not None:
                t.reward = t.env_reward
        await self._call("reward", need_reward)
        if self.rewards.has_cost:
            await self._call("cost", [(t, c, r) for t, c, r in todo if t.finish_reason != "error"])

    def _texts(self, trajs: list[Trajectory]) -> list[str]:
        """The completions' text: the generator's (`response_text`), else decoded here, in one call where the decode
        has `many` (asyncrl.deploy.build.tokenizer_fns)."""
        texts = [t.response_text for t in trajs]
        todo = [i for i, text in enumerate(texts) if text is None]
        for i, text in zip(todo, decode_many(self.decode, [trajs[i].response_ids for i in todo])):
            texts[i] = text
        return texts  # type: ignore[return-value]

    async def _call(self, what: str, items: list[tuple[Trajectory, str, dict[str, Any]]]) -> None:
        if not items:
            return
        calls = [Call(t.prompt_text, c, r, t.finish_reason, len(t.response_ids)) for t, c, r in items]
        results = await self.rewards.score(calls, cost=what == "cost")
        for (traj, _, _), result in zip(items, results):
            if isinstance(result, BaseException):  # user code: contain, count, fail the group
                self._fail(traj, what, result)
            elif what == "reward":
                traj.reward, traj.reward_components = result.total, dict(result.components)
            else:
                traj.cost = result.total

    def _fail(self, traj: Trajectory, what: str, exc: BaseException) -> None:
        reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
        key = f"{what}_errors"
        self.counts[key] += 1
        if self.counts[key] <= 5:
            log.warning("scorer %d: %s failed for seq %d (%s)", self.scorer_id, what, traj.seq_id, reason)
        traj.finish_reason = "error"
        traj.error = f"{what}: {reason}"

    async def _score_baseline(self, group: Group) -> None:
        """ReMax: reward of the group's greedy completion, once, into every member; a failure fails the group."""
        first = group.trajectories[0]
        row = json.loads(first.row_json) if first.row_json else {}
        completion = (first.baseline_text if first.baseline_text is not None
                      else self.decode(first.baseline_response_ids))
        # the greedy completion's finish reason is not known here: a function that names it gets no value for it
        call = Call(first.prompt_text, completion, row, None, len(first.baseline_response_ids))
        [value] = await self.rewards.score([call])
        if isinstance(value, BaseException):  # user code: the group cannot be trained without its baseline
            self._fail(first, "baseline", value)  # counted and logged once per group
            for t in group.trajectories[1:]:
                t.finish_reason, t.error = "error", first.error
            return
        self.counts["baselines_scored"] += 1
        for t in group.trajectories:
            t.baseline_reward = value.total

    async def _fill_ref_logprobs(self, trajs: list[Trajectory]) -> None:
        """Reference logprobs of every scored trajectory, on a worker thread (the loop keeps serving)."""
        ok = [t for t in trajs if t.finish_reason != "error" and t.response_ids]
        if not ok:
            return
        assert self.reference is not None
        t0 = self.recorder.begin("reference")
        rows = await asyncio.to_thread(self.reference.response_logprobs, ok)
        for t, logprobs in zip(ok, rows):
            t.ref_logprobs = logprobs
        self.recorder.record("reference", t0, time.time())

    def stop(self) -> None:
        self._stopped.set()

    def stats(self) -> RoleStats:
        """This scorer's window, since its previous `stats()` call: samples scored, reward calls that
        failed, and its spans; reward calls hung now (past the timeout, still on their threads)."""
        take = self._window.take
        return RoleStats(metrics={
            "scorer/samples_per_s": Rate(take("scored", self.counts["scored"])),
            "scorer/reward_errors": Total(take("reward_errors", self.counts["reward_errors"])),
            "scorer/reward_calls_hung": Sum(float(self.rewards.hung_calls)),
            "scorer/rss_mb": Max(rss_mb()),
            **process_cpu_metrics("scorer", self.process_cpu),
            **peak_memory_metrics("scorer", f"scorer/{self.scorer_id}"),
        }, spans=self.recorder.drain())
