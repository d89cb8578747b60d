"""The import graph keeps the layers of docs/architecture.md: no loops between the top-level
packages, and the rooms of swarm/peer import only what their rules allow.

Read from the source (every import statement, those inside functions and under TYPE_CHECKING
too: a loop through a deferred import is still a loop), so it needs nothing installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UNITS = ("swarm.cli", "swarm.compute", "swarm.discovery", "swarm.keys", "swarm.peer", "swarm.signaling", "web_peer")
ROLE_MODULES = ("swarm.peer.roles", "swarm.peer.coordinator.role", "swarm.peer.worker.role", "swarm.peer.election.driver")


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module → every module it names in an import (``from a import b`` names ``a`` and ``a.b``)."""
    out: dict[str, set[str]] = {}
    for path in [*REPO.glob("swarm/**/*.py"), *REPO.glob("web_peer/**/*.py")]:
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        out[_module_of(path)] = names
    return out


IMPORTS = _imports()


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _unit(module: str) -> str | None:
    return next((u for u in UNITS if _within(module, u)), None)


def _importers(source: str, target: str) -> list[str]:
    """Modules under ``source`` that import something under ``target``, as 'module → name'."""
    return sorted(f"{m} → {n}" for m, names in IMPORTS.items() if _within(m, source)
                  for n in names if _within(n, target))


def test_the_graph_is_read():
    assert "swarm.peer.roles" in IMPORTS and "swarm.peer.coordinator.dispatch" in IMPORTS["swarm.peer.coordinator.handoff"]
    # the rules below see what they forbid: both roles import the plan room, deferred imports too
    assert _importers("swarm.peer.worker", "swarm.peer.plan") and _importers("swarm.peer.coordinator", "swarm.peer.plan")
    assert "swarm.peer.memory" in IMPORTS["swarm.peer.plan.shape"]  # an import inside a function


def test_no_loops_between_top_level_packages():
    graph = {u: set() for u in UNITS}
    for module, names in IMPORTS.items():
        src = _unit(module)
        for name in names:
            dst = _unit(name)
            if src and dst and dst != src:
                graph[src].add(dst)
    loops = []

    def visit(unit: str, path: list[str]) -> None:
        for nxt in sorted(graph[unit]):
            if nxt in path:
                loops.append(" → ".join(path[path.index(nxt):] + [nxt]))
            else:
                visit(nxt, path + [nxt])

    for unit in UNITS:
        visit(unit, [unit])
    assert not loops, f"package loops: {sorted(set(loops))}"


@pytest.mark.parametrize("source, target", [
    ("swarm.signaling", "swarm.peer"), ("swarm.discovery", "swarm.peer"), ("swarm.keys", "swarm.peer"),
    ("web_peer", "swarm.peer"), ("swarm.compute", "swarm.peer"), ("swarm.compute", "swarm.signaling"),
    ("swarm.compute", "swarm.discovery"), ("swarm.peer", "swarm.cli"),
    ("swarm.peer.coordinator", "swarm.peer.worker"), ("swarm.peer.worker", "swarm.peer.coordinator"),
    ("swarm.peer.weights", "swarm.peer.coordinator"), ("swarm.peer.weights", "swarm.peer.worker"),
    ("swarm.peer.plan", "swarm.peer.coordinator"), ("swarm.peer.plan", "swarm.peer.worker"),
    ("swarm.peer.plan", "swarm.peer.weights"), ("swarm.peer.election.core", "swarm.peer"),
])
def test_a_room_does_not_import_what_its_rules_forbid(source, target):
    assert not _importers(source, target), f"{source} must not import {target}"


@pytest.mark.parametrize("source", ["swarm.peer.net", "swarm.peer.weights", "swarm.peer.plan", "swarm.peer.election.core"])
def test_the_layers_below_the_roles_know_no_role(source):
    found = [hit for role in ROLE_MODULES for hit in _importers(source, role)]
    assert not found, found
