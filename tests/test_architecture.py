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
    assert "elastic_ext.rendezvous.factory" in graph["elastic_ext.plugin"]
    assert "elastic_ext.rendezvous.handler" in graph["elastic_ext.rendezvous.factory"]
    assert "elastic_ext.local.job" in graph["elastic_ext.chaos.runner"]
    assert "elastic_ext.local.processes" in graph["elastic_ext.local.job"]


MAX_RENDEZVOUS_LINES = 400
"""One job per module: a rendezvous module over this many lines says why in its docstring."""
OVER_LIMIT_REASON = f"Over {MAX_RENDEZVOUS_LINES} lines because"


@pytest.mark.parametrize("path", sorted((PACKAGE / "rendezvous").glob("*.py")),
                         ids=lambda path: path.name)
def test_a_rendezvous_module_is_short_or_says_why_not(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    assert lines <= MAX_RENDEZVOUS_LINES or OVER_LIMIT_REASON in docstring, (
        f"{path.relative_to(ROOT)} has {lines} lines: split it by job, or give the reason "
        f"in its module docstring (a line with '{OVER_LIMIT_REASON} ...')")
