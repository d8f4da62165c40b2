"""Hugging Face model folders, offline: load any local causal LM, or write a tiny random one.

Place in the dataflow: every process that holds a model — rollout engines (`engines.torch_engine`,
vLLM, SGLang) and the trainer — finds its weights through `ensure_model(config.model)` and loads them
with `load_model` / `load_tokenizer`. Nothing here downloads: a tiny model of a standard architecture
(Qwen2 or Llama) is written with `save_pretrained`, so tests and examples exercise the same loading path
as a real checkpoint.

The tiny tokenizer is character-level: every (ASCII) character of `TinyModelConfig.vocab` is one token,
after four special tokens with fixed ids (<pad>=0, <bos>=1, <eos>=2, <unk>=3). Encoding adds no special
tokens, so a prompt's ids are exactly its characters, and `decode(encode(s)) == s` for any `s` written
in the vocabulary. Characters outside it are not representable (a Qwen2 tokenizer under transformers
5.x drops them; other loaders give <unk>): keep task text inside the vocabulary.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


class TinyModelSpec(Protocol):
    """What building a tiny model reads (asyncrl's `[model.build_tiny]` section has these fields)."""

    arch: str
    vocab: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    experts_per_token: int
    max_positions: int
    init_std: float
    seed: int


class ModelSpec(Protocol):
    """What `ensure_model` reads (asyncrl's `[model]` section): the folder, and the tiny model to build there."""

    path: str
    build_tiny: TinyModelSpec | None


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or a torch.dtype) -> torch.dtype."""
    import torch  # here and below, where a tensor is made: the launcher finds model folders without torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to unused code points."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_char_tokenizer(vocab: str):
    """A character-level PreTrainedTokenizerFast that adds no bos/eos when encoding.

    It is a byte-level BPE with no merges, i.e. the standard GPT-2/Qwen2 tokenizer shape: transformers
    5.x rebuilds any "qwen2" model's tokenizer as a byte-level BPE from the saved vocab and merges
    (ignoring a custom pre-tokenizer), so this is the shape that loads identically on every path. Each
    ASCII character is one token; a non-ASCII character of `vocab` is one token per UTF-8 byte.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = _byte_to_unicode()
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in vocab:
        for b in ch.encode("utf-8"):
            ids.setdefault(byte_char[b], len(ids))
    tok = Tokenizer(models.BPE(vocab=ids, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        # The default clean-up rewrites " ," to "," and would break the exact round trip.
        clean_up_tokenization_spaces=False,
    )


# The tiny mixture-of-experts architectures: model type -> (config class, model class, the config's name for its
# expert count). Each expert is an MLP of `intermediate_size`; qwen2_moe adds its shared expert of the same width.
MOE_ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "num_experts"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "num_experts"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "num_local_experts"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "num_experts"),
}


def _build_moe(cfg: TinyModelSpec, common: dict[str, Any]):
    import transformers

    config_name, model_name, experts_key = MOE_ARCHS[cfg.arch]
    extra: dict[str, Any] = {experts_key: cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
                             "tie_word_embeddings": False, "output_router_logits": False}
    if cfg.arch in ("qwen3_moe", "qwen2_moe"):
        extra["moe_intermediate_size"] = cfg.intermediate_size
        extra["norm_topk_prob"] = True  # each token's chosen experts' weights sum to 1, as in Mixtral and OLMoE
    if cfg.arch == "qwen3_moe":
        extra["head_dim"] = cfg.hidden_size // cfg.num_heads  # Qwen3's default is 128 whatever the width
    if cfg.arch == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = cfg.intermediate_size
    config = getattr(transformers, config_name)(**common, **extra)
    return getattr(transformers, model_name)(config)


def _build_model(cfg: TinyModelSpec, vocab_size: int):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        initializer_range=cfg.init_std,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"tiny model: num_heads ({cfg.num_heads}) must divide hidden_size ({cfg.hidden_size}) "
            f"and num_kv_heads ({cfg.num_kv_heads}) must divide num_heads"
        )
    # Small Qwen2 checkpoints tie the LM head to the embeddings, Llama ones do not: keep both shapes
    # so that weight loading is exercised with and without tied names.
    if cfg.arch in MOE_ARCHS:
        if cfg.experts_per_token > cfg.num_experts:
            raise ValueError(f"tiny model: experts_per_token ({cfg.experts_per_token}) is more than num_experts "
                             f"({cfg.num_experts})")
        model = _build_moe(cfg, common)
    elif cfg.arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID)
    return model


def _quiet_transformers() -> None:
    """Progress bars for loading a 75k-parameter model only clutter the run's log."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def build_tiny_model(path: str | Path, cfg: TinyModelSpec) -> None:
    """Write a tiny random-initialised HF causal LM + char tokenizer into `path` (deterministic in cfg.seed)."""
    import torch

    _quiet_transformers()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(cfg.vocab)
    # Fork the global RNG so that building a model does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = _build_model(cfg, vocab_size=len(tokenizer))
    model.save_pretrained(path)  # safetensors is the default format
    tokenizer.save_pretrained(path)
    # Name the portable class: older transformers releases do not know the 5.x "TokenizersBackend".
    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["model_max_length"] = cfg.max_positions
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    log.info("built tiny %s model at %s (%d params)", cfg.arch, path, sum(p.numel() for p in model.parameters()))


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    """The HF causal LM in `path` (local files only), on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), local_files_only=True)
    return model.to(device).eval()


# Model types for which AutoTokenizer loads a folder whose tokenizer_config.json names the generic backend class
# with `TokenizersBackend.from_pretrained` itself: none is in transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
# (those get the model's registered class instead) or maps to MistralCommonBackend (tests/unit/test_hf_tokenizer.py
# holds this list to the installed transformers' registry).
GENERIC_TOKENIZER_TYPES = frozenset({"llama", "gpt2", "gemma", "gemma2", "granite", "olmo2", "phi", "qwen3",
                                     "smollm3"})
_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str | Path):
    """The tokenizer saved in `path` (local files only): the class AutoTokenizer would choose. Where that class is
    knowably the generic Rust backend (`generic_tokenizer`), it is loaded directly: AutoTokenizer's registry
    imports every model family's configuration and torch, about 3 s of CPU in each process that starts (the
    launcher, every generator, the trainer)."""
    if generic_tokenizer(path):
        from transformers import PreTrainedTokenizerFast  # transformers 5: TokenizersBackend, by this name too

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def generic_tokenizer(path: str | Path) -> bool:
    """Whether AutoTokenizer loads `path` as `TokenizersBackend.from_pretrained(path)`: a tokenizer.json, a
    tokenizer_config.json naming the generic backend with no custom code (`auto_map`), and a model type of
    GENERIC_TOKENIZER_TYPES."""
    folder = Path(path)
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return ((folder / "tokenizer.json").is_file() and "auto_map" not in tok_cfg
            and tok_cfg.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES and model_type in GENERIC_TOKENIZER_TYPES)


def ensure_model(model_cfg: ModelSpec) -> Path:
    """Return model_cfg.path, first building the tiny model there if it is missing and build_tiny is set.

    Safe when several processes race: each builds into its own temporary folder beside the target and
    renames it into place; the losers discard theirs.
    """
    path = Path(model_cfg.path)
    if (path / "config.json").exists():
        return path
    if model_cfg.build_tiny is None:
        raise FileNotFoundError(
            f"model.path {str(path)!r} has no config.json; point it at a local HF model folder "
            "or set [model.build_tiny] to write a tiny random model there"
        )
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(
            f"model.path {str(path)!r} exists but holds no config.json; refusing to build a tiny model "
            "into a non-empty folder — empty it or choose another path"
        )
    build = model_cfg.build_tiny
    return write_model_folder(path, lambda tmp: build_tiny_model(tmp, build))


def write_model_folder(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temporary folder beside `path`, which is then renamed into place: an interrupted
    write leaves no half-written model behind, and of processes racing to write the same folder the first
    rename wins and the others discard theirs. Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model folder is an ordinary one
        write(tmp)
        try:
            os.replace(tmp, path)  # atomic; replaces an empty folder, fails on a non-empty one
        except OSError:
            if not (path / "config.json").exists():
                raise
            log.info("another process wrote %s first; using it", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def eos_token_ids(path_or_model: Any) -> list[int]:
    """The eos ids of a model folder or a loaded model: generation config first, then the model config."""
    if isinstance(path_or_model, (str, Path)):
        from transformers import AutoConfig, GenerationConfig

        path = Path(path_or_model)
        gen = None
        if (path / "generation_config.json").exists():
            gen = GenerationConfig.from_pretrained(str(path), local_files_only=True)
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    else:
        gen = getattr(path_or_model, "generation_config", None)
        config = path_or_model.config
    for source in (gen, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids = [value] if isinstance(value, int) else list(value)
            return list(dict.fromkeys(int(i) for i in ids))
    return []
