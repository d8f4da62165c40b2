"""The experiment trackers of `[logging]`: `[logging.wandb]`, `[logging.mlflow]`, `[logging.trackio]`.

Place in the dataflow: read with the rest of the config (asyncrl/config/schema.py `LoggingConfig` holds them);
at the start of a run `asyncrl.telemetry.loggers.build_sinks` opens one sink per tracker that is set, and
every metrics row, sample table and the run's end reach it (asyncrl/telemetry/trackers.py).

Each tracker is off by default and turned on either by `<name> = true` (every setting at its default) or by
its table, e.g.

```toml
[logging.wandb]
project = "gsm8k"
mode = "online"
tags = ["grpo", "7b"]
```

`LoggingConfig.__post_init__` turns `true` into the table of defaults and `false` into None, so the code
reads a section or None, and the resolved config.toml shows every setting.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Annotated, Literal

from asyncrl.config.section import Section, _d

if TYPE_CHECKING:
    from asyncrl.config.schema import LoggingConfig


class WandbConfig(Section):
    """A Weights & Biases run (needs: pip install 'asyncrl[loggers]')."""

    project: Annotated[str, _d("W&B project", min_length=1)] = "asyncrl"
    entity: Annotated[str | None, _d("W&B team or user the run belongs to; unset: your default entity")] = None
    name: Annotated[str | None, _d("run name; unset: the run directory's name")] = None
    group: Annotated[str | None, _d("W&B group (e.g. a sweep's runs side by side)")] = None
    tags: Annotated[list[str], _d("W&B tags of the run")] = []
    notes: Annotated[str | None, _d("W&B notes (a longer description of the run)")] = None
    mode: Annotated[
        Literal["online", "offline", "disabled"] | None,
        _d("online: upload while the run goes (needs W&B credentials: `wandb login` or WANDB_API_KEY); "
           "offline: write <run_dir>/wandb, upload later with `wandb sync`; disabled: log nothing; "
           "unset: WANDB_MODE from the environment, else offline"),
    ] = None


class MlflowConfig(Section):
    """An MLflow run (needs: pip install 'asyncrl[mlflow]')."""

    tracking_uri: Annotated[
        str | None,
        _d("MLflow tracking server or store, e.g. 'http://host:5000' or 'sqlite:///mlflow.db' (the SQL store needs "
           "the full mlflow package); unset: MLFLOW_TRACKING_URI from the environment, else a file store in "
           "<run_dir>/mlruns"),
    ] = None
    experiment: Annotated[str, _d("MLflow experiment name (created if missing)", min_length=1)] = "asyncrl"
    name: Annotated[str | None, _d("run name; unset: the run directory's name")] = None
    tags: Annotated[dict[str, str], _d("MLflow tags of the run, e.g. {team = \"rl\"}")] = {}


class TrackioConfig(Section):
    """A trackio run, stored in trackio's local database (TRACKIO_DIR, default ~/.cache/huggingface/trackio;
    needs: pip install 'asyncrl[trackio]')."""

    project: Annotated[str, _d("trackio project (`trackio show --project NAME` shows it)", min_length=1)] = "asyncrl"
    name: Annotated[str | None, _d("run name; unset: the run directory's name")] = None
    group: Annotated[str | None, _d("trackio group of the run")] = None
    space_id: Annotated[
        str | None,
        _d("a Hugging Face Space ('user/space') to log to instead of the local database (needs a Hugging Face "
           "login)"),
    ] = None


# The switches as LoggingConfig annotates them: `true` / `false` or the table.
WandbSwitch = Annotated[
    WandbConfig | bool | None,
    _d("log to Weights & Biases: true, or a [logging.wandb] table (project, entity, name, group, tags, notes, "
       "mode); offline under <run_dir>/wandb unless mode says otherwise (needs: pip install 'asyncrl[loggers]')"),
]
MlflowSwitch = Annotated[
    MlflowConfig | bool | None,
    _d("log to MLflow: true, or a [logging.mlflow] table (tracking_uri, experiment, name, tags); params = the "
       "flattened config (needs: pip install 'asyncrl[mlflow]')"),
]
TrackioSwitch = Annotated[
    TrackioConfig | bool | None,
    _d("log to trackio: true, or a [logging.trackio] table (project, name, group, space_id) (needs: pip install "
       "'asyncrl[trackio]')"),
]

# tracker -> (the module it imports, the extra that installs it)
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "loggers"),
    "wandb": ("wandb", "loggers"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}



def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without a spec (a stand-in module)
        return True


def check_trackers(logging: LoggingConfig) -> list[str]:
    """Config-time errors of `[logging]`: a tracker whose package is missing (naming the extra that installs
    it), and a `wandb_project` that contradicts the [logging.wandb] table beside it."""
    errors = []
    for name, (module, extra) in TRACKER_PACKAGES.items():
        if getattr(logging, name) and not _installed(module):
            errors.append(f"logging.{name}: needs the {module} package, which is not installed — "
                          f"pip install 'asyncrl[{extra}]', or remove logging.{name}")
    if logging.wandb_project is not None and logging.wandb:
        errors.append(f"logging.wandb_project: {logging.wandb_project!r} contradicts [logging.wandb] project = "
                      f"{logging.wandb.project!r} — keep one: project inside [logging.wandb]")
    return errors


__all__ = ["MlflowConfig", "MlflowSwitch", "TRACKER_PACKAGES", "TrackioConfig", "TrackioSwitch", "WandbConfig",
           "WandbSwitch", "check_trackers"]
