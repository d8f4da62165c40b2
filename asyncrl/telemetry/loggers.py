"""Metric sinks: where each per-step metrics row goes (metrics.jsonl always; TensorBoard, W&B, live view).

Place in the dataflow: Controller ──row──► every sink's `log(row)` ──► files / console; `close()` at the
end of the run (also when it fails). `[logging]` in the config picks the optional sinks; the registry
below maps each option to its class, so adding a backend is one class and one entry.

TensorBoard and W&B are optional extras (`pip install 'asyncrl[loggers]'`), imported only when enabled;
a missing package is one clear error at the start of the run, not a crash at step 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config_schema import Config
from asyncrl.telemetry.metrics import MetricsWriter


class MetricSink(Protocol):
    def log(self, row: Mapping[str, Any]) -> None: ...
    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None: ...  # asyncrl/telemetry/rollouts.py
    def close(self) -> None: ...


class JsonlSink:
    """`<run_dir>/metrics.jsonl`, one JSON object per row (see `MetricsWriter`)."""

    def __init__(self, path: str | Path) -> None:
        self.writer = MetricsWriter(path)

    def log(self, row: Mapping[str, Any]) -> None:
        self.writer.write(row)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Samples go to rollouts.jsonl, not among the metrics."""

    def close(self) -> None:
        self.writer.close()


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a row (bools and None dropped): what TensorBoard and W&B plot."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


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
        for key, value in _scalars(row).items():
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

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run in offline mode under `<run_dir>/wandb` (upload later with `wandb sync`).

    Offline unless WANDB_MODE says otherwise in the environment: the runtime never needs the network.
    """

    def __init__(self, run_dir: str | Path, project: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(f"logging.wandb = true needs the wandb package ({err}); "
                              "install it with: pip install 'asyncrl[loggers]'") from None
        self._wandb = wandb
        self.run = wandb.init(project=project, dir=str(run_dir), name=Path(run_dir).resolve().name,
                              mode=os.environ.get("WANDB_MODE", "offline"), config=dict(config))

    def log(self, row: Mapping[str, Any]) -> None:
        values = _scalars(row)
        step = int(values.pop("step", 0))
        self.run.log(values, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """A table per split ("samples/train", "samples/eval"): step, prompt, completion, reward, finish."""
        for split in sorted({s["split"] for s in samples}):
            table = self._wandb.Table(columns=["step", "prompt", "completion", "reward", "finish_reason"])
            for s in samples:
                if s["split"] == split:
                    table.add_data(step, s["prompt"], s["completion"], s["reward"], s.get("finish_reason", ""))
            self.run.log({f"samples/{split}": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def _cell(text: str, limit: int = 300) -> str:
    text = text.replace("|", "\\|").replace("\n", " ⏎ ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def live_enabled(setting: str | bool, stream: Any = None) -> bool:
    """`logging.live`: "auto" is on only when the stream (default stdout) is a terminal."""
    if setting == "auto":
        stream = stream if stream is not None else sys.stdout
        return bool(getattr(stream, "isatty", lambda: False)())
    return bool(setting)


def _tensorboard(cfg: Config, run_dir: Path) -> MetricSink:
    return TensorBoardSink(run_dir / "tensorboard")


def _wandb(cfg: Config, run_dir: Path) -> MetricSink:
    import msgspec

    return WandbSink(run_dir, cfg.logging.wandb_project, msgspec.to_builtins(cfg))


def _live(cfg: Config, run_dir: Path) -> MetricSink:
    from asyncrl.telemetry.live import LiveView

    return LiveView(total_steps=cfg.trainer.total_steps, run_name=run_dir.resolve().name)


# option name -> (is it on for this config?, factory)
OPTIONAL_SINKS: dict[str, tuple[Callable[[Config], bool], Callable[[Config, Path], MetricSink]]] = {
    "tensorboard": (lambda cfg: cfg.logging.tensorboard, _tensorboard),
    "wandb": (lambda cfg: cfg.logging.wandb, _wandb),
    "live": (lambda cfg: live_enabled(cfg.logging.live), _live),
}


def build_sinks(cfg: Config, run_dir: str | Path) -> list[MetricSink]:
    """metrics.jsonl plus every optional sink `[logging]` turns on. Closes what it opened if one fails."""
    run_dir = Path(run_dir)
    sinks: list[MetricSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    try:
        for enabled, factory in OPTIONAL_SINKS.values():
            if enabled(cfg):
                sinks.append(factory(cfg, run_dir))
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks


def close_sinks(sinks: list[MetricSink]) -> None:
    """Close every sink, even if one fails to; then raise the first failure."""
    first: BaseException | None = None
    for sink in reversed(sinks):
        try:
            sink.close()
        except Exception as exc:  # the other sinks still flush their files
            first = first or exc
    if first is not None:
        raise first
