"""Agentic environments: the Env protocol, token-in/token-out transcripts, the episode runner, tools (JSON
schemas, call formats, the `tools` env) and built-in environments (docs/envs.md)."""

from asyncrl.envs.base import ENVS, Env, StepResult, check_env, resolve_env
from asyncrl.envs.runner import Episode, EpisodeLimits, EpisodeRunner
from asyncrl.envs.tool_env import ToolEnv, ToolTurn, ToolUse
from asyncrl.envs.tool_parsers import PARSERS, ParsedTurn, ToolCall, make_parser
from asyncrl.envs.tool_schema import Tool, ToolResult, ToolSet, tool_schema
from asyncrl.envs.transcript import ChatTemplateError, HFCodec, Transcript, resolve_format

__all__ = ["ENVS", "PARSERS", "ChatTemplateError", "Env", "Episode", "EpisodeLimits", "EpisodeRunner", "HFCodec",
           "ParsedTurn", "StepResult", "Tool", "ToolCall", "ToolEnv", "ToolResult", "ToolSet", "ToolTurn", "ToolUse",
           "Transcript", "check_env", "make_parser", "resolve_env", "resolve_format", "tool_schema"]
