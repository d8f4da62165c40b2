"""A tiny learned reward model for tests: built offline from the session's tiny causal LM."""

from __future__ import annotations

from pathlib import Path

import torch


def build_reward_model(causal_dir: Path, out: Path, *, labels: int = 1, seed: int = 0) -> Path:
    """A random sequence classifier over the tiny causal LM's body, saved as a reward model folder."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(causal_dir, num_labels=labels, local_files_only=True)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a head that tells the texts apart
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(causal_dir, local_files_only=True).save_pretrained(out)
    return out
