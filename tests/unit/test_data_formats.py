"""Dataset layouts: verl's GSM8K parquet rows and TRL's conversational rows load unchanged; dotted field
paths reach nested fields; the `datasets` backend reads csv / arrow / save_to_disk folders / folders of files
named by split, and named splits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from asyncrl.config.schema import DataConfig
from asyncrl.data.rows import MissingField, check_data, field_at, format_row, load_rows
from asyncrl.rewards.rules import RULES

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
VERL_ROW = {  # the layout of verl's examples/data_preprocess/gsm8k.py
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": QUESTION + " Let's think step by step and output the final answer "
                                                      "after \"####\"."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "answer": "48/2 = 24 ... #### 72", "question": QUESTION},
}
TRL_ROW = {"prompt": [{"role": "user", "content": "What color is the sky?"}], "completion_hint": "blue"}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- the two layouts the issue names ---------------------------------------------------------------------


def test_verl_gsm8k_parquet_row_loads_and_its_nested_answer_scores(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW]), path)
    [row] = load_rows(DataConfig(path=str(path)), "train", seed=0)
    assert row["prompt"] == VERL_ROW["prompt"] and row["reward_model"]["ground_truth"] == "72"
    reward = RULES.get("exact_match")("reward_model.ground_truth")
    fields = {k: v for k, v in row.items() if k != "prompt"}
    assert reward("p", " 72 ", **fields) == 1.0 and reward("p", "71", **fields) == 0.0


def test_trl_conversational_jsonl_row_loads(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [TRL_ROW, {"prompt": "plain text works too"}])
    assert load_rows(DataConfig(path=str(path)), "train", seed=0) == [TRL_ROW, {"prompt": "plain text works too"}]


def test_rows_whose_prompt_is_neither_text_nor_messages_are_rejected(tmp_path):
    bad = [{"prompt": []}, {"prompt": [{"role": "user"}]}, {"prompt": [{"role": "user", "content": ["parts"]}]}]
    path = write_jsonl(tmp_path / "train.jsonl", [TRL_ROW, *bad])
    with pytest.raises(ValueError, match=r"^data\.path: line 2, line 3, line 4: not a row with a prompt at 'prompt'"):
        load_rows(DataConfig(path=str(path)), "train", seed=0)


def test_prompt_key_may_be_a_dotted_path(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [VERL_ROW])
    assert load_rows(DataConfig(path=str(path), prompt_key="extra_info.question"), "train", seed=0) == [VERL_ROW]


def test_rows_without_the_fields_of_the_prompt_template_are_named(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "q1"}, {"query": "q2"}])
    cfg = DataConfig(path=str(path), prompt_template="{question}\nAnswer with a number.")
    with pytest.raises(ValueError, match=r"^data\.path: line 2: data\.prompt_template: the row has no field "
                                         r"'question' — fix the rows"):
        load_rows(cfg, "train", seed=0)
    path.write_text('{"question": "q1"}\n')
    assert load_rows(cfg, "train", seed=0) == [{"question": "q1"}]  # no `prompt` field needed


# -- dotted field paths ---------------------------------------------------------------------------------


def test_field_at_follows_dotted_paths_and_list_indices():
    assert field_at(VERL_ROW, "reward_model.ground_truth") == "72"
    assert field_at(VERL_ROW, "prompt.0.role") == "user"
    assert field_at({"a.b": 1, "a": {"b": 2}}, "a.b") == 1  # a key holding dots is found first


def test_field_at_names_the_missing_part_of_the_path():
    with pytest.raises(MissingField) as exc:
        field_at(VERL_ROW, "reward_model.answer")
    assert str(exc.value) == "no field 'reward_model.answer'"
    with pytest.raises(KeyError) as exc:  # a MissingField is a KeyError
        field_at(VERL_ROW, "solution.value")
    assert str(exc.value) == "no field 'solution.value' (nothing at 'solution')"


def test_format_row_takes_dotted_fields_and_format_specs():
    assert format_row("{extra_info.index:03d}: {reward_model.ground_truth}", VERL_ROW) == "000: 72"
    assert format_row("{{literal}} {data_source}", VERL_ROW) == "{literal} openai/gsm8k"


def test_rule_with_a_missing_dotted_answer_key_names_the_path():
    reward = RULES.get("exact_match")("reward_model.answer")
    with pytest.raises(ValueError, match=r"the row has no field 'reward_model\.answer' .*reward\.answer_key"):
        reward("p", "72", reward_model={"ground_truth": "72"})


# -- the datasets backend -------------------------------------------------------------------------------


ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]


@pytest.fixture
def datasets():
    return pytest.importorskip("datasets")


def test_csv_file_loads_through_datasets(tmp_path, datasets):
    path = tmp_path / "train.csv"
    path.write_text("prompt,answer\n1+1=,2\n2+2=,4\n")
    rows = load_rows(DataConfig(path=str(path)), "train", seed=0)
    assert [r["prompt"] for r in rows] == ["1+1=", "2+2="] and str(rows[1]["answer"]) == "4"


def test_arrow_file_and_save_to_disk_dataset_load(tmp_path, datasets):
    datasets.Dataset.from_list([VERL_ROW, VERL_ROW]).save_to_disk(str(tmp_path / "one"))
    assert load_rows(DataConfig(path=str(tmp_path / "one")), "train", seed=0) == [VERL_ROW, VERL_ROW]
    [arrow] = (tmp_path / "one").glob("*.arrow")
    assert load_rows(DataConfig(path=str(arrow)), "train", seed=0) == [VERL_ROW, VERL_ROW]


def test_save_to_disk_dataset_dict_reads_the_named_splits(tmp_path, datasets):
    folder = tmp_path / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                          "test": datasets.Dataset.from_list(ROWS[3:])}).save_to_disk(str(folder))
    cfg = DataConfig(path=str(folder), eval_split="test")
    assert load_rows(cfg, "train", seed=0) == ROWS[:3]
    assert load_rows(cfg, "eval", seed=0) == ROWS[3:]
    assert check_data(cfg) == []
    with pytest.raises(ValueError, match=r"^data\.split: .* has no split 'validation' \(it holds train, test\)"):
        load_rows(DataConfig(path=str(folder), split="validation"), "train", seed=0)
    assert check_data(DataConfig(path=str(folder), eval_split="dev")) == [
        f"data.eval_split: {folder} has no split 'dev' (it holds train, test)"]


def test_folder_of_files_named_by_split_loads_like_verls_output(tmp_path, datasets):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder = tmp_path / "gsm8k"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([VERL_ROW] * 3), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist([VERL_ROW]), folder / "test.parquet")
    cfg = DataConfig(path=str(folder), eval_split="test")
    assert len(load_rows(cfg, "train", seed=0)) == 3 and len(load_rows(cfg, "eval", seed=0)) == 1


def test_eval_path_folder_with_several_splits_asks_for_eval_split(tmp_path, datasets):
    folder = tmp_path / "held_out"
    datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS), "b": datasets.Dataset.from_list(ROWS)}
                         ).save_to_disk(str(folder))
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"^data\.eval_split: .* holds the splits a, b — set data\.eval_split"):
        load_rows(DataConfig(path=str(train), eval_path=str(folder)), "eval", seed=0)
    assert load_rows(DataConfig(path=str(train), eval_path=str(folder), eval_split="b"), "eval", seed=0) == ROWS


def test_splits_of_a_single_file_are_config_errors(tmp_path):
    train = str(write_jsonl(tmp_path / "train.jsonl", ROWS))
    assert check_data(DataConfig(path=train, split="test"))[0].startswith("data.split: 'test' names a split")
    assert check_data(DataConfig(path=train, eval_split="test"))[0].startswith(
        f"data.eval_split: data.path {train!r} is a single file")
    with pytest.raises(ValueError, match=r"^data\.eval_split: .* single file"):
        load_rows(DataConfig(path=train, eval_split="test"), "eval", seed=0)


def test_csv_and_folders_without_datasets_name_the_extra(tmp_path, monkeypatch):
    (tmp_path / "train.csv").write_text("prompt\na\n")
    (tmp_path / "folder").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    for path, what in ((tmp_path / "train.csv", "a .csv file"), (tmp_path / "folder", "a folder")):
        assert check_data(DataConfig(path=str(path))) == [
            f"data.path: reading {what} needs the Hugging Face datasets library — pip install 'asyncrl[datasets]'"]
        with pytest.raises(ValueError, match=r"pip install 'asyncrl\[datasets\]'"):
            load_rows(DataConfig(path=str(path)), "train", seed=0)


def test_an_unreadable_folder_is_one_line(tmp_path, datasets):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as exc:
        load_rows(DataConfig(path=str(tmp_path / "empty")), "train", seed=0)
    assert str(exc.value).startswith("data.path: cannot read") and "\n" not in str(exc.value)
