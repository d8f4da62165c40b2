"""Token-in/token-out episode transcripts: the exact token ids an episode trains on.

Place in the dataflow: the `EpisodeRunner` (and `asyncrl.Runtime` episodes) keep one `Transcript` per
episode. The model's turns are appended as the ids the engine sampled (loss_mask True, with their
behaviour logprobs and versions); environment observations are encoded once and appended
(loss_mask False). Nothing already in the transcript is ever decoded and re-encoded, so a tokenizer whose
decode→encode does not round-trip cannot change a trained token.

Formats (`[env] chat_template`):
* "none"   — plain: prompt = encode_prompt(initial observation) (with the model's BOS when its tokenizer
             puts one before plain text, as `asyncrl.data.prompts` does for dataset prompts); each observation =
             encode(text). The tiny char-level tokenizer has no chat template and uses this.
* "strict" — the tokenizer's chat template, applied append-only: for every turn k the rendering of
             messages[:k+1] must start with the rendering of messages[:k] (text and tokens); the tokens
             appended for an observation are the rendering's new suffix (plus the template's end-of-turn
             text after the model's message, minus what the model already sampled, e.g. its eos). A
             template that is not append-only raises `ChatTemplateError` naming the turn.
* "concat" — the fallback for such templates: each message rendered alone, renderings concatenated.
* "auto"   — "strict" when the template passes a probe conversation, else "concat" (with a warning);
             "none" without a template.

Observations are text (a user message) or a list of messages (e.g. role "tool": tool results), rendered
together. Tools: `start(..., tools=schemas)` passes the tools' JSON schemas to every rendering as the
template's `tools=` argument; a template that ignores `tools` gets `tools_prompt` (the call format's own
description of the tools) as a system message instead, so the model is told about them either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.data.prompts import plain_text_bos

log = logging.getLogger(__name__)

Message = dict[str, str]
Observation = str | list[Message]   # a user message's text, or messages (tool results) in order
FORMATS = ("auto", "none", "strict", "concat")


class ChatTemplateError(ValueError):
    """The chat template cannot be applied append-only (one line, names the turn)."""


class Codec(Protocol):
    """What a transcript needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...              # no special tokens added
    def encode_prompt(self, text: str) -> list[int]: ...       # an episode's first text: plus the BOS, if expected
    def decode(self, ids: list[int]) -> str: ...               # special tokens skipped (what the env sees)
    def decode_raw(self, ids: list[int]) -> str: ...           # special tokens kept (to match template text)
    def render(self, messages: list[Message], add_generation_prompt: bool,
               tools: list[dict] | None = None) -> str: ...  # chat template (`tools` only when there are some)


@dataclass
class HFCodec:
    """A Hugging Face tokenizer as a Codec."""

    tok: Any
    bos: int | None = field(init=False, default=None)  # put before plain text by this tokenizer, if any

    def __post_init__(self) -> None:
        self.bos = plain_text_bos(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """The first text of an episode without a chat template: the BOS once, if the model expects one
        (a template writes its own: `render` output goes through `encode`)."""
        ids = self.encode(text)
        return ids if self.bos is None or ids[:1] == [self.bos] else [self.bos, *ids]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def decode_raw(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def render(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))


def resolve_format(codec: Any, mode: str) -> str:
    """'auto' → 'strict' | 'concat' | 'none' for this tokenizer; other modes are checked and returned."""
    if mode not in FORMATS:
        raise ValueError(f"env.chat_template: unknown mode {mode!r} — one of {', '.join(FORMATS)}")
    has = bool(getattr(codec, "has_template", False))
    if mode == "none":
        return mode
    if not has:
        if mode == "auto":
            return "none"
        raise ValueError(f"env.chat_template: {mode!r} needs a tokenizer with a chat template and this one has none "
                         f"— use 'none' (plain append) or 'auto'")
    if mode != "auto":
        return mode
    try:
        probe_append_only(codec)
    except ChatTemplateError as exc:
        log.warning("%s; using per-message concatenation (env.chat_template = 'concat')", exc)
        return "concat"
    return "strict"


def probe_append_only(codec: Any) -> None:
    """Raise ChatTemplateError if a four-message probe conversation does not render append-only."""
    msgs = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "3"}, {"role": "assistant", "content": "4"}]
    for k in range(1, len(msgs)):
        _check_prefix(codec, msgs[:k], msgs[: k + 1], k)


def _render(codec: Any, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None) -> str:
    """The template's rendering; `tools` is passed only when there are some (a Codec may not take it)."""
    if tools:
        return codec.render(messages, add_generation_prompt, tools=tools)
    return codec.render(messages, add_generation_prompt)


def _check_prefix(codec: Any, before: list[Message], after: list[Message], turn: int,
                  tools: list[dict] | None = None) -> tuple[str, str]:
    """Renderings (before, after) of two conversations, each with the generation prompt when the model speaks
    next; raise unless `after` extends `before` (text and ids)."""
    gen_before = before[-1]["role"] != "assistant"
    gen_after = after[-1]["role"] != "assistant"
    a, b = _render(codec, before, gen_before, tools), _render(codec, after, gen_after, tools)
    ids_a, ids_b = codec.encode(a), codec.encode(b)
    if not b.startswith(a) or ids_b[: len(ids_a)] != ids_a:
        at = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        raise ChatTemplateError(
            f"chat template is not append-only at turn {turn}: the rendering of messages[:{len(after)}] does not "
            f"start with the rendering of messages[:{len(before)}] (first differing token {at}) — set "
            f"env.chat_template = 'concat' (per-message rendering) or use a template that only appends")
    return a, b


@dataclass
class Transcript:
    """One episode's tokens. `prompt_ids` = the templated initial observation; `response_ids` = every
    later token, model turns (mask True) interleaved with observations (mask False)."""

    codec: Any
    fmt: str = "none"                        # resolved: "none" | "strict" | "concat"
    stop_ids: frozenset[int] = frozenset()   # ids an engine stops on (their text may be a template closer)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    tools: list[dict] | None = None          # JSON schemas passed to every rendering (`start`)
    turns: int = 0
    # an MoE engine's routing (record_routing): int16 rows of [layers, top_k], one per position fed so far, each
    # position's from the turn whose forward fed it first (`add_model_turn`); lost with a truncated context
    routed_experts: bytes = b""
    routing_shape: list[int] = field(default_factory=list)
    routing_lost: bool = False
    _last_turn: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.fmt not in ("none", "strict", "concat"):
            raise ValueError(f"Transcript format must be resolved ('none', 'strict' or 'concat'), got {self.fmt!r}")

    @property
    def context(self) -> list[int]:
        """The exact token context of the next model turn."""
        return self.prompt_ids + self.response_ids

    def start(self, observation: Observation, tools: list[dict] | None = None, tools_prompt: str = "") -> list[int]:
        """Encode the initial observation (a user message's text, or messages ending the prompt) as the prompt.
        `tools`: JSON schemas for the template's `tools=`; where the template ignores them, `tools_prompt` goes
        in as (the start of) the system message. Without a template ("none") neither is used."""
        self.messages = _as_messages(observation)
        if self.fmt == "none":
            self.prompt_ids = self.codec.encode_prompt("".join(m["content"] for m in self.messages))
            return self.prompt_ids
        if tools:
            self._use_tools(tools, tools_prompt)
        if self.fmt == "strict":
            self.prompt_ids = self.codec.encode(self._render(self.messages, True))
        else:
            self.prompt_ids = self.codec.encode(self._render(self.messages, False) + self._gen_prompt())
        return self.prompt_ids

    def _use_tools(self, tools: list[dict], tools_prompt: str) -> None:
        probe = [{"role": "user", "content": "x"}]
        if self.codec.render(probe, False, tools=tools) != self.codec.render(probe, False):
            self.tools = list(tools)
            return
        if not tools_prompt:
            log.warning("the chat template ignores `tools` and no tools prompt was given: the model is not told "
                        "which tools it has")
            return
        log.debug("the chat template ignores `tools`: describing them in the system message")
        if self.messages[0]["role"] == "system":
            first = self.messages[0]
            self.messages[0] = {**first, "content": f"{tools_prompt}\n\n{first['content']}"}
        else:
            self.messages.insert(0, {"role": "system", "content": tools_prompt})

    def add_model_turn(self, ids: list[int], logprobs: list[float], versions: list[int],
                       routing: tuple[bytes, list[int]] | None = None) -> str:
        """Append the sampled ids as they are; return the turn's text for the env. `routing`: the engine's record
        of the turn (`Completion.routed_experts`, `routing_shape`), every position of context + ids but the last."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"model turn: {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        if routing is not None:
            self._join_routing(*routing, positions=len(self.context) + len(ids) - 1)
        self.response_ids += ids
        self.loss_mask += [True] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        self.turns += 1
        self._last_turn = list(ids)
        text = self.codec.decode(ids)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def _join_routing(self, data: bytes, shape: list[int], positions: int) -> None:
        """Keep the positions this turn fed first: the context the earlier turns fed keeps their routing (the
        forward that sampled from it), the rest — the last turn's final token, the observations since, this
        turn's tokens — takes this turn's. A turn without a record, or with a truncated context, ends the
        record (the trainer's own router decides every position after it)."""
        row = 2 * shape[0] * shape[1] if len(shape) == 2 else 0
        if self.routing_lost:
            return
        if not data or not row or (self.routing_shape and list(shape) != self.routing_shape) \
                or len(data) != positions * row:
            self.routing_lost = True
            return
        self.routing_shape = list(shape)
        self.routed_experts += data[len(self.routed_experts):]

    def routing(self) -> dict[str, Any]:
        """The Trajectory's `routed_experts` / `routing_shape`: a row per position but the last, rows of -1 (no
        record: the trainer's router decides) where the episode ended on observations or the record ended."""
        if not self.routed_experts:
            return {}
        row = 2 * self.routing_shape[0] * self.routing_shape[1]
        want = (len(self.context) - 1) * row
        data = self.routed_experts[:want] + b"\xff" * max(0, want - len(self.routed_experts))  # int16 -1
        return {"routed_experts": data, "routing_shape": list(self.routing_shape)}

    def lose_routing(self) -> None:
        """The engine truncated a turn's context: its routing rows no longer line up with the transcript."""
        self.routing_lost = True

    def observation_ids(self, observation: Observation) -> list[int]:
        """The ids an observation appends (not yet appended); raises ChatTemplateError in strict mode."""
        msgs = _as_messages(observation)
        if self.fmt == "none":
            return self.codec.encode("".join(m["content"] for m in msgs))
        if self.fmt == "strict":
            closer = self._strict_closer()
            prev, full = _check_prefix(self.codec, self.messages, [*self.messages, *msgs], self.turns, self.tools)
            return self.codec.encode(closer + full[len(prev):])
        # The model's message rendered alone: its header is the generation prompt the context already
        # holds, so its content is searched for after that (a short content like "a" may occur in the header).
        rendered, gen = self._one(self.messages[-1]), self._gen_prompt()
        head = rendered.find(gen) if gen else -1
        closer = self._closer(rendered, self.messages[-1]["content"], head + len(gen) if head >= 0 else 0)
        return self.codec.encode(closer + self.codec.render(msgs, False) + gen)

    def add_observation(self, observation: Observation, ids: list[int], version: int) -> None:
        self.response_ids += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)  # placeholder: the learner masks env tokens out
        self.versions += [version] * len(ids)
        self.messages += _as_messages(observation)

    # -- template pieces ---------------------------------------------------------------------------
    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return _render(self.codec, messages, add_generation_prompt, self.tools)

    def _one(self, msg: Message) -> str:
        return self.codec.render([msg], False)

    def _gen_prompt(self) -> str:
        probe = [{"role": "user", "content": "x"}]
        with_gen, without = self.codec.render(probe, True), self.codec.render(probe, False)
        return with_gen[len(without):] if with_gen.startswith(without) else ""

    def _strict_closer(self) -> str:
        """Template text after the model's message content (e.g. '<|im_end|>\\n'), minus what it sampled."""
        head = self._render(self.messages[:-1], True)
        full = self._render(self.messages, False)
        if not full.startswith(head):
            raise ChatTemplateError(
                f"chat template is not append-only at turn {self.turns}: the rendering with the model's message "
                f"does not start with the generation prompt before it — set env.chat_template = 'concat'")
        return self._closer(full[len(head):], self.messages[-1]["content"])

    def _closer(self, rendered: str, content: str, start: int = 0) -> str:
        """The text of `rendered` (a model message) after its `content`, searched from `start`."""
        at = rendered.find(content, start) if content else start
        closer = rendered[at + len(content):] if at >= 0 else ""
        # The model's own stop token (eos / end-of-turn) is already in the transcript: do not add it twice.
        tail = [i for i in self._last_turn[-1:] if i in self.stop_ids]
        sampled = self.codec.decode_raw(tail) if tail else ""
        if sampled and closer.startswith(sampled):
            closer = closer[len(sampled):]
        return closer


def _as_messages(observation: Observation) -> list[Message]:
    """An observation as chat messages: text is one user message; a list is checked and copied."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not observation or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                  and isinstance(m.get("content"), str) for m in observation):
        raise ValueError("an observation is text or a non-empty list of messages with string 'role' and 'content'")
    return [dict(m) for m in observation]
