"""Metric sinks: where each per-step metrics row goes (metrics.jsonl always; TensorBoard, W&B, MLflow,
trackio, the live view when `[logging]` turns them on).

Place in the dataflow: Controller ──row──► `log_row(sinks, row)` ──► every sink's `log(row)` ──► files /
console / tracker; `close(outcome)` at the end of the run ("finished", or "failed" / "stopped" when it
ends early). `[logging]` in the config picks the optional sinks; the registry below maps each option to
its class, so adding a backend is one class and one entry. The trackers live in asyncrl/telemetry/trackers.py.

Every optional sink is `Contained`: one that raises while the run goes (a tracker server gone, a full
disk under its folder) logs one warning, counts its failures in the rows' `logging/tracker_errors`, and
the run goes on; metrics.jsonl, which the run's summary is read back from, is not contained. The packages
are optional extras, imported only when enabled; a missing one is a config error naming the extra
(asyncrl/config/trackers.py), not a crash at step 1.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config.schema import Config
from asyncrl.telemetry.metrics import MetricsWriter
from asyncrl.telemetry.trackers import FAILED, FINISHED, STOPPED, MlflowSink, TrackioSink, WandbSink, scalars

__all__ = ["FAILED", "FINISHED", "STOPPED", "TRACKER_ERRORS", "Contained", "JsonlSink", "MetricSink",
           "TensorBoardSink", "build_sinks", "close_sinks", "live_enabled", "log_row"]

log = logging.getLogger(__name__)

TRACKER_ERRORS = "logging/tracker_errors"  # row key: the optional sinks' failed calls so far


class MetricSink(Protocol):
    def log(self, row: Mapping[str, Any]) -> None: ...
    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None: ...  # asyncrl/telemetry/rollouts.py
    def close(self, outcome: str = FINISHED) -> None: ...


class JsonlSink:
    """`<run_dir>/metrics.jsonl`, one JSON object per row (see `MetricsWriter`)."""

    def __init__(self, path: str | Path) -> None:
        self.writer = MetricsWriter(path)

    def log(self, row: Mapping[str, Any]) -> None:
        self.writer.write(row)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Samples go to rollouts.jsonl, not among the metrics."""

    def close(self, outcome: str = FINISHED) -> None:
        self.writer.close()


class TensorBoardSink:
    """TensorBoard scalars in `<run_dir>/tensorboard`, x-axis = train step (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(f"logging.tensorboard = true needs the tensorboard package ({err}); "
                              "install it with: pip install 'asyncrl[loggers]'") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, row: Mapping[str, Any]) -> None:
        step = int(row.get("step", 0))
        for key, value in scalars(row).items():
            if key != "step":
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """The step's samples as one markdown table under the TEXT tab ("samples/<split>")."""
        for split in sorted({s["split"] for s in samples}):
            lines = ["| prompt | completion | reward |", "|---|---|---|"]
            lines += [f"| {_cell(s['prompt'])} | {_cell(s['completion'])} | {s['reward']:.4g} |"
                      for s in samples if s["split"] == split]
            self.writer.add_text(f"samples/{split}", "\n".join(lines), global_step=step)
        self.writer.flush()

    def close(self, outcome: str = FINISHED) -> None:
        self.writer.close()


def _cell(text: str, limit: int = 300) -> str:
    text = text.replace("|", "\\|").replace("\n", " ⏎ ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def live_enabled(setting: str | bool, stream: Any = None) -> bool:
    """`logging.live`: "auto" is on only when the stream (default stdout) is a terminal."""
    if setting == "auto":
        stream = stream if stream is not None else sys.stdout
        return bool(getattr(stream, "isatty", lambda: False)())
    return bool(setting)


class Contained:
    """An optional sink whose failures never end the run: the first is logged with its traceback, every one
    is counted (`errors`, summed into the rows' `logging/tracker_errors`), and the run goes on."""

    def __init__(self, name: str, sink: MetricSink) -> None:
        self.name = name
        self.sink = sink
        self.errors = 0

    def _call(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 — a tracker's trouble is not the run's
            self.errors += 1
            if self.errors == 1:
                log.warning("logging.%s: %s failed; the run goes on without it where it fails (counted in %s)",
                            self.name, what, TRACKER_ERRORS, exc_info=True)

    def log(self, row: Mapping[str, Any]) -> None:
        self._call("log", self.sink.log, row)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        self._call("log_samples", self.sink.log_samples, step, samples)

    def close(self, outcome: str = FINISHED) -> None:
        self._call("close", self.sink.close, outcome)
        if self.errors:
            log.warning("logging.%s: %d call(s) failed during the run", self.name, self.errors)


def _config_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as the trackers' run config."""
    import msgspec

    return msgspec.to_builtins(cfg)


def _live(cfg: Config, run_dir: Path) -> MetricSink:
    from asyncrl.telemetry.live import LiveView

    return LiveView(total_steps=cfg.trainer.total_steps, run_name=run_dir.resolve().name)


# option name -> (is it on for this config?, factory); opened in this order, the live view last so the
# trackers' start-up lines print before it takes the console
OPTIONAL_SINKS: dict[str, tuple[Callable[[Config], bool], Callable[[Config, Path], MetricSink]]] = {
    "tensorboard": (lambda cfg: cfg.logging.tensorboard, lambda cfg, d: TensorBoardSink(d / "tensorboard")),
    "wandb": (lambda cfg: bool(cfg.logging.wandb), lambda cfg, d: WandbSink(d, cfg.logging.wandb, _config_dict(cfg))),
    "mlflow": (lambda cfg: bool(cfg.logging.mlflow),
               lambda cfg, d: MlflowSink(d, cfg.logging.mlflow, _config_dict(cfg))),
    "trackio": (lambda cfg: bool(cfg.logging.trackio),
                lambda cfg, d: TrackioSink(d, cfg.logging.trackio, _config_dict(cfg))),
    "live": (lambda cfg: live_enabled(cfg.logging.live), _live),
}


def build_sinks(cfg: Config, run_dir: str | Path) -> list[MetricSink]:
    """metrics.jsonl plus every optional sink `[logging]` turns on, each `Contained`. One that fails to open
    (a tracker server unreachable, no credentials for W&B online) fails the run's start, after the ones
    already opened are closed: a run the config asked to track is not started untracked."""
    run_dir = Path(run_dir)
    sinks: list[MetricSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    try:
        for name, (enabled, factory) in OPTIONAL_SINKS.items():
            if enabled(cfg):
                sinks.append(Contained(name, factory(cfg, run_dir)))
    except BaseException:
        close_sinks(sinks, FAILED)
        raise
    return sinks


def log_row(sinks: list[MetricSink], row: dict[str, Any]) -> None:
    """Hand `row` to every sink, with the count of the optional sinks' failures so far."""
    row[TRACKER_ERRORS] = sum(getattr(s, "errors", 0) for s in sinks)
    for sink in sinks:
        sink.log(row)


def close_sinks(sinks: list[MetricSink], outcome: str = FINISHED) -> None:
    """Close every sink, telling it how the run ended, even if one fails to; then raise the first failure."""
    first: BaseException | None = None
    for sink in reversed(sinks):
        try:
            sink.close(outcome)
        except Exception as exc:  # the other sinks still flush their files
            first = first or exc
    if first is not None:
        raise first
