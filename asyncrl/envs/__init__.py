"""Agentic environments: the Env protocol, token-in/token-out transcripts, the episode runner, tools and
built-in environments (docs/envs.md)."""

from asyncrl.envs.base import ENVS, Env, StepResult, check_env, resolve_env
from asyncrl.envs.runner import Episode, EpisodeLimits, EpisodeRunner
from asyncrl.envs.transcript import ChatTemplateError, HFCodec, Transcript, resolve_format

__all__ = ["ENVS", "ChatTemplateError", "Env", "Episode", "EpisodeLimits", "EpisodeRunner", "HFCodec", "StepResult",
           "Transcript", "check_env", "resolve_env", "resolve_format"]
