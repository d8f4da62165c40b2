"""The OpenAI endpoint's recording without an engine: how a continued chat request is encoded (the sampled
ids kept, the template's closer and the new messages appended), when a request starts a trajectory of its
own, and how an episode's turns become trajectories."""

from __future__ import annotations

import pytest

from asyncrl.envs.transcript import HFCodec
from asyncrl.serve.chat import ChatRenderer, check_messages, template_messages
from asyncrl.serve.recording import ServedEpisode, Turn, message_key

# user turns "1<content><eos>=", assistant turns "2<content><eos>=", generation prompt "2": append-only.
TEMPLATE = ("{% for m in messages %}{{ '1' if m['role'] == 'user' else '2' }}{{ m['content'] }}<eos>="
            "{% endfor %}{% if add_generation_prompt %}2{% endif %}")
# repeats the number of messages in front: every rendering changes the start, nothing is append-only
COUNTED = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture
def codec(tiny_model_dir):
    from engines.hf import load_tokenizer

    return HFCodec(load_tokenizer(tiny_model_dir))


class _Server:
    def forget(self, episode_id: str) -> None:
        pass

    def decode(self, ids: list[int]) -> str:
        return ""


def _turn(prompt: list[int], response: list[int], *, temperature: float = 1.0, parent: Turn | None = None,
          new: list[int] | None = None, version: int = 0, **kw) -> Turn:
    return Turn(prompt_ids=prompt, response_ids=response, logprobs=[-0.5] * len(response),
                versions=[version] * len(response), finish_reason="stop", temperature=temperature, text="",
                parent=parent, new_ids=new or [], new_version=version, **kw)


def test_a_continued_chat_keeps_the_sampled_ids_and_appends_the_closer_minus_a_sampled_eos(codec):
    eos = codec.tok.eos_token_id
    chat = ChatRenderer(codec, frozenset([eos]), TEMPLATE)
    first = [{"role": "user", "content": "5"}]
    prompt = chat.fresh(first, None)
    assert codec.decode_raw(prompt) == "15<eos>=2"
    nxt = [*first, {"role": "assistant", "content": "7"}, {"role": "user", "content": "+"}]

    with_eos = _turn(prompt, codec.encode("7") + [eos], messages=first)
    with_eos.text = "7"
    new = chat.extension(with_eos, nxt, None)
    assert codec.decode_raw(with_eos.context + new) == "15<eos>=27<eos>=1+<eos>=2"  # one <eos>: the sampled one

    cut = _turn(prompt, codec.encode("7"), messages=first)  # ended by max_tokens: the template's <eos> is added
    cut.text = "7"
    assert codec.decode_raw(cut.context + chat.extension(cut, nxt, None)) == "15<eos>=27<eos>=1+<eos>=2"


def test_a_template_that_rewrites_earlier_turns_gives_no_extension(codec):
    chat = ChatRenderer(codec, frozenset(), COUNTED)
    first = [{"role": "user", "content": "5"}]
    t = _turn(chat.fresh(first, None), codec.encode("7"), messages=first)
    t.text = "7"
    assert chat.extension(t, [*first, t.reply(), {"role": "user", "content": "+"}], None) is None


def test_a_tokenizer_without_a_chat_template_refuses_chat_with_one_line(codec):
    chat = ChatRenderer(codec, frozenset())
    with pytest.raises(ValueError, match="no chat template: start the server with chat_template=... or use "
                                         "/v1/completions"):
        chat.fresh([{"role": "user", "content": "5"}], None)


def test_chat_messages_are_checked_and_matched_on_role_content_and_tool_calls():
    for bad, why in [([], "at least one message"), ([{"role": "robot", "content": "x"}], "messages\\[0\\].role"),
                     ([{"role": "user", "content": [{"type": "image_url"}]}], "'image_url' is not supported")]:
        with pytest.raises(ValueError, match=why):
            check_messages(bad)
    sdk = {"role": "assistant", "content": "7", "refusal": None, "tool_calls": None, "audio": None}
    assert message_key(sdk) == message_key({"role": "assistant", "content": "7"})
    assert template_messages([sdk]) == [{"role": "assistant", "content": "7"}]
    parts = {"role": "user", "content": [{"type": "text", "text": "1"}, {"type": "text", "text": "2"}]}
    assert template_messages([parts])[0]["content"] == "12"


def test_an_episode_continued_twice_gives_one_trajectory_with_the_new_context_masked():
    ep = ServedEpisode(_Server(), "e", "http://x")
    a = _turn([1, 2], [3, 4], version=0)
    b = _turn([1, 2, 3, 4, 9], [5], parent=a, new=[9], version=1)
    ep.record(a)
    ep.record(b)
    ep.reward = 0.5
    [t] = ep.to_trajectories()
    assert t.prompt_ids == [1, 2] and t.response_ids == [3, 4, 9, 5]
    assert t.loss_mask == [True, True, False, True] and t.behavior_logprobs == [-0.5, -0.5, 0.0, -0.5]
    assert t.versions == [0, 0, 1, 1] and (t.min_version, t.max_version) == (0, 1)
    assert t.env_reward == 0.5 and t.turns == 2


def test_rewritten_history_branches_and_greedy_turns_make_separate_or_no_trajectories():
    ep = ServedEpisode(_Server(), "e", "http://x")
    root = _turn([1], [2])
    left = _turn([1, 2, 7], [3], parent=root, new=[7])
    right = _turn([1, 2, 8], [4], parent=root, new=[8])   # n=2 choices both taken further
    rewritten = _turn([6, 6], [5])                         # continues nothing: a trajectory of its own
    greedy = _turn([6, 6, 5, 1], [2], temperature=0.0)     # answered, never trained
    for t in (root, left, right, rewritten, greedy):
        ep.record(t)
    with pytest.raises(ValueError, match="set ep.reward"):
        ep.to_trajectories()
    ep.reward = 1.0
    trajs = ep.to_trajectories()
    assert [t.prompt_ids + t.response_ids for t in trajs] == [[1, 2, 7, 3], [1, 2, 8, 4], [6, 6, 5]]
    assert [t.loss_mask for t in trajs] == [[True, False, True], [True, False, True], [True]]
    only_greedy = ServedEpisode(_Server(), "g", "http://x")
    only_greedy.record(_turn([1], [2], temperature=0.0))
    only_greedy.reward = 1.0
    with pytest.raises(ValueError, match="no sampled completion to train on .*1 of them greedy"):
        only_greedy.to_trajectories()


TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]
HERMES = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


def test_a_reply_with_a_hermes_tool_call_returns_openai_tool_calls_and_keeps_the_model_text_in_the_context():
    from asyncrl.serve.openai_server import _finish, parse_tool_calls

    t = _turn([1, 2], [3, 4, 5])
    t.text = HERMES
    assert parse_tool_calls(t, TOOLS, "hermes") == 1
    reply = t.reply()
    assert reply["content"] == "Let me compute." and _finish(t) == "tool_calls"
    (call,) = reply["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calculator" and call["function"]["arguments"] == '{"expression": "2+3"}'
    assert t.raw_reply() == {"role": "assistant", "content": HERMES}  # what the context holds

    broken = _turn([1, 2], [3])
    broken.text = '<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>'
    assert parse_tool_calls(broken, TOOLS, "hermes") == 0  # unreadable: the client gets the text as written
    assert broken.reply() == {"role": "assistant", "content": broken.text} and _finish(broken) == "stop"
    plain = _turn([1, 2], [3])
    plain.text = "5"
    assert parse_tool_calls(plain, TOOLS, "hermes") == 0 and plain.reply()["content"] == "5"


def test_a_request_echoing_the_tool_calls_as_an_sdk_sends_them_continues_the_turn_rendered_as_written(codec):
    eos = codec.tok.eos_token_id
    chat = ChatRenderer(codec, frozenset([eos]), TEMPLATE)
    first = [{"role": "user", "content": "5"}]
    t = _turn(chat.fresh(first, None), codec.encode("7") + [eos], messages=first, tools_key="k")
    t.text = "7"  # the model's own text (here a stand-in the tiny vocabulary can spell) ...
    t.content, t.tool_calls = "", [{"id": "call_1", "type": "function",
                                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]
    ep = ServedEpisode(_Server(), "e", "http://x")
    ep.record(t)
    # ... echoed back by an SDK: extra null fields, an index, the arguments re-serialised
    echoed = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression":"2+3"}'}}]}
    nxt = template_messages([*first, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "5"}])
    assert ep.parent_for_chat(nxt, "k") is t
    other = dict(echoed, tool_calls=[{"id": "call_2", "function": {"name": "calculator", "arguments": "{}"}}])
    assert ep.parent_for_chat(template_messages([*first, other, nxt[-1]]), "k") is None
    new = chat.extension(t, nxt, None)
    # the assistant turn is rendered as the model wrote it (not the template's rendering of tool_calls)
    assert codec.decode_raw(t.context + new) == "15<eos>=27<eos>=25<eos>=2"
