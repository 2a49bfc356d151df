"""The chart rendered together with the JupyterHub chart it depends on (zero-to-jupyterhub, the
release ``Chart.yaml`` names), checked with real tools.

- Every object, the JupyterHub chart's included, passes ``kubernetes_validate`` strictly (custom
  resources: :mod:`tests.deploy.crd_schemas`).
- The names gpupool's objects use are the JupyterHub chart's: the ServiceMonitor's Secret holds
  the Prometheus service's token; the hub ServiceAccount the RBAC binds exists.
- The two idle reapers agree with the JupyterHub chart on: its culler waits longer than gpupool.
- Connectivity, by network-config-analyzer (``nca``) over every NetworkPolicy rendered plus the
  per-job policies the hub creates (built by ``gpupool.kube.manifests.make_network_policy``) for two
  jobs of two users, with pods labelled as the charts and the hub's Job label them:
  rank <-> rank within a job (``j1-1 -> j1-0`` on 29500), job -> cluster DNS and Prometheus -> hub
  metrics allowed; across jobs (``j2-0 -> j1-0`` on 29500, either way), a notebook -> job pods,
  job -> hub, job -> the hub's database (PostgreSQL in another namespace) and job -> the internet
  denied.
- checkov finds no failed check but those listed, each with its reason, in
  ``tests/deploy/checkov-baseline.txt``; every listed one still occurs (no stale skips).

The JupyterHub chart comes from ``helm/gpupool/charts/`` (``helm dependency build``) or else
from ``shared/charts/`` beside the repository; without either these tests skip, saying so. ``nca``
and ``checkov`` run from ``$GPUPOOL_TOOLS_BIN``, else ``.venv-tools/bin`` (``make tools-venv``:
their dependencies clash with the hub's), else ``PATH``; without them those tests skip.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from gpupool.core.jobs import Job, JobSpec
from gpupool.core.ledger import Allocation
from gpupool.kube.manifests import job_name, make_job, make_network_policy
from tests.deploy.chart_fixtures import (
    CHART,
    NAMESPACE,
    RELEASE,
    ROOT,
    by_kind,
    dependency_version,
    merge,
    render_all,
    render_with_origin,
    validate_object,
    z2jh_archive,
    z2jh_chart,
)

BASELINE = Path(__file__).with_name("checkov-baseline.txt")


@pytest.fixture(scope="module")
def full_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[helm.Chart]:
    with z2jh_chart(tmp_path_factory) as loaded:
        yield loaded


def values_with_hub(name: str) -> dict[str, Any]:
    if name == "default":
        return {}
    values: dict[str, Any] = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    return values


def test_the_archive_is_the_release_chart_yaml_names(full_chart: helm.Chart) -> None:
    archive = z2jh_archive()
    assert dependency_version() == "4.4.0"
    assert archive is not None and archive.name == "jupyterhub-4.4.0.tgz"
    values = full_chart.merge_values({})
    assert values["jupyterhub"]["cull"]["timeout"] == 14400  # ours over the JupyterHub chart's


@pytest.mark.parametrize("name", ["default", "small", "large"])
def test_every_object_with_the_jupyterhub_chart_is_valid(full_chart: helm.Chart, name: str) -> None:
    objects = render_all(full_chart, values_with_hub(name))
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "Secret", "NetworkPolicy", "ConfigMap"} <= kinds
    for obj in objects:
        validate_object(obj)


def test_gpupool_names_the_jupyterhub_charts_objects(full_chart: helm.Chart) -> None:
    objects = render_all(full_chart, values_with_hub("large"))
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    (endpoint,) = monitor["spec"]["endpoints"]
    credentials = endpoint["authorization"]["credentials"]
    secret = by_kind(objects, "Secret")[credentials["name"]]
    assert credentials["key"] in secret["data"]
    service = by_kind(objects, "Service")["hub"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    hub_pod = by_kind(objects, "Deployment")["hub"]["spec"]["template"]
    metrics = by_kind(objects, "NetworkPolicy")["gpupool-hub-metrics"]
    selector = metrics["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= hub_pod["metadata"]["labels"].items()
    accounts = by_kind(objects, "ServiceAccount")
    bindings = [*by_kind(objects, "RoleBinding").values()]
    bindings += by_kind(objects, "ClusterRoleBinding").values()
    for binding in bindings:
        for subject in binding.get("subjects", []):
            if subject["kind"] == "ServiceAccount":
                assert subject["name"] in accounts, binding["metadata"]["name"]
    assert hub_pod["spec"]["serviceAccountName"] == "hub"
    # a fullnameOverride renames the JupyterHub chart's Secret, and the ServiceMonitor follows
    renamed = merge(values_with_hub("large"), {"jupyterhub": {"fullnameOverride": "jh"}})
    objects = render_all(full_chart, renamed)
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    name = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]["name"]
    assert name == "jh-hub" and name in by_kind(objects, "Secret")


def test_the_culler_waits_for_gpupool_with_the_jupyterhub_chart_on(full_chart: helm.Chart) -> None:
    for name in ("default", "large"):
        render_all(full_chart, values_with_hub(name))
    with pytest.raises(helm.HelmRenderError, match=r"jupyterhub\.cull\.timeout: 3600 seconds"):
        render_all(full_chart, {"jupyterhub": {"cull": {"timeout": 3600}}})
    render_all(full_chart, {"jupyterhub": {"cull": {"enabled": False, "timeout": 3600}}})


# -- tools ----------------------------------------------------------------------------------------
def tool(name: str) -> str:
    folders = [os.environ.get("GPUPOOL_TOOLS_BIN", ""), str(ROOT / ".venv-tools" / "bin")]
    for folder in folders:
        if folder and (Path(folder) / name).is_file():
            return str(Path(folder) / name)
    found = shutil.which(name)
    if found is None:
        pytest.skip(
            f"{name} is not installed: `make tools-venv` installs it into .venv-tools "
            "(or set GPUPOOL_TOOLS_BIN)"
        )
    return found


# -- connectivity (network-config-analyzer) ------------------------------------------------------
def _namespace(name: str) -> dict[str, Any]:
    meta = {"name": name, "labels": {"kubernetes.io/metadata.name": name}}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def _pod(name: str, namespace: str, labels: dict[str, str], port: int = 0) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "example"}
    if port:
        container["ports"] = [{"containerPort": port, "name": "http", "protocol": "TCP"}]
    meta = {"name": name, "namespace": namespace, "labels": labels}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [container]},
    }


def _policy(
    name: str, pods: dict[str, str], direction: str, peer: dict[str, Any], ports: Any
) -> dict[str, Any]:
    rule: dict[str, Any] = {("to" if direction == "Egress" else "from"): [peer]}
    if ports:
        rule["ports"] = ports
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": [direction],
            direction.lower(): [rule],
        },
    }


def _two_jobs() -> tuple[Job, Job]:
    """Two-node CPU jobs of two users in two teams."""
    script = "import torch.distributed as dist\n"
    return (
        Job("0f3a9c2b7d41", "alice", "vision", JobSpec(script, nodes=2), state="starting"),
        Job("7c1d2e9a0b33", "bob", "nlp", JobSpec(script, nodes=2), state="starting"),
    )


J1, J2 = _two_jobs()
INDEX = "batch.kubernetes.io/job-completion-index"


def _job_pod_labels(job: Job, index: int) -> dict[str, str]:
    """A job pod's labels: the hub's Job template's, plus those the Job controller adds."""
    allocations = [
        Allocation(f"{job.id}-{i}", job.owner, job.team, "cpu", "job", job.id, 1, 0, None, ())
        for i in range(job.spec.nodes)
    ]
    built = make_job(
        job, allocations, pod_template={}, namespace=NAMESPACE, script_configmap="s", image="i"
    )
    labels: dict[str, str] = built["spec"]["template"]["metadata"]["labels"]
    return labels | {INDEX: str(index), "batch.kubernetes.io/job-name": built["metadata"]["name"]}


JOB = {"gpupool.io/job": J1.id}
OTHER_JOB = {"gpupool.io/job": J2.id}
"""Whole jobs, not single pods: nca reads every scalar that parses as an integer as one, so a
selector on ``batch.kubernetes.io/job-completion-index: "0"`` fails its parser."""
RENDEZVOUS = [{"port": 29500, "protocol": "TCP"}]
DNS = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]


def _ns_peer(namespace: str, pods: dict[str, str]) -> dict[str, Any]:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": pods},
    }


SPECS = {
    "rank-to-rank": (
        "permits",
        _policy("rank-to-rank", JOB, "Egress", {"podSelector": {"matchLabels": JOB}}, None),
    ),
    "rank-from-rank": (
        "permits",
        _policy("rank-from-rank", JOB, "Ingress", {"podSelector": {"matchLabels": JOB}}, None),
    ),
    "job-to-dns": (
        "permits",
        _policy("job-to-dns", JOB, "Egress", _ns_peer("kube-system", {"k8s-app": "kube-dns"}), DNS),
    ),
    "other-job-to-dns": (
        "permits",
        _policy(
            "other-job-to-dns",
            OTHER_JOB,
            "Egress",
            _ns_peer("kube-system", {"k8s-app": "kube-dns"}),
            DNS,
        ),
    ),
    "rank-to-rank-rendezvous": (  # j1-1 -> j1-0 (and j1-0 -> j1-1) on 29500
        "permits",
        _policy(
            "rank-to-rank-rendezvous",
            JOB,
            "Ingress",
            {"podSelector": {"matchLabels": JOB}},
            RENDEZVOUS,
        ),
    ),
    "other-job-to-rendezvous": (  # j2-0 -> j1-0 (and every other pair) on 29500
        "forbids",
        _policy(
            "other-job-to-rendezvous",
            JOB,
            "Ingress",
            {"podSelector": {"matchLabels": OTHER_JOB}},
            RENDEZVOUS,
        ),
    ),
    "other-job-egress-to-job": (
        "forbids",
        _policy(
            "other-job-egress", OTHER_JOB, "Egress", {"podSelector": {"matchLabels": JOB}}, None
        ),
    ),
    "job-to-other-job": (
        "forbids",
        _policy(
            "job-to-other-job", JOB, "Egress", {"podSelector": {"matchLabels": OTHER_JOB}}, None
        ),
    ),
    "prometheus-to-hub": (
        "permits",
        _policy(
            "prometheus-to-hub",
            {"component": "hub"},
            "Ingress",
            _ns_peer("monitoring", {"app.kubernetes.io/name": "prometheus"}),
            [{"port": 8081, "protocol": "TCP"}],
        ),
    ),
    "notebook-to-job": (
        "forbids",
        _policy(
            "notebook-to-job",
            JOB,
            "Ingress",
            {"podSelector": {"matchLabels": {"component": "singleuser-server"}}},
            None,
        ),
    ),
    "job-to-hub": (
        "forbids",
        _policy(
            "job-to-hub",
            JOB,
            "Egress",
            {"podSelector": {"matchLabels": {"component": "hub"}}},
            None,
        ),
    ),
    "job-to-proxy": (
        "forbids",
        _policy(
            "job-to-proxy",
            JOB,
            "Egress",
            {"podSelector": {"matchLabels": {"component": "proxy"}}},
            None,
        ),
    ),
    "job-to-database": (
        "forbids",
        _policy("job-to-database", JOB, "Egress", _ns_peer("db", {"app": "postgres"}), None),
    ),
    "job-to-internet": (
        "forbids",
        _policy("job-to-internet", JOB, "Egress", {"ipBlock": {"cidr": "1.1.1.1/32"}}, None),
    ),
    "job-to-other-dns-ports": (
        "forbids",
        _policy(
            "job-to-other-dns-ports",
            JOB,
            "Egress",
            _ns_peer("kube-system", {"k8s-app": "kube-dns"}),
            [{"port": 443, "protocol": "TCP"}],
        ),
    ),
}
"""What each check asks of the rendered policies: ``permits`` all of, or ``forbids`` all of, the
connections of a NetworkPolicy written as the question."""


@pytest.fixture(scope="module")
def cluster(full_chart: helm.Chart, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every NetworkPolicy of the large values and the hub's for two jobs, and pods labelled as
    the charts (and the hub's Jobs) label them."""
    objects = render_all(full_chart, values_with_hub("large"))
    folder = tmp_path_factory.mktemp("nca")
    policies = list(by_kind(objects, "NetworkPolicy").values())
    assert {"hub", "proxy", "singleuser", "gpupool-job-baseline", "gpupool-hub-metrics"} <= {
        p["metadata"]["name"] for p in policies
    }
    # the per-job policies as the hub makes them, with the DNS peers the chart hands the hub
    hub = json.loads(by_kind(objects, "ConfigMap")["gpupool-config"]["data"]["gpupool.json"])
    dns = hub["KubeJobBackend"]["network_policy_dns"]
    for job in (J1, J2):
        owner = {"metadata": {"name": job_name(job), "uid": f"uid-{job.id}"}}
        policies.append(make_network_policy(job, NAMESPACE, owner, dns=dns))
    deployments = by_kind(objects, "Deployment")
    singleuser = {
        "component": "singleuser-server",
        "app": "jupyterhub",
        "release": RELEASE,
        "hub.jupyter.org/network-access-hub": "true",
    }
    pods = [
        _pod("hub", NAMESPACE, deployments["hub"]["spec"]["template"]["metadata"]["labels"], 8081),
        _pod(
            "proxy", NAMESPACE, deployments["proxy"]["spec"]["template"]["metadata"]["labels"], 8000
        ),
        _pod("jupyter-ada", NAMESPACE, singleuser, 8888),
        # job pods carry the hub's Job labels only (gpupool.kube.manifests.make_job), not the
        # notebook's
        _pod("j1-0", NAMESPACE, _job_pod_labels(J1, 0)),
        _pod("j1-1", NAMESPACE, _job_pod_labels(J1, 1)),
        _pod("j2-0", NAMESPACE, _job_pod_labels(J2, 0)),
        _pod("j2-1", NAMESPACE, _job_pod_labels(J2, 1)),
        _pod("coredns", "kube-system", {"k8s-app": "kube-dns"}),
        _pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
        _pod("postgres", "db", {"app": "postgres"}),
    ]
    files = {
        "policies": folder / "policies.yaml",
        "pods": folder / "pods.yaml",
        "ns": folder / "ns.yaml",
    }
    files["policies"].write_text(yaml.safe_dump_all(policies))
    files["pods"].write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "PodList", "items": pods}))
    namespaces = [_namespace(n) for n in (NAMESPACE, "kube-system", "monitoring", "db")]
    files["ns"].write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "NamespaceList", "items": namespaces})
    )
    for name, (_, spec) in SPECS.items():
        files[name] = folder / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(spec))
    return files


@pytest.mark.parametrize("check", list(SPECS))
def test_connectivity(cluster: dict[str, Path], check: str) -> None:
    query = SPECS[check][0]
    result = subprocess.run(
        [
            tool("nca"),
            f"--{query}",
            str(cluster[check]),
            "--base_np_list",
            str(cluster["policies"]),
            "--pod_list",
            str(cluster["pods"]),
            "--ns_list",
            str(cluster["ns"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    verdict = f"policies.yaml {query} " if query == "forbids" else "policies.yaml permits all"
    assert result.returncode == 0 and verdict in result.stdout, result.stdout + result.stderr


def test_the_metrics_path_is_closed_without_gpupools_policy(
    cluster: dict[str, Path], tmp_path: Path
) -> None:
    """The question is meaningful: without gpupool-hub-metrics the JupyterHub chart keeps
    Prometheus out, as the issue said."""
    policies = [
        p
        for p in yaml.safe_load_all(cluster["policies"].read_text())
        if p["metadata"]["name"] != "gpupool-hub-metrics"
    ]
    closed = tmp_path / "closed.yaml"
    closed.write_text(yaml.safe_dump_all(policies))
    result = subprocess.run(
        [
            tool("nca"),
            "--permits",
            str(cluster["prometheus-to-hub"]),
            "--base_np_list",
            str(closed),
            "--pod_list",
            str(cluster["pods"]),
            "--ns_list",
            str(cluster["ns"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and "does not permit" in result.stdout, result.stdout


def test_ranks_reach_each_other_only_through_the_hubs_per_job_policy(
    cluster: dict[str, Path], tmp_path: Path
) -> None:
    """Without the hub's per-job policies the chart's own admit no traffic between job pods,
    not even within a job (and with them, only within: ``test_connectivity``)."""
    policies = [
        p
        for p in yaml.safe_load_all(cluster["policies"].read_text())
        if p["metadata"]["name"] not in (job_name(J1), job_name(J2))
    ]
    chart_only = tmp_path / "chart-only.yaml"
    chart_only.write_text(yaml.safe_dump_all(policies))
    result = subprocess.run(
        [
            tool("nca"),
            "--permits",
            str(cluster["rank-to-rank-rendezvous"]),
            "--base_np_list",
            str(chart_only),
            "--pod_list",
            str(cluster["pods"]),
            "--ns_list",
            str(cluster["ns"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and "does not permit" in result.stdout, result.stdout


# -- checkov -------------------------------------------------------------------------------------
def baseline() -> list[tuple[str, str, str]]:
    """(check id, resource glob, reason) per line of checkov-baseline.txt."""
    out = []
    for line in BASELINE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        check, resource, reason = line.split(maxsplit=2)
        assert reason.strip(), f"no reason for {check} {resource}"
        out.append((check, resource, reason))
    return out


@pytest.mark.parametrize("name", ["default", "large"])
def test_checkov_finds_nothing_outside_the_baseline(
    full_chart: helm.Chart, name: str, tmp_path: Path
) -> None:
    objects = render_with_origin(full_chart, values_with_hub(name))
    z2jh = {
        f"{o['kind']}.{o['metadata'].get('namespace', '')}.{o['metadata']['name']}".replace(
            "..", "."
        )
        for path, o in objects
        if path.startswith("gpupool/charts/jupyterhub/")
    }
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(yaml.safe_dump_all([o for _, o in objects]))
    result = subprocess.run(
        [
            tool("checkov"),
            "-f",
            str(manifests),
            "--framework",
            "kubernetes",
            "--quiet",
            "--compact",
            "--skip-download",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
    )
    assert result.returncode in (0, 1), result.stderr[-2000:]
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [
        (c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]
    ]
    skips = baseline()

    def listed(failure: tuple[str, str], check: str, pattern: str) -> bool:
        origin, _, glob = pattern.rpartition(":")
        if origin == "z2jh" and failure[1] not in z2jh:
            return False
        return failure[0] == check and fnmatch.fnmatch(failure[1], glob)

    unexplained = [f for f in failed if not any(listed(f, c, g) for c, g, _ in skips)]
    assert not unexplained, f"checkov failures not in {BASELINE.name}: {sorted(unexplained)}"
    assert report_summary_ok(reports)
    if name == "large":  # every optional part on: each listed skip is still needed
        stale = [(c, g) for c, g, _ in skips if not any(listed(f, c, g) for f in failed)]
        assert not stale, f"{BASELINE.name} lists checks that no longer fail: {stale}"


def report_summary_ok(reports: list[dict[str, Any]]) -> bool:
    """checkov parsed every manifest and ran checks on them."""
    return all(r["summary"]["parsing_errors"] == 0 and r["summary"]["passed"] > 0 for r in reports)
