"""Every third-party module a package imports is declared in pyproject.toml where that package
is installed from: ``gpupool`` and ``gpupool_spawner`` (the hub) in ``[hub]``, ``gpupool_lab``
(JupyterLab, job pods, the ``gpupool`` command) in ``[lab]``, or in the base ``dependencies``.

Every ``import`` counts, wherever it is written (module level, inside a function, under
``TYPE_CHECKING``). An import name is mapped to its distribution by :data:`DISTRIBUTIONS` where
the two differ (``yaml`` is PyYAML's), else by its own name; the map is checked against what the
installed distributions say they provide, so it cannot drift unseen.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "gpupool": (ROOT / "hub" / "gpupool", "hub"),
    "gpupool_spawner": (ROOT / "spawner" / "gpupool_spawner", "hub"),
    "gpupool_lab": (ROOT / "labextension" / "gpupool_lab", "lab"),
}
"""Each package: its folder and the extra it is installed with."""
DISTRIBUTIONS = {
    "yaml": "pyyaml",
    "pynvml": "nvidia-ml-py",
    "IPython": "ipython",
    "kubespawner": "jupyterhub-kubespawner",
    "bs4": "beautifulsoup4",
}
"""Import names whose distribution's name is not the import name (``_`` read as ``-``)."""


def normal(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(module: str) -> str:
    return normal(DISTRIBUTIONS.get(module, module))


def declared(extra: str) -> set[str]:
    """The distributions ``pip install .[extra]`` asks for by name (base ones included)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"][extra]]
    return {normal(m.group()) for r in requirements if (m := re.match(r"[A-Za-z0-9._-]+", r))}


def third_party_imports(source: str) -> set[str]:
    """The top-level names of the modules ``source`` imports that are neither the standard
    library's nor gpupool's own (relative imports are banned by ruff, and so gpupool's)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
    return found - set(sys.stdlib_module_names) - set(PACKAGES) - {"__future__"}


def undeclared(package: str) -> dict[str, list[str]]:
    """Distribution → the files of ``package`` that import it without its extra declaring it."""
    folder, extra = PACKAGES[package]
    have = declared(extra)
    missing: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for module in third_party_imports(path.read_text()):
            if distribution(module) not in have:
                where = str(path.relative_to(ROOT))
                missing.setdefault(distribution(module), []).append(where)
    return missing


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_third_party_import_is_declared_in_the_packages_extra(package: str) -> None:
    assert undeclared(package) == {}, f"declare these in [{PACKAGES[package][1]}]"


def test_the_named_clients_are_declared_where_they_are_used() -> None:
    assert {"kubernetes-asyncio", "aiohttp", "tornado", "jinja2"} <= declared("hub")
    assert {"requests", "tornado"} <= declared("lab")


def test_an_import_name_maps_to_the_distribution_that_provides_it() -> None:
    provides = importlib.metadata.packages_distributions()
    imported = {
        module
        for folder, _extra in PACKAGES.values()
        for path in folder.rglob("*.py")
        for module in third_party_imports(path.read_text())
    }
    assert {"requests", "kubernetes_asyncio", "aiohttp"} <= imported
    for module in sorted(imported | set(DISTRIBUTIONS)):
        if module in provides:  # installed here (all of them, in the test environment)
            assert distribution(module) in {normal(d) for d in provides[module]}, module


def test_an_undeclared_import_is_found() -> None:
    source = "import yaml\nfrom requests.adapters import HTTPAdapter\nimport json\n"
    assert third_party_imports(source) == {"yaml", "requests"}
    assert distribution("yaml") not in declared("hub")  # what the check would report
