"""Chat requests of the OpenAI-compatible endpoint → the exact prompt ids the engine is prompted with.

Place in the dataflow: `openai_server.py` calls `ChatRenderer.prompt` for each /chat/completions request;
the ids go to `Runtime.generate` and into the episode's record (`recording.py`). A request that continues an
earlier turn (`ServedEpisode.parent_for_chat`) is prompted with that turn's exact context plus
`extension` — the template's end-of-turn text after the reply (minus a stop token the model sampled) and the
rendering of the new messages — as `asyncrl/envs/transcript.py` does for environment episodes ("strict").
When the template does not render the longer conversation as an extension of the shorter one (as text and
as ids), or the reply is not found in its rendering, the request is prompted with its own rendering and
starts a trajectory of its own.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from asyncrl.serve.recording import Turn, content_text

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateMissing(ValueError):
    """The tokenizer has no chat template and none was given to the server."""


class ChatRenderer:
    """Renders chat messages with the policy's tokenizer (or `chat_template`, a Jinja string that replaces
    the tokenizer's) and encodes them without adding special tokens (the template writes its own)."""

    def __init__(self, codec: Any, stop_ids: frozenset[int], chat_template: str | None = None) -> None:
        self.codec = codec
        self.stop_ids = stop_ids
        self.template = chat_template
        self.available = bool(chat_template) or bool(getattr(codec.tok, "chat_template", None))

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: list | None) -> str:
        if not self.available:
            raise ChatTemplateMissing("the model's tokenizer has no chat template: start the server with "
                                      "chat_template=... or use /v1/completions")
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if tools:
            kwargs["tools"] = tools
        if self.template:
            kwargs["chat_template"] = self.template
        try:
            text = self.codec.tok.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # Jinja's raise_exception ("roles must alternate"), a missing field, ...
            raise ValueError(f"the chat template failed on these messages: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        if not isinstance(text, str):
            raise ValueError(f"the chat template returned a {type(text).__name__}, not text")
        return text

    def fresh(self, messages: list[dict[str, Any]], tools: list | None) -> list[int]:
        """The ids of a request that continues nothing: its whole rendering."""
        return self.codec.encode(self.render(messages, True, tools))

    def extension(self, parent: Turn, messages: list[dict[str, Any]], tools: list | None) -> list[int] | None:
        """The ids to append to `parent.context` for `messages` (which continue the parent's conversation),
        or None where the template does not render it as an extension."""
        assert parent.messages is not None
        # the reply as the model wrote it: the template's own rendering of parsed tool calls would differ
        prev = [*parent.messages, parent.raw_reply()]
        head = self.render(parent.messages, True, tools)
        full = self.render(prev, False, tools)
        after = self.render([*prev, *messages[len(prev):]], True, tools)
        if not (full.startswith(head) and after.startswith(full)):
            return None
        ids_full = self.codec.encode(full)
        if self.codec.encode(after)[: len(ids_full)] != ids_full:
            return None  # the boundary merges into one token: the suffix cannot be encoded on its own
        closer = self._closer(full[len(head):], parent)
        return None if closer is None else self.codec.encode(closer + after[len(full):])

    def _closer(self, rendered_reply: str, parent: Turn) -> str | None:
        """The template's text after the reply's content (e.g. '<|im_end|>\\n'), minus the stop token the
        model sampled (already in the context); None if the rendering does not hold the content as it is."""
        content = parent.text
        at = rendered_reply.find(content) if content else 0
        if at < 0:
            return None
        closer = rendered_reply[at + len(content):]
        tail = [i for i in parent.response_ids[-1:] if i in self.stop_ids]
        sampled = self.codec.decode_raw(tail) if tail else ""
        return closer[len(sampled):] if sampled and closer.startswith(sampled) else closer


def check_messages(messages: list[Any]) -> None:
    """Raise ValueError (one line) for messages the endpoint cannot render."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        try:
            content_text(m.get("content"))
        except ValueError as exc:
            raise ValueError(f"messages[{i}]: {exc}") from None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: text parts joined, null fields dropped (SDKs send
    `"tool_calls": null`, which templates test with `is defined`)."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = content_text(m.get("content"))
        out.append(msg)
    return out


def tools_key(tools: list | None) -> str:
    return json.dumps(tools or None, sort_keys=True)
