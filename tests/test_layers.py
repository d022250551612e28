"""The house's floors, read from the source (every import, module-level or inside a function).

Arrows point one way (STYLE.md). The library: trees <- forest <- runs <- ops / planner <- schedule <- modeling
<- engine <- trainers; the planner is a pure function of forests (no torch, no model code) and the
kernel layer holds kernels only. Beside it, the forest sources (conversations, the tool environment,
synthetic workloads) read only the floor; above it, the lab (benchmarks, calibration, the planner's
baselines, reports and plots) and on top the app (the CLI, recipes, console, train-compare). Nothing
in the library imports the sources, the lab or the app, and no module imports itself back through
a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "harts_hf"
BASE = {"checks", "chunking", "trees", "forest", "runs"}
LIBRARY = {"ops", "planner", "schedule", "modeling", "engine", "trainers"}
MAY_IMPORT = {  # top-level part of harts_hf -> the parts it may import (besides itself)
    "checks": set(),
    "chunking": set(),
    "trees": set(),
    "forest": {"checks", "trees"},
    "runs": {"checks", "trees", "forest"},
    "ops": BASE,
    "planner": BASE,
    "sources": BASE,
    "schedule": BASE | {"ops", "planner"},
    "modeling": BASE | {"ops", "schedule"},
    "engine": BASE | {"ops", "modeling", "planner", "schedule"},
    "trainers": BASE | {"ops", "modeling", "planner", "schedule", "engine"},
    "lab": BASE | LIBRARY | {"sources"},
    "app": BASE | LIBRARY | {"sources", "lab"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str) -> tuple[set[str], set[str]]:
    """(harts_hf modules ``name`` imports, top-level third-party packages it imports)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("harts_hf"):
                theirs.add(target.split(".")[0])
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                ours.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                (ours if alias.name.startswith("harts_hf") else theirs).add(alias.name.split(".")[0])
    return {m for m in ours if m in MODULES and m != name}, theirs


GRAPH = {name: _imports(name)[0] for name in MODULES}


def _part(name: str) -> str:
    return name.split(".")[1] if "." in name else name


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _part(n) in MAY_IMPORT))
def test_imports_point_down(name):
    allowed = MAY_IMPORT[_part(name)] | {_part(name)}
    wrong = sorted(m for m in GRAPH[name] if _part(m) not in allowed)
    assert not wrong, f"{name} imports {wrong}: a higher floor"


def test_the_planner_is_pure():
    for name in MODULES:
        if _part(name) == "planner":
            assert not _imports(name)[1] & {"torch", "transformers", "trl"}, f"{name} imports model code"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
