"""The chart installed the way z2jh admins install the JupyterHub chart, rendered together with it
(zero-to-jupyterhub 4.4.0, the release ``Chart.yaml`` names; skipped, saying so, without it).

- Renaming: whatever names z2jh gives the hub's ServiceAccount (``fullnameOverride``,
  ``nameOverride``, ``hub.serviceAccount.name``, an account it does not create), gpupool's
  RoleBinding and ClusterRoleBinding name the account the hub Deployment runs as.
- An admin's own ``hub.extraVolumes`` / ``extraVolumeMounts`` (Helm replaces lists): the render
  is refused with a sentence naming what to add, and adding it gives the hub gpupool's config.
- The image pullers (hook and continuous DaemonSets) tolerate the GPU nodes' taints that
  gpupool's GPU pods tolerate, so the notebook image is pre-pulled onto GPU nodes; a GPU
  toleration the pullers lack is refused, naming it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy.chart_fixtures import (
    CHART,
    NAMESPACE,
    RELEASE,
    merge,
    render_all,
    render_with_origin,
    z2jh_chart,
)
from tests.deploy.kube_api import tolerated

GPUPOOL_TEMPLATES = "gpupool/templates/"

# The taint GKE puts on every GPU node (`nvidia.com/gpu=present:NoSchedule`), which gpupool's
# default gpuTolerations tolerate.
GKE_GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def full_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[helm.Chart]:
    with z2jh_chart(tmp_path_factory) as loaded:
        yield loaded


def hub_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """z2jh's hub Deployment, whatever it is named (its pods carry `component: hub`)."""
    (hub,) = [
        o
        for o in objects
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["metadata"]["labels"].get("component") == "hub"
    ]
    return hub


# -- 1. the hub's ServiceAccount, as z2jh names it ---------------------------------------------
RENAMINGS = [
    pytest.param({"fullnameOverride": "jhub"}, "jhub-hub", id="fullnameOverride"),
    # z2jh's fullnameOverride defaults to "", which wins over nameOverride: null lets it apply
    pytest.param(
        {"fullnameOverride": None, "nameOverride": "jh"}, f"{RELEASE}-jh-hub", id="nameOverride"
    ),
    pytest.param({"hub": {"serviceAccount": {"name": "hub-sa"}}}, "hub-sa", id="sa-name"),
    pytest.param(
        {"hub": {"serviceAccount": {"create": False, "name": "platform-hub"}}},
        "platform-hub",
        id="sa-not-created",
    ),
]


@pytest.mark.parametrize(("jupyterhub", "account"), RENAMINGS)
def test_gpupool_binds_the_account_the_hub_runs_as(
    full_chart: helm.Chart, jupyterhub: dict[str, Any], account: str
) -> None:
    """The hub's pod authenticates as system:serviceaccount:<namespace>:<serviceAccountName>,
    and Kubernetes' RBAC authorizer grants a RoleBinding's or ClusterRoleBinding's rules only to
    the subjects it names (kubernetes pkg/registry/rbac/validation/rule.go: appliesToUser matches
    a ServiceAccount subject by serviceaccount.MatchesUsername(namespace, name, user)). A
    binding naming `hub` while the hub runs as `jhub-hub` leaves the hub unable to list nodes:
    it does not start."""
    origin = render_with_origin(full_chart, {"jupyterhub": jupyterhub})
    objects = [obj for _, obj in origin]
    pod_spec = hub_deployment(objects)["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == account  # what z2jh's helper names it
    if jupyterhub.get("hub", {}).get("serviceAccount", {}).get("create", True):
        accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
        assert account in accounts
    bindings = [
        obj
        for path, obj in origin
        if path.startswith(GPUPOOL_TEMPLATES)
        and obj["kind"] in ("RoleBinding", "ClusterRoleBinding")
    ]
    assert {b["kind"] for b in bindings} == {"RoleBinding", "ClusterRoleBinding"}
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
        ], binding["metadata"]["name"]
    # the JupyterHub chart installed on its own: the bindings name rbac.hubServiceAccount
    alone = {"jupyterhub": {"enabled": False}, "rbac": {"hubServiceAccount": account}}
    with helm.Chart.load(CHART) as chart:  # a disabled dependency is dropped from the Chart
        objects = render_all(chart, alone)
    subjects = [
        s
        for o in objects
        if o["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for s in o["subjects"]
    ]
    assert [s["name"] for s in subjects] == [account, account]


# -- 2. an admin's own hub volumes -------------------------------------------------------------
ADMIN_VOLUME = {"name": "site-certs", "secret": {"secretName": "site-certs"}}
ADMIN_MOUNT = {"name": "site-certs", "mountPath": "/etc/site-certs", "readOnly": True}


def gpupool_config_mounts(objects: list[dict[str, Any]]) -> list[str]:
    """Where the hub's container mounts a volume of the gpupool-config ConfigMap."""
    pod_spec = hub_deployment(objects)["spec"]["template"]["spec"]
    names = {
        v["name"]
        for v in pod_spec.get("volumes") or []
        if (v.get("configMap") or {}).get("name") == "gpupool-config"
    }
    (hub,) = [c for c in pod_spec["containers"] if c["name"] == "hub"]
    return [m["mountPath"] for m in hub.get("volumeMounts") or [] if m["name"] in names]


@pytest.mark.parametrize(
    ("hub", "key"),
    [
        pytest.param({"extraVolumes": [ADMIN_VOLUME]}, "extraVolumes", id="volumes"),
        pytest.param({"extraVolumeMounts": [ADMIN_MOUNT]}, "extraVolumeMounts", id="mounts"),
        pytest.param(
            {"extraVolumes": [ADMIN_VOLUME], "extraVolumeMounts": [ADMIN_MOUNT]},
            "extraVolumes",
            id="both",
        ),
    ],
)
def test_an_admins_own_hub_volumes_keep_gpupool_config(
    full_chart: helm.Chart, hub: dict[str, Any], key: str
) -> None:
    """Helm replaces a list value rather than merging it (Helm's value coalescing,
    pkg/chartutil/coalesce.go in Helm 3: only maps merge), so an admin's
    `jupyterhub.hub.extraVolumes` drops the chart's gpupool-config entry and the hub stops on a
    missing /etc/gpupool/gpupool.json (and a mount of a volume the pod lacks is refused by the
    API server). The render must refuse, saying what
    to add; what it says must be enough."""
    values = {"jupyterhub": {"hub": copy.deepcopy(hub)}}
    try:
        objects = render_all(full_chart, values)
    except helm.HelmRenderError as refused:
        message = str(refused)
    else:
        pytest.fail(
            f"rendered a hub without gpupool's config: it mounts gpupool-config at "
            f"{gpupool_config_mounts(objects)} (wanted /etc/gpupool)"
        )
    assert f"jupyterhub.hub.{key}: Helm replaces" in message
    assert "/etc/gpupool/gpupool.json" in message
    # follow the sentences: add each entry they name to the admin's list, until it renders
    for _ in range(3):
        match = re.search(r"jupyterhub\.hub\.(\w+): .*?add `(\{.*?\})` to it", message)
        assert match, message
        lists = values["jupyterhub"]["hub"]
        lists[match[1]] = [*lists.get(match[1], []), yaml.safe_load(match[2])]
        try:
            objects = render_all(full_chart, values)
            break
        except helm.HelmRenderError as refused:
            message = str(refused)
    else:
        pytest.fail(f"still refused after adding what it named: {message}")
    assert gpupool_config_mounts(objects) == ["/etc/gpupool"]
    pod_spec = hub_deployment(objects)["spec"]["template"]["spec"]
    assert ADMIN_VOLUME in pod_spec["volumes"] or "extraVolumes" not in hub
    (container,) = [c for c in pod_spec["containers"] if c["name"] == "hub"]
    assert ADMIN_MOUNT in container["volumeMounts"] or "extraVolumeMounts" not in hub


# -- 3. the image pullers on GPU nodes ---------------------------------------------------------
def puller_tolerations(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The tolerations of each image-puller DaemonSet's pods, by DaemonSet name."""
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"].get("tolerations") or []
        for o in objects
        if o["kind"] == "DaemonSet" and "image-puller" in o["metadata"]["name"]
    }


def test_the_image_pullers_tolerate_the_gpu_taint(full_chart: helm.Chart) -> None:
    """The DaemonSet controller runs a daemon pod only on nodes whose NoSchedule and NoExecute
    taints its pod template tolerates (kubernetes pkg/controller/daemon/daemon_controller.go:
    NodeShouldRunDaemonPod and predicates, FindMatchingUntoleratedTaint on NoSchedule and
    NoExecute; the tolerations it adds itself cover node conditions only), the rule the
    stand-in's `tolerated` implements for kube-scheduler. Without the GPU toleration the CUDA
    notebook image is never pre-pulled onto GPU nodes, and each node's first GPU spawn pulls it
    within the start timeout."""
    pullers = puller_tolerations(render_all(full_chart, {}))
    assert set(pullers) == {"hook-image-puller", "continuous-image-puller"}
    for name, tolerations in pullers.items():
        assert tolerated(GKE_GPU_TAINT, tolerations), f"{name}: {tolerations}"
    # CPU notebooks stay off GPU nodes: the toleration is the pullers' alone
    values = full_chart.merge_values({})["jupyterhub"]
    user_pods = values["scheduling"]["userPods"]["tolerations"]
    assert not tolerated(GKE_GPU_TAINT, user_pods + values["singleuser"]["extraTolerations"])


def test_the_pullers_follow_the_large_values_gpu_taints(full_chart: helm.Chart) -> None:
    values: dict[str, Any] = yaml.safe_load((CHART / "ci" / "large-values.yaml").read_text())
    pullers = puller_tolerations(render_all(full_chart, values))
    taints = [GKE_GPU_TAINT, {"key": "dedicated", "value": "gpu", "effect": "NoExecute"}]
    assert len(pullers) == 2
    for name, tolerations in pullers.items():
        for taint in taints:
            assert tolerated(taint, tolerations), f"{name} does not tolerate {taint}"


def test_a_gpu_toleration_the_pullers_lack_is_refused(full_chart: helm.Chart) -> None:
    gpu = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "accelerator", "operator": "Equal", "value": "h100", "effect": "NoSchedule"},
    ]
    values: dict[str, Any] = {"gpupool": {"gpuTolerations": gpu}}
    with pytest.raises(
        helm.HelmRenderError,
        match=r"jupyterhub\.prePuller\.extraTolerations: .* gpupool\.gpuTolerations' accelerator",
    ):
        render_all(full_chart, values)
    # covered: the same toleration, or one on the key for every effect
    for puller in (gpu[1], {"key": "accelerator", "operator": "Exists"}):
        covered = merge(
            values, {"jupyterhub": {"prePuller": {"extraTolerations": [gpu[0], puller]}}}
        )
        render_all(full_chart, covered)
    # not covered: another value, or another effect
    for puller in (
        {**gpu[1], "value": "a100"},
        {"key": "accelerator", "operator": "Exists", "effect": "NoExecute"},
    ):
        wrong = merge(values, {"jupyterhub": {"prePuller": {"extraTolerations": [gpu[0], puller]}}})
        with pytest.raises(helm.HelmRenderError, match="accelerator"):
            render_all(full_chart, wrong)
    # no puller, nothing to pre-pull
    off = {"prePuller": {"hook": {"enabled": False}, "continuous": {"enabled": False}}}
    objects = render_all(full_chart, merge(values, {"jupyterhub": off}))
    assert not puller_tolerations(objects)
