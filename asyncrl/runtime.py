"""The embedding API: `asyncrl.Runtime`, for users whose agent loop is their own program.

Place in the dataflow — the user's loop replaces the generators' prompt loop:

```
 user loop ── rt.generate / ep.act ──► Generator.generate (the least-loaded one; continuous batching, newest weights)
     └────── rt.submit(group) ──► ReplayBuffer.submit_group (gate: admitted at the group's min_version)
                                     ──► rollout queue ──► Scorer ──► Trainer ──► weights ──► Generators
```

```python
async with Runtime("agent.toml") as rt:          # starts buffer, trainer, scorers, generator engines
    ep = rt.episode("?")                          # token-in/token-out transcript
    text = await ep.act()                         # one model turn on the exact token context
    ep.observe("+"); ep.reward = 1.0              # env tokens (not trained), the episode's reward
    await rt.submit([ep, ...])                    # one group (GRPO: episodes of the same task)
    await rt.wait_for_version(rt.version + 1)     # training runs in the background
```

Training takes one step per `trainer.prompts_per_step` submitted groups, broadcasts the weights to the
generator engines and publishes the version, up to `trainer.total_steps` (the Controller's own loop,
metrics.jsonl in `run.output_dir` as for `asyncrl launch`). Staleness: a submitted group is admitted at
the gate at its min_version, so `staleness.max_staleness` holds for it like for generated groups: `submit`
waits while the gate has no room (backpressure) and drops the group (returns None, counted as
`buffer/submitted_dropped_stale`) when it is too old to fit. Deployments: in-process (`local=True`) or Ray
actors (`local=False`).

Checkpoints and resume: durable checkpoints are written as for `asyncrl launch` (`run.save_every_s`, on by
default, and `run.save_every`); `Runtime(cfg, resume=True)` continues from the newest valid one in the run
directory. `rt.version` starts
at the checkpoint's version, the groups accepted and not yet trained are trained, metrics.jsonl goes on.
Groups your loop had submitted that were still being scored when the checkpoint was taken are not in it:
submit them again (their places at the gate are kept for the next submissions).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any, Sequence

from asyncrl.aio import discard
from asyncrl.algorithms.registry import advantage_needs
from asyncrl.config import load_config
from asyncrl.config.schema import Config
from asyncrl.control.controller import Controller
from asyncrl.envs.tool_env import ToolTurn, ToolUse
from asyncrl.envs.transcript import HFCodec, Transcript, resolve_format
from asyncrl.errors import TrainingFinished  # raised here; user code imports it from here or from asyncrl.errors
from asyncrl.messages import Completion, SamplingParams, Trajectory
from buffers.dispatch import Loads
from engines.hf import ensure_model, eos_token_ids, load_tokenizer

log = logging.getLogger(__name__)


class _IdleGenerator:
    """A generator role whose prompt loop is replaced by waiting: the user's loop does the generating."""

    def __init__(self, role: Any) -> None:
        self._role = role
        self._stopped = asyncio.Event()

    async def run(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        self._stopped.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._role, name)


class _Embedded:
    """The Controller's Deployment: roles as deployed, idle generator loops, publish observed, shutdown
    deferred to Runtime.__aexit__ (so generate works until the user leaves the context)."""

    def __init__(self, inner: Any, on_publish: Any) -> None:
        self.inner = inner
        self.buffer = _PublishHook(inner.buffer, on_publish)
        self.trainer = inner.trainer
        self.generators = [_IdleGenerator(g) for g in inner.generators]
        self.scorers = inner.scorers

    # your own loop submits episodes: a restarted generator could not take them over, so nothing is restarted
    restartable: tuple[str, ...] = ()

    def dead_role(self, exc: BaseException) -> str | None:
        return self.inner.dead_role(exc)

    def holder_of(self, role: str) -> str:
        return self.inner.holder_of(role)

    async def leave_weight_groups(self) -> None:
        raise NotImplementedError("asyncrl.Runtime does not restart roles")

    async def generator_death(self) -> BaseException | None:
        raise NotImplementedError("asyncrl.Runtime does not restart roles")

    async def restart(self, kind: str, index: int) -> None:
        raise NotImplementedError("asyncrl.Runtime does not restart roles")

    async def setup_weight_sync(self, group_name: str = "weights") -> None:
        await self.inner.setup_weight_sync()

    async def save_checkpoint(self, path: str) -> None:
        await self.inner.save_checkpoint(path)

    def probes(self) -> dict[str, Any]:
        return self.inner.probes()

    async def shutdown(self) -> None:
        """Deliberately nothing: the Controller calls this when training ends, but the user's loop may still
        generate; `Runtime.__aexit__` shuts `inner` down."""


class _PublishHook:
    def __init__(self, buffer: Any, on_publish: Any) -> None:
        self._buffer = buffer
        self._on_publish = on_publish

    async def publish(self, version: int, *, report: bool = False) -> Any:
        out = await self._buffer.publish(version, report=report)
        self._on_publish(version)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buffer, name)


class AgentEpisode:
    """A token-in/token-out episode driven by the user's loop: `act` samples a model turn on the exact
    context, `observe` appends environment text or messages (never trained), `reward` is the episode's reward.
    With `tools` (a ToolUse), the prompt carries their schemas and `call_tools` runs the calls of a turn."""

    def __init__(self, rt: "Runtime", prompt: str | list[dict[str, str]], tools: ToolUse | None = None) -> None:
        self._rt = rt
        self.tools = tools
        self.transcript = Transcript(rt.codec, rt.chat_format, stop_ids=rt.stop_ids)
        if tools is None:
            self.transcript.start(prompt)
        else:
            self.transcript.start(prompt, tools=tools.schemas, tools_prompt=tools.prompt)
        self.prompt = prompt if isinstance(prompt, str) else rt.codec.decode(self.transcript.prompt_ids)
        self.reward = 0.0
        self.temperature: float | None = None
        self.finish_reason = "stop"

    async def act(self, **sampling: Any) -> str:
        """One model turn (`sampling`: SamplingParams fields except n); returns its text."""
        c = await self._rt.generate(self.transcript.context, **sampling)
        temp = self._rt.sampling(**sampling).temperature
        if self.temperature is not None and temp != self.temperature:
            raise ValueError(f"an episode's turns must share one temperature ({self.temperature} then {temp})")
        self.temperature = temp
        self.finish_reason = c.finish_reason
        return self.transcript.add_model_turn(list(c.response_ids), list(c.logprobs), list(c.versions))

    def observe(self, observation: str | list[dict[str, str]]) -> None:
        """Append text (a user message) or messages (e.g. role "tool") through the chat template."""
        self.transcript.add_observation(observation, self.transcript.observation_ids(observation), self._rt.version)

    async def call_tools(self, text: str) -> ToolTurn:
        """Run the tool calls in model turn `text` and observe their tool messages (results or errors); a
        turn without calls observes nothing (`turn.calls` is empty: it is the final answer)."""
        if self.tools is None:
            raise ValueError("this episode has no tools — start it with rt.episode(prompt, tools=[...])")
        turn = await self.tools.respond(text)
        if turn.messages:
            self.observe(turn.messages)
        return turn

    def to_trajectory(self) -> Trajectory:
        t = self.transcript
        if not t.turns:
            raise ValueError("an episode needs at least one model turn (act) before it is submitted")
        model_versions = [v for v, m in zip(t.versions, t.loss_mask) if m] or [self._rt.version]
        return Trajectory(seq_id=0, group_id=0, group_size=1, prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                          loss_mask=t.loss_mask, behavior_logprobs=t.logprobs, versions=t.versions,
                          min_version=min(model_versions), max_version=max(model_versions),
                          finish_reason="length" if self.finish_reason == "length" else "stop",
                          temperature=self.temperature if self.temperature is not None else 1.0,
                          prompt_text=self.prompt, env_reward=float(self.reward), turns=t.turns,
                          tool_calls=self.tools.tools.calls if self.tools else 0,
                          tool_errors=self.tools.tools.errors if self.tools else 0)


class Runtime:
    """Starts the run's roles and trains in the background on what the user's loop submits."""

    def __init__(self, config: Config | str | Path, *, local: bool = True, overrides: Sequence[str] = (),
                 run_dir: str | Path | None = None, resume: bool = False) -> None:
        self.cfg = config if isinstance(config, Config) else load_config(config, overrides)
        advantage = self.cfg.algorithm.advantage
        if advantage_needs(advantage).greedy_baseline:
            raise ValueError(f"algorithm.advantage: {advantage!r} needs a greedy baseline, the generators' greedy "
                             f"completion of each prompt, which groups submitted to a Runtime do not have — use "
                             f"e.g. 'grpo' or 'rloo'")
        self.local = local
        self.run_dir = run_dir
        self.resume = resume  # continue from the newest valid checkpoint in the run directory
        self._version = 0
        self._version_changed = asyncio.Condition()
        self._task: asyncio.Future | None = None
        self._loads = Loads()  # the generate calls in flight per generator, and its seconds per call
        self._calls = itertools.count()
        self._started_ray = False
        self._inner: Any = None
        self._servers: list[Any] = []  # OpenAI-compatible endpoints, closed on exit

    # -- lifecycle --------------------------------------------------------------------------------
    async def __aenter__(self) -> "Runtime":
        cfg = self.cfg
        await asyncio.to_thread(ensure_model, cfg.model)
        tok = load_tokenizer(cfg.model.path)
        self.codec = HFCodec(tok)
        self.chat_format = resolve_format(self.codec, cfg.env.chat_template if cfg.env else "auto")
        self.stop_ids = frozenset([*eos_token_ids(cfg.model.path), *cfg.rollout.stop_token_ids])
        try:
            if self.local:
                from asyncrl.deploy.local import LocalDeployment

                self._inner = await asyncio.to_thread(LocalDeployment, cfg)
            else:
                from asyncrl.deploy.launch import RayDeployment, start_ray

                self._started_ray = start_ray(cfg)
                self._inner = RayDeployment(cfg)
                await asyncio.to_thread(self._inner.wait_ready)
            self._deployment = _Embedded(self._inner, self._published)
            self.controller = Controller(cfg, self._deployment, run_dir=self.run_dir, resume=self.resume)
        except BaseException:  # __aexit__ will not run: stop what was started, then report the cause
            try:
                await self._release()
            except Exception as exc:  # the start's own error is the one to report
                log.warning("cleanup after a failed start failed too: %s", exc)
            raise
        self._task = asyncio.ensure_future(self.controller.run())
        self._task.add_done_callback(lambda _: asyncio.ensure_future(self._notify()))
        await self._until_ready()
        return self

    async def _until_ready(self) -> None:
        """Wait until the Controller restored its checkpoint (a resume) and the engines hold the weights to
        start from; a run that ends first (no checkpoint to resume from) is shut down and its error raised."""
        ready = asyncio.ensure_future(self.controller.ready.wait())
        await asyncio.wait([ready, self._task], return_when=asyncio.FIRST_COMPLETED)
        discard(ready)
        if not self.controller.ready.is_set():
            assert self._task is not None and self._task.done()
            await self._release()
            self._task.result()  # its error; a run without steps to take ends here too
        self._version = self.controller.first_step

    async def __aexit__(self, *exc: Any) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            await server.close()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            try:
                await self._task
            except (asyncio.CancelledError, Exception) as err:  # reported by whoever awaited training
                log.debug("background training ended with %r", err)
        await self._release()

    async def _release(self) -> None:
        """Shut the deployment down (engines, actors) and Ray if this Runtime started it."""
        inner, self._inner = self._inner, None
        try:
            if inner is not None:
                await inner.shutdown()
        finally:
            if self._started_ray:
                from asyncrl.deploy.launch import stop_ray

                self._started_ray = False
                stop_ray()

    # -- versions ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The newest published policy version (every generator engine holds it)."""
        return self._version

    @property
    def training_done(self) -> bool:
        return self._task is not None and self._task.done()

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The newest metrics rows (one per train step, the last `controller.ROWS_KEPT`; all are in metrics.jsonl).
        Step v's row comes a little after version v is published (the roles' stats are gathered first)."""
        return list(self.controller.rows)

    def _published(self, version: int) -> None:
        self._version = max(self._version, version)
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._version_changed:
            self._version_changed.notify_all()

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until the published version is >= `version`; returns it. TimeoutError after `timeout`;
        TrainingFinished if training ended first (a failure is chained)."""
        async def wait() -> int:
            async with self._version_changed:
                while self._version < version:
                    self._raise_if_finished()
                    await self._version_changed.wait()
            return self._version

        return await asyncio.wait_for(wait(), timeout)

    def _raise_if_finished(self) -> None:
        if self._task is not None and self._task.done():
            exc = None if self._task.cancelled() else self._task.exception()
            raise TrainingFinished(f"training ended at version {self._version}"
                                   + (f": {type(exc).__name__}: {exc}" if exc else "")) from exc

    async def wait_done(self) -> list[dict[str, Any]]:
        """Wait for the background training to finish; returns the metrics rows (raises what it raised)."""
        assert self._task is not None, "use Runtime as `async with Runtime(...) as rt`"
        return await asyncio.shield(self._task)

    # -- generation -------------------------------------------------------------------------------
    def sampling(self, **overrides: Any) -> SamplingParams:
        r = self.cfg.rollout
        base = dict(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                    stop_token_ids=list(r.stop_token_ids), stop=list(r.stop))
        if "n" in overrides:
            raise ValueError("generate samples one completion; call it n times concurrently (they are batched)")
        base.update(overrides)
        return SamplingParams(n=1, **base)

    async def generate(self, prompt: str | list[int], **sampling: Any) -> Completion:
        """One completion of `prompt` (text is encoded once, with the model's BOS if its tokenizer puts one before
        plain text; ids are used as they are) on the newest weights:
        token ids, behaviour logprobs and the version of each token. Concurrent calls are batched; each goes to
        the least-loaded generator."""
        ids = self.codec.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        gens = self._deployment.generators
        # the least-loaded generator: fewest calls in flight, weighted by its seconds per call (ties: lowest
        # index), so a slow generator gets few of them (buffers/dispatch.py)
        i = self._loads.pick(range(len(gens)))
        call = next(self._calls)
        self._loads.started(i, call)
        ok = False
        try:
            out = await gens[i].generate([ids], self.sampling(**sampling))
            ok = True
        finally:
            self._loads.finished(call, ok)
        return out[0][0]

    def episode(self, prompt: str | list[dict[str, str]], tools: Sequence[Any] | ToolUse | None = None,
                parser: str = "hermes") -> AgentEpisode:
        """A new token-in/token-out episode whose initial observation is `prompt` (text or chat messages).
        `tools`: registered names, 'pkg.module:function' paths, callables, or a ToolUse; their JSON schemas
        go to the chat template's `tools=`, and `ep.call_tools(text)` reads calls in the `parser` format."""
        if tools is not None and not isinstance(tools, ToolUse):
            tools = ToolUse(list(tools), parser)
        return AgentEpisode(self, prompt, tools)

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)

    async def serve_openai(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> Any:
        """Start an OpenAI-compatible endpoint over this policy (asyncrl/serve/openai_server.py): agent code
        calls `server.episode().base_url`, every request is recorded for `submit`. Port 0 picks a free port
        (`server.port`, `server.url`). `options`: chat_template (a Jinja string replacing the tokenizer's),
        model_name, max_n (16), max_tokens (rollout.max_new_tokens), tool_parser ("hermes": the format
        `tool_calls` are read in; None: raw text). Closed when the Runtime exits."""
        from asyncrl.serve import OpenAIServer

        server = await OpenAIServer(self, host, port, **options).start()
        self._servers.append(server)
        return server

    # -- training data ----------------------------------------------------------------------------
    async def submit(self, group: Sequence[Any] | AgentEpisode | Trajectory,
                     timeout: float | None = None) -> int | None:
        """Queue one group (episodes of the same task; GRPO compares them) for training.

        Trajectories with `env_reward` set are trained with it; others are scored by `reward.fn`. Episodes of
        the OpenAI endpoint (`serve_openai`) give one trajectory per recorded conversation, each with the
        episode's reward.
        Returns the group id, or None when the group was too stale for the gate (dropped, counted).
        Waits while the gate has no room; TrainingFinished once training has ended.
        """
        items = [group] if isinstance(group, (AgentEpisode, Trajectory)) or hasattr(group, "to_trajectories") \
            else list(group)
        trajs = [t for x in items for t in _trajectories(x)]
        for t in trajs:  # here, one line to the caller, not later in the trainer (which would end the run)
            _check_submittable(t)
        self._raise_if_finished()
        try:
            return await self._deployment.buffer.submit_group(trajs, timeout)
        except Exception as exc:
            if type(exc).__name__ == "QueueClosed" or self.training_done:
                raise TrainingFinished(f"training ended at version {self._version}; the group was not queued") from exc
            raise


def _trajectories(x: Any) -> list[Any]:
    if isinstance(x, AgentEpisode):
        return [x.to_trajectory()]
    if hasattr(x, "to_trajectories"):  # asyncrl.serve.ServedEpisode
        return list(x.to_trajectories())
    return [x]


def _check_submittable(t: Trajectory) -> None:
    """Raise ValueError (one line) for a trajectory the trainer must refuse: greedy, no prompt, or per-token
    lists that do not match its response."""
    if not isinstance(t, Trajectory):
        raise TypeError(f"submit takes AgentEpisodes or Trajectories (or served episodes), got {type(t).__name__}")
    if t.temperature <= 0:
        raise ValueError(f"submit: a trajectory sampled greedily (temperature={t.temperature}) is never trained — "
                         f"sample its turns with temperature > 0")
    if not t.prompt_ids:
        raise ValueError("submit: a trajectory needs at least one prompt token")
    n = len(t.response_ids)
    if not (len(t.loss_mask) == len(t.behavior_logprobs) == len(t.versions) == n):
        raise ValueError(f"submit: response_ids ({n}), loss_mask ({len(t.loss_mask)}), behavior_logprobs "
                         f"({len(t.behavior_logprobs)}) and versions ({len(t.versions)}) need one entry per "
                         f"response token")
