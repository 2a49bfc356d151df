"""The Helm chart, rendered by real Helm (``helm_python``, the Helm v4 SDK) and checked as the
cluster and the hub would check it.

- Render: the chart's own objects for ``ci/small-values.yaml`` and ``ci/large-values.yaml``, with
  the JupyterHub dependency disabled (it cannot be downloaded here); every built-in object passes
  ``kubernetes_validate`` strictly for the oldest and newest Kubernetes it ships; Kueue and
  Prometheus Operator objects pass :mod:`tests.deploy.crd_schemas`.
- Lint: ``helm lint --strict`` reports nothing at warning level or above.
- Bad values: the schema (typos, negative quotas, bad kinds) and the chart's checks (a team naming
  an undefined offer, an unknown MIG profile, GPU models Kueue cannot tell apart) refuse them,
  naming the key.
- One source of truth: the hub loads the rendered ``gpupool.json`` with its own config classes,
  and the quotas it will enforce equal the Kueue ClusterQueues'; the Kueue GPU-equivalents of
  each MIG resource equal the hub's; the queue names the hub puts on pods are the LocalQueues.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import runpy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import major_minor
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.core.ledger import Allocation
from gpupool.core.mig import GEOMETRIES
from gpupool.hub.fileconfig import load_config_file
from gpupool.podspec import gpu_equivalents, queue_name
from tests.deploy.crd_schemas import SCHEMAS, validate_custom

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "gpupool"
VALUES_FILES = ("small", "large")
K8S_VERSIONS = ("1.33", major_minor(kubernetes_validate.latest_version()))
NO_DEPENDENCY = {"jupyterhub": {"enabled": False}}
RELEASE, NAMESPACE = "gp", "jhub"


def values_of(name: str) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    return merge(values, NO_DEPENDENCY)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def hub_config(objects: list[dict[str, Any]], tmp_path: Path) -> Config:
    """The hub's config after ``extraConfig`` loads the rendered ConfigMap's file."""
    data = by_kind(objects, "ConfigMap")["gpupool-config"]["data"]["gpupool.json"]
    path = tmp_path / "gpupool.json"
    path.write_text(data)
    c = Config()
    load_config_file(c, path)
    return c


def quantity_milli(text: str) -> int:
    """A quantity of whole or milli units in thousandths: "1500m" -> 1500, "2" -> 2000."""
    match = re.fullmatch(r"(\d+)(m?)", text)
    assert match, f"unexpected quantity {text!r}"
    return int(match[1]) * (1 if match[2] else 1000)


# -- render and validate ----------------------------------------------------------------------
@pytest.mark.parametrize("name", VALUES_FILES)
def test_every_object_is_valid_for_kubernetes(chart: helm.Chart, name: str) -> None:
    objects = render(chart, values_of(name))
    kinds = {o["kind"] for o in objects}
    assert {"ConfigMap", "Role", "RoleBinding", "ClusterRole", "NetworkPolicy"} <= kinds
    checked = 0
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in SCHEMAS:
            validate_custom(obj)
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked == len(objects)


def test_large_values_render_every_optional_part(chart: helm.Chart) -> None:
    objects = render(chart, values_of("large"))
    kinds = {o["kind"] for o in objects}
    assert {"ResourceFlavor", "ClusterQueue", "LocalQueue", "PriorityClass"} <= kinds
    assert {"ServiceMonitor"} <= kinds
    assert len(by_kind(objects, "ClusterQueue")) == 13  # twelve teams and `everyone`
    dashboard = by_kind(objects, "ConfigMap")["gpupool-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["gpupool.json"])["uid"] == "gpupool"


def test_small_values_leave_optional_parts_out(chart: helm.Chart) -> None:
    kinds = {o["kind"] for o in render(chart, values_of("small"))}
    assert not kinds & {"ClusterQueue", "PriorityClass", "ServiceMonitor", "ResourceFlavor"}


def test_defaults_render_and_use_the_chart_images(chart: helm.Chart, tmp_path: Path) -> None:
    values = merge(chart.values, NO_DEPENDENCY)
    objects = render(chart, values)
    c = hub_config(objects, tmp_path)
    image = values["jupyterhub"]["singleuser"]["image"]
    assert c.KubeJobBackend.image == f"{image['name']}:{image['tag']}"
    assert c.JupyterHub.spawner_class == "gpupool-kube"


@pytest.mark.parametrize("name", VALUES_FILES)
def test_helm_lint_strict_is_clean(name: str, tmp_path: Path) -> None:
    """Lint our chart on its own: a copy without the JupyterHub dependency, which cannot be
    fetched here (lint would otherwise only report that charts/ lacks it)."""
    copy_ = tmp_path / "gpupool"
    shutil.copytree(CHART, copy_)
    meta = yaml.safe_load((copy_ / "Chart.yaml").read_text())
    assert [d["name"] for d in meta.pop("dependencies")] == ["jupyterhub"]
    (copy_ / "Chart.yaml").write_text(yaml.safe_dump(meta))
    report = helm.lint(copy_, values_of(name), strict=True)
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert not serious and not report["errors"], report


# -- bad values --------------------------------------------------------------------------------
BAD_VALUES = [
    pytest.param({"gpupool": {"teams": {"lab": {"guarantee": -1}}}}, "guarantee", id="negative"),
    pytest.param({"gpupool": {"teams": {"lab": {"gaurantee": 2}}}}, "gaurantee", id="typo-team"),
    pytest.param(
        {"gpupool": {"teams": {"lab": {"max_priority": 101}}}},
        "/gpupool/teams/lab/max_priority': maximum: got 101, want 100",
        id="priority-range",
    ),
    pytest.param({"gpupol": {}}, "gpupol", id="typo-top"),
    pytest.param({"kueue": {"enabeld": True}}, "enabeld", id="typo-kueue"),
    pytest.param({"gpupool": {"offers": {"h100": {"kind": "tpu"}}}}, "kind", id="bad-kind"),
    pytest.param(
        {"gpupool": {"offers": {"x": {"kind": "mig", "profile": "3g.45gb"}}}},
        "profile",
        id="bad-profile",
    ),
    pytest.param(
        {"gpupool": {"teams": {"Lab_1": {"guarantee": 1}}}}, "Lab_1", id="team-not-dns-label"
    ),
    pytest.param(
        {"gpupool": {"teams": {"lab": {"offers": ["cpu", "h200"]}}}},
        'gpupool.teams.lab.offers: unknown offer "h200"',
        id="unknown-offer",
    ),
    pytest.param(
        {"gpupool": {"offers": {"mig-3g.45gb": {}}}},
        "gpupool.offers.mig-3g.45gb: 3g.45gb is not a MIG profile",
        id="unknown-mig-offer",
    ),
    pytest.param(
        {"kueue": {"enabled": True, "gpuModels": ["H100-80GB", "A100-40GB"]}},
        "kueue.gpuModels: nvidia.com/mig-1g.10gb",
        id="kueue-models-disagree",
    ),
]


@pytest.mark.parametrize(("override", "message"), BAD_VALUES)
def test_bad_values_are_refused_naming_the_key(
    chart: helm.Chart, override: dict[str, Any], message: str
) -> None:
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as refused:
        render(chart, merge(values_of("small"), override))
    assert message in str(refused.value)


def test_the_schema_knows_every_mig_profile_gpupool_knows() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    offers = schema["properties"]["gpupool"]["properties"]["offers"]
    enum = offers["patternProperties"][""]["properties"]["profile"]["enum"]
    assert sorted(enum) == sorted({p.name for g in GEOMETRIES.values() for p in g.profiles})


def test_the_gpu_equivalents_table_is_generated_from_the_code() -> None:
    script = runpy.run_path(str(ROOT / "scripts" / "helm-gpu-equivalents"))
    table = CHART / "files" / "gpu-equivalents.yaml"
    assert table.read_text() == script["render"](), "run scripts/helm-gpu-equivalents"


# -- one source of truth -----------------------------------------------------------------------
def test_kueue_quotas_equal_what_the_hub_enforces(chart: helm.Chart, tmp_path: Path) -> None:
    values = chart.merge_values(values_of("large"))
    objects = render(chart, values)
    settings = GPUPool(config=hub_config(objects, tmp_path)).settings()
    resource = values["kueue"]["resource"]
    queues = by_kind(objects, "ClusterQueue")
    teams = {**settings.teams, "everyone": settings.everyone}
    assert set(queues) == {f"{RELEASE}-{name}" for name in teams}
    for name, team in teams.items():
        (group,) = queues[f"{RELEASE}-{name}"]["spec"]["resourceGroups"]
        (flavor,) = group["flavors"]
        quota = next(r for r in flavor["resources"] if r["name"] == resource)
        assert quantity_milli(quota["nominalQuota"]) == team.guarantee_milli, name
        assert quantity_milli(quota["borrowingLimit"]) == team.borrow_limit_milli, name


def test_a_team_priority_range_reaches_the_hub(chart: helm.Chart, tmp_path: Path) -> None:
    priorities = {"min_priority": -10, "max_priority": 20}
    values = merge(values_of("large"), {"gpupool": {"teams": {"vision": priorities}}})
    teams = GPUPool(config=hub_config(render(chart, values), tmp_path)).settings().teams
    assert (teams["vision"].min_priority, teams["vision"].max_priority) == (-10, 20)
    assert (teams["nlp"].min_priority, teams["nlp"].max_priority) == (-100, 0)


def test_kueue_counts_each_gpu_resource_as_the_hub_does(chart: helm.Chart) -> None:
    values = chart.merge_values(values_of("large"))
    objects = render(chart, values)
    snippet = by_kind(objects, "ConfigMap")["gpupool-kueue-resources"]["data"]["resources.yaml"]
    transformations = yaml.safe_load(snippet)["resources"]["transformations"]
    rendered = {t["input"]: t["outputs"][values["kueue"]["resource"]] for t in transformations}
    assert all(t["strategy"] == "Replace" for t in transformations)
    expected: dict[str, int] = {}
    for model in values["kueue"]["gpuModels"]:
        expected |= gpu_equivalents(model)
    assert {k: quantity_milli(v) for k, v in rendered.items()} == expected
    assert rendered["nvidia.com/mig-3g.40gb"] == "500m"


def test_pods_name_the_local_queues_the_chart_creates(chart: helm.Chart, tmp_path: Path) -> None:
    objects = render(chart, values_of("large"))
    c = hub_config(objects, tmp_path)
    local = by_kind(objects, "LocalQueue")
    for section in ("KubeGPUSpawner", "KubeJobBackend"):
        template = c[section].kueue_queue_template
        for team in ("vision", "theory", "everyone"):
            alloc = Allocation("a1", "ada", team, "mig-3g.40gb", "notebook", "", 1, 500, None, ())
            name = queue_name(template, alloc)
            assert name in local, (section, name)
            assert local[name]["metadata"]["namespace"] == NAMESPACE
            assert local[name]["spec"]["clusterQueue"] == f"{RELEASE}-{team}"


def test_hub_settings_are_real_traits_of_the_hub_classes(chart: helm.Chart, tmp_path: Path) -> None:
    from jupyterhub.app import JupyterHub

    from gpupool.hub.reclaim import IdleReclaimer
    from gpupool.jobs.kube import KubeJobBackend
    from gpupool.jobs.manager import JobManager
    from gpupool_spawner.kube import KubeGPUSpawner

    classes = {
        "GPUPool": GPUPool,
        "JupyterHub": JupyterHub,
        "JobManager": JobManager,
        "KubeGPUSpawner": KubeGPUSpawner,
        "KubeJobBackend": KubeJobBackend,
        "IdleReclaimer": IdleReclaimer,
    }
    objects = render(chart, values_of("large"))
    c = hub_config(objects, tmp_path)
    assert set(c) == set(classes)
    for section, settings in c.items():
        traits = classes[section].class_traits(config=True)
        for key, value in settings.items():
            assert key in traits, f"{section}.{key} is not a setting"
            if section not in ("JupyterHub", "JobManager"):  # class-valued traits load lazily
                probe = classes[section].__new__(classes[section])  # traits, no __init__ I/O
                traits[key].validate(probe, value)
    assert c.JobManager.default_time_limit == 7200  # gpupool.extraConfig merged in
    assert c.KubeJobBackend.gpu_priority_class_name == f"{RELEASE}-job"
    assert by_kind(objects, "PriorityClass")[f"{RELEASE}-job"]["value"] == 500


def test_the_hub_extra_config_loads_the_mounted_file(chart: helm.Chart) -> None:
    hub = chart.values["jupyterhub"]["hub"]
    source = hub["extraConfig"]["zz-gpupool"]
    ast.parse(source)
    (volume,) = hub["extraVolumes"]
    (mount,) = hub["extraVolumeMounts"]
    assert volume["configMap"]["name"] == "gpupool-config" and mount["name"] == volume["name"]
    assert f'"{mount["mountPath"]}/gpupool.json"' in source
    assert max(hub["extraConfig"]) == "zz-gpupool", "gpupool's extraConfig must sort last"


# -- RBAC --------------------------------------------------------------------------------------
API_CALL = re.compile(r"\b(core|batch)\.(\w+)\b")
VERBS = {
    "create": "create",
    "read": "get",
    "list": "list",
    "patch": "patch",
    "delete_collection": "deletecollection",
    "delete": "delete",
    "replace": "update",
}


def api_calls(path: Path) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every ``core.*``/``batch.*`` client call in a module."""
    calls = set()
    for group_name, method in API_CALL.findall(path.read_text()):
        verb = next((v for prefix, v in VERBS.items() if method.startswith(prefix + "_")), None)
        if verb is None:
            continue
        rest = re.sub(r"^(create|read|list|patch|delete_collection|delete|replace)_", "", method)
        rest = rest.removeprefix("namespaced_")
        resource, _, sub = rest.partition("_")
        plural = {"config": "configmaps", "node": "nodes"}.get(resource, resource + "s")
        if rest == "pod_log":
            plural, sub = "pods/log", ""
        assert not sub or rest.startswith("config_map"), f"unmapped API call {method}"
        calls.add(("batch" if group_name == "batch" else "", plural, verb))
    return calls


def granted(objects: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    out = set()
    for kind in ("Role", "ClusterRole"):
        for role in by_kind(objects, kind).values():
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out


def test_rbac_grants_every_call_the_hub_makes(chart: helm.Chart) -> None:
    objects = render(chart, values_of("small"))
    hub = ROOT / "hub" / "gpupool"
    needed = api_calls(hub / "jobs" / "kube.py") | api_calls(hub / "discovery" / "kubernetes.py")
    assert ("batch", "jobs", "create") in needed and ("", "nodes", "list") in needed
    assert ("", "pods/log", "get") in needed
    missing = needed - granted(objects)
    assert not missing, f"the chart's RBAC lacks {sorted(missing)}"
    bindings = list(by_kind(objects, "RoleBinding").values())
    bindings += by_kind(objects, "ClusterRoleBinding").values()
    for binding in bindings:
        (subject,) = binding["subjects"]
        assert (subject["kind"], subject["name"], subject["namespace"]) == (
            "ServiceAccount",
            "hub",
            NAMESPACE,
        )


def test_rendezvous_policy_selects_job_pods_both_ways(chart: helm.Chart) -> None:
    (policy,) = by_kind(render(chart, values_of("small")), "NetworkPolicy").values()
    job_pods = {"matchExpressions": [{"key": "gpupool.io/job", "operator": "Exists"}]}
    assert policy["spec"]["podSelector"] == job_pods
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": job_pods}]}]
    assert policy["spec"]["egress"] == [{"to": [{"podSelector": job_pods}]}]
    assert not by_kind(
        render(chart, merge(values_of("small"), {"networkPolicy": {"enabled": False}})),
        "NetworkPolicy",
    )
