"""EpisodeRunner: plays multi-turn episodes against an environment on the generator's event loop.

Place in the dataflow: Generator (admits a group) ──► **EpisodeRunner.run_group** (group_size episodes of
one row, concurrently) ──► Trajectories (env_reward set) ──► rollout queue ──► Scorer (uses env_reward).

Each model turn is one `engine.generate([transcript.context], SamplingParams(n=1, ...))` on the exact
running token context, so hundreds of episodes awaiting the model are decoded together by the engine's
continuous batching. Limits per episode: `max_turns` model turns and `max_episode_tokens` response tokens
(model + environment); hitting one ends the episode with finish_reason "length" (truncated).

Containment (nothing is lost, every fault is counted by kind in `counters` — the episodes themselves are
counted once, by the buffer, as they reach the rollout queue: `env/episodes`, `env/errors`):
* `reset` raising / timing out / returning a non-string: finish_reason "error" — nothing to train on;
  the Scorer fails the group (slots returned to the gate, counted as failed).
* `step` raising / timing out / returning garbage (or an observation the tokenizer cannot encode): the
  episode ends with `env_error` recorded and counted (`step_errors`, `step_timeouts`, `garbage`); with
  `on_step_error = "keep"` (default) it is trained on the tokens it has with the reward summed so far,
  with "fail" it fails its group like a reset error.
* the engine raising: finish_reason "error" (the group fails, as on the single-turn path).
Env methods must not block the loop (they are `async`); a synchronous hang cannot be timed out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from asyncrl.envs.base import EnvGarbage, as_step_result
from asyncrl.envs.transcript import ChatTemplateError, Transcript
from asyncrl.messages import SamplingParams, Trajectory
from engines.base import RolloutEngine

log = logging.getLogger(__name__)

COUNTERS = ("reset_errors", "step_errors", "step_timeouts", "garbage", "template_errors",
            "engine_errors", "turn_limit", "token_limit")


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    max_turns: int = 8
    max_episode_tokens: int = 64
    step_timeout_s: float = 10.0
    on_step_error: str = "keep"   # "keep" | "fail"


@dataclass(slots=True)
class Episode:
    transcript: Transcript
    reward: float = 0.0
    finish_reason: str = "stop"   # "stop" (env said done) | "length" (a limit) | "error"
    error: str = ""               # why it failed (finish_reason "error")
    env_error: str = ""           # what the env did wrong (any finish_reason)
    prompt_text: str = ""
    prompt_truncated: bool = False
    tool_calls: int = 0           # the env's `tool_calls` / `tool_errors` at the end of the episode
    tool_errors: int = 0


class EpisodeRunner:
    def __init__(self, *, engine: RolloutEngine, env_cls: type, env_kwargs: dict[str, Any], codec: Any, fmt: str,
                 sampling: SamplingParams, limits: EpisodeLimits, stop_ids: frozenset[int] = frozenset(),
                 turn_stops: list[str] | None = None) -> None:
        self.engine = engine
        self.env_cls = env_cls
        self.env_kwargs = dict(env_kwargs)
        self.codec = codec
        self.fmt = fmt
        self.limits = limits
        self.stop_ids = stop_ids
        self.sampling = sampling
        self.stop = [*sampling.stop, *(s for s in (turn_stops or []) if s not in sampling.stop)]
        self.counters = {k: 0 for k in COUNTERS}

    async def run_group(self, group_id: int, row: dict[str, Any], n: int, generator_id: int = 0) -> list[Trajectory]:
        """`n` episodes of `row` played concurrently; one Trajectory each, in order (never raises for env faults)."""
        row_json = json.dumps(row).encode()
        episodes = await asyncio.gather(*[self.run_episode(row) for _ in range(n)])
        return [self.trajectory(ep, group_id * n + j, group_id, n, row_json, generator_id)
                for j, ep in enumerate(episodes)]

    async def run_episode(self, row: dict[str, Any]) -> Episode:
        ep = Episode(Transcript(self.codec, self.fmt, stop_ids=self.stop_ids))
        try:
            env = self.env_cls(**self.env_kwargs)
            obs = await asyncio.wait_for(env.reset(row), self.limits.step_timeout_s)
            if not isinstance(obs, (str, list)):
                raise TypeError(f"reset returned {type(obs).__name__}, not the initial observation text or messages")
            tools, tools_prompt = _env_tools(env)
            if not ep.transcript.start(obs, tools=tools, tools_prompt=tools_prompt):
                raise ValueError("reset returned an observation that encodes to no tokens")
            ep.prompt_text = obs if isinstance(obs, str) else self.codec.decode(ep.transcript.prompt_ids)
        except Exception as exc:  # noqa: BLE001 — user env: contained, counted, the group fails
            self.counters["reset_errors"] += 1
            ep.finish_reason, ep.error = "error", f"env reset: {_why(exc)}"
            ep.env_error = ep.error
            self._warn(ep.error)
            return ep
        try:
            await self._play(env, ep)
        finally:
            ep.tool_calls, ep.tool_errors = _count(env, "tool_calls"), _count(env, "tool_errors")
            await _close(env)
        return ep

    async def _play(self, env: Any, ep: Episode) -> None:
        t, lim = ep.transcript, self.limits
        while True:
            if t.turns >= lim.max_turns:
                ep.finish_reason = "length"
                self.counters["turn_limit"] += 1
                return
            room = lim.max_episode_tokens - len(t.response_ids)
            if room <= 0:
                ep.finish_reason = "length"
                self.counters["token_limit"] += 1
                return
            params = SamplingParams(n=1, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                    top_k=self.sampling.top_k, max_new_tokens=min(self.sampling.max_new_tokens, room),
                                    stop_token_ids=list(self.sampling.stop_token_ids), stop=self.stop)
            try:
                c = (await self.engine.generate([t.context], params))[0][0]
            except Exception as exc:  # noqa: BLE001 — engine failure: the group fails, as on the single-turn path
                self.counters["engine_errors"] += 1
                ep.finish_reason, ep.error = "error", f"engine: {_why(exc)}"
                return
            ep.prompt_truncated |= c.prompt_truncated
            if c.prompt_truncated:
                t.lose_routing()
            routing = (c.routed_experts, c.routing_shape) if c.routing_shape else None
            text = t.add_model_turn(list(c.response_ids), list(c.logprobs), list(c.versions), routing)
            try:
                result = as_step_result(await asyncio.wait_for(env.step(text), lim.step_timeout_s))
            except Exception as exc:  # noqa: BLE001 — user env: contained and counted
                kind = "step_timeouts" if isinstance(exc, asyncio.TimeoutError) else (
                    "garbage" if isinstance(exc, EnvGarbage) else "step_errors")
                self.counters[kind] += 1
                self._step_failed(ep, f"env step {t.turns}: {_why(exc)}")
                return
            ep.reward += float(result.reward)
            if result.done:
                ep.finish_reason = "stop"
                return
            if not result.observation:
                continue
            try:
                ids = t.observation_ids(result.observation)
            except ChatTemplateError as exc:
                self.counters["template_errors"] += 1
                self._step_failed(ep, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 — text the tokenizer refuses is the env's garbage
                self.counters["garbage"] += 1
                self._step_failed(ep, f"env step {t.turns}: observation could not be encoded: {_why(exc)}")
                return
            if len(t.response_ids) + len(ids) >= lim.max_episode_tokens:
                ep.finish_reason = "length"  # no room left for the model to answer this observation
                self.counters["token_limit"] += 1
                return
            t.add_observation(result.observation, ids, self.engine.version)

    def _step_failed(self, ep: Episode, why: str) -> None:
        ep.env_error = why
        self._warn(why)
        if self.limits.on_step_error == "fail":
            ep.finish_reason, ep.error = "error", why

    def _warn(self, why: str) -> None:
        failures = sum(self.counters[k] for k in ("reset_errors", "step_errors", "step_timeouts", "garbage",
                                                   "template_errors"))
        if failures <= 5:
            log.warning("episode: %s", why)

    def trajectory(self, ep: Episode, seq_id: int, group_id: int, n: int, row_json: bytes,
                   generator_id: int) -> Trajectory:
        t = ep.transcript
        model_versions = [v for v, m in zip(t.versions, t.loss_mask) if m] or [self.engine.version]
        return Trajectory(
            seq_id=seq_id, group_id=group_id, group_size=n,
            prompt_ids=t.prompt_ids, response_ids=t.response_ids, loss_mask=t.loss_mask,
            behavior_logprobs=t.logprobs, versions=t.versions,
            min_version=min(model_versions), max_version=max(model_versions),
            finish_reason=ep.finish_reason, truncated=ep.finish_reason == "length",
            prompt_truncated=ep.prompt_truncated, temperature=self.sampling.temperature,
            prompt_text=ep.prompt_text, row_json=row_json, generator_id=generator_id, error=ep.error,
            env_reward=ep.reward if math.isfinite(ep.reward) else 0.0, turns=t.turns, env_error=ep.env_error,
            tool_calls=ep.tool_calls, tool_errors=ep.tool_errors,
            **t.routing(),
        )


def _env_tools(env: Any) -> tuple[list[dict] | None, str]:
    """The env's optional `tool_schemas` (for the template's `tools=`) and `tool_prompt`; TypeError if malformed."""
    tools = getattr(env, "tool_schemas", None)
    prompt = getattr(env, "tool_prompt", "")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise TypeError(f"tool_schemas is {type(tools).__name__}; expected a list of JSON schemas (dicts)")
    if not isinstance(prompt, str):
        raise TypeError(f"tool_prompt is {type(prompt).__name__}, not str")
    return tools or None, prompt


def _count(env: Any, name: str) -> int:
    """An optional int counter of the env (tool_calls, tool_errors); 0 when absent or not an int."""
    value = getattr(env, name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


async def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        result = close()
        if asyncio.iscoroutine(result):
            await asyncio.wait_for(result, 5)
    except Exception as exc:  # noqa: BLE001 — a failing close must not lose the episode
        log.debug("env close failed: %s", exc)
