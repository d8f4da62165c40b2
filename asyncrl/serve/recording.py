"""Recorded episodes of the OpenAI-compatible endpoint: requests → exact token turns → trajectories.

Place in the dataflow: `asyncrl/serve/openai_server.py` answers each request of an episode (its base_url
carries the episode id) with `Runtime.generate`, and records every sampled choice here as a `Turn` — the
exact prompt ids the engine saw, the sampled ids, behaviour logprobs and per-token policy versions. When
the user's code submits the episode (`rt.submit([ep, ...])`), `ServedEpisode.to_trajectories` turns its
turns into `Trajectory`s for the rollout queue → Scorer → Trainer, as `AgentEpisode` does for its own loop.

How requests are chained (never re-tokenising a sampled token):
* A request *extends* an earlier turn of the same episode when it continues that turn's conversation:
  chat — its messages start with that request's messages plus the assistant reply returned (role, content
  and tool calls compared), with the same `tools`, and the chat template renders the longer conversation
  as an extension of the shorter one (text and ids); completions — its prompt text starts with that
  request's prompt text plus the sampled text (or its prompt ids start with that turn's prompt +
  response ids). The longest such turn is the parent.
* An extending request's prompt is the parent's exact context (prompt + sampled ids) plus the encoding of
  what is new: the template's end-of-turn text after the reply (minus a stop token the model sampled) and
  the rendering of the new messages, or the new prompt text. So the engine is prompted on exactly the
  tokens the trainer sees.
* A turn extending a parent sampled at the same temperature continues the parent's trajectory: the new
  tokens go in with loss_mask False, the sampled ones with loss_mask True. Any other request — one that
  rewrote the history, or the first — starts a trajectory of its own (prompt = its exact context).
* Every turn that no later turn continues ends a trajectory: an episode yields one trajectory per such
  turn, each trained as its own sample with the episode's reward (a turn continued by several later
  turns — choices of n > 1 each taken further — is in each of their trajectories). Turns sampled greedily
  (temperature 0) are answered but never trained.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from asyncrl.messages import Trajectory

log = logging.getLogger(__name__)


@dataclass
class Turn:
    """One sampled choice of one request, as the engine produced it."""

    prompt_ids: list[int]               # the exact context the engine was prompted with
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    temperature: float
    text: str                           # what the response returned (after a stop string is cut off)
    parent: "Turn | None" = None        # the turn whose trajectory this one continues (same temperature)
    new_ids: list[int] = field(default_factory=list)  # context appended after the parent's (loss_mask False)
    new_version: int = 0                # the policy version when those tokens were appended
    # what a later request is matched against
    messages: list[dict[str, Any]] | None = None  # chat: the request's messages (the reply not included)
    tools_key: str = ""                 # chat: the request's tools, canonical JSON
    prompt_text: str | None = None      # completions: the request's prompt text (None: ids were sent)
    sampled_text: str = ""              # completions: decode(response_ids), the stop string included
    continued: bool = False             # a later turn continues this one's trajectory
    # chat with tools=: the calls parsed out of `text` (OpenAI `tool_calls` objects) and the text around them;
    # the reply returns these, while the context keeps the model's exact text (`raw_reply`)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    content: str | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def reply(self) -> dict[str, Any]:
        """The assistant message returned to the client (and matched when a later request echoes it)."""
        if self.tool_calls:
            return {"role": "assistant", "content": self.content or None, "tool_calls": self.tool_calls}
        return {"role": "assistant", "content": self.text}

    def raw_reply(self) -> dict[str, Any]:
        """The reply as the model wrote it (tool calls in its own format): what the context holds, so what a
        continuation is rendered after."""
        return {"role": "assistant", "content": self.text}


def message_key(msg: dict[str, Any]) -> tuple[str, str, str, str]:
    """What makes two chat messages the same for chaining: role, text content, tool calls, tool call id
    (fields an SDK adds with null values, such as `refusal`, do not count)."""
    return (str(msg.get("role")), content_text(msg.get("content")), _calls_key(msg.get("tool_calls")),
            str(msg.get("tool_call_id") or ""))


def _calls_key(calls: Any) -> str:
    """Tool calls compared by id, name and parsed arguments: an SDK echoes them back with fields of its own
    (null ones, an `index`) and may re-serialise the arguments."""
    if not calls:
        return "null"
    out = []
    for c in calls if isinstance(calls, list) else [calls]:
        fn = c.get("function") or {} if isinstance(c, dict) else {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append([c.get("id") if isinstance(c, dict) else None, fn.get("name"), args])
    return json.dumps(out, sort_keys=True)


def content_text(content: Any) -> str:
    """A message's content as text: a string, None (""), or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise ValueError(f"message content part of type {kind!r} is not supported: text parts only")
            parts.append(p["text"])
        return "".join(parts)
    raise ValueError(f"message content must be a string, null or a list of text parts, got {type(content).__name__}")


class ServedEpisode:
    """One episode of the OpenAI-compatible endpoint: agent code calls `base_url`; the user's code sets
    `reward` and submits the episode (`rt.submit([ep, ...])`, episodes of one task make one group)."""

    def __init__(self, server: Any, episode_id: str, base_url: str) -> None:
        self._server = server
        self.id = episode_id
        self.base_url = base_url
        self.reward: float | None = None
        self.turns: list[Turn] = []
        self.closed = False
        self._answering = 0               # requests being answered (close waits for them)
        self._idle = asyncio.Event()
        self._idle.set()

    async def __aenter__(self) -> "ServedEpisode":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """No further requests (404); requests already being answered finish and are recorded."""
        self.closed = True
        self._server.forget(self.id)
        await self._idle.wait()

    def begin(self) -> None:
        self._answering += 1
        self._idle.clear()

    def end(self) -> None:
        self._answering -= 1
        if not self._answering:
            self._idle.set()

    def parent_for_chat(self, messages: list[dict[str, Any]], tools_key: str) -> Turn | None:
        """The turn whose conversation (request messages + reply) `messages` continues, the longest first."""
        keys = [message_key(m) for m in messages]
        best: Turn | None = None
        for t in self.turns:
            if t.messages is None or t.tools_key != tools_key:
                continue
            prev = [message_key(m) for m in t.messages] + [message_key(t.reply())]
            if len(keys) > len(prev) and keys[: len(prev)] == prev:
                if best is None or len(t.context) > len(best.context):
                    best = t
        return best

    def parent_for_text(self, prompt: str) -> Turn | None:
        best = None
        for t in self.turns:
            if t.prompt_text is not None and prompt.startswith(t.prompt_text + t.sampled_text):
                if best is None or len(t.context) > len(best.context):
                    best = t
        return best

    def parent_for_ids(self, ids: list[int]) -> Turn | None:
        best = None
        for t in self.turns:
            ctx = t.context
            if t.messages is None and ids[: len(ctx)] == ctx and (best is None or len(ctx) > len(best.context)):
                best = t
        return best

    def record(self, turn: Turn) -> None:
        if turn.parent is not None:
            turn.parent.continued = True
        self.turns.append(turn)

    # -- training data ------------------------------------------------------------------------------
    def to_trajectories(self) -> list[Trajectory]:
        """One trajectory per turn that no later turn continues (greedy ones left out), each with the
        episode's reward. ValueError (one line) without a reward or without a sampled turn."""
        if self.reward is None:
            raise ValueError(f"episode {self.id}: set ep.reward before submitting it")
        ends = [t for t in self.turns if not t.continued and t.temperature > 0]
        if not ends:
            greedy = sum(t.temperature <= 0 for t in self.turns)
            raise ValueError(f"episode {self.id}: no sampled completion to train on ({len(self.turns)} requests"
                             f"{f', {greedy} of them greedy (temperature 0)' if greedy else ''})")
        return [chain_trajectory(t, float(self.reward), self._server.decode) for t in ends]


def chain_trajectory(end: Turn, reward: float, decode: Any = None) -> Trajectory:
    """The trajectory that ends with `end`: its first turn's prompt, then each turn's new context tokens
    (loss_mask False) and sampled tokens (loss_mask True)."""
    chain = [end]
    while chain[-1].parent is not None:
        chain.append(chain[-1].parent)  # type: ignore[arg-type]
    chain.reverse()
    resp: list[int] = []
    mask: list[bool] = []
    lps: list[float] = []
    vers: list[int] = []
    for i, t in enumerate(chain):
        if i:
            resp += t.new_ids
            mask += [False] * len(t.new_ids)
            lps += [0.0] * len(t.new_ids)  # placeholder: the learner masks these out
            vers += [t.new_version] * len(t.new_ids)
        resp += t.response_ids
        mask += [True] * len(t.response_ids)
        lps += t.logprobs
        vers += t.versions
    prompt = chain[0].prompt_ids
    if prompt + resp != end.context:  # the chaining invariant: the engine saw exactly these tokens
        raise AssertionError("a recorded chain does not reproduce its last turn's context")
    sampled = [v for v, m in zip(vers, mask) if m] or [end.new_version]
    return Trajectory(seq_id=0, group_id=0, group_size=1, prompt_ids=list(prompt), response_ids=resp, loss_mask=mask,
                      behavior_logprobs=lps, versions=vers, min_version=min(sampled), max_version=max(sampled),
                      finish_reason="length" if end.finish_reason == "length" else "stop",
                      temperature=end.temperature, env_reward=reward, turns=len(chain),
                      prompt_text=decode(list(prompt)) if decode is not None else "")
