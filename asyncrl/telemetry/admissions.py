"""RUN_DIR/admissions.jsonl: every group id the gate handed out, and what became of it, across every attempt.

Place in the dataflow: the staleness gate records its group events (buffers/gate.py: ids admitted, accepted,
released with the reason and why); the buffer's `stats()` report carries them each step, and the Controller
appends them here beside the step's metrics row, and once more after the roles' loops stop (what the last
window held, a dead attempt's included). A group id is the index of its prompt in the prompt stream
(`PromptStream.row`), so the file lists every prompt drawn. With RUN_DIR/ledger.jsonl (what each step
trained) it shows that each one was trained once or released with its cause (benchmarks/faults.py grades it).

Lines, in the order written:

```
{"attempt": 0, "step": 0, "next_id": 0, "regenerate": [], "stored": []}
{"step": 1, "admitted": [0, 1, 2, 3], "accepted": [0, 2, 3], "released": [[1, "failed", "scorer/0#0 died"]]}
{"attempt": 1, "step": 5, "next_id": 28, "regenerate": [24, 25], "stored": [20, 21, 22, 23]}
```

An `attempt` line starts a run (0) or a resume (1, 2, ...: `--resume`, or the automatic resume after the
trainer or the buffer died) from the checkpoint of `step`: its gate's next fresh id, the groups it generates
again (running when the checkpoint was taken: the same ids, so the same prompts) and the groups it stored
accepted. Unlike ledger.jsonl, a resume does not cut this file back: what the earlier attempt did after that
checkpoint stays, so a reader sees which of its groups the resume undid (`regenerate`, and every id from
`next_id` on) and that they were drawn again. Event lines without any event are not written. A buffer that
dies takes the events of its last window with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from asyncrl.telemetry.metrics import GroupEvents

ADMISSIONS = "admissions.jsonl"


class AdmissionLog:
    """Appends to RUN_DIR/admissions.jsonl: an attempt's start, then its group events; each line flushed."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / ADMISSIONS
        self._file: IO[str] | None = None

    def start(self, step: int, gate: dict[str, Any] | None = None) -> None:
        """An attempt begins at `step`: a fresh run (no `gate`), or a resume from the checkpoint whose gate state
        (`GateState` as builtins) is `gate`. A fresh run replaces an earlier run's file."""
        if gate is None:
            self.path.unlink(missing_ok=True)
        attempt = _count_attempts(self.path)
        live = gate["live"] if gate is not None else []
        self._write({"attempt": attempt, "step": step, "next_id": gate["next_id"] if gate is not None else 0,
                     "regenerate": [gid for gid, _, accepted in live if not accepted],
                     "stored": [gid for gid, _, accepted in live if accepted]})

    def write(self, step: int, events: GroupEvents | None) -> None:
        """The gate's events reported with the metrics row of `step` (nothing when there are none)."""
        if events:
            self._write({"step": step, "admitted": events.admitted, "accepted": events.accepted,
                         "released": events.released})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, line: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._file.flush()


@dataclass
class Attempt:
    """One attempt of a run as admissions.jsonl records it: its start line, then its events merged in order."""

    step: int  # the step it started from (0, or its checkpoint's)
    next_id: int  # the gate's next fresh id at its start: ids from here on were drawn by this attempt
    regenerate: list[int]  # running at its checkpoint: admitted again by this attempt
    stored: list[int]  # accepted and not trained at its checkpoint: trained by this attempt
    admitted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    released: list[tuple[int, str, str]] = field(default_factory=list)


def read_attempts(path: str | Path) -> list[Attempt]:
    """Every attempt in an admissions.jsonl, in order."""
    attempts: list[Attempt] = []
    for text in Path(path).read_text(encoding="utf-8").splitlines():
        if not text.strip():
            continue
        line = json.loads(text)
        if "attempt" in line:
            attempts.append(Attempt(step=line["step"], next_id=line["next_id"], regenerate=line["regenerate"],
                                    stored=line["stored"]))
            continue
        if not attempts:
            raise ValueError(f"{path}: group events before the first attempt line")
        attempts[-1].admitted += line["admitted"]
        attempts[-1].accepted += line["accepted"]
        attempts[-1].released += [tuple(r) for r in line["released"]]
    return attempts


def _count_attempts(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open(encoding="utf-8") as f:
        return sum(line.startswith('{"attempt"') for line in f)
