"""benchmarks/faults.py grades every group id drawn from the prompt stream (RUN_DIR/admissions.jsonl, every
attempt) against the final ledger: trained exactly once, or released with its cause, or in flight when the run
ended. Hand-made admissions and ledgers, one of each kind of violation; no Ray, no model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from asyncrl.telemetry.admissions import AdmissionLog, Attempt, read_attempts
from asyncrl.telemetry.metrics import GroupEvents

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "faults.py"


@pytest.fixture(scope="module")
def faults():
    spec = importlib.util.spec_from_file_location("faults_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def ledger(*steps: list[int]) -> list[dict]:
    return [{"step": i + 1, "groups": [[gid, f"prompt {gid}"] for gid in ids]} for i, ids in enumerate(steps)]


def one_attempt(admitted: int, accepted: list[int], released: list[tuple[int, str, str]] = ()) -> list[Attempt]:
    return [Attempt(step=0, next_id=0, regenerate=[], stored=[], admitted=list(range(admitted)),
                    accepted=accepted, released=list(released))]


def test_a_clean_run_trains_each_id_once_and_its_failures_and_its_tail_are_no_violation(faults):
    attempts = one_attempt(7, [0, 1, 3, 4, 5], [(2, "failed", "scorer/0#1 died"), (6, "filtered", "rewards all 0")])
    g = faults.grade(attempts, ledger([0, 1], [3, 4]))
    assert g.value == 0 and g.admitted == 7 and g.trained_once == 4
    assert g.failed == {"failed: scorer/0 died": 1, "filtered: rewards all 0": 1}  # any incarnation of the scorer
    assert g.unfinished == 1  # 5: accepted, not trained when the run ended


def test_groups_a_killed_attempt_accepted_after_its_checkpoint_count_as_regenerated_once_trained_after_the_resume(
        faults, tmp_path):
    # P = 2. Attempt 0: checkpoint at step 2 (ids 0-3 trained, 4 and 5 stored, 6 and 7 running, next id 8);
    # after it, it accepts 6, 7 and 8, a dead generator's 9 is released, and it trains step 3 before it dies.
    # Attempt 1 resumes from that checkpoint: 6 and 7 again (same ids, same prompts), then 8 on, 9 trained now.
    log = AdmissionLog(tmp_path)
    log.start(0)
    log.write(2, GroupEvents(admitted=list(range(8)), accepted=[0, 1, 2, 3, 4, 5]))
    log.write(3, GroupEvents(admitted=[8, 9], accepted=[6, 7, 8], released=[(9, "failed", "generator/0#0 died")]))
    log.close()
    log.start(2, {"next_id": 8, "live": [[4, 1, True], [5, 1, True], [6, 1, False], [7, 1, False]]})
    log.write(3, GroupEvents(admitted=[6, 7, 8, 9, 10, 11], accepted=[6, 7, 8, 9, 10]))
    log.close()
    attempts = read_attempts(tmp_path / "admissions.jsonl")
    assert [(a.step, a.next_id, a.regenerate, a.stored) for a in attempts] == [(0, 0, [], []),
                                                                               (2, 8, [6, 7], [4, 5])]
    trained = ledger([0, 1], [2, 3], [4, 5], [6, 7], [8, 9])  # cut back to step 2 by the resume, then 3-5 again
    g = faults.grade(attempts, trained)
    assert g.value == 0 and g.attempts == 2 and g.trained_once == 10 and g.failed == {}
    assert (g.undone, g.regenerated, g.unfinished) == (3, 3, 2)  # 6, 7, 8 again; 10 and 11 in flight at the end


def test_an_id_trained_twice_is_a_violation(faults):
    g = faults.grade(one_attempt(4, [0, 1, 2, 3]), ledger([0, 1], [1, 2]))
    assert g.value == 1 and g.violations == {"trained more than once": 1}
    assert g.examples["trained more than once"] == [1]


def test_an_id_neither_trained_nor_released_before_the_last_trained_one_is_a_violation(faults):
    g = faults.grade(one_attempt(4, [0, 1, 2, 3]), ledger([0, 2], [3]))
    assert g.value == 1 and g.violations == {"neither trained nor released": 1}
    assert g.examples["neither trained nor released"] == [1]


def test_an_id_released_without_a_cause_is_a_violation(faults):
    g = faults.grade(one_attempt(3, [0, 2], [(1, "failed", " ")]), ledger([0, 2]))
    assert g.value == 1 and g.violations == {"released without a cause": 1}


def test_a_prompt_the_resume_undid_and_never_drew_again_is_a_violation(faults):
    dead = Attempt(step=0, next_id=0, regenerate=[], stored=[], admitted=[0, 1, 2, 3], accepted=[0, 1, 2, 3])
    skipping = Attempt(step=1, next_id=2, regenerate=[], stored=[], admitted=[3, 4], accepted=[3, 4])
    g = faults.grade([dead, skipping], ledger([0, 1], [3, 4]))
    assert g.violations == {"neither trained nor released": 1} and g.examples["neither trained nor released"] == [2]


def test_an_id_the_record_lacks_is_a_violation_whether_trained_or_skipped(faults):
    attempts = [Attempt(step=0, next_id=0, regenerate=[], stored=[], admitted=[0, 2, 3], accepted=[0, 2, 3])]
    g = faults.grade(attempts, ledger([0, 2], [3, 9]))
    assert g.violations == {"trained, never drawn": 1, "skipped by the prompt stream": 1}
    assert g.examples == {"trained, never drawn": [9], "skipped by the prompt stream": [1]}
