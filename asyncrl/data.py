"""Prompt sources: load dataset rows and hand them out as an endless, reshuffled stream.

Place in the dataflow: the controller calls `load_rows(cfg.data, "train", seed)` once and feeds a
`PromptStream` to the generators (each row is a dict; `data.prompt_key` holds the prompt text, the other
fields travel with the trajectory to the reward function). `asyncrl validate` calls `check_data`.

Sources (exactly one of `data.path` / `data.source`):
- `.jsonl`: one JSON object per line (blank lines skipped); `.json`: a JSON array of objects, or JSONL.
- `.parquet`: read with pyarrow (the `asyncrl[parquet]` extra).
- `source = 'pkg.module:function'`: called as `fn(split="train"|"eval", seed=seed)`, returning an
  iterable of dicts.
Relative paths are resolved against the current working directory.

Eval split: `data.eval_path` if set; else the callable with split="eval"; else (a `data.path` without an
eval file) the train rows themselves, with a warning — the caller takes the first `trainer.eval_prompts`
of them, so evaluation then measures prompts that are also trained on.

Bad rows are a user mistake: loading raises ValueError with one line naming the config field and up to
three row (or line) numbers, rather than skipping rows silently.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from asyncrl.config_schema import DataConfig
from asyncrl.registry import import_path

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet")
Split = Literal["train", "eval"]


def load_rows(data_cfg: DataConfig, split: Split, seed: int) -> list[dict[str, Any]]:
    """Rows of one split, each checked to hold a string under `data_cfg.prompt_key`."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if split == "eval" and data_cfg.eval_path:
        field, numbered = "data.eval_path", _read_file(data_cfg.eval_path, "data.eval_path")
    elif data_cfg.source:
        field, numbered = "data.source", _call_source(data_cfg.source, split, seed)
    elif data_cfg.path:
        field, numbered = "data.path", _read_file(data_cfg.path, "data.path")
        if split == "eval":
            log.warning("no data.eval_path: evaluating on the first training rows of %s", data_cfg.path)
    else:
        raise ValueError("data: set data.path (a JSONL/Parquet file) or data.source ('pkg.module:function')")
    rows = _check_rows(numbered, data_cfg.prompt_key, field)
    if not rows and split == "train":
        raise ValueError(f"{field}: the {split} split has no rows")
    return rows


def check_data(data_cfg: DataConfig) -> list[str]:
    """Error lines for `asyncrl validate`: the source is set once, files exist, the callable fits."""
    errors: list[str] = []
    if bool(data_cfg.path) == bool(data_cfg.source):
        which = "both are set" if data_cfg.path else "neither is set"
        errors.append(f"data.path, data.source: set exactly one of them ({which}) — a JSONL/Parquet file "
                      f"or 'pkg.module:function'")
    for field, value in (("data.path", data_cfg.path), ("data.eval_path", data_cfg.eval_path)):
        if value:
            errors += _check_file(field, value)
    if data_cfg.source:
        errors += _check_source(data_cfg.source)
    return errors


class PromptStream:
    """The endless prompt order: epoch e is a fresh permutation of the rows seeded by (seed, e), and
    `row(i)` is its i-th row overall, so the order is a function of the index alone.

    The generators ask for the row of each group they admit by its group id (`row(group_id)`): the gate
    hands ids out in order, so all generators share one order, a group regenerated after a failure or a
    resume gets the same prompt, and the data position of a run is the gate's next group id (nothing to
    checkpoint). The same seed gives the same order in every process. Rows are returned as shallow copies,
    so a consumer may add fields without touching the source.
    """

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("PromptStream needs at least one row")
        self._rows = list(rows)
        self._seed = seed
        self._shuffle = shuffle
        self.epoch = -1
        self._order: list[int] = []
        self._pos = 0
        self._orders: dict[int, list[int]] = {}  # epoch -> permutation, for row(); the newest two kept

    def row(self, index: int) -> dict[str, Any]:
        """The `index`-th row of the endless order (index >= 0)."""
        if index < 0:
            raise ValueError(f"PromptStream.row: index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self._rows))
        order = self._orders.get(epoch)
        if order is None:
            order = self._permutation(epoch)
            self._orders[epoch] = order
            for old in sorted(self._orders)[:-2]:  # ids arrive nearly in order: two epochs cover the overlap
                del self._orders[old]
        return dict(self._rows[order[pos]])

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if self._shuffle:
            # A string seed is hashed with SHA-512 by `random`: stable across processes and runs.
            random.Random(f"asyncrl-prompts:{self._seed}:{epoch}").shuffle(order)
        return order

    def next_row(self) -> dict[str, Any]:
        if self._pos >= len(self._order):
            self._start_epoch()
        row = self._rows[self._order[self._pos]]
        self._pos += 1
        return dict(row)

    def _start_epoch(self) -> None:
        self.epoch += 1
        self._order = self._permutation(self.epoch)
        self._pos = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        return self.next_row()


# -- reading --------------------------------------------------------------------------------------------


def _read_file(path: str, field: str) -> Iterator[tuple[str, Any]]:
    """(label, row) pairs from a JSONL/JSON/Parquet file; the label is 'line N' or 'row N'."""
    errors = _check_file(field, path)
    if errors:
        raise ValueError(errors[0])
    p = Path(path)
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
        return ((f"row {i}", item) for i, item in enumerate(items, 1))
    return _read_jsonl(text, field)


def _read_jsonl(text: str, field: str) -> Iterator[tuple[str, Any]]:
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


def _read_parquet(path: Path, field: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{field}: reading Parquet needs pyarrow — pip install 'asyncrl[parquet]'") from None
    try:
        items = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a corrupt file; report one line
        raise ValueError(f"{field}: cannot read Parquet file {path} ({exc})") from None
    return ((f"row {i}", item) for i, item in enumerate(items, 1))


def _call_source(spec: str, split: Split, seed: int) -> Iterator[tuple[str, Any]]:
    errors = _check_source(spec)
    if errors:
        raise ValueError(errors[0])
    result = import_path(spec)(split=split, seed=seed)
    if isinstance(result, (str, bytes, dict)) or not isinstance(result, Iterable):
        raise ValueError(f"data.source: {spec!r} returned a {type(result).__name__}, not an iterable of row dicts")
    return ((f"row {i}", item) for i, item in enumerate(result, 1))


def _check_rows(numbered: Iterable[tuple[str, Any]], prompt_key: str, field: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bad: list[str] = []
    for label, row in numbered:
        if isinstance(row, dict) and isinstance(row.get(prompt_key), str):
            rows.append(row)
        else:
            bad.append(label)
    if bad:
        shown = ", ".join(bad[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
        raise ValueError(
            f"{field}: {shown}: not a row with a string field {prompt_key!r} "
            f"— fix the rows or set data.prompt_key to the field holding the prompt text"
        )
    return rows


# -- checks ---------------------------------------------------------------------------------------------


def _check_file(field: str, path: str) -> list[str]:
    p = Path(path)
    if p.suffix not in SUFFIXES:
        return [f"{field}: {path!r} must end in {', '.join(SUFFIXES)}"]
    if not p.is_file():
        return [f"{field}: file {path!r} does not exist (relative paths start at {Path.cwd()})"]
    return []


def _check_source(spec: str) -> list[str]:
    try:
        fn = import_path(spec)
    except ValueError as exc:
        return [f"data.source: {exc} — is its package installed or on PYTHONPATH?"]
    if not callable(fn):
        return [f"data.source: {spec!r} is not callable (got {type(fn).__name__})"]
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []  # uninspectable: trust the convention
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    keywords = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    missing = [name for name in ("split", "seed") if name not in keywords]
    extra = [p.name for p in params if p.name not in ("split", "seed") and p.default is p.empty
             and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    if missing or extra:
        what = f"missing: {', '.join(missing)}" if missing else f"it also requires: {', '.join(extra)}"
        return [f"data.source: {spec!r} must be callable as fn(split=..., seed=...) ({what}) — "
                f"e.g. def rows(split, seed): ..."]
    return []
