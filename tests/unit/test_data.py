"""Prompt sources: JSONL / JSON / Parquet files, callables, row checks, and the reshuffling stream."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from asyncrl.config.schema import DataConfig
from asyncrl.data.rows import PromptStream, check_data, load_rows

FIX = "asyncrl_unit_fixtures"


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "data"))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]


def test_jsonl_rows_load_in_file_order_and_blank_lines_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    path.write_text(path.read_text() + "\n   \n")
    assert load_rows(DataConfig(path=str(path)), "train", seed=0) == ROWS


def test_json_array_file_loads(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(ROWS))
    assert load_rows(DataConfig(path=str(path)), "train", seed=0) == ROWS


def test_parquet_rows_load(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows(DataConfig(path=str(path)), "train", seed=0) == ROWS


def test_parquet_without_pyarrow_says_which_extra_to_install(tmp_path, monkeypatch):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"data\.path: .*pip install 'asyncrl\[parquet\]'"):
        load_rows(DataConfig(path=str(path)), "train", seed=0)


def test_callable_source_is_called_with_split_and_seed():
    rows = load_rows(DataConfig(source=f"{FIX}:rows"), "train", seed=7)
    assert [r["prompt"] for r in rows] == [f"train-{i}" for i in range(5)]
    assert {r["seed"] for r in rows} == {7}
    assert load_rows(DataConfig(source=f"{FIX}:rows"), "eval", seed=7)[0]["prompt"] == "eval-0"


def test_callable_source_taking_kwargs_is_accepted():
    assert load_rows(DataConfig(source=f"{FIX}:rows_kwargs"), "train", seed=3) == [{"prompt": "train-kw", "seed": 3}]


def test_eval_split_reads_eval_path_when_set(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "held out"}])
    cfg = DataConfig(path=str(train), eval_path=str(held_out))
    assert load_rows(cfg, "eval", seed=0) == [{"prompt": "held out"}]


def test_eval_split_without_eval_file_falls_back_to_train_rows_with_warning(tmp_path, caplog):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with caplog.at_level(logging.WARNING, logger="asyncrl.data.rows"):
        rows = load_rows(DataConfig(path=str(train)), "eval", seed=0)
    assert rows == ROWS
    assert "no data.eval_path" in caplog.text


def test_bad_jsonl_line_error_names_the_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"^data\.path: line 3: not a JSON object"):
        load_rows(DataConfig(path=str(path)), "train", seed=0)


def test_jsonl_line_that_is_not_an_object_names_the_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"^data\.path: line 2: not a JSON object \(got list\)"):
        load_rows(DataConfig(path=str(path)), "train", seed=0)


def test_rows_missing_prompt_key_are_rejected_naming_up_to_three(tmp_path):
    rows = [{"prompt": "ok"}] + [{"question": "q"}] * 4 + [{"prompt": 5}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError) as exc:
        load_rows(DataConfig(path=str(path)), "train", seed=0)
    message = str(exc.value)
    assert message.startswith("data.path: line 2, line 3, line 4 (and 2 more): not a row with a prompt at 'prompt' "
                              "(a string, or a list of chat messages")
    assert "data.prompt_key" in message and "\n" not in message


def test_prompt_key_selects_the_prompt_field(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "2+2="}])
    assert load_rows(DataConfig(path=str(path), prompt_key="question"), "train", seed=0) == [{"question": "2+2="}]


def test_callable_rows_without_prompt_are_rejected_by_row_number():
    with pytest.raises(ValueError, match=r"^data\.source: row 2, row 3: not a row"):
        load_rows(DataConfig(source=f"{FIX}:rows_missing_prompt"), "train", seed=0)


def test_empty_train_file_is_an_error(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"^data\.path: the train split has no rows"):
        load_rows(DataConfig(path=str(path)), "train", seed=0)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({}, "data.path, data.source: set exactly one of them (neither is set)"),
        ({"path": "x.jsonl", "source": f"{FIX}:rows"}, "(both are set)"),
        ({"path": "missing.jsonl"}, "data.path: file 'missing.jsonl' does not exist"),
        ({"path": "rows.txt"}, "data.path: 'rows.txt' must end in .jsonl, .json, .parquet, .csv, .arrow or be a "
                               "dataset folder"),
        ({"source": f"{FIX}:rows", "eval_path": "missing.parquet"}, "data.eval_path: file 'missing.parquet' does not"),
        ({"source": f"{FIX}:rows_without_seed"},
         "data.source: 'asyncrl_unit_fixtures:rows_without_seed' must be callable as fn(split=..., seed=...) "
         "(missing: seed)"),
        ({"source": f"{FIX}:NOT_A_FUNCTION"},
         "data.source: 'asyncrl_unit_fixtures:NOT_A_FUNCTION' is not callable (got int)"),
        ({"source": "no_such_module_xyz:rows"}, "data.source: cannot import module 'no_such_module_xyz'"),
    ],
)
def test_check_data_reports_one_line_naming_the_field(tmp_path, monkeypatch, kwargs, fragment):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "x.jsonl", ROWS)
    errors = check_data(DataConfig(**kwargs))
    assert len(errors) == 1 and fragment in errors[0], errors


def test_check_data_accepts_existing_file_and_good_source(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert check_data(DataConfig(path=str(path))) == []
    assert check_data(DataConfig(source=f"{FIX}:rows")) == []


def take(stream: PromptStream, n: int) -> list[str]:
    return [stream.next_row()["prompt"] for _ in range(n)]


ROWS10 = [{"prompt": str(i)} for i in range(10)]


def test_prompt_stream_visits_every_row_once_per_epoch_and_reshuffles():
    stream = PromptStream(ROWS10, seed=1, shuffle=True)
    first, second = take(stream, 10), take(stream, 10)
    assert sorted(first) == sorted(second) == sorted(r["prompt"] for r in ROWS10)
    assert first != second  # a new permutation each epoch
    assert stream.epoch == 1


def test_prompt_stream_is_deterministic_per_seed():
    assert take(PromptStream(ROWS10, seed=5), 30) == take(PromptStream(ROWS10, seed=5), 30)
    assert take(PromptStream(ROWS10, seed=5), 30) != take(PromptStream(ROWS10, seed=6), 30)


def test_prompt_stream_without_shuffle_cycles_in_order():
    assert take(PromptStream(ROWS10[:3], seed=0, shuffle=False), 7) == ["0", "1", "2", "0", "1", "2", "0"]


def test_prompt_stream_returns_copies_so_consumers_cannot_alter_the_dataset():
    rows = [{"prompt": "a"}]
    stream = PromptStream(rows, seed=0)
    stream.next_row()["extra"] = 1
    assert rows == [{"prompt": "a"}] and "extra" not in next(stream)


def test_prompt_stream_rejects_no_rows():
    with pytest.raises(ValueError, match="at least one row"):
        PromptStream([], seed=0)


def test_prompt_rows_are_a_function_of_the_group_id_alone():
    from asyncrl.data.rows import PromptStream

    rows = [{"prompt": str(i)} for i in range(5)]
    a, b = PromptStream(rows, seed=3), PromptStream(rows, seed=3)
    forward = [a.row(i)["prompt"] for i in range(12)]
    backward = [b.row(i)["prompt"] for i in reversed(range(12))][::-1]  # any order of asking
    assert forward == backward
    assert sorted(forward[:5]) == sorted(forward[5:10]) == [str(i) for i in range(5)]  # each epoch whole
    assert forward[:5] != forward[5:10] or forward[5:10] != forward[10:] + forward[:3]  # reshuffled
    with pytest.raises(ValueError):
        a.row(-1)
