"""Kueue's admission for the API stand-in: quota, cohort arithmetic and covered resources.

:class:`Kueue` admits the stand-in's suspended Jobs that carry a queue label
(``kueue.x-k8s.io/queue-name``) as Kueue's scheduler does, from the objects the Helm chart
renders: its ClusterQueues and LocalQueues, and the resource transformations of the
``gpupool-kueue-resources`` ConfigMap (what an admin merges into Kueue's Configuration). It
follows kueue at ff69552 (v0.20 development):

- *requests*: a Workload's pod set asks for its pod template's requests (a container's request
  defaults to its limit: kubernetes ``pkg/apis/core/v1/defaults.go`` ``SetDefaults_Pod``), times
  the pod count, after the transformations (``applyResourceTransformations`` in kueue
  ``pkg/workload/workload.go``: the outputs times the input quantity, exact decimals; ``Replace``
  drops the input). Every resource but ``cpu`` is then counted in whole units, a fraction rounded
  up (``ResourceValue`` in ``pkg/resources/requests.go``: ``Quantity.Value()``), per pod, and
  multiplied by the count (``totalRequestsFromPodSets``); so are the quotas
  (``AmountFromQuantity`` in ``pkg/resources/amount.go``).
- *covered*: a requested resource that no resource group of the ClusterQueue covers makes the
  Workload inadmissible: "resource %s unavailable in ClusterQueue" (``findFlavorForPodSets`` in
  ``pkg/scheduler/flavorassigner/flavorassigner.go``).
- *fit*: ``fitsResourceQuota`` (same file): above the ClusterQueue's ``PotentialAvailable`` the
  Workload never fits ("insufficient quota for ... > maximum capacity"); above its
  ``Available`` it waits ("insufficient unused quota for %s in flavor %s, %s more needed").
  Both come from the cohort tree of ``pkg/cache/scheduler/resource_node.go`` (``available``,
  ``potentialAvailable``, ``localQuota``, ``accumulateFromChild``), written out here as a tree
  of one cohort, as Kueue keeps it. Preemption is not modelled (the stand-in's
  :meth:`StandIn.kueue_preempt` does that on a test's word): a Workload that does not fit waits.

A pod with a queue label is a Workload of its own (Kueue's pod integration): Kueue's webhook
gates it (``kueue.x-k8s.io/admission``; ``gate`` in kueue
``pkg/controller/jobs/pod/pod_controller.go``, called from ``PodWebhook.Default``) and removes the
gate on admission (``prepare`` in ``Pod.Run``, same file); kube-scheduler does not schedule a
gated pod (kubernetes ``pkg/scheduler/framework/plugins/schedulinggates``: ``PreEnqueue``). The
stand-in has no gates: a test asks :meth:`Kueue.admit_pod` and schedules the pod only when it is
admitted.

Contract: :meth:`Kueue.schedule` admits, in creation order, each waiting Job that fits (calling
:meth:`StandIn.kueue_admit`, which resumes it) and records why each other one waits, in Kueue's
words (``pending``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import yaml

from tests.deploy.kube_api import StandIn

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
_SUFFIX = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
}


def quantity(text: Any) -> Decimal:
    """A Kubernetes quantity as an exact decimal ("500m" -> 0.5). Parsing keeps at most nine
    decimals, rounding up (apimachinery ``ParseQuantity``)."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text).strip())
    assert match and match[2] in _SUFFIX, f"not a quantity: {text!r}"
    value = Decimal(match[1]) * _SUFFIX[match[2]]
    nanos = value * Decimal(10**9)
    return Decimal(math.ceil(nanos)) / Decimal(10**9)


def kueue_units(resource: str, value: Decimal) -> int:
    """Kueue's integer amount: milli-units for cpu, whole units rounded up for all else."""
    return math.ceil(value * 1000) if resource == "cpu" else math.ceil(value)


@dataclass
class Node:
    """A node of Kueue's cohort tree (``resourceNode``): a ClusterQueue or the cohort."""

    nominal: dict[str, int] = field(default_factory=dict)
    borrowing: dict[str, int | None] = field(default_factory=dict)
    lending: dict[str, int | None] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)

    def local(self, resource: str) -> int:  # localQuota
        limit = self.lending.get(resource)
        return 0 if limit is None else max(0, self.nominal.get(resource, 0) - limit)


@dataclass
class Kueue:
    queues: dict[str, Node]
    """ClusterQueues by name, all in one cohort (the chart's)."""
    covered: dict[str, set[str]]
    """What each ClusterQueue's resource groups cover."""
    flavor: dict[str, str]
    local_queues: dict[tuple[str, str], str]
    """(namespace, LocalQueue) -> ClusterQueue."""
    transformations: dict[str, tuple[str, dict[str, Decimal]]]
    admitted: dict[tuple[str, str], tuple[str, dict[str, int]]] = field(default_factory=dict)
    pending: dict[tuple[str, str], str] = field(default_factory=dict)

    @classmethod
    def from_chart(cls, objects: list[dict[str, Any]]) -> Kueue:
        queues, covered, flavor, local = {}, {}, {}, {}
        transformations: dict[str, tuple[str, dict[str, Decimal]]] = {}
        for obj in objects:
            kind, meta = obj["kind"], obj["metadata"]
            if kind == "ClusterQueue":
                node, names = Node(), set()
                for group in obj["spec"]["resourceGroups"]:
                    names |= set(group["coveredResources"])
                    (fl,) = group["flavors"]
                    flavor[meta["name"]] = fl["name"]
                    for r in fl["resources"]:
                        name = r["name"]
                        node.nominal[name] = kueue_units(name, quantity(r["nominalQuota"]))
                        for key, into in (
                            ("borrowingLimit", node.borrowing),
                            ("lendingLimit", node.lending),
                        ):
                            into[name] = kueue_units(name, quantity(r[key])) if key in r else None
                queues[meta["name"]], covered[meta["name"]] = node, names
            elif kind == "LocalQueue":
                local[meta["namespace"], meta["name"]] = obj["spec"]["clusterQueue"]
            elif kind == "ConfigMap" and meta["name"] == "gpupool-kueue-resources":
                config = yaml.safe_load(obj["data"]["resources.yaml"])
                for t in config["resources"]["transformations"]:
                    outputs = {k: quantity(v) for k, v in t["outputs"].items()}
                    transformations[t["input"]] = (t.get("strategy", "Retain"), outputs)
        return cls(queues, covered, flavor, local, transformations)

    # -- the cohort tree (resource_node.go) -----------------------------------------------------
    def _cohort(self, resource: str) -> tuple[int, int]:
        """The cohort's SubtreeQuota and Usage (``accumulateFromChild``)."""
        quota = sum(q.nominal.get(resource, 0) - q.local(resource) for q in self.queues.values())
        usage = sum(
            max(0, q.usage.get(resource, 0) - q.local(resource)) for q in self.queues.values()
        )
        return quota, usage

    def available(self, queue: str, resource: str) -> int:
        node = self.queues[queue]
        quota, usage = self._cohort(resource)
        parent = quota - usage
        lq = node.local(resource)
        limit = node.borrowing.get(resource)
        if limit is not None:
            stored = node.nominal.get(resource, 0) - lq
            used_in_parent = max(0, node.usage.get(resource, 0) - lq)
            parent = min(stored - used_in_parent + limit, parent)
        local_available = max(0, lq - node.usage.get(resource, 0))
        return max(0, local_available + parent)  # ClusterQueueSnapshot.Available

    def potential(self, queue: str, resource: str) -> int:
        node = self.queues[queue]
        most = node.local(resource) + self._cohort(resource)[0]
        limit = node.borrowing.get(resource)
        if limit is not None:
            most = min(node.nominal.get(resource, 0) + limit, most)
        return most

    # -- workloads ------------------------------------------------------------------------------
    def pod_requests(self, pod_spec: dict[str, Any]) -> dict[str, int]:
        """What one pod of the template counts as in Kueue, after the transformations."""
        total: dict[str, Decimal] = {}
        for c in pod_spec.get("containers") or []:
            res = c.get("resources") or {}
            asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}
            for name, value in asked.items():
                total[name] = total.get(name, Decimal(0)) + quantity(value)
        out: dict[str, Decimal] = {}
        for name, value in total.items():
            if name not in self.transformations:
                out[name] = out.get(name, Decimal(0)) + value
                continue
            strategy, outputs = self.transformations[name]
            for target, factor in outputs.items():
                out[target] = out.get(target, Decimal(0)) + value * factor
            if strategy == "Retain":
                out[name] = out.get(name, Decimal(0)) + value
        return {k: kueue_units(k, v) for k, v in out.items()}

    def workload(self, job: dict[str, Any]) -> tuple[str, dict[str, int]]:
        """The ClusterQueue and total requests of a Job's Workload (one pod set)."""
        meta, spec = job["metadata"], job["spec"]
        queue = self.local_queues.get((meta["namespace"], meta["labels"][QUEUE_LABEL]), "")
        count = int(spec.get("parallelism", 1))
        per_pod = self.pod_requests(spec["template"]["spec"])
        return queue, {k: v * count for k, v in per_pod.items() if v}

    def fits(self, queue: str, requests: dict[str, int]) -> str:
        """'' when the Workload fits the ClusterQueue now, else why not, in Kueue's words."""
        if queue not in self.queues:
            return "ClusterQueue doesn't exist"
        flavor = self.flavor[queue]
        for resource in sorted(requests):
            if resource not in self.covered[queue]:
                return f"resource {resource} unavailable in ClusterQueue"
        for resource, value in sorted(requests.items()):
            most = self.potential(queue, resource)
            if value > most:
                return (
                    f"insufficient quota for {resource} in flavor {flavor}, request ({value}) "
                    f"> maximum capacity ({most})"
                )
            available = self.available(queue, resource)
            if value > available:
                return (
                    f"insufficient unused quota for {resource} in flavor {flavor}, "
                    f"{value - available} more needed"
                )
        return ""

    def schedule(self, api: StandIn) -> None:
        """One pass of Kueue's scheduler over the stand-in's waiting Jobs (see the contract)."""
        jobs = sorted(
            api.objects["jobs"].values(), key=lambda j: int(j["metadata"]["resourceVersion"])
        )
        for job in jobs:
            meta = job["metadata"]
            key = (meta["namespace"], meta["name"])
            if QUEUE_LABEL not in (meta.get("labels") or {}) or key in self.admitted:
                continue
            if not job["spec"].get("suspend"):
                continue
            queue, requests = self.workload(job)
            why = self.fits(queue, requests)
            if why:
                self.pending[key] = why
                continue
            self.pending.pop(key, None)
            for resource, value in requests.items():
                usage = self.queues[queue].usage
                usage[resource] = usage.get(resource, 0) + value
            self.admitted[key] = (queue, requests)
            api.kueue_admit(meta["name"], meta["namespace"])

    def admit_pod(self, api: StandIn, namespace: str, name: str) -> str:
        """Admit the pod's Workload ('') or say why it stays gated (also in ``pending``)."""
        pod = api.objects["pods"][namespace, name]
        key = (namespace, name)
        queue = self.local_queues.get((namespace, pod["metadata"]["labels"][QUEUE_LABEL]), "")
        requests = {k: v for k, v in self.pod_requests(pod["spec"]).items() if v}
        why = self.fits(queue, requests)
        if why:
            self.pending[key] = why
            return why
        for resource, value in requests.items():
            usage = self.queues[queue].usage
            usage[resource] = usage.get(resource, 0) + value
        self.admitted[key] = (queue, requests)
        return ""

    def finish(self, namespace: str, name: str) -> None:
        """The Job's Workload finished (or was deleted): its quota is free again."""
        queue, requests = self.admitted.pop((namespace, name))
        for resource, value in requests.items():
            self.queues[queue].usage[resource] -= value
