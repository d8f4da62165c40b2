"""The Controller: runs the dataflow built from one Config until `trainer.total_steps`, then stops it.

```
 loop        consumes                    produces                 waits for                 unblocked by
 ─────────── ─────────────────────────── ──────────────────────── ───────────────────────── ──────────────────────────
 Generator   prompt rows, gate slots     trajectories → rollout q  gate capacity (staleness) publish(v), returned slots
 Scorer      rollout queue               groups → train store      trajectories              generators
 Trainer     P oldest groups (take_step) new weights, version v+1  the P oldest groups done  scorers accepting groups
 Controller  step results                broadcast, publish(v+1),  the trainer's step        train_step returning
                                         metrics.jsonl row
```

Each train step: `train_step(s)` (it takes step s+1's groups from the hub while it trains, and starts
the broadcast of version s+1 when its update ends; `train_step(s+1)` is asked for at the same time and
waits in the trainer behind it) → every generator joins the broadcast (their receives were armed during
the step; all members of the collective take part together) → `train_step(s+1)` updates once the send
released the weights (while the generators swap) → `publish(s+1)` on the gate once every generator
holds it → (every `eval_every` steps) held-out evaluation, before the next step is asked for → the
roles' statistics of step s's window are gathered (while step s+1 trains) → one metrics row. Generators
and scorers run their own loops the whole time, so generation of later versions overlaps training up to
the staleness bound.

The Controller talks to roles through `Deployment`: in-process objects (`LocalDeployment`, here) or Ray
actors behind async proxies (`asyncrl.launch.RayDeployment`). It never imports Ray.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Protocol

from asyncrl.aio import discard
from asyncrl.config import config_to_toml
from asyncrl.config_schema import Config
from asyncrl.telemetry.loggers import MetricSink, build_sinks, close_sinks, live_enabled
from asyncrl.telemetry.metrics import RoleStats, WindowReducer
from asyncrl.telemetry.spans import Span, busy_shares, overlap_ratio
from asyncrl.telemetry.summary import summarize_rows
from asyncrl.telemetry.trace import TraceWriter

log = logging.getLogger(__name__)


class Deployment(Protocol):
    """Where the roles live. Each attribute exposes the role's async methods."""

    hub: Any
    trainer: Any
    generators: list[Any]
    scorers: list[Any]

    async def setup_weight_sync(self) -> None: ...
    async def save_checkpoint(self, path: str) -> None: ...
    async def shutdown(self) -> None: ...


class RoleFailed(RuntimeError):
    pass


class Controller:
    def __init__(self, cfg: Config, deployment: Deployment, *, run_dir: str | Path | None = None,
                 config_text: str | None = None) -> None:
        self.cfg = cfg
        self.d = deployment
        self.run_dir = Path(run_dir or cfg.run.output_dir)
        self.config_text = config_text
        self._loops: list[asyncio.Future] = []
        self._spans: list[Span] = []
        self._reducer = WindowReducer()  # the roles' window reports -> row values (and running totals)
        self._trace: TraceWriter | None = None
        self._window_end = 0.0
        self._next_train: asyncio.Future | None = None  # the next train step, started early (_one_step)
        self._arm = False  # every generator's receive may wait for the send (Generator.can_arm_receive)
        self._armed: list[asyncio.Future] | None = None  # the generators' receives of the next version
        self.rows: list[dict[str, Any]] = []

    async def run(self) -> list[dict[str, Any]]:
        cfg, d = self.cfg, self.d
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # always: `asyncrl report` and `asyncrl plan` read the run's settings from it
        (self.run_dir / "config.toml").write_text(self.config_text if self.config_text is not None
                                                  else config_to_toml(cfg))
        t_start = time.time()
        sinks: list[MetricSink] = []
        quiet = live_enabled(cfg.logging.live)  # the live view replaces the progress lines
        try:
            sinks = build_sinks(cfg, self.run_dir)  # inside try: a missing logger package still shuts down
            if cfg.logging.trace:
                self._trace = TraceWriter(self.run_dir / "trace.json", origin=t_start)
            await d.setup_weight_sync()
            self._arm = all(await asyncio.gather(*[g.can_arm_receive() for g in d.generators]))
            self._loops = [asyncio.ensure_future(r.run()) for r in [*d.generators, *d.scorers]]
            if cfg.trainer.eval_every > 0:
                first = {"step": 0, "version": 0, "time/elapsed_s": time.time() - t_start}
                first.update(await self._guard(d.trainer.evaluate()))
                _log_row(sinks, first)
                self.rows.append(first)
            t_prev = time.time()
            for step in range(cfg.trainer.total_steps):
                row = await self._one_step(step, t_start, t_prev)
                t_prev = self._window_end
                _log_row(sinks, row)
                self.rows.append(row)
                if not quiet and ((step + 1) % cfg.run.log_every == 0 or step + 1 == cfg.trainer.total_steps):
                    log.info(_progress_line(row, cfg.trainer.total_steps))
            summary = self._summary(t_start)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if cfg.run.save_checkpoint:
                await d.save_checkpoint(str(self.run_dir / "checkpoint"))
            return self.rows
        finally:
            if self._next_train is not None:  # a step started before a failure (or Ctrl-C) elsewhere
                discard(self._next_train)
                self._next_train = None
            for f in self._armed or []:  # (an armed receive ends when its group is closed at shutdown)
                discard(f)
            self._armed = None
            close_sinks(sinks)
            if self._trace is not None:
                self._trace.close()
            try:
                await self._stop_loops()
            finally:  # whatever stopping the loops raised (a dead actor, a cancellation), kill the actors
                await d.shutdown()

    async def _one_step(self, step: int, t_start: float, t_prev: float) -> dict[str, Any]:
        d = self.d
        train, self._next_train = self._next_train, None  # started at the end of the previous step, if any
        receives, self._armed = self._armed, None  # armed at the end of the previous step, if any
        if receives is None and self._arm:  # the first step: arm now, while it trains
            receives = [asyncio.ensure_future(g.receive_weights(armed=True)) for g in d.generators]
        if train is None:
            train = asyncio.ensure_future(self._train(step))
        version = step + 1
        every = self.cfg.trainer.eval_every
        eval_due = every > 0 and (version % every == 0 or version == self.cfg.trainer.total_steps)
        more = version < self.cfg.trainer.total_steps
        if more and not eval_due:  # (an evaluation reads the trainer's weights: it goes first)
            # Asked for now, it waits in the trainer behind this step (train steps run one at a time, in
            # order) and starts the moment this step's update ended and its send released the weights,
            # without a round trip through the controller.
            self._next_train = asyncio.ensure_future(self._train(version))
        try:
            metrics = await self._guard(train)
        except BaseException:
            for f in receives or []:  # a failed step: its armed receives are not awaited below
                discard(f)
            raise
        # The broadcast: the trainer started sending when its update ended (train_step(send=True)); every
        # generator receives into staging (armed during the step where it can wait for the send: then it
        # joins at once, else it is called now) and then swaps at its next decode-step boundary (KV
        # recompute included). The next step, asked for above, updates once the send released the
        # weights, while the generators still swap; its groups were prefetched during this step. They were
        # admitted by the gate at the versions the generators held, so the staleness bound holds as before.
        if receives is None:
            receives = [asyncio.ensure_future(g.receive_weights()) for g in d.generators]
        try:
            sent = await self._guard(d.trainer.send_weights())
            await self._guard(asyncio.gather(*receives))
        finally:
            for f in receives:  # a failure above: no stray receive left running
                discard(f)
        if more and self._arm:  # the next version's receives wait for its send while the next step trains
            self._armed = [asyncio.ensure_future(g.receive_weights(armed=True)) for g in d.generators]
        await self._guard(d.hub.publish(version))
        row: dict[str, Any] = {"step": version, "version": version, "time/elapsed_s": time.time() - t_start}
        row.update(metrics)
        row.update(dict(sent))
        if eval_due:
            row.update(await self._guard(d.trainer.evaluate()))
        t_end = time.time()
        if more and self._next_train is None:  # after an evaluation
            # Start the next step now and gather this window's role statistics while it runs: they are
            # bookkeeping, not part of the dataflow, and would otherwise idle the trainer every step.
            self._next_train = asyncio.ensure_future(self._train(version))
        row.update(await self._role_metrics(t_prev, t_end))
        row["time/step_s"] = t_end - t_prev  # the step's window; consecutive windows tile the loop
        row["throughput/samples_per_s"] = metrics.get("trainer/samples", 0.0) / max(t_end - t_prev, 1e-9)
        self._window_end = t_end
        return row

    def _train(self, step: int) -> Awaitable[dict[str, Any]]:
        """Train step `step`: prefetch the next step's groups while it trains (when there is a next step)
        and start the weight send when its update ends."""
        return self.d.trainer.train_step(step, send=True, prefetch=step + 1 < self.cfg.trainer.total_steps)

    async def _role_metrics(self, t0: float, t1: float) -> dict[str, float]:
        """Every role's report of its window (what happened since its previous `stats()`), reduced by each
        metric's own type over this step's window [t0, t1]; busy shares and overlap from the spans."""
        d = self.d
        reports: list[RoleStats] = await self._guard(asyncio.gather(
            *[g.stats() for g in d.generators], *[s.stats() for s in d.scorers], d.trainer.stats(), d.hub.stats()))
        out = self._reducer.reduce([r.metrics for r in reports], window_s=max(t1 - t0, 1e-9))
        new_spans = [sp for r in reports for sp in r.spans]
        if self._trace is not None:
            self._trace.add_spans(new_spans)
            self._trace.add_counters(t1, {k: out[k] for k in ("buffer/rollout_depth", "buffer/train_depth")
                                          if k in out})
        # Keep spans that can still overlap the next window (a long generate started two windows ago).
        self._spans = [s for s in [*self._spans, *new_spans] if s.end >= t0 - 60.0]
        out.update(busy_shares(self._spans, (t0, t1)))
        out["overlap_ratio"] = overlap_ratio(self._spans, (t0, t1))
        return out

    async def _guard(self, aw: Awaitable[Any]) -> Any:
        """Await `aw`, but fail fast (one clear error) if a generator or scorer loop died meanwhile."""
        fut = asyncio.ensure_future(aw)
        try:
            done, _ = await asyncio.wait([fut, *self._loops], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # Ctrl-C: stop the call too, and retrieve its outcome (no warning)
            discard(fut)
            raise
        if fut not in done:
            fut.cancel()
            dead = next(iter(done))
            exc = dead.exception() if not dead.cancelled() else None
            raise RoleFailed(f"a generator or scorer stopped unexpectedly: {_first_line(exc)}") from exc
        try:
            return fut.result()
        except Exception as exc:  # e.g. an actor died mid-call: one line, the cause stays chained
            if _is_actor_death(exc):
                raise RoleFailed(f"an actor died: {_first_line(exc)}") from exc
            raise

    async def _stop_loops(self) -> None:
        d = self.d
        for r in [*d.generators, *d.scorers]:
            try:
                await asyncio.wait_for(r.stop(), 10)
            except Exception as exc:  # a dead actor must not block shutdown
                log.debug("stop failed: %s", exc)
        try:
            await asyncio.wait_for(d.hub.close(), 10)
        except Exception as exc:
            log.debug("hub close failed: %s", exc)
        if self._loops:
            done, pending = await asyncio.wait(self._loops, timeout=15)
            for f in pending:
                f.cancel()
            for f in done:  # retrieve: a loop that died has already been reported by _guard
                if not f.cancelled() and f.exception() is not None:
                    log.debug("role loop ended with %r", f.exception())

    def _summary(self, t_start: float) -> dict[str, Any]:
        out: dict[str, Any] = {"wall_s": time.time() - t_start}
        out.update(summarize_rows(self.rows))
        out["setting"] = {"num_generators": self.cfg.rollout.num_generators,
                          "max_staleness": self.cfg.staleness.max_staleness,
                          "prompts_per_step": self.cfg.trainer.prompts_per_step,
                          "group_size": self.cfg.rollout.group_size,
                          "concurrency": self.cfg.rollout.concurrency,
                          "torch_threads": self.cfg.cluster.torch_threads}
        return out


def _log_row(sinks: list[MetricSink], row: dict[str, Any]) -> None:
    for sink in sinks:
        sink.log(row)


def _first_line(exc: BaseException | None) -> str:
    if exc is None:
        return "cancelled"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _is_actor_death(exc: BaseException) -> bool:
    # Ray's ActorDiedError / RayActorError, recognised by name: the Controller never imports Ray.
    return any(c.__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError")
               for c in type(exc).__mro__)


def _progress_line(row: dict[str, Any], total: int) -> str:
    parts = [f"step {row['step']}/{total}", f"reward {row.get('reward/mean', float('nan')):.3f}"]
    if "eval/greedy_reward" in row:
        parts.append(f"eval greedy {row['eval/greedy_reward']:.3f}")
    parts.append(f"staleness max {row.get('staleness/max', 0):.0f}")
    parts.append(f"{row['time/elapsed_s']:.1f}s")
    return " | ".join(parts)
