"""The package's shape, checked from its source: no import cycles, and the product never
depends on the local-job and chaos tooling (or on the bundled trainer)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elastic_ext"
TOOLING = ("elastic_ext.chaos", "elastic_ext.local")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else \
        module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m in imported_modules(path) if m in modules and m != name}
    return graph


def product_modules() -> list[str]:
    return sorted(m for m in import_graph() if not m.startswith(TOOLING))


def test_there_are_no_import_cycles() -> None:
    graph = import_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)
    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("module", product_modules())
def test_the_product_does_not_depend_on_the_tooling_or_the_trainer(module: str) -> None:
    path = next(p for p in PACKAGE.rglob("*.py") if module_name(p) == module)
    bad = sorted(m for m in imported_modules(path)
                 if m.startswith(TOOLING) or m == "trainer" or m.startswith("trainer."))
    assert not bad, f"{module} imports {bad}"


def test_the_checks_see_the_modules_they_guard() -> None:
    graph = import_graph()
    assert "elastic_ext.agent.setup" in graph["elastic_ext.agent.plugin"]
    assert "elastic_ext.rendezvous.agent.handler" in graph["elastic_ext.agent.setup"]
    assert "elastic_ext.local.job" in graph["elastic_ext.chaos.runner"]
    assert "elastic_ext.local.processes" in graph["elastic_ext.local.job"]


MAX_RENDEZVOUS_LINES = 400
"""One job per module: a rendezvous module over this many lines says why in its docstring."""
OVER_LIMIT_REASON = f"Over {MAX_RENDEZVOUS_LINES} lines because"


@pytest.mark.parametrize("path", sorted((PACKAGE / "rendezvous").rglob("*.py")),
                         ids=lambda path: str(path.relative_to(PACKAGE / "rendezvous")))
def test_a_rendezvous_module_is_short_or_says_why_not(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    assert lines <= MAX_RENDEZVOUS_LINES or OVER_LIMIT_REASON in docstring, (
        f"{path.relative_to(ROOT)} has {lines} lines: split it by job, or give the reason "
        f"in its module docstring (a line with '{OVER_LIMIT_REASON} ...')")


def reachable(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every package module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


RENDEZVOUS = "elastic_ext.rendezvous"
LAYERS = (f"{RENDEZVOUS}.protocol", f"{RENDEZVOUS}.stores", f"{RENDEZVOUS}.agent")
"""The rendezvous' layers, top first: each imports only the layers above it (and the
``settings`` and ``errors`` all three share)."""


@pytest.mark.parametrize("layer", LAYERS)
def test_a_rendezvous_layer_imports_only_the_layers_above_it(layer: str) -> None:
    graph = import_graph()
    below = LAYERS[LAYERS.index(layer) + 1:]
    bad = sorted(f"{module} -> {target}" for module in graph if module.startswith(layer)
                 for target in graph[module] if target.startswith(below))
    assert not bad, "a layer imports one below it: " + ", ".join(bad)
    assert any(module.startswith(layer + ".") for module in graph), f"{layer} is empty"


PROTOCOL_MAY_READ_TIME = {"clock.py", "liveness.py"}
"""``clock`` is the injected clock's real implementation; ``liveness`` takes a clock whose
default is ``time.monotonic``."""
NOT_PURE = ("threading", "socket", "os", "subprocess", "requests", "http", "urllib",
            "select", "torch", "signal", "time")


@pytest.mark.parametrize("path", sorted((PACKAGE / "rendezvous" / "protocol").glob("*.py")),
                         ids=lambda path: path.name)
def test_the_protocol_layer_is_pure(path: Path) -> None:
    forbidden = set(NOT_PURE) - ({"time"} if path.name in PROTOCOL_MAY_READ_TIME else set())
    bad = sorted({m for m in imported_modules(path) if m.split(".")[0] in forbidden})
    assert not bad, f"{path.name} imports {bad}: the protocol does no I/O and keeps no threads"


@pytest.mark.parametrize("root", ["elastic_ext.worker.loop", "elastic_ext.integrations.resume",
                                  "elastic_ext.warm.launcher", "elastic_ext.warm.worker"])
def test_a_worker_imports_neither_the_agent_nor_the_rendezvous(root: str) -> None:
    """A worker never talks to the store: it reaches its agent only through the control
    channel. (``rendezvous.errors`` is shared: ``torch_compat`` raises its ConfigError.)"""
    bad = sorted(m for m in reachable(root, import_graph())
                 if m.startswith(("elastic_ext.agent", f"{RENDEZVOUS}."))
                 and m != f"{RENDEZVOUS}.errors")
    assert not bad, f"{root} reaches {bad}"


def test_the_agent_imports_no_worker_module() -> None:
    """The agent process loads the rendezvous and the warm fork server, never the training
    loop, snapshots or the guard: the plugin stays light inside torchrun."""
    reached = reachable("elastic_ext.agent.plugin", import_graph())
    assert "elastic_ext.rendezvous.agent.handler" in reached
    bad = sorted(m for m in reached if m.startswith(("elastic_ext.worker",
                                                     "elastic_ext.integrations")))
    assert not bad, f"the agent reaches {bad}"
