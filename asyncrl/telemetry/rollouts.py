"""What the model writes: RUN_DIR/rollouts.jsonl, a few samples in the console, the trackers.

Place in the dataflow: every `logging.rollouts_every` steps the Trainer decodes the trajectories it
trained on and puts them in its step metrics under `ROLLOUTS_KEY`; at each evaluation the Evaluator puts
its held-out completions under `EVAL_SAMPLES_KEY`. The Controller takes both out of the row (they are not
metrics) and hands them to `RolloutLog`, which appends one JSON line per sample and logs the first
`logging.rollouts_shown` of them; the metric sinks get them too (`log_samples`: W&B and trackio tables,
TensorBoard text, MLflow artifacts).

A line of rollouts.jsonl:

```
{"step": 10, "split": "train", "group_id": 37, "seq_id": 148, "prompt": "...", "completion": "...",
 "reward": 1.0, "components": {"correct": 1.0, "format": 0.5}, "min_version": 9, "max_version": 9,
 "finish_reason": "stop", "completion_tokens": 12}
{"step": 10, "split": "eval", "mode": "greedy", "prompt": "...", "completion": "...", "reward": 0.0, ...}
```

`step` is the version the step made (the metrics row's step); a resume cuts the file back to its
checkpoint's step like metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

ROLLOUTS_KEY = "rollouts/samples"  # trainer metrics -> Controller: the step's decoded trajectories
EVAL_SAMPLES_KEY = "eval/samples"  # evaluator metrics -> Controller: the held-out completions
ROLLOUTS = "rollouts.jsonl"
SHOWN_CHARS = 240  # each of prompt and completion in the console


def train_samples(trajectories: Iterable[Any], decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """One JSON-ready dict per trained trajectory (its response decoded once, here)."""
    return [{
        "split": "train", "group_id": t.group_id, "seq_id": t.seq_id, "prompt": t.prompt_text,
        "completion": decode(list(t.response_ids)), "reward": t.reward, "components": dict(t.reward_components),
        "min_version": t.min_version, "max_version": t.max_version, "finish_reason": t.finish_reason,
        "completion_tokens": len(t.response_ids),
    } for t in trajectories]


def _short(text: str) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


class RolloutLog:
    """Appends samples to RUN_DIR/rollouts.jsonl, shows a few in the console, passes them to the sinks."""

    def __init__(self, run_dir: str | Path, *, shown: int, sinks: list[Any] | None = None) -> None:
        self.path = Path(run_dir) / ROLLOUTS
        self.shown = shown
        self.sinks = sinks if sinks is not None else []

    def write(self, step: int, samples: list[dict[str, Any]]) -> None:
        if not samples:
            return
        with self.path.open("a", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}, ensure_ascii=False) + "\n")
        for s in samples[: self.shown]:
            what = s.get("mode", s["split"])
            log.info("sample at step %d (%s, reward %.3g): %s ▸ %s", step, what, s["reward"], _short(s["prompt"]),
                     _short(s["completion"]))
        for sink in self.sinks:
            sink.log_samples(step, samples)
