"""Prompt sources: load dataset rows and hand them out as an endless, reshuffled stream.

Place in the dataflow: the generators and the trainer's evaluator call `load_rows(cfg.data, split, seed)` once
(asyncrl/deploy/build.py) and `asyncrl.data.prompts` turns each row into the prompt's tokens; a `PromptStream` hands the
rows to the generators by group id. Each row is a dict; its prompt is the `data.prompt_key` field (a string, or a list
of chat messages `[{"role", "content"}]` as in TRL's conversational format and verl's parquet rows) or
`data.prompt_template` formatted with its fields. The whole row travels with the trajectory to the reward function.
`asyncrl validate` calls `check_data`.

Sources (exactly one of `data.path` / `data.source`):
- `data.path`: a file or folder, read by `asyncrl.data.files` (.jsonl, .json, .parquet built in; .csv,
  .arrow and folders — `save_to_disk`, or data files named by split — through the `datasets` extra).
  `data.split` picks the split of a folder that holds several.
- `source = 'pkg.module:function'`: called as `fn(split="train"|"eval", seed=seed)`, returning an
  iterable of dicts.
Relative paths are resolved against the current working directory.

Eval split: `data.eval_path` if set (its `data.eval_split`, if set); else the callable with split="eval";
else `data.eval_split` of the `data.path` folder if set; else the train rows themselves, with a warning —
the caller takes the first `trainer.eval_prompts` of them, so evaluation then measures prompts that are also
trained on.

Fields are named by dotted paths through nested rows (`field_at`): `reward_model.ground_truth` reads
`row["reward_model"]["ground_truth"]`, so verl's GSM8K layout loads unchanged; a key that itself holds
dots is found first.

Bad rows are a user mistake: loading raises ValueError with one line naming the config field and up to
three row (or line) numbers, rather than skipping rows silently.
"""

from __future__ import annotations

import inspect
import logging
import random
import string
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Literal

from asyncrl.config.schema import Config, DataConfig
from asyncrl.data.files import check_path, disk_splits, is_single_split, read_path
from asyncrl.registry import import_path

log = logging.getLogger(__name__)

Split = Literal["train", "eval"]


def load_rows(data_cfg: DataConfig, split: Split, seed: int) -> list[dict[str, Any]]:
    """Rows of one split, each checked to hold a prompt (`data.prompt_key`, or the fields of
    `data.prompt_template`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    eval_split = data_cfg.eval_split or None
    if split == "eval" and data_cfg.eval_path:
        field, numbered = "data.eval_path", read_path(data_cfg.eval_path, "data.eval_path", eval_split,
                                                      "data.eval_split")
    elif data_cfg.source:
        field, numbered = "data.source", _call_source(data_cfg.source, split, seed)
    elif data_cfg.path and split == "eval" and eval_split:
        if is_single_split(data_cfg.path):
            raise ValueError(_SINGLE_FILE_EVAL.format(path=data_cfg.path))
        field, numbered = "data.path", read_path(data_cfg.path, "data.path", eval_split, "data.eval_split")
    elif data_cfg.path:
        field, numbered = "data.path", read_path(data_cfg.path, "data.path", data_cfg.split)
        if split == "eval":
            log.warning("no data.eval_path or data.eval_split: evaluating on the first training rows of %s",
                        data_cfg.path)
    else:
        raise ValueError("data: set data.path (a dataset file or folder) or data.source ('pkg.module:function')")
    rows = _check_rows(numbered, data_cfg, field)
    if not rows and split == "train":
        raise ValueError(f"{field}: the {split} split has no rows")
    return rows


def check_config(cfg: Config) -> list[str]:
    """The [data] section's check in `load_config` (asyncrl/config/checks.py): `check_data` of it."""
    return check_data(cfg.data)


def check_data(data_cfg: DataConfig) -> list[str]:
    """Error lines for `asyncrl validate`: the source is set once, paths exist and can be read, the splits
    named exist where that is known without reading, the callable fits."""
    errors: list[str] = []
    if bool(data_cfg.path) == bool(data_cfg.source):
        which = "both are set" if data_cfg.path else "neither is set"
        errors.append(f"data.path, data.source: set exactly one of them ({which}) — a dataset file or folder "
                      f"or 'pkg.module:function'")
    for field, value in (("data.path", data_cfg.path), ("data.eval_path", data_cfg.eval_path)):
        if value:
            errors += check_path(field, value)
    if errors:
        return errors + (_check_source(data_cfg.source) if data_cfg.source else [])
    errors += _check_splits(data_cfg)
    if data_cfg.source:
        errors += _check_source(data_cfg.source)
    if data_cfg.prompt_template:
        errors += _check_template(data_cfg.prompt_template)
    return errors


# -- fields ---------------------------------------------------------------------------------------------


class MissingField(KeyError):
    """A row lacks the field a dotted path names; `path` is the whole path, `missing` its first absent part."""

    def __init__(self, path: str, missing: str) -> None:
        super().__init__(path)
        self.path, self.missing = path, missing

    def __str__(self) -> str:
        if self.missing == self.path:
            return f"no field {self.path!r}"
        return f"no field {self.path!r} (nothing at {self.missing!r})"


def field_at(row: Mapping[str, Any], path: str) -> Any:
    """The value at `path` in a row: a key of the row, or a dotted path through nested dicts (and list
    indices: 'prompt.0.content'); a key that itself holds dots is found first. Raises MissingField."""
    if path in row:
        return row[path]
    node: Any = row
    parts = path.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise MissingField(path, ".".join(parts[: i + 1]))
    return node


class _RowFormatter(string.Formatter):
    """str.format over a row whose replacement fields are dotted paths ('{reward_model.ground_truth}')."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        return field_at(kwargs, field_name), field_name


def format_row(template: str, row: Mapping[str, Any]) -> str:
    """`template` formatted with the row's fields (dotted paths allowed; format specs and `{{`/`}}` as in
    str.format). Raises MissingField for a field the row lacks, ValueError for a malformed template."""
    return _RowFormatter().vformat(template, (), row)


def is_messages(value: Any) -> bool:
    """A non-empty list of chat messages, each a dict with string 'role' and 'content' (extra keys allowed)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value))


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


def _call_source(spec: str, split: Split, seed: int) -> Iterator[tuple[str, Any]]:
    errors = _check_source(spec)
    if errors:
        raise ValueError(errors[0])
    result = import_path(spec)(split=split, seed=seed)
    if isinstance(result, (str, bytes, dict)) or not isinstance(result, Iterable):
        raise ValueError(f"data.source: {spec!r} returned a {type(result).__name__}, not an iterable of row dicts")
    return ((f"row {i}", item) for i, item in enumerate(result, 1))


def _check_rows(numbered: Iterable[tuple[str, Any]], data_cfg: DataConfig, field: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bad: list[str] = []
    first_problem = ""
    for label, row in numbered:
        problem = _row_problem(row, data_cfg)
        if problem is None:
            rows.append(row)
            continue
        bad.append(label)
        first_problem = first_problem or problem
    if bad:
        shown = ", ".join(bad[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
        raise ValueError(f"{field}: {shown}: {first_problem}")
    return rows


def _row_problem(row: Any, data_cfg: DataConfig) -> str | None:
    """What makes `row` unusable as a prompt row (one phrase with its fix), or None."""
    if data_cfg.prompt_template:
        if not isinstance(row, Mapping):
            return f"not a row (got {type(row).__name__})"
        try:
            format_row(data_cfg.prompt_template, row)
        except MissingField as exc:
            return f"data.prompt_template: the row has {exc} — fix the rows or the template's field names"
        except (ValueError, IndexError) as exc:
            return f"data.prompt_template: cannot format it ({exc})"
        return None
    key = data_cfg.prompt_key
    try:
        value = field_at(row, key) if isinstance(row, Mapping) else None
    except MissingField:
        value = None
    if isinstance(value, str) or is_messages(value):
        return None
    return (f"not a row with a prompt at {key!r} (a string, or a list of chat messages with string 'role' and "
            f"'content') — fix the rows or set data.prompt_key to the field holding the prompt")


# -- checks ---------------------------------------------------------------------------------------------


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


_SINGLE_FILE_EVAL = ("data.eval_split: data.path {path!r} is a single file (one split) — set data.eval_path to the "
                     "held-out rows, or point data.path at a folder holding the splits")


def _check_splits(data_cfg: DataConfig) -> list[str]:
    """The splits named apply to the paths given, and exist where a save_to_disk folder lists its splits."""
    errors: list[str] = []
    path, eval_path = data_cfg.path, data_cfg.eval_path
    if path and data_cfg.split != "train" and is_single_split(path):
        errors.append(f"data.split: {data_cfg.split!r} names a split of a folder, and data.path {path!r} is a single "
                      f"file (one split) — leave data.split at 'train' or point data.path at the folder")
    if data_cfg.eval_split and not eval_path:
        if data_cfg.source:
            errors.append("data.eval_split: applies to data.eval_path or a data.path folder; data.source is called "
                          "with split='eval' — leave data.eval_split empty")
        elif path and is_single_split(path):
            errors.append(_SINGLE_FILE_EVAL.format(path=path))
    wanted = [("data.split", path, data_cfg.split)] if path else []
    if data_cfg.eval_split:
        wanted.append(("data.eval_split", eval_path or path, data_cfg.eval_split))
    for field, where, name in wanted:
        known = disk_splits(where) if where else None
        if known is not None and name not in known:
            errors.append(f"{field}: {where} has no split {name!r} (it holds {', '.join(known)})")
    return errors


def _check_template(template: str) -> list[str]:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return [f"data.prompt_template: not a valid format string ({exc}) — write a literal brace as {{{{ or }}}}"]
    positional = [n for n in names if n == "" or n.isdigit()]
    if positional:
        return ["data.prompt_template: name a row field in each {} (e.g. '{question}'), not a position"]
    return []
