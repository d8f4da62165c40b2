"""Roles in-process with fakes: a Scorer or Generator talks to a fake buffer (records every call) and, for the
generator, a fake RolloutEngine. Bad input — a reward function that raises, hangs or returns garbage, an
engine that raises — is contained: its group is released and counted, the rest of the run goes on."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Callable, Mapping

import pytest
import torch

from asyncrl.data.prompts import Prompt
from asyncrl.messages import Completion, SamplingParams, Trajectory
from asyncrl.roles.generator import Generator
from asyncrl.roles.scorer import Scorer
from asyncrl.telemetry.metrics import Mean, Rate, Share, Sum, Total
from engines.base import RolloutEngine
from tests.component import score_fakes
from tests.fakes import ThreadRewards

torch.set_num_threads(1)


def run(coro: Any, timeout: float = 5.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


class FakeBuffer(score_fakes.FakeBuffer):
    """The async methods a Generator and a Scorer call on the ReplayBuffer; records every call."""

    def __init__(self, batches: list[list[Trajectory]] | None = None, admit_ids: int = 1_000) -> None:
        super().__init__(list(batches or []))
        self.details: list[str] = []  # why, per release_groups call
        self.admits: list[tuple[int, int]] = []  # (max_groups, version) per call
        self.rollouts: list[Trajectory] = []
        self._next_id = 0
        self._admit_ids = admit_ids

    async def admit(self, max_groups: int, version: int, timeout: float | None = None, holder=None) -> list[int]:
        self.admits.append((max_groups, version))
        n = min(max_groups, self._admit_ids - self._next_id)
        if n <= 0:
            await asyncio.sleep(min(timeout or 0.01, 0.01))
            return []
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        return ids

    async def put_rollouts(self, trajs: list[Trajectory]) -> None:
        self.rollouts.extend(trajs)

    async def release_groups(self, group_ids: list[int], reason: str, detail: str = "") -> None:
        await super().release_groups(group_ids, reason, detail)
        self.details.append(detail)

    async def note_held(self, version: int, holder: str | None = None) -> None:
        self.held = version


def traj(group_id: int, j: int, text: str, group_size: int = 2) -> Trajectory:
    """One scored-to-be trajectory whose decoded completion is `text` (see `decode` below)."""
    return Trajectory(seq_id=group_id * group_size + j, group_id=group_id, group_size=group_size,
                      prompt_ids=[1], response_ids=[ord(c) for c in text], loss_mask=[True] * len(text),
                      behavior_logprobs=[0.0] * len(text), versions=[0] * len(text), min_version=0,
                      max_version=0, finish_reason="stop", prompt_text=f"p{group_id}",
                      row_json=json.dumps({"answer": "a"}).encode())


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def make_scorer(buffer: FakeBuffer, reward_fn: Callable[..., Any], timeout_s: float = 30.0, **kw: Any) -> Scorer:
    return Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(reward_fn, timeout_s=timeout_s), decode=decode,
                  **kw)


def by_text(prompt: str, completion: str, **fields: Any) -> Any:
    """Reward from the completion text: 'boom' raises, 'nan' / 'str' return garbage, else 1 if 'a'."""
    if completion == "boom":
        raise RuntimeError("user reward bug")
    if completion == "nan":
        return float("nan")
    if completion == "str":
        return "1.0"
    return 1.0 if completion == fields["answer"] else 0.0


# -- Scorer ----------------------------------------------------------------------------------------
def test_scorer_fails_only_the_group_whose_reward_raises_and_accepts_the_others():
    buffer = FakeBuffer()
    scorer = make_scorer(buffer, by_text)
    batch = [traj(0, 0, "a"), traj(0, 1, "b"), traj(1, 0, "a"), traj(1, 1, "boom"), traj(2, 0, "b"),
             traj(2, 1, "b")]
    run(scorer.score_batch(batch))
    assert buffer.released["failed"] == [1]
    assert [g.group_id for g in buffer.accepted] == [0, 2]
    assert [t.reward for t in buffer.accepted[0].trajectories] == [1.0, 0.0]
    assert [t.reward for t in buffer.accepted[1].trajectories] == [0.0, 0.0]
    assert scorer.counts["reward_errors"] == 1 and scorer.counts["scored"] == 6
    failed = batch[3]
    assert failed.finish_reason == "error" and "RuntimeError: user reward bug" in failed.error
    scorer.stop()


def test_scorer_gives_each_sample_its_own_row_and_decodes_the_batch_at_once():
    seen = []

    def mutating(prompt: str, completion: str, **fields: Any) -> float:
        seen.append(dict(fields))
        fields["answer"] = "changed"  # a reward function that writes into its row: the next sample must not see it
        return 1.0 if completion == "a" else 0.0

    def decode_one(ids: list[int]) -> str:
        raise AssertionError("the batch is decoded with decode.many")

    decode_one.many = lambda seqs: [decode(ids) for ids in seqs]
    buffer = FakeBuffer()
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(mutating, timeout_s=30.0), decode=decode_one)
    run(scorer.score_batch([traj(0, 0, "a"), traj(0, 1, "b")]))
    assert [f["answer"] for f in seen] == ["a", "a"]
    assert [t.reward for t in buffer.accepted[0].trajectories] == [1.0, 0.0]
    scorer.stop()


def test_scorer_scores_the_generators_text_and_decodes_only_what_arrives_without_it():
    seen = []

    def reward(prompt: str, completion: str, **fields: Any) -> float:
        seen.append(completion)
        return 1.0 if completion == "a" else 0.0

    decoded = []

    def decode_many(seqs: list[list[int]]) -> list[str]:
        decoded.append(len(seqs))
        return [decode(ids) for ids in seqs]

    def decode_one(ids: list[int]) -> str:
        raise AssertionError("the batch is decoded with decode.many")

    decode_one.many = decode_many
    with_text = [traj(0, 0, "x"), traj(0, 1, "y")]
    with_text[0].response_text, with_text[1].response_text = "a", "b"  # the generator's decode wins
    buffer = FakeBuffer()
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(reward, timeout_s=30.0), decode=decode_one)
    run(scorer.score_batch([*with_text, traj(1, 0, "a"), traj(1, 1, "c")]))
    assert seen == ["a", "b", "a", "c"] and decoded == [2]  # one decode call, for the two without text
    decoded_again = [traj(2, 0, "x"), traj(2, 1, "y")]
    for t in decoded_again:
        t.response_text = "a"
    run(scorer.score_batch(decoded_again))
    assert decoded == [2] and seen[4:] == ["a", "a"]  # a batch that arrives decoded is not decoded here
    scorer.stop()


def test_the_scorers_lazy_decode_loads_no_tokenizer_until_a_completion_arrives_without_text(tiny_model_dir,
                                                                                            monkeypatch):
    from asyncrl.deploy import build_scoring as build

    loads = []
    real = build.tokenizer_fns
    monkeypatch.setattr(build, "tokenizer_fns", lambda path: loads.append(path) or real(path))
    lazy = build.LazyDecode(str(tiny_model_dir))
    assert loads == []
    tok, decode_ = real(str(tiny_model_dir))
    ids = tok.encode("12+3=", add_special_tokens=False)
    assert lazy(ids) == decode_(ids) and lazy.many([ids, ids[:2]]) == [decode_(ids), decode_(ids[:2])]
    assert loads == [str(tiny_model_dir)]  # once


def test_scorer_says_why_it_released_each_group():
    buffer = FakeBuffer()
    scorer = make_scorer(buffer, by_text, filter_zero_variance=True)
    run(scorer.score_batch([traj(0, 0, "boom"), traj(0, 1, "a"), traj(1, 0, "b"), traj(1, 1, "b")]))
    assert buffer.released == {"failed": [0], "filtered": [1]}
    assert buffer.details == ["reward: RuntimeError: user reward bug",
                              "zero reward variance: every reward of the group is 0"]
    scorer.stop()


@pytest.mark.parametrize("garbage", ["nan", "str"])
def test_scorer_fails_a_group_whose_reward_is_not_a_finite_number(garbage):
    buffer = FakeBuffer()
    scorer = make_scorer(buffer, by_text)
    run(scorer.score_batch([traj(0, 0, garbage), traj(0, 1, "a"), traj(1, 0, "a"), traj(1, 1, "a")]))
    assert buffer.released["failed"] == [0]
    assert [g.group_id for g in buffer.accepted] == [1]
    assert scorer.counts["reward_errors"] == 1
    scorer.stop()


def test_scorer_times_out_a_hanging_reward_and_fails_its_group_without_hanging():
    buffer = FakeBuffer()
    release = threading.Event()

    def hangs(prompt: str, completion: str, **fields: Any) -> float:
        if completion == "hang":
            release.wait(10)  # far past timeout_s; released at the end so no thread outlives the test
        return 1.0

    scorer = make_scorer(buffer, hangs, timeout_s=0.2)
    batch = [traj(0, 0, "a"), traj(0, 1, "hang"), traj(1, 0, "a"), traj(1, 1, "b")]
    t0 = time.monotonic()
    try:
        run(scorer.score_batch(batch))
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        scorer.stop()
    assert 0.15 <= elapsed < 1.5
    assert buffer.released["failed"] == [0]
    assert [g.group_id for g in buffer.accepted] == [1]
    assert scorer.counts["reward_errors"] == 1
    assert batch[1].finish_reason == "error" and batch[1].error == "reward: timed out"
    assert all(t.error == "" for t in buffer.accepted[0].trajectories)


def test_scorer_filters_a_zero_variance_group_and_accepts_a_mixed_one():
    buffer = FakeBuffer()
    scorer = make_scorer(buffer, by_text, filter_zero_variance=True)
    run(scorer.score_batch([traj(0, 0, "a"), traj(0, 1, "a"), traj(1, 0, "a"), traj(1, 1, "b")]))
    assert buffer.released == {"filtered": [0], "failed": []}
    assert [g.group_id for g in buffer.accepted] == [1]
    scorer.stop()


def test_scorer_assembles_a_group_whose_members_arrive_in_separate_batches():
    buffer = FakeBuffer(batches=[[traj(0, 0, "a", group_size=3), traj(1, 0, "b")],
                           [traj(1, 1, "a"), traj(0, 2, "b", group_size=3)],
                           [traj(0, 1, "a", group_size=3)]])
    scorer = make_scorer(buffer, by_text)

    async def main() -> None:
        task = asyncio.create_task(scorer.run())
        while len(buffer.accepted) < 2:
            await asyncio.sleep(0.005)
        scorer.stop()
        await asyncio.wait_for(task, 2)

    run(main())
    assert [g.group_id for g in buffer.accepted] == [1, 0]
    g0 = buffer.accepted[1]
    assert [t.seq_id for t in g0.trajectories] == [0, 1, 2]  # members sorted by seq_id
    assert [t.reward for t in g0.trajectories] == [1.0, 1.0, 0.0]
    assert scorer.assembler.pending() == 0


def _counts(stats: Any) -> dict[str, float]:
    """A report's values without the gauges (memory, hung reward calls)."""
    return {k: v for k, v in stats.values().items()
            if not k.endswith(("/rss_mb", "/reward_calls_hung")) and not k.startswith("memory/")}


def test_scorer_stats_report_the_window_since_the_previous_read():
    buffer = FakeBuffer()
    scorer = make_scorer(buffer, by_text)
    run(scorer.score_batch([traj(0, 0, "a"), traj(0, 1, "boom")]))
    first = scorer.stats()
    assert first.values().pop("scorer/rss_mb") > 0  # the process's resident memory, a gauge
    assert first.values().pop("scorer/reward_calls_hung") == 0  # none timed out
    assert _counts(first) == {"scorer/samples_per_s": 2, "scorer/reward_errors": 1}
    assert isinstance(first.metrics["scorer/samples_per_s"], Rate)  # the Controller divides by the window
    assert isinstance(first.metrics["scorer/reward_errors"], Total)  # ... and adds the windows up
    assert "score" in {sp.kind for sp in first.spans}
    again = scorer.stats()  # read resets: nothing scored since
    assert _counts(again) == {"scorer/samples_per_s": 0, "scorer/reward_errors": 0} and again.spans == []
    run(scorer.score_batch([traj(1, 0, "a"), traj(1, 1, "b")]))
    assert _counts(scorer.stats()) == {"scorer/samples_per_s": 2, "scorer/reward_errors": 0}
    scorer.stop()


def test_two_scorers_complete_every_group_of_a_backed_up_queue_when_group_size_does_not_divide_their_batch():
    # 60 groups of 6 wait in the rollout queue; each scorer takes up to 256 trajectories (not a multiple of 6).
    # A group split between the two would complete in neither, and the trainer would wait for it forever.
    from buffers.replay import ReplayBuffer

    p, size = 30, 6

    async def main() -> list[int]:
        buffer = ReplayBuffer(prompts_per_step=p, group_size=size, max_staleness=1, rollout_capacity=2 * p * size,
                              train_capacity=2 * p)
        ids = await buffer.admit(2 * p, 0)
        await buffer.put_rollouts([traj(g, j, "ab"[j % 2], group_size=size) for g in ids for j in range(size)])
        scorers = [Scorer(scorer_id=i, buffer=buffer, rewards=ThreadRewards(by_text), decode=decode) for i in range(2)]
        loops = [asyncio.create_task(s.run()) for s in scorers]
        try:
            taken = [g.group_id for step in range(2) for g in await buffer.take_step(step, timeout=5.0)]
        finally:
            for s in scorers:
                s.stop()
            await asyncio.gather(*loops)
        return taken

    assert run(main(), timeout=15.0) == list(range(2 * p))


# -- Generator -------------------------------------------------------------------------------------
class FakeEngine:
    """A RolloutEngine that answers each prompt with n one-token completions stamped with its version."""

    def __init__(self, fail_calls: set[int] = frozenset()) -> None:
        self.version = 0
        self.calls = 0
        self.fail_calls = set(fail_calls)  # 0-based indices of generate calls that raise
        self.loads: list[int] = []
        self.closed = False

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        call, self.calls = self.calls, self.calls + 1
        await asyncio.sleep(0)
        if call in self.fail_calls:
            raise RuntimeError("engine blew up")
        return [[Completion(prompt_ids=p, response_ids=[7], logprobs=[-0.5], versions=[self.version],
                            finish_reason="stop") for _ in range(params.n)] for p in prompts]

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.loads.append(version)
        self.version = version

    async def close(self) -> None:
        self.closed = True


class FakeReceiver:
    """Like the in-process channel: the weights are there when asked for, so it is not armed early."""

    arms_early = False

    def __init__(self, version: int) -> None:
        self.version = version

    def receive(self, *, armed: bool = False) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        return {"w": torch.zeros(1)}, self.version, {"sync/bytes": 4.0}


def make_generator(buffer: FakeBuffer, engine: FakeEngine, concurrency: int = 2, rows: Any = None) -> Generator:
    counter = iter(range(10**6))
    prompt_row = rows or (lambda gid: {"prompt": f"q{next(counter)}", "answer": "a"})
    return Generator(generator_id=0, engine=engine, buffer=buffer, prompt_row=prompt_row,
                     encode=lambda row: Prompt([ord(c) for c in row["prompt"]], row["prompt"]),
                     sampling=SamplingParams(n=2, max_new_tokens=1),
                     concurrency=concurrency)


def test_generator_sends_each_completion_with_its_text_decoded_once_a_batch():
    calls = []

    def decode_one(ids: list[int]) -> str:
        return decode(ids)

    decode_one.many = lambda seqs: calls.append(len(seqs)) or [f"t{ids[0]}" for ids in seqs]
    buffer = FakeBuffer()
    gen = make_generator(buffer, FakeEngine())
    gen.decode = decode_one
    run(_run_until(gen, lambda: len(buffer.rollouts) >= 4))
    assert all(t.response_text == "t7" for t in buffer.rollouts)  # FakeEngine answers token 7
    assert calls and all(n % 2 == 0 for n in calls)  # whole groups, one call each put
    assert all(t.baseline_text is None for t in buffer.rollouts)  # no ReMax baseline here


def test_fake_engine_satisfies_the_rollout_engine_protocol():
    assert isinstance(FakeEngine(), RolloutEngine)


async def _run_until(gen: Generator, done: Callable[[], bool], timeout: float = 2.0) -> None:
    task = asyncio.create_task(gen.run())
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        assert not task.done(), f"generator loop died: {task.exception()!r}"
        await asyncio.sleep(0.005)
    gen.stop()
    await asyncio.wait_for(task, 1.0)


def test_generator_releases_groups_as_failed_when_the_engine_raises_and_keeps_going():
    buffer = FakeBuffer()
    engine = FakeEngine(fail_calls={0})
    gen = make_generator(buffer, engine)
    run(_run_until(gen, lambda: len(buffer.rollouts) >= 4))
    # each group is its own engine request: only the group whose call raised fails
    assert buffer.released["failed"] == [0]  # counted once, by the buffer (buffer/failed)
    # the loop kept going: groups 1 and 2 were generated, 2 samples each
    assert {t.group_id for t in buffer.rollouts[:4]} == {1, 2}
    assert sorted(t.seq_id for t in buffer.rollouts[:4]) == [2, 3, 4, 5]


def test_generator_stats_report_the_window_since_the_previous_read():
    buffer = FakeBuffer()
    gen = make_generator(buffer, FakeEngine())
    run(_run_until(gen, lambda: len(buffer.rollouts) >= 4))
    first = gen.stats()
    assert first.values()["generation/tokens_per_s"] == gen.tokens_generated == len(buffer.rollouts)  # 1 token each
    assert {"generate", "wait_gate"} <= {sp.kind for sp in first.spans}
    again = gen.stats()  # read resets: nothing generated since
    assert again.values()["generation/tokens_per_s"] == 0 and again.spans == []
    gen.receiver = FakeReceiver(version=1)
    run(gen.receive_weights())  # in flight: swapped on receipt (the engine keeps no pause record of its own)
    swap = gen.stats()
    assert swap.values()["generation/stall_s"] == swap.values()["generation/stall_s_total"] == gen.swap_s_total > 0
    assert gen.stats().values()["generation/stall_s"] == 0


def test_generator_counts_truncated_prompts_and_reports_the_rows_filtered_at_load():
    buffer = FakeBuffer()
    gen = Generator(generator_id=0, engine=FakeEngine(), buffer=buffer, prompt_row=lambda gid: {"prompt": f"q{gid}"},
                    encode=lambda row: Prompt([1, 2], "whole " + row["prompt"], truncated=row["prompt"] == "q1"),
                    sampling=SamplingParams(n=2, max_new_tokens=1), prompts_filtered=3)
    run(_run_until(gen, lambda: len({t.group_id for t in buffer.rollouts}) >= 3))
    values = gen.stats().values()
    assert values["data/truncated_prompts"] == 1 and values["data/filtered_overlong"] == 3
    q1 = [t for t in buffer.rollouts if t.group_id == 1]
    assert all(t.prompt_truncated and t.prompt_text == "whole q1" for t in q1)
    assert not any(t.prompt_truncated for t in buffer.rollouts if t.group_id != 1)
    assert gen.stats().values()["data/truncated_prompts"] == 0  # a window count: read resets it


class PausingEngine(FakeEngine):
    """An engine that keeps its own record of swap pauses (as TorchEngine and vLLM do), since the start."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[float] = []

    def stats(self) -> dict[str, float]:
        return {"engine/swap_pause_s/sum": sum(self.pauses)}


def test_generator_reports_the_engines_swap_pauses_of_the_window_as_its_stall():
    engine = PausingEngine()
    gen = make_generator(FakeBuffer(), engine)
    engine.pauses.append(0.25)
    first = gen.stats()
    engine.pauses.append(0.5)
    second = gen.stats().metrics
    assert first.values()["generation/stall_s"] == 0.25
    assert second["generation/stall_s"] == Sum(0.5) and second["generation/stall_s_total"] == Total(0.5)
    assert second["generation/stall_share"] == Share(0.5)  # of this generator's time in the step's window


@pytest.mark.parametrize("mode", ["in_flight", "between_requests"])
def test_generator_applies_received_weights_before_its_next_admission(mode):
    buffer = FakeBuffer()
    engine = FakeEngine()
    gen = make_generator(buffer, engine, concurrency=1)
    gen.weight_update = mode
    gen.receiver = FakeReceiver(version=3)

    async def main() -> None:
        stats = await gen.receive_weights()
        assert stats == {"sync/bytes": 4.0}
        # in flight: handed to the engine on receipt; between requests: staged until the loop swaps
        assert engine.loads == ([3] if mode == "in_flight" else [])
        await _run_until(gen, lambda: len(buffer.rollouts) >= 2)

    run(main())
    assert engine.loads == [3]
    assert buffer.admits[0][1] == 3  # admitted with the new version
    assert all(t.min_version == 3 and t.versions == [3] for t in buffer.rollouts)


class ArmedReceiver:
    """Like the collective receiver: may be called ahead of the send (`arms_early`) and waits for it."""

    arms_early = True

    def __init__(self) -> None:
        self.sent = threading.Event()
        self.calls: list[bool] = []

    def receive(self, *, armed: bool = False) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        self.calls.append(armed)
        assert self.sent.wait(5)
        time.sleep(0.02)  # the transfer
        return {"w": torch.ones(1)}, 4, {"sync/seconds": 0.02, "sync/bytes": 4.0}


def test_generator_armed_receive_waits_for_the_send_and_records_only_the_transfer():
    engine = FakeEngine()
    gen = make_generator(FakeBuffer(), engine)
    assert not gen.can_arm_receive()  # no receiver yet
    gen.receiver = FakeReceiver(version=3)
    assert not gen.can_arm_receive()  # a receiver that cannot wait for the send
    with pytest.raises(RuntimeError, match="cannot wait"):
        run(gen.receive_weights(armed=True))
    gen.receiver = ArmedReceiver()
    assert gen.can_arm_receive()

    async def main() -> dict[str, float]:
        armed = asyncio.ensure_future(gen.receive_weights(armed=True))
        await asyncio.sleep(0.3)  # the trainer still trains; the loop is free meanwhile
        assert not armed.done()
        gen.receiver.sent.set()
        return await armed

    assert run(main())["sync/bytes"] == 4.0
    assert gen.receiver.calls == [True] and engine.loads == [4]
    (span,) = [sp for sp in gen.recorder.drain() if sp.kind == "weights_recv"]
    assert span.end - span.start == pytest.approx(0.02, abs=0.01)  # not the 0.3 s spent armed


def test_generator_stop_ends_run_promptly_while_the_gate_is_closed():
    buffer = FakeBuffer(admit_ids=0)  # the gate never has room
    gen = make_generator(buffer, FakeEngine())

    async def main() -> float:
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(0.05)
        assert not task.done()
        t0 = time.monotonic()
        gen.stop()
        await asyncio.wait_for(task, 1.0)
        return time.monotonic() - t0

    assert run(main()) < 0.5


class BatchingEngine(FakeEngine):
    """A FakeEngine with the native engine's `submit_many`: records how many calls each post carried."""

    def __init__(self) -> None:
        super().__init__()
        self.posts: list[int] = []

    def submit_many(self, calls: list[tuple[list[list[int]], SamplingParams]]) -> list[Any]:
        self.posts.append(len(calls))
        return [self.generate(prompts, params) for prompts, params in calls]


def test_generator_posts_the_groups_it_was_admitted_together_in_one_engine_call_and_fails_a_bad_row_alone():
    buffer = FakeBuffer(admit_ids=3)
    engine = BatchingEngine()
    asked: list[int] = []

    def prompt_row(gid: int) -> dict[str, str]:
        asked.append(gid)
        return {"question": "no prompt key"} if gid == 1 else {"prompt": f"q{gid}", "answer": "a"}

    gen = make_generator(buffer, engine, concurrency=3, rows=prompt_row)
    run(_run_until(gen, lambda: len(buffer.rollouts) >= 4 and buffer.released.get("failed")))
    assert engine.posts == [2]  # groups 0 and 2 in one post; group 1's row failed before it
    assert buffer.released["failed"] == [1] and asked == [0, 1, 2]  # each row read once
    assert sorted(t.group_id for t in buffer.rollouts) == [0, 0, 2, 2]
    assert gen.gate._users == 0  # every group let the engine go (a sleep is not kept waiting)


def test_generator_fails_groups_whose_rows_lack_the_prompt_key():
    buffer = FakeBuffer()
    rows = iter([{"question": "no prompt key"}, {"question": "neither"}])

    def prompt_row(gid: int) -> dict[str, str]:
        return next(rows, {"prompt": "ok"})

    gen = make_generator(buffer, FakeEngine(), rows=prompt_row)
    run(_run_until(gen, lambda: len(buffer.rollouts) >= 2))
    assert buffer.released["failed"] == [0, 1]
    assert buffer.rollouts[0].group_id == 2 and buffer.rollouts[0].prompt_text == "ok"


def test_scorer_keeps_scoring_after_more_hung_rewards_than_worker_threads():
    # A hung call cannot be killed; it must not hold a slot that later calls need (a 4-thread pool
    # once failed every later sample after four hangs, so no group was ever accepted again).
    buffer = FakeBuffer()
    release = threading.Event()

    def hangs(prompt: str, completion: str, **fields: Any) -> float:
        if completion == "hang":
            release.wait(10)
        return 1.0 if completion == "a" else 0.0

    scorer = make_scorer(buffer, hangs, timeout_s=0.05)
    try:
        run(scorer.score_batch([traj(g, j, "hang") for g in range(3) for j in range(2)]))
        run(scorer.score_batch([traj(10, 0, "a"), traj(10, 1, "b")]))
    finally:
        release.set()
        scorer.stop()
    assert buffer.released["failed"] == [0, 1, 2]
    assert [g.group_id for g in buffer.accepted] == [10]
    assert [t.reward for t in buffer.accepted[0].trajectories] == [1.0, 0.0]


class HeldBuffer(FakeBuffer):
    """Admits like the gate after `note_held`: at the newer of the asked and the noted version (recorded per
    group id)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: int | None = None
        self.admitted_at: dict[int, int] = {}

    async def admit(self, max_groups: int, version: int, timeout: float | None = None, holder=None) -> list[int]:
        await asyncio.sleep(0.002)
        at = max(version, -1 if self.held is None else self.held)
        ids = await super().admit(max_groups, version, timeout, holder)
        self.admitted_at.update((gid, at) for gid in ids)
        return ids


class SlowSwapEngine(FakeEngine):
    """load_weights takes a while (a swap waiting for its decode-step boundary); records the buffer's
    held version when the swap begins."""

    def __init__(self, buffer: HeldBuffer) -> None:
        super().__init__()
        self.buffer = buffer
        self.held_at_swap: list[int | None] = []

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        time.sleep(0.05)  # the buffer's note is under way meanwhile
        self.held_at_swap.append(self.buffer.held)
        super().load_weights(tensors, version)


def test_generator_notes_a_received_version_before_the_swap_lands_and_samples_at_it_only_after():
    buffer = HeldBuffer()
    engine = SlowSwapEngine(buffer)
    gen = make_generator(buffer, engine, concurrency=1)
    gen.receiver = FakeReceiver(version=3)

    async def main() -> None:
        run_task = asyncio.create_task(gen.run())  # admits and samples while the swap is under way
        await asyncio.sleep(0.02)
        await gen.receive_weights()  # returns once the swap landed
        assert engine.version == 3
        n = len(buffer.rollouts)
        t0 = time.monotonic()
        while len(buffer.rollouts) < n + 4:
            assert time.monotonic() - t0 < 2 and not run_task.done()
            await asyncio.sleep(0.005)
        gen.stop()
        await asyncio.wait_for(run_task, 1.0)

    run(main())
    assert engine.held_at_swap == [3]  # the buffer heard of version 3 before the swap landed
    assert 3 in buffer.admitted_at.values()  # and admitted at it
    # no group was sampled at an older version than the one it was admitted at (the gate's bound)
    assert all(t.min_version >= buffer.admitted_at[t.group_id] for t in buffer.rollouts)
    assert {t.min_version for t in buffer.rollouts} == {0, 3}


class DecodingEngine(FakeEngine):
    """An engine that counts decode forwards and the sequences they carried, since the start (as TorchEngine)."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0
        self.decode_tokens = 0

    def stats(self) -> dict[str, float]:
        return {"engine/decode_forwards": float(self.forwards), "engine/decode_tokens": float(self.decode_tokens)}


def test_generator_reports_the_windows_decode_batch_and_its_share_of_the_slots():
    engine = DecodingEngine()
    gen = make_generator(FakeBuffer(), engine)
    slots = gen.concurrency * gen.sampling.n
    engine.forwards, engine.decode_tokens = 4, 4 * slots  # full: every slot decoding
    first = gen.stats().metrics
    assert first["generation/decode_batch"] == Mean(slots, weight=4)
    assert first["generation/occupancy"] == Mean(1.0, weight=4)
    engine.forwards, engine.decode_tokens = 10, 4 * slots + 6  # 6 more forwards of one sequence each: the tail
    second = gen.stats().metrics
    assert second["generation/decode_batch"] == Mean(1.0, weight=6)
    assert second["generation/occupancy"] == Mean(1 / slots, weight=6)
    assert "generation/decode_batch" not in gen.stats().metrics  # no decode step in the window: no value
