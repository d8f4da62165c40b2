"""`reward.isolation = "process"`: reward calls in worker processes (asyncrl/rewards/process.py). A reward
that hangs, holds its interpreter lock, exits, segfaults or runs out of memory fails only its own call; a
fresh worker takes its place; no worker outlives the pool or the process that started it."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config.schema import RewardConfig
from asyncrl.deploy.build import build_rewards
from asyncrl.messages import Trajectory
from asyncrl.rewards.base import Score
from asyncrl.rewards.process import ProcessRewards, RewardError, RewardWorkerDied
from asyncrl.roles.scorer import Scorer
from tests.component import score_fakes
from tests.component.score_fakes import FakeBuffer

DATA = Path(__file__).resolve().parents[1] / "unit" / "data"
MISBEHAVES = "asyncrl_unit_fixtures:reward_misbehaves"


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA))  # the workers get this process's search path


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def gone_soon(pids: list[int], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def score(pool: ProcessRewards, completions: list[str], **kw) -> list:
    """Each call's total, or what failed it."""
    out = asyncio.run(pool.score([("q", c, {"answer": "a"}) for c in completions], **kw))
    return [r.total if isinstance(r, Score) else r for r in out]


@pytest.fixture
def pool_of():
    pools: list[ProcessRewards] = []

    def make(**kw) -> ProcessRewards:
        pools.append(ProcessRewards(kw.pop("fn", MISBEHAVES), "answer", **kw))
        return pools[-1]

    yield make
    for p in pools:
        p.close()


def test_a_batch_runs_across_the_workers_and_each_failure_keeps_its_exception_type(pool_of):
    pool = pool_of(workers=2)
    out = score(pool, ["pid", "pid", "a", "bb", "boom", "custom", "nan", "print"])
    assert len({out[0], out[1]}) == 2 and set(out[:2]) == {float(p) for p in pool.pids()}  # both workers
    assert out[2:4] == [1.0, 2.0] and out[7] == 5.0  # what the reward prints does not reach the wire
    assert type(out[4]) is KeyError and str(out[4]) == "'boom'"  # as the thread path reports it
    assert isinstance(out[5], RewardError) and "asyncrl_unit_fixtures.CustomRewardError: custom" in str(out[5])
    assert type(out[6]) is ValueError and "must return a finite number" in str(out[6])


@pytest.mark.parametrize("hang", ["sleep", "regex"])  # regex: a long C call that holds the interpreter lock
def test_a_call_past_the_timeout_kills_its_worker_and_the_next_call_runs_on_a_fresh_one(pool_of, hang):
    pool = pool_of(workers=1, timeout_s=0.5)
    first, timed_out, second, after = score(pool, ["pid", hang, "pid", "a"])
    assert isinstance(timed_out, asyncio.TimeoutError)
    assert second != first and after == 1.0
    assert not alive(int(first))  # killed and reaped, not left running


@pytest.mark.parametrize("death, says", [("exit", "exited with status 1"), ("segv", "killed by SIGSEGV")])
def test_a_worker_that_dies_fails_only_the_call_it_was_running(pool_of, death, says):
    pool = pool_of(workers=1)
    out = score(pool, ["a", death, "bb", "ccc"])
    assert out[0] == 1.0 and out[2:] == [2.0, 3.0]
    assert isinstance(out[1], RewardWorkerDied) and says in str(out[1])


def test_a_call_over_the_memory_limit_fails_and_its_worker_is_replaced(pool_of):
    pool = pool_of(workers=1, max_memory_mb=256)
    first, oom, second = score(pool, ["pid", "alloc", "pid"])
    assert isinstance(oom, MemoryError)
    assert second != first  # what the reward held goes with the old worker


def test_cost_calls_go_to_the_cost_function(pool_of):
    pool = pool_of(fn="asyncrl_unit_fixtures:reward_named", cost_fn="asyncrl_unit_fixtures:reward_varargs")
    assert pool.has_cost
    assert score(pool, ["a", "b"]) == [1.0, 0.0]
    assert score(pool, ["a", "b"], cost=True) == [2.0, 2.0]


@pytest.mark.parametrize("kw, line", [
    ({"reward_fn": "no_such_module_xyz:score"}, "reward.fn: cannot import module 'no_such_module_xyz'"),
    ({"reward_fn": "exact_match", "cost_fn": "no_such_cost"}, "reward.cost_fn: unknown reward rule 'no_such_cost'"),
])
def test_a_spec_that_does_not_resolve_fails_when_the_pool_starts_naming_its_key(kw, line):
    with pytest.raises(ValueError) as exc:
        ProcessRewards(answer_key="answer", **kw)
    assert str(exc.value).startswith(line)


def test_close_ends_every_worker_even_inside_a_hung_call_and_starts_none_for_the_calls_left(pool_of):
    pool = pool_of(workers=2, timeout_s=30.0)
    pids = pool.pids()

    async def main() -> list:
        task = asyncio.ensure_future(pool.score([("q", c, {}) for c in ["sleep", "sleep", "a"]]))
        await asyncio.sleep(0.3)
        pool.close()
        return await asyncio.wait_for(task, 5.0)

    hung, hung_too, left = asyncio.run(main())
    assert isinstance(hung, RewardWorkerDied) and isinstance(hung_too, RewardWorkerDied)
    assert type(left) is RuntimeError and "closed" in str(left)
    assert pool.pids() == [] and not any(alive(p) for p in pids)


def test_workers_end_when_the_pool_is_garbage_collected():
    pool = ProcessRewards(MISBEHAVES, "answer", workers=2)
    pids = pool.pids()
    del pool
    gc.collect()
    assert not any(alive(p) for p in pids)


def test_workers_die_with_the_process_that_started_them():
    script = (f"import os, signal, sys\nsys.path.insert(0, {str(DATA)!r})\n"
              "from asyncrl.rewards.process import ProcessRewards\n"
              f"pool = ProcessRewards({MISBEHAVES!r}, 'answer', workers=2)\n"
              "print(*pool.pids(), flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2 and gone_soon(pids)


# -- the Scorer with reward.isolation = "process", end to end ------------------------------------------


def traj(group_id: int, j: int, text: str, finish_reason: str = "stop") -> Trajectory:
    return score_fakes.traj(group_id, j, text, finish_reason, answer='a')


def test_scorer_with_process_isolation_scores_batches_and_a_dying_or_hung_reward_fails_only_its_group():
    rewards = build_rewards(RewardConfig(fn=MISBEHAVES, isolation="process", workers=2, timeout_s=0.5))
    assert isinstance(rewards, ProcessRewards)
    pids = rewards.pids()
    groups = {0: ["a", "bb"], 1: ["exit", "a"], 2: ["sleep", "a"], 3: ["ccc", "a"]}
    buffer = FakeBuffer([[traj(g, j, t) for j, t in enumerate(texts)] for g, texts in groups.items()])
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=rewards, decode=lambda ids: "".join(map(chr, ids)))

    async def main() -> None:
        loop = asyncio.ensure_future(scorer.run())
        while len(buffer.accepted) + len(buffer.released["failed"]) < len(groups):
            await asyncio.sleep(0.02)
        scorer.stop()
        await asyncio.wait_for(loop, 5.0)

    asyncio.run(asyncio.wait_for(main(), 20.0))
    assert [g.group_id for g in buffer.accepted] == [0, 3] and buffer.released["failed"] == [1, 2]
    assert [t.reward for t in buffer.accepted[1].trajectories] == [3.0, 1.0]
    assert scorer.counts["reward_errors"] == 2
    assert not any(alive(p) for p in [*pids, *rewards.pids()])  # the loop's end closed the pool
    assert rewards.pids() == []
