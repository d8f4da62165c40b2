"""Load a run's config: read the TOML (`include.py`: `extends`, `${env:VAR}`), apply `--set` overrides, convert
it field by field against the schema (`fields.py`, `schema.py`) and run the cross-field checks (`checks.py`).

Place in the dataflow: the CLI calls `load_config(path, overrides)` before anything else starts; the
deployments build every role from the returned `Config`, and the Controller writes `config_to_toml(cfg)` into
the run directory.

Validation reports every problem at once, one line each, naming the TOML path and the fix:
1. TOML syntax (one line, `file:line`), `extends` and `${env:VAR}`, then `--set section.key=value` overrides
   (values parsed as TOML, falling back to a plain string);
2. field by field: unknown keys (with a did-you-mean), missing required keys, and each value converted
   alone with `msgspec.convert` against its annotated type (msgspec stops at the first error, so a whole
   struct is never converted in one go); the field's `Meta(description=...)` is quoted as the hint;
3. cross-field checks (asyncrl/config/checks.py: batch divisibility, queue capacities, and each subsystem's
   own check of the keys it reads). A check is skipped when a field it reads already failed in step 2, so one
   mistake gives one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import msgspec

from asyncrl.config.checks import cross_check
from asyncrl.config.fields import ConfigError, convert_struct, drop_none, parse_value
from asyncrl.config.include import blame, escape_interpolation, forget, read_config
from asyncrl.config.schema import Config

__all__ = ["ConfigError", "apply_overrides", "config_from_dict", "config_to_toml", "load_config", "read_run_config"]


def load_config(path: str | Path, overrides: Sequence[str] = (), *, cross_checks: bool = True) -> Config:
    """Read a TOML config, apply `section.key=value` overrides, validate everything; raise ConfigError.

    `cross_checks=False` checks each field (unknown keys, types, bounds) but not the cross-field checks,
    which look at the machine a run starts on (model and data paths, reward imports, CUDA, CPU ids)."""
    raw, origins = read_config(Path(path))
    errors = apply_overrides(raw, overrides)
    for item in overrides:
        forget(origins, item.partition("=")[0].strip())
    try:
        cfg = config_from_dict(raw, cross_checks=cross_checks)
    except ConfigError as exc:
        errors += exc.errors
    if errors:
        raise ConfigError(blame(errors, origins, Path(path)))  # a value a base file set: that file and line
    return cfg


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run wrote into RUN_DIR/config.toml, for the readers of a finished run (`asyncrl report`,
    `asyncrl plan`): checked field by field, each error naming the file; a field the file lacks (a run
    written before it existed) takes its default. No cross-field checks: a finished run is read on
    whatever machine holds its directory, not the one it ran on."""
    path = Path(run_dir) / "config.toml"
    try:
        return load_config(path, cross_checks=False)
    except ConfigError as exc:
        if not path.is_file():
            raise
        raise ConfigError([f"{path}: {line}" for line in exc.errors]) from None


def config_from_dict(raw: dict[str, Any], *, cross_checks: bool = True) -> Config:
    """Validate a TOML-shaped dict (field by field, then cross-field); raise ConfigError listing all."""
    errors: list[str] = []
    broken: set[str] = set()
    cfg = convert_struct(Config, raw, "", errors, broken)
    if cross_checks:
        errors += cross_check(cfg, broken)
    if errors:
        raise ConfigError(errors)
    return cfg


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> list[str]:
    """Set each `a.b.c=value` in `raw` (in place); return one error line per malformed override."""
    errors: list[str] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            errors.append(f"--set {item}: expected section.key=value, e.g. trainer.lr=1e-4")
            continue
        node = raw
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                errors.append(f"--set {item}: {'.'.join(parts[: depth + 1])} is a value, not a table")
                break
        else:
            node[parts[-1]] = parse_value(text.strip())
    return errors


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML text (no `extends`, a literal `${` escaped); `load_config` of it gives back an
    equal Config."""
    return msgspec.toml.encode(escape_interpolation(drop_none(msgspec.to_builtins(cfg)))).decode()
