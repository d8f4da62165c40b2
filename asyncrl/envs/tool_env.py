"""Tool use for chat models: `ToolUse` (a tool set and its call format) and the built-in `tools` environment.

Place in the dataflow, per episode (EpisodeRunner, asyncrl/envs/runner.py):

    reset(row) ──► prompt rendered with the template's tools=ToolUse.schemas (or ToolUse.prompt as the
                   system message where the template ignores tools=)
    loop: model turn ──► ToolUse.respond(text): parser.parse ──► ToolSet.call per call
          ──► tool messages (role "tool", one per call, results or errors) ──► appended, loss_mask False
    a turn without calls is the final answer: rewarded by a reward rule against the row's answer.

`ToolUse` is the same piece for `asyncrl.Runtime` episodes (`rt.episode(prompt, tools=[...])`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from asyncrl.envs.base import StepResult
from asyncrl.envs.tool_parsers import ParsedTurn, ToolCall, ToolParser, make_parser
from asyncrl.envs.tool_schema import Tool, ToolResult, ToolSet
from asyncrl.envs.transcript import Message


@dataclass(slots=True)
class ToolTurn:
    """A model turn read for tool calls: its content, the calls, their results and the tool messages."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)

    @property
    def messages(self) -> list[Message]:
        """The tool messages to append, one per call in order ([] for a turn without calls)."""
        return [r.message for r in self.results]


class ToolUse:
    """Tools (registered names, 'pkg.module:function' paths or callables) and the format the model calls
    them in (`hermes`, `json`, `name_args`: asyncrl/envs/tool_parsers.py)."""

    def __init__(self, tools: Sequence[str | Callable[..., Any] | Tool] | ToolSet, parser: str | ToolParser = "hermes",
                 *, timeout_s: float = 5.0, max_output: int = 2000) -> None:
        self.tools = tools if isinstance(tools, ToolSet) else ToolSet(tools, timeout_s=timeout_s,
                                                                      max_output=max_output)
        if not self.tools.names:
            raise ValueError("tool use needs at least one tool")
        self.parser = make_parser(parser, self.tools.schemas) if isinstance(parser, str) else parser

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return self.tools.schemas

    @property
    def prompt(self) -> str:
        """The tools described in the call format's own words (a system message, for templates without tools=)."""
        return self.parser.system_prompt(self.schemas)

    async def respond(self, text: str) -> ToolTurn:
        """Parse a model turn and run its calls."""
        return await self.run(self.parser.parse(text))

    async def run(self, parsed: ParsedTurn) -> ToolTurn:
        """Run the calls of a parsed turn one after another, in the order the model wrote them."""
        turn = ToolTurn(parsed.content, parsed.calls)
        for call in parsed.calls:
            turn.results.append(await self.tools.call(call))
        return turn


class ToolEnv:
    """Answer the row's question, calling tools as the model likes: every turn with calls gets the tool
    messages back; the first turn without calls (or the turn after `max_calls` calls) is the final answer,
    scored by the reward rule `reward` (exact_match, contains, gsm8k, boxed, ... : asyncrl/rewards/rules.py)
    against the row's `answer_key`. Rows: {"prompt": text or chat messages, "answer": ...}. The episode's
    reward is that score, plus `tool_bonus` if a call succeeded."""

    def __init__(self, *, tools: Sequence[str] = ("calculator",), parser: str = "hermes", reward: str = "exact_match",
                 answer_key: str = "answer", max_calls: int = 4, tool_bonus: float = 0.0, system: str = "",
                 timeout_s: float = 5.0, max_output: int = 2000) -> None:
        from asyncrl.rewards.rules import RULES

        if isinstance(tools, str):
            raise ValueError(f"tools must be a list of tool names, got the string {tools!r} — write [{tools!r}]")
        if reward not in RULES:
            raise ValueError(f"unknown reward rule {reward!r} — one of {', '.join(RULES.names())}")
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        self.use = ToolUse(list(tools), parser, timeout_s=timeout_s, max_output=max_output)
        self.score = RULES.get(reward)(answer_key)
        self.max_calls = max_calls
        self.tool_bonus = tool_bonus
        self.system = system
        self.tool_schemas = self.use.schemas   # read by the runner: the template's tools=
        self.tool_prompt = self.use.prompt     # and their description where the template ignores tools=

    @property
    def tool_calls(self) -> int:
        return self.use.tools.calls

    @property
    def tool_errors(self) -> int:
        return self.use.tools.errors

    async def reset(self, row: dict[str, Any]) -> str | list[Message]:
        self.row = row
        self.prompt = row["prompt"]
        if not self.system:
            return self.prompt
        user = [{"role": "user", "content": self.prompt}] if isinstance(self.prompt, str) else list(self.prompt)
        return [{"role": "system", "content": self.system}, *user]

    async def step(self, action: str) -> StepResult:
        parsed = self.use.parser.parse(action)
        if parsed.calls and self.use.tools.calls < self.max_calls:
            turn = await self.use.run(parsed)
            return StepResult(observation=turn.messages)
        fields = {k: v for k, v in self.row.items() if k != "prompt"}
        prompt = self.prompt if isinstance(self.prompt, str) else str(self.prompt[-1].get("content", ""))
        reward = float(self.score(prompt, parsed.content, **fields))
        if self.use.tools.calls > self.use.tools.errors:
            reward += self.tool_bonus
        return StepResult(reward=reward, done=True)
