"""Test modules never import each other (README, *Tests*): what several modules share lives in a
``conftest.py`` or a helper module (``tests/accounts.py``, ``tests/deploy/kube_fixtures.py``…).

A test module is a ``test_*.py`` file under ``tests/``; every import counts, wherever it is
written (module level or inside a function), as in :mod:`tests.unit.test_import_graph`.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported_test_modules(source: str) -> list[str]:
    """The test modules (``tests.….test_*``) that ``source`` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:  # relative: banned by ruff
            names = [f"{node.module}.{a.name}" for a in node.names]
        for parts in (name.split(".") for name in names):
            tests = [i for i, part in enumerate(parts) if part.startswith("test_")]
            if parts[0] == "tests" and tests:
                found.append(".".join(parts[: tests[0] + 1]))
    return sorted(set(found))


def test_the_finder_finds_imports_of_test_modules() -> None:
    source = """
from tests.deploy.test_kube_jobs import notebook_pod
from tests.deploy import test_kube_manifests as pods
import tests.hub.test_admin_page
def f():
    from tests.adapters.test_mig_on_demand import make_instance
from tests.deploy.kube_fixtures import notebook_pod
from tests.conftest import h100_node
"""
    assert imported_test_modules(source) == [
        "tests.adapters.test_mig_on_demand",
        "tests.deploy.test_kube_jobs",
        "tests.deploy.test_kube_manifests",
        "tests.hub.test_admin_page",
    ]


def test_no_test_module_imports_another() -> None:
    wrong = {
        str(path.relative_to(TESTS)): found
        for path in sorted(TESTS.rglob("*.py"))
        if "node_modules" not in path.parts
        for found in [imported_test_modules(path.read_text())]
        if found
    }
    assert wrong == {}, "move what they share into a conftest.py or a helper module"
