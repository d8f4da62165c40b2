"""Experiment trackers as metric sinks: Weights & Biases, MLflow, trackio.

Place in the dataflow: `asyncrl.telemetry.loggers.build_sinks` opens one of these per tracker set in
`[logging]` (asyncrl/config/trackers.py holds the settings) at the start of a run; the Controller hands
each of them every metrics row (`log`, x-axis = the row's train step), the samples RolloutLog writes
(`log_samples`) and the run's outcome (`close`). Each is wrapped in `loggers.Contained`, so a tracker that
fails mid-run is counted and the run goes on.

Every tracker gets the resolved config (W&B and trackio as the run config, MLflow as params flattened to
`section.key`) and, unless set, the run directory's name as the run name. The packages are optional
extras, imported here only when their tracker is on; asyncrl/config/checks.py reports a missing one before the
run starts, naming the extra.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from asyncrl.config.trackers import MlflowConfig, TrackioConfig, WandbConfig

log = logging.getLogger(__name__)

FINISHED, FAILED, STOPPED = "finished", "failed", "stopped"  # how a run ended: the sinks' close(outcome)
SAMPLE_COLUMNS = ["step", "prompt", "completion", "reward", "finish_reason"]


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a row (bools, None and NaN dropped): what the trackers plot."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


def _step_and_values(row: Mapping[str, Any]) -> tuple[int, dict[str, float]]:
    values = scalars(row)
    return int(values.pop("step", 0)), values


def _by_split(samples: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    for split in sorted({s["split"] for s in samples}):
        yield split, [s for s in samples if s["split"] == split]


def _sample_rows(step: int, samples: list[dict[str, Any]]) -> list[list[Any]]:
    return [[step, s["prompt"], s["completion"], s["reward"], s.get("finish_reason", "")] for s in samples]


def _missing(package: str, extra: str, err: ImportError) -> ImportError:
    return ImportError(f"this tracker needs the {package} package ({err}); install it with: "
                       f"pip install 'asyncrl[{extra}]'")


class WandbSink:
    """A Weights & Biases run; its files under `<run_dir>/wandb` (offline: upload later with `wandb sync`)."""

    def __init__(self, run_dir: str | Path, settings: WandbConfig, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise _missing("wandb", "loggers", err) from None
        self._wandb = wandb
        # an explicit mode wins; unset keeps the environment's say, and never reaches for the network itself
        mode = settings.mode or os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(project=settings.project, entity=settings.entity,
                              name=settings.name or Path(run_dir).resolve().name, group=settings.group,
                              tags=list(settings.tags) or None, notes=settings.notes, dir=str(run_dir),
                              mode=mode, config=dict(config))

    def log(self, row: Mapping[str, Any]) -> None:
        step, values = _step_and_values(row)
        self.run.log(values, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """A table per split ("samples/train", "samples/eval"): step, prompt, completion, reward, finish."""
        for split, rows in _by_split(samples):
            table = self._wandb.Table(columns=SAMPLE_COLUMNS, data=_sample_rows(step, rows))
            self.run.log({f"samples/{split}": table}, step=step)

    def close(self, outcome: str = FINISHED) -> None:
        self.run.finish(exit_code=0 if outcome == FINISHED else 1)  # W&B shows a non-zero exit as failed


# MLflow names may hold letters, digits and _ - . space : / only (mlflow.utils.validation)
_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")
_MLFLOW_PARAM_CHARS = 6000  # MAX_PARAM_VAL_LENGTH
_MLFLOW_BATCH = 100  # params per log_batch call (MAX_PARAMS_TAGS_PER_BATCH); metrics may be 1000
_MLFLOW_STATUS = {FINISHED: "FINISHED", FAILED: "FAILED", STOPPED: "KILLED"}


def mlflow_key(key: str) -> str:
    """A metric or param name MLflow accepts: each character it refuses becomes '_'."""
    return _MLFLOW_BAD.sub("_", key)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: `section.key` -> the value as text (tables flattened, lists as JSON)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        out[mlflow_key(name)] = text[:_MLFLOW_PARAM_CHARS]
    return out


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i: i + size]


class MlflowSink:
    """An MLflow run: params = the flattened config, a metric history per row key (step = train step), the
    samples as `samples/<split>/step_<N>.jsonl` artifacts; the run's status says how it ended."""

    def __init__(self, run_dir: str | Path, settings: MlflowConfig, config: Mapping[str, Any]) -> None:
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Metric, Param
        except ImportError as err:
            raise _missing("mlflow", "mlflow", err) from None
        self._metric = Metric
        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # the store mlflow-skinny can write (its SQL store needs SQLAlchemy): MLflow 3 refuses a file store
            # unless this opt-out is set; one already in the environment (even "false") is left as it is
            uri = (Path(run_dir) / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(settings.experiment))
        run = self.client.create_run(experiment_id, run_name=settings.name or Path(run_dir).resolve().name,
                                     tags=dict(settings.tags))
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in flat_params(config).items()]
        for chunk in _chunks(params, _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=chunk)

    def log(self, row: Mapping[str, Any]) -> None:
        step, values = _step_and_values(row)
        now = int(time.time() * 1000)
        metrics = [self._metric(mlflow_key(k), v, now, step) for k, v in values.items()]
        for chunk in _chunks(metrics, 1000):  # MAX_METRICS_PER_BATCH
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        for split, rows in _by_split(samples):
            text = "".join(json.dumps({"step": step, **s}, ensure_ascii=False) + "\n" for s in rows)
            self.client.log_text(self.run_id, text, f"samples/{split}/step_{step:06d}.jsonl")

    def close(self, outcome: str = FINISHED) -> None:
        self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS[outcome])


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes: plain text in run.log


class _LogLines(io.TextIOBase):
    """A text stream whose lines become INFO log records (trackio prints its banner to stdout)."""

    def write(self, text: str) -> int:
        for line in _ANSI.sub("", text).splitlines():
            if line.strip():
                log.info("trackio: %s", line.strip())
        return len(text)


class TrackioSink:
    """A trackio run in trackio's own database (`trackio show --project NAME`), or on a Hugging Face Space."""

    def __init__(self, run_dir: str | Path, settings: TrackioConfig, config: Mapping[str, Any]) -> None:
        try:
            import trackio
        except ImportError as err:
            raise _missing("trackio", "trackio", err) from None
        self._trackio = trackio
        with contextlib.redirect_stdout(_LogLines()):  # its banner would draw through the live view
            self.run = trackio.init(project=settings.project, name=settings.name or Path(run_dir).resolve().name,
                                    group=settings.group, space_id=settings.space_id, config=dict(config),
                                    embed=False)

    def log(self, row: Mapping[str, Any]) -> None:
        step, values = _step_and_values(row)
        self.run.log(values, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        for split, rows in _by_split(samples):
            table = self._trackio.Table(columns=SAMPLE_COLUMNS, data=_sample_rows(step, rows))
            self.run.log({f"samples/{split}": table}, step=step)

    def close(self, outcome: str = FINISHED) -> None:
        """Waits for trackio's writer thread to store what was logged (trackio keeps no run status)."""
        from trackio import context_vars

        with contextlib.redirect_stdout(_LogLines()):
            if context_vars.current_run.get() is self.run:
                self._trackio.finish()  # also unsets it, or trackio finishes it again at exit
            else:  # opened in another context (an asyncio task's copy)
                self.run.finish()
