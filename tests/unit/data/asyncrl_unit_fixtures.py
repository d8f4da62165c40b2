"""Importable functions for unit tests that resolve 'module:function' specs (data sources, rewards).

The test modules put this folder on sys.path; nothing here is part of asyncrl.
"""

from __future__ import annotations

NOT_A_FUNCTION = 3


# -- data sources: fn(split=..., seed=...) -> iterable of rows ------------------------------------------


def rows(split, seed):
    return ({"prompt": f"{split}-{i}", "answer": str(i), "seed": seed} for i in range(5))


def rows_kwargs(**kwargs):
    return [{"prompt": f"{kwargs['split']}-kw", "seed": kwargs["seed"]}]


def rows_without_seed(split):
    return [{"prompt": split}]


def rows_missing_prompt(split, seed):
    return [{"prompt": "ok"}, {"question": "no prompt"}, "not a dict"]


# -- reward functions: fn(prompt, completion, **fields) -> float ----------------------------------------


def reward_all_fields(prompt, completion, **fields):
    """Scores 1.0 when the completion equals the row's answer; echoes the fields it saw via `seen`."""
    reward_all_fields.seen = dict(fields)
    return 1.0 if completion == fields["answer"] else 0.0


def reward_named(prompt, completion, answer, bonus=0.0):
    return (1.0 if completion == answer else 0.0) + bonus


def reward_varargs(*args, **kwargs):
    return float(len(args))


def reward_one_arg(text):
    return 0.0


def reward_swapped(completion, prompt, **fields):
    return 0.0


def reward_positional_only_extra(prompt, completion, answer, /):
    return 0.0


async def reward_async(prompt, completion, **fields):
    return 0.0


def reward_returns(value):
    """A reward function returning `value` whatever it is asked."""

    def reward(prompt, completion, **fields):
        return value

    return reward


def reward_misbehaves(prompt, completion, **fields):
    """What a reward can do to the process it runs in, chosen by the completion (reward.isolation tests):
    'pid' returns the worker's process id; 'sleep' sleeps; 'regex' holds the interpreter lock in one long C
    call; 'exit' and 'segv' end the process; 'alloc' allocates 1 GiB; 'print' writes to stdout; 'boom'
    raises KeyError; 'custom' raises an exception type of this module; 'nan' returns NaN; anything else scores
    its length."""
    import ctypes
    import os
    import re
    import time

    if completion == "pid":
        return float(os.getpid())
    if completion == "sleep":
        time.sleep(60)
    if completion == "regex":  # catastrophic backtracking: minutes inside the regex engine, lock held
        re.match(r"(a+)+$", "a" * 64 + "b")
    if completion == "exit":
        os._exit(1)
    if completion == "segv":
        ctypes.string_at(0)
    if completion == "alloc":
        return float(len(bytearray(2**30)))
    if completion == "print":
        print("a reward that prints must not corrupt the wire\n" * 1000)
    if completion == "boom":
        raise KeyError("boom")
    if completion == "custom":
        raise CustomRewardError("custom")
    if completion == "nan":
        return float("nan")
    return float(len(completion))


class CustomRewardError(Exception):
    pass


# -- reward function forms (docs/rewards.md): batched, TRL-style, async, components, the sample's extras ----


def _batched(fn):
    from asyncrl.rewards import batched

    return batched(fn)


@_batched
def reward_batched(prompts, completions, answer):
    """Marked batched: one call per batch; records the batch sizes it saw."""
    reward_batched.sizes.append(len(completions))
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


reward_batched.sizes = []


def trl_accuracy(completions, answer, **kwargs):
    """TRL's reward_funcs shape (no decorator): completions and dataset columns as lists."""
    trl_accuracy.kwargs = sorted(kwargs)
    return [float(c == a) for c, a in zip(completions, answer)]


def trl_wrong_length(completions, **kwargs):
    return [1.0]


async def reward_async_len(prompt, completion, delay=0.0):
    """Awaited on the scorer's loop; counts how many calls are in flight at once."""
    import asyncio

    reward_async_len.active += 1
    reward_async_len.peak = max(reward_async_len.peak, reward_async_len.active)
    try:
        await asyncio.sleep(float(delay))
        if completion == "hang":
            await asyncio.sleep(60)
        return float(len(completion))
    finally:
        reward_async_len.active -= 1


reward_async_len.active = 0
reward_async_len.peak = 0


def reward_parts(prompt, completion, answer):
    """Two components at once: correctness and a format bonus."""
    return {"correct": float(completion == answer), "short": 1.0 if len(completion) <= 2 else 0.0}


def reward_sees_extras(prompt, completion, finish_reason, completion_tokens):
    """-1 for a response cut at max_new_tokens, else its token count."""
    return -1.0 if finish_reason == "length" else float(completion_tokens)


def reward_extras_kwargs(prompt, completion, **fields):
    reward_extras_kwargs.seen = dict(fields)
    return 0.0


def reward_one(prompt, completion, **fields):
    return 1.0
