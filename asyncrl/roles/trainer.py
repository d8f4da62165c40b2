"""Trainer role: takes one step's groups from the train store (in admission order, through the staleness
gate), runs the update, and sends the new weights to the generators.

Place in the dataflow: train store (ReplayBuffer) ──► **Trainer** (Learner) ──► weight broadcast ──► Generators.
The order of take, update and send, and how they overlap, is the step pipeline's (asyncrl/pipeline.py,
`UpdatePipeline`); this role adds the step's metrics, evaluation and the checkpoint. Waiting on
`take_step` is the trainer's idle time on the gate; the update runs on a worker thread so the actor can
still answer `stats()` while it trains.

A plain async class: no Ray here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

from asyncrl.checkpoints import store as checkpoint
from asyncrl.pipeline import LEDGER_KEY, StepSource, UpdatePipeline
from asyncrl.rewards.combine import component_means
from asyncrl.roles.evaluator import Evaluator
from asyncrl.roles.trainer_ranks import RankedLearner
from asyncrl.telemetry.memory import peak_memory_metrics
from asyncrl.telemetry.metrics import (
    Max,
    ProcessCpu,
    RoleStats,
    generator_staleness_stats,
    process_cpu_metrics,
    rss_mb,
    staleness_stats,
    token_staleness_stats,
)
from asyncrl.telemetry.rollouts import ROLLOUTS_KEY, train_samples
from asyncrl.telemetry.spans import SpanRecorder
from asyncrl.training import sharded
from asyncrl.training.learner import Learner
from asyncrl.training.lora import export_lora
from asyncrl.training.parallel import copy_weights
from engines.base import SleepableEngine
from transports.base import WeightSender

log = logging.getLogger(__name__)


class Trainer:
    # this role's process's CPU for its window (`<role>/cpu_cores`): given by the Ray actor built for it (RoleActor)
    process_cpu: ProcessCpu | None = None

    def __init__(
        self,
        *,
        learner: Learner,
        buffer: StepSource,
        evaluator: Evaluator | None = None,
        recorder: SpanRecorder | None = None,
        decode: Callable[[list[int]], str] | None = None,
        rollouts_every: int = 0,
        eval_model: Any = None,
    ) -> None:
        self.learner = learner
        # trainer.parallel = "fsdp2": the evaluator's engine runs on its own unsharded copy of the policy, which
        # takes the weights rank 0 gathered after the last change before each evaluation (a sharded forward
        # on rank 0 alone would wait forever for the other ranks)
        self.eval_model = eval_model
        self.decode = decode  # token ids -> text, for the samples of rollouts.jsonl
        self.rollouts_every = rollouts_every if decode is not None else 0
        self.buffer = buffer
        self.evaluator = evaluator
        self.recorder = recorder or SpanRecorder("trainer")
        # prefetch → update → send → release, in step order (asyncrl/pipeline.py)
        self.pipeline = UpdatePipeline(learner=learner, source=buffer, recorder=self.recorder)
        self.ranks: RankedLearner | None = None  # trainer.num_ranks > 1: the other ranks train each step too

    async def attach_ranks(self, ranks: RankedLearner) -> None:
        """Rank 0 of several (asyncrl/roles/trainer_ranks.py): from now on every update and restore runs on every
        rank, and the sends read the weights gathered after it. Before the weight-sync group forms."""
        self.ranks = self.pipeline.learner = ranks
        await ranks.gather_weights()

    @property
    def version(self) -> int:
        return self.learner.version

    @property
    def sender(self) -> WeightSender | None:
        return self.pipeline.sender

    @sender.setter
    def sender(self, sender: WeightSender | None) -> None:
        self.pipeline.sender = sender

    async def train_step(self, step: int, *, prefetch: bool = False) -> dict[str, float]:
        """Train step `step` (the learner holds version `step`; afterwards `step + 1`) and start the send
        of the new weights, whose statistics `send_weights()` returns. `prefetch`: step + 1 follows, so its
        groups are taken while this one trains. Steps asked for ahead of time wait for the one before."""
        out = await self.pipeline.train_step(step, prefetch=prefetch)
        metrics = out.metrics
        trajs = [t for g in out.groups for t in g.trajectories]
        metrics.update(staleness_stats([step - t.min_version for t in trajs]))
        # which generator sampled what was trained, and how stale (generator/<i>/staleness/mean, ...)
        metrics.update(generator_staleness_stats((t.generator_id, step - t.min_version) for t in trajs))
        token_lags = [step - v for t in trajs for v in t.versions]
        metrics.update(token_staleness_stats(token_lags))  # staleness/token_mean, staleness/token_hist/<k>
        # trajectories whose tokens came from more than one policy version (in-flight weight swaps)
        metrics["rollout/multi_version_share"] = sum(t.max_version > t.min_version for t in trajs) / max(1, len(trajs))
        metrics["rollout/kv_reused_share"] = sum(t.kv_reused for t in trajs) / max(1, len(trajs))
        metrics["trainer/gate_wait_s"] = out.gate_wait_s
        metrics["trainer/tokens_per_s"] = metrics.get("trainer/tokens", 0.0) / max(out.train_s, 1e-9)
        metrics["reward/mean"] = metrics.get("trainer/reward_mean", 0.0)
        metrics.update(component_means(t.reward_components for t in trajs))  # reward/<name> of each component
        # what was trained, for the run's ledger (the Controller takes it out of the row: ledger.jsonl)
        metrics[LEDGER_KEY] = [[g.group_id, g.trajectories[0].prompt_text[:200] if g.trajectories else ""]
                               for g in out.groups]
        if self.rollouts_every and (step + 1) % self.rollouts_every == 0 and self.decode is not None:
            metrics[ROLLOUTS_KEY] = train_samples(trajs, self.decode)  # rollouts.jsonl (the Controller writes it)
        return metrics

    async def send_weights(self) -> dict[str, Any]:
        """The statistics of the oldest send `train_step` started and no one claimed yet; with none,
        broadcast the current weights (stamped with the current version) now."""
        return dict(await self.pipeline.send_weights())

    async def evaluate(self) -> dict[str, float]:
        if self.evaluator is None:
            return {}
        t0 = self.recorder.begin("eval")
        if self.eval_model is not None:
            copy_weights(self.eval_model, dict(self.pipeline.learner.state_dict_for_sync()))
        # The evaluation's K/V cache (every held-out prompt at once, to the longest reply) is the trainer's memory
        # between evaluations: an engine that can sleep gives it back after each one and allocates it again on wake.
        engine = getattr(self.evaluator, "engine", None)
        sleeps = isinstance(engine, SleepableEngine)
        if sleeps:
            await engine.wake()
        try:
            out = await self.evaluator.evaluate()
        finally:
            if sleeps:
                await engine.sleep()
        self.recorder.record("eval", t0, time.time(), self.learner.version)
        return out

    def teacher_forced_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                                temperature: float = 1.0) -> list[float]:
        """The trainer's logprobs of a fixed sequence (the reference an engine's logprobs must match)."""
        # a forward of a sharded model on rank 0 alone would wait forever for the other ranks
        if self.ranks is not None and self.learner.dp.mode == "fsdp2":
            raise RuntimeError("teacher_forced_logprobs: not available with trainer.parallel = 'fsdp2'")
        return self.learner.teacher_forced_logprobs(prompt_ids, response_ids, temperature)

    @property
    def sharded(self) -> bool:
        """trainer.parallel = "fsdp2" over several ranks: no rank holds the whole model (training/sharded.py)."""
        return self.ranks is not None and self.learner.dp.mode == "fsdp2"

    async def save_state(self, root: str, *, step: int, config_text: str, extra: dict[str, Any],
                         keep_last: int) -> str:
        """A durable checkpoint of the current version under `root` (asyncrl/checkpoints/store.py): the learner's
        state, this process's RNG and the caller's `extra` state (the buffer's, the Controller's). Called
        between steps, when no update runs; written off the event loop. Sharded: every rank writes its shards
        into the checkpoint's folder before this rank seals it (training/sharded.py)."""
        tensors, state = self.learner.checkpoint_state()
        tensors["rng"], state["rng"] = checkpoint.rng_state()
        state.update(extra)
        ranks = self.ranks
        write = (lambda tmp: ranks.save_shards(str(tmp / sharded.SHARDS))) if self.sharded and ranks else None
        path = await asyncio.to_thread(checkpoint.save, root, step=step, version=self.learner.version,
                                       config_text=config_text, tensors=tensors, state=state, keep_last=keep_last,
                                       write=write)
        return str(path)

    async def load_state(self, path: str) -> int:
        """Continue from the checkpoint at `path` (verified first: a corrupted one is never loaded)."""
        ck = await asyncio.to_thread(checkpoint.load, path)

        def restore() -> None:
            self.learner.restore_state(ck.tensors, ck.state, shards=ck.path / sharded.SHARDS)
            checkpoint.set_rng_state(ck.tensors["rng"], ck.state["rng"])

        if self.ranks is None:
            restore()
        else:  # every rank loads the same checkpoint (DDP: rank 0's state is every rank's; fsdp2: its shards)
            await self.ranks.load_state(path, restore)
        return self.learner.version

    def save_checkpoint(self, path: str, tokenizer: Any = None, dtype: str | None = None) -> str:
        """Write an HF-loadable folder (config + safetensors [+ tokenizer]) of the current weights, cast to
        `dtype` (asyncrl.deploy.build.export_dtype; None = as trained), with the critic and the Safe-RLHF multiplier.
        LoRA: the merged weights, and the adapter alone in `adapter/` (training/lora.py `export_lora`). Sharded:
        every rank joins the gather of the full weights, and this rank writes the one folder. On a worker thread."""
        if self.sharded and self.ranks is not None:
            policy, *critic = self.ranks.full_copies()  # unsharded copies on CPU, built for the export
            out = checkpoint.export_hf(policy, path, tokenizer=tokenizer, dtype=dtype, copy_model=False)
            for model in critic:  # PPO's value model, beside the policy
                model.save_pretrained(out / "critic", safe_serialization=True)
        elif self.learner.lora:
            out = export_lora(self.learner.model, path, tokenizer=tokenizer, dtype=dtype)
        else:
            out = checkpoint.export_hf(self.learner.model, path, tokenizer=tokenizer, dtype=dtype)
            if self.learner.critic is not None:  # PPO's value model, beside the policy
                self.learner.critic.save(out / "critic")
        if self.learner.lagrange is not None:  # Safe-RLHF multiplier, to resume with
            (out / "safety.json").write_text(json.dumps(self.learner.lagrange.state_dict()))
        return str(out)

    def stats(self) -> RoleStats:
        """The trainer's spans and its process's peak memory since its previous `stats()` call (its per-step
        metrics come with each `train_step`)."""
        metrics = {"trainer/rss_mb": Max(rss_mb()), **process_cpu_metrics("trainer", self.process_cpu),
                   **peak_memory_metrics("trainer", "trainer")}
        return RoleStats(metrics=metrics, spans=self.recorder.drain())

