"""A learned reward model as a reward component: `reward.model = "path/to/folder"`.

Place in the dataflow: the Scorer's `RewardSet` (combine.py) hands `RewardModel.values` each batch of calls;
the texts (prompt + completion, or the tokenizer's chat template with `reward.model_chat_template`) go through
an `AutoModelForSequenceClassification` with one label, `reward.model_batch_size` at a time, padded, on a
daemon thread (the role's event loop keeps serving); the logit of each text is its value (after
`reward.model_transform`). Its component name is "reward_model", its weight `reward.model_weight`.

It runs in the role's own process whatever `reward.isolation` says (it is the run's code, not the user's),
with that process's torch threads (`cluster.torch_threads`), on CUDA when the process sees a GPU. A forward
pass does not hang, so `reward.timeout_s` does not bound it: size `model_batch_size` and
`model_max_len` to the machine. A text longer than `model_max_len` tokens is cut from the left, so that
the end of the completion is what the model reads.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from asyncrl.aio import on_daemon_thread
from asyncrl.rewards.base import Call, Value

log = logging.getLogger(__name__)


def check_reward_model(path: str) -> list[str]:
    """Error lines for `asyncrl validate`: `path` must be a local sequence-classification folder with one label."""
    import json

    config = Path(path) / "config.json"
    if not config.is_file():
        return [f"reward.model: {path!r} is not a Hugging Face model folder (no config.json) — point it at a "
                f"local AutoModelForSequenceClassification folder"]
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return [f"reward.model: cannot read {str(config)!r} ({exc})"]
    archs = cfg.get("architectures") or []
    labels = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else cfg.get("num_labels", 2)
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        return [f"reward.model: {path!r} holds a {archs[0]}, not a sequence classifier — a reward model is an "
                f"AutoModelForSequenceClassification with num_labels = 1"]
    if labels != 1:
        return [f"reward.model: {path!r} has {labels} labels — a reward model scores with one (num_labels = 1)"]
    return []


class RewardModel:
    """A sequence classifier with one label as a `Component` (base.py)."""

    def __init__(self, path: str, *, name: str = "reward_model", weight: float = 1.0, batch_size: int = 8,
                 max_len: int = 1024, transform: str = "none", chat_template: bool = False,
                 dtype: str = "float32", device: str = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from engines.hf import torch_dtype

        errors = check_reward_model(path)
        if errors:
            raise ValueError(errors[0])
        if transform not in ("none", "sigmoid"):
            raise ValueError(f"reward.model_transform: {transform!r} — expected 'none' or 'sigmoid'")
        self.name = name
        self.weight = weight
        self.batch_size = batch_size
        self.max_len = max_len
        self.transform = transform
        self.chat_template = chat_template
        hf_logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.truncation_side = "left"  # keep the end of the completion
        if self.tokenizer.pad_token_id is None:  # batches need padding; the eos token is the usual stand-in
            if self.tokenizer.eos_token is None:
                raise ValueError(f"reward.model: the tokenizer in {path!r} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward.model_chat_template: the tokenizer in {path!r} has no chat template — "
                             f"set reward.model_chat_template = false (prompt and completion are concatenated)")
        self.device = torch.device(device)  # the hosting role's (cluster.scorer_gpus, or the trainer's)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch_dtype(dtype), local_files_only=True).to(self.device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # pooling finds each text's last token

    def text(self, call: Call) -> str:
        """What the model reads for one call."""
        if not self.chat_template:
            return call.prompt + call.completion
        messages = [{"role": "user", "content": call.prompt}, {"role": "assistant", "content": call.completion}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    @torch.inference_mode()
    def score_texts(self, texts: list[str]) -> list[float]:
        """One value per text: padded batches of `batch_size`, the logit of the single label."""
        out: list[float] = []
        special = not self.chat_template  # a rendered chat template already holds its special tokens
        for start in range(0, len(texts), self.batch_size):
            enc: Any = self.tokenizer(texts[start:start + self.batch_size], padding=True, truncation=True,
                                      max_length=self.max_len, add_special_tokens=special, return_tensors="pt")
            logits = self.model(**enc.to(self.device)).logits.float()[:, 0]
            if self.transform == "sigmoid":
                logits = torch.sigmoid(logits)
            out += logits.tolist()
        return out

    hung_calls = 0  # a call past the timeout is not left running (killed, or bounded by the batch)

    async def values(self, calls: list[Call]) -> list[Value | BaseException]:
        try:
            texts = [self.text(c) for c in calls]
            scores = await on_daemon_thread(self.score_texts, texts, name="reward-model")
        except Exception as exc:  # noqa: BLE001 - a text the tokenizer rejects, out of memory: fail the batch
            log.warning("reward model failed on a batch of %d: %s", len(calls), exc)
            return [exc] * len(calls)
        return [v if math.isfinite(v) else ValueError(f"the reward model gave {v}") for v in scores]

    def close(self) -> None:
        """Nothing to stop: the model goes with the role."""
