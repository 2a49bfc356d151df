"""What the Helm chart tests share: where the chart is, the release it is rendered as, and
rendering it with the JupyterHub chart (test modules never import each other)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]


CHART = ROOT / "helm" / "gpupool"


RELEASE, NAMESPACE = "gp", "jhub"


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "PriorityClass",
    "ResourceFlavor",
    "ClusterQueue",
    "WorkloadPriorityClass",
}


def dependency_version() -> str:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (dep,) = [d for d in meta["dependencies"] if d["name"] == "jupyterhub"]
    return str(dep["version"])


def z2jh_archive() -> Path | None:
    """The JupyterHub chart archive to render with: charts/ when filled, else shared/charts/."""
    version = dependency_version()
    for folder in (CHART / "charts", ROOT.parent / "shared" / "charts"):
        archive = folder / f"jupyterhub-{version}.tgz"
        if archive.is_file():
            return archive
    return None


def render_all(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    return [obj for _, obj in render_with_origin(chart, values)]


def render_with_origin(
    chart: helm.Chart, values: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """(template path, object) of every rendered object, namespaced as Helm would install it."""
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                if doc["kind"] not in CLUSTER_SCOPED:
                    doc["metadata"].setdefault("namespace", NAMESPACE)
                objects.append((path, doc))
    return objects
