"""The Python packages' import graph has no circle, and the layers point down.

Every ``import`` counts, wherever it is written (module level, inside functions, under
``TYPE_CHECKING``): a circle hidden in a function or a type-only import is still a circle a reader
has to untangle. Layers (DESIGN): ``gpupool.core`` imports nothing else of gpupool; the notebook
side (``gpupool_lab``) never imports ``gpupool``; nothing of ``gpupool`` imports the spawners.
Packages: ``gpupool.discovery`` only reads what the pool has (core and the declarations, nothing
that acts); ``gpupool.hub`` (inside JupyterHub) is imported by nothing else of gpupool but the
``gpupool.describe`` command, which builds the hub's objects; the
Kubernetes client is imported only in ``gpupool.kube`` and the Kubernetes spawner.
"""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "gpupool": ROOT / "hub" / "gpupool",
    "gpupool_spawner": ROOT / "spawner" / "gpupool_spawner",
    "gpupool_lab": ROOT / "labextension" / "gpupool_lab",
}


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed on a fresh thread: Debian's Python 3.11.2 can fail
    ``ast.parse`` with "AST constructor recursion depth mismatch" on a thread where an earlier
    test hit a RecursionError (a CPython 3.11 bug, seen once in a full run here); a new thread
    starts at depth 0."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(ast.parse, path.read_text()).result()


def modules() -> dict[str, tuple[Path, bool]]:
    """Module name → (file, is a package's ``__init__``); Alembic's migrations are scripts."""
    found = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = (path, path.name == "__init__.py")
    return found


def graph() -> dict[str, set[str]]:
    """Module → the modules of these packages it imports (explicitly, by name)."""
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, (path, is_package) in known.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(parse(path)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                targets = [module, *(f"{module}.{a.name}" for a in node.names)]
            edges[name] |= {t for t in targets if t in known and t != name}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    assert circles(graph()) == []


def test_the_layers_point_down() -> None:
    edges = graph()
    wrong = sorted(
        f"{a} imports {b}"
        for a, targets in edges.items()
        for b in targets
        if (a.startswith("gpupool.core") and not b.startswith("gpupool.core"))
        or (a.startswith("gpupool_lab") and b.startswith("gpupool."))
        or (a.startswith("gpupool.") and b.startswith("gpupool_spawner"))
    )
    assert wrong == []


def test_discovery_only_reads() -> None:
    edges = graph()
    wrong = sorted(
        f"{a} imports {b}"
        for a, targets in edges.items()
        if a.startswith("gpupool.discovery")
        for b in targets
        if not b.startswith(("gpupool.discovery", "gpupool.core", "gpupool.declarations"))
    )
    assert wrong == []


def test_nothing_below_the_hub_integration_imports_it() -> None:
    edges = graph()
    wrong = sorted(
        f"{a} imports {b}"
        for a, targets in edges.items()
        if a.startswith("gpupool.") and not a.startswith(("gpupool.hub", "gpupool.describe"))
        for b in targets
        if b.startswith("gpupool.hub")
    )
    assert wrong == []


def test_only_the_kube_package_and_spawner_import_the_kubernetes_client() -> None:
    allowed = ("gpupool.kube", "gpupool_spawner.kube")
    wrong = []
    for name, (path, _) in modules().items():
        for node in ast.walk(parse(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            client = any(n.split(".")[0] in ("kubernetes", "kubernetes_asyncio") for n in names)
            if client and not name.startswith(allowed):
                wrong.append(name)
    assert wrong == []


def test_there_are_modules_to_check() -> None:
    edges = graph()
    assert {"gpupool.core.ledger", "gpupool.hub.handlers", "gpupool_lab.client"} <= set(edges)
    assert {"gpupool.kube.pods", "gpupool.mig.manager", "gpupool.monitors.dcgm"} <= set(edges)
    assert "gpupool.core.ledger" in edges["gpupool.hub.menu"]  # an import is seen as an edge
