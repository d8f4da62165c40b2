"""Read back the config a finished run wrote into its run directory.

Place in the dataflow: `asyncrl launch` writes RUN_DIR/config.toml (`config_to_toml`) ──► the readers of a
finished run (`asyncrl report`, `asyncrl plan`) ──► `read_run_config` ──► a typed `Config`.

The file is checked field by field against the schema, as `load_config` does: unknown keys (with a
did-you-mean), types and bounds, every problem at once; a field the file lacks (a run written before the
field existed) takes its default. `load_config`'s cross-field checks are left out: they check the machine
a run starts on (model and data paths, reward imports, CUDA for NCCL, CPU ids), while a finished run is
read on whatever machine holds its directory.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.config import ConfigError, _convert_struct, _read_toml
from asyncrl.config_schema import Config


def read_run_config(run_dir: str | Path) -> Config:
    """RUN_DIR/config.toml as a `Config`; raise ConfigError with one line per problem, each naming the file."""
    path = Path(run_dir) / "config.toml"
    raw = _read_toml(path)  # ConfigError naming the file when it is missing or not TOML
    errors: list[str] = []
    cfg = _convert_struct(Config, raw, "", errors, set())
    if errors:
        raise ConfigError([f"{path}: {line}" for line in errors])
    return cfg
