"""A stand-in Kubernetes API server for the job backend's tests, and a Job controller the test
drives step by step.

What it answers like the real API server (over HTTP, on its own thread, for
``kubernetes_asyncio``): ConfigMaps, Services and Pods (``/api/v1``), Jobs (``/apis/batch/v1``) and
NetworkPolicies (``/apis/networking.k8s.io/v1``) per namespace: create (``201``; ``uid``,
``resourceVersion``, ``creationTimestamp`` and the defaults the API server adds; the body validated
strictly against the 1.33 schemas, ``422 Invalid`` if it fails; ``409 AlreadyExists``; ``400
BadRequest`` for a namespace that is not the URL's), get (``404 NotFound``), list and
delete-collection with label selectors (``k=v``, ``k!=v``, ``k``), patch (strategic-merge and merge
patches of maps, JSON patch), delete with ``propagationPolicy`` (Jobs default to ``Orphan`` as on a
real cluster; ``Background`` lets the garbage collector delete the dependents named by
``ownerReferences``), and pod logs (``404`` for a missing pod, ``400`` while the container waits to
start, else the bytes, ``limitBytes`` honoured). Errors are ``Status`` objects with ``reason``,
``code``, ``message`` and ``details``. A NetworkPolicy gets the API server's defaults
(``policyTypes`` from its rules, ``protocol: TCP`` on ports;
``pkg/apis/networking/v1/defaults.go``) and its deletion answers a ``Status``, not the object (its
REST storage does not set ``ReturnDeletedObject``;
``pkg/registry/networking/networkpolicy/storage/storage.go``). RBAC: :meth:`StandIn.forbid` takes a
verb on a resource away from the hub's service account, which then gets ``403 Forbidden`` with the
authorizer's message (``forbiddenMessage``, wrapped by ``NewForbidden``, in
``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go``).

Nodes, the scheduler and volume attachment, when the test registers nodes (:meth:`StandIn.add_node`,
node objects as the API returns them; without any, pods are put on ``dgx-h100-<index + 1>`` as
before): :meth:`StandIn.schedule` does what kube-scheduler's filters do for what gpupool relies
on, in their order: taints (``NoSchedule``/``NoExecute`` need a toleration), ``nodeSelector`` and
required node affinity (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``, ``Gt``, ``Lt``;
``matchFields`` on ``metadata.name``), free allocatable (requests, or limits where a request is
missing, of the pods bound there and not ended; extended resources always, ``cpu``/``memory``/
``pods`` where the node lists them), and ``topologySpreadConstraints`` with ``DoNotSchedule``
(domains: the nodes that pass the pod's node affinity, as ``nodeAffinityPolicy: Honor``). A pod
no node takes stays Pending with ``PodScheduled=False``, reason ``Unschedulable`` and the
scheduler's message (``0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) didn't
match Pod's node affinity/selector.``; reasons counted per node, sorted as strings; the
preemption postscript is left out), and a ``FailedScheduling`` event. Of the nodes that pass, it
takes the one with the most room left for the pod's requests (kube-scheduler's default
``LeastAllocated`` scoring, simplified; ties by name). Volumes: claims registered with
:meth:`StandIn.add_claim` have access modes (unregistered ones are ``ReadWriteOnce``, z2jh's
default); a ``ReadWriteOnce`` claim is attached to one node at a time, so a pod bound to a second
node while a pod not ended on another uses it stays Pending in ``ContainerCreating`` with a
``FailedAttachVolume`` event ``Multi-Attach error for volume "pvc-…" Volume is already used by
pod(s) …``. Events are kept in :attr:`StandIn.events` (not served).

Node lifecycle, driven by the test as the control plane does it in 1.33: admission adds to every pod
created (by the hub or the Job controller) the ``DefaultTolerationSeconds`` tolerations
(``node.kubernetes.io/not-ready`` and ``unreachable``, ``NoExecute``, ``tolerationSeconds: 300``,
each unless the pod tolerates that taint already;
``plugin/pkg/admission/defaulttolerationseconds/admission.go``). :meth:`StandIn.lose_node` is the
node lifecycle controller once a kubelet stops posting status (``Unknown``) or posts ``NotReady``
(``False``): the ``Ready`` condition (``NodeStatusUnknown``, "Kubelet stopped posting node
status."), the ``unreachable``/``not-ready`` taints ``NoSchedule`` and ``NoExecute`` (with
``timeAdded``; ``pkg/controller/nodelifecycle/node_lifecycle_controller.go``), and the ``Ready``
condition of its pods ``False`` (``MarkPodsNotReady``, ``pkg/controller/util/node/
controller_utils.go``). :meth:`StandIn.evict` is the taint eviction controller some seconds after: a
pod that does not tolerate a ``NoExecute`` taint, or whose matching tolerations' least
``tolerationSeconds`` have passed, gets the ``DisruptionTarget`` condition
(``DeletionByTaintManager``) and is deleted (``pkg/controller/tainteviction/taint_eviction.go``).
Deleting a pod bound to a lost node, by anyone (taint eviction, the garbage collector, a client), is
graceful: the API server sets ``deletionTimestamp`` and ``deletionGracePeriodSeconds`` and keeps the
pod until its kubelet confirms (``CheckGracefulDelete`` in ``pkg/registry/core/pod/strategy.go``),
which a lost node's kubelet never does: the pod stays Terminating, phase ``Running``, until
:meth:`StandIn.recover_node` (the kubelet is back, kills it and confirms) or a delete with
``gracePeriodSeconds: 0`` (force). A pod on a healthy node is gone at once (its kubelet confirms at
once here).

The Job controller is not automatic: the test moves a Job along with :class:`StandIn` methods
that do what the controller and kubelet do in Kubernetes 1.33: create one pod per completion
index from the template (``<job>-<index>-<suffix>``, the controller's labels, the index
annotation, ``hostname``, ``JOB_COMPLETION_INDEX``, an owner reference and the tracking
finalizer), schedule and run them, let their container exit, and set the Job's counters and its
conditions (``Suspended``; ``SuccessCriteriaMet`` then ``Complete``; ``FailureTarget`` then
``Failed``, deleting the pods still active).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import json
import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import kubernetes_validate
from aiohttp import web

from tests.deploy import kube_dra
from tests.deploy.kube_devices import DevicePlugin
from tests.deploy.kube_hami import Schedulers

VALIDATE_VERSION = "1.33"
RESOURCES: dict[str, tuple[str, str, str]] = {
    "configmaps": ("", "v1", "ConfigMap"),
    "services": ("", "v1", "Service"),
    "pods": ("", "v1", "Pod"),
    "jobs": ("batch", "batch/v1", "Job"),
    "networkpolicies": ("networking.k8s.io", "networking.k8s.io/v1", "NetworkPolicy"),
    # stored like any object: the API server never expires a Lease (its registry,
    # pkg/registry/coordination/lease, has no TTL; only kube-apiserver's own identity Leases
    # are deleted once stale, by pkg/controlplane/controller/apiserverleasegc): whether one is
    # held is its readers' judgement from spec.renewTime (gpupool.kube.claim)
    "leases": ("coordination.k8s.io", "coordination.k8s.io/v1", "Lease"),
    **kube_dra.RESOURCES,
}
RETURNS_OBJECT_ON_DELETE = ("pods", "services")
PLURALS = {kind: plural for plural, (_, _, kind) in RESOURCES.items()} | {"Node": "nodes"}
POD_CONDITIONS = (
    "PodReadyToStartContainers",
    "Initialized",
    "Ready",
    "ContainersReady",
    "PodScheduled",
)
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
HOSTNAME_KEY = "kubernetes.io/hostname"
TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"
DEFAULT_TOLERATION_SECONDS = 300
"""``--default-not-ready-toleration-seconds`` and ``--default-unreachable-toleration-seconds``."""
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
TAINT_EVICTION_MESSAGE = "Taint manager: deleting due to NoExecute taint"
HUB_USER = "system:serviceaccount:jhub:hub"
"""Who the hub is to the API server (the JupyterHub chart's hub ServiceAccount)."""
ALL = "*"
"""The namespace argument for every namespace (``GET /api/v1/pods``, cluster-wide)."""

Reply = tuple[int, Any]
T = TypeVar("T")


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    """Run under the stand-in's lock (the test drives it while its HTTP thread answers)."""

    @functools.wraps(method)
    def locked(self: StandIn, *args: Any, **kwargs: Any) -> T:
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class StandIn:
    """The API server's storage and answers (plain, synchronous; see :class:`Served`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {p: {} for p in RESOURCES}
        self.logs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.deletions: list[tuple[str, str, str]] = []
        self._rv = itertools.count(1000)
        self._tick = itertools.count(1)
        self.nodes: dict[str, dict[str, Any]] = {}
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.history: list[tuple[int, str, str, str, dict[str, Any], dict[str, Any] | None]] = []
        """Watch events: resourceVersion, type, plural, namespace, the object, and the object as
        the event before it left it (``None`` for a new one)."""
        self._last: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.compacted = 0
        self.bookmarks = True
        """Whether a watch asked for ``allowWatchBookmarks`` ends with one. The API server's
        bookmarks are best effort: a client may not assume one is sent even when it asked
        (Kubernetes docs, "API Concepts", Watch bookmarks); ``False`` makes it send none."""
        self.forbidden: set[tuple[str, str]] = set()
        self.lost: set[str] = set()
        """Nodes whose kubelet is gone (:meth:`lose_node`): it confirms no deletion."""
        self.dra = kube_dra.DRA(self)
        """ResourceSlices and the scheduler's DRA plugin (:mod:`tests.deploy.kube_dra`)."""
        self.workloads: dict[tuple[str, str], list[dict[str, Any]]] = {}
        """Kueue's Workload of a Job (by the Job's namespace and name): its conditions, as
        :meth:`kueue_admit` and :meth:`kueue_preempt` leave them (not served)."""
        self.schedulers = Schedulers()
        """Which schedulers run, and HAMi (:mod:`tests.deploy.kube_hami`)."""
        self.device_plugin: DevicePlugin | None = None
        """NVIDIA's device plugin on the nodes, when a test sets one (:mod:`tests.deploy.
        kube_devices`): it chooses each started pod's devices."""

    # -- bookkeeping --------------------------------------------------------------------------
    def now(self) -> str:
        moment = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(seconds=next(self._tick))
        return moment.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _touch(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        plural = PLURALS.get(str(obj.get("kind")), "")
        if plural and self._stored(plural, obj) is obj:
            self._record("MODIFIED", plural, obj)

    def _stored(self, plural: str, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        meta = obj["metadata"]
        if plural == "nodes":
            return self.nodes.get(meta["name"])
        return self.objects[plural].get((meta.get("namespace", ""), meta["name"]))

    def _record(self, kind: str, plural: str, obj: Mapping[str, Any]) -> None:
        """One watch event (the object as it is now, at its resourceVersion, and as it was)."""
        meta = obj["metadata"]
        rv, ns = int(meta["resourceVersion"]), meta.get("namespace", "")
        key = (plural, ns, meta["name"])
        now = copy.deepcopy(dict(obj))
        before = self._last.pop(key, None) if kind == "DELETED" else self._last.get(key)
        if kind != "DELETED":
            self._last[key] = now
        self.history.append((rv, kind, plural, ns, now, before))

    def _deleted(self, plural: str, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self._record("DELETED", plural, obj)

    # -- watches ------------------------------------------------------------------------------
    @_locked
    def compact(self) -> None:
        """Forget the watch history so far (etcd compaction): a watch from any resourceVersion
        handed out before this gets ``410`` and must list again."""
        self.compacted = next(self._rv)
        self.history.clear()

    @_locked
    def watch_from(
        self, plural: str, namespace: str, selector: str, resource_version: str
    ) -> tuple[list[tuple[str, dict[str, Any]]], int] | None:
        """The events a watch from ``resource_version`` starts with and the version it is at;
        ``None`` when that version is compacted (the server answers ``410 Expired``). Without a
        version (or ``"0"``): the current objects as ``ADDED``, as the API server does."""
        if resource_version in ("", "0"):
            _, listed = self.list_objects(plural, namespace, selector)
            at = int(listed["metadata"]["resourceVersion"])
            return [("ADDED", copy.deepcopy(o)) for o in listed["items"]], at
        at = int(resource_version)
        if at < self.compacted:
            return None
        return self.events_after(plural, namespace, selector, at), at

    @_locked
    def events_after(
        self, plural: str, namespace: str, selector: str, at: int
    ) -> list[tuple[str, dict[str, Any]]]:
        """The events after ``at`` a watch with ``selector`` sees, as the watch cache filters
        them (``convertToWatchEvent`` in ``staging/src/k8s.io/apiserver/pkg/storage/cacher/
        cache_watcher.go``): an object that comes to match is ``ADDED``, one that stops
        matching is ``DELETED`` (its last matching content, at the event's version)."""
        out = []
        for rv, kind, p, ns, obj, before in self.history:
            if (
                rv <= at
                or p != plural
                or (plural != "nodes" and namespace != ALL and ns != namespace)
            ):
                continue
            now = kind != "DELETED" and matches(selector, obj["metadata"].get("labels") or {})
            was = before is not None and matches(selector, before["metadata"].get("labels") or {})
            if now and not was:
                out.append(("ADDED", copy.deepcopy(obj)))
            elif now:
                out.append(("MODIFIED", copy.deepcopy(obj)))
            elif was:
                gone = copy.deepcopy(before if kind != "DELETED" else obj)
                gone["metadata"]["resourceVersion"] = str(rv)
                out.append(("DELETED", gone))
        return out

    @_locked
    def bookmark(self, plural: str) -> dict[str, Any]:
        """A ``BOOKMARK`` event's object: the kind and only ``metadata.resourceVersion``, the
        store's version now (every event up to it has been sent)."""
        api_version, kind = ("v1", "Node") if plural == "nodes" else RESOURCES[plural][1:]
        version = str(next(self._rv))
        return {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": version}}

    def expired(self, resource_version: str) -> dict[str, Any]:
        """The ``ERROR`` event's object for a watch from a compacted version."""
        message = f"too old resource version: {resource_version} ({self.compacted})"
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": "Expired",
            "code": 410,
        }

    @staticmethod
    def _resource(plural: str) -> str:
        group = RESOURCES[plural][0]
        return f"{plural}.{group}" if group else plural

    def _status(
        self, code: int, reason: str, message: str, plural: str = "", name: str = ""
    ) -> Reply:
        details = {"name": name, "kind": plural} if plural else {}
        if plural and RESOURCES[plural][0]:
            details["group"] = RESOURCES[plural][0]
        return code, {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "details": details,
            "code": code,
        }

    def _not_found(self, plural: str, name: str) -> Reply:
        message = f'{self._resource(plural)} "{name}" not found'
        return self._status(404, "NotFound", message, plural, name)

    # -- RBAC ---------------------------------------------------------------------------------
    @_locked
    def forbid(self, verb: str, plural: str) -> None:
        """The hub's Role no longer grants ``verb`` (``create``, ``get``, ``list``, ``patch``,
        ``delete``, ``deletecollection``) on ``plural``."""
        self.forbidden.add((verb, plural))

    def authorize(self, verb: str, plural: str, namespace: str, name: str = "") -> Reply | None:
        """``None`` if the hub may, else the API server's ``403``: ``NewForbidden`` of the
        authorizer's ``forbiddenMessage`` (the object's name only where the request names one:
        a create does not)."""
        if (verb, plural) not in self.forbidden:
            return None
        group = RESOURCES[plural][0]
        why = (
            f'User "{HUB_USER}" cannot {verb} resource "{plural}" in API group "{group}" in the '
            f'namespace "{namespace}"'
        )
        subject = f'{self._resource(plural)} "{name}"' if name else self._resource(plural)
        return self._status(403, "Forbidden", f"{subject} is forbidden: {why}", plural, name)

    # -- the REST verbs -----------------------------------------------------------------------
    def create(self, plural: str, namespace: str, body: dict[str, Any]) -> Reply:
        _group, api_version, kind = RESOURCES[plural]
        meta = body.get("metadata") or {}
        name = str(meta.get("name") or "")
        if body.get("kind") != kind or body.get("apiVersion") != api_version:
            return self._status(400, "BadRequest", f"expected {api_version} {kind}")
        if meta.get("namespace", namespace) != namespace:
            message = (
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
            return self._status(400, "BadRequest", message)
        try:
            version = kube_dra.VALIDATE_VERSIONS.get(plural, VALIDATE_VERSION)
            kubernetes_validate.validate(body, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            message = f'{kind} "{name}" is invalid: {e.message}'
            return self._status(422, "Invalid", message, plural, name)
        if (namespace, name) in self.objects[plural]:
            message = f'{self._resource(plural)} "{name}" already exists'
            return self._status(409, "AlreadyExists", message, plural, name)
        obj = copy.deepcopy(body)
        obj["metadata"] |= {
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "creationTimestamp": self.now(),
            "generation": 1,
        }
        self._touch(obj)
        getattr(self, f"_defaults_{plural}", lambda o: None)(obj)
        self.objects[plural][namespace, name] = obj
        self._record("ADDED", plural, obj)
        return 201, obj

    def _defaults_pods(self, obj: dict[str, Any]) -> None:
        """The API server gives a pod it creates ``status.phase: Pending`` (KubeSpawner's
        reflector reads it) before any scheduler has looked at it, and admission its default
        tolerations (:func:`default_tolerations`)."""
        obj.setdefault("status", {"phase": "Pending", "qosClass": "Burstable"})
        default_tolerations(obj["spec"])
        self.schedulers.admit(obj)  # the default scheduler name, then HAMi's webhook

    def _defaults_services(self, obj: dict[str, Any]) -> None:
        spec = obj["spec"]
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        spec["clusterIPs"] = [spec.setdefault("clusterIP", "10.96.0.17")]
        spec |= {"ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack"}
        spec.setdefault("internalTrafficPolicy", "Cluster")
        for port in spec.get("ports", []):
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port["port"])
        obj["status"] = {"loadBalancer": {}}

    def _defaults_networkpolicies(self, obj: dict[str, Any]) -> None:
        """``SetDefaults_NetworkPolicy`` and ``SetDefaults_NetworkPolicyPort``."""
        spec = obj.setdefault("spec", {})
        if not spec.get("policyTypes"):
            spec["policyTypes"] = ["Ingress", *(["Egress"] if spec.get("egress") else [])]
        for direction in ("ingress", "egress"):
            for rule in spec.get(direction) or []:
                for port in rule.get("ports") or []:
                    port.setdefault("protocol", "TCP")

    def _defaults_jobs(self, obj: dict[str, Any]) -> None:
        spec, uid, name = obj["spec"], obj["metadata"]["uid"], obj["metadata"]["name"]
        controller = {
            "batch.kubernetes.io/controller-uid": uid,
            "batch.kubernetes.io/job-name": name,
            "controller-uid": uid,
            "job-name": name,
        }
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        template_meta = spec["template"].setdefault("metadata", {})
        template_meta["labels"] = {**template_meta.get("labels", {}), **controller}
        spec.setdefault("suspend", False)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completions", 1)
        spec.setdefault("parallelism", 1)
        failed = "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed"
        spec.setdefault("podReplacementPolicy", failed)
        obj["status"] = {}
        if spec["suspend"]:
            self._set_condition(obj, "Suspended", "JobSuspended", "Job suspended")
        else:
            obj["status"] = self._running_status()

    def _running_status(self) -> dict[str, Any]:
        return {
            "startTime": self.now(),
            "active": 0,
            "ready": 0,
            "terminating": 0,
            "uncountedTerminatedPods": {},
        }

    def get(self, plural: str, namespace: str, name: str) -> Reply:
        obj = self.objects[plural].get((namespace, name))
        return (200, obj) if obj is not None else self._not_found(plural, name)

    def list_objects(self, plural: str, namespace: str, selector: str = "") -> Reply:
        if plural == "nodes":
            api_version, kind = "v1", "Node"
            stored: Any = {("", n): o for n, o in sorted(self.nodes.items())}
        else:
            _group, api_version, kind = RESOURCES[plural]
            stored = self.objects[plural]
        items = [
            o
            for (ns, _), o in stored.items()
            if (plural == "nodes" or namespace == ALL or ns == namespace)
            and matches(selector, o["metadata"].get("labels") or {})
        ]
        body = {
            "kind": f"{kind}List",
            "apiVersion": api_version,
            "metadata": {"resourceVersion": str(next(self._rv))},
            "items": items,
        }
        return 200, body

    def patch(self, plural: str, namespace: str, name: str, content_type: str, patch: Any) -> Reply:
        obj = self.objects[plural].get((namespace, name))
        if obj is None:
            return self._not_found(plural, name)
        if content_type.startswith("application/json-patch+json"):
            updated = json_patch(obj, patch)
        elif content_type.startswith(
            ("application/merge-patch+json", "application/strategic-merge-patch+json")
        ):
            updated = merge_patch(obj, patch)
        else:
            return self._status(415, "UnsupportedMediaType", f"{content_type} is not supported")
        was_suspended = bool((obj.get("spec") or {}).get("suspend"))
        obj.clear()
        obj.update(updated)
        self._touch(obj)
        if plural == "jobs" and was_suspended and not obj["spec"].get("suspend"):
            self._set_condition(obj, "Suspended", "JobResumed", "Job resumed", "False")
            obj["status"] |= self._running_status()
        return 200, obj

    def delete(
        self,
        plural: str,
        namespace: str,
        name: str,
        propagation: str = "",
        grace_seconds: int | None = None,
    ) -> Reply:
        """Delete an object (see the module docstring for pods on a lost node, which stay
        Terminating; ``grace_seconds``: the request's ``gracePeriodSeconds``)."""
        found = self.objects[plural].get((namespace, name))
        if found is None:
            return self._not_found(plural, name)
        if plural == "pods" and self._terminating(found, grace_seconds):
            return 200, found
        obj = self.objects[plural].pop((namespace, name))
        self._deleted(plural, obj)
        policy = propagation or ("Orphan" if plural == "jobs" else "Background")
        self.deletions.append((plural, name, policy))
        uid = obj["metadata"]["uid"]
        if policy == "Orphan":
            for dependent in self._dependents(uid):
                refs = dependent["metadata"]["ownerReferences"]
                dependent["metadata"]["ownerReferences"] = [r for r in refs if r["uid"] != uid]
        else:
            self.collect_garbage()
        if plural in RETURNS_OBJECT_ON_DELETE:
            return 200, obj
        details = {"name": name, "kind": plural, "uid": uid}
        if RESOURCES[plural][0]:
            details["group"] = RESOURCES[plural][0]
        return 200, {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": details,
        }

    def _terminating(self, pod: dict[str, Any], grace_seconds: int | None) -> bool:
        """A graceful delete of a pod whose kubelet never confirms (bound to a lost node, not
        ended, a grace period above 0): ``deletionTimestamp`` set (a later delete may only
        shorten the grace), the pod kept. False: delete it now."""
        spec, meta = pod["spec"], pod["metadata"]
        grace = (
            spec.get("terminationGracePeriodSeconds", 30)
            if grace_seconds is None
            else grace_seconds
        )
        ended = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if spec.get("nodeName") not in self.lost or ended or grace <= 0:
            return False
        if meta.get("deletionTimestamp") and grace >= meta.get("deletionGracePeriodSeconds", 0):
            return True
        start = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(seconds=next(self._tick) + grace)
        meta["deletionTimestamp"] = start.strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["deletionGracePeriodSeconds"] = grace
        self._touch(pod)
        return True

    def delete_collection(
        self, plural: str, namespace: str, selector: str, grace_seconds: int | None = None
    ) -> Reply:
        _, listed = self.list_objects(plural, namespace, selector)
        for obj in listed["items"]:
            self.delete(plural, namespace, obj["metadata"]["name"], grace_seconds=grace_seconds)
        return 200, listed

    def _dependents(self, uid: str) -> list[dict[str, Any]]:
        return [
            obj
            for store in self.objects.values()
            for obj in store.values()
            if any(r["uid"] == uid for r in obj["metadata"].get("ownerReferences") or [])
        ]

    def collect_garbage(self) -> None:
        """Delete every object whose owners are all gone, until none is left (the garbage
        collector; recorded with the policy ``"gc"``)."""
        while True:
            alive = {o["metadata"]["uid"] for s in self.objects.values() for o in s.values()}
            orphans = [
                (plural, key)
                for plural, store in self.objects.items()
                for key, obj in store.items()
                if (refs := obj["metadata"].get("ownerReferences"))
                and not any(r["uid"] in alive for r in refs)
                and not obj["metadata"].get("deletionTimestamp")  # asked already
            ]
            if not orphans:
                return
            for plural, key in orphans:
                obj = self.objects[plural][key]
                if plural == "pods" and self._terminating(obj, None):
                    continue  # on a lost node: Terminating
                self._deleted(plural, self.objects[plural].pop(key))
                self.deletions.append((plural, key[1], "gc"))

    def log(self, namespace: str, name: str, container: str, limit_bytes: int | None) -> Reply:
        pod = self.objects["pods"].get((namespace, name))
        if pod is None:
            return self._not_found("pods", name)
        names = [c["name"] for c in pod["spec"]["containers"]]
        if container not in names:
            message = f"container {container} is not valid for pod {name}"
            return self._status(400, "BadRequest", message)
        statuses = {s["name"]: s for s in pod["status"].get("containerStatuses") or []}
        state = statuses.get(container, {}).get("state") or {"waiting": {}}
        if "waiting" in state:
            why = state["waiting"].get("reason") or "ContainerCreating"
            message = f'container "{container}" in pod "{name}" is waiting to start: {why}'
            return self._status(400, "BadRequest", message)
        data = self.logs.get(name, b"")
        return 200, data[:limit_bytes] if limit_bytes else data

    # -- the Job controller and the kubelet, driven by the test -------------------------------
    def job(self, name: str, namespace: str) -> dict[str, Any]:
        return self.objects["jobs"][namespace, name]

    def pods_of(self, name: str, namespace: str) -> dict[int, dict[str, Any]]:
        """The newest pod of each index of Job ``name``."""
        uid = self.job(name, namespace)["metadata"]["uid"]
        out: dict[int, dict[str, Any]] = {}
        for pod in self.objects["pods"].values():
            labels = pod["metadata"]["labels"]
            if labels.get("batch.kubernetes.io/controller-uid") == uid:
                out[int(labels[INDEX_KEY])] = pod  # creation order: later wins
        return dict(sorted(out.items()))

    @_locked
    def create_pods(self, name: str, namespace: str, *, unschedulable: str = "") -> list[str]:
        """One Pending pod per index that has no active pod (the Job controller)."""
        job = self.job(name, namespace)
        spec = job["spec"]
        assert not spec.get("suspend"), "the Job controller creates no pods for a suspended Job"
        existing = self.pods_of(name, namespace)
        created = []
        for index in range(spec["completions"]):
            if index in existing and existing[index]["status"]["phase"] != "Failed":
                continue
            pod = self._pod_from_template(job, index)
            create = functools.partial(self.create, "resourceclaims", namespace)
            self.dra.claims_from_templates(pod, self.objects["resourceclaimtemplates"], create)
            if unschedulable:
                pod["status"]["conditions"] = [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": unschedulable,
                        "lastProbeTime": None,
                        "lastTransitionTime": self.now(),
                    }
                ]
            self.objects["pods"][namespace, pod["metadata"]["name"]] = pod
            self._record("ADDED", "pods", pod)
            created.append(pod["metadata"]["name"])
        job["status"]["active"] = job["status"].get("active", 0) + len(created)
        self._touch(job)
        return created

    def _pod_from_template(self, job: dict[str, Any], index: int) -> dict[str, Any]:
        meta, template = job["metadata"], copy.deepcopy(job["spec"]["template"])
        base = f"{meta['name']}-{index}-"
        spec = template["spec"]
        spec["hostname"] = f"{meta['name']}-{index}"
        for container in spec["containers"]:
            index_env = {
                "name": "JOB_COMPLETION_INDEX",
                "valueFrom": {
                    "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{INDEX_KEY}']"}
                },
            }
            container["env"] = [*container.get("env", []), index_env]
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        default_tolerations(spec)  # the controller's pods pass admission too
        pod_meta = {
            "name": base + uuid.uuid4().hex[:5],
            "generateName": base,
            "namespace": meta["namespace"],
            "uid": str(uuid.uuid4()),
            "creationTimestamp": self.now(),
            "labels": {**template["metadata"].get("labels", {}), INDEX_KEY: str(index)},
            "annotations": {**template["metadata"].get("annotations", {}), INDEX_KEY: str(index)},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "finalizers": [TRACKING_FINALIZER],
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": pod_meta,
            "spec": spec,
            "status": {"phase": "Pending", "qosClass": "Burstable"},
        }
        self.schedulers.admit(pod)  # HAMi's webhook sees the controller's pods too
        self._touch(pod)
        return pod

    @_locked
    def run_pods(self, name: str, namespace: str, indexes: list[int] | None = None) -> None:
        """Schedule and start the pods (all, or those of ``indexes``): phase Running."""
        job = self.job(name, namespace)
        for index, pod in self.pods_of(name, namespace).items():
            if (indexes is not None and index not in indexes) or pod["status"][
                "phase"
            ] != "Pending":
                continue
            if self.nodes:
                if self.schedule(namespace, pod["metadata"]["name"]) == "Running":
                    job["status"]["ready"] = job["status"].get("ready", 0) + 1
                continue
            pod["spec"]["nodeName"] = f"dgx-h100-{index + 1}"
            self._start(pod, f"10.244.{index + 1}.7", f"192.168.0.{index + 1}")
            job["status"]["ready"] = job["status"].get("ready", 0) + 1
        self._touch(job)

    def _start(self, pod: dict[str, Any], pod_ip: str, host_ip: str) -> None:
        """The kubelet starts a bound pod's containers: phase Running."""
        node = self.nodes.get(pod["spec"].get("nodeName") or "")
        if self.device_plugin is not None and node is not None:  # the device manager allocates
            self.device_plugin.allocate(pod, node, self._bound_pods(exclude=pod))
        started = self.now()
        pod["status"] = {
            "phase": "Running",
            "qosClass": "Burstable",
            "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}],
            "hostIP": host_ip,
            "startTime": started,
            "conditions": [
                {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": started}
                for t in POD_CONDITIONS
            ],
            "containerStatuses": [
                self._container_status(c, {"running": {"startedAt": started}}, True)
                for c in pod["spec"]["containers"]
            ],
        }
        self._touch(pod)

    # -- nodes, the scheduler and volume attachment --------------------------------------------
    @_locked
    def add_node(self, node: Mapping[str, Any]) -> None:
        """A node (API JSON, as ``GET nodes/<name>`` returns it); the scheduler now runs."""
        obj = copy.deepcopy(dict(node))
        obj |= {"kind": "Node", "apiVersion": "v1"}
        name = obj["metadata"]["name"]
        labels = obj["metadata"].setdefault("labels", {})
        labels.setdefault(HOSTNAME_KEY, name)
        known = name in self.nodes
        self.nodes[name] = obj
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self._record("MODIFIED" if known else "ADDED", "nodes", obj)

    @_locked
    def update_node(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """``change(node)`` in place (a kubectl edit, label or cordon): one ``MODIFIED``."""
        change(self.nodes[name])
        self._touch(self.nodes[name])

    def cordon(self, name: str, unschedulable: bool = True) -> None:
        """``kubectl cordon`` (or ``uncordon``): ``spec.unschedulable`` and the node controller's
        ``node.kubernetes.io/unschedulable:NoSchedule`` taint."""
        taint = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}

        def change(node: dict[str, Any]) -> None:
            spec = node.setdefault("spec", {})
            taints = [t for t in spec.get("taints") or [] if t.get("key") != taint["key"]]
            spec["taints"] = [*taints, taint] if unschedulable else taints
            if unschedulable:
                spec["unschedulable"] = True
            else:
                spec.pop("unschedulable", None)

        self.update_node(name, change)

    @_locked
    def remove_node(self, name: str, delete_pods: bool = True) -> None:
        """The node object is deleted; with ``delete_pods`` the pod garbage collector then
        deletes the pods bound to it (as it does for pods on nodes that no longer exist)."""
        self._deleted("nodes", self.nodes.pop(name))
        self.lost.discard(name)
        if delete_pods:  # force-deleted (``gcOrphaned`` in pkg/controller/podgc/gc_controller.go)
            for (ns, pod_name), pod in list(self.objects["pods"].items()):
                if pod["spec"].get("nodeName") == name:
                    self.delete("pods", ns, pod_name, grace_seconds=0)

    @_locked
    def lose_node(self, name: str, ready: str = "Unknown", message: str = "") -> None:
        """The node's kubelet stops posting status (``ready="Unknown"``) or posts NotReady
        (``"False"``), and the node lifecycle controller acts (see the module docstring): the
        ``Ready`` condition, the ``NoSchedule`` and ``NoExecute`` taints, its pods not Ready.
        From now on its kubelet confirms no pod deletion."""
        taint = UNREACHABLE_TAINT if ready == "Unknown" else NOT_READY_TAINT
        reason = "NodeStatusUnknown" if ready == "Unknown" else "KubeletNotReady"
        message = message or (
            "Kubelet stopped posting node status."
            if ready == "Unknown"
            else "container runtime is down"
        )
        now = self.now()

        def change(node: dict[str, Any]) -> None:
            status = node.setdefault("status", {})
            kept = [c for c in status.get("conditions") or [] if c.get("type") != "Ready"]
            status["conditions"] = [
                *kept,
                {
                    "type": "Ready",
                    "status": ready,
                    "reason": reason,
                    "message": message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                },
            ]
            spec = node.setdefault("spec", {})
            keys = (NOT_READY_TAINT, UNREACHABLE_TAINT)
            others = [t for t in spec.get("taints") or [] if t.get("key") not in keys]
            spec["taints"] = [
                *others,
                {"key": taint, "effect": "NoSchedule"},  # TaintNodesByCondition
                {"key": taint, "effect": "NoExecute", "timeAdded": now},
            ]

        self.update_node(name, change)
        self.lost.add(name)
        for pod in self.objects["pods"].values():
            if pod["spec"].get("nodeName") != name:
                continue
            for c in (pod.get("status") or {}).get("conditions") or []:
                if c["type"] in ("Ready", "ContainersReady"):  # MarkPodsNotReady: Ready
                    c |= {"status": "False", "lastTransitionTime": now}
            self._touch(pod)

    @_locked
    def recover_node(self, name: str) -> None:
        """The kubelet is back: ``Ready`` again, the lifecycle taints gone, and the pods it
        was asked to delete meanwhile are killed and their deletion confirmed."""
        now = self.now()

        def change(node: dict[str, Any]) -> None:
            status = node.setdefault("status", {})
            kept = [c for c in status.get("conditions") or [] if c.get("type") != "Ready"]
            ready = {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            status["conditions"] = [*kept, ready]
            keys = (NOT_READY_TAINT, UNREACHABLE_TAINT)
            spec = node.setdefault("spec", {})
            spec["taints"] = [t for t in spec.get("taints") or [] if t.get("key") not in keys]

        self.update_node(name, change)
        self.lost.discard(name)
        for (ns, pod_name), pod in list(self.objects["pods"].items()):
            if pod["spec"].get("nodeName") == name and pod["metadata"].get("deletionTimestamp"):
                self.delete("pods", ns, pod_name, grace_seconds=0)

    @_locked
    def evict(self, seconds: float) -> list[str]:
        """The taint eviction controller, ``seconds`` after the ``NoExecute`` taints were put
        on (see the module docstring): the pods it deletes now, by name. A pod's delay is the
        least ``tolerationSeconds`` of its tolerations that match the node's ``NoExecute``
        taints (none with a number: never; a taint not tolerated: at once), as
        ``getMinTolerationTime`` reckons it."""
        evicted = []
        for (ns, pod_name), pod in list(self.objects["pods"].items()):
            node = self.nodes.get(pod["spec"].get("nodeName") or "")
            if node is None or pod["metadata"].get("deletionTimestamp"):
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            taints = (node.get("spec") or {}).get("taints") or []
            taints = [t for t in taints if t.get("effect") == "NoExecute"]
            delay = eviction_delay(taints, pod["spec"].get("tolerations") or [])
            if delay is None or delay > seconds:
                continue
            now = self.now()
            pod["status"].setdefault("conditions", []).append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "DeletionByTaintManager",
                    "message": TAINT_EVICTION_MESSAGE,
                    "lastProbeTime": None,
                    "lastTransitionTime": now,
                }
            )
            self._touch(pod)
            message = f"Marking for deletion Pod {ns}/{pod_name}"
            self.event(pod, "Normal", "TaintManagerEviction", message)
            self.delete("pods", ns, pod_name)
            evicted.append(pod_name)
        return evicted

    @_locked
    def add_claim(
        self, namespace: str, name: str, access_modes: Sequence[str] = ("ReadWriteOnce",)
    ) -> None:
        """A bound PersistentVolumeClaim with these access modes (its volume ``pvc-<uid>``)."""
        self.claims[namespace, name] = {
            "accessModes": list(access_modes),
            "volumeName": f"pvc-{uuid.uuid4()}",
        }

    def event(self, obj: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        self.events.append(
            {
                "involvedObject": {"kind": "Pod", "name": meta["name"]},
                "namespace": meta.get("namespace", ""),
                "type": kind,
                "reason": reason,
                "message": message,
            }
        )

    @_locked
    def schedule(self, namespace: str, name: str) -> str:
        """Schedule a Pending pod (kube-scheduler), then start it unless a volume cannot be
        attached (the attach/detach controller and the kubelet). Returns ``"Unschedulable"``,
        ``"ContainerCreating"`` or ``"Running"``; ``"Pending"``, the pod untouched, when no
        scheduler of its ``schedulerName`` runs (:mod:`tests.deploy.kube_hami`)."""
        pod = self.objects["pods"][namespace, name]
        node_name = pod["spec"].get("nodeName")
        if not node_name and not self.schedulers.runs(pod):
            return "Pending"  # no scheduler of that name: none ever looks at the pod
        if not node_name:
            node_name, message = self._pick_node(pod)
            if node_name is None:
                pod["status"] = {
                    "phase": "Pending",
                    "qosClass": "Burstable",
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": message,
                            "lastProbeTime": None,
                            "lastTransitionTime": self.now(),
                        }
                    ],
                }
                self.event(pod, "Warning", "FailedScheduling", message)
                self._touch(pod)
                return "Unschedulable"
            pod["spec"]["nodeName"] = node_name
            self.schedulers.bind(pod, self.nodes[node_name], self._bound_pods(exclude=pod))
            self.dra.bind(pod, node_name, self.objects["resourceclaims"], self._touch)
            self.event(
                pod,
                "Normal",
                "Scheduled",
                f"Successfully assigned {namespace}/{name} to {node_name}",
            )
        blocked = self._multi_attach(pod, node_name)
        if blocked:
            scheduled = self.now()
            pod["status"] = {
                "phase": "Pending",
                "qosClass": "Burstable",
                "hostIP": self._host_ip(node_name),
                "startTime": scheduled,
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "True",
                        "lastProbeTime": None,
                        "lastTransitionTime": scheduled,
                    }
                ],
                "containerStatuses": [
                    self._container_status(c, {"waiting": {"reason": "ContainerCreating"}}, False)
                    for c in pod["spec"]["containers"]
                ],
            }
            self.event(pod, "Warning", "FailedAttachVolume", blocked)
            self._touch(pod)
            return "ContainerCreating"
        number = sum(1 for p in self.objects["pods"].values() if p["spec"].get("nodeName"))
        self._start(pod, f"10.244.{number}.7", self._host_ip(node_name))
        return "Running"

    def _host_ip(self, node_name: str) -> str:
        return f"192.168.0.{sorted(self.nodes).index(node_name) + 1}"

    def _bound_pods(self, exclude: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Pods bound to a node and not ended (what the scheduler's cache counts)."""
        return [
            p
            for p in self.objects["pods"].values()
            if p is not exclude
            and p["spec"].get("nodeName")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and not p["metadata"].get("deletionTimestamp")
        ]

    def _pick_node(self, pod: dict[str, Any]) -> tuple[str | None, str]:
        """The node kube-scheduler would bind ``pod`` to, or None and the FitError message."""
        if missing := self.dra.missing(pod, self.objects["resourceclaims"]):
            return None, missing
        reasons: Counter[str] = Counter()
        feasible: list[tuple[float, str]] = []
        requests = self.schedulers.kube_requests(pod, pod_requests(pod))
        eligible = [n for n in self.nodes.values() if node_matches(pod, n)]
        for name, node in sorted(self.nodes.items()):
            failed = self._filter(pod, node, requests, eligible)
            if failed:
                reasons.update(failed)
                continue
            feasible.append((-self._room(node, requests), name))
        if feasible:
            return min(feasible)[1], ""
        histogram = sorted(f"{n} {r}" for r, n in reasons.items())
        return None, f"0/{len(self.nodes)} nodes are available: {', '.join(histogram)}."

    def _filter(
        self,
        pod: Mapping[str, Any],
        node: Mapping[str, Any],
        requests: Mapping[str, float],
        eligible: Sequence[Mapping[str, Any]],
    ) -> list[str]:
        """The reasons of the first filter ``node`` fails, in kube-scheduler's order."""
        spec = pod["spec"]
        if (node.get("spec") or {}).get("unschedulable"):
            return ["node(s) were unschedulable"]
        for taint in (node.get("spec") or {}).get("taints") or []:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerated(
                taint, spec.get("tolerations") or []
            ):
                return [
                    f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
                ]
        if not node_matches(pod, node):
            return ["node(s) didn't match Pod's node affinity/selector"]
        free = self._free(node)
        short = [
            f"Insufficient {resource}"
            for resource, amount in sorted(requests.items())
            if (resource in free or "/" in resource) and amount > free.get(resource, 0)
        ]
        if short:
            return short
        if self.dra.pick(pod, node["metadata"]["name"], self.objects["resourceclaims"]) is None:
            return [kube_dra.UNFIT]
        for constraint in spec.get("topologySpreadConstraints") or []:
            if constraint.get("whenUnsatisfiable") == "DoNotSchedule" and not self._spread_ok(
                pod, node, constraint, eligible
            ):
                return ["node(s) didn't match pod topology spread constraints"]
        return self.schedulers.extender_filter(pod, node, self._bound_pods(exclude=pod))

    def _free(self, node: Mapping[str, Any]) -> dict[str, float]:
        """Allocatable less the requests of every pod bound to ``node`` and not ended, whatever
        its namespace or maker: kube-scheduler's NodeResourcesFit (``fitsRequest`` in
        ``pkg/scheduler/framework/plugins/noderesources/fit.go`` compares a pod's requests with
        ``nodeInfo.Allocatable`` less ``nodeInfo.Requested``, the sum over all the node's
        pods), so another tenant's GPU pod takes GPUs gpupool's ledger may think free."""
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        free = {k: quantity(v) for k, v in allocatable.items()}
        name = node["metadata"]["name"]
        for other in self._bound_pods():
            if other["spec"]["nodeName"] == name:
                for resource, amount in pod_requests(other).items():
                    free[resource] = free.get(resource, 0) - amount
        return free

    def _room(self, node: Mapping[str, Any], requests: Mapping[str, float]) -> float:
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        free = self._free(node)
        shares = [
            (free.get(r, 0) - a) / quantity(allocatable[r])
            for r, a in requests.items()
            if allocatable.get(r) and quantity(allocatable[r]) > 0
        ]
        return sum(shares) / len(shares) if shares else 0.0

    def _spread_ok(
        self,
        pod: Mapping[str, Any],
        node: Mapping[str, Any],
        constraint: Mapping[str, Any],
        eligible: Sequence[Mapping[str, Any]],
    ) -> bool:
        key = constraint["topologyKey"]
        selector = constraint.get("labelSelector") or {}
        namespace = pod["metadata"].get("namespace")
        domains = {n["metadata"]["labels"].get(key) for n in eligible} - {None}
        value = node["metadata"]["labels"].get(key)
        if value is None:
            return False
        by_node = {n["metadata"]["name"]: n["metadata"]["labels"].get(key) for n in eligible}
        counts = dict.fromkeys(domains, 0)
        for other in self._bound_pods(exclude=pod):
            domain = by_node.get(other["spec"]["nodeName"])
            if (
                domain in counts
                and other["metadata"].get("namespace") == namespace
                and selector_matches(selector, other["metadata"].get("labels") or {})
            ):
                counts[domain] += 1
        itself = int(selector_matches(selector, pod["metadata"].get("labels") or {}))
        skew = counts.get(value, 0) + itself - min(counts.values(), default=0)
        return skew <= int(constraint.get("maxSkew", 1))

    def _multi_attach(self, pod: Mapping[str, Any], node_name: str) -> str:
        """The Multi-Attach error for the first ReadWriteOnce claim of ``pod`` that a pod on
        another node uses, or ``""``."""
        namespace = pod["metadata"]["namespace"]
        for claim in pod_claims(pod):
            info = self.claims.get((namespace, claim)) or {
                "accessModes": ["ReadWriteOnce"],
                "volumeName": f"pvc-{uuid.uuid5(uuid.NAMESPACE_URL, namespace + '/' + claim)}",
            }
            if not {"ReadWriteOnce", "ReadWriteOncePod"} & set(info["accessModes"]):
                continue
            users = sorted(
                p["metadata"]["name"]
                for p in self._bound_pods(exclude=pod)
                if p["metadata"].get("namespace") == namespace
                and p["spec"]["nodeName"] != node_name
                and claim in pod_claims(p)
            )
            if users:
                return (
                    f'Multi-Attach error for volume "{info["volumeName"]}" Volume is already used '
                    f"by pod(s) {', '.join(users)}"
                )
        return ""

    @staticmethod
    def _container_status(
        container: Mapping[str, Any], state: dict[str, Any], ready: bool
    ) -> dict[str, Any]:
        return {
            "name": container["name"],
            "image": container["image"],
            "imageID": f"{container['image']}@sha256:{'0' * 64}",
            "containerID": f"containerd://{uuid.uuid4().hex}",
            "ready": ready,
            "started": ready,
            "restartCount": 0,
            "state": state,
            "lastState": {},
        }

    @_locked
    def exit_pod(self, name: str, namespace: str, index: int, code: int) -> str:
        """The job container of index ``index`` ends with ``code`` (the kubelet), and the Job
        controller counts it; returns the pod's name."""
        job = self.job(name, namespace)
        pod = self.pods_of(name, namespace)[index]
        finished = self.now()
        terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": pod["status"].get("startTime", finished),
            "finishedAt": finished,
        }
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        pod["status"]["containerStatuses"] = [
            self._container_status(c, {"terminated": terminated}, False)
            for c in pod["spec"]["containers"]
        ]
        for c in pod["status"].get("conditions", []):
            if c["type"] in ("Ready", "ContainersReady"):
                c |= {"status": "False", "reason": "PodCompleted"}
        pod["metadata"]["finalizers"] = []
        self._touch(pod)
        status = job["status"]
        status["active"] -= 1
        status["ready"] = max(0, status.get("ready", 0) - 1)
        if code == 0:
            status["succeeded"] = status.get("succeeded", 0) + 1
            done = sorted({*_indexes(status.get("completedIndexes", "")), index})
            status["completedIndexes"] = ",".join(map(str, done))
        else:
            status["failed"] = status.get("failed", 0) + 1
        self._touch(job)
        return str(pod["metadata"]["name"])

    @_locked
    def complete(self, name: str, namespace: str) -> None:
        """Every index succeeded: ``SuccessCriteriaMet``, then ``Complete``."""
        job = self.job(name, namespace)
        assert job["status"].get("succeeded") == job["spec"]["completions"]
        message = "Reached expected number of succeeded pods"
        self._set_condition(job, "SuccessCriteriaMet", "CompletionsReached", message)
        self._set_condition(job, "Complete", "CompletionsReached", message)
        job["status"]["completionTime"] = self.now()

    @_locked
    def fail(self, name: str, namespace: str, reason: str, message: str) -> None:
        """``FailureTarget``; the still active pods are deleted; then ``Failed``."""
        job = self.job(name, namespace)
        self._set_condition(job, "FailureTarget", reason, message)
        for pod in self.pods_of(name, namespace).values():
            if pod["status"]["phase"] in ("Pending", "Running"):
                self.objects["pods"].pop((namespace, pod["metadata"]["name"]))
        job["status"] |= {"active": 0, "ready": 0, "terminating": 0}
        self._set_condition(job, "Failed", reason, message)

    # -- Kueue -------------------------------------------------------------------------------
    @_locked
    def kueue_admit(self, name: str, namespace: str) -> None:
        """Kueue admits the Job's Workload (``QuotaReserved`` then ``Admitted``) and resumes the
        Job: ``spec.suspend: false`` (``Job.RunWithPodSetsInfo`` in kueue
        ``pkg/controller/jobs/job/job_controller.go``, called by ``startJob`` in
        ``pkg/controller/jobframework/reconciler.go``); the Job controller then sets
        ``Suspended=False`` (``JobResumed``) and a new ``startTime``. Create its pods with
        :meth:`create_pods`."""
        self.patch(
            "jobs", namespace, name, "application/merge-patch+json", {"spec": {"suspend": False}}
        )
        admitted = "The workload is admitted"
        self.workloads[namespace, name] = [
            self._condition("QuotaReserved", "QuotaReserved", "Quota reserved in ClusterQueue"),
            self._condition("Admitted", "Admitted", admitted),
        ]

    @_locked
    def kueue_preempt(self, name: str, namespace: str, message: str) -> None:
        """Kueue preempts the admitted Job's Workload, as Kueue does: the Workload gets
        ``Evicted=True`` (reason ``Preempted``, ``message``), ``QuotaReserved=False`` and
        ``Admitted=False`` (``workload.SetEvictedCondition``, then ``UnsetQuotaReservation``
        in kueue ``pkg/workload``); the job reconciler's ``stopJob`` calls ``Job.Stop``, which
        sets ``spec.suspend: true`` and clears ``status.startTime`` (``jobframework/
        reconciler.go``, ``jobs/job/job_controller.go``: "Reset start time so we can update the
        scheduling directives later when unsuspending"). The Job controller then deletes the
        active pods (not counted as failed) and sets ``Suspended=True`` (``JobSuspended``, "Job
        suspended"; ``pkg/controller/job/job_controller.go``). Nothing on the Job says it was
        admitted before."""
        job = self.job(name, namespace)
        job["spec"]["suspend"] = True
        job["status"].pop("startTime", None)
        for pod in self.pods_of(name, namespace).values():
            if pod["status"]["phase"] in ("Pending", "Running"):
                self.objects["pods"].pop((namespace, pod["metadata"]["name"]))
                self._deleted("pods", pod)
        job["status"] |= {"active": 0, "ready": 0, "terminating": 0}
        self._set_condition(job, "Suspended", "JobSuspended", "Job suspended")
        self.workloads[namespace, name] = [
            self._condition("Evicted", "Preempted", message),
            self._condition("QuotaReserved", "Preempted", message, "False"),
            self._condition(
                "Admitted", "NoReservation", "The workload has no reservation", "False"
            ),
        ]

    def _condition(
        self, kind: str, reason: str, message: str, status: str = "True"
    ) -> dict[str, Any]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": self.now(),
        }

    def _set_condition(
        self, obj: dict[str, Any], kind: str, reason: str, message: str, status: str = "True"
    ) -> None:
        now = self.now()
        conditions = obj["status"].setdefault("conditions", [])
        condition = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastProbeTime": now,
            "lastTransitionTime": now,
        }
        for i, c in enumerate(conditions):
            if c["type"] == kind:
                conditions[i] = condition
                break
        else:
            conditions.append(condition)
        self._touch(obj)


def _indexes(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}  # fmt: skip


def quantity(text: Any) -> float:
    """A resource quantity (``"500m"``, ``"16G"``, ``"8Gi"``, ``2``) as a number."""
    found = _QUANTITY.match(str(text).strip())
    if not found or found.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity: {text!r}")
    return float(found.group(1)) * _SUFFIX[found.group(2)]


def pod_requests(pod: Mapping[str, Any]) -> dict[str, float]:
    """What the pod's containers request (a limit stands for a missing request), plus one of
    ``pods``."""
    total: Counter[str] = Counter({"pods": 1})
    for container in pod["spec"].get("containers") or []:
        resources = container.get("resources") or {}
        wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for resource, amount in wanted.items():
            total[resource] += quantity(amount)
    return dict(total)


def default_tolerations(spec: dict[str, Any]) -> None:
    """What the ``DefaultTolerationSeconds`` admission plugin adds: for ``not-ready`` and for
    ``unreachable``, unless a toleration with that key (or none) and effect ``NoExecute`` (or
    none) is there, ``{key, operator: Exists, effect: NoExecute, tolerationSeconds: 300}``."""
    tolerations = spec.get("tolerations") or []
    for key in (NOT_READY_TAINT, UNREACHABLE_TAINT):
        if not any(
            t.get("key") in (None, "", key) and t.get("effect") in (None, "", "NoExecute")
            for t in tolerations
        ):
            tolerations = [
                *tolerations,
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": DEFAULT_TOLERATION_SECONDS,
                },
            ]
    spec["tolerations"] = tolerations


def eviction_delay(
    taints: Sequence[Mapping[str, Any]], tolerations: Sequence[Mapping[str, Any]]
) -> float | None:
    """Seconds after its ``NoExecute`` ``taints`` were put on that a pod with ``tolerations``
    is evicted: 0 when one is not tolerated, ``None`` (never) when no matching toleration has
    ``tolerationSeconds``, else the least of them (``GetMatchingTolerations`` and
    ``getMinTolerationTime``; a number at or below 0 is 0)."""
    if not taints:
        return None
    used = []
    for taint in taints:
        matching = [t for t in tolerations if tolerated(taint, [t])]
        if not matching:
            return 0.0
        used += matching
    seconds = [
        float(t["tolerationSeconds"]) for t in used if t.get("tolerationSeconds") is not None
    ]
    if not seconds:
        return None
    return max(0.0, min(seconds))


def pod_claims(pod: Mapping[str, Any]) -> list[str]:
    return [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["spec"].get("volumes") or []
        if "persistentVolumeClaim" in v
    ]


def tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _expression_holds(expression: Mapping[str, Any], value: str | None) -> bool:
    op, values = expression["operator"], expression.get("values") or []
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and value.lstrip("-").isdigit():
        return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
    return False


def node_matches(pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Whether ``node`` passes the pod's ``nodeSelector`` and required node affinity."""
    spec, labels = pod["spec"], node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms")
    if not terms:
        return True
    fields = {"metadata.name": node["metadata"]["name"]}
    return any(
        (t.get("matchExpressions") or t.get("matchFields"))
        and all(_expression_holds(e, labels.get(e["key"])) for e in t.get("matchExpressions") or [])
        and all(_expression_holds(e, fields.get(e["key"])) for e in t.get("matchFields") or [])
        for t in terms
    )


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A ``LabelSelector`` (``matchLabels``, ``matchExpressions``) against ``labels``."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(
        _expression_holds(e, labels.get(e["key"])) for e in selector.get("matchExpressions") or []
    )


def matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` satisfy an equality-based label selector."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 (maps merge, ``null`` deletes, anything else replaces)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add``/``replace``/``remove`` on object members."""
    out = copy.deepcopy(target)
    for op in ops:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
        ]
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "remove":
            del node[last]
        else:
            node[last] = copy.deepcopy(op["value"])
    return out


# -- HTTP --------------------------------------------------------------------------------------
class Served:
    """A :class:`StandIn` answering HTTP on ``127.0.0.1`` from its own thread and event loop."""

    def __init__(self) -> None:
        self.api = StandIn()
        self.closing = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        self.runner, self.port = future.result(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> tuple[web.AppRunner, int]:
        app = web.Application()
        add = app.router.add_route
        add("GET", "/api/v1/namespaces/{ns}/pods/{name}/log", self._log)
        add("GET", "/api/v1/nodes", self._list_nodes)
        add("GET", "/api/v1/nodes/{name}", self._get_node)
        add("GET", "/api/v1/pods", self._list_all_pods)
        add("GET", "/apis/coordination.k8s.io/v1/leases", self._list_all_leases)
        add("GET", "/apis/resource.k8s.io/v1/resourceslices", self._list_slices)
        for prefix, plurals in (
            ("/api/v1", "configmaps|services|pods"),
            ("/apis/batch/v1", "jobs"),
            ("/apis/networking.k8s.io/v1", "networkpolicies"),
            ("/apis/coordination.k8s.io/v1", "leases"),
            ("/apis/resource.k8s.io/v1", "resourceclaims|resourceclaimtemplates"),
        ):
            many = f"{prefix}/namespaces/{{ns}}/{{plural:{plurals}}}"
            add("GET", many, self._list)
            add("POST", many, self._create)
            add("DELETE", many, self._delete_collection)
            add("GET", many + "/{name}", self._get)
            add("PATCH", many + "/{name}", self._patch)
            add("DELETE", many + "/{name}", self._delete)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _answer(self, request: web.Request, reply: Reply) -> web.Response:
        code, body = reply
        if isinstance(body, bytes):
            return web.Response(status=code, body=body, content_type="text/plain")
        return web.json_response(body, status=code)

    def _seen(self, request: web.Request) -> tuple[str, str, str]:
        self.api.requests.append((request.method, request.path, dict(request.query)))
        m = request.match_info
        return m.get("plural", "pods"), m["ns"], m.get("name", "")

    async def _list_nodes(self, request: web.Request) -> web.StreamResponse:
        self.api.requests.append((request.method, request.path, dict(request.query)))
        if request.query.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request, "nodes", "")
        with self.api.lock:
            reply = self.api.list_objects("nodes", "", request.query.get("labelSelector", ""))
            return self._answer(request, copy.deepcopy(reply))

    async def _list_all_pods(self, request: web.Request) -> web.StreamResponse:
        """``GET /api/v1/pods``: every namespace's pods (list or watch; needs ``list``/``watch``
        on pods cluster-wide, which :meth:`StandIn.forbid` can take away)."""
        self.api.requests.append((request.method, request.path, dict(request.query)))
        watching = request.query.get("watch", "").lower() in ("true", "1")
        if refused := self._refused("watch" if watching else "list", "pods", ALL):
            return refused
        if watching:
            return await self._watch(request, "pods", ALL)
        with self.api.lock:
            reply = self.api.list_objects("pods", ALL, request.query.get("labelSelector", ""))
            return self._answer(request, copy.deepcopy(reply))

    async def _list_all_leases(self, request: web.Request) -> web.StreamResponse:
        """``GET /apis/coordination.k8s.io/v1/leases``: every namespace's Leases (a list)."""
        self.api.requests.append((request.method, request.path, dict(request.query)))
        if refused := self._refused("list", "leases", ALL):
            return refused
        with self.api.lock:
            reply = self.api.list_objects("leases", ALL, request.query.get("labelSelector", ""))
            return self._answer(request, copy.deepcopy(reply))

    async def _list_slices(self, request: web.Request) -> web.StreamResponse:
        """``GET /apis/resource.k8s.io/v1/resourceslices``: cluster-scoped (list or watch)."""
        self.api.requests.append((request.method, request.path, dict(request.query)))
        if request.query.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request, "resourceslices", "")
        with self.api.lock:
            reply = self.api.list_objects(
                "resourceslices", "", request.query.get("labelSelector", "")
            )
            return self._answer(request, copy.deepcopy(reply))

    async def _get_node(self, request: web.Request) -> web.Response:
        self.api.requests.append((request.method, request.path, dict(request.query)))
        name = request.match_info["name"]
        with self.api.lock:
            node = self.api.nodes.get(name)
            reply = (
                (200, node)
                if node
                else self.api._status(404, "NotFound", f'nodes "{name}" not found')
            )
            return self._answer(request, copy.deepcopy(reply))

    async def _watch(self, request: web.Request, plural: str, ns: str) -> web.StreamResponse:
        """``?watch=true``: newline-delimited events from ``resourceVersion`` until
        ``timeoutSeconds``; a compacted version gets one ``ERROR`` event with a ``410`` Status
        (HTTP 200, as the API server does). With ``allowWatchBookmarks``, a ``BOOKMARK`` ends a
        watch that runs out: the watch cache sends one to each watcher shortly before its
        timeout (``nextBookmarkTime`` in ``cache_watcher.go``: the deadline less 2 s, or every
        minute), so a client resumes from a recent version even when nothing it watches
        changed."""
        query = request.query
        selector, version = query.get("labelSelector", ""), query.get("resourceVersion", "")
        timeout = float(query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        start = self.api.watch_from(plural, ns, selector, version)
        if start is None:
            event = {"type": "ERROR", "object": self.api.expired(version)}
            await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
            return response
        events, at = start
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                for kind, obj in events:
                    line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                    await response.write(line)
                    at = max(at, int(obj["metadata"]["resourceVersion"]))
                if self.closing:
                    break
                if asyncio.get_running_loop().time() >= deadline:
                    asked = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
                    if asked and self.api.bookmarks:
                        with self.api.lock:  # nothing recorded between the two
                            events = self.api.events_after(plural, ns, selector, at)
                            mark = self.api.bookmark(plural)
                        for kind, obj in [*events, ("BOOKMARK", mark)]:
                            line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                            await response.write(line)
                    break
                await asyncio.sleep(0.01)
                events = self.api.events_after(plural, ns, selector, at)
            await response.write_eof()
        except ConnectionResetError:  # the client went away (aiohttp's error is one)
            pass
        return response

    def _refused(self, verb: str, plural: str, ns: str, name: str = "") -> web.Response | None:
        with self.api.lock:
            reply = self.api.authorize(verb, plural, ns, name)
        return None if reply is None else web.json_response(reply[1], status=reply[0])

    async def _list(self, request: web.Request) -> web.StreamResponse:
        plural, ns, _ = self._seen(request)
        watching = request.query.get("watch", "").lower() in ("true", "1")
        if refused := self._refused("watch" if watching else "list", plural, ns):
            return refused
        if watching:
            return await self._watch(request, plural, ns)
        with self.api.lock:
            reply = self.api.list_objects(plural, ns, request.query.get("labelSelector", ""))
            return self._answer(request, copy.deepcopy(reply))

    async def _create(self, request: web.Request) -> web.Response:
        plural, ns, _ = self._seen(request)
        if refused := self._refused("create", plural, ns):
            return refused
        body = await request.json()
        with self.api.lock:
            return self._answer(request, copy.deepcopy(self.api.create(plural, ns, body)))

    async def _get(self, request: web.Request) -> web.Response:
        plural, ns, name = self._seen(request)
        if refused := self._refused("get", plural, ns, name):
            return refused
        with self.api.lock:
            return self._answer(request, copy.deepcopy(self.api.get(plural, ns, name)))

    async def _patch(self, request: web.Request) -> web.Response:
        plural, ns, name = self._seen(request)
        if refused := self._refused("patch", plural, ns, name):
            return refused
        body = await request.json()
        with self.api.lock:
            reply = self.api.patch(plural, ns, name, request.content_type, body)
            return self._answer(request, copy.deepcopy(reply))

    async def _delete(self, request: web.Request) -> web.Response:
        plural, ns, name = self._seen(request)
        if refused := self._refused("delete", plural, ns, name):
            return refused
        text = await request.text()
        options = json.loads(text) if text.strip() else {}
        policy = request.query.get("propagationPolicy") or options.get("propagationPolicy", "")
        grace = _grace(request, options)
        with self.api.lock:
            reply = self.api.delete(plural, ns, name, policy, grace)
            return self._answer(request, copy.deepcopy(reply))

    async def _delete_collection(self, request: web.Request) -> web.Response:
        plural, ns, _ = self._seen(request)
        if refused := self._refused("deletecollection", plural, ns):
            return refused
        text = await request.text()
        grace = _grace(request, json.loads(text) if text.strip() else {})
        with self.api.lock:
            selector = request.query.get("labelSelector", "")
            reply = self.api.delete_collection(plural, ns, selector, grace)
            return self._answer(request, copy.deepcopy(reply))

    async def _log(self, request: web.Request) -> web.Response:
        _, ns, name = self._seen(request)
        limit = request.query.get("limitBytes")
        container = request.query.get("container", "")
        with self.api.lock:
            reply = self.api.log(ns, name, container, int(limit) if limit else None)
            return self._answer(request, reply)

    def close(self) -> None:
        self.closing = True  # open watches end
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _grace(request: web.Request, options: Mapping[str, Any]) -> int | None:
    """A delete's ``gracePeriodSeconds`` (the query's, else the ``DeleteOptions`` body's)."""
    value = request.query.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
    return None if value is None else int(value)


@contextmanager
def served() -> Iterator[Served]:
    server = Served()
    try:
        yield server
    finally:
        server.close()
