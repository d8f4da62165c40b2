"""Trainer role: takes one step's groups from the train queue (in admission order, through the staleness
gate), runs the update, and sends the new weights to the generators.

Place in the dataflow: train queue (ReplayHub) ──► **Trainer** (Learner) ──► weight broadcast ──► Generators.
Waiting on `take_step` is the trainer's idle time on the gate; the update itself runs on a worker thread
so the actor can still answer `stats()` while it trains.

A plain async class: no Ray here.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol

import torch

from asyncrl.aio import discard, retrieve
from asyncrl.messages import Group
from asyncrl.roles.evaluator import Evaluator
from asyncrl.roles.learner import Learner
from asyncrl.telemetry.metrics import RoleStats, staleness_stats, token_staleness_stats
from asyncrl.telemetry.spans import SpanRecorder

log = logging.getLogger(__name__)


class StepSource(Protocol):
    """The part of the ReplayHub the trainer talks to."""

    async def take_step(self, step: int, timeout: float | None = None) -> list[Group]: ...


class WeightSender(Protocol):
    def send(self, tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]: ...


class Trainer:
    def __init__(
        self,
        *,
        learner: Learner,
        hub: StepSource,
        evaluator: Evaluator | None = None,
        recorder: SpanRecorder | None = None,
    ) -> None:
        self.learner = learner
        self.hub = hub
        self.evaluator = evaluator
        self.sender: WeightSender | None = None
        self.recorder = recorder or SpanRecorder("trainer")
        self._prefetch: tuple[int, asyncio.Future] | None = None  # (step, its take_step), started early
        self._sending: asyncio.Future | None = None    # the send of the current weights, while it reads them
        self._released = asyncio.Event()  # set once that send no longer reads the weights (or ended)
        self._unclaimed: deque[asyncio.Future] = deque()  # sends train_step started, for send_weights()
        # train steps asked for ahead of time run one at a time, in step order (not arrival order: a Ray
        # actor may start two calls in either order)
        self._turn = asyncio.Condition()
        self._busy = False
        self._failed: BaseException | None = None  # the last train step that raised (wakes the ones after it)

    @property
    def version(self) -> int:
        return self.learner.version

    async def train_step(self, step: int, *, send: bool = False, prefetch: bool = False) -> dict[str, float]:
        """Train step `step` (the learner holds version `step`); afterwards the version is step + 1.

        `prefetch`: once this step's groups are taken, start taking step + 1's from the hub, so they
        travel while this step trains (the caller promises to train step + 1). `send`: start the
        broadcast of the new weights as soon as the update ends; `send_weights()` returns its statistics.
        A send still in flight (it reads the weights) is waited for before the update. Steps asked for
        ahead of time wait for the one before them (in the order asked).
        """
        async with self._turn:
            await self._turn.wait_for(lambda: self._failed is not None
                                      or (not self._busy and self.learner.version >= step))
            if self.learner.version < step:  # woken by a failure: the steps before this one will not come
                raise RuntimeError(f"train_step({step}): an earlier train step failed ({self._failed!r})")
            self._busy, self._failed = True, None
        try:
            return await self._train_step(step, send, prefetch)
        except Exception as exc:
            self._failed = exc
            raise
        finally:
            async with self._turn:
                self._busy = False
                self._turn.notify_all()

    async def _train_step(self, step: int, send: bool, prefetch: bool) -> dict[str, float]:
        await self._wait_send()
        if step != self.learner.version:
            raise RuntimeError(f"train_step({step}) but the trainer holds version {self.learner.version}")
        t0, c0 = time.time(), time.process_time()
        groups = await self._take(step)
        t1, c1 = time.time(), time.process_time()
        # process CPU time beside the wall time: in process it is every role's, so the planner can tell
        # computing from waiting in the gate wait (generation + scoring) and in the update
        self.recorder.record("wait_gate", t0, t1, step, cpu_s=c1 - c0)
        if prefetch:
            task = asyncio.ensure_future(self.hub.take_step(step + 1))
            task.add_done_callback(retrieve)  # a take never claimed (a failure elsewhere) warns nobody
            self._prefetch = (step + 1, task)
        metrics = await asyncio.to_thread(self.learner.update, groups)
        t2, c2 = time.time(), time.process_time()
        self.recorder.record("train", t1, t2, step, cpu_s=c2 - c1)
        if send:
            self._unclaimed.append(self._begin_send())
        trajs = [t for g in groups for t in g.trajectories]
        metrics.update(staleness_stats([step - t.min_version for t in trajs]))
        token_lags = [step - v for t in trajs for v in t.versions]
        metrics.update(token_staleness_stats(token_lags))  # staleness/token_mean, staleness/token_hist/<k>
        # trajectories whose tokens came from more than one policy version (in-flight weight swaps)
        metrics["rollout/multi_version_share"] = sum(t.max_version > t.min_version for t in trajs) / max(1, len(trajs))
        metrics["rollout/kv_reused_share"] = sum(t.kv_reused for t in trajs) / max(1, len(trajs))
        metrics["trainer/gate_wait_s"] = t1 - t0
        metrics["trainer/tokens_per_s"] = metrics.get("trainer/tokens", 0.0) / max(t2 - t1, 1e-9)
        metrics["reward/mean"] = metrics.get("trainer/reward_mean", 0.0)
        return metrics

    async def _take(self, step: int) -> list[Group]:
        """Step `step`'s groups: the prefetched ones if they are that step's, else take them now."""
        pending, self._prefetch = self._prefetch, None
        if pending is not None:
            if pending[0] == step:
                return await pending[1]
            discard(pending[1])  # not this step's (a caller that broke its promise): take afresh
        return await self.hub.take_step(step)

    async def send_weights(self) -> dict[str, float]:
        """Broadcast the current weights (stamped with the current version) to every generator.

        If `train_step(send=True)` already started this broadcast, wait for it and return its statistics.
        """
        task = self._unclaimed.popleft() if self._unclaimed else None  # the oldest send no one asked for yet
        if task is None:
            await self._wait_send()
            task = self._begin_send()
        return await asyncio.shield(task)

    def _begin_send(self) -> asyncio.Future:
        if self.sender is None:
            raise RuntimeError("trainer has no weight sender; set up the weight-sync group first")
        sender, version, tensors = self.sender, self.learner.version, self.learner.state_dict_for_sync()
        loop, released = asyncio.get_running_loop(), asyncio.Event()
        call = sender.send
        if getattr(sender, "releases_early", False):  # it says when it stops reading the weights
            call = functools.partial(sender.send, released=lambda: loop.call_soon_threadsafe(released.set))

        async def send() -> dict[str, float]:
            t0 = time.time()
            try:
                stats = await asyncio.to_thread(call, tensors, version)
            finally:
                released.set()
            self.recorder.record("weights_send", t0, time.time(), version)
            return stats

        task = asyncio.ensure_future(send())
        task.add_done_callback(retrieve)  # its caller (send_weights) reports a failure
        self._sending, self._released = task, released
        return task

    async def _wait_send(self) -> None:
        """Wait until a send in flight no longer reads the weights the next update would change: its end,
        or earlier where the sender says so (the collective sender, once it has packed its last bucket;
        the broadcast of that copy goes on beside the update)."""
        task = self._sending
        if task is None:
            return
        released = asyncio.ensure_future(self._released.wait())
        try:
            await asyncio.wait({task, released}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            released.cancel()
        if not task.done():
            return  # released: still broadcasting its own copy (its outcome goes to send_weights' caller)
        if self._sending is task:
            self._sending = None
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            raise RuntimeError(f"the weight send before this step failed: {exc}") from exc

    async def evaluate(self) -> dict[str, float]:
        if self.evaluator is None:
            return {}
        t0 = time.time()
        out = await self.evaluator.evaluate()
        self.recorder.record("eval", t0, time.time(), self.learner.version)
        return out

    def teacher_forced_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                                temperature: float = 1.0) -> list[float]:
        """The trainer's logprobs of a fixed sequence (the reference an engine's logprobs must match)."""
        return self.learner.teacher_forced_logprobs(prompt_ids, response_ids, temperature)

    def save_checkpoint(self, path: str, tokenizer: Any = None) -> str:
        """Write an HF-loadable folder (config + safetensors [+ tokenizer])."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.learner.model.save_pretrained(out, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        if self.learner.critic is not None:  # PPO's value model, beside the policy
            self.learner.critic.save(out / "critic")
        if self.learner.lagrange is not None:  # Safe-RLHF multiplier, to resume with
            (out / "safety.json").write_text(json.dumps(self.learner.lagrange.state_dict()))
        return str(out)

    def stats(self) -> RoleStats:
        """The trainer's spans since its previous `stats()` call (its per-step metrics come with each
        `train_step`)."""
        return RoleStats(spans=self.recorder.drain())

