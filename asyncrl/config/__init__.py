"""Configuration: the run's TOML schema, reading it, and checking it — the bottom of the library.

Owns the schema (`schema`, with the sections in `algo`, `lora`, `trackers` on the base in `section`), reading a
file (`include`: `extends`, `${env:VAR}`; `fields`: field-by-field conversion, one line per problem), the loader
(`loader`: `load_config`, overrides, `config_to_toml`), the cross-field checks (`checks`) and the editor schema
and starter config (`tools`). It imports nothing of asyncrl but `asyncrl.registry`: each subsystem's check of its
own keys lives with that subsystem and is named in `checks.CHECKS` by import path, imported only when it runs.
Everything else imports it. The names below are its public API.
"""

from asyncrl.config.fields import ConfigError
from asyncrl.config.loader import apply_overrides, config_from_dict, config_to_toml, load_config, read_run_config
from asyncrl.config.schema import Config

__all__ = ["Config", "ConfigError", "apply_overrides", "config_from_dict", "config_to_toml", "load_config",
           "read_run_config"]
