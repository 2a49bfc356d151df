"""The stand-in API server's Dynamic Resource Allocation (``resource.k8s.io/v1``, Kubernetes 1.34):
ResourceClaims (namespaced) and ResourceSlices (cluster-scoped), and the scheduler's DRA plugin
with its structured allocator, for :mod:`tests.deploy.kube_api` (which calls the hooks here).

What it does as upstream does:
- ResourceClaims are created, read, listed, patched and deleted like any namespaced object;
  their bodies are validated strictly against the 1.34 schemas (``resource.k8s.io/v1`` is GA
  there), so an unknown field is ``422 Invalid`` as the API server's strict field validation
  answers it. The garbage collector deletes a claim whose owner (its pod) is gone.
- ResourceClaimTemplates likewise; a pod the Job controller makes (:meth:`StandIn.create_pods`)
  whose ``spec.resourceClaims`` name a template gets a claim made from it, owned by the pod, as
  the resourceclaim controller makes it (:meth:`DRA.claims_from_templates`).
- ResourceSlices are what a DRA driver's kubelet plugin publishes per node
  (:func:`gpu_slice`: NVIDIA's ``gpu.nvidia.com`` driver, one pool per node named after it,
  devices ``gpu-<minor>`` with the attributes ``type``, ``uuid``, ``productName``,
  ``pcieBusID`` and the capacity ``memory``, as ``GetDevice`` in
  ``cmd/gpu-kubelet-plugin/deviceinfo.go`` of NVIDIA/k8s-dra-driver-gpu builds them); the test
  adds them with :meth:`DRA.add_slice`; they are served (list) at
  ``/apis/resource.k8s.io/v1/resourceslices``.
- Scheduling a pod whose ``spec.resourceClaims`` name claims (``resourceClaimName``): the DRA
  plugin's Filter (``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go``)
  asks the structured allocator
  (``staging/src/k8s.io/dynamic-resource-allocation/structured``) for devices on the node for
  each request of each claim not yet allocated: devices of the node's slices, of the request's
  DeviceClass (here: the class is the driver's name, as NVIDIA's chart's ``gpu.nvidia.com``
  class selects ``device.driver == 'gpu.nvidia.com' && type == 'gpu'``), matching every CEL
  selector, not allocated to another claim (the allocator's ``allocatedDevices``), ``count`` of
  them (``ExactCount``). A node where that fails is refused with the plugin's reason ``cannot
  allocate all claims``, so a pod nothing matches stays Pending, ``Unschedulable``, with the
  scheduler's message (``0/1 nodes are available: 1 cannot allocate all claims.``). A claim that
  does not exist leaves the pod Pending too (PreFilter: ``resourceclaim "<name>" not found``).
  On binding, the claim's ``status.allocation.devices.results`` (``request``, ``driver``,
  ``pool``, ``device``) and ``nodeSelector`` (the node), and ``status.reservedFor`` (the pod),
  are written as the plugin's PreBind does.
- The CEL evaluator knows the forms gpupool emits and the DeviceClass's:
  ``device.attributes['<domain>'].<name> == '<text>'`` and ``... in ['<a>', '<b>']``, joined by
  ``&&``; any other expression is refused (a test then fails rather than pass on a guess).
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

GROUP = "resource.k8s.io"
API_VERSION = "resource.k8s.io/v1"
RESOURCES = {
    "resourceclaims": (GROUP, API_VERSION, "ResourceClaim"),
    "resourceclaimtemplates": (GROUP, API_VERSION, "ResourceClaimTemplate"),
    "resourceslices": (GROUP, API_VERSION, "ResourceSlice"),
}
"""The DRA resources the stand-in stores like its others (claims and templates namespaced and
served like its others; slices cluster-scoped, namespace ``""``, listed and watched at
``/apis/resource.k8s.io/v1/resourceslices``)."""
VALIDATE_VERSIONS = dict.fromkeys(RESOURCES, "1.34")
"""The schema version each DRA resource is validated with (``resource.k8s.io/v1`` is 1.34's)."""
UNFIT = "cannot allocate all claims"
NVIDIA = "gpu.nvidia.com"

_TERM = re.compile(
    r"^device\.attributes\['(?P<domain>[a-z0-9.-]+)'\]\.(?P<attr>[A-Za-z0-9_]+)\s*"
    r"(?:==\s*'(?P<one>[^']*)'|in\s*\[(?P<many>[^\]]*)\])$"
)


def gpu_slice(
    node: str, gpus: Sequence[tuple[str, str]], memory: str = "81559Mi"
) -> dict[str, Any]:
    """The ResourceSlice NVIDIA's DRA driver publishes for ``node``: ``gpus`` as (UUID, product)
    in PCI bus order (``gpu-<i>``, bus ``0000:<i+1>0:00.0``); ``memory`` as ``GetDevice`` writes
    NVML's total memory, ``resource.NewQuantity(bytes, resource.BinarySI)`` (an H100 80GB's
    81559 MiB serialises as ``81559Mi``)."""
    devices = [
        {
            "name": f"gpu-{i}",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": uuid},
                "productName": {"string": product},
                "pcieBusID": {"string": f"0000:{i + 1:x}0:00.0"},
            },
            "capacity": {"memory": {"value": memory}},
        }
        for i, (uuid, product) in enumerate(gpus)
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{NVIDIA}-slice"},
        "spec": {
            "driver": NVIDIA,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def cel_holds(expression: str, driver: str, attributes: Mapping[str, Any]) -> bool:
    """Whether the CEL ``expression`` holds for a device of ``driver`` with ``attributes`` (see
    the module docstring for the forms known)."""
    for term in (t.strip() for t in expression.split("&&")):
        if term == f"device.driver == '{driver}'":
            continue
        if term.startswith("device.driver =="):
            return False
        m = _TERM.match(term)
        if m is None:
            raise ValueError(f"the stand-in's CEL cannot evaluate {term!r}")
        name = m["attr"] if m["domain"] == driver else f"{m['domain']}/{m['attr']}"
        value = (attributes.get(name) or {}).get("string")
        wanted = [m["one"]] if m["one"] is not None else re.findall(r"'([^']*)'", m["many"] or "")
        if value is None or value not in wanted:
            return False
    return True


DEVICE_CLASSES = {
    NVIDIA: f"device.driver == '{NVIDIA}' && device.attributes['{NVIDIA}'].type == 'gpu'",
}
"""The DeviceClasses of the cluster, by name: their CEL selectors (NVIDIA's chart's
``gpu.nvidia.com``)."""


class DRA:
    """The slices, and the scheduler's DRA plugin over the stand-in's claims. ``api``: the
    stand-in (:class:`tests.deploy.kube_api.StandIn`), whose store keeps the slices, so they are
    listed and watched (``ADDED``/``MODIFIED``/``DELETED`` at their resourceVersions) as the
    API server serves them."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.made: dict[tuple[str, str], dict[str, str]] = {}
        """The claims made from templates, by pod (namespace, name): by the pod's claim name
        (what ``status.resourceClaimStatuses`` says; kept here, as the stand-in's kubelet
        rewrites a pod's status)."""

    @property
    def slices(self) -> list[dict[str, Any]]:
        with self.api.lock:
            return list(self.api.objects["resourceslices"].values())

    def add_slice(self, resource_slice: dict[str, Any]) -> None:
        """The driver publishes (or rewrites) a slice: stored, one watch event."""
        obj = copy.deepcopy(resource_slice)
        obj |= {"kind": "ResourceSlice", "apiVersion": API_VERSION}
        with self.api.lock:
            known = self.api.objects["resourceslices"].get(("", obj["metadata"]["name"]))
            obj["metadata"]["uid"] = known["metadata"]["uid"] if known else str(uuid.uuid4())
            self.api.objects["resourceslices"]["", obj["metadata"]["name"]] = obj
            self.api._touch(obj)

    def remove_slice(self, name: str) -> None:
        """The driver (or its plugin's cleanup) deletes a slice: one ``DELETED``."""
        with self.api.lock:
            obj = self.api.objects["resourceslices"].pop(("", name))
            self.api._deleted("resourceslices", obj)

    # -- the scheduler's plugin ---------------------------------------------------------------
    def claim_names(self, pod: Mapping[str, Any]) -> list[str]:
        """The claims the pod uses: named, or made for it from a template (its
        ``status.resourceClaimStatuses``)."""
        meta = pod["metadata"]
        made = self.made.get((meta.get("namespace", ""), meta["name"]), {})
        return [
            r.get("resourceClaimName") or made.get(r["name"]) or f"{r['name']} (not made yet)"
            for r in pod["spec"].get("resourceClaims") or []
        ]

    def claims_from_templates(
        self,
        pod: dict[str, Any],
        templates: Mapping[tuple[str, str], Any],
        create: Callable[[dict[str, Any]], tuple[int, Any]],
    ) -> None:
        """Kubernetes' resourceclaim controller (``pkg/controller/resourceclaim/controller.go``,
        ``handleClaim``): for each ``resourceClaimTemplateName`` of a new pod, a claim made from
        the template's ``spec`` (``generateName: <pod>-<claim>-``), owned by the pod
        (``controller: true``, so the garbage collector deletes it with the pod), annotated
        ``resource.kubernetes.io/pod-claim-name``, and recorded in the pod's
        ``status.resourceClaimStatuses``."""
        ns, meta = pod["metadata"].get("namespace", ""), pod["metadata"]
        statuses = []
        for ref in pod["spec"].get("resourceClaims") or []:
            template_name = ref.get("resourceClaimTemplateName")
            if not template_name:
                continue
            template = templates.get((ns, template_name))
            if template is None:
                continue  # the controller retries; the pod waits (not modelled further)
            name = f"{meta['name']}-{ref['name']}-{uuid.uuid4().hex[:5]}"
            body = {
                "apiVersion": API_VERSION,
                "kind": "ResourceClaim",
                "metadata": {
                    "name": name,
                    "annotations": {"resource.kubernetes.io/pod-claim-name": ref["name"]},
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": meta["name"],
                            "uid": meta["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": copy.deepcopy(template["spec"]["spec"]),
            }
            code, reply = create(body)
            assert code == 201, reply
            statuses.append({"name": ref["name"], "resourceClaimName": name})
        if statuses:
            pod.setdefault("status", {})["resourceClaimStatuses"] = statuses
            self.made[ns, meta["name"]] = {s["name"]: s["resourceClaimName"] for s in statuses}

    def missing(self, pod: Mapping[str, Any], claims: Mapping[tuple[str, str], Any]) -> str:
        """PreFilter: the message for a claim the pod names that does not exist, or ``""``."""
        ns = pod["metadata"].get("namespace", "")
        for name in self.claim_names(pod):
            if (ns, name) not in claims:
                return f'resourceclaim "{name}" not found'
        return ""

    def _taken(self, claims: Mapping[tuple[str, str], Any]) -> set[tuple[str, str, str]]:
        return {
            (r["driver"], r["pool"], r["device"])
            for c in claims.values()
            for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
                "results"
            )
            or []
        }

    def pick(
        self, pod: Mapping[str, Any], node: str, claims: Mapping[tuple[str, str], Any]
    ) -> dict[str, list[dict[str, str]]] | None:
        """The results per claim name the allocator finds on ``node`` (``{}`` when the pod
        names no claim or all are allocated there), or None: ``cannot allocate all claims``."""
        ns = pod["metadata"].get("namespace", "")
        taken = self._taken(claims)
        out: dict[str, list[dict[str, str]]] = {}
        for name in self.claim_names(pod):
            claim = claims[ns, name]
            allocation = (claim.get("status") or {}).get("allocation")
            if allocation:
                terms = (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []
                fields = [f for t in terms for f in t.get("matchFields") or []]
                if any(node not in f.get("values", []) for f in fields):
                    return None  # allocated on another node
                continue
            results: list[dict[str, str]] = []
            for request in claim["spec"]["devices"]["requests"]:
                exactly = request.get("exactly") or {}
                wanted = int(exactly.get("count", 1))
                found = [
                    d
                    for d in self._devices(node, exactly)
                    if d not in taken
                    and d not in {(r["driver"], r["pool"], r["device"]) for r in results}
                ]
                if len(found) < wanted:
                    return None
                for driver, pool, device in found[:wanted]:
                    results.append(
                        {
                            "request": request["name"],
                            "driver": driver,
                            "pool": pool,
                            "device": device,
                        }
                    )
            out[name] = results
        return out

    def _devices(self, node: str, exactly: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        class_cel = DEVICE_CLASSES.get(exactly.get("deviceClassName", ""))
        if class_cel is None:
            return []
        selectors = [s["cel"]["expression"] for s in exactly.get("selectors") or [] if "cel" in s]
        out = []
        for item in current(self.slices):
            spec = item["spec"]
            if spec.get("nodeName") != node:
                continue
            for device in spec.get("devices") or []:
                attrs = device.get("attributes") or {}
                if all(cel_holds(e, spec["driver"], attrs) for e in [class_cel, *selectors]):
                    out.append((spec["driver"], spec["pool"]["name"], device["name"]))
        return out

    def bind(
        self,
        pod: Mapping[str, Any],
        node: str,
        claims: Mapping[tuple[str, str], Any],
        touch: Callable[[dict[str, Any]], None],
    ) -> None:
        """PreBind: write each claim's allocation (as :meth:`pick` found it) and reservation."""
        picked = self.pick(pod, node, claims) or {}
        ns, meta = pod["metadata"].get("namespace", ""), pod["metadata"]
        for name in self.claim_names(pod):
            claim = claims[ns, name]
            status = claim.setdefault("status", {})
            if name in picked:
                status["allocation"] = {
                    "devices": {"results": picked[name]},
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": [node]}
                                ]
                            }
                        ]
                    },
                }
            reserved = status.setdefault("reservedFor", [])
            reserved.append({"resource": "pods", "name": meta["name"], "uid": meta["uid"]})
            touch(claim)


def current(slices: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The slices the structured allocator allocates from: per pool (driver, pool name), those
    of its newest ``spec.pool.generation`` (``GatherPools``/``addSlice`` in
    ``staging/src/k8s.io/dynamic-resource-allocation/structured/internal/stable/
    pools_stable.go``, 1.34: an older one is "out-dated" and ignored)."""
    newest: dict[tuple[str, str], int] = {}
    for item in slices:
        spec = item["spec"]
        pool = (spec["driver"], spec["pool"]["name"])
        newest[pool] = max(newest.get(pool, 0), int(spec["pool"].get("generation", 0)))
    return [
        i
        for i in slices
        if int(i["spec"]["pool"].get("generation", 0))
        == newest[i["spec"]["driver"], i["spec"]["pool"]["name"]]
    ]


def dra_only(node: Mapping[str, Any]) -> dict[str, Any]:
    """``node`` (API JSON) as it is where NVIDIA's DRA driver gives the GPUs and its device
    plugin does not run: no ``nvidia.com/*`` capacity or allocatable (extended resources are
    only what a device plugin registers with the kubelet; the DRA driver's kubelet plugin
    publishes ResourceSlices instead, NVIDIA/k8s-dra-driver-gpu's chart installs no device
    plugin), its GFD labels kept."""
    out = copy.deepcopy(dict(node))
    status = out.setdefault("status", {})
    for field in ("capacity", "allocatable"):
        status[field] = {
            k: v for k, v in (status.get(field) or {}).items() if not k.startswith("nvidia.com/")
        }
    return out


def uuids_of(node: str, count: int = 8) -> list[str]:
    """Made-up GPU UUIDs of ``node``, by device name (``gpu-<minor>``)."""
    tag = sum(node.encode()) % 0xFFFF
    return [f"GPU-{tag:04x}{i:04x}-1111-2222-3333-444455556666" for i in range(count)]


def reversed_slice(node: str, product: str = "NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    """:func:`gpu_slice` of eight GPUs (:func:`uuids_of`) whose PCI bus order is the reverse of
    their device names: the node's first GPU (NVML index 0, the ledger's ``gpu0``) is ``gpu-7``,
    so an allocator that is not pinned (it takes the first free device, ``gpu-0``) would give
    another GPU than the ledger's."""
    body = gpu_slice(node, [(u, product) for u in uuids_of(node)])
    for i, device in enumerate(body["spec"]["devices"]):
        device["attributes"]["pcieBusID"]["string"] = f"0000:{8 - i:x}0:00.0"
    return body
