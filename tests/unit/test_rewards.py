"""Reward rules, import-path reward functions, and the checks on what a reward function returns."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncrl.rewards import RULES, call_reward, check_reward, resolve_reward

FIX = "asyncrl_unit_fixtures"


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "data"))


@pytest.mark.parametrize(
    "rule, completion, answer, expected",
    [
        ("exact_match", " 42\n", "42", 1.0),
        ("exact_match", "42 apples", "42", 0.0),
        ("exact_match", "7", 7, 1.0),  # numeric answers from JSON compare as strings
        ("prefix_match", "42 apples", " 42", 1.0),
        ("prefix_match", "apples 42", "42", 0.0),
        ("contains", "the answer is 42.", "42", 1.0),
        ("contains", "the answer is 41", "42", 0.0),
    ],
)
def test_builtin_rule_scores_completion_against_answer(rule, completion, answer, expected):
    fn = resolve_reward(rule, "answer")
    assert call_reward(fn, "q", completion, {"prompt": "q", "answer": answer}) == expected


def test_builtin_rules_are_registered_by_name():
    assert {"exact_match", "prefix_match", "contains"} <= set(RULES.names())


def test_builtin_rule_reads_the_configured_answer_key():
    fn = resolve_reward("exact_match", "target")
    assert call_reward(fn, "q", "5", {"target": "5", "answer": "6"}) == 1.0


def test_builtin_rule_without_answer_field_names_answer_key():
    fn = resolve_reward("exact_match", "answer")
    with pytest.raises(ValueError, match="reward.answer_key") as exc:
        call_reward(fn, "q", "5", {"prompt": "q", "solution": "5"})
    assert "'answer'" in str(exc.value) and "solution" in str(exc.value)


def test_unknown_builtin_rule_suggests_the_closest_name():
    with pytest.raises(ValueError, match=r"^reward\.fn: unknown reward rule 'exact_mach' — did you mean 'exact_match'"):
        resolve_reward("exact_mach", "answer")


def test_import_path_reward_with_kwargs_receives_row_fields():
    fn = resolve_reward(f"{FIX}:reward_all_fields", "answer")
    row = {"prompt": "1+1=", "answer": "2", "level": 3}
    assert call_reward(fn, "1+1=", "2", row) == 1.0
    import asyncrl_unit_fixtures

    # `prompt` is passed positionally, so the row's own `prompt` field is not passed again
    assert asyncrl_unit_fixtures.reward_all_fields.seen == {"answer": "2", "level": 3}


def test_import_path_reward_without_kwargs_gets_only_the_fields_it_names():
    fn = resolve_reward(f"{FIX}:reward_named", "answer")
    assert call_reward(fn, "q", "2", {"prompt": "q", "answer": "2", "unrelated": object()}) == 1.0
    assert call_reward(fn, "q", "2", {"answer": "2", "bonus": 0.5}) == 1.5


def test_named_field_missing_from_row_is_a_clear_error():
    fn = resolve_reward(f"{FIX}:reward_named", "answer")
    with pytest.raises(ValueError, match="needs row field\\(s\\) answer"):
        call_reward(fn, "q", "2", {"prompt": "q"})


def test_varargs_reward_is_accepted():
    fn = resolve_reward(f"{FIX}:reward_varargs", "answer")
    assert call_reward(fn, "q", "c", {"answer": "x"}) == 2.0


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("reward_one_arg", "signature (text)"),
        ("reward_swapped", "signature (completion, prompt, **fields)"),
        ("reward_positional_only_extra", "signature"),
        ("NOT_A_FUNCTION", "not callable (got int)"),
        ("no_such_function", "has no attribute"),
    ],
)
def test_unusable_reward_function_is_one_line_naming_reward_fn(name, fragment):
    errors = check_reward(f"{FIX}:{name}", "answer")
    assert len(errors) == 1
    assert errors[0].startswith("reward.fn: ") and "\n" not in errors[0]
    assert fragment in errors[0]


def test_unimportable_reward_module_says_how_to_fix():
    (error,) = check_reward("no_such_module_xyz:score", "answer")
    assert error.startswith("reward.fn: cannot import module 'no_such_module_xyz'")
    assert "PYTHONPATH" in error


def test_check_reward_accepts_builtin_and_import_path():
    assert check_reward("contains", "answer") == []
    assert check_reward(f"{FIX}:reward_named", "answer") == []


@pytest.mark.parametrize("bad", [float("nan"), math.inf, -math.inf, "1.0", None, [1.0], b"1"])
def test_non_finite_or_non_numeric_result_raises_value_error(bad):
    import asyncrl_unit_fixtures

    fn = asyncrl_unit_fixtures.reward_returns(bad)
    with pytest.raises(ValueError, match="must return a finite number"):
        call_reward(fn, "q", "c", {})


@pytest.mark.parametrize("good, expected", [(1, 1.0), (True, 1.0), (0.25, 0.25), (-2, -2.0)])
def test_numeric_results_are_converted_to_float(good, expected):
    import asyncrl_unit_fixtures

    value = call_reward(asyncrl_unit_fixtures.reward_returns(good), "q", "c", {})
    assert value == expected and type(value) is float


def test_call_rewards_async_calls_one_at_a_time_contains_errors_and_moves_past_a_hung_call():
    import asyncio
    import threading
    import time

    from asyncrl.rewards.loader import HungCalls, call_rewards_async

    active, overlaps, calls = set(), [], []
    guard = threading.Lock()
    release = threading.Event()

    def fn(prompt, completion, **fields):
        with guard:
            if active:
                overlaps.append(sorted(active | {completion}))
            active.add(completion)
            calls.append(completion)
        try:
            if completion == "hang":
                release.wait(5)  # hangs past the timeout; the next calls must not wait for it
            if completion == "boom":
                raise RuntimeError("user bug")
            return "x" if completion == "str" else len(completion)
        finally:
            with guard:
                active.discard(completion)

    items = ["a", "bb", "boom", "hang", "ccc", "str", "dddd"]
    t0 = time.perf_counter()
    hung = HungCalls()
    out = asyncio.run(call_rewards_async(fn, [("p", c, {}) for c in items], timeout_s=0.3, hung=hung))
    elapsed = time.perf_counter() - t0
    assert hung.running == 1  # the "hang" call, still on its thread
    release.set()
    assert out[:2] == [1.0, 2.0] and out[4] == 3.0 and out[6] == 4.0
    assert isinstance(out[2], RuntimeError) and isinstance(out[3], asyncio.TimeoutError)
    assert isinstance(out[5], ValueError)  # a non-number result, as call_reward reports it
    assert elapsed < 2.0
    # one call at a time, except beside a call that already timed out (a hung thread cannot be stopped)
    assert overlaps and all("hang" in o for o in overlaps)
    assert calls == items  # each call made exactly once, in order


def test_hung_reward_calls_are_bounded_and_counted_until_they_return():
    import asyncio
    import threading
    import time

    from asyncrl.rewards.loader import HungCalls, call_rewards_async
    from tests.fakes import ThreadRewards

    release = threading.Event()

    def fn(prompt, completion, **fields):
        if completion == "hang":
            release.wait(10)
        return 1.0

    hung = HungCalls(limit=2)

    async def batch(items):
        return await call_rewards_async(fn, [("p", c, {}) for c in items], timeout_s=0.2, hung=hung)

    out = asyncio.run(batch(["hang", "a", "hang", "b"]))
    assert isinstance(out[0], asyncio.TimeoutError) and out[1] == 1.0 and isinstance(out[2], asyncio.TimeoutError)
    assert isinstance(out[3], RuntimeError) and "reward.timeout_s" in str(out[3])  # 2 hung: no third thread
    assert hung.running == 2
    rewards = ThreadRewards(fn, timeout_s=0.2)  # the roles' view: the count of its components' hung calls
    [failed] = asyncio.run(rewards.score([("p", "hang", {})]))
    assert isinstance(failed, asyncio.TimeoutError) and rewards.hung_calls == 1
    release.set()  # the hung calls return: their threads end, and calls start again
    deadline = time.monotonic() + 5
    while (hung.running or rewards.hung_calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hung.running == rewards.hung_calls == 0
    assert asyncio.run(batch(["a"])) == [1.0]


def test_each_reward_call_is_bounded_from_its_own_start_not_the_batch():
    import asyncio
    import time

    from asyncrl.rewards.loader import HungCalls, call_rewards_async

    def fn(prompt, completion, **fields):
        time.sleep(0.12)  # each call within its 0.3 s timeout; the batch of 5 takes twice that
        return 1.0

    hung = HungCalls()
    out = asyncio.run(call_rewards_async(fn, [("p", str(i), {}) for i in range(5)], timeout_s=0.3, hung=hung))
    assert out == [1.0] * 5 and hung.running == 0


def test_reward_threads_are_reused_between_batches_but_never_after_a_hung_call():
    import asyncio
    import threading

    from asyncrl.rewards.loader import REWARD_THREADS, HungCalls, call_rewards_async

    seen: list[tuple[str, int]] = []
    release = threading.Event()

    def fn(prompt, completion, **fields):
        seen.append((completion, threading.get_ident()))
        if completion == "hang":
            release.wait(10)
        return 1.0

    hung = HungCalls()

    async def batches():
        out = [await call_rewards_async(fn, [("p", c, {}) for c in items], timeout_s=0.2, hung=hung)
               for items in (["a", "b"], ["c"], ["hang", "d"], ["e"])]
        return out

    out = asyncio.run(batches())
    assert out[:2] == [[1.0, 1.0], [1.0]] and out[3] == [1.0]
    assert isinstance(out[2][0], asyncio.TimeoutError) and out[2][1] == 1.0
    thread = dict(seen)
    assert thread["a"] == thread["b"] == thread["c"] == thread["hang"]  # one thread, kept between batches
    assert thread["d"] != thread["hang"] and thread["e"] == thread["d"]  # the hung one is never reused
    hung_thread = next(t for t in threading.enumerate() if t.ident == thread["hang"])
    release.set()  # the hung call returns: its thread ends instead of going back to the idle ones
    hung_thread.join(5)
    assert not hung_thread.is_alive() and hung.running == 0
    assert 1 <= REWARD_THREADS.idle() <= REWARD_THREADS.keep
