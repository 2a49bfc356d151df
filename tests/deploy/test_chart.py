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
- The default values start a hub: their gpupool settings pass gpupool's own validation and build
  a pool (on a simulated inventory standing in for the nodes).
- Kueue keeps gpupool's promises: no queue reclaims lent quota from a notebook (LowerPriority, and
  notebooks rank above jobs); WorkloadPriorityClasses and fair-sharing weights from the team values.
- The two idle reapers agree: the JupyterHub chart's culler waits longer than gpupool's reclaim.
- Kueue labels name the chart's WorkloadPriorityClasses (notebooks above jobs); the job-pod
  settings (node binding, shared volume, kept claims) reach the hub only when set.
- The PrometheusRule's alerts use only metric names the hub exports.
- One source of truth: the hub loads the rendered ``gpupool.json`` with its own config classes,
  and the quotas it will enforce equal the Kueue ClusterQueues'; the Kueue GPU-equivalents of
  each MIG resource equal the hub's; the queue names the hub puts on pods are the LocalQueues.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import re
import runpy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.core.ledger import Allocation
from gpupool.core.limits import UserLimits
from gpupool.core.mig import GEOMETRIES
from gpupool.discovery.node_pools import parse_node_pools
from gpupool.hub.fileconfig import load_config_file
from gpupool.kube.api import ClusterAPI
from gpupool.kube.pods import gpu_equivalents, queue_name
from gpupool.pool import Pool
from tests.deploy.chart_fixtures import (
    CHART,
    NAMESPACE,
    RELEASE,
    ROOT,
    by_kind,
    merge,
    render,
    validate_object,
)
from tests.deploy.crd_schemas import validate_custom

VALUES_FILES = ("small", "large")
NO_DEPENDENCY = {"jupyterhub": {"enabled": False}}


def values_of(name: str) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    return merge(values, NO_DEPENDENCY)


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def hub_config(objects: list[dict[str, Any]], tmp_path: Path) -> Config:
    """The hub's config after ``extraConfig`` loads the rendered ConfigMap's file."""
    data = by_kind(objects, "ConfigMap")["gpupool-config"]["data"]["gpupool.json"]
    path = tmp_path / "gpupool.json"
    path.write_text(data)
    c = Config()
    load_config_file(c, path)
    return c


def kueue_value(text: str) -> int:
    """What Kueue counts a quota or request of the GPU-equivalent resource as: whole units of
    the quantity, a fraction rounded up (kueue pkg/resources ResourceValue: Quantity.Value())."""
    match = re.fullmatch(r"(\d+)(m?)", text)
    assert match, f"unexpected quantity {text!r}"
    return -(-int(match[1]) // 1000) if match[2] else int(match[1])


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
        validate_object(obj)
        checked += 1
    assert checked == len(objects)


def test_large_values_render_every_optional_part(chart: helm.Chart) -> None:
    objects = render(chart, values_of("large"))
    kinds = {o["kind"] for o in objects}
    assert {"ResourceFlavor", "ClusterQueue", "LocalQueue", "PriorityClass"} <= kinds
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds
    assert len(by_kind(objects, "ClusterQueue")) == 13  # twelve teams and `everyone`
    dashboard = by_kind(objects, "ConfigMap")["gpupool-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["gpupool.json"])["uid"] == "gpupool"


def test_small_values_leave_optional_parts_out(chart: helm.Chart) -> None:
    kinds = {o["kind"] for o in render(chart, values_of("small"))}
    assert not kinds & {
        "ClusterQueue",
        "PriorityClass",
        "ServiceMonitor",
        "PrometheusRule",
        "ResourceFlavor",
    }


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
    pytest.param(
        {"gpupool": {"teams": {"lab": {"user_limits": {"job": 3}}}}}, "job", id="typo-limit"
    ),
    pytest.param({"gpupool": {"userLimits": {"jobs": -1}}}, "jobs", id="negative-limit"),
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
    pytest.param(
        {"gpupool": {"offers": {"mig-1g.10gb": {}}}},
        "gpupool.offers.mig-1g.10gb.model: 1g.10gb takes a different share of the GPU on "
        "A100-40GB (250m), A100-80GB (125m), H100-80GB (125m); set model",
        id="ambiguous-mig-offer",
    ),
    pytest.param(
        {"kueue": {"enabled": True, "preemption": {"reclaimWithinCohort": "Any"}}},
        "reclaimWithinCohort",
        id="kueue-preempts-notebooks",
    ),
    pytest.param(
        {"kueue": {"enabled": True, "priorities": {"notebook": 100, "job": 100}}},
        "kueue.priorities.notebook: 100 must be above kueue.priorities.job (100)",
        id="kueue-job-not-below-notebook",
    ),
    pytest.param(
        {"priorityClasses": {"enabled": True, "notebook": 10, "job": 500}},
        "priorityClasses.notebook: 10 must be above priorityClasses.job (500)",
        id="pod-job-above-notebook",
    ),
    pytest.param(
        {"jupyterhub": {"enabled": True, "cull": {"enabled": True, "timeout": 3600}}},
        "jupyterhub.cull.timeout: 3600 seconds would stop GPU notebooks without gpupool's "
        'warning; gpupool reclaims idle GPU notebooks after 120 minutes (team "*"), so set it '
        "to at least 7800",
        id="culler-before-reclaim",
    ),
    pytest.param(
        {
            "gpupool": {"idlePolicies": {"nlp": {"idle_minutes": 300}}},
            "jupyterhub": {"enabled": True, "cull": {"timeout": 14400, "every": 600}},
        },
        'after 300 minutes (team "nlp"), so set it to at least 18600',
        id="culler-before-a-team-reclaim",
    ),
    pytest.param(
        {"gpupool": {"idlePolicies": {"nlp": {"action": "sleep"}}}},
        "action",
        id="bad-idle-action",
    ),
    pytest.param(
        {"gpupool": {"jobs": {"sharedVolumeMountPath": "shared"}}},
        "sharedVolumeMountPath",
        id="relative-shared-path",
    ),
    pytest.param(
        {"gpupool": {"jobs": {"keepClaims": ["Home_Claim"]}}}, "keepClaims", id="bad-claim-name"
    ),
    pytest.param({"gpupool": {"bindToNode": "no"}}, "bindToNode", id="bind-not-a-boolean"),
    pytest.param(
        {"gpupool": {"notebookHardening": {"runAsNonroot": True}}},
        "runAsNonroot",
        id="hardening-field-misspelt",
    ),
    pytest.param(
        {"metrics": {"prometheusRule": {"enabled": True, "idleMinutes": 0}}},
        "idleMinutes",
        id="alert-after-no-time",
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
    enum = schema["definitions"]["offer-keys"]["properties"]["profile"]["enum"]
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
        assert kueue_value(quota["nominalQuota"]) == team.guarantee_milli, name
        assert kueue_value(quota["borrowingLimit"]) == team.borrow_limit_milli, name


def test_a_team_priority_range_reaches_the_hub(chart: helm.Chart, tmp_path: Path) -> None:
    priorities = {"min_priority": -10, "max_priority": 20}
    values = merge(values_of("large"), {"gpupool": {"teams": {"vision": priorities}}})
    teams = GPUPool(config=hub_config(render(chart, values), tmp_path)).settings().teams
    assert (teams["vision"].min_priority, teams["vision"].max_priority) == (-10, 20)
    assert (teams["nlp"].min_priority, teams["nlp"].max_priority) == (-100, 0)


def test_per_user_limits_and_retention_reach_the_hub(chart: helm.Chart, tmp_path: Path) -> None:
    values = merge(
        values_of("large"),
        {
            "gpupool": {
                "userLimits": {"jobs": 10, "spawns": 1},
                "teams": {"vision": {"user_limits": {"jobs": 40}}},
                "everyone": {"user_limits": {"log_followers": 2}},
                "jobs": {"retentionDays": 90},
            }
        },
    )
    c = hub_config(render(chart, values), tmp_path)
    settings = GPUPool(config=c).settings()
    assert settings.teams["vision"].user_limits == UserLimits(jobs=40, log_followers=8, spawns=1)
    assert settings.teams["nlp"].user_limits == UserLimits(jobs=10, log_followers=8, spawns=1)
    assert settings.everyone.user_limits == UserLimits(jobs=10, log_followers=2, spawns=1)
    assert c.JobManager.retention_days == 90
    default = hub_config(render(chart, chart.merge_values(values_of("large"))), tmp_path)
    assert "user_limits" not in default.GPUPool and "retention_days" not in default.JobManager


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
    hami = values["kueue"]["hami"]  # HAMi's resources: the count free, the memory by MiB
    assert rendered.pop(hami["countResource"]) == "0"
    assert rendered.pop(hami["memoryResource"]) == f"{10**12 // hami['gpuMemoryMiB']}n"
    assert {k: kueue_value(v) for k, v in rendered.items()} == expected
    assert rendered["nvidia.com/mig-3g.40gb"] == "500"


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


def test_pods_and_jobs_name_the_kueue_priority_classes_the_chart_creates(
    chart: helm.Chart, tmp_path: Path
) -> None:
    from gpupool.core.ledger import Device
    from gpupool.kube.pods import KUEUE_PRIORITY_LABEL, gpu_labels

    objects = render(chart, values_of("large"))
    c = hub_config(objects, tmp_path)
    classes = by_kind(objects, "WorkloadPriorityClass")
    notebook, job = c.KubeGPUSpawner.kueue_priority_class, c.KubeJobBackend.kueue_priority_class
    assert (notebook, job) == (f"{RELEASE}-notebook", f"{RELEASE}-job")
    assert classes[notebook]["value"] > classes[job]["value"]  # Kueue never preempts a notebook
    device = (Device("GPU-0", "3g.40gb"),)
    alloc = Allocation("a1", "ada", "vision", "mig-3g.40gb", "notebook", "", 1, 500, "n1", device)
    labels = gpu_labels(alloc, c.KubeGPUSpawner.kueue_queue_template, notebook)
    assert labels[KUEUE_PRIORITY_LABEL] in classes
    # without Kueue there is no WorkloadPriorityClass, and no setting names one
    small = hub_config(render(chart, values_of("small")), tmp_path)
    for section in ("KubeGPUSpawner", "KubeJobBackend"):
        assert "kueue_priority_class" not in small[section]
        assert "kueue_queue_template" not in small[section]


JOB_POD_KEYS = ("bind_to_node", "shared_volume_claim", "shared_volume_mount_path", "keep_claims")


def test_job_pod_settings_reach_the_hub_only_when_set(chart: helm.Chart, tmp_path: Path) -> None:
    from gpupool.kube.jobs import KubeJobBackend

    small = hub_config(render(chart, values_of("small")), tmp_path)
    for section in ("KubeGPUSpawner", "KubeJobBackend"):
        assert not set(JOB_POD_KEYS) & set(small[section]), section  # the hub's defaults
    c = hub_config(render(chart, values_of("large")), tmp_path)
    assert c.KubeGPUSpawner.bind_to_node is True
    assert c.KubeJobBackend.shared_volume_claim == "gpupool-shared"
    assert c.KubeJobBackend.shared_volume_mount_path == "/mnt/shared"
    assert c.KubeJobBackend.keep_claims == ["group-datasets"]
    # false is a setting too, and the job backend follows the notebook's binding
    unbound = merge(values_of("small"), {"gpupool": {"bindToNode": False}})
    c = hub_config(render(chart, unbound), tmp_path)
    assert c.KubeGPUSpawner.bind_to_node is False
    assert "bind_to_node" not in c.KubeJobBackend
    c.KubeJobBackend.namespace = NAMESPACE  # not the service account's file
    backend = KubeJobBackend(config=c)
    assert backend.bind_to_node is False
    assert (backend.shared_volume_claim, backend.keep_claims) == ("", [])


def test_notebook_hardening_reaches_the_hub_only_when_set(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """null: the hub's default (every field); a map: those fields; {}: none."""
    from gpupool.kube.pods import HARDENING

    small = hub_config(render(chart, values_of("small")), tmp_path)
    assert "pod_hardening" not in small.KubeGPUSpawner
    assert HARDENING == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for hardening in ({}, {"seccompProfile": {"type": "RuntimeDefault"}}):
        values = merge(values_of("small"), {"gpupool": {"notebookHardening": hardening}})
        c = hub_config(render(chart, values), tmp_path)
        assert c.KubeGPUSpawner.pod_hardening == hardening


def test_hub_settings_are_real_traits_of_the_hub_classes(chart: helm.Chart, tmp_path: Path) -> None:
    from jupyterhub.app import JupyterHub

    from gpupool.hub.reclaim import IdleReclaimer
    from gpupool.jobs.manager import JobManager
    from gpupool.kube.jobs import KubeJobBackend
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
    # the large values set every optional setting, so all of them were checked above
    assert {"kueue_priority_class", "bind_to_node", "pod_hardening"} <= set(c.KubeGPUSpawner)
    assert {"kueue_priority_class", *JOB_POD_KEYS[1:]} <= set(c.KubeJobBackend)
    assert {"network_policy", "network_policy_dns"} <= set(c.KubeJobBackend)


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
API_CALL = re.compile(r"\b(core|batch|networking|coordination)\.(\w+)\b")
GROUPS = {
    "core": "",
    "batch": "batch",
    "networking": "networking.k8s.io",
    "coordination": "coordination.k8s.io",
}
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
    """(API group, resource, verb) of every ``core.*``/``batch.*``/``networking.*`` client call in
    a module."""
    calls = set()
    for group_name, method in API_CALL.findall(path.read_text()):
        verb = next((v for prefix, v in VERBS.items() if method.startswith(prefix + "_")), None)
        if verb is None:
            continue
        rest = re.sub(r"^(create|read|list|patch|delete_collection|delete|replace)_", "", method)
        rest = rest.removeprefix("namespaced_").removesuffix("_for_all_namespaces")
        resource, _, sub = rest.partition("_")
        plural = {"config": "configmaps", "node": "nodes"}.get(resource, resource + "s")
        if rest == "pod_log":
            plural, sub = "pods/log", ""
        if rest == "network_policy":
            plural, sub = "networkpolicies", ""
        assert not sub or rest.startswith("config_map"), f"unmapped API call {method}"
        calls.add((GROUPS[group_name], plural, verb))
    return calls


def watched() -> set[tuple[str, str, str]]:
    """What the Kubernetes reconciler lists and then watches, through its one seam
    (:class:`gpupool.kube.api.ClusterAPI`: nodes cluster-wide, pods in the hub's
    namespace, every namespace's pods as ``tenants``): a watch is a list call with
    ``watch=true``, so the scan above sees only the list."""
    kinds = ClusterAPI().selectors
    assert set(kinds) == {"nodes", "pods", "tenants"}, kinds
    plural = {"tenants": "pods"}
    return {("", plural.get(k, k), verb) for k in kinds for verb in ("list", "watch")}


def granted(
    objects: list[dict[str, Any]], kinds: tuple[str, ...] = ("Role", "ClusterRole")
) -> set[tuple[str, str, str]]:
    out = set()
    for kind in kinds:
        for role in by_kind(objects, kind).values():
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out


def test_rbac_grants_every_call_the_hub_makes(chart: helm.Chart) -> None:
    objects = render(chart, values_of("small"))
    kube = sorted((ROOT / "hub" / "gpupool" / "kube").glob("*.py"))  # every API call is there
    needed = set().union(*(api_calls(path) for path in kube))
    needed |= watched()
    assert ("batch", "jobs", "create") in needed and ("", "nodes", "list") in needed
    assert ("", "nodes", "watch") in needed and ("", "pods", "watch") in needed
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


def test_rbac_lets_the_reconciler_watch_nodes_cluster_wide_and_pods_in_its_namespace(
    chart: helm.Chart,
) -> None:
    """Nodes are cluster-scoped: only a ClusterRole grants them, and it grants nothing else but
    listing and watching every namespace's pods (other tenants' GPU requests) and listing their
    Leases (other releases' node claims), and nothing but reading; gpupool's own pods are
    managed in the release's namespace, through its Role."""
    objects = render(chart, values_of("small"))
    cluster_wide = granted(objects, ("ClusterRole",))
    namespaced = granted(objects, ("Role",))
    for verb in ("list", "watch"):
        assert ("", "nodes", verb) in cluster_wide, f"no ClusterRole may {verb} nodes"
        assert ("", "pods", verb) in namespaced, f"the hub's Role may not {verb} pods"
    assert {resource for _, resource, _ in cluster_wide} == {"nodes", "pods", "leases"}
    assert {verb for _, _, verb in cluster_wide} == {"get", "list", "watch"}
    assert {v for _, r, v in cluster_wide if r == "pods"} == {"list", "watch"}
    assert {v for _, r, v in cluster_wide if r == "leases"} == {"list"}  # others' node claims


def test_the_release_wide_job_policy_admits_dns_only(chart: helm.Chart) -> None:
    """Every job pod: no ingress, egress to the cluster DNS only; what a job's ranks need of
    each other is the hub's per-job policy (``test_kube_job_network.py``)."""
    (policy,) = by_kind(render(chart, values_of("small")), "NetworkPolicy").values()
    job_pods = {"matchExpressions": [{"key": "gpupool.io/job", "operator": "Exists"}]}
    assert policy["metadata"]["name"] == "gpupool-job-baseline"
    assert policy["spec"]["podSelector"] == job_pods
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert not policy["spec"].get("ingress")  # no pod may reach a job pod through this one
    (dns,) = policy["spec"]["egress"]  # nothing else by default
    assert dns == {
        "to": [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                },
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
    }
    assert not by_kind(
        render(chart, merge(values_of("small"), {"networkPolicy": {"enabled": False}})),
        "NetworkPolicy",
    )


def test_the_hub_makes_per_job_policies_with_the_charts_dns_and_may_do_just_that(
    chart: helm.Chart, tmp_path: Path
) -> None:
    from gpupool.kube.jobs import KubeJobBackend

    dns = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dns"}},
        "podSelector": {"matchLabels": {"k8s-app": "node-local-dns"}},
    }
    values = merge(values_of("small"), {"networkPolicy": {"jobs": {"dns": dns}}})
    objects = render(chart, values)
    c = hub_config(objects, tmp_path)
    c.KubeJobBackend.namespace = NAMESPACE  # not the service account's file
    backend = KubeJobBackend(config=c)
    assert backend.network_policy is True
    assert backend.network_policy_dns == [dns]  # the release-wide policy's DNS, one definition
    (policy,) = by_kind(objects, "NetworkPolicy").values()
    assert policy["spec"]["egress"][0]["to"] == [dns]
    source = ROOT / "hub" / "gpupool" / "kube" / "jobs.py"
    needed = {c for c in api_calls(source) if c[1] == "networkpolicies"}
    assert needed == {("networking.k8s.io", "networkpolicies", v) for v in ("create", "delete")}
    assert {g for g in granted(objects) if g[1] == "networkpolicies"} == needed  # exactly
    # without NetworkPolicies the hub makes none, and its Role may not
    off = merge(values_of("small"), {"networkPolicy": {"enabled": False}})
    objects = render(chart, off)
    c = hub_config(objects, tmp_path)
    c.KubeJobBackend.namespace = NAMESPACE
    assert KubeJobBackend(config=c).network_policy is False
    assert not {g for g in granted(objects) if g[1] == "networkpolicies"}


# -- the defaults start a hub ------------------------------------------------------------------
VALUES_EXAMPLE = {
    "offers": {
        "h100": {"kind": "gpu", "model": "H100-80GB", "max_count": 8, "nvlink": True},
        "mig-3g.40gb": {"description": "Half an H100 (MIG 3g.40gb)"},
        "mig-1g.10gb": {"model": "H100-80GB"},
    },
    "teams": {
        "vision": {"guarantee": 4, "borrow_limit": 2, "user_cap": 2, "max_priority": 10},
        "nlp": {"guarantee": 2, "offers": ["cpu", "mig-3g.40gb", "mig-1g.10gb"]},
    },
}
DEFAULT_NODES = "gpu1: 8x H100-80GB, nvlink=8; gpu2: 8x H100-80GB, mig=8"
"""Nodes the default offers fit: whole H100s in one NVLink island, and H100s with MIG on."""


def test_default_values_build_the_hub_pool(chart: helm.Chart, tmp_path: Path) -> None:
    """What the hub does at start with the default values (``setup`` -> ``Pool.from_config``),
    on a simulated inventory standing in for the Kubernetes nodes: no refusal, no warning. The
    defaults hold no example offer or team (Helm would merge them into every install); the
    example in values.yaml's comments is added on top."""
    values = merge(chart.values, NO_DEPENDENCY)
    assert set(values["gpupool"]["offers"]) == {"cpu"} and not values["gpupool"]["teams"]
    values = merge(values, {"gpupool": VALUES_EXAMPLE})  # the example in values.yaml's comments
    c = hub_config(render(chart, values), tmp_path)
    assert c.GPUPool.inventory == "kubernetes"
    c.GPUPool.inventory = f"simulated:{DEFAULT_NODES}"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'gpupool.sqlite'}"
    config = GPUPool(config=c)
    settings = config.settings()
    assert settings.offers["mig-1g.10gb"].model == "H100-80GB"
    warnings: list[str] = []

    class Log:
        def warning(self, fmt: str, *args: object) -> None:
            warnings.append(fmt % args)

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    pool = Pool.from_config(config, Log())  # type: ignore[arg-type]
    assert [w for w in warnings if "SIMULATED inventory" not in w] == []
    assert {g.model for g in pool.inventory.gpus} == {"H100-80GB"}


# -- Kueue keeps gpupool's promises ---------------------------------------------------------------
def test_kueue_never_reclaims_from_notebooks(chart: helm.Chart) -> None:
    for values in (values_of("large"), merge(values_of("small"), {"kueue": {"enabled": True}})):
        objects = render(chart, values)
        merged = chart.merge_values(values)
        classes = by_kind(objects, "WorkloadPriorityClass")
        notebook, job = classes[f"{RELEASE}-notebook"], classes[f"{RELEASE}-job"]
        assert notebook["value"] > job["value"]
        assert notebook["value"] == merged["kueue"]["priorities"]["notebook"]
        for queue in by_kind(objects, "ClusterQueue").values():
            # a queue reclaims only from lower priority than what it admits: never a notebook
            assert queue["spec"]["preemption"]["reclaimWithinCohort"] in ("LowerPriority", "Never")
            assert queue["spec"]["preemption"]["withinClusterQueue"] != "LowerOrNewerEqualPriority"
        for obj in objects:
            if obj["apiVersion"].startswith("kueue.x-k8s.io/"):
                validate_custom(obj)


def test_kueue_fair_sharing_weights_follow_the_guarantees(chart: helm.Chart) -> None:
    values = values_of("large")
    queues = by_kind(render(chart, values), "ClusterQueue")
    teams = {**values["gpupool"]["teams"], "everyone": values["gpupool"]["everyone"]}
    for name, spec in teams.items():
        weight = queues[f"{RELEASE}-{name}"]["spec"]["fairSharing"]["weight"]
        expected = 2 if name == "theory" else spec.get("guarantee", 0)  # theory: weights.theory
        assert quantity_milli(weight) == round(expected * 1000), name
    off = merge(values, {"kueue": {"fairSharing": {"enabled": False}}})
    assert not any(
        "fairSharing" in q["spec"] for q in by_kind(render(chart, off), "ClusterQueue").values()
    )


def test_default_kueue_settings_keep_the_promise(chart: helm.Chart) -> None:
    kueue = chart.values["kueue"]
    assert kueue["preemption"]["reclaimWithinCohort"] == "LowerPriority"
    assert kueue["priorities"]["notebook"] > kueue["priorities"]["job"]
    assert chart.values["priorityClasses"]["notebook"] > chart.values["priorityClasses"]["job"]


# -- idle reapers --------------------------------------------------------------------------------
def test_culler_waits_longer_than_the_reclaimer(chart: helm.Chart, tmp_path: Path) -> None:
    from gpupool.hub.reclaim import DEFAULT_POLICY

    cull = chart.values["jupyterhub"]["cull"]
    assert (
        cull["enabled"]
        and cull["timeout"] >= int(DEFAULT_POLICY["idle_minutes"]) * 60 + cull["every"]
    )
    values = values_of("large")
    c = hub_config(render(chart, values), tmp_path)
    policies = c.IdleReclaimer.policies
    assert policies == values["gpupool"]["idlePolicies"]
    base = {**DEFAULT_POLICY, **policies["*"]}
    longest = max(
        {**base, **p}["idle_minutes"] for p in policies.values() if {**base, **p}["action"] != "off"
    )
    assert longest == 240  # theory; finance's 600 is off
    big = values["jupyterhub"]["cull"]
    assert big["timeout"] >= longest * 60 + big["every"]


# -- metrics -------------------------------------------------------------------------------------
def test_service_monitor_reads_the_jupyterhub_charts_secret(chart: helm.Chart) -> None:
    objects = render(chart, values_of("large"))
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"] == {
        "name": "hub",
        "key": "hub.services.prometheus.apiToken",
    }
    policy = by_kind(objects, "NetworkPolicy")["gpupool-hub-metrics"]
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"component": "hub", "release": RELEASE}
    }
    ((rule,),) = [r["from"] for r in policy["spec"]["ingress"]]
    assert rule["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
    }
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": 8081, "protocol": "TCP"}]
    closed = merge(values_of("large"), {"metrics": {"prometheusAccess": {"enabled": False}}})
    assert "gpupool-hub-metrics" not in by_kind(render(chart, closed), "NetworkPolicy")
    named = merge(
        values_of("large"), {"metrics": {"serviceMonitor": {"tokenSecret": {"name": "s"}}}}
    )
    (monitor,) = by_kind(render(chart, named), "ServiceMonitor").values()
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"]["name"] == "s"


# -- alerts ----------------------------------------------------------------------------------------
# The Kubernetes reconciliation's counter (gpupool.kube.reconcile), allowed while that
# module is not there yet.
PENDING_METRICS = {"gpupool_kube_drift_total"}


def hub_metric_names(tmp_path: Path) -> set[str]:
    """The sample names the hub exports: gpupool's collector over a simulated pool (with a job
    manager stand-in) and gpupool's own counters and histograms."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from gpupool.hub.collector import PoolCollector  # imports (registers) gpupool.metrics

    with contextlib.suppress(ImportError):  # registers gpupool_kube_drift
        importlib.import_module("gpupool.kube.reconcile")

    c = Config()
    c.GPUPool.inventory = "simulated:n1: 1x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'metrics.sqlite'}"
    c.GPUPool.offers = {"cpu": {"kind": "cpu"}}
    c.GPUPool.teams = {"vision": {"guarantee": 1}}

    class Log:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    pool = Pool.from_config(GPUPool(config=c), Log())  # type: ignore[arg-type]
    collector = PoolCollector(pool, SimpleNamespace(jobs={}))  # type: ignore[arg-type]
    names = {m.name for m in collector.collect()}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for metric in REGISTRY.collect():  # labelled families have no samples until used
        if metric.name.startswith("gpupool_"):
            names |= {metric.name + s for s in suffixes.get(metric.type, ("",))}
    return names


def test_alerts_use_the_metrics_the_hub_exports(chart: helm.Chart, tmp_path: Path) -> None:
    objects = render(chart, values_of("large"))
    (rule,) = by_kind(objects, "PrometheusRule").values()
    validate_custom(rule)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {
        "GPUPoolIdleGPUNotebooks",
        "GPUPoolTeamBorrowing",
        "GPUPoolJobsPending",
        "GPUPoolSlowQueue",
        "GPUPoolKubeDrift",
        "GPUPoolStoreUnhealthy",
    }
    assert alerts["GPUPoolIdleGPUNotebooks"]["for"] == "20m"  # idleMinutes of the large values
    assert alerts["GPUPoolJobsPending"]["for"] == "90m"
    assert alerts["GPUPoolSlowQueue"]["expr"].endswith("> 5400")
    assert alerts["GPUPoolTeamBorrowing"]["for"] == "120m"  # the chart's default
    exported = hub_metric_names(tmp_path)
    used = {n for r in group["rules"] for n in re.findall(r"\bgpupool_\w+", r["expr"])}
    assert used >= {
        "gpupool_idle_notebooks",
        "gpupool_team_borrowed_gpu_equivalents",
        "gpupool_store_healthy",
    }
    assert used - exported <= PENDING_METRICS, sorted(used - exported)
    for r in group["rules"]:  # each alert says whose it is
        by = re.search(r"by \((\w+)", r["expr"])
        assert by and f"$labels.{by[1]} }}}}" in r["annotations"]["summary"], r["alert"]


def test_node_pools_reach_the_hubs_pool_as_declared(chart: helm.Chart, tmp_path: Path) -> None:
    declared = {
        "a100": {
            "node": "8x A100-80GB",
            "max_nodes": 4,
            "node_selector": {"cloud.google.com/gke-nodepool": "a100"},
        }
    }
    objects = render(chart, merge(values_of("small"), {"gpupool": {"nodePools": declared}}))
    (pool,) = parse_node_pools(GPUPool(config=hub_config(objects, tmp_path)).node_pools)
    assert (pool.name, pool.max_nodes, len(pool.node.gpus)) == ("a100", 4, 8)
    assert pool.node_selector == (("cloud.google.com/gke-nodepool", "a100"),)
    with pytest.raises(helm.HelmValuesError, match="max_nodes"):
        render(chart, merge(values_of("small"), {"gpupool": {"nodePools": {"a": {"node": "x"}}}}))
