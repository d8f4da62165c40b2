"""engines.hf: the tiny offline model folder loads through the real HF Auto* path, and ensure_model
builds it once, safely, or says clearly what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config.schema import ModelConfig, TinyModelConfig
from engines import hf

torch.set_num_threads(1)

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    hf.build_tiny_model(path, TINY)
    return path


@pytest.mark.parametrize("text", ["12+3=15", "a , b ,c", "  leading and trailing  ", "x*y-z=?", " "])
def test_tokenizer_round_trips_text_exactly(model_dir, text):
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_llama_folder_tokenizes_like_the_qwen2_folder(model_dir, tmp_path):
    """transformers 5.x loads a qwen2 folder's tokenizer as Qwen2Tokenizer, a llama one as-is: same ids."""
    hf.build_tiny_model(tmp_path, TinyModelConfig(**{**_fields(TINY), "arch": "llama"}))
    text = "a , b= 12?"
    assert hf.load_tokenizer(tmp_path).encode(text) == hf.load_tokenizer(model_dir).encode(text)


def test_generic_tokenizer_types_are_the_ones_autotokenizer_loads_with_the_generic_backend():
    """engines.hf.GENERIC_TOKENIZER_TYPES against the installed transformers' registry: none of them gets the model's
    registered class instead of the hub's (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) or Mistral's backend."""
    from transformers.models.auto import tokenization_auto

    assert not hf.GENERIC_TOKENIZER_TYPES & tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert all(tokenization_auto.TOKENIZER_MAPPING_NAMES.get(t) != "MistralCommonBackend"
               for t in hf.GENERIC_TOKENIZER_TYPES)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_tokenizer_gives_what_autotokenizer_gives(arch, tmp_path):
    """The direct load of a generic tokenizer (a llama folder) and AutoTokenizer's (a qwen2 folder: transformers
    gives it Qwen2Tokenizer) give AutoTokenizer's class, ids, specials and chat rendering."""
    hf.build_tiny_model(tmp_path, TinyModelConfig(**{**_fields(TINY), "arch": arch}))
    assert hf.generic_tokenizer(tmp_path) == (arch == "llama")
    ours, auto = hf.load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(ours) is type(auto)
    text = "a , b= 12?"
    assert ours.encode(text) == auto.encode(text) and ours(text)["input_ids"] == auto(text)["input_ids"]
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id, ours.padding_side) == \
        (auto.eos_token_id, auto.pad_token_id, auto.bos_token_id, auto.padding_side)
    assert ours.init_kwargs == auto.init_kwargs


def test_load_tokenizer_leaves_a_custom_or_specific_tokenizer_to_autotokenizer(model_dir, tmp_path):
    import json
    import shutil

    for change in ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, {"tokenizer_class": "GPT2Tokenizer"}):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(model_dir, folder)
        (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                        "model_type": "llama"}))
        tok_cfg = folder / "tokenizer_config.json"
        tok_cfg.write_text(json.dumps({**json.loads(tok_cfg.read_text()), **change}))
        assert not hf.generic_tokenizer(folder), change
    assert not hf.generic_tokenizer(tmp_path / "missing")


def test_tokenizer_encodes_one_token_per_character_without_special_tokens(model_dir):
    tok = hf.load_tokenizer(model_dir)
    ids = tok.encode("ab 1")
    assert len(ids) == 4
    assert [tok.decode([i]) for i in ids] == ["a", "b", " ", "1"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok("ab", add_special_tokens=True)["input_ids"] == ids[:2]  # no bos/eos added


def test_tiny_model_loads_through_auto_classes(model_dir):
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in model_dir.iterdir()
    }
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tok) == 4 + len(set(TINY.vocab))
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    logits = model(torch.tensor([tok.encode("1+1=")])).logits
    assert logits.shape == (1, 4, len(tok))


def test_load_model_returns_eval_mode_in_requested_dtype(model_dir):
    model = hf.load_model(model_dir, dtype="bfloat16")
    assert not model.training
    assert next(model.parameters()).dtype == torch.bfloat16


def test_build_is_deterministic_in_seed(model_dir, tmp_path):
    hf.build_tiny_model(tmp_path / "same", TINY)
    hf.build_tiny_model(tmp_path / "other", TinyModelConfig(**{**_fields(TINY), "seed": 1}))
    ref = load_file(model_dir / "model.safetensors")
    same = load_file(tmp_path / "same" / "model.safetensors")
    other = load_file(tmp_path / "other" / "model.safetensors")
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert not torch.equal(ref["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_init_std_sets_the_weight_scale(tmp_path):
    hf.build_tiny_model(tmp_path, TinyModelConfig(**{**_fields(TINY), "init_std": 0.2}))
    std = load_file(tmp_path / "model.safetensors")["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.15 < std < 0.25


def test_llama_arch_builds_an_untied_llama(tmp_path):
    hf.build_tiny_model(tmp_path, TinyModelConfig(**{**_fields(TINY), "arch": "llama"}))
    model = hf.load_model(tmp_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()


def test_eos_token_ids_read_from_folder_and_model(model_dir):
    assert hf.eos_token_ids(model_dir) == [2]
    assert hf.eos_token_ids(str(model_dir)) == [2]
    assert hf.eos_token_ids(hf.load_model(model_dir)) == [2]


def test_ensure_model_builds_missing_folder_once(tmp_path):
    cfg = ModelConfig(path=str(tmp_path / "models" / "tiny"), build_tiny=TINY)
    path = hf.ensure_model(cfg)
    assert (path / "config.json").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert hf.ensure_model(cfg) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in path.parent.iterdir()] == ["tiny"]  # no temporary folder left behind


def test_ensure_model_without_build_tiny_names_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere.*build_tiny"):
        hf.ensure_model(ModelConfig(path=str(missing)))
    assert not missing.exists()


def test_ensure_model_refuses_non_empty_folder_without_config(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="non-empty"):
        hf.ensure_model(ModelConfig(path=str(tmp_path), build_tiny=TINY))


def test_ensure_model_loses_a_build_race_gracefully(tmp_path, monkeypatch):
    """Another process finishes first: our rename fails, we use theirs and clean up our temp folder."""
    target = tmp_path / "tiny"
    real_build = hf.build_tiny_model

    def build_while_another_process_wins(path, cfg):
        real_build(target, cfg)  # the other process
        real_build(path, cfg)

    monkeypatch.setattr(hf, "build_tiny_model", build_while_another_process_wins)
    assert hf.ensure_model(ModelConfig(path=str(target), build_tiny=TINY)) == target
    assert (target / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def _fields(cfg: TinyModelConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__struct_fields__}
