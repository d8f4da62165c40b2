"""An OpenAI-compatible HTTP endpoint over the Runtime's current policy, recording episodes for training.

Place in the dataflow — black-box agent code (the `openai` SDK, LangChain, ...) takes the place of the
user's loop of `asyncrl.Runtime`:

```
 agent ── POST {ep.base_url}/chat/completions ──► OpenAIServer ── Runtime.generate ──► Generator engines
                                                      └── records the exact turn in the episode (recording.py)
 user code: ep.reward = r; rt.submit([ep, ...]) ──► ReplayBuffer.submit_group ──► Scorer ──► Trainer
```

```python
server = await rt.serve_openai()                     # http://127.0.0.1:<free port>
async with server.episode() as ep:                   # base_url: http://127.0.0.1:PORT/episodes/<id>/v1
    client = AsyncOpenAI(base_url=ep.base_url, api_key="unused")
    ...                                              # the agent's own code
    ep.reward = 1.0
await rt.submit([ep, ...])                           # one group (episodes of the same task)
```

Routes: POST /episodes/<id>/v1/chat/completions, POST /episodes/<id>/v1/completions, GET .../v1/models
(and GET /v1/models); POST /episodes, POST /groups and GET /status for agents in another process
(control.py, `asyncrl serve`). The episode id in the base_url ties every request to its episode, so unmodified agent
code is recorded; a request without one (or for a closed episode) is answered 404. aiohttp serves it on the
Runtime's own event loop, bound to 127.0.0.1 unless another host is given. Errors are OpenAI-shaped JSON
(`{"error": {"message": ..., "type": ...}}`), one line each.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.serve.chat import ChatRenderer, check_messages, template_messages, tools_key
from asyncrl.serve.control import add_routes
from asyncrl.serve.recording import ServedEpisode, Turn

log = logging.getLogger(__name__)

LOGGED_ERRORS = 10  # the first few refused requests are logged (agent code often swallows them)


class ChatRequest(msgspec.Struct, kw_only=True):
    """The fields of a chat completion request the endpoint reads; others (user, metadata, ...) are ignored."""

    messages: list[dict[str, Any]]
    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str | list[Any]          # text, token ids, or a list of one of those
    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    stream: bool | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class RequestError(Exception):
    """Answered as an OpenAI-shaped error with this HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class OpenAIServer:
    """Serves the Runtime's policy over HTTP; `episode()` opens a recorded episode with its own base_url."""

    def __init__(self, rt: Any, host: str = "127.0.0.1", port: int = 0, *, chat_template: str | None = None,
                 model_name: str | None = None, max_n: int = 16, max_tokens: int | None = None,
                 tool_parser: str | None = "hermes") -> None:
        if max_n < 1:
            raise ValueError(f"serve_openai: max_n must be >= 1, got {max_n}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"serve_openai: max_tokens must be >= 1, got {max_tokens}")
        self.rt = rt
        self.host, self.port = host, port
        self.model_name = model_name or Path(str(rt.cfg.model.path)).name
        self.max_n = max_n
        self.max_tokens = max_tokens or rt.cfg.rollout.max_new_tokens
        self.max_prompt_len = rt.cfg.data.max_prompt_len
        self.chat = ChatRenderer(rt.codec, rt.stop_ids, chat_template)
        if tool_parser is not None:
            from asyncrl.envs.tool_parsers import PARSERS

            PARSERS.get(tool_parser)  # an unknown format: one line at start, not at the first request
        self.tool_parser = tool_parser
        self.counters = {"requests": 0, "refused": 0, "continued": 0, "started": 0, "tool_calls": 0}
        self._episodes: dict[str, ServedEpisode] = {}
        self._runner: Any = None

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> "OpenAIServer":
        try:
            from aiohttp import web
        except ImportError as exc:  # an optional dependency: the `serve` extra
            raise ImportError("the OpenAI-compatible endpoint needs aiohttp: pip install 'asyncrl[serve]'") from exc
        app = web.Application(middlewares=[_json_errors()], client_max_size=64 * 2**20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{episode}/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._no_episode)
        app.router.add_post("/v1/completions", self._no_episode)
        add_routes(app, self)  # POST /episodes, POST /groups, GET /status: for agents in another process
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the port picked when 0 was asked for
        if not self.chat.available:
            log.warning("the model's tokenizer has no chat template: /chat/completions answers 400 unless "
                        "serve_openai(chat_template=...) gives one; /completions works")
        log.info("OpenAI-compatible endpoint on %s", self.url)
        return self

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> "OpenAIServer":
        return self if self._runner is not None else await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def episode(self) -> ServedEpisode:
        """A new recorded episode; give its `base_url` to the agent's OpenAI client."""
        eid = secrets.token_hex(8)
        ep = ServedEpisode(self, eid, f"{self.url}/episodes/{eid}/v1")
        self._episodes[eid] = ep
        return ep

    def forget(self, episode_id: str) -> None:
        self._episodes.pop(episode_id, None)

    def open_episode(self, episode_id: str) -> ServedEpisode | None:
        ep = self._episodes.get(episode_id)
        return None if ep is None or ep.closed else ep

    def decode(self, ids: list[int]) -> str:
        return self.rt.codec.decode(ids)

    # -- handlers -----------------------------------------------------------------------------------
    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}]})

    async def _no_episode(self, request: Any) -> Any:
        return self._refuse(RequestError(404, "requests are recorded per episode: use the base_url of "
                                              "server.episode() (.../episodes/<id>/v1)", "not_found_error"))

    async def _chat(self, request: Any) -> Any:
        return await self._answer(request, ChatRequest, self._chat_turns, _chat_body)

    async def _completions(self, request: Any) -> Any:
        return await self._answer(request, CompletionRequest, self._completion_turns, _completion_body)

    async def _answer(self, request: Any, kind: type, sample: Any, body: Any) -> Any:
        from aiohttp import web

        self.counters["requests"] += 1
        try:
            ep = self.open_episode(request.match_info["episode"])
            if ep is None:
                raise RequestError(404, f"episode {request.match_info['episode']!r} is not open (closed, or never "
                                        f"opened by server.episode())", "not_found_error")
            try:
                req = msgspec.json.decode(await request.read(), type=kind)
            except msgspec.MsgspecError as exc:
                raise RequestError(400, f"bad request body: {exc}") from None
            if req.stream:
                raise RequestError(400, "stream=true is not supported by this endpoint; request without streaming")
            if not 1 <= req.n <= self.max_n:
                raise RequestError(400, f"n must be between 1 and {self.max_n} (serve_openai max_n), got {req.n}")
            ep.begin()
            try:
                prompt, turns = await sample(ep, req)
            finally:
                ep.end()
        except RequestError as exc:
            return self._refuse(exc)
        except ValueError as exc:  # a bad message, sampling parameter or template failure (ChatTemplateMissing)
            return self._refuse(RequestError(400, str(exc)))
        return web.json_response(body(self, req, prompt, turns))

    def _refuse(self, exc: RequestError) -> Any:
        return self.refuse(exc.status, str(exc), exc.kind)

    def refuse(self, status: int, message: str, kind: str = "invalid_request_error") -> Any:
        """An OpenAI-shaped JSON error response (counted; the first few logged)."""
        from aiohttp import web

        self.counters["refused"] += 1
        if self.counters["refused"] <= LOGGED_ERRORS:
            log.warning("OpenAI endpoint refused a request (%d): %s", status, message)
        return web.json_response(_error(message, kind), status=status)

    # -- sampling -----------------------------------------------------------------------------------
    async def _chat_turns(self, ep: ServedEpisode, req: ChatRequest) -> tuple[list[int], list[Turn]]:
        if req.top_logprobs:
            raise RequestError(400, "top_logprobs is not supported: logprobs=true returns each sampled token's "
                                    "logprob")
        check_messages(req.messages)
        messages = template_messages(req.messages)
        key = tools_key(req.tools)
        parent = ep.parent_for_chat(messages, key)
        new = self.chat.extension(parent, messages, req.tools) if parent is not None else None
        if parent is None or new is None:  # continues nothing the template can extend: its own rendering
            parent, new, prompt = None, [], self.chat.fresh(messages, req.tools)
        else:
            prompt = parent.context + new
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        turns = await self._sample(ep, req, prompt, parent, new, limit, messages=messages, tools_key=key)
        if req.tools and self.tool_parser:
            self.counters["tool_calls"] += sum(parse_tool_calls(t, req.tools, self.tool_parser) for t in turns)
        return prompt, turns


    async def _completion_turns(self, ep: ServedEpisode, req: CompletionRequest) -> tuple[list[int], list[Turn]]:
        if req.echo or req.suffix is not None or (req.best_of or 1) > 1 or req.logprobs:
            raise RequestError(400, "echo, suffix, best_of > 1 and logprobs > 0 (top alternatives) are not "
                                    "supported; logprobs=0 returns each sampled token's logprob")
        p: Any = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise RequestError(400, f"one prompt per request, got {len(p)}")
            p = p[0]
        text: str | None = None
        if isinstance(p, str):
            text = p
            parent = ep.parent_for_text(p)
            new = self.rt.codec.encode(p[len(parent.prompt_text or "") + len(parent.sampled_text):]) if parent else []
            prompt = parent.context + new if parent else self.rt.codec.encode_prompt(p)
        else:
            ids = list(p)
            vocab = len(self.rt.codec.tok)
            if not ids or any(type(i) is not int or not 0 <= i < vocab for i in ids):
                raise RequestError(400, f"prompt token ids must be a non-empty list of ids in [0, {vocab})")
            parent = ep.parent_for_ids(ids)
            new = ids[len(parent.context):] if parent else []
            prompt = ids
        turns = await self._sample(ep, req, prompt, parent, new, req.max_tokens, prompt_text=text)
        return prompt, turns

    async def _sample(self, ep: ServedEpisode, req: Any, prompt: list[int], parent: Turn | None, new: list[int],
                      max_tokens: int | None, **match: Any) -> list[Turn]:
        """Sample req.n choices of `prompt` concurrently (batched by the engine) and record each in `ep`."""
        if not prompt:
            raise RequestError(400, "the prompt is empty (it encodes to no tokens)")
        if len(prompt) > self.max_prompt_len:
            raise RequestError(400, f"the prompt is {len(prompt)} tokens, more than data.max_prompt_len = "
                                    f"{self.max_prompt_len} (the engine's limit)")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        sampling: dict[str, Any] = {"max_new_tokens": min(max_tokens or self.max_tokens, self.max_tokens),
                                    "stop": [*self.rt.cfg.rollout.stop, *stops], "seed": req.seed}
        if req.temperature is not None:
            sampling["temperature"] = req.temperature
        if req.top_p is not None:
            sampling["top_p"] = req.top_p
        params = self.rt.sampling(**sampling)
        params.validate()  # ValueError → 400, one line
        if req.seed is not None:  # n samples of one request must differ: one stream per choice
            seeds = [req.seed + j for j in range(req.n)]
        else:
            seeds = [None] * req.n
        version = self.rt.version
        outs = await asyncio.gather(*[self.rt.generate(prompt, **{**sampling, "seed": s}) for s in seeds])
        chained = parent is not None and parent.temperature == params.temperature and params.temperature > 0
        turns = []
        for c in outs:
            text = self.rt.codec.decode(list(c.response_ids))
            turn = Turn(prompt_ids=list(prompt), response_ids=list(c.response_ids), logprobs=list(c.logprobs),
                        versions=list(c.versions), finish_reason=c.finish_reason, temperature=params.temperature,
                        text=_cut_at_stop(text, params.stop) if c.finish_reason == "stop" else text,
                        parent=parent if chained else None, new_ids=list(new) if chained else [],
                        new_version=version, sampled_text=text, **match)
            ep.record(turn)
            turns.append(turn)
        self.counters["continued" if chained else "started"] += 1
        return turns


def parse_tool_calls(turn: Turn, tools: list[dict[str, Any]], parser: str) -> int:
    """Set the turn's OpenAI `tool_calls` (and the content around them) from its text, read in the model's
    format (`parser`, e.g. hermes' <tool_call>{json}</tool_call>); returns how many. A turn with a call that
    cannot be read keeps its whole text as the content (the client sees what the model wrote); the model is
    trained on its exact tokens either way."""
    from asyncrl.envs.tool_parsers import make_parser

    parsed = make_parser(parser, tools).parse(turn.text)
    if not parsed.calls or any(c.error for c in parsed.calls):
        return 0
    turn.content = parsed.content
    turn.tool_calls = [{"id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
    return len(turn.tool_calls)


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """OpenAI semantics: the returned text ends before the first stop string (the tokens keep it)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _usage(prompt: list[int], turns: list[Turn]) -> dict[str, int]:
    done = sum(len(t.response_ids) for t in turns)
    return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}


def _finish(t: Turn) -> str:
    if t.tool_calls:
        return "tool_calls"
    return "length" if t.finish_reason == "length" else "stop"


def _chat_body(server: OpenAIServer, req: ChatRequest, prompt: list[int], turns: list[Turn]) -> dict[str, Any]:
    raw = server.rt.codec.decode_raw

    def logprobs(t: Turn) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        toks = [raw([i]) for i in t.response_ids]
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                            for s, lp in zip(toks, t.logprobs)]}

    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": server.model_name, "usage": _usage(prompt, turns),
            "choices": [{"index": j, "message": t.reply(), "finish_reason": _finish(t), "logprobs": logprobs(t)}
                        for j, t in enumerate(turns)]}


def _completion_body(server: OpenAIServer, req: CompletionRequest, prompt: list[int],
                     turns: list[Turn]) -> dict[str, Any]:
    raw = server.rt.codec.decode_raw

    def logprobs(t: Turn) -> dict[str, Any] | None:
        if req.logprobs is None:
            return None
        toks = [raw([i]) for i in t.response_ids]
        offsets = [0, *itertools.accumulate(len(s) for s in toks)][: len(toks)]
        return {"tokens": toks, "token_logprobs": list(t.logprobs), "top_logprobs": None, "text_offset": offsets}

    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name, "usage": _usage(prompt, turns),
            "choices": [{"index": j, "text": t.text, "finish_reason": _finish(t), "logprobs": logprobs(t)}
                        for j, t in enumerate(turns)]}


def _json_errors() -> Any:
    from aiohttp import web

    @web.middleware
    async def middleware(request: Any, handler: Any) -> Any:
        """Unknown routes, wrong methods and failures answer OpenAI-shaped JSON too (the SDK shows its message)."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return web.json_response(_error(f"{request.method} {request.path}: {exc.reason}",
                                            "not_found_error" if exc.status == 404 else "invalid_request_error"),
                                     status=exc.status)
        except Exception as exc:  # the engine failed, training ended with an error, ...: the agent sees why
            log.exception("OpenAI endpoint: %s %s failed", request.method, request.path)
            return web.json_response(_error(f"{type(exc).__name__}: {exc}".splitlines()[0], "server_error"),
                                     status=500)

    return middleware
