"""Tools: the call format, the AST calculator, the sandboxed Python tool (time, memory, network limits) and
the ToolBox turning every failure into an error observation."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.envs.tools import PythonTool, ToolBox, ToolCall, calculate, calculator, make_toolbox, parse_call


def run(coro):
    return asyncio.run(coro)


def test_parse_call_named_default_and_plain_answers():
    names = frozenset({"calculator", "python"})
    assert parse_call("calculator:2+3*4", names) == ToolCall("calculator", "2+3*4")
    assert parse_call("7*8=", names, default="calculator") == ToolCall("calculator", "7*8")
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
    assert run(box.call(ToolCall("boom", ""))) == "error: RuntimeError: tool broke"
    assert "timed out" in run(box.call(ToolCall("hang", "")))
    assert "returned int" in run(box.call(ToolCall("garbage", "")))
    assert "unknown tool" in run(box.call(ToolCall("nope", "")))
    assert run(box.call(ToolCall("calc", "1/0"))) == "error: ValueError: division by zero"
    assert run(box.call(ToolCall("calc", "2+2"))) == "4"
    assert box.calls == 6 and box.errors == 5


@pytest.fixture(scope="module")
def py() -> PythonTool:
    return PythonTool(timeout_s=3.0, memory_mb=256, cpu_s=2)


def test_python_tool_runs_code_and_reports_errors(py):
    assert run(py("print(6*7)")) == "42"
    assert run(py("raise ValueError('bad input')")) == "error: ValueError: bad input"


def test_python_tool_limits_time_and_memory(py):
    quick = PythonTool(timeout_s=0.5, cpu_s=5)
    assert "timed out" in run(quick("import time\ntime.sleep(30)"))
    out = run(py("x = bytearray(1024 * 2**20)\nprint(len(x))"))
    assert out.startswith("error:") and "MemoryError" in out


def test_python_tool_keeps_only_a_bounded_part_of_a_flood_of_output():
    import resource

    tool = PythonTool(timeout_s=10.0, max_output=100)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    out = run(tool("import sys\nfor _ in range(300):\n    sys.stdout.write('x' * 2**20)"))  # 300 MiB
    assert out == "x" * 100
    # the parent never held the flood (communicate() would have buffered all 300 MiB here)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100 * 1024
    err = run(tool("import sys\nsys.stderr.write('noise\\n' * 10**6)\nraise KeyError('last line')"))
    assert err == "error: KeyError: 'last line'"  # the tail of stderr is kept: its last line is the error


def test_python_tool_has_no_network(py):
    code = "import socket\ns = socket.create_connection(('127.0.0.1', 9), timeout=1)\nprint('connected')"
    out = run(py(code))
    assert out.startswith("error:") and "connected" not in out
    assert py.isolation in ("namespace", "socket_block")


def test_make_toolbox_by_name_with_aliases():
    box = make_toolbox(["calculator"], aliases={"c": "calculator"})
    assert box.names == {"calculator", "c"} and run(box.call(ToolCall("c", "3*3"))) == "9"
    with pytest.raises(ValueError, match="unknown tool"):
        make_toolbox(["shell"])


def test_network_namespace_blocks_even_raw_sockets():
    import socket

    tool = PythonTool(timeout_s=3.0)
    if tool.isolation != "namespace":
        pytest.skip("unshare -rn is not available here; the python tool falls back to the socket.socket block")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = ("import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\ns.settimeout(1)\n"
            f"s.connect(('127.0.0.1', {port}))\nprint('connected')")
    try:
        assert run(PythonTool(isolation="socket_block")(code)) == "connected"  # the fallback is bypassable
        out = run(tool(code))
        assert out.startswith("error:") and "connected" not in out
    finally:
        server.close()
