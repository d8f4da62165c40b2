"""The layers stay apart: the library's packages in one order from the configuration up to the CLI (`LAYERS`),
no import upward and no import cycle; engines/, buffers/ and transports/ use none of asyncrl's internals (the
few asyncrl modules they share are leaves); Ray is imported only where actors are built and launched (roles are
tested without it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What engines/, buffers/ and transports/ may import from asyncrl: the wire messages, the registry and the
# typed metric and span records every role reports in. Each of these is a leaf: it imports no other asyncrl
# module. Engines may also use transports/ (the receiving half of a transport runs inside an engine's own
# workers); transports/ uses neither engines/ nor buffers/.
NEUTRAL = ("asyncrl.messages", "asyncrl.registry", "asyncrl.telemetry.metrics", "asyncrl.telemetry.memory",
           "asyncrl.telemetry.spans")
NEUTRAL_FILES = ("asyncrl/messages.py", "asyncrl/registry.py", "asyncrl/telemetry/metrics.py",
                 "asyncrl/telemetry/memory.py", "asyncrl/telemetry/spans.py")
BELOW = ("engines", "buffers", "transports")  # the packages below asyncrl/
RAY_MODULES = {"asyncrl/deploy/actors.py", "asyncrl/deploy/launch.py"}


def _runtime_imports(path: Path) -> list[str]:
    """Modules `path` imports at run time (anywhere, functions included; not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_engines_buffers_and_transports_import_only_the_neutral_asyncrl_modules():
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in _files(*BELOW)
           for name in _runtime_imports(p) if _within(name, ("asyncrl",)) and not _within(name, NEUTRAL)]
    assert bad == []


# What engines/ may import from transports/: the Protocols and stats (base) and the receiving halves made for an
# engine's own workers (vllm: a worker's group membership; sglang: the header an update announces). The collective
# group, bucketing, IPC and the in-process channel are the transports' internals.
ENGINE_TRANSPORT_API = ("transports.base", "transports.vllm", "transports.sglang")


def test_engines_import_only_the_receiving_halves_transports_make_for_them():
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in _files("engines") for name in _runtime_imports(p)
           if _within(name, ("transports",)) and not _within(name, ENGINE_TRANSPORT_API)]
    assert bad == []


def test_transports_use_neither_engines_nor_buffers():
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in _files("transports")
           for name in _runtime_imports(p) if _within(name, ("engines", "buffers"))]
    assert bad == []


def test_the_neutral_modules_are_leaves_of_asyncrl():
    files = [ROOT / f for f in NEUTRAL_FILES]
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in files
           for name in _runtime_imports(p) if _within(name, ("asyncrl", *BELOW)) and not _within(name, NEUTRAL)]
    assert bad == []


def test_ray_is_imported_only_by_the_actor_and_launch_modules():
    bad = [str(p.relative_to(ROOT)) for p in _files("asyncrl", *BELOW)
           if str(p.relative_to(ROOT)) not in RAY_MODULES and _within_any_ray(_runtime_imports(p))]
    assert bad == []


def _within_any_ray(names: list[str]) -> bool:
    return any(_within(n, ("ray",)) for n in names)


def test_the_layering_check_sees_imports_inside_functions_but_not_type_checking_blocks(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import asyncrl.config\n"
                   "def f():\n    import ray\n    from asyncrl.roles import trainer\n")
    names = _runtime_imports(src)
    assert "ray" in names and "asyncrl.roles" in names and "asyncrl.config" not in names


def test_the_runtime_asks_an_engines_traits_and_never_compares_its_name():
    """`rollout.engine == "torch"` and the like: the capability it stands for is a field of engines.base.EngineTraits,
    so that a new engine declares it once instead of being looked for in every comparison."""
    import re

    comparison = re.compile(r"""(engine\s*[!=]=|[!=]=\s*["'](torch|vllm|sglang)["']|engine\s+(not\s+)?in\s*[(\[{])""")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("asyncrl", "transports", "buffers") for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if comparison.search(line.split("#")[0])]
    assert not found, "\n".join(found)


def test_every_registered_engine_declares_its_traits_and_an_unknown_one_gets_one_line():
    import pytest

    from engines.base import ENGINE_TRAITS, IPC_ENGINES, SLEEPING_ENGINES, WEIGHT_TRANSPORTS, available_engines, traits

    assert set(available_engines()) == set(ENGINE_TRAITS)
    assert traits("torch").in_process and traits("torch").ipc and not traits("vllm").in_process
    assert WEIGHT_TRANSPORTS == {"torch": "bucketed", "vllm": "bucketed", "sglang": "per_tensor"}
    assert IPC_ENGINES == SLEEPING_ENGINES == {"torch"}
    with pytest.raises(KeyError, match="rollout engine 'tgi' declares no traits.*known: sglang, torch, vllm"):
        traits("tgi")


LIBRARY = ("asyncrl", *BELOW)  # the library's packages (benchmarks/, examples/ and tests/ are not)


def _module_graph() -> dict[str, set[str]]:
    """module -> the library modules it imports at run time (functions included, `if TYPE_CHECKING:` not); `from
    pkg import name` counts as importing pkg.name where that is a module, else pkg."""
    files = {}
    for path in _files(*LIBRARY):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for stmt in node.body for n in ast.walk(stmt)}
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                               for a in node.names)
        graph[module] = {t for t in map(owner, targets) if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_library_imports_itself_back_through_others():
    """No import cycle between the library's modules (a function-level import counts: it is a cycle the moment the
    function runs; a type-only import under TYPE_CHECKING does not)."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# The library's packages from the bottom up: a module may import its own layer and the layers below it, never one
# above (a type-only import under TYPE_CHECKING excepted). A module outside every entry fails the test: place it.
LAYERS: list[tuple[str, ...]] = [
    ("asyncrl.messages", "asyncrl.registry", "asyncrl.errors", "asyncrl.aio", "asyncrl.heap", "asyncrl.tasks"),
    ("asyncrl.config",),  # the schema, the loader, the checks (each subsystem's by import path only)
    ("asyncrl.telemetry",),
    ("transports",),
    ("engines",),
    ("buffers", "asyncrl.pipeline", "asyncrl.checkpoints", "asyncrl.algorithms", "asyncrl.data"),
    ("asyncrl.rewards",),
    ("asyncrl.envs", "asyncrl.training"),
    ("asyncrl.roles",),
    ("asyncrl.control",),  # the driver: it sees roles only as proxies
    ("asyncrl.deploy",),  # builds the roles and hosts them (Ray or one process)
    ("asyncrl.planning", "asyncrl.report", "asyncrl.sweep", "asyncrl.serve"),
    ("asyncrl.runtime",),
    ("asyncrl.cli", "asyncrl.cli_serve", "asyncrl"),  # `asyncrl` itself: its lazy `Runtime` attribute
]


def _layer(module: str) -> int | None:
    """The index in LAYERS of the most specific entry that holds `module`."""
    best: tuple[int, int] | None = None
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                if best is None or len(entry) > best[1]:
                    best = (i, len(entry))
    return None if best is None else best[0]


def test_every_library_module_has_a_layer():
    assert [m for m in _module_graph() if _layer(m) is None] == []


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
            for module, targets in sorted(graph.items()) for target in sorted(targets)
            if (_layer(module) or 0) < (_layer(target) or 0)]


def test_no_module_imports_a_package_above_its_own():
    upward = _upward(_module_graph())
    assert upward == [], "\n".join(upward)


def test_the_layer_check_sees_an_upward_import():
    assert _layer("asyncrl.config.loader") == 1 and _layer("asyncrl.deploy.launch") == 10
    assert _layer("asyncrl") == len(LAYERS) - 1 and _layer("asyncrl.runtime") == len(LAYERS) - 2
    graph = {"asyncrl.config.loader": {"asyncrl.deploy.launch", "asyncrl.registry"},
             "asyncrl.deploy.launch": {"asyncrl.config.loader", "asyncrl.deploy.actors"}}
    assert _upward(graph) == ["asyncrl.config.loader (layer 1) imports asyncrl.deploy.launch (layer 10)"]


def test_the_launcher_and_the_buffers_process_start_without_torch_or_transformers():
    """What every run starts with imports neither torch nor transformers (together 3-5 s of CPU per process on
    these machines): the launcher's modules, and the buffer's actor with its scorers' builders and a model folder's
    tokenizer check. Only the roles that need them import them, when they are built."""
    import subprocess
    import sys

    code = ("import sys; import asyncrl.deploy.launch, asyncrl.deploy.actors, asyncrl.deploy.build_scoring, "
            "engines.hf; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
