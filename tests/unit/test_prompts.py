"""Prompts: a row becomes token ids in one place — chat messages, chat templates, system prompt, prompt
template, template kwargs, the BOS exactly once, a pre-rendered prompt templated once, and over-long prompts
(error / filter / truncate_left)."""

from __future__ import annotations

import logging
import string
from typing import Any

import pytest

from asyncrl.config.schema import Config, DataConfig, ModelConfig
from asyncrl.data.prompts import (
    OverlongPrompt,
    Prompt,
    PromptEncoder,
    check_prompts,
    plain_text_bos,
    screen_rows,
    template_markers,
)

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 ?.:\n=+[]"
BOS, EOS = 1, 2
# A Llama-style template: it writes the BOS itself, then one "[role]content" line per message.
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")


def make_tokenizer(*, chat_template: str | None = None, bos: bool = True, eos: bool = False) -> Any:
    """A char-level PreTrainedTokenizerFast built offline. `bos`: its post-processor puts <s> before plain
    text when asked for special tokens (as Llama's does); `eos`: it also appends </s>."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    single = " ".join([*(["<s>"] if bos else []), "$A", *(["</s>"] if eos else [])])
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", BOS), ("</s>", EOS)])
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="module")
def llama():
    return make_tokenizer(chat_template=BOS_TEMPLATE)


@pytest.fixture(scope="module")
def plain_llama():
    return make_tokenizer()


def chars(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


USER = [{"role": "user", "content": "what is 2+2?"}]


# -- messages and templates ------------------------------------------------------------------------------


def test_the_test_tokenizer_prepends_bos_like_llama(llama):
    assert llama.encode("ab", add_special_tokens=True) == [BOS, *chars(llama, "ab")]
    assert plain_text_bos(llama) == BOS


def test_chat_messages_are_rendered_with_the_template_and_its_generation_prompt(llama):
    prompt = PromptEncoder(llama, DataConfig(path="x")).encode({"prompt": USER})
    assert llama.decode(prompt.ids) == "<s>[user]what is 2+2?\n[assistant]"
    assert prompt.text == "what is 2+2?" and not prompt.truncated


def test_a_string_prompt_is_one_user_message_under_the_template(llama):
    prompt = PromptEncoder(llama, DataConfig(path="x")).encode({"prompt": "what is 2+2?"})
    assert llama.decode(prompt.ids) == "<s>[user]what is 2+2?\n[assistant]"


def test_bos_written_by_the_chat_template_is_not_doubled(llama):
    ids = PromptEncoder(llama, DataConfig(path="x")).encode({"prompt": USER}).ids
    assert ids[0] == BOS and ids.count(BOS) == 1
    # what add_special_tokens=True would have done to the rendered text
    text = llama.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert llama.encode(text, add_special_tokens=True)[:2] == [BOS, BOS]


def test_without_a_template_a_bos_expecting_model_gets_exactly_one_bos(plain_llama):
    encoder = PromptEncoder(plain_llama, DataConfig(path="x"))
    assert encoder.encode({"prompt": "ab"}).ids == [BOS, *chars(plain_llama, "ab")]
    assert encoder.encode({"prompt": "<s>ab"}).ids == [BOS, *chars(plain_llama, "ab")]  # already there: kept once


def test_chat_template_none_joins_the_message_contents_with_one_bos(llama):
    encoder = PromptEncoder(llama, DataConfig(path="x", chat_template="none", system_prompt="be brief"))
    prompt = encoder.encode({"prompt": USER})
    assert prompt.ids == [BOS, *chars(llama, "be brief\nwhat is 2+2?")]
    assert prompt.text == "be brief\nwhat is 2+2?"


def test_auto_without_a_template_joins_the_contents_too(plain_llama):
    messages = [{"role": "system", "content": "sys"}, *USER]
    prompt = PromptEncoder(plain_llama, DataConfig(path="x")).encode({"prompt": messages})
    assert plain_llama.decode(prompt.ids, skip_special_tokens=True) == "sys\nwhat is 2+2?"


def test_only_the_bos_of_a_tokenizer_that_also_appends_eos_is_added():
    tok = make_tokenizer(bos=True, eos=True)
    assert tok.encode("ab", add_special_tokens=True)[-1] == EOS
    assert PromptEncoder(tok, DataConfig(path="x")).encode({"prompt": "ab"}).ids == [BOS, *chars(tok, "ab")]


def test_a_template_without_bos_is_followed_and_warned_about_once(caplog):
    tok = make_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with caplog.at_level(logging.WARNING, logger="asyncrl.data.prompts"):
        encoder = PromptEncoder(tok, DataConfig(path="x"))
        first, second = encoder.encode({"prompt": "ab"}), encoder.encode({"prompt": "cd"})
    assert first.ids == chars(tok, "ab") and second.ids == chars(tok, "cd")
    assert caplog.text.count("does not begin with the BOS") == 1


def test_system_prompt_goes_first_and_a_rows_own_system_message_wins(llama):
    encoder = PromptEncoder(llama, DataConfig(path="x", system_prompt="be brief"))
    assert encoder.messages({"prompt": USER}) == [{"role": "system", "content": "be brief"}, *USER]
    own = [{"role": "system", "content": "mine"}, *USER]
    assert encoder.messages({"prompt": own}) == own
    assert llama.decode(encoder.encode({"prompt": "hi"}).ids) == "<s>[system]be brief\n[user]hi\n[assistant]"


def test_prompt_template_formats_row_fields_with_dotted_paths(llama):
    cfg = DataConfig(path="x", prompt_template="{question}\nAnswer with a number. ({extra_info.split})")
    encoder = PromptEncoder(llama, cfg)
    row = {"question": "what is 2+2?", "extra_info": {"split": "train"}}
    assert encoder.messages(row) == [{"role": "user", "content": "what is 2+2?\nAnswer with a number. (train)"}]


def test_chat_template_kwargs_reach_the_template():
    tok = make_tokenizer(chat_template="{{ bos_token }}{% if think %}think {% endif %}{{ messages[0]['content'] }}")
    assert tok.decode(PromptEncoder(tok, DataConfig(path="x")).encode({"prompt": "hi"}).ids) == "<s>hi"
    with_kwargs = PromptEncoder(tok, DataConfig(path="x", chat_template_kwargs={"think": True}))
    assert tok.decode(with_kwargs.encode({"prompt": "hi"}).ids) == "<s>think hi"


def test_a_failing_chat_template_is_one_line_naming_the_setting():
    tok = make_tokenizer(chat_template="{{ raise_exception('only user messages') }}")
    with pytest.raises(ValueError, match=r"^data\.chat_template: .*only user messages.*chat_template = 'none'"):
        PromptEncoder(tok, DataConfig(path="x")).encode({"prompt": "hi"})


def test_tiny_char_tokenizer_prompts_are_exactly_their_characters(tiny_model_dir):
    """The examples' tokenizer has no BOS behaviour and no template: prompts encode as before."""
    from engines.hf import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    assert plain_text_bos(tok) is None and not tok.chat_template
    prompt = PromptEncoder(tok, DataConfig(path="x")).encode({"prompt": "5382="})
    assert prompt == Prompt(tok.encode("5382=", add_special_tokens=False), "5382=")
    assert len(prompt.ids) == 5


# -- a prompt rendered upstream is templated once --------------------------------------------------------

# The chat templates of SmolLM2-135M-Instruct (ChatML, with its default system prompt) and of
# Llama-3-8B-Instruct, verbatim.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def chat_tokenizer(specials: list[str], template: str, *, bos: str, eos: str, bos_before_text: bool) -> Any:
    """A char-level PreTrainedTokenizerFast over printable ASCII with a real model's special tokens and chat
    template. `bos_before_text`: its post-processor puts the BOS before plain text (Llama 3's does, SmolLM2's
    does not)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*specials, "<unk>"])}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([*specials, "<unk>"])
    if bos_before_text:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="<unk>")
    hf.chat_template = template
    return hf


@pytest.fixture(scope="module")
def smollm2():
    return chat_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], SMOLLM2_TEMPLATE,
                          bos="<|im_start|>", eos="<|im_end|>", bos_before_text=False)


@pytest.fixture(scope="module")
def llama3():
    return chat_tokenizer(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>"], LLAMA3_TEMPLATE,
                          bos="<|begin_of_text|>", eos="<|eot_id|>", bos_before_text=True)


QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]


def rendered_once(tok: Any, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tok.encode(text, add_special_tokens=False)


def test_the_markers_are_the_special_tokens_the_template_itself_writes(smollm2, llama3):
    im_start = smollm2.convert_tokens_to_ids("<|im_start|>")
    assert template_markers(smollm2, {}) == (("<|im_start|>", "<|im_end|>"), im_start)
    markers, first = template_markers(llama3, {})
    assert markers == ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    assert first == llama3.bos_token_id == plain_text_bos(llama3)
    assert "<|endoftext|>" not in template_markers(smollm2, {})[0]  # special, but the template never writes it


def test_a_pre_rendered_smollm2_prompt_is_used_as_it_is_and_said_once(smollm2, caplog):
    text, ids = rendered_once(smollm2, QUESTION)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    with caplog.at_level(logging.INFO, logger="asyncrl.data.prompts"):
        encoder = PromptEncoder(smollm2, DataConfig(path="x"))
        prompts = [encoder.encode({"prompt": text}) for _ in range(3)]
        lengths = encoder.lengths([{"prompt": text}] * 2)
    assert [p.ids for p in prompts] == [ids] * 3 and lengths == [len(ids)] * 2
    assert encoder.encode({"prompt": QUESTION}).ids == ids  # the same as rendering the messages once
    assert prompts[0].text == text  # the reward function sees the row's string as it is
    assert caplog.text.count("not templated again") == 1 and "'<|im_start|>'" in caplog.text
    assert "system_prompt" not in caplog.text


def test_a_plain_string_is_still_templated_and_nothing_is_said(smollm2, llama3, caplog):
    with caplog.at_level(logging.INFO, logger="asyncrl.data.prompts"):
        for tok in (smollm2, llama3):
            prompt = PromptEncoder(tok, DataConfig(path="x")).encode({"prompt": "What is 17 + 25?"})
            assert prompt.ids == rendered_once(tok, QUESTION)[1] and prompt.text == "What is 17 + 25?"
    assert caplog.text == ""


def test_a_pre_rendered_llama3_prompt_has_one_bos_with_or_without_its_own(llama3, caplog):
    text, ids = rendered_once(llama3, QUESTION)
    bos = llama3.bos_token_id
    assert text.startswith("<|begin_of_text|><|start_header_id|>user") and ids.count(bos) == 1
    encoder = PromptEncoder(llama3, DataConfig(path="x", system_prompt="Be brief."))
    with caplog.at_level(logging.INFO, logger="asyncrl.data.prompts"):
        assert encoder.encode({"prompt": text}).ids == ids
        stripped = text.removeprefix("<|begin_of_text|>")  # a pipeline that left the BOS to the tokenizer
        assert encoder.encode({"prompt": stripped}).ids == ids
    assert caplog.text.count("not templated again") == 1
    assert "data.system_prompt is not added" in caplog.text  # the row's own rendering wins
    with_system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert encoder.encode({"prompt": "What is 17 + 25?"}).ids == rendered_once(llama3, with_system)[1]


def test_chat_messages_are_rendered_even_when_they_hold_markers_and_none_keeps_a_string_as_it_is(llama3):
    text, ids = rendered_once(llama3, QUESTION)
    nested = PromptEncoder(llama3, DataConfig(path="x")).encode({"prompt": [{"role": "user", "content": text}]})
    assert nested.ids.count(llama3.convert_tokens_to_ids("<|start_header_id|>")) == 4  # rendered around it
    none = PromptEncoder(llama3, DataConfig(path="x", chat_template="none"))
    assert none.encode({"prompt": text}).ids == ids  # exactly itself, its BOS not doubled


# -- over-long prompts ----------------------------------------------------------------------------------


ROWS = [{"prompt": "a" * n} for n in (3, 9, 4, 12)]


def test_overlong_error_names_the_rows_and_their_lengths(plain_llama):
    encoder = PromptEncoder(plain_llama, DataConfig(path="x", max_prompt_len=8))
    with pytest.raises(OverlongPrompt) as exc:
        screen_rows(ROWS, encoder)
    message = str(exc.value)
    assert message.startswith("data.max_prompt_len: train row 2 (10 tokens), row 4 (13 tokens): prompt longer "
                              "than 8 tokens")  # the BOS counts
    assert "data.overlong = 'filter'" in message and "\n" not in message
    with pytest.raises(OverlongPrompt):
        encoder.encode(ROWS[1])


def test_overlong_filter_leaves_the_rows_out_and_counts_them(plain_llama, caplog):
    encoder = PromptEncoder(plain_llama, DataConfig(path="x", max_prompt_len=8, overlong="filter"))
    with caplog.at_level(logging.WARNING, logger="asyncrl.data.prompts"):
        kept, dropped = screen_rows(ROWS, encoder)
    assert kept == [ROWS[0], ROWS[2]] and dropped == 2
    assert "left out 2 of 4 train rows" in caplog.text


def test_overlong_filter_that_leaves_nothing_is_an_error(plain_llama):
    encoder = PromptEncoder(plain_llama, DataConfig(path="x", max_prompt_len=2, overlong="filter"))
    with pytest.raises(OverlongPrompt, match="every train prompt is longer than 2 tokens"):
        screen_rows(ROWS, encoder)


def test_overlong_truncate_left_keeps_the_bos_and_the_end_of_the_question(plain_llama):
    encoder = PromptEncoder(plain_llama, DataConfig(path="x", max_prompt_len=5, overlong="truncate_left"))
    assert screen_rows(ROWS, encoder) == (ROWS, 0)
    prompt = encoder.encode({"prompt": "abcdefgh"})
    assert prompt.ids == [BOS, *chars(plain_llama, "efgh")] and prompt.truncated
    assert prompt.text == "abcdefgh"  # the reward function sees the whole prompt
    assert not encoder.encode({"prompt": "abcd"}).truncated


def test_prompts_that_fit_are_untouched_in_every_mode(plain_llama):
    for mode in ("error", "filter", "truncate_left"):
        encoder = PromptEncoder(plain_llama, DataConfig(path="x", max_prompt_len=13, overlong=mode))
        assert screen_rows(ROWS, encoder) == (ROWS, 0)


def _config(tmp_path, **data: Any) -> Config:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"prompt": "{r["prompt"]}"}}\n' for r in ROWS))
    return Config(model=ModelConfig(path=str(tmp_path / "model")), data=DataConfig(path=str(path), **data))


def test_check_prompts_reports_overlong_rows_before_a_run(tmp_path, plain_llama):
    errors = check_prompts(_config(tmp_path, max_prompt_len=8), plain_llama)
    assert len(errors) == 2 and all("row 2 (10 tokens)" in e for e in errors)  # train, then the eval fallback
    assert errors[0].startswith("data.max_prompt_len: train") and errors[1].startswith("data.max_prompt_len: eval")
    assert check_prompts(_config(tmp_path, max_prompt_len=8, overlong="filter"), plain_llama) == []
    assert check_prompts(_config(tmp_path, max_prompt_len=8), None) == []  # no tokenizer in model.path yet


def test_asyncrl_validate_names_overlong_rows_with_the_models_tokenizer(tiny_config_file, capsys):
    from asyncrl.cli import main

    assert main(["validate", str(tiny_config_file)]) == 0
    assert main(["validate", str(tiny_config_file), "--set", "data.max_prompt_len=4"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("config error: data.max_prompt_len: train row 1 (5 tokens), row 2 (5 tokens), "
                             "row 3 (5 tokens) and 3997 more: prompt longer than 4 tokens")
    assert main(["validate", str(tiny_config_file), "--set", "data.max_prompt_len=4",
                 "--set", 'data.overlong="truncate_left"']) == 0


def test_env_episodes_without_a_template_start_with_one_bos_too(plain_llama, tiny_model_dir):
    from asyncrl.envs.transcript import HFCodec, Transcript
    from engines.hf import load_tokenizer

    assert Transcript(HFCodec(plain_llama), "none").start("ab") == [BOS, *chars(plain_llama, "ab")]
    assert HFCodec(plain_llama).encode_prompt("<s>ab") == [BOS, *chars(plain_llama, "ab")]
    tiny = load_tokenizer(tiny_model_dir)  # no BOS behaviour: episodes start exactly as before
    assert Transcript(HFCodec(tiny), "none").start("5=") == tiny.encode("5=", add_special_tokens=False)


def test_decode_many_is_the_same_as_decoding_each(tiny_model_dir):
    import random

    from asyncrl.deploy.build import tokenizer_fns

    tok, decode = tokenizer_fns(str(tiny_model_dir))
    assert hasattr(decode, "many")  # a fast tokenizer without the clean-up pass: one Rust call for the batch
    rng = random.Random(0)
    seqs = [[rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))] for _ in range(64)]  # specials too
    assert decode.many(seqs) == [decode(s) for s in seqs]
