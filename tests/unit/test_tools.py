"""Tools: the call format, the AST calculator and the ToolBox turning every failure into an error observation
(the sandboxed Python tool: test_sandbox.py)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.envs.tools import TextCall, ToolBox, calculate, calculator, make_toolbox, parse_call


def run(coro):
    return asyncio.run(coro)


def test_parse_call_named_default_and_plain_answers():
    names = frozenset({"calculator", "python"})
    assert parse_call("calculator:2+3*4", names) == TextCall("calculator", "2+3*4")
    assert parse_call("7*8=", names, default="calculator") == TextCall("calculator", "7*8")
    assert parse_call("56", names, default="calculator") is None
    assert parse_call("nosuch:1", names) is None


def test_calculator_evaluates_arithmetic_and_refuses_everything_else():
    assert calculate("2+3*4") == 14 and calculate("(1+2)**3 - 7//2") == 24 and calculate("-3%4") == 1
    assert run(calculator("7/2")) == "3.5" and run(calculator("6/2")) == "3"
    for bad in ("__import__('os').system('true')", "a+1", "2**1000", "1/0", "[1]*3", "x" * 300):
        with pytest.raises(ValueError):
            calculate(bad)


def test_calculator_refuses_huge_integers_before_computing_them():
    import time

    # unchecked, the last one takes ~30 s of CPU on the event loop, where no timeout can interrupt it
    t0 = time.perf_counter()
    for bad in ("(9**64)**64", "(((9**64)**64)**64)**64", "(2**64)**64", "(10**60*10**60)**40"):
        with pytest.raises(ValueError, match="too large"):
            calculate(bad)
    assert time.perf_counter() - t0 < 0.1
    assert calculate("3**64*3**64") == 3**128 and calculate("(2**32)**2") == 2**64
    with pytest.raises(ValueError, match="not finite"):  # floats overflow to inf in constant time
        calculate("1e300*1e300")
    with pytest.raises(ValueError, match="too large"):  # or raise OverflowError
        calculate("1e300**2")


def test_toolbox_turns_raise_hang_and_garbage_into_error_observations():
    async def boom(args):
        raise RuntimeError("tool broke")

    async def hang(args):
        await asyncio.sleep(60)

    async def garbage(args):
        return 42

    box = ToolBox({"boom": boom, "hang": hang, "garbage": garbage, "calc": calculator}, timeout_s=0.05)
    assert run(box.call(TextCall("boom", ""))) == "error: RuntimeError: tool broke"
    assert "timed out" in run(box.call(TextCall("hang", "")))
    assert "returned int" in run(box.call(TextCall("garbage", "")))
    assert "unknown tool" in run(box.call(TextCall("nope", "")))
    assert run(box.call(TextCall("calc", "1/0"))) == "error: ValueError: division by zero"
    assert run(box.call(TextCall("calc", "2+2"))) == "4"
    assert box.calls == 6 and box.errors == 5


def test_make_toolbox_by_name_with_aliases():
    box = make_toolbox(["calculator"], aliases={"c": "calculator"})
    assert box.names == {"calculator", "c"} and run(box.call(TextCall("c", "3*3"))) == "9"
    with pytest.raises(ValueError, match="unknown tool"):
        make_toolbox(["shell"])
