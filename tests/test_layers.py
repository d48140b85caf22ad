"""The package's layer rules, read from the source: who may import whom.

- ``sse`` is at the bottom: it imports nothing of ours.
- ``delivery`` and ``engine`` know no HTTP server: no ``aiohttp.web``, nothing of ``server``,
  ``client`` or ``lab`` (the relay engine speaks to upstreams with aiohttp's client; ``delivery``
  imports no aiohttp at all).
- Nothing imports ``lab`` but ``lab`` itself (the CLI names its commands as strings).
Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "replystream"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute names (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else None
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = (package or module_name(path)).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> str:
    return name.split(".")[1] if name.count(".") >= 1 else ""


def offending(layer_name: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for name, imported in MODULES.items():
        if layer(name) != layer_name:
            continue
        hits = sorted(i for i in imported if i.startswith(forbidden) or i in forbidden)
        if hits:
            bad[name] = hits
    return bad


def test_the_rules_see_every_layer():
    assert {"sse", "delivery", "engine", "server", "client", "lab"} <= {
        layer(name) for name in MODULES
    }


def test_sse_imports_nothing_of_ours():
    others = tuple(f"replystream.{part}" for part in ("delivery", "engine", "server", "client"))
    assert offending("sse", (*others, "replystream.lab", "replystream.stats")) == {}


@pytest.mark.parametrize("name", ["delivery", "engine"])
def test_delivery_and_engine_know_no_http_server(name):
    forbidden: tuple[str, ...] = (
        "aiohttp.web",
        "replystream.server",
        "replystream.client",
        "replystream.lab",
    )
    if name == "delivery":
        forbidden = (*forbidden, "aiohttp")
    assert offending(name, forbidden) == {}


def test_nothing_imports_lab_but_lab():
    users = {
        name: sorted(i for i in imported if i.startswith("replystream.lab"))
        for name, imported in MODULES.items()
        if layer(name) != "lab"
    }
    assert {name: hits for name, hits in users.items() if hits} == {}


def internal_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from package import module`` included)."""
    graph: dict[str, set[str]] = {}
    for name, imported in MODULES.items():
        graph[name] = {i for i in imported if i in MODULES and i != name}
    return graph


def test_no_import_cycle_even_through_function_local_imports():
    graph = internal_graph()
    # Package __init__ modules re-export their children; an edge into a package is an edge
    # into what it re-exports, which the child-to-parent import would close into a false
    # cycle. Only module-to-module edges are checked.
    packages = {name for name in MODULES if (PACKAGE.parent / name.replace(".", "/")).is_dir()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node] - packages):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for start in sorted(set(graph) - packages):
        if start not in state:
            visit(start, [start])
    assert cycles == []
