"""Builds the env pieces of a run from its Config: the generators' EpisodeRunner and the trainer's
held-out `EnvEvaluator` (greedy and sampled episodes on the trainer's own weights).

Place in the dataflow: `asyncrl/deploy/build.py` calls `episode_runner` for each generator and `env_evaluator`
for the trainer when `[env]` is set.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.config.schema import Config
from asyncrl.envs.base import resolve_env, turn_stops
from asyncrl.envs.runner import EpisodeLimits, EpisodeRunner
from asyncrl.envs.transcript import HFCodec, resolve_format
from asyncrl.messages import SamplingParams
from asyncrl.telemetry.rollouts import EVAL_SAMPLES_KEY
from engines.base import RolloutEngine


def limits(cfg: Config) -> EpisodeLimits:
    e = cfg.env
    assert e is not None
    return EpisodeLimits(max_turns=e.max_turns, max_episode_tokens=e.max_episode_tokens,
                         step_timeout_s=e.step_timeout_s, on_step_error=e.on_step_error)


def episode_runner(
    cfg: Config, engine: RolloutEngine, tokenizer: Any, *, temperature: float | None = None
) -> EpisodeRunner:
    """The runner for `[env]`; `rollout.max_new_tokens` is the per-turn limit."""
    e, r = cfg.env, cfg.rollout
    if e is None:
        raise ValueError("episode_runner needs an [env] section")
    cls = resolve_env(e.env)
    codec = HFCodec(tokenizer)
    eos = getattr(engine, "eos_token_ids", None) or (
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    )
    sampling = SamplingParams(n=1, temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                              top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop_token_ids=list(r.stop_token_ids), stop=list(r.stop))
    return EpisodeRunner(engine=engine, env_cls=cls, env_kwargs=e.kwargs, codec=codec,
                         fmt=resolve_format(codec, e.chat_template), sampling=sampling, limits=limits(cfg),
                         stop_ids=frozenset([*eos, *r.stop_token_ids]), turn_stops=turn_stops(cls))


class EnvEvaluator:
    """Mean episode reward of greedy and of sampled episodes over fixed held-out rows; with `samples`, each
    episode too (its prompt, and everything after it decoded: model turns and observations), under
    EVAL_SAMPLES_KEY for rollouts.jsonl."""

    def __init__(self, *, greedy: EpisodeRunner, sampled: EpisodeRunner, rows: list[dict[str, Any]],
                 samples: bool = False) -> None:
        self.runners = {"greedy": greedy, "sampled": sampled}
        self.engine = greedy.engine  # both runners' (the trainer puts it to sleep between evaluations)
        self.rows = rows
        self.samples = samples

    async def evaluate(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        samples: list[dict[str, Any]] = []
        for name, runner in self.runners.items():
            episodes = await asyncio.gather(*[runner.run_episode(row) for row in self.rows])
            out[f"eval/{name}_reward"] = sum(ep.reward for ep in episodes) / max(1, len(episodes))
            out[f"eval/{name}_errors"] = float(sum(bool(ep.env_error or ep.error) for ep in episodes))
            out[f"eval/{name}_turns"] = sum(ep.transcript.turns for ep in episodes) / max(1, len(episodes))
            if self.samples:
                samples += [{"split": "eval", "mode": name, "prompt": ep.prompt_text,
                             "completion": runner.codec.decode(ep.transcript.response_ids), "reward": ep.reward,
                             "components": {}, "finish_reason": ep.finish_reason, "turns": ep.transcript.turns,
                             "completion_tokens": len(ep.transcript.response_ids)} for ep in episodes]
        out["eval/prompts"] = float(len(self.rows))
        if self.samples:
            out[EVAL_SAMPLES_KEY] = samples
        return out


def env_evaluator(cfg: Config, engine: RolloutEngine, tokenizer: Any, rows: list[dict[str, Any]]) -> EnvEvaluator:
    return EnvEvaluator(greedy=episode_runner(cfg, engine, tokenizer, temperature=0.0),
                        sampled=episode_runner(cfg, engine, tokenizer), rows=rows,
                        samples=cfg.logging.rollouts_every > 0)
