"""Prompts: where a dataset row becomes the token ids the model is prompted with — the one place.

Place in the dataflow: `asyncrl/deploy/build.py` gives every generator and the trainer's evaluator a
`PromptEncoder` (row -> `Prompt`) and screens their rows with `screen_rows` (`data.overlong`) before a
`PromptStream` hands them out; `asyncrl validate` and the Ray launch call `check_prompts`, so an over-long
prompt is one line, not an actor's death (the launch checks while its actors start). (Environment episodes
render their own observations: asyncrl/envs/transcript.py.)

A row becomes a prompt in four steps, each set in `[data]`:
1. The prompt: `prompt_template` formatted with the row's fields (`{question}`, dotted paths such as
   `{extra_info.question}`) when set, else the row's `prompt_key` field — a string, or a list of chat
   messages `[{"role", "content"}]` (TRL's conversational format, verl's parquet rows).
2. Messages: a string is one user message; `system_prompt`, when set, goes first as a system message
   (unless the messages already start with one: the row's own wins).
3. Text: with `chat_template = "auto"` and a tokenizer that has a chat template,
   `apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)`.
   A string prompt that already holds one of the template's markers (the special tokens the template itself
   writes around a probe conversation: `<|im_start|>`, `<|start_header_id|>`, `<|begin_of_text|>`) was
   rendered upstream (verl, OpenRLHF) and is used as it is — templated once, not twice, and without
   `system_prompt`; the log says so once. Chat messages are always rendered.
   Otherwise (`"none"`, or no template) the messages' contents joined by newlines, roles dropped — a string
   prompt without a system prompt is exactly itself.
4. Ids, special tokens: the text is encoded without adding special tokens, then
   - with a chat template: the template writes the BOS if the model wants one (as HF's
     `apply_chat_template(tokenize=True)` and vLLM's chat API do), so a template that starts with
     `{{ bos_token }}` gives exactly one BOS; a pre-rendered prompt without it gets that one BOS, as the
     template would have written it. A tokenizer that adds a BOS to plain text under a template that does
     not write one is warned about once; the template still decides.
   - without one: the BOS, if the tokenizer puts one before plain text (`encode(text)` with special tokens
     starts with `bos_token_id`: Llama-style `add_bos_token` or a TemplateProcessing post-processor), is
     prepended unless the text already begins with it. Only the BOS: a tokenizer that also appends an EOS
     to plain text does not end a prompt with it. The tiny char-level tokenizer adds nothing.
Then the length: a prompt over `max_prompt_len` tokens is, by `overlong`, an error naming the rows
("error", checked for every row at load), a row left out ("filter", counted), or cut to its last tokens
("truncate_left", counted; a leading BOS is kept).

`Prompt.text` — what the reward function receives as `prompt`, and the ledger shows — is the prompt without
chat-template markup: the messages' contents joined by newlines (the string itself for a plain prompt).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from asyncrl.config.schema import Config, DataConfig
from asyncrl.data.rows import Split, field_at, format_row, is_messages, load_rows

log = logging.getLogger(__name__)

Message = dict[str, Any]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]          # what the engine is prompted with (at most max_prompt_len ids)
    text: str               # the prompt without template markup: the reward function's `prompt`
    truncated: bool = False  # cut to its last max_prompt_len ids (data.overlong = "truncate_left")


class OverlongPrompt(ValueError):
    """A prompt longer than data.max_prompt_len where data.overlong does not allow cutting it."""


class PromptEncoder:
    """Row -> Prompt with the `[data]` settings and the model's tokenizer (steps in the module docstring)."""

    def __init__(self, tokenizer: Any, data_cfg: DataConfig) -> None:
        self.tok = tokenizer
        self.cfg = data_cfg
        self.templated = data_cfg.chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))
        self.markers: tuple[str, ...] = ()  # the template's own special tokens: a string holding one is rendered
        self.bos = plain_text_bos(tokenizer)  # the BOS every prompt begins with (None: none is added)
        if self.templated:
            self.markers, first = template_markers(tokenizer, data_cfg.chat_template_kwargs)
            if self.bos is not None and first not in (None, self.bos):
                log.warning("the chat template does not begin with the BOS token (id %d) the tokenizer puts "
                            "before plain text; prompts follow the template (no BOS added)", self.bos)
            if first != self.bos:
                self.bos = None  # the template decides: it writes none
        self._said_rendered = False

    # -- steps 1-3: row -> messages -> text ------------------------------------------------------------
    def raw_prompt(self, row: Mapping[str, Any]) -> Any:
        """The row's prompt as written: prompt_template formatted with the row, else its prompt_key field."""
        if self.cfg.prompt_template:
            return format_row(self.cfg.prompt_template, row)
        return field_at(row, self.cfg.prompt_key)

    def messages(self, row: Mapping[str, Any]) -> list[Message]:
        return self._messages(self.raw_prompt(row))

    def _messages(self, value: Any) -> list[Message]:
        if isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        elif is_messages(value):
            messages = [dict(m) for m in value]
        else:
            raise ValueError(f"data.prompt_key {self.cfg.prompt_key!r}: the prompt must be a string or a list of chat "
                             f"messages with string 'role' and 'content', got {type(value).__name__}")
        if self.cfg.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return messages

    def render(self, row: Mapping[str, Any]) -> tuple[str, str]:
        """(model text, plain text): what is tokenized, and the prompt without template markup (a pre-rendered
        string prompt is both)."""
        value = self.raw_prompt(row)
        if isinstance(value, str) and self.rendered(value):
            return value, value
        messages = self._messages(value)
        plain = "\n".join(m["content"] for m in messages)
        if not self.templated:
            return plain, plain
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                **self.cfg.chat_template_kwargs)
        except Exception as exc:  # jinja raises its own types (a template's raise_exception, a missing key)
            raise ValueError(f"data.chat_template: the tokenizer's chat template failed on a prompt "
                             f"({type(exc).__name__}: {exc}) — check the row's messages and "
                             f"data.chat_template_kwargs, or set data.chat_template = 'none'") from exc
        if not isinstance(text, str):
            raise ValueError(f"data.chat_template: the chat template returned a {type(text).__name__}, not text")
        return text, plain

    # -- step 4: text -> ids ---------------------------------------------------------------------------
    def token_ids(self, text: str) -> list[int]:
        return self._with_bos(self.tok.encode(text, add_special_tokens=False))

    def rendered(self, text: str) -> bool:
        """Whether a string prompt already carries the chat template (holds one of its markers); the first
        one found is logged once."""
        found = next((m for m in self.markers if m in text), None)
        if found is not None and not self._said_rendered:
            self._said_rendered = True
            skipped = "; data.system_prompt is not added to them" if self.cfg.system_prompt else ""
            log.warning("data.chat_template = 'auto': string prompts that already hold the chat template's "
                        "special tokens (this one has %r) are used as they are, not templated again%s",
                        found, skipped)
        return found is not None

    def _with_bos(self, ids: list[int]) -> list[int]:
        # a template's rendering already begins with its BOS: only a pre-rendered prompt without it, or plain
        # text (no template) for a tokenizer that puts one before it, gets one here
        if self.bos is None or ids[:1] == [self.bos]:
            return ids
        return [self.bos, *ids]

    # -- the prompt ------------------------------------------------------------------------------------
    def encode(self, row: Mapping[str, Any]) -> Prompt:
        """The row's prompt within max_prompt_len: cut (truncate_left) or OverlongPrompt (error, filter —
        rows screened at load never raise it)."""
        text, plain = self.render(row)
        return self._fit(self.token_ids(text), plain)

    def lengths(self, rows: list[Mapping[str, Any]]) -> list[int]:
        """Prompt lengths in tokens of many rows (one batched tokenizer call)."""
        if not rows:
            return []
        texts = [self.render(row)[0] for row in rows]
        batch = self.tok(texts, add_special_tokens=False)["input_ids"]
        return [len(self._with_bos(list(ids))) for ids in batch]

    def _fit(self, ids: list[int], plain: str) -> Prompt:
        limit = self.cfg.max_prompt_len
        if len(ids) <= limit:
            return Prompt(ids, plain)
        if self.cfg.overlong != "truncate_left":
            raise OverlongPrompt(f"a prompt of {len(ids)} tokens is longer than data.max_prompt_len = {limit} "
                                 f"(data.overlong = {self.cfg.overlong!r})")
        keep_bos = self.bos is not None and ids[0] == self.bos and limit > 1
        kept = [ids[0], *ids[len(ids) - limit + 1:]] if keep_bos else ids[len(ids) - limit:]
        return Prompt(kept, plain, truncated=True)


# Conversations the chat template is rendered on to learn its markers; the second for templates that
# refuse a lone user message (and so that a template's system-turn tokens count too).
PROBES = ([{"role": "user", "content": "hi"}],
          [{"role": "system", "content": "hi"}, {"role": "user", "content": "hi"}])


def template_markers(tokenizer: Any, kwargs: Mapping[str, Any]) -> tuple[tuple[str, ...], int | None]:
    """(markers, first id): the special tokens the chat template writes around the probe conversations
    (`<|im_start|>`, `<|start_header_id|>`, `<|begin_of_text|>` ...: the tokenizer's special tokens and
    added tokens marked special), and the first id of its rendering of the first probe it renders. ((), None)
    when it renders neither (rows then fail with their own error)."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    found: dict[int, None] = {}  # ordered, for a stable log line
    first: int | None = None
    for messages in PROBES:
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception:  # jinja's own types; a template that refuses this probe may render the other
            continue
        if not isinstance(text, str) or not text:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        first = ids[0] if first is None and ids else first
        found.update((i, None) for i in ids if i in special)
    return tuple(t for t in tokenizer.convert_ids_to_tokens(list(found)) if t), first


def plain_text_bos(tokenizer: Any) -> int | None:
    """The BOS id if the tokenizer puts it before plain text when asked for special tokens, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = tokenizer.encode("a", add_special_tokens=True)
    without = tokenizer.encode("a", add_special_tokens=False)
    return bos if with_special[:1] == [bos] and without[:1] != [bos] else None


def screen_rows(rows: list[dict[str, Any]], encoder: PromptEncoder, what: str = "train"
                ) -> tuple[list[dict[str, Any]], int]:
    """Apply data.overlong at load: (rows kept, rows left out).

    "error" raises one line naming up to three rows (1-based, in load order) with their lengths; "filter"
    leaves them out and logs the count once; "truncate_left" keeps every row (each is cut when encoded)."""
    cfg = encoder.cfg
    if cfg.overlong == "truncate_left" or not rows:
        return rows, 0
    limit = cfg.max_prompt_len
    over = [(i, n) for i, n in enumerate(encoder.lengths(rows), 1) if n > limit]
    if not over:
        return rows, 0
    if cfg.overlong == "error":
        shown = ", ".join(f"row {i} ({n} tokens)" for i, n in over[:3])
        more = f" and {len(over) - 3} more" if len(over) > 3 else ""
        raise OverlongPrompt(
            f"data.max_prompt_len: {what} {shown}{more}: prompt longer than {limit} tokens — raise "
            f"data.max_prompt_len, or set data.overlong = 'filter' (leave such rows out) or 'truncate_left' "
            f"(keep their last tokens)")
    dropped = {i for i, _ in over}
    kept = [row for i, row in enumerate(rows, 1) if i not in dropped]
    if not kept:
        raise OverlongPrompt(f"data.max_prompt_len: every {what} prompt is longer than {limit} tokens "
                             f"(data.overlong = 'filter' left none) — raise data.max_prompt_len")
    log.warning("data.overlong = 'filter': left out %d of %d %s rows longer than data.max_prompt_len = %d tokens",
                len(over), len(rows), what, limit)
    return kept, len(over)


def prompt_rows(cfg: Config, split: Split, encoder: PromptEncoder) -> tuple[list[dict[str, Any]], int]:
    """The rows a role prompts with and how many `data.overlong = 'filter'` left out: the train split, or
    the first `trainer.eval_prompts` held-out rows (filtered before they are counted off). [env] rows are
    not screened: episodes render their own observations."""
    rows = load_rows(cfg.data, split, cfg.run.seed)
    first = cfg.trainer.eval_prompts if split == "eval" else len(rows)
    if cfg.env is not None:
        return rows[:first], 0
    if cfg.data.overlong != "filter":
        rows = rows[:first]  # only these are encoded: check only these
    kept, dropped = screen_rows(rows, encoder, split)
    return kept[:first], dropped


def check_prompts(cfg: Config, tokenizer: Any | None = None) -> list[str]:
    """Error lines for the run's prompts with the model's tokenizer (`asyncrl validate`, and the Ray launch
    while its actors start): every train row (and eval row, with evaluation on) loads, renders and, with
    data.overlong = 'error', fits max_prompt_len. None for [env] runs (episodes render their own
    observations), or without `tokenizer` when model.path holds no tokenizer yet (a tiny model not built)."""
    if cfg.env is not None:
        return []
    if tokenizer is None:
        if not (Path(cfg.model.path) / "tokenizer_config.json").is_file():
            return []
        from engines.hf import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
    encoder = PromptEncoder(tokenizer, cfg.data)
    errors: list[str] = []
    for split in ("train", "eval") if cfg.trainer.eval_every > 0 else ("train",):
        try:
            prompt_rows(cfg, split, encoder)
        except ValueError as exc:  # one line each: `asyncrl validate` reports every problem
            errors.append(str(exc))
    return errors
