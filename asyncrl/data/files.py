"""Dataset files on disk: the readers behind `data.path` / `data.eval_path`.

Place in the dataflow: `asyncrl.data.rows.load_rows` asks `read_path` for the (label, row) pairs of one split and
`check_path` for `asyncrl validate`'s error lines; nothing else reads dataset files.

What a path may be (chosen by its suffix, or a folder):
- `.jsonl` (one JSON object per line, blank lines skipped), `.json` (a JSON array of objects, or JSONL):
  built in.
- `.parquet`: pyarrow (the `asyncrl[parquet]` extra). Nested columns (verl's `prompt` list of messages,
  `reward_model` struct) come back as lists and dicts.
- `.csv`, `.arrow`, and folders: the Hugging Face `datasets` library (the `asyncrl[datasets]` extra). A
  folder written by `save_to_disk` (it holds `dataset_dict.json` or `state.json`) is read with
  `load_from_disk`; any other folder with `load_dataset(folder)`, which finds data files and names their
  splits from the file names (`train.parquet`, `test-00000-of-00001.parquet`, `data/train/*.jsonl`, ...).

A single file is one split. A folder may hold several (a `DatasetDict`): `split` names the one to read;
`split=None` takes the only split there is, and names the splits otherwise. Nothing is downloaded: a hub
dataset is read from a local copy (e.g. `load_dataset(name).save_to_disk(folder)` on a connected machine).
`datasets` is given a temporary cache folder that is removed once the rows are read, so no cache is left
in the user's home.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Iterator

BUILTIN_SUFFIXES = (".jsonl", ".json", ".parquet")
DATASETS_SUFFIXES = (".csv", ".arrow")
SUFFIXES = BUILTIN_SUFFIXES + DATASETS_SUFFIXES
DATASETS_EXTRA = "pip install 'asyncrl[datasets]'"

Numbered = Iterator[tuple[str, Any]]


def read_path(path: str, field: str, split: str | None = None, split_field: str = "data.split") -> Numbered:
    """(label, row) pairs of one split of `path`; the label is 'line N' or 'row N'. Raises ValueError with
    one line naming `field` (or `split_field` for a split the folder lacks)."""
    errors = check_path(field, path)
    if errors:
        raise ValueError(errors[0])
    p = Path(path)
    if p.is_dir() or p.suffix in DATASETS_SUFFIXES:
        return _numbered(_read_with_datasets(p, field, split, split_field))
    if p.suffix == ".parquet":
        return _read_parquet(p, field)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{field}: cannot read {path} ({exc})") from None
    if p.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: {path} is not valid JSON ({exc})") from None
        return _numbered(items)
    return _read_jsonl(text, field)


def check_path(field: str, path: str) -> list[str]:
    """Error lines for a dataset path: a known suffix or a folder, present, its reader installed."""
    p = Path(path)
    if p.suffix not in SUFFIXES and (p.is_file() or (p.suffix and not p.exists())):
        return [f"{field}: {path!r} must end in {', '.join(SUFFIXES)} or be a dataset folder"]
    if not p.exists():
        what = "file" if p.suffix in SUFFIXES else "path"
        return [f"{field}: {what} {path!r} does not exist (relative paths start at {Path.cwd()})"]
    if (p.is_dir() or p.suffix in DATASETS_SUFFIXES) and not _has_datasets():
        what = "a folder" if p.is_dir() else f"a {p.suffix} file"
        return [f"{field}: reading {what} needs the Hugging Face datasets library — {DATASETS_EXTRA}"]
    return []


def is_single_split(path: str) -> bool:
    """Whether `path` is one split by construction (a file): `data.split` / `data.eval_split` do not apply."""
    return Path(path).is_file()


def disk_splits(path: str) -> list[str] | None:
    """The split names a `save_to_disk` DatasetDict folder records (read without `datasets`), else None."""
    index = Path(path) / "dataset_dict.json"
    try:
        splits = json.loads(index.read_text(encoding="utf-8")).get("splits")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(s) for s in splits] if isinstance(splits, list) else None


# -- built-in readers -----------------------------------------------------------------------------------


def _numbered(items: Any) -> Numbered:
    return ((f"row {i}", item) for i, item in enumerate(items, 1))


def _read_jsonl(text: str, field: str) -> Numbered:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: line {lineno}: not a JSON object ({exc.msg} at column {exc.colno})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{field}: line {lineno}: not a JSON object (got {type(item).__name__})")
        yield f"line {lineno}", item


def _read_parquet(path: Path, field: str) -> Numbered:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{field}: reading Parquet needs pyarrow — pip install 'asyncrl[parquet]'") from None
    try:
        items = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a corrupt file; report one line
        raise ValueError(f"{field}: cannot read Parquet file {path} ({exc})") from None
    return _numbered(items)


# -- Hugging Face datasets ------------------------------------------------------------------------------


def _has_datasets() -> bool:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def _read_with_datasets(path: Path, field: str, split: str | None, split_field: str) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()  # a few-thousand-row dataset needs no progress bar in the run's log
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-datasets-") as cache:
            if path.is_file() and path.suffix == ".arrow":
                ds = datasets.Dataset.from_file(str(path), in_memory=True)
            elif path.is_file():  # .csv
                ds = datasets.load_dataset("csv", data_files=str(path), split="train", cache_dir=cache,
                                           keep_in_memory=True)
            elif (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                ds = datasets.load_from_disk(str(path), keep_in_memory=True)
            else:
                ds = datasets.load_dataset(str(path), cache_dir=cache, keep_in_memory=True)
            if isinstance(ds, datasets.DatasetDict):
                ds = _pick_split(ds, path, split, split_field)
            return ds.to_list()
    except ValueError:
        raise
    except Exception as exc:  # datasets raises many types for an unreadable folder or file; report one line
        raise ValueError(f"{field}: cannot read {path} with the datasets library ({type(exc).__name__}: {exc})") \
            from None


def _pick_split(dd: Any, path: Path, split: str | None, split_field: str) -> Any:
    names = list(dd)
    if split is None:
        if len(names) == 1:
            return dd[names[0]]
        raise ValueError(f"{split_field}: {path} holds the splits {', '.join(names)} — set {split_field} to one "
                         f"of them")
    if split not in dd:
        raise ValueError(f"{split_field}: {path} has no split {split!r} (it holds {', '.join(names) or 'none'})")
    return dd[split]
