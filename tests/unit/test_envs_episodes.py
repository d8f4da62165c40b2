"""Env episodes without a model: a scripted engine, a tokenizer whose decode→encode does not round-trip,
chat templates that are and are not append-only, and environments that raise, hang or return garbage."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from asyncrl.envs.base import StepResult, as_step_result, check_env, resolve_env
from asyncrl.envs.runner import EpisodeLimits, EpisodeRunner
from asyncrl.envs.transcript import ChatTemplateError, Transcript, resolve_format
from asyncrl.messages import Completion, SamplingParams

SPECIAL = "<eos>"


class MergeCodec:
    """Chars are tokens, plus a merged "ab" token and an "<eos>" special token. Encoding merges greedily, so
    the sampled pair ("a", "b") decodes to "ab" and re-encodes to the single merged token: no round trip."""

    def __init__(self, template: str | None = None) -> None:
        chars = "abcdefghijklmnopqrstuvwxyz0123456789+-?=<>|:"
        self.vocab = [*chars, "ab", SPECIAL]
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.eos = self.ids[SPECIAL]
        self.template = template

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for tok in (SPECIAL, "ab"):
                if text.startswith(tok, i):
                    out.append(self.ids[tok])
                    i += len(tok)
                    break
            else:
                out.append(self.ids[text[i]])
                i += 1
        return out

    def encode_prompt(self, text: str) -> list[int]:  # no BOS
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i != self.eos)

    def decode_raw(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)

    @property
    def has_template(self) -> bool:
        return self.template is not None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        body = "".join(f"<{m['role'][0]}>{m['content']}{SPECIAL}|" for m in messages)
        if self.template == "counted":  # not append-only: the prefix changes with every message
            body = f"{len(messages)}:" + body
        return body + ("<a>" if add_generation_prompt else "")


class ScriptedEngine:
    """Returns the scripted turns in order and records the exact contexts it was given."""

    def __init__(self, turns: list[list[int]], version: int = 3) -> None:
        self.turns = list(turns)
        self.contexts: list[list[int]] = []
        self.version = version
        self.eos_token_ids: list[int] = []

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.contexts.append(list(prompts[0]))
        ids = self.turns.pop(0) if self.turns else [0]
        ids = ids[: params.max_new_tokens]
        return [[Completion(prompt_ids=prompts[0], response_ids=ids, logprobs=[-0.5 - k for k in range(len(ids))],
                            versions=[self.version] * len(ids), finish_reason="stop")]]


class EchoEnv:
    """Answers every turn with "ab" until `turns` turns, reward 1 per turn."""

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns

    async def reset(self, row: dict[str, Any]) -> str:
        self.n = 0
        return row["prompt"]

    async def step(self, action: str) -> StepResult:
        self.n += 1
        return StepResult(observation="ab", reward=1.0, done=self.n >= self.turns)


def runner(engine, codec, env_cls=EchoEnv, fmt="none", kwargs=None, **limits) -> EpisodeRunner:
    return EpisodeRunner(engine=engine, env_cls=env_cls, env_kwargs=kwargs or {}, codec=codec, fmt=fmt,
                         sampling=SamplingParams(max_new_tokens=4), limits=EpisodeLimits(**limits),
                         stop_ids=frozenset([codec.eos]))


def test_trained_ids_equal_sampled_ids_when_decode_encode_does_not_round_trip():
    codec = MergeCodec()
    a, b, ab, eos = codec.ids["a"], codec.ids["b"], codec.ids["ab"], codec.eos
    assert codec.encode(codec.decode([a, b])) == [ab]  # the tokenizer really does not round-trip
    engine = ScriptedEngine([[a, b, eos], [b, a]])
    traj = asyncio.run(runner(engine, codec).run_group(7, {"prompt": "q"}, 1))[0]
    q = codec.encode("q")
    assert traj.prompt_ids == q
    assert traj.response_ids == [a, b, eos, ab, b, a]          # sampled ids kept, env "ab" encoded once
    assert traj.loss_mask == [True, True, True, False, True, True]
    assert engine.contexts == [q, q + [a, b, eos, ab]]          # each turn saw the exact running context
    assert traj.behavior_logprobs[:3] == [-0.5, -1.5, -2.5] and traj.behavior_logprobs[3] == 0.0
    assert traj.env_reward == 2.0 and traj.turns == 2 and traj.finish_reason == "stop"
    assert traj.min_version == 3 and traj.seq_id == 7 and traj.group_id == 7


def test_append_only_template_appends_only_the_new_suffix_and_skips_the_sampled_eos():
    codec = MergeCodec(template="plain")
    assert resolve_format(codec, "auto") == "strict"
    t = Transcript(codec, "strict", stop_ids=frozenset([codec.eos]))
    t.start("q")
    assert codec.decode_raw(t.prompt_ids) == "<u>q<eos>|<a>"
    t.add_model_turn([codec.ids["5"], codec.eos], [-1.0, -1.0], [0, 0])
    ids = t.observation_ids("+")
    assert codec.decode_raw(ids) == "|<u>+<eos>|<a>"  # template closer minus the sampled <eos>, then the user turn
    t.add_observation("+", ids, 0)
    full = codec.render(t.messages, True)
    assert codec.decode_raw(t.prompt_ids + t.response_ids) == full


def test_template_that_is_not_append_only_is_reported_with_its_turn():
    codec = MergeCodec(template="counted")
    with pytest.raises(ChatTemplateError, match="not append-only at turn 1"):
        resolve_format(codec, "strict") and Transcript(codec, "strict").start("q") and _one_turn(codec)
    assert resolve_format(codec, "auto") == "concat"  # auto falls back to per-message rendering
    engine = ScriptedEngine([[codec.ids["5"], codec.eos], [codec.ids["6"]]])
    r = runner(engine, codec, fmt="strict")
    traj = asyncio.run(r.run_group(0, {"prompt": "q"}, 1))[0]
    assert "not append-only at turn 1" in traj.env_error and r.counters["template_errors"] == 1
    assert traj.finish_reason == "stop" and traj.loss_mask == [True, True]  # kept: trained on what it has
    # concat mode plays the same episode through
    engine = ScriptedEngine([[codec.ids["5"], codec.eos], [codec.ids["6"]]])
    traj = asyncio.run(runner(engine, codec, fmt="concat").run_group(0, {"prompt": "q"}, 1))[0]
    assert traj.env_error == "" and traj.turns == 2
    assert traj.response_ids[:2] == [codec.ids["5"], codec.eos] and traj.response_ids[-1] == codec.ids["6"]


@pytest.mark.parametrize("turn, closer", [("a", "|"), ("", "|"), ("5", "|")])
def test_concat_closes_the_model_message_after_its_content_even_when_the_header_contains_it(turn, closer):
    # "counted" renders the model's message alone as "1:<a>{content}<eos>|": content "a" also occurs in
    # its header "<a>", and an empty content (the model sampled only its eos) is found anywhere
    codec = MergeCodec(template="counted")
    t = Transcript(codec, "concat", stop_ids=frozenset([codec.eos]))
    t.start("q")
    assert codec.decode_raw(t.prompt_ids) == "1:<u>q<eos>|<a>"
    t.add_model_turn([*codec.encode(turn), codec.eos], [-1.0] * (len(turn) + 1), [0] * (len(turn) + 1))
    assert codec.decode_raw(t.observation_ids("+")) == closer + "1:<u>+<eos>|<a>"


def _one_turn(codec: MergeCodec) -> None:
    t = Transcript(codec, "strict", stop_ids=frozenset([codec.eos]))
    t.start("q")
    t.add_model_turn([codec.ids["5"]], [0.0], [0])
    t.observation_ids("+")


def test_strict_without_template_is_a_config_error_and_auto_is_plain():
    codec = MergeCodec()
    assert resolve_format(codec, "auto") == "none"
    with pytest.raises(ValueError, match="env.chat_template"):
        resolve_format(codec, "strict")


class RaisingEnv(EchoEnv):
    async def step(self, action: str) -> StepResult:
        raise RuntimeError("boom")


class HangingEnv(EchoEnv):
    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(60)
        return StepResult()


class GarbageEnv(EchoEnv):
    async def step(self, action: str) -> Any:
        return {"obs": 1}


class BadResetEnv(EchoEnv):
    async def reset(self, row: dict[str, Any]) -> str:
        raise KeyError("target")


@pytest.mark.parametrize("env_cls, counter, text", [
    (RaisingEnv, "step_errors", "RuntimeError: boom"), (HangingEnv, "step_timeouts", "timed out"),
    (GarbageEnv, "garbage", "step returned dict"),
])
def test_env_step_fault_ends_episode_with_recorded_error_and_the_rest_goes_on(env_cls, counter, text):
    codec = MergeCodec()
    r = runner(ScriptedEngine([[1]] * 8), codec, env_cls=env_cls, step_timeout_s=0.05)
    trajs = asyncio.run(r.run_group(0, {"prompt": "q"}, 2))
    for t in trajs:
        assert text in t.env_error and t.finish_reason == "stop" and t.loss_mask == [True]
    assert r.counters[counter] == 2
    good = asyncio.run(runner(ScriptedEngine([[1]] * 4), codec).run_group(1, {"prompt": "q"}, 1))[0]
    assert good.env_error == "" and good.env_reward == 2.0
    failing = runner(ScriptedEngine([[1]] * 8), codec, env_cls=env_cls, step_timeout_s=0.05, on_step_error="fail")
    assert all(t.finish_reason == "error" for t in asyncio.run(failing.run_group(0, {"prompt": "q"}, 2)))


class UnencodableEnv(EchoEnv):
    async def step(self, action: str) -> StepResult:
        return StepResult(observation="Z", reward=0.5)  # MergeCodec has no "Z": encode raises KeyError


def test_observation_the_tokenizer_cannot_encode_ends_the_episode_as_garbage_not_the_group():
    codec = MergeCodec()
    r = runner(ScriptedEngine([[1]] * 4), codec, env_cls=UnencodableEnv)
    trajs = asyncio.run(r.run_group(0, {"prompt": "q"}, 2))
    for t in trajs:
        assert "observation could not be encoded: KeyError" in t.env_error
        assert t.finish_reason == "stop" and t.loss_mask == [True] and t.env_reward == 0.5
    assert r.counters["garbage"] == 2


def test_reset_fault_fails_the_episode_and_is_counted():
    r = runner(ScriptedEngine([]), MergeCodec(), env_cls=BadResetEnv)
    (t,) = asyncio.run(r.run_group(0, {"prompt": "q"}, 1))
    assert t.finish_reason == "error" and "env reset: KeyError" in t.error and r.counters["reset_errors"] == 1


def test_turn_limit_and_token_budget_truncate_the_episode():
    codec = MergeCodec()
    r = runner(ScriptedEngine([[1, 1]] * 10), codec, kwargs={"turns": 99}, max_turns=3)
    (t,) = asyncio.run(r.run_group(0, {"prompt": "q"}, 1))
    assert t.turns == 3 and t.finish_reason == "length" and t.truncated and r.counters["turn_limit"] == 1
    r = runner(ScriptedEngine([[1, 1, 1, 1]] * 10), codec, kwargs={"turns": 99}, max_episode_tokens=7)
    (t,) = asyncio.run(r.run_group(0, {"prompt": "q"}, 1))
    assert len(t.response_ids) <= 7 and t.finish_reason == "length" and r.counters["token_limit"] == 1


def test_step_result_accepts_tuples_and_rejects_garbage():
    assert as_step_result(("x", 1, True)) == StepResult("x", 1, True)
    for bad in (None, ("x", float("nan"), True), (3, 0.0, False), ("x", 0.0, "yes"), ("x", True, False)):
        with pytest.raises(ValueError):
            as_step_result(bad)


class SyncEnv:
    def reset(self, row):
        return ""

    async def step(self, action):
        return StepResult()


class WrongSignatureEnv:
    async def reset(self):
        return ""

    async def step(self, action):
        return StepResult()


def test_check_env_reports_each_mistake_in_one_line():
    assert check_env("guess", {"max_guesses": 3}) == []
    assert "did you mean 'guess'" in check_env("gues", {})[0]
    assert "cannot import module" in check_env("no_such_pkg.envs:Env", {})[0]
    assert "has no attribute 'Nope'" in check_env("asyncrl.envs.builtin:Nope", {})[0]
    assert "not a class" in check_env("asyncrl.envs.builtin:guess_rows", {})[0]
    assert "reset is not async" in check_env(f"{__name__}:SyncEnv", {})[0]
    assert "must be callable as reset(self, row)" in check_env(f"{__name__}:WrongSignatureEnv", {})[0]
    assert check_env("guess", {"bogus": 1})[0].startswith("env.kwargs:")
    assert resolve_env("guess").__name__ == "GuessEnv"


def test_builtin_envs_follow_their_rules():
    from asyncrl.envs.builtin import FirstDigitEnv, GuessEnv, ToolArithEnv, arith_rows, guess_rows

    async def main():
        fd = FirstDigitEnv()
        assert await fd.reset({"prompt": "5382=", "answer": "5"}) == "5382="
        assert (await fd.step("5")).reward == 1.0 and (await fd.step("4")).reward == 0.0
        g = GuessEnv(max_guesses=3)
        await g.reset({"prompt": "?", "target": 6})
        assert [await g.step(a) for a in ("4", "x")] == [StepResult("+", 0.0, False), StepResult("?", 0.0, False)]
        assert await g.step("6") == StepResult("", 1.0, True)
        await g.reset({"prompt": "?", "target": 0})
        assert [(await g.step("5")).done for _ in range(3)] == [False, False, True]  # out of guesses, reward 0
        t = ToolArithEnv()
        assert await t.reset({"prompt": "9-3", "answer": "6"}) == "9-3"
        assert await t.step("=") == StepResult("6,", 0.0, False)        # "=" evaluates the display
        assert (await t.step("6,")).reward == pytest.approx(1.1)          # right, and used the tool
        await t.reset({"prompt": "9-3", "answer": "6"})
        assert (await t.step("calculator:1/0")).observation == "?,"       # a tool error is an observation
        assert (await t.step("7")).reward == 0.0
        await t.reset({"prompt": "8*7", "answer": "56"})
        assert (await t.step("5")).reward == pytest.approx(0.25)          # half the digits, partial 0.5

    asyncio.run(main())
    train, held = arith_rows("train"), arith_rows("eval")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(len(r["answer"]) == 1 for r in train + held)
    assert sorted({r["target"] for r in guess_rows("eval")}) == list(range(10))


def test_hf_tokenizer_chat_template_is_applied_append_only(tiny_model_dir):
    from asyncrl.envs.transcript import HFCodec
    from engines.hf import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}{{ '1' if m['role'] == 'user' else '2' }}{{ m['content'] }}<eos>="
                         "{% endfor %}{% if add_generation_prompt %}2{% endif %}")
    codec = HFCodec(tok)
    assert resolve_format(codec, "auto") == "strict"
    t = Transcript(codec, "strict", stop_ids=frozenset([tok.eos_token_id]))
    t.start("5")
    sampled = codec.encode("7") + [tok.eos_token_id]
    t.add_model_turn(sampled, [-1.0, -1.0], [0, 0])
    t.add_observation("+", t.observation_ids("+"), 0)
    assert (codec.decode_raw(t.prompt_ids + t.response_ids) == codec.render(t.messages, True)
            == "15<eos>=27<eos>=1+<eos>=2")
    assert t.response_ids[:2] == sampled and t.loss_mask == [True, True] + [False] * (len(t.response_ids) - 2)


# -- the Generator's two paths (single-turn completions, env episodes) at shutdown ------------------

class _ClosingBuffer:
    """Admits one group, then nothing; refuses its rollouts as a closed buffer does (optionally calling
    `before_refusing` first, e.g. the generator's stop(), as the runtime does before closing the buffer)."""

    def __init__(self) -> None:
        self.before_refusing = lambda: None
        self.admitted = self.puts = 0

    async def admit(self, max_groups: int, version: int, timeout: float | None = None, holder=None) -> list[int]:
        if self.admitted:
            await asyncio.sleep(0.01)
            return []
        self.admitted = 1
        return [0]

    async def put_rollouts(self, trajs) -> None:
        from buffers.queue import QueueClosed

        self.puts += 1
        self.before_refusing()
        raise QueueClosed("rollout queue is closed")

    async def release_groups(self, group_ids: list[int], reason: str, detail: str = "") -> None:
        raise AssertionError("nothing fails here")


def _generator(buffer: _ClosingBuffer, env: bool):
    from asyncrl.data.prompts import Prompt
    from asyncrl.roles.generator import Generator

    codec = MergeCodec()
    gen = Generator(generator_id=0, engine=ScriptedEngine([[1]] * 8), buffer=buffer,
                    prompt_row=lambda gid: {"prompt": "q"},
                    encode=lambda row: Prompt(codec.encode(row["prompt"]), row["prompt"]),
                    sampling=SamplingParams(n=2, max_new_tokens=2), concurrency=1)
    if env:
        gen.episodes = runner(ScriptedEngine([[1]] * 8), codec)
    return gen


def _run_collecting_loop_errors(coro) -> tuple[BaseException | None, list[str]]:
    """Run `coro` on a fresh loop; (its exception or None, messages the loop's exception handler got)."""
    import gc

    errors: list[str] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _, ctx: errors.append(ctx["message"]))
    try:
        loop.run_until_complete(asyncio.wait_for(coro, 5))
        raised = None
    except Exception as exc:  # noqa: BLE001 — the test inspects it
        raised = exc
    finally:
        gc.collect()  # an unretrieved task exception is reported when its task is collected
        loop.close()
    gc.collect()
    return raised, errors


@pytest.mark.parametrize("env", [False, True], ids=["single_turn", "env_episodes"])
def test_generator_drops_rollouts_quietly_when_the_buffer_closes_after_stop(env):
    buffer = _ClosingBuffer()
    gen = _generator(buffer, env)
    buffer.before_refusing = gen.stop  # the runtime stops the loops, then closes the buffer
    raised, errors = _run_collecting_loop_errors(gen.run())
    assert raised is None and buffer.puts == 1
    assert errors == []  # no "Task exception was never retrieved" (QueueClosed) at shutdown


@pytest.mark.parametrize("env", [False, True], ids=["single_turn", "env_episodes"])
def test_generator_run_fails_loudly_when_the_buffer_refuses_rollouts_while_running(env):
    # not stopped: the group would stay running at the gate forever, so the loop must end with the error
    buffer = _ClosingBuffer()
    raised, errors = _run_collecting_loop_errors(_generator(buffer, env).run())
    assert type(raised).__name__ == "QueueClosed" and buffer.puts == 1
    assert errors == []


# -- env metrics from the buffer: each stats() reports its window (since the previous one), plus totals ---------

def test_buffer_env_metrics_count_the_window_since_the_previous_stats_and_the_totals():
    from asyncrl.messages import Trajectory
    from asyncrl.telemetry.metrics import WindowReducer
    from buffers.replay import ReplayBuffer

    def episode(error: str = "", turns: int = 2, truncated: bool = False,
                tools: tuple[int, int] = (0, 0)) -> Trajectory:
        return Trajectory(seq_id=0, group_id=0, group_size=1, prompt_ids=[1], response_ids=[2], loss_mask=[True],
                          behavior_logprobs=[0.0], versions=[0], min_version=0, max_version=0, finish_reason="stop",
                          env_reward=1.0, env_error=error, turns=turns, truncated=truncated,
                          tool_calls=tools[0], tool_errors=tools[1])

    async def main() -> list[dict[str, float]]:
        buffer = ReplayBuffer(prompts_per_step=1, group_size=1, max_staleness=0, rollout_capacity=16, train_capacity=4)
        reducer = WindowReducer()  # as the Controller reduces the buffer's windows into rows

        async def read() -> dict[str, float]:
            return reducer.reduce([(await buffer.stats()).metrics], window_s=1.0)

        out = [await read()]
        await buffer.put_rollouts([episode(tools=(3, 1)), episode(turns=4, error="env step 1: boom")])
        out += [await read(), await read()]  # the second read: nothing since the first, an empty window
        await buffer.put_rollouts([episode(truncated=True, tools=(2, 2))])
        out.append(await read())
        return out

    before, first, empty, second = asyncio.run(main())
    assert "env/episodes" not in before  # no env episodes, no env metrics
    assert (first["env/episodes"], first["env/errors"], first["env/truncated"]) == (2, 1, 0)
    assert first["env/turns_mean"] == 3.0
    assert empty["env/episodes"] == 0 and empty["env/episodes_total"] == 2
    assert math.isnan(empty["env/turns_mean"])  # no episodes, no mean (null in metrics.jsonl)
    assert (second["env/episodes"], second["env/truncated"], second["env/errors"]) == (1, 1, 0)
    assert (second["env/episodes_total"], second["env/errors_total"], second["env/truncated_total"]) == (3, 1, 1)
    assert (first["env/tool_calls"], first["env/tool_errors"], second["env/tool_calls"]) == (3, 1, 2)
    assert (second["env/tool_calls_total"], second["env/tool_errors_total"]) == (5, 3)


# ---- an MoE engine's routing across turns (algorithm.routing_replay)

class RoutingEngine(ScriptedEngine):
    """Scripted turns, each with a routing record of every position fed (context + ids but the last): one layer,
    top-2, row = [turn, position]."""

    def __init__(self, turns: list[list[int]], truncate_turn: int = -1) -> None:
        super().__init__(turns)
        self.truncate_turn = truncate_turn

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        import msgspec

        from engines.routing import pack_routing

        turn = len(self.contexts)
        (c,) = (await super().generate(prompts, params))[0]
        import torch

        rows = torch.tensor([[[turn, p]] for p in range(len(prompts[0]) + len(c.response_ids) - 1)]).view(-1, 1, 2)
        return [[msgspec.structs.replace(c, prompt_truncated=turn == self.truncate_turn, **pack_routing(rows))]]


def _rows(traj) -> list[list[int]]:
    from engines.routing import unpack_routing

    return unpack_routing(traj.routed_experts, traj.routing_shape)[:, 0].tolist()


def test_an_episodes_routing_keeps_each_position_from_the_turn_that_fed_it_first():
    codec = MergeCodec()
    engine = RoutingEngine([[1, 2, 3], [4, 5]])
    play = runner(engine, codec, EchoEnv, kwargs={"turns": 3}, max_turns=2)  # ends on the turn limit
    (traj,) = asyncio.run(play.run_group(0, {"prompt": "xy"}, 1))
    first, second = engine.contexts  # "xy"; "xy" + turn 1 + the observation "ab" (one merged token)
    assert len(first) == 2 and len(second) == 2 + 3 + 1
    rows = _rows(traj)
    tokens = len(traj.prompt_ids) + len(traj.response_ids)
    assert traj.response_ids == [1, 2, 3, codec.ids["ab"], 4, 5, codec.ids["ab"]]  # ends on the last observation
    assert len(rows) == tokens - 1
    fed_first = len(first) + 3 - 1  # turn 0 fed the prompt and its tokens but its last
    assert rows[:fed_first] == [[0, p] for p in range(fed_first)]
    fed_second = len(second) + 2 - 1  # turn 1: turn 0's last token, the observation, its own tokens but the last
    assert rows[fed_first:fed_second] == [[1, p] for p in range(fed_first, fed_second)]
    assert rows[fed_second:] == [[-1, -1]] * (tokens - 1 - fed_second)  # never fed: the trainer's router decides


def test_a_truncated_turn_ends_the_episodes_routing_record():
    engine = RoutingEngine([[1, 2, 3], [4, 5]], truncate_turn=1)
    (traj,) = asyncio.run(runner(engine, MergeCodec(), EchoEnv, kwargs={"turns": 2}).run_group(0, {"prompt": "xy"},
                                                                                                1))
    rows = _rows(traj)
    assert rows[:4] == [[0, p] for p in range(4)] and set(map(tuple, rows[4:])) == {(-1, -1)}
