"""Reward function forms (per sample, batched, async), what a function is told about the sample (finish
reason, token count), and weighted components: how they add up, what fails a call, how they are named."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from asyncrl.rewards import Call, Score, batched, call_reward, check_reward, resolve_reward
from asyncrl.rewards.combine import RewardSet, combine, component_means
from asyncrl.rewards.loader import FunctionComponent, is_async, is_batched
from tests.fakes import ThreadRewards

FIX = "asyncrl_unit_fixtures"


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "data"))


def fixture(name: str):
    import asyncrl_unit_fixtures

    return getattr(asyncrl_unit_fixtures, name)


def values(fn, calls, **kw) -> list:
    return asyncio.run(FunctionComponent(fn, **kw).values([Call(*c) for c in calls]))


# -- what the function is told -------------------------------------------------------------------------


def test_a_function_that_names_finish_reason_and_completion_tokens_gets_them():
    fn = resolve_reward(f"{FIX}:reward_sees_extras", "answer")
    assert call_reward(fn, "q", "abc", {"answer": "x"}, "stop", 3) == 3.0
    assert call_reward(fn, "q", "abc", {"answer": "x"}, "length", 3) == -1.0


def test_row_fields_named_like_the_extras_do_not_override_the_samples_own():
    fn = resolve_reward(f"{FIX}:reward_sees_extras", "answer")
    assert call_reward(fn, "q", "abc", {"finish_reason": "length", "completion_tokens": 99}, "stop", 3) == 3.0


def test_an_unknown_extra_is_not_passed_and_a_function_that_needs_it_says_so():
    fn = resolve_reward(f"{FIX}:reward_sees_extras", "answer")
    with pytest.raises(ValueError, match="needs finish_reason, which this call does not know .* give it a default"):
        call_reward(fn, "q", "abc", {}, None, 3)
    kwargs_fn = resolve_reward(f"{FIX}:reward_extras_kwargs", "answer")
    call_reward(kwargs_fn, "q", "c", {"answer": "a"})
    assert fixture("reward_extras_kwargs").seen == {"answer": "a"}  # nothing unknown is invented
    call_reward(kwargs_fn, "q", "c", {"answer": "a"}, "length", 7)
    assert fixture("reward_extras_kwargs").seen == {"answer": "a", "finish_reason": "length", "completion_tokens": 7}


# -- forms ---------------------------------------------------------------------------------------------


def test_forms_are_read_off_the_function():
    assert is_batched(fixture("reward_batched")) and not is_async(fixture("reward_batched"))
    assert is_batched(fixture("trl_accuracy"))  # TRL's convention: a `completions` parameter, no decorator
    assert is_async(fixture("reward_async_len")) and not is_batched(fixture("reward_async_len"))
    assert not is_batched(fixture("reward_named")) and not is_async(fixture("reward_named"))
    resolved = resolve_reward(f"{FIX}:reward_async_len", "answer")  # the adapted wrapper keeps the form
    assert is_async(resolved) and not is_batched(resolved)
    assert is_batched(resolve_reward(f"{FIX}:trl_accuracy", "answer"))


def test_a_batched_function_is_called_once_per_batch_with_lists():
    fn = resolve_reward(f"{FIX}:reward_batched", "answer")
    fixture("reward_batched").sizes.clear()
    out = values(fn, [("p", "a", {"answer": "a"}), ("p", "b", {"answer": "a"}), ("p", "c", {"answer": "c"})])
    assert out == [1.0, 0.0, 1.0] and fixture("reward_batched").sizes == [3]


def test_a_trl_reward_function_gets_prompts_columns_and_extras_as_lists():
    fn = resolve_reward(f"{FIX}:trl_accuracy", "answer")
    row = {"prompt": "q", "answer": "a", "level": 2}
    out = values(fn, [("q", "a", row, "stop", 1), ("q", "b", row, "length", 1)])
    assert out == [1.0, 0.0]
    # like TRL, the row's own prompt/completion columns are not passed again
    assert fixture("trl_accuracy").kwargs == ["completion_tokens", "finish_reason", "level", "prompts"]


def test_a_batched_result_of_the_wrong_length_fails_every_sample_and_a_bad_item_only_its_own():
    fn = resolve_reward(f"{FIX}:trl_wrong_length", "answer")
    out = values(fn, [("q", "a", {}), ("q", "b", {})])
    assert all(isinstance(o, ValueError) and "returned 1 values for 2 samples" in str(o) for o in out)

    @batched
    def half_bad(prompts, completions):
        return [1.0, "x", float("nan")]

    first, second, third = values(half_bad, [("q", c, {}) for c in "abc"])
    assert first == 1.0 and isinstance(second, ValueError) and isinstance(third, ValueError)


def test_a_hung_batched_call_times_out_every_sample_of_the_batch():
    @batched
    def hangs(prompts, completions):
        time.sleep(2)
        return [1.0] * len(completions)

    out = values(hangs, [("q", c, {}) for c in "ab"], timeout_s=0.2)
    assert all(isinstance(o, asyncio.TimeoutError) for o in out)


def test_async_calls_run_on_the_loop_at_most_max_concurrency_at_once_each_bounded_by_the_timeout():
    fn = resolve_reward(f"{FIX}:reward_async_len", "answer")
    impl = fixture("reward_async_len")
    impl.peak = 0
    calls = [("q", "x" * (i + 1), {"delay": 0.05}) for i in range(9)] + [("q", "hang", {"delay": 0})]
    out = values(fn, calls, timeout_s=0.5, max_concurrency=3)
    assert out[:9] == [float(i + 1) for i in range(9)]
    assert isinstance(out[9], asyncio.TimeoutError)
    assert impl.peak == 3 and impl.active == 0  # the cap held, and the hung call was cancelled


def test_async_and_batched_functions_need_thread_isolation_and_say_so_in_one_line():
    assert check_reward(f"{FIX}:reward_async", "answer") == []
    for name, form in (("reward_async", "async"), ("trl_accuracy", "batched")):
        (line,) = check_reward(f"{FIX}:{name}", "answer", "reward.functions[1].fn", isolation="process")
        assert line.startswith(f"reward.functions[1].fn: '{FIX}:{name}' is {form}")
        assert "reward.isolation = 'thread'" in line and "\n" not in line


def test_a_batched_function_with_a_positional_only_parameter_is_rejected():
    (line,) = check_reward(f"{FIX}:reward_positional_only_extra", "answer")  # per sample: a signature error
    assert "signature" in line

    @batched
    def stuck(completions, /):
        return []

    from asyncrl.rewards.loader import _adapt

    with pytest.raises(ValueError, match="keyword arguments only"):
        _adapt("m:stuck", stuck)


# -- components ----------------------------------------------------------------------------------------


def test_a_dict_result_is_its_components_and_their_sum():
    out = asyncio.run(ThreadRewards(resolve_reward(f"{FIX}:reward_parts", "answer")).score(
        [("q", "a", {"answer": "a"}), ("q", "bbb", {"answer": "a"})]))
    assert out == [Score(total=2.0, components={"correct": 1.0, "short": 1.0}),
                   Score(total=0.0, components={"correct": 0.0, "short": 0.0})]


def test_weighted_functions_add_up_and_each_named_value_is_kept_unweighted():
    def length(prompt, completion, **f):
        return float(len(completion))

    def parts(prompt, completion, **f):
        return {"x": 1.0, "y": 2.0}

    rewards = RewardSet([FunctionComponent(length, name="length", weight=2.0),
                         FunctionComponent(parts, name="ignored", weight=-0.5),
                         FunctionComponent(lambda p, c, **f: 7.0, name="", weight=1.0)])
    [score] = asyncio.run(rewards.score([("q", "abc", {})]))
    assert score.total == pytest.approx(2.0 * 3 - 0.5 * (1.0 + 2.0) + 7.0)
    assert score.components == {"length": 3.0, "x": 1.0, "y": 2.0}  # a dict's keys name its values


def test_a_call_fails_when_any_component_fails_it():
    def boom(prompt, completion, **f):
        if completion == "b":
            raise KeyError("b")
        return 1.0

    rewards = RewardSet([FunctionComponent(boom, name="boom"), FunctionComponent(lambda p, c, **f: 2.0, name="two")])
    ok, failed = asyncio.run(rewards.score([("q", "a", {}), ("q", "b", {})]))
    assert ok == Score(total=3.0, components={"boom": 1.0, "two": 2.0}) and isinstance(failed, KeyError)


@pytest.mark.parametrize("parts, says", [
    ([("a", 1.0, 1.0), ("", 1.0, {"a": 2.0})], "two reward components are named 'a'"),
    ([("mean", 1.0, 1.0)], "'mean' is reserved"),
    ([("a", float("inf"), 1.0)], "not finite"),
])
def test_components_that_cannot_be_told_apart_or_add_up_fail_the_call(parts, says):
    with pytest.raises(ValueError, match=says):
        combine(parts)


def test_component_means_average_each_component_over_the_samples_that_carry_it():
    means = component_means([{"a": 1.0, "b": 0.0}, {"a": 0.0}, {}, {"a": 0.5, "b": 1.0}])
    assert means == {"reward/a": 0.5, "reward/b": 0.5}
    assert component_means([{}, {}]) == {}


def test_a_closed_reward_set_refuses_to_score():
    rewards = ThreadRewards(lambda p, c, **f: 1.0)
    rewards.close()
    with pytest.raises(RuntimeError, match="after close"):
        asyncio.run(rewards.score([("q", "a", {})]))
