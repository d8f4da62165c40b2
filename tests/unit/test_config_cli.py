"""`asyncrl config schema | show | init`, `asyncrl --version` and the help text (asyncrl/config/tools.py,
asyncrl/cli.py), and the example configs, which share examples/base.toml through `extends`."""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from importlib import metadata
from pathlib import Path

import msgspec
import pytest

from asyncrl.cli import _parser, main
from asyncrl.config import config_to_toml, load_config
from asyncrl.config.fields import _list_struct_type, _struct_type
from asyncrl.config.schema import Config
from asyncrl.config.tools import STARTER, config_schema, starter_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RUN_CONFIGS = sorted(p for p in EXAMPLES.glob("*/*.toml"))  # examples/<name>/*.toml; examples/*.toml are bases


def tables(cls: type = Config, path: str = "") -> list[tuple[str, type]]:
    """Every table of the schema with its Struct: ('', Config), ('model', ModelConfig), ..."""
    out = [(path, cls)]
    for f in msgspec.structs.fields(cls):
        sub = _struct_type(f.type) or _list_struct_type(f.type)
        if sub is not None:
            out += tables(sub, f"{path}.{f.encode_name}" if path else f.encode_name)
    return out


def leaf_fields(cls: type) -> list[msgspec.structs.FieldInfo]:
    return [f for f in msgspec.structs.fields(cls)
            if _struct_type(f.type) is None and _list_struct_type(f.type) is None]


# -- the examples -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_example_loads_through_its_bases_and_resolves_without_extends(path, tmp_path):
    cfg = load_config(path, cross_checks=False)
    text = config_to_toml(cfg)
    assert "extends" not in text and load_config(_written(tmp_path / "resolved.toml", text), cross_checks=False) == cfg


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_every_example_extends_the_shared_base():
    def bases(path: Path) -> list[Path]:
        ext = tomllib.loads(path.read_text()).get("extends", [])
        direct = [(path.parent / e).resolve() for e in ([ext] if isinstance(ext, str) else ext)]
        return direct + [b for d in direct for b in bases(d)]

    assert RUN_CONFIGS and all((EXAMPLES / "base.toml").resolve() in bases(p) for p in RUN_CONFIGS)


# -- schema -------------------------------------------------------------------------------------------------

def test_the_schema_gives_every_key_of_every_table_its_description():
    defs = config_schema()["$defs"]
    missing = [f"{path}.{f.encode_name}" for path, cls in tables() for f in msgspec.structs.fields(cls)
               if not defs[cls.__name__]["properties"][f.encode_name].get("description")]
    assert missing == []
    assert "extends" in defs["Config"]["properties"]


@pytest.mark.parametrize("draft", ["declared", "Draft202012Validator"])
def test_the_schema_accepts_every_example_file_and_rejects_a_typo_and_a_wrong_type(draft):
    jsonschema = pytest.importorskip("jsonschema")
    schema = config_schema()
    cls = jsonschema.validators.validator_for(schema) if draft == "declared" else getattr(jsonschema, draft)
    cls.check_schema(schema)
    validator = cls(schema)
    for path in sorted(EXAMPLES.rglob("*.toml")):  # as an editor sees them: bases and files with extends
        assert [e.message for e in validator.iter_errors(tomllib.loads(path.read_text()))] == [], path
        resolved = tomllib.loads(config_to_toml(load_config(path, cross_checks=False))) if path in RUN_CONFIGS else {}
        assert [e.message for e in validator.iter_errors(resolved)] == [], path
    bad = {"trainer": {"lrr": 1e-3, "total_steps": "ten"}, "extends": 3, "env": {"env": "guess", "max_turns": 0}}
    messages = sorted(e.message for e in validator.iter_errors(bad))
    assert len(messages) == 4 and any("'lrr' was unexpected" in m for m in messages)


def test_config_schema_prints_json_or_writes_the_file(tmp_path, capsys):
    assert main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == config_schema()
    out = tmp_path / "asyncrl.schema.json"
    assert main(["config", "schema", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == config_schema()


# -- show ---------------------------------------------------------------------------------------------------

def test_config_show_prints_every_default_after_extends_and_set_and_reloads_equal(tmp_path, capsys):
    path = EXAMPLES / "ppo" / "config.toml"
    assert main(["config", "show", str(path), "--set", "trainer.lr=1e-4"]) == 0
    text = capsys.readouterr().out
    raw = tomllib.loads(text)
    assert raw["trainer"]["lr"] == 1e-4 and raw["algorithm"]["advantage"] == "gae"  # the --set, the file
    assert raw["model"]["build_tiny"]["hidden_size"] == 64 and raw["cluster"]["num_cpus"] == 2  # the bases
    assert raw["weight_sync"]["bucket_mb"] == 256.0  # a default no file mentions
    shown = load_config(_written(tmp_path / "shown.toml", text), cross_checks=False)
    assert shown == load_config(path, ["trainer.lr=1e-4"], cross_checks=False)


def test_config_show_ends_with_the_auto_values_this_machine_resolves_them_to(capsys):
    """The machine-dependent defaults of [cluster] are decided when a run starts (asyncrl/deploy/auto.py), in one
    step that `config show` prints as comments after the TOML: the values resolve_ray gives the actors and the
    torch threads each role then sets."""
    from asyncrl.deploy.auto import machine_defaults, resolve_ray

    path = EXAMPLES / "first_digit" / "config.toml"
    assert main(["config", "show", str(path)]) == 0
    text = capsys.readouterr().out
    toml_part, _, comment = text.partition("\n# On this machine")
    assert tomllib.loads(toml_part)["cluster"]["scorer_placement"] == "auto"  # the file keeps "auto"
    cfg = load_config(path, cross_checks=False)
    rows = machine_defaults(cfg, [0, 1])
    placed = resolve_ray(cfg, [0, 1]).cluster
    assert ("cluster.scorer_placement", placed.scorer_placement) in rows
    assert ("cluster.affinity.trainer", placed.affinity.trainer) in rows and placed.affinity.trainer == [1]
    assert dict(rows)["torch_threads.trainer"] == [1] and dict(rows)["torch_threads.local"] == 1
    shown = machine_defaults(cfg)  # this machine's own CPUs, as printed
    assert [line.split(" = ")[0].strip("# ") for line in comment.splitlines()[2:]] == [k for k, _ in shown]
    assert f'#   cluster.scorer_placement = "{dict(shown)["cluster.scorer_placement"]}"' in comment
    fixed = load_config(path, ['cluster.torch_threads=2', 'cluster.scorer_placement="actor"'], cross_checks=False)
    assert not any(k.startswith("torch_threads.") or k == "cluster.scorer_placement" for k, _ in
                   machine_defaults(fixed, [0, 1]))  # values the user set are not "resolved"


def test_config_show_of_a_bad_config_prints_its_errors_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text('[model]\npath = "m"\n[trainer]\nlrr = 1\n')
    assert main(["config", "show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == "config error: trainer.lrr: unknown key — did you mean 'lr'?"


# -- init ---------------------------------------------------------------------------------------------------

def test_config_init_writes_a_starter_that_validates_and_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "sub" / "my.toml"
    assert main(["config", "init", "--out", str(out)]) == 0
    assert out.read_text() == starter_config()
    out.write_text("# mine\n")
    assert main(["config", "init", "--out", str(out)]) == 2
    assert out.read_text() == "# mine\n" and "pass --force" in capsys.readouterr().err
    assert main(["config", "init", "--out", str(out), "--force"]) == 0
    assert out.read_text() == starter_config()
    capsys.readouterr()
    assert main(["launch", str(out), "--dry-run"]) == 0  # every cross-field check of this machine too
    assert json.loads(capsys.readouterr().out)["samples_per_step"] == 16 * 8


def test_the_starter_sets_its_values_and_lists_every_other_key_at_its_default_under_its_description(tmp_path):
    text = starter_config()
    cfg = load_config(_written(tmp_path / "starter.toml", text), cross_checks=False)
    assert cfg.trainer.lr == STARTER["trainer"]["lr"] and cfg.model.build_tiny is not None and cfg.env is None
    seen: dict[str, list[str]] = {}
    table, previous, uncommented = "", "", []
    for line in text.splitlines():
        if m := re.match(r"^(?:# )?\[\[?([\w.]+)\]\]?$", line):
            table = m.group(1)
            active = not line.startswith("#")
        elif m := re.match(r"^(# )?(\w+) = (.*)$", line):
            seen.setdefault(table, []).append(m.group(2))
            assert previous.startswith("#") and not re.match(r"^# \w+ = ", previous), line  # its description
            if m.group(1) and active and "(required)" not in line and "(unset by default)" not in line:
                line = f"{m.group(2)} = {m.group(3)}"
        previous = line
        uncommented.append(line)
    expected = {path: [f.encode_name for f in leaf_fields(cls)] for path, cls in tables() if path}
    expected = {path: keys for path, keys in expected.items() if keys}
    assert seen == expected  # every key of every table, in the schema's order
    # the commented-out defaults are the real defaults: uncommented, they change nothing
    again = load_config(_written(tmp_path / "uncommented.toml", "\n".join(uncommented)), cross_checks=False)
    assert again == cfg


def test_each_key_of_the_starter_has_its_own_description_above_it():
    text = starter_config()
    descriptions = config_schema()["$defs"]["TrainerConfig"]["properties"]
    for key in ("lr", "total_steps", "mini_batches"):
        start = descriptions[key]["description"][:40]
        assert re.search(rf"# {re.escape(start)}.*?\n(?:#   .*\n)*(?:# )?{key} = ", text), key


@pytest.mark.slow
def test_the_starter_config_trains_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "init"]) == 0
    rc = main(["launch", "config.toml", "--local", "--set", "trainer.total_steps=2", "--set",
               "trainer.prompts_per_step=2", "--set", "trainer.eval_every=0", "--set", "logging.live=false",
               "--set", "run.save_checkpoint=false"])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "starter" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == 2


# -- --version, --help --------------------------------------------------------------------------------------

def test_version_prints_the_installed_packages_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    try:
        expected = metadata.version("asyncrl")
    except metadata.PackageNotFoundError:
        expected = "unknown (not installed)"
    assert capsys.readouterr().out.strip() == f"asyncrl {expected}"


def test_help_ends_with_example_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "examples:\n  asyncrl config init" in out
    assert "asyncrl launch examples/first_digit/config.toml --local" in out


def test_every_positional_argument_of_every_command_has_help_text():
    def positionals(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, str | None]]:
        out = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.append((f"{name} {action.metavar}", action.help))
                for sub_name, sub in action.choices.items():
                    out += positionals(sub, f"{name} {sub_name}")
            elif not action.option_strings:
                out.append((f"{name} {action.dest}", action.help))
        return out

    found = positionals(_parser(), "asyncrl")
    assert {"asyncrl plot run_dirs", "asyncrl sweep config", "asyncrl config show config"} <= {n for n, _ in found}
    assert [name for name, text in found if not text or text == argparse.SUPPRESS] == []
