"""Tool calls as instruct models emit them: JSON schemas from signatures and docstrings, the call formats'
parsers, the tool set's error answers, and episodes in which a scripted model calls tools through a
Hermes-style chat template (a real HF tokenizer, built offline)."""

from __future__ import annotations

import asyncio
import json
import string
import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncrl.envs.base import check_env, resolve_env
from asyncrl.envs.runner import EpisodeLimits, EpisodeRunner
from asyncrl.envs.tool_env import ToolUse
from asyncrl.envs.tool_parsers import ToolCall, make_parser
from asyncrl.envs.tool_schema import Tool, ToolSet, tool_schema
from asyncrl.envs.transcript import HFCodec, Transcript, resolve_format
from asyncrl.messages import Completion, SamplingParams


def run(coro):
    return asyncio.run(coro)


# -- schemas ---------------------------------------------------------------------------------------------

def lookup(city: str, days: int = 1, units: list[str] | None = None, exact: bool = False) -> dict:
    """Look up the weather of a city.

    Args:
        city: The city's name.
        days: How many days ahead.
        units: Units to report in.
        exact: Whether to match the name exactly.
    """
    return {"city": city, "days": days}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def test_schema_from_signature_and_docstring_is_the_openai_function_format():
    assert tool_schema(lookup) == {"type": "function", "function": {
        "name": "lookup", "description": "Look up the weather of a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's name."},
            "days": {"type": "integer", "description": "How many days ahead."},
            "units": {"type": "array", "items": {"type": "string"}, "nullable": True,
                      "description": "Units to report in."},
            "exact": {"type": "boolean", "description": "Whether to match the name exactly."}},
            "required": ["city"]}}}
    calc, py = ToolSet(["calculator", "python"]).schemas
    assert calc["function"]["name"] == "calculator" and calc["function"]["parameters"]["required"] == ["expression"]
    assert py["function"]["name"] == "python" and list(py["function"]["parameters"]["properties"]) == ["code"]


def test_a_tool_without_hints_or_docstring_is_refused_in_one_line():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="tool 'bare': no JSON schema .* Google-style docstring") as err:
        Tool(bare)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        ToolSet(["shell"])


# -- parsers ---------------------------------------------------------------------------------------------

def test_hermes_reads_several_calls_and_the_content_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    turn = make_parser("hermes").parse(text)
    assert turn.content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("calculator", {"expression": "6*7"}, ""), ("lookup", {"city": "Oslo"}, "")]
    assert turn.calls[0].id.startswith("call_") and turn.calls[0].id != turn.calls[1].id
    assert make_parser("hermes").parse("The answer is 42.").calls == []
    # a block the model did not close (it ran out of tokens) is read to the end of the turn
    open_block = make_parser("hermes").parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}')
    assert [(c.name, c.arguments) for c in open_block.calls] == [("calculator", {"expression": "1"})]


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator", "arguments": {"expression": "1"', "not valid JSON"),
    ('{"arguments": {}}', 'needs a "name"'),
    ('["calculator"]', "must be a JSON object"),
    ('{"name": "calculator", "arguments": [1]}', '"arguments" of calculator must be a JSON object'),
])
def test_hermes_keeps_an_unreadable_call_as_a_call_that_carries_its_error(body, error):
    calls = make_parser("hermes").parse(f"<tool_call>{body}</tool_call> and <tool_call>{body}</tool_call>").calls
    assert len(calls) == 2 and all(error in c.error for c in calls)


def test_json_format_reads_a_whole_turn_object_or_list_and_leaves_answers_alone():
    p = make_parser("json")
    assert [(c.name, c.arguments) for c in p.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}').calls] \
        == [("f", {"a": 1})]
    fenced = p.parse('```json\n[{"name": "f", "arguments": {}}, {"name": "g"}]\n```')
    assert [c.name for c in fenced.calls] == ["f", "g"] and fenced.content == ""
    assert p.parse('{"answer": 42}').calls == [] and p.parse('{"answer": 42}').content == '{"answer": 42}'
    assert p.parse("42").content == "42"
    assert "not valid JSON" in p.parse('{"name": "f", "arguments": {').calls[0].error


def test_name_args_fills_the_tools_one_required_parameter():
    p = make_parser("name_args", ToolSet(["calculator"]).schemas)
    assert [(c.name, c.arguments) for c in p.parse("calculator:2+3").calls] == [("calculator", {"expression": "2+3"})]
    assert p.parse("nosuch:1").calls == [] and p.parse("56").content == "56"
    assert p.format_call(ToolCall("calculator", {"expression": "7*8"})) == "calculator:7*8"
    assert make_parser("name_args", [tool_schema(lookup)]).parse("lookup:Oslo").calls[0].arguments == {"city": "Oslo"}
    with pytest.raises(ValueError, match="tool 'add' takes 2 required parameters; NAME:ARGS can fill exactly one"):
        make_parser("name_args", [tool_schema(add)])
    with pytest.raises(ValueError, match="unknown tool-call format 'xml' — one of hermes, json, name_args"):
        make_parser("xml")


def test_format_call_round_trips_through_parse():
    call = ToolCall("calculator", {"expression": "6*7"})
    for name in ("hermes", "json"):
        p = make_parser(name)
        back = p.parse(p.format_call(call)).calls
        assert [(c.name, c.arguments) for c in back] == [("calculator", {"expression": "6*7"})]


# -- the tool set's answers --------------------------------------------------------------------------------

async def boom(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("tool broke\nsecond line")


async def hang(x: int) -> str:
    """Never returns.

    Args:
        x: Anything.
    """
    await asyncio.sleep(60)
    return ""


def slow_sync(x: int) -> str:
    """Blocks its thread a while.

    Args:
        x: Seconds to sleep.
    """
    time.sleep(x)
    return "late"


def opaque(x: int) -> object:
    """Returns something that is not JSON.

    Args:
        x: Anything.
    """
    return object()


def test_every_failure_is_answered_with_an_error_tool_message_and_counted():
    tools = ToolSet(["calculator", lookup, boom, hang, slow_sync, opaque], timeout_s=0.2)

    def answer(name: str, args: dict, error: str = "") -> str:
        return run(tools.call(ToolCall(name, args, id="c1", error=error))).content

    assert answer("calculator", {"expression": "6*7"}) == "42"
    assert json.loads(answer("lookup", {"city": "Oslo", "days": 2})) == {"city": "Oslo", "days": 2}
    assert answer("lookup", {"city": "Oslo", "units": None}) != ""  # X | None accepts null
    assert answer("", {}, error="the <tool_call> block is not valid JSON") == \
        "error: the <tool_call> block is not valid JSON"
    assert answer("search", {}).startswith("error: unknown tool 'search'; tools: calculator, lookup")
    assert answer("lookup", {}) == "error: lookup: invalid arguments: 'city' is a required property"
    assert answer("lookup", {"city": "Oslo", "when": 1}).startswith("error: lookup: invalid arguments: Additional")
    assert answer("lookup", {"city": "Oslo", "days": "two"}) == \
        "error: lookup: invalid arguments: days: 'two' is not of type 'integer'"
    assert answer("boom", {"x": 1}) == "error: RuntimeError: tool broke"
    assert answer("hang", {"x": 1}) == "error: hang timed out after 0.2s"
    assert answer("slow_sync", {"x": 1}) == "error: slow_sync timed out after 0.2s"
    assert answer("opaque", {"x": 1}) == "error: opaque returned object, not text or JSON"
    assert answer("calculator", {"expression": "1/0"}) == "error: ValueError: division by zero"
    assert (tools.calls, tools.errors) == (13, 10)
    result = run(tools.call(ToolCall("calculator", {"expression": "2"}, id="call_9")))
    assert result.message == {"role": "tool", "name": "calculator", "content": "2", "tool_call_id": "call_9"}


def test_the_python_tool_runs_code_from_its_json_arguments_and_named_tools_are_built_once_per_process():
    first, second = ToolSet(["python"]), ToolSet(["python"])
    assert first.tools["python"] is second.tools["python"]  # episodes share it: no namespace probe per episode
    out = run(first.call(ToolCall("python", {"code": "print(6*7)"})))
    assert (out.content.strip(), out.error) == ("42", False)
    out = run(first.call(ToolCall("python", {"code": "1/0"})))
    assert out.error and "ZeroDivisionError" in out.content and first.errors == 1


def test_a_slow_sync_tool_does_not_stall_other_episodes_on_the_loop():
    tools = ToolSet([slow_sync], timeout_s=5)
    order: list[str] = []

    async def other() -> None:
        await asyncio.sleep(0.05)
        order.append("other episode")

    async def main() -> None:
        async def call() -> None:
            await tools.call(ToolCall("slow_sync", {"x": 1}))
            order.append("tool")

        await asyncio.gather(call(), other())

    run(main())
    assert order == ["other episode", "tool"]


# -- episodes through a Hermes-style chat template -------------------------------------------------------

HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A ChatML template that ignores `tools` and renders any role (SmolLM2-Instruct's has this shape).
CHATML_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                   "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_tokenizer(template: str):
    """A byte-level tokenizer over printable ASCII with ChatML's special tokens and `template` (offline)."""
    from engines.hf import build_char_tokenizer

    tok = build_char_tokenizer(string.printable)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    return tok


class ScriptedChatModel:
    """Returns the scripted turns (text + <|im_end|>) in order; records every context it was given."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tok, self.turns = tok, list(turns)
        self.contexts: list[list[int]] = []
        self.version = 0
        self.eos_token_ids = [tok.eos_token_id]

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.contexts.append(list(prompts[0]))
        ids = self.tok.encode(self.turns.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        return [[Completion(prompt_ids=prompts[0], response_ids=ids, logprobs=[-0.1] * len(ids),
                            versions=[0] * len(ids), finish_reason="stop")]]


def episode(tok, turns: list[str], kwargs: dict[str, Any], row: dict[str, Any], fmt: str = "auto"):
    engine = ScriptedChatModel(tok, turns)
    codec = HFCodec(tok)
    runner = EpisodeRunner(engine=engine, env_cls=resolve_env("tools"), env_kwargs=kwargs, codec=codec,
                           fmt=resolve_format(codec, fmt), sampling=SamplingParams(max_new_tokens=200),
                           limits=EpisodeLimits(max_turns=6, max_episode_tokens=2000),
                           stop_ids=frozenset([tok.eos_token_id]))
    traj = run(runner.run_group(0, row, 1))[0]
    return traj, engine, codec


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def test_a_hermes_call_runs_the_tool_and_its_result_is_appended_untrained_through_the_template():
    tok = chat_tokenizer(HERMES_TEMPLATE)
    traj, engine, codec = episode(tok, [CALL, "42"], {"tools": ["calculator"]}, {"prompt": "What is 6*7?",
                                                                                    "answer": "42"})
    schemas = ToolSet(["calculator"]).schemas
    prompt = codec.decode_raw(traj.prompt_ids)
    assert prompt == codec.render([{"role": "user", "content": "What is 6*7?"}], True, tools=schemas)
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in prompt
    # the second turn's context is exactly the whole conversation re-rendered: earlier tokens never changed
    messages = [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "name": "calculator", "content": "42"}]
    second = engine.contexts[1]
    assert second == tok.encode(codec.render(messages, True, tools=schemas), add_special_tokens=False)
    assert codec.decode_raw(second).endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    call_ids = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    tool_ids = second[len(traj.prompt_ids) + len(call_ids):]
    answer_ids = tok.encode("42", add_special_tokens=False) + [tok.eos_token_id]
    assert traj.response_ids == call_ids + tool_ids + answer_ids
    assert traj.loss_mask == [True] * len(call_ids) + [False] * len(tool_ids) + [True] * len(answer_ids)
    assert (traj.env_reward, traj.turns, traj.tool_calls, traj.tool_errors, traj.env_error) == (1.0, 2, 1, 0, "")


def test_unreadable_unknown_and_invalid_calls_are_answered_as_tool_messages_and_the_episode_goes_on():
    tok = chat_tokenizer(HERMES_TEMPLATE)
    bad = ('<tool_call>{"name": "calculator", "arguments": {</tool_call>'
           '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
           '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>')
    traj, engine, codec = episode(tok, [bad, CALL, "42"], {"tools": ["calculator"], "tool_bonus": 0.5},
                                  {"prompt": "6*7?", "answer": "42"})
    after_bad = codec.decode_raw(engine.contexts[1])
    responses = [r.split("\n</tool_response>")[0] for r in after_bad.split("<tool_response>\n")[1:]]
    assert responses[0].startswith("error: the <tool_call> block is not valid JSON (Expecting property name")
    assert responses[1:] == ["error: unknown tool 'search'; tools: calculator",
                             "error: calculator: invalid arguments: 'expression' is a required property"]
    assert after_bad.count("<|im_start|>user") == 2  # the three results form one user turn, as in Qwen2.5
    assert (traj.turns, traj.tool_calls, traj.tool_errors, traj.env_reward) == (3, 4, 3, 1.5)


def test_after_max_calls_a_turn_with_calls_is_the_final_answer():
    tok = chat_tokenizer(HERMES_TEMPLATE)
    traj, _, _ = episode(tok, [CALL, CALL, "42"], {"tools": ["calculator"], "max_calls": 1},
                         {"prompt": "6*7?", "answer": "42"})
    assert (traj.turns, traj.tool_calls, traj.env_reward) == (2, 1, 0.0)


def test_a_template_that_ignores_tools_gets_them_described_in_the_system_message():
    tok = chat_tokenizer(CHATML_TEMPLATE)
    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}],
           "answer": "42"}
    traj, engine, codec = episode(tok, [CALL, "42"], {"tools": ["calculator"]}, row)
    prompt = codec.decode_raw(traj.prompt_ids)
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '"name": "calculator"' in prompt and prompt.endswith("</tool_call>\n\nBe brief.<|im_end|>\n"
                                                                 "<|im_start|>user\n6*7?<|im_end|>\n"
                                                                 "<|im_start|>assistant\n")
    assert codec.decode_raw(engine.contexts[1]).endswith(
        "</tool_call><|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert traj.env_reward == 1.0 and traj.prompt_text == codec.decode(traj.prompt_ids)


def test_name_args_tools_env_without_a_template_appends_plain_results():
    from engines.hf import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+-*=:abcdefghijklmnopqrstuvwxyz")
    traj, engine, codec = episode(tok, ["calculator:6*7", "42"], {"tools": ["calculator"], "parser": "name_args"},
                                  {"prompt": "6*7", "answer": "42"}, fmt="none")
    assert codec.decode_raw(engine.contexts[1]) == "6*7calculator:6*7<eos>42"
    assert (traj.env_reward, traj.tool_calls) == (1.0, 1)


def test_tools_env_config_is_validated_in_one_line_per_mistake():
    assert check_env("tools", {"tools": ["calculator", "python"], "parser": "hermes"}) == []
    assert check_env("tools", {"tools": ["calculator"], "parser": "json", "reward": "contains"}) == []
    for kwargs, wrong in [({"tools": ["shell"]}, "unknown tool 'shell'"),
                          ({"tools": "calculator"}, "write ['calculator']"),
                          ({"parser": "xml"}, "unknown tool-call format 'xml'"),
                          ({"reward": "nope"}, "unknown reward rule 'nope'"),
                          ({"tools": ["asyncrl.envs.tools:nothing"]}, "has no attribute"),
                          ({"parser": "name_args", "tools": ["tests.unit.test_tool_calls:add"]}, "NAME:ARGS")]:
        errors = check_env("tools", kwargs)
        assert len(errors) == 1 and wrong in errors[0] and errors[0].startswith("env.kwargs:"), errors


def test_tools_env_section_loads_from_toml_and_a_wrong_tool_is_one_config_line(make_config):
    from asyncrl.config import ConfigError

    cfg = make_config('env.env="tools"', 'env.kwargs={tools=["calculator", "python"], parser="hermes"}',
                      "data.max_prompt_len=128")
    assert cfg.env.kwargs == {"tools": ["calculator", "python"], "parser": "hermes"}
    with pytest.raises(ConfigError) as info:
        make_config('env.env="tools"', 'env.kwargs={tools=["shell"]}', "data.max_prompt_len=128")
    (line,) = info.value.errors
    assert line.startswith("env.kwargs: 'tools' cannot be built") and "unknown tool 'shell'" in line


def test_strict_transcript_keeps_tool_messages_prefix_stable_over_turns():
    tok = chat_tokenizer(HERMES_TEMPLATE)
    codec = HFCodec(tok)
    use = ToolUse(["calculator"])
    t = Transcript(codec, "strict", stop_ids=frozenset([tok.eos_token_id]))
    t.start("q", tools=use.schemas, tools_prompt=use.prompt)
    two_calls = CALL + "\n" + CALL.replace("6*7", "1+1")
    for text in (two_calls, CALL):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        t.add_model_turn(ids, [0.0] * len(ids), [0] * len(ids))
        turn = run(use.respond(codec.decode(ids)))
        t.add_observation(turn.messages, t.observation_ids(turn.messages), 0)
        assert [m["content"] for m in turn.messages] == (["42", "2"] if text == two_calls else ["42"])
        full = tok.encode(codec.render(t.messages, True, tools=use.schemas), add_special_tokens=False)
        assert t.prompt_ids + t.response_ids == full


def test_runtime_episodes_call_tools_and_report_them_in_the_trajectory():
    from asyncrl.runtime import AgentEpisode

    tok = chat_tokenizer(HERMES_TEMPLATE)
    codec = HFCodec(tok)
    model = ScriptedChatModel(tok, [CALL, "42"])

    async def generate(context, **sampling):
        return (await model.generate([context], SamplingParams()))[0][0]

    rt = SimpleNamespace(codec=codec, chat_format="strict", stop_ids=frozenset([tok.eos_token_id]), version=0,
                         generate=generate, sampling=lambda **kw: SamplingParams(temperature=1.0))
    ep = AgentEpisode(rt, "6*7?", ToolUse(["calculator"], "hermes"))

    async def play() -> list[int]:
        calls = []
        while True:
            turn = await ep.call_tools(await ep.act())
            calls.append(len(turn.calls))
            if not turn.calls:
                return calls

    assert run(play()) == [1, 0]
    traj = ep.to_trajectory()
    assert (traj.turns, traj.tool_calls, traj.tool_errors) == (2, 1, 0)
    assert codec.decode_raw(model.contexts[1]).endswith("<tool_response>\n42\n</tool_response><|im_end|>\n"
                                                        "<|im_start|>assistant\n")
