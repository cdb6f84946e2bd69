"""The import graph of datamover/: no cycles, and layers that point one way (see ARCHITECTURE.md).

Read from the source with ``ast`` (nothing is imported), counting every import: at module level, inside
functions (lazy imports of optional parts) and under ``if TYPE_CHECKING``, because a cycle or an upward
arrow that only typing or a lazy import walks is still a tie the next change can trip over.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: what each lower layer may import (besides itself); the layers not listed (agents' users: policy, compat,
#: testing, bench, integrations, the CLI) may import any of these, but never form a cycle
ALLOWED = {
    "errors": set(),
    "processes": set(),
    "units": {"errors"},
    "descriptors": {"errors", "units"},
    "telemetry": {"errors", "units", "descriptors"},
    "backends": {"errors", "units", "processes", "descriptors", "telemetry"},
    "agents": {"errors", "units", "processes", "descriptors", "telemetry", "backends"},
}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (a package counts as its ``__init__``)."""
    mods: dict[str, tuple[Path, bool]] = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)

    def known(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    edges: dict[str, set[str]] = defaultdict(set)
    for mod, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges[mod] |= {known(a.name) for a in node.names if a.name.split(".")[0] == package}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                if target.split(".")[0] != package:
                    continue
                for a in node.names:  # ``from pkg import submodule`` imports the submodule
                    sub = f"{target}.{a.name}"
                    edges[mod].add(sub if sub in mods else known(target))
        edges[mod].discard(mod)
    return dict(edges)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def upward(edges: dict[str, set[str]], package: str) -> list[str]:
    """Every arrow from a layer in ALLOWED to a part of ``package`` it may not import."""
    layer = lambda m: m.split(".")[1] if m.count(".") else ""  # noqa: E731
    bad = []
    for src, targets in sorted(edges.items()):
        allowed = ALLOWED.get(layer(src))
        if allowed is None:
            continue
        for dst in sorted(targets):
            if layer(dst) != layer(src) and layer(dst) not in allowed:
                bad.append(f"{src} -> {dst}")
    return bad


def test_datamover_has_no_import_cycles():
    assert cycles(import_graph(ROOT, "datamover")) == []


def test_layers_point_one_way():
    edges = import_graph(ROOT, "datamover")
    assert upward(edges, "datamover") == []
    assert "datamover.backends.base" in edges  # the graph really covers the tree


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from . import b\n",
                "pkg/b.py": "def f():\n    from .c import x\n",
                "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import y\n",
            },
            [["pkg.a", "pkg.b", "pkg.c"]],
        ),
        ({"pkg/__init__.py": "from .a import z\n", "pkg/a.py": "import os\nfrom .b import q\n", "pkg/b.py": ""}, []),
        (
            {"pkg/__init__.py": "", "pkg/sub/__init__.py": "from ..a import f\n", "pkg/a.py": "from .sub import g\n"},
            [["pkg.a", "pkg.sub"]],
        ),
    ],
)
def test_the_checker_finds_cycles_through_lazy_typing_and_package_imports(tmp_path, files, expected):
    assert cycles(import_graph(_tree(tmp_path, files), "pkg")) == expected


def test_the_checker_finds_an_upward_arrow(tmp_path):
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/backends/__init__.py": "",
            "pkg/backends/x.py": "import typing\nif typing.TYPE_CHECKING:\n    from ..agents.agent import A\n",
            "pkg/agents/__init__.py": "",
            "pkg/agents/agent.py": "from ..backends import x\n",
        },
    )
    assert upward(import_graph(root, "pkg"), "pkg") == ["pkg.backends.x -> pkg.agents.agent"]
