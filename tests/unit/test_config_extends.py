"""`extends = "base.toml"` and `${env:VAR}` in config files (asyncrl/config/include.py): what a file resolves
to, and the one-line errors that name the file, the line, the key and the fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, config_to_toml, load_config, read_run_config

MODEL = """
[model]
path = "runs/models/tiny"

[model.build_tiny]
hidden_size = 32
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def load(path: Path, overrides: tuple[str, ...] = ()):
    return load_config(path, overrides, cross_checks=False)


def errors_of(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load(path, overrides)
    return exc.value.errors


# -- extends ------------------------------------------------------------------------------------------------

def test_a_file_extending_a_base_merges_tables_key_by_key_and_its_own_values_win(tmp_path):
    write(tmp_path / "base.toml", MODEL + """
        [trainer]
        lr = 0.01
        total_steps = 7
        betas = [0.8, 0.9]

        [data]
        source = "asyncrl.tasks.digits:first_digit"
    """)
    child = write(tmp_path / "child.toml", """
        extends = "base.toml"

        [trainer]
        lr = 0.002
        betas = [0.5]

        [model.build_tiny]
        num_layers = 3
    """)
    cfg = load(child, ("trainer.betas=[0.7, 0.6]",))
    assert cfg.trainer.lr == 0.002 and cfg.trainer.total_steps == 7  # a table merged, not replaced
    assert cfg.trainer.betas == [0.7, 0.6]  # arrays replace (the child's, then --set's)
    assert cfg.model.build_tiny.hidden_size == 32 and cfg.model.build_tiny.num_layers == 3  # nested tables too
    assert cfg.data.source == "asyncrl.tasks.digits:first_digit" and cfg.model.path == "runs/models/tiny"


def test_an_array_of_tables_in_the_file_replaces_the_bases_whole(tmp_path):
    write(tmp_path / "base.toml", MODEL + """
        [[reward.functions]]
        fn = "exact_match"

        [[reward.functions]]
        fn = "contains"
    """)
    child = write(tmp_path / "child.toml", """
        extends = "base.toml"

        [[reward.functions]]
        fn = "prefix_match"
        weight = 2.0
    """)
    assert [(f.fn, f.weight) for f in load(child).reward.functions] == [("prefix_match", 2.0)]


def test_relative_bases_are_read_from_the_including_files_folder_not_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path / "shared" / "base.toml", MODEL)
    write(tmp_path / "shared" / "sampling.toml", 'extends = "base.toml"\n[rollout]\ngroup_size = 3\n')
    child = write(tmp_path / "runs" / "a" / "config.toml", 'extends = "../../shared/sampling.toml"\n')
    monkeypatch.chdir(tmp_path / "runs")
    cfg = load(Path("a/config.toml"))
    assert cfg.rollout.group_size == 3 and cfg.model.path == "runs/models/tiny"  # a chain of two bases
    assert load(child) == cfg


def test_a_list_of_bases_merges_in_order_and_the_file_comes_last(tmp_path):
    write(tmp_path / "a.toml", MODEL + "[trainer]\nlr = 0.1\ntotal_steps = 5\nepochs = 2\n")
    write(tmp_path / "b.toml", "[trainer]\nlr = 0.2\ntotal_steps = 6\n")
    child = write(tmp_path / "c.toml", 'extends = ["a.toml", "b.toml"]\n[trainer]\nlr = 0.3\n')
    t = load(child).trainer
    assert (t.lr, t.total_steps, t.epochs) == (0.3, 6, 2)


def test_a_cycle_of_extends_is_one_line_naming_the_cycle(tmp_path):
    write(tmp_path / "a.toml", 'extends = "b.toml"\n' + MODEL)
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    errors = errors_of(tmp_path / "a.toml")
    assert len(errors) == 1
    assert "makes a cycle" in errors[0]
    assert errors[0].endswith(f"{tmp_path / 'a.toml'} -> {tmp_path / 'b.toml'} -> {tmp_path / 'a.toml'} "
                              f"— remove one of these extends")


def test_a_file_extending_itself_is_a_cycle(tmp_path):
    path = write(tmp_path / "a.toml", 'extends = "./a.toml"\n' + MODEL)
    (line,) = errors_of(path)
    assert "makes a cycle" in line


def test_a_missing_base_is_one_line_with_the_path_it_resolved_to(tmp_path):
    child = write(tmp_path / "sub" / "c.toml", 'extends = "../bases/nope.toml"\n' + MODEL)
    assert errors_of(child) == [f"{child}: extends = '../bases/nope.toml': no file {tmp_path / 'bases' / 'nope.toml'} "
                                f"(a relative path is read from the folder of the file that names it)"]


def test_extends_that_is_not_a_file_name_is_one_line(tmp_path):
    child = write(tmp_path / "c.toml", "extends = 3\n" + MODEL)
    (line,) = errors_of(child)
    assert line.startswith(f"{child}: extends: expected a file name or a list of file names")


def test_a_syntax_error_in_a_base_names_the_bases_file_and_line(tmp_path):
    base = write(tmp_path / "base.toml", MODEL + "\n[trainer]\nlr = = 1\n")
    child = write(tmp_path / "c.toml", 'extends = "base.toml"\n')
    (line,) = errors_of(child)
    assert line.startswith(f"{base}:8: TOML syntax error")


def test_a_bad_value_in_a_base_names_the_bases_file_and_line_and_one_in_the_file_names_neither(tmp_path):
    base = write(tmp_path / "base.toml", MODEL + """
        [trainer]
        lrr = 0.1
        total_steps = 0
    """)
    child = write(tmp_path / "c.toml", 'extends = "base.toml"\n\n[rollout]\ngroup_size = 0\n')
    errors = errors_of(child)
    assert f"{base}:8: trainer.lrr: unknown key — did you mean 'lr'?" in errors
    assert any(e.startswith(f"{base}:9: trainer.total_steps: expected an integer >= 1, got 0") for e in errors)
    assert any(e.startswith("rollout.group_size: expected an integer >= 1, got 0") for e in errors)
    assert len(errors) == 3


def test_a_set_override_of_a_base_value_is_reported_as_the_override_not_the_base(tmp_path):
    write(tmp_path / "base.toml", MODEL + "[trainer]\nlr = 0.1\n")
    child = write(tmp_path / "c.toml", 'extends = "base.toml"\n')
    (line,) = errors_of(child, ("trainer.lr=-1",))
    assert line.startswith("trainer.lr: expected a number > 0, got -1")


def test_the_resolved_config_carries_no_extends_and_reloads_equal_without_its_base(tmp_path):
    base = write(tmp_path / "base.toml", MODEL + "[trainer]\nlr = 0.05\n")
    child = write(tmp_path / "c.toml", 'extends = "base.toml"\n[run]\noutput_dir = "runs/c"\n')
    cfg = load(child)
    run_dir = tmp_path / "runs" / "c"
    run_dir.mkdir(parents=True)
    text = config_to_toml(cfg)
    assert "extends" not in text
    (run_dir / "config.toml").write_text(text)  # what a run writes: --resume reads this, not the base
    base.unlink()
    assert read_run_config(run_dir) == cfg


# -- ${env:VAR} ---------------------------------------------------------------------------------------------

def test_env_references_in_strings_are_replaced_in_nested_tables_and_arrays(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_T_NAME", "exp1")
    monkeypatch.setenv("ASYNCRL_T_STOP", "END")
    path = write(tmp_path / "c.toml", MODEL + """
        [run]
        output_dir = "runs/${env:ASYNCRL_T_NAME}/${env:ASYNCRL_T_NAME}"

        [rollout]
        stop = ["${env:ASYNCRL_T_STOP}", "x"]

        [data]
        chat_template_kwargs = { tag = "<${env:ASYNCRL_T_NAME}>" }
    """)
    cfg = load(path)
    assert cfg.run.output_dir == "runs/exp1/exp1"
    assert cfg.rollout.stop == ["END", "x"]
    assert cfg.data.chat_template_kwargs == {"tag": "<exp1>"}


def test_an_env_default_is_used_when_the_variable_is_unset_or_empty(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCRL_T_UNSET", raising=False)
    monkeypatch.setenv("ASYNCRL_T_EMPTY", "")
    path = write(tmp_path / "c.toml", MODEL + """
        [run]
        output_dir = "${env:ASYNCRL_T_UNSET:-runs/default-a}"
        [data]
        system_prompt = "${env:ASYNCRL_T_EMPTY:-Be brief.}${env:ASYNCRL_T_UNSET:-}"
    """)
    cfg = load(path)
    assert cfg.run.output_dir == "runs/default-a" and cfg.data.system_prompt == "Be brief."


def test_an_unset_variable_without_default_is_one_line_naming_the_key_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCRL_T_UNSET", raising=False)
    path = write(tmp_path / "c.toml", MODEL + '[data]\npath = "${env:ASYNCRL_T_UNSET}/train.jsonl"\n')
    assert errors_of(path) == ["data.path: environment variable ASYNCRL_T_UNSET is not set — export "
                               "ASYNCRL_T_UNSET=..., or give a default: ${env:ASYNCRL_T_UNSET:-value}"]


def test_an_unset_variable_in_a_base_names_the_bases_file_and_line(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCRL_T_UNSET", raising=False)
    base = write(tmp_path / "base.toml", MODEL + '[data]\npath = "${env:ASYNCRL_T_UNSET}"\n')
    child = write(tmp_path / "c.toml", 'extends = "base.toml"\n')
    (line,) = errors_of(child)
    assert line.startswith(f"{base}:7: data.path: environment variable ASYNCRL_T_UNSET is not set")


def test_an_unknown_interpolation_is_an_error_that_says_how_to_write_it(tmp_path):
    path = write(tmp_path / "c.toml", MODEL + '[data]\nsystem_prompt = "home is ${HOME}"\n')
    (line,) = errors_of(path)
    assert line.startswith("data.system_prompt: '${HOME}' is not an interpolation asyncrl knows — write ${env:VAR}")


def test_a_doubled_dollar_is_a_literal_and_a_literal_survives_the_saved_config(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_T_NAME", "exp1")
    path = write(tmp_path / "c.toml", MODEL + '[data]\nsystem_prompt = "costs $${env:ASYNCRL_T_NAME} and $$${x}"\n')
    cfg = load(path)
    assert cfg.data.system_prompt == "costs ${env:ASYNCRL_T_NAME} and $${x}"
    saved = write(tmp_path / "saved.toml", config_to_toml(cfg))
    assert load(saved) == cfg


def test_set_values_are_taken_literally_not_interpolated(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_T_NAME", "exp1")
    path = write(tmp_path / "c.toml", MODEL)
    cfg = load(path, ("run.output_dir=runs/${env:ASYNCRL_T_NAME}",))
    assert cfg.run.output_dir == "runs/${env:ASYNCRL_T_NAME}"
    assert load(write(tmp_path / "saved.toml", config_to_toml(cfg))) == cfg
