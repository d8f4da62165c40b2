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

Each train step runs through the step pipeline (asyncrl/pipeline.py, which shows the whole sequence):
`train_step(s)` → the weight send every generator joins → `publish(s+1)` on the gate; step s+1 is asked
for at once and trains meanwhile (after the evaluation, every `eval_every` steps). Then the roles'
statistics of step s's window are gathered and one metrics row is written. Generators and scorers run
their own loops the whole time, so generation of later versions overlaps training up to the staleness
bound. With `cluster.placement = "colocated"` they do not: the generators sleep (their engines release the
K/V cache) from the moment step s's groups are in until the new weights reach them, evaluation included,
so generation and training take turns on the shared device (asyncrl/pipeline.py shows the sequence).

A watch (asyncrl/control/watchdog.py) runs beside the loops: a run whose every group fails, or a role whose event
loop is blocked, ends with one `RunStalled` line instead of a livelock or a hang.

The Controller talks to roles through `Deployment`: in-process objects (`asyncrl.deploy.local.LocalDeployment`)
or Ray actors behind async proxies (`asyncrl.deploy.launch.RayDeployment`). It never imports Ray. On Ray a dead
generator or scorer is restarted (asyncrl/control/supervisor.py); a dead trainer or buffer ends the run with one line
naming it and the resume command.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections import deque
from pathlib import Path
from typing import IO, Any, Awaitable, Callable, Protocol

import msgspec

from asyncrl.aio import discard
from asyncrl.checkpoints.policy import SaveSchedule, note_failure
from asyncrl.checkpoints.store import CHECKPOINTS, clear, latest_valid, read_state
from asyncrl.config import config_to_toml
from asyncrl.config.schema import Config
from asyncrl.control.supervisor import RoleFailed, Supervisor, gather_alive, is_actor_death, why_no_checkpoint
from asyncrl.control.watchdog import Probe, RunStalled, RunWatch
from asyncrl.pipeline import LEDGER_KEY, StepPipeline
from asyncrl.telemetry.admissions import AdmissionLog
from asyncrl.telemetry.loggers import FAILED, STOPPED, MetricSink, build_sinks, close_sinks, live_enabled, log_row
from asyncrl.telemetry.metrics import ACTOR_CALLS, ProcessCpu, RoleStats, WindowReducer, rss_mb
from asyncrl.telemetry.rollouts import EVAL_SAMPLES_KEY, ROLLOUTS, ROLLOUTS_KEY, RolloutLog
from asyncrl.telemetry.spans import Span, busy_shares, overlap_ratio
from asyncrl.telemetry.summary import summarize_rows
from asyncrl.telemetry.trace import TraceWriter
from buffers.replay import BufferState

# a train step's figures the trace shows as counters (docs/metrics.md): engine and trainer, how far apart
TRACE_STEP_COUNTERS = ("trainer/logprob_gap", "trainer/logprob_diff", "routing/agreement")

log = logging.getLogger(__name__)


class Deployment(Protocol):
    """Where the roles live. Each attribute exposes the role's async methods."""

    buffer: Any
    trainer: Any
    generators: list[Any]
    scorers: list[Any]
    restartable: tuple[str, ...]  # the role kinds supervision restarts ("generator", "scorer"); () in process

    async def setup_weight_sync(self, group_name: str = "weights") -> None: ...
    async def save_checkpoint(self, path: str) -> None: ...  # the final HF export
    async def shutdown(self) -> None: ...
    def probes(self) -> dict[str, Probe]:
        """One heartbeat probe per process hosting roles, by a name for it (asyncrl/control/watchdog.py); called once
        the event loop runs."""
        ...
    def dead_role(self, exc: BaseException) -> str | None:
        """The role ("trainer", "generator/0", ...) whose actor's death `exc` reports; None if unknown."""
        ...
    def holder_of(self, role: str) -> str: ...  # the name the role's current actor holds groups under (buffer)
    async def leave_weight_groups(self) -> None: ...  # supervision: every live member ends its group
    async def generator_death(self) -> BaseException | None: ...  # supervision: a dead generator's error, if any
    async def restart(self, kind: str, index: int) -> None: ...  # supervision: a fresh actor for a dead one


# What the Controller keeps in memory per step is bounded (a run of hours must not grow the driver): the newest
# ROWS_KEPT metrics rows (Runtime.metrics; every row streams to metrics.jsonl, which the summary reads at the end),
# the spans that reach past the current window (busy shares of the next one; every span streams to trace.json),
# and the names of the roles seen (one per actor).
ROWS_KEPT = 100
DEATH_GRACE_S = 2.0  # how long a failed call waits for a role death behind it to be seen (Controller._death_behind)


__all__ = ["Controller", "Deployment", "RoleFailed", "RunStopped"]


class RunStopped(RuntimeError):
    """The run stopped on SIGTERM or SIGINT after writing a checkpoint; the message says how to resume."""


class Controller:
    def __init__(self, cfg: Config, deployment: Deployment, *, run_dir: str | Path | None = None,
                 config_text: str | None = None, resume: bool = False, launched_at: float | None = None) -> None:
        self.cfg = cfg
        # start-up: from `launched_at` (the launch; default: this run's start) to the generators' first requests
        self.launched_at = launched_at
        self.startup_s: float | None = None
        self.d = deployment
        self.run_dir = Path(run_dir or cfg.run.output_dir)
        self.config_text = config_text
        self.resume = resume  # continue from the newest valid checkpoint in RUN_DIR/checkpoints
        # the signal's name once SIGTERM or SIGINT asked to stop: finish the step, write a checkpoint, stop
        self._stopping = ""
        # ends a run that cannot progress (every group failing, a role's loop blocked) with one error
        self.watch = RunWatch(buffer=deployment.buffer, max_failed_in_a_row=cfg.run.max_failed_groups_in_a_row,
                              no_progress_timeout_s=cfg.run.no_progress_timeout_s,
                              role_timeout_s=cfg.run.role_timeout_s)
        self._watching: asyncio.Future | None = None
        self._stalled = ""  # the process the watch found stalled (RunStalled.process): its roles answer no stop()
        # samples of what the model writes (RUN_DIR/rollouts.jsonl, the console, W&B / TensorBoard)
        self.rollouts = RolloutLog(self.run_dir, shown=cfg.logging.rollouts_shown)
        self.first_step = 0  # the step this run starts from: a resume's checkpoint step, else 0
        self.ready = asyncio.Event()  # set once restored and every generator holds the weights to start from
        self.supervisor = Supervisor(deployment, max_restarts=cfg.cluster.max_restarts, run_dir=self.run_dir,
                                     save_every=cfg.run.save_every, save_every_s=cfg.run.save_every_s)
        # when durable checkpoints are written: run.save_every, run.save_every_s (asyncrl/checkpoints/policy.py)
        self.saves = SaveSchedule(every=cfg.run.save_every, every_s=cfg.run.save_every_s,
                                  total_steps=cfg.trainer.total_steps)
        self._doing = ""  # what the run is doing ("training step 7"): a failure's note says it (note_failure)
        self._spans: list[Span] = []  # reported spans that end after the last window: they reach into the next
        self._roles: set[str] = set()  # every role that reported a span: each gets a busy share in every row
        self._reducer = WindowReducer()  # the roles' window reports -> row values (and running totals)
        self._trace: TraceWriter | None = None
        self._ledger: IO[str] | None = None  # RUN_DIR/ledger.jsonl, open from the first step's line to the end
        # RUN_DIR/admissions.jsonl: every group id the gate handed out and what became of it, every attempt
        self.admissions = AdmissionLog(self.run_dir)
        self._step = 0  # the newest step this run trained (or started from): stamps the last group events
        self._window_end = 0.0
        # the event loop thread's CPU seconds at the window's end: `time/controller_s` is the next window's
        # increment (thread_time, not wall: awaiting the roles costs the driver nothing)
        self._cpu_mark = 0.0
        self._calls_mark = 0  # ACTOR_CALLS.n at the window's end: `controller/actor_calls` is the next's increment
        self._cpu = ProcessCpu()
        # train → send → receive → publish, each step asked for ahead of time (asyncrl/pipeline.py); colocated:
        # in series, the generators asleep from before the train step to after the weight sync
        self.colocated = cfg.cluster.placement == "colocated"
        self.steps = StepPipeline(trainer=deployment.trainer, generators=deployment.generators,
                                  buffer=deployment.buffer, total_steps=cfg.trainer.total_steps, watch=self._guard,
                                  pause_after=self._eval_due,
                                  drain_after=lambda v: self._save_wanted(v),
                                  recover=self.supervisor.recover if deployment.restartable else None,
                                  colocated=self.colocated, tolerated=self.supervisor.tolerated,
                                  # colocated, a generator's sleep ends after its receive: all asked after the wake
                                  with_reports=not self.colocated)
        self.supervisor.attach(self.steps)
        self.rows: deque[dict[str, Any]] = deque(maxlen=ROWS_KEPT)  # the newest only (see ROWS_KEPT)
        self.rows_written = 0  # rows in metrics.jsonl (resumed: those up to the checkpoint, then this run's)

    async def run(self) -> list[dict[str, Any]]:
        cfg, d = self.cfg, self.d
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t_start = time.time()
        self.saves.start()  # run.save_every_s counts from the run's start
        sinks: list[MetricSink] = []
        outcome = FAILED
        quiet = live_enabled(cfg.logging.live)  # the live view replaces the progress lines
        remove_handler = self._on_sigterm()
        try:
            first_step = self.first_step = await self._restore() if self.resume else self._fresh_run_dir()
            # always: `asyncrl report` and `asyncrl plan` read the run's settings from it (written once RUN_DIR
            # is this run's: a fresh run refused there leaves the earlier run's config to its --resume)
            (self.run_dir / "config.toml").write_text(self._config_text())
            self._doing = f"resuming from step {first_step}" if self.resume else "starting the run"
            sinks = build_sinks(cfg, self.run_dir)  # inside try: a missing logger package still shuts down
            self.rollouts.sinks = sinks
            if cfg.logging.trace:
                self._trace = TraceWriter(self.run_dir / "trace.json", origin=t_start)
            await d.setup_weight_sync()
            if first_step:  # the generators start from the model folder: give them the checkpoint's weights
                await self._guard(asyncio.gather(d.trainer.send_weights(),
                                                 *[g.receive_weights() for g in d.generators]))
            self.ready.set()
            if self.colocated:  # the first evaluation before any generation: the engines hold no cache yet
                await self._first_eval(sinks, first_step, t_start)
            self.supervisor.start_loops()
            self.startup_s = time.time() - (t_start if self.launched_at is None else self.launched_at)
            log.info("generating %.1f s after the launch (Ray, actors, model loads, weight sync)", self.startup_s)
            self.watch.probes = d.probes()
            self._watching = asyncio.ensure_future(self.watch.run())
            if not self.colocated:
                await self._first_eval(sinks, first_step, t_start)
            await self.steps.start()
            t_prev, self._cpu_mark, self._cpu = time.time(), time.thread_time(), ProcessCpu()
            self._calls_mark = ACTOR_CALLS.n
            for step in range(first_step, cfg.trainer.total_steps):
                self._doing = f"training step {step + 1}"
                row = await self._one_step(step, t_start, t_prev)
                t_prev = self._window_end
                self._keep_row(sinks, row)
                # a signal or run.save_every_s: a checkpoint once the pipeline is drained
                # (asyncrl/checkpoints/policy.py)
                wanted = bool(self._stopping) or self.saves.timed()
                if self.saves.due(step + 1) or (wanted and self.steps.drained(step + 1)):
                    path = await self._save(step + 1)
                    if self._stopping:
                        raise RunStopped(f"stopped by {self._stopping} after step {step + 1} of "
                                         f"{cfg.trainer.total_steps}; checkpoint {path}; resume with: "
                                         f"asyncrl launch --resume {self.run_dir}")
                    self.steps.ask_next(step + 1)
                elif wanted:  # that step prefetched the next one's groups: train it too, then the checkpoint
                    self.steps.ask_next(step + 1)
                if not quiet and ((step + 1) % cfg.run.log_every == 0 or step + 1 == cfg.trainer.total_steps):
                    log.info(_progress_line(row, cfg.trainer.total_steps))
            close_sinks(sinks)  # flushed: the whole run is read back from metrics.jsonl
            sinks = []
            rows = _read_rows(self.run_dir / "metrics.jsonl")
            summary = self._summary(t_start, rows)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if cfg.run.save_checkpoint:
                self._doing = f"writing the final export into {self.run_dir / 'checkpoint'}"
                await d.save_checkpoint(str(self.run_dir / "checkpoint"))
            return rows
        except BaseException as exc:  # the trackers record how the run ended
            outcome = STOPPED if isinstance(exc, (RunStopped, KeyboardInterrupt, asyncio.CancelledError)) else FAILED
            if outcome == FAILED and self._doing:  # the last line of a failed run names it (checkpoints/policy.py)
                note_failure(exc, self._doing)
            raise
        finally:
            remove_handler()
            if self._watching is not None:
                discard(self._watching)
            self.steps.close()  # a step asked for ahead of a failure (or Ctrl-C) elsewhere
            close_sinks(sinks, outcome)  # (none left open when the run finished)
            if self._trace is not None:
                self._trace.close()
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None
            try:
                try:
                    await self._stop_loops()
                finally:  # the gate's events since the last row (a dead attempt's too), while the buffer lives
                    await self._last_group_events()
            finally:  # whatever stopping the loops raised (a dead actor, a cancellation), kill the actors
                await d.shutdown()

    async def _first_eval(self, sinks: list[MetricSink], first_step: int, t_start: float) -> None:
        """The evaluation of version 0 (a fresh run with evaluation on): the first metrics row."""
        if self.cfg.trainer.eval_every > 0 and not first_step:
            first = {"step": 0, "version": 0, "time/elapsed_s": time.time() - t_start}
            first.update(await self._guard(self.d.trainer.evaluate()))
            self.rollouts.write(0, first.pop(EVAL_SAMPLES_KEY, []))
            self._keep_row(sinks, first)

    async def _one_step(self, step: int, t_start: float, t_prev: float) -> dict[str, Any]:
        """Train step `step` through publish (the step pipeline), then evaluation when due, then the
        window's metrics row. An evaluation reads the trainer's weights, so the next step is asked for
        after it; otherwise it is asked for at once and trains while the row is gathered. Colocated, the
        evaluation runs inside the step, while the generators still sleep."""
        version = step + 1
        eval_due = self._eval_due(version)
        evaluated: dict[str, Any] = {}

        async def evaluate() -> None:
            evaluated.update(await self._guard(self.d.trainer.evaluate()))

        metrics, sent = await self.steps.step(step, while_asleep=evaluate if eval_due and self.colocated else None)
        self._step = version
        self._write_ledger(version, metrics.pop(LEDGER_KEY, []))
        self.rollouts.write(version, metrics.pop(ROLLOUTS_KEY, []))
        row: dict[str, Any] = {"step": version, "version": version, "time/elapsed_s": time.time() - t_start}
        row.update(metrics)
        row.update(dict(sent))
        if eval_due:
            if not self.colocated:
                await evaluate()
            row.update(evaluated)
            self.rollouts.write(version, row.pop(EVAL_SAMPLES_KEY, []))
        t_end, cpu, calls = time.time(), time.thread_time(), ACTOR_CALLS.n
        if not self._save_wanted(version):  # (asked for once the checkpoint is written)
            self.steps.ask_next(version)
        row.update(await self._role_metrics(t_prev, t_end, ask_trainer=eval_due))
        row["time/step_s"] = t_end - t_prev  # the step's window; consecutive windows tile the loop
        # the driver's own work in that window: the Controller, the step pipeline, supervision, the watch and
        # the Ray calls they make (their row work of the previous step included); on Ray its share of
        # time/step_s is what driving the run costs (benchmarks/hub.py)
        row["time/controller_s"] = cpu - self._cpu_mark
        self._cpu_mark = cpu
        if calls > self._calls_mark:  # on Ray: the actor calls the driver submitted, each a round trip of its loop
            row["controller/actor_calls"] = float(calls - self._calls_mark)
        self._calls_mark = calls
        row["throughput/samples_per_s"] = metrics.get("trainer/samples", 0.0) / max(t_end - t_prev, 1e-9)
        if self._trace is not None:  # the engine-trainer agreement on the timeline, beside the spans
            self._trace.add_counters(t_end, {k: row[k] for k in TRACE_STEP_COUNTERS
                                             if isinstance(row.get(k), (int, float))})
        self._window_end = t_end
        return row

    def _keep_row(self, sinks: list[MetricSink], row: dict[str, Any]) -> None:
        """Stream `row` to the sinks (metrics.jsonl among them); keep it among the newest ROWS_KEPT."""
        log_row(sinks, row)
        self.rows.append(row)
        self.rows_written += 1

    def _write_ledger(self, version: int, groups: list[list[Any]]) -> None:
        """RUN_DIR/ledger.jsonl: the groups (id, prompt) each train step trained, one line per step. With
        resume it shows every accepted group trained exactly once and no prompt skipped or repeated. The file
        stays open for the run (opened after a resume cut it back), each line flushed as it is written."""
        if self._ledger is None:
            self._ledger = (self.run_dir / "ledger.jsonl").open("a")
        self._ledger.write(json.dumps({"step": version, "groups": groups}) + "\n")
        self._ledger.flush()

    def _eval_due(self, version: int) -> bool:
        every = self.cfg.trainer.eval_every
        return every > 0 and (version % every == 0 or version == self.cfg.trainer.total_steps)

    def _save_wanted(self, version: int) -> bool:
        """Whether a checkpoint may follow the step that publishes `version`: the pipeline drains before it
        (a step interval or the last step, run.save_every_s passed, or a signal asked to stop)."""
        return self.saves.due(version) or self.saves.timed() or bool(self._stopping)

    def _on_sigterm(self) -> Callable[[], None]:
        """SIGTERM (preemption) or SIGINT (Ctrl-C): the first finishes the step in progress, writes a
        checkpoint and stops the run with RunStopped; a second cancels the run at once. Returns the function
        that uninstalls the handlers (a no-op where the loop cannot take signal handlers: not the main
        thread, where Ctrl-C keeps Python's default)."""
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def handle(sig: signal.Signals) -> None:
            if self._stopping and task is not None:
                log.warning("second %s: stopping now, without a checkpoint", sig.name)
                task.cancel()
                return
            self._stopping = sig.name
            log.warning("%s: finishing the step in progress, then a checkpoint and stop "
                        "(send it again to stop at once)", sig.name)

        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, handle, sig)
            except (NotImplementedError, RuntimeError, ValueError):
                break
            installed.append(sig)

        def remove() -> None:
            for sig in installed:
                loop.remove_signal_handler(sig)
        return remove

    async def _save(self, version: int) -> str:
        """A durable checkpoint of version `version` (asyncrl/checkpoints/store.py), written by the trainer: its
        weights, optimizer and RNG, the buffer's state (groups accepted and not trained, the gate) and the
        Controller's totals. The pipeline drained first: nothing is half-trained or prefetched."""
        t0 = time.time()
        self._doing = f"writing checkpoint step {version} into {self.run_dir / CHECKPOINTS}"
        buffer_state = await self._guard(self.d.buffer.state())
        # total_steps: a later fresh run in RUN_DIR tells a finished run (replaced) from one to resume (refused)
        extra = {"buffer": msgspec.to_builtins(buffer_state),
                 "controller": {"totals": dict(self._reducer.totals), "total_steps": self.cfg.trainer.total_steps}}
        path = await self._guard(self.d.trainer.save_state(
            str(self.run_dir / CHECKPOINTS), step=version, config_text=self._config_text(), extra=extra,
            keep_last=self.cfg.run.keep_last))
        self.saves.saved()
        log.info("checkpoint of version %d: %s (%.1fs)", version, path, time.time() - t0)
        return path

    def _fresh_run_dir(self) -> int:
        """A new run (no --resume) in RUN_DIR: its rows replace an earlier run's. An earlier run's checkpoints
        are never mixed with this run's (a later --resume would load the wrong one): those of a run that
        finished (its newest checkpoint is at its last step) are deleted, like its rows and its export; those
        of a run that stopped before its end are refused — it is for --resume to continue."""
        root = self.run_dir / CHECKPOINTS
        found = latest_valid(root)
        if found is not None:
            manifest, state = read_state(found, verified=True)
            planned = state.get("controller", {}).get("total_steps")
            if planned is None or manifest.step < planned:
                of = f" of {planned}" if planned is not None else ""
                raise RuntimeError(f"{root} holds the checkpoints of an earlier run that stopped at step "
                                   f"{manifest.step}{of}: continue it with asyncrl launch --resume {self.run_dir}, "
                                   f"or choose another run.output_dir (or delete {root})")
            log.warning("%s holds the checkpoints of an earlier run that finished (step %d of %d): this new run "
                        "replaces them", root, manifest.step, planned)
        if root.is_dir():  # a finished run's, or only partial or corrupted ones
            clear(root)
        for name in ("metrics.jsonl", "ledger.jsonl", ROLLOUTS):
            (self.run_dir / name).unlink(missing_ok=True)
        self.admissions.start(0)  # (replaces an earlier run's file)
        return 0

    async def _restore(self) -> int:
        """Load the newest valid checkpoint of RUN_DIR into the trainer and the buffer (before the
        generators start); truncate metrics.jsonl to its step. Returns the step to continue from."""
        root = self.run_dir / CHECKPOINTS
        found = latest_valid(root)
        if found is None:
            why = why_no_checkpoint(self.cfg.run.save_every, self.cfg.run.save_every_s)
            raise RuntimeError(f"--resume: no valid checkpoint in {root} ({why})")
        manifest, extra = read_state(found)
        step = manifest.step
        if step > self.cfg.trainer.total_steps:
            raise RuntimeError(f"--resume: the checkpoint is at step {step}, past trainer.total_steps = "
                               f"{self.cfg.trainer.total_steps}; raise it with --set trainer.total_steps=N")
        await self._guard(self.d.trainer.load_state(str(found)))
        await self._guard(self.d.buffer.restore(msgspec.convert(extra["buffer"], BufferState)))
        self._reducer = WindowReducer(extra["controller"]["totals"])
        kept = _truncate_rows(self.run_dir / "metrics.jsonl", step)
        self.rows.extend(kept)
        self.rows_written = len(kept)
        _truncate_rows(self.run_dir / "ledger.jsonl", step)
        _truncate_rows(self.run_dir / ROLLOUTS, step)
        self.admissions.start(step, extra["buffer"]["gate"])  # not cut back: the undone groups stay on record
        self._step = step
        log.info("resuming from %s: version %d", found, step)
        return step

    def _config_text(self) -> str:
        return self.config_text if self.config_text is not None else config_to_toml(self.cfg)

    async def _role_metrics(self, t0: float, t1: float, *, ask_trainer: bool = False) -> dict[str, float]:
        """Every role's report of its window (what happened since its previous `stats()`), reduced by each
        metric's own type over this step's window [t0, t1]; busy shares and overlap from the spans. The
        reports that came with the step's replies (the trainer's send, each generator's receive, the buffer's
        publish: StepPipeline.take_reports) are used as they are; only the other roles are asked (`stats()`), and the
        trainer again after an evaluation (`ask_trainer`: its eval span ends after the send's report)."""
        d = self.d
        came = self._note_group_events(self.steps.take_reports())
        have = {role for role, _ in came} - ({"trainer"} if ask_trainer else set())  # its eval came after the send
        roles = [*[(f"generator/{i}", g) for i, g in enumerate(d.generators)],
                 *[(f"scorer/{i}", s) for i, s in enumerate(d.scorers)], ("trainer", d.trainer), ("buffer", d.buffer)]
        asked = [self._buffer_stats() if name == "buffer" else r.stats() for name, r in roles if name not in have]
        reports: list[RoleStats] = [report for _, report in came]
        if asked:
            reports += await self._guard(gather_alive(self.supervisor, asked))  # a dead one: no report
        out = self._reducer.reduce([r.metrics for r in reports], window_s=max(t1 - t0, 1e-9))
        out["supervisor/restarts"] = float(self.supervisor.restarts)
        new_spans = [sp for r in reports for sp in r.spans]
        if self._trace is not None:
            self._trace.add_spans(new_spans)
            self._trace.add_counters(t1, {k: out[k] for k in ("buffer/rollout_depth", "buffer/train_depth")
                                          if k in out})
        # A role reports a span once it has ended, so only one that ends after t1 (drained just after the
        # window closed) can overlap a later window: keep those alone. A long generate begun two windows ago
        # arrives whole in the window it ends in and is clipped to it.
        spans = [*self._spans, *new_spans]
        self._roles.update(sp.role for sp in new_spans)
        out.update(busy_shares(spans, (t0, t1), roles=self._roles))
        out["overlap_ratio"] = overlap_ratio(spans, (t0, t1))
        self._spans = [sp for sp in spans if sp.end > t1]
        out["controller/rss_mb"] = rss_mb()  # the driver's own: a long run must not grow here either
        # the driver's CPU, every thread (Ray's beside the event loop; in process, --local: every role's)
        out["controller/cpu_cores"] = (self._cpu.take() or 0.0) / max(t1 - t0, 1e-9)
        return out

    def _note_group_events(self, reports: list[tuple[str, RoleStats]]) -> list[tuple[str, RoleStats]]:
        """Append the buffer's group events among `reports` to admissions.jsonl (at once: a later failure in
        the same step must not lose them); returns `reports`."""
        for role, report in reports:
            if role == "buffer":
                self.admissions.write(self._step, report.groups)
        return reports

    async def _buffer_stats(self) -> RoleStats:
        """The buffer's `stats()`, its group events written as soon as it answers."""
        return self._note_group_events([("buffer", await self.d.buffer.stats())])[0][1]

    async def _last_group_events(self) -> None:
        """The group events no metrics row carried (the last window, a failed step's), once the loops stopped:
        from the reports the step pipeline still holds, then from the buffer. A dead buffer's are lost."""
        self._note_group_events(self.steps.take_reports())
        try:
            if self._stalled.startswith("buffer"):  # the watch's name for its process (RayDeployment.probes)
                raise RuntimeError("its process is stalled")
            self.admissions.write(self._step, await asyncio.wait_for(self.d.buffer.group_events(), 10))
        except Exception as exc:
            log.debug("the buffer's last group events are lost: %s", exc)
        finally:
            self.admissions.close()

    async def _guard(self, aw: Awaitable[Any]) -> Any:
        """Await `aw`, but fail fast (one clear error) if a generator or scorer loop died meanwhile and
        supervision does not restart it (asyncrl/control/supervisor.py), or the watch found that the run cannot
        progress (RunStalled); a dead trainer or buffer: one line naming it and the resume command."""
        fut = asyncio.ensure_future(aw)
        while True:
            try:
                watching = [self._watching] if self._watching is not None else []
                done, _ = await asyncio.wait([fut, *self.supervisor.watched, *watching],
                                             return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # Ctrl-C: stop the call too, and retrieve its outcome (no warning)
                discard(fut)
                raise
            if fut in done:
                break
            if self._watching is not None and self._watching in done:  # the watch's verdict, already one line
                discard(fut)
                exc = self._watching.exception() if not self._watching.cancelled() else None
                self._stalled = getattr(exc, "process", "")
                raise RunStalled(str(exc), process=self._stalled) from None
            try:
                for ended in done:
                    self.supervisor.ended(ended)  # restarts the role, or raises RoleFailed
            except BaseException:
                discard(fut)
                raise
        try:
            return fut.result()
        except Exception as exc:  # e.g. an actor died mid-call: one line, the cause stays chained
            if is_actor_death(exc):
                self.supervisor.fatal(exc)  # the trainer or the buffer: RoleFailed with the resume line
                if self.supervisor.tolerated(exc):
                    raise  # a generator's: the step pipeline's `recover` takes it
                raise self.supervisor.death(self.d.dead_role(exc), exc) from exc
            await self._death_behind()
            raise

    async def _death_behind(self) -> None:
        """A call that failed because a peer died (the trainer's weight send, its receiver killed: "connection
        reset") can fail before that death reaches the watch. Give the watched role loops DEATH_GRACE_S to end:
        a death is then reported as such (restarted, or RoleFailed naming the role and the resume command)
        instead of the error it caused."""
        watched = list(self.supervisor.watched)
        if not watched:
            return
        done, _ = await asyncio.wait(watched, timeout=DEATH_GRACE_S)
        for ended in done:
            self.supervisor.ended(ended)

    async def _stop_loops(self) -> None:
        d = self.d
        # together, each bounded: a dead actor raises at once, a stalled one never answers; the roles in the process
        # the watch found stalled are not asked (their loops are cancelled below without waiting)
        process_of = getattr(d, "process_of", None)
        roles = self.supervisor.roles()
        stalled = frozenset(role for role, _ in roles if process_of(role) == self._stalled) \
            if self._stalled and process_of is not None else frozenset()
        stops = {asyncio.ensure_future(endpoint.stop()): role for role, endpoint in roles if role not in stalled}
        unanswered: frozenset[str] = stalled
        if stops:
            _, pending = await asyncio.wait(stops, timeout=10)
            for f in stops:
                discard(f)  # cancels a stop still pending; retrieves a failed one's error
            unanswered |= frozenset(stops[f] for f in pending)
        if unanswered:
            log.debug("role loops that did not answer stop(), or were not asked: %s", ", ".join(sorted(unanswered)))
        try:
            await asyncio.wait_for(d.buffer.close(), 10)
        except Exception as exc:
            log.debug("buffer close failed: %s", exc)
        await self.supervisor.stop(unresponsive=unanswered)  # their loops will not end either: not waited for

    def _summary(self, t_start: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"wall_s": time.time() - t_start, "startup_s": self.startup_s}
        out.update(summarize_rows(rows))
        out["setting"] = {"num_generators": self.cfg.rollout.num_generators,
                          "max_staleness": self.cfg.staleness.max_staleness,
                          "prompts_per_step": self.cfg.trainer.prompts_per_step,
                          "group_size": self.cfg.rollout.group_size,
                          "concurrency": self.cfg.rollout.concurrency,
                          "torch_threads": self.cfg.cluster.torch_threads}
        return out


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of metrics.jsonl (NaN and inf were written as null)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_rows(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep (and return) the rows of metrics.jsonl up to `step` (a run may have gone on past its last
    checkpoint before it died); the resumed run appends after them, so no step appears twice."""
    if not path.exists():
        return []
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(f"{line}\n" for line in kept))
    return [json.loads(line) for line in kept]


def _progress_line(row: dict[str, Any], total: int) -> str:
    parts = [f"step {row['step']}/{total}", f"reward {row.get('reward/mean', float('nan')):.3f}"]
    if "eval/greedy_reward" in row:
        parts.append(f"eval greedy {row['eval/greedy_reward']:.3f}")
    parts.append(f"staleness max {row.get('staleness/max', 0):.0f}")
    parts.append(f"{row['time/elapsed_s']:.1f}s")
    return " | ".join(parts)
