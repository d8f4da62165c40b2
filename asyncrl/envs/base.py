"""The environment contract, the built-in registry, and how `[env] env = ...` resolves and is validated.

Place in the dataflow: the Generator's `EpisodeRunner` (`asyncrl/envs/runner.py`) builds one env object
per episode with `resolve_env(cfg.env.env)(**cfg.env.kwargs)`, then alternates model turns with `step`:

    obs = await env.reset(row)                # initial observation text (the prompt)
    loop:  model turn (exact sampled ids) ──► await env.step(turn_text) ──► StepResult
           StepResult.observation is encoded once and appended (loss_mask False); done ends the episode

An environment is any class with `async def reset(self, row)` and `async def step(self, action)`;
`asyncrl validate` checks that through `check_env` (module, class, coroutine methods, signatures,
constructor keywords, one instance built with `env.kwargs`), one line per problem. Optional class
attribute `stop: list[str]`: strings that end a model turn (added to `rollout.stop` for its episodes),
e.g. ["="] for a calculator call.

Tools (asyncrl/envs/tool_env.py): after `reset`, the runner reads the optional instance attributes
`tool_schemas` (the tools' JSON schemas, passed to the chat template's `tools=`) and `tool_prompt` (their
description for templates that ignore `tools=`); after the episode, `tool_calls` and `tool_errors` (ints,
counted into `env/tool_calls` and `env/tool_errors`).
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import inspect
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from asyncrl.config.schema import Config
from asyncrl.registry import Registry, import_path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    """What `Env.step` returns. A plain tuple (observation, reward, done) is accepted too."""

    observation: str | list[dict[str, str]] = ""  # appended after the model's turn (never trained): text (a user
                            # message) or chat messages (e.g. role "tool" results); "" or [] appends nothing
    reward: float = 0.0     # the episode's reward is the sum over its steps
    done: bool = False      # True ends the episode after this step


@runtime_checkable
class Env(Protocol):
    """One episode's environment; a fresh instance per episode (state lives on the instance)."""

    async def reset(self, row: dict[str, Any]) -> str:
        """Start an episode from a dataset row; return the initial observation (the prompt text)."""
        ...

    async def step(self, action: str) -> StepResult:
        """React to the model's turn (decoded text, special tokens skipped)."""
        ...


ENVS: Registry[type] = Registry("environment")
ENVS.register_lazy("first_digit", "asyncrl.envs.builtin:FirstDigitEnv")
ENVS.register_lazy("tool_arith", "asyncrl.envs.builtin:ToolArithEnv")
ENVS.register_lazy("guess", "asyncrl.envs.builtin:GuessEnv")
ENVS.register_lazy("tools", "asyncrl.envs.tool_env:ToolEnv")


class EnvGarbage(ValueError):
    """An env returned something that is not a StepResult / (str, number, bool) / str observation."""


def as_step_result(value: Any) -> StepResult:
    """Normalise what `step` returned; raise EnvGarbage with one line otherwise."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 3:
        result = StepResult(*value)
    else:
        raise EnvGarbage(f"step returned {type(value).__name__} {value!r:.80}; "
                         f"expected StepResult(observation, reward, done)")
    obs = result.observation
    if not isinstance(obs, str) and not (isinstance(obs, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in obs)):
        raise EnvGarbage(f"step observation is {type(obs).__name__} {obs!r:.60}; expected text or a list of "
                         f"messages with string 'role' and 'content'")
    if (isinstance(result.reward, bool) or not isinstance(result.reward, (int, float))
            or not math.isfinite(result.reward)):
        raise EnvGarbage(f"step reward is {result.reward!r:.40}; expected a finite number")
    if not isinstance(result.done, bool):
        raise EnvGarbage(f"step done is {type(result.done).__name__}, not bool")
    return result


def resolve_env(spec: str) -> type:
    """A built-in name or 'pkg.module:Class' -> the class. ValueError with one line starting 'env.env:'."""
    if ":" not in spec:
        if spec not in ENVS:
            close = difflib.get_close_matches(spec, ENVS.names(), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"env.env: unknown environment {spec!r} — {hint}built-in: {', '.join(ENVS.names())}; "
                             f"or give an import path 'pkg.module:Class'")
        return ENVS.get(spec)
    try:
        cls = import_path(spec)
    except ValueError as exc:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 — the import itself failed: say where to look
            raise ValueError(f"env.env: {exc} — is its package installed or on PYTHONPATH?") from None
        classes = [n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__]
        close = difflib.get_close_matches(attr, classes, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"classes there: {', '.join(sorted(classes)) or 'none'}"
        raise ValueError(f"env.env: {exc} — {hint}") from None
    if not inspect.isclass(cls):
        raise ValueError(f"env.env: {spec!r} is a {type(cls).__name__}, not a class — point at the env class")
    return cls


def check_env(spec: str, kwargs: dict[str, Any]) -> list[str]:
    """Error lines for `asyncrl validate`: the class resolves, has async reset(row)/step(action), its
    constructor accepts `env.kwargs`, and one instance builds with them (then it is closed again), so a
    wrong value is a config error here instead of every episode failing at run time."""
    try:
        cls = resolve_env(spec)
    except ValueError as exc:
        return [str(exc)]
    errors: list[str] = []
    for name, arg in (("reset", "row"), ("step", "action")):
        fn = getattr(cls, name, None)
        if fn is None:
            errors.append(f"env.env: {spec!r} has no {name}() — define `async def {name}(self, {arg})`")
        elif not inspect.iscoroutinefunction(fn):
            errors.append(f"env.env: {spec!r}.{name} is not async — define it as `async def {name}(self, {arg})`")
        elif not _takes_one_argument(fn):
            errors.append(f"env.env: {spec!r}.{name} has signature {inspect.signature(fn)}; "
                          f"it must be callable as {name}(self, {arg})")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        errors.append(f"env.kwargs: {spec!r} cannot be built with {sorted(kwargs)} ({exc}) — match its __init__")
    except ValueError:
        pass  # uninspectable constructor: trust it
    if not errors:
        errors += _check_builds(spec, cls, kwargs)
    return errors


def _check_builds(spec: str, cls: type, kwargs: dict[str, Any]) -> list[str]:
    """Build one env with `kwargs` (as each episode does) and close it; an error line if that raises."""
    try:
        env = cls(**kwargs)
    except Exception as exc:  # noqa: BLE001 — user code: its error is the config's
        text = str(exc).strip().splitlines()
        return [f"env.kwargs: {spec!r} cannot be built with {kwargs!r} — {type(exc).__name__}: "
                f"{text[0][:200] if text else ''} — fix the value"]
    close = getattr(env, "close", None)
    try:
        result = close() if callable(close) else None
        if inspect.isawaitable(result):
            _run_to_end(result)
    except Exception as exc:  # noqa: BLE001 — a failing close is the episode runner's to contain, not a config error
        log.debug("env.env: closing the env built for validation failed: %r", exc)
    return []


def _run_to_end(awaitable: Any) -> None:
    """Await `awaitable` to its end from sync code, also when this thread already runs an event loop."""
    async def wait() -> None:
        await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(wait())
        return
    worker = threading.Thread(target=asyncio.run, args=(wait(),), name="env-close", daemon=True)
    worker.start()
    worker.join(10)


def _takes_one_argument(fn: Any) -> bool:
    try:
        inspect.signature(fn).bind(object(), object())  # (self, arg)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def turn_stops(cls: type) -> list[str]:
    """The env class's optional `stop` attribute (strings that end a model turn)."""
    stop = getattr(cls, "stop", [])
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"env.env: {cls.__name__}.stop must be a list of non-empty strings, got {stop!r}")
    return list(stop)


def check_config(cfg: Config) -> list[str]:
    """The [env] section's check in `load_config` (asyncrl/config/checks.py): the class resolves with async
    reset/step and takes env.kwargs; episodes fit the context; the estimator and the cost signal are ones
    episodes can feed."""
    if cfg.env is None:
        return []
    from asyncrl.algorithms.checks import needs_of

    e = cfg.env
    errors = check_env(e.env, e.kwargs)
    if not errors:
        try:
            turn_stops(resolve_env(e.env))
        except ValueError as exc:
            errors.append(str(exc))
    needs = needs_of(cfg.algorithm.advantage)
    if needs is not None and needs.greedy_baseline:
        errors.append(f"env.env: advantage {cfg.algorithm.advantage!r} needs a greedy completion of each prompt as "
                      f"its baseline, which env episodes do not produce — use another algorithm.advantage "
                      f"(e.g. 'grpo') with [env]")
    if cfg.reward.cost_fn:
        errors.append("reward.cost_fn: env episodes bring their own reward and are not scored by reward.cost_fn — "
                      "leave it empty with [env] (return a cost-shaped reward from the env instead)")
    if e.max_episode_tokens >= cfg.data.max_prompt_len:
        errors.append(f"env.max_episode_tokens: {e.max_episode_tokens} leaves no room for the initial observation in "
                      f"data.max_prompt_len = {cfg.data.max_prompt_len} (the engine keeps the last max_prompt_len "
                      f"tokens of an episode's context) — raise data.max_prompt_len or lower env.max_episode_tokens")
    if not errors and (Path(cfg.model.path) / "tokenizer_config.json").is_file():
        from asyncrl.envs.transcript import HFCodec, resolve_format
        from engines.hf import load_tokenizer

        try:
            resolve_format(HFCodec(load_tokenizer(cfg.model.path)), e.chat_template)
        except ValueError as exc:
            errors.append(str(exc))
    return errors
