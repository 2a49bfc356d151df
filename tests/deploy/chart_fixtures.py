"""What the Helm chart tests share: where the chart is, the release it is rendered as, and
rendering it with the JupyterHub chart (test modules never import each other)."""

from __future__ import annotations

import contextlib
import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.crd_schemas import SCHEMAS, validate_custom
from tests.deploy.kube_fixtures import K8S_VERSIONS

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


def render(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders (no NOTES.txt), as Helm's template output has it."""
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(rendered.items()):
        if not path.endswith("NOTES.txt"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def validate_object(obj: dict[str, Any]) -> None:
    """``obj`` against its CRD's schema, else against every Kubernetes version's (strict)."""
    if (obj["apiVersion"], obj["kind"]) in SCHEMAS:
        validate_custom(obj)
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@contextlib.contextmanager
def z2jh_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[helm.Chart]:
    """gpupool's chart with the JupyterHub chart in its charts/ (skips where there is none)."""
    archive = z2jh_archive()
    if archive is None:
        pytest.skip(
            f"the JupyterHub chart {dependency_version()} is neither in helm/gpupool/charts/ "
            "(run `helm dependency build helm/gpupool`) nor in shared/charts/"
        )
    copy_ = tmp_path_factory.mktemp("chart") / "gpupool"
    shutil.copytree(CHART, copy_, ignore=shutil.ignore_patterns("charts"))
    (copy_ / "charts").mkdir()
    shutil.copy(archive, copy_ / "charts")
    with helm.Chart.load(copy_) as loaded:
        yield loaded
