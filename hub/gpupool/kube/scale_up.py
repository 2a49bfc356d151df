"""Scale-up requests: pending pods that make the cluster's autoscaler add a declared node pool's
nodes for jobs that wait for them.

Vocabulary
- *scale-up* (:class:`gpupool.core.queue.ScaleUp`): ``nodes`` new nodes of a node pool, each to
  hold ``count`` of an offer, as the job queue asks (:func:`gpupool.core.queue.scale_ups`).
- *request pod*: one pause container per node wanted, named ``gpupool-scale-up-<pool>-<i>``,
  labelled ``gpupool.io/scale-up: <pool>``, asking for the job node's GPU resources (so only a
  node that could hold the job node fits it, and none of the present nodes can: that is why the
  job waits), selecting the pool's ``node_selector`` labels and the offer's GPU product, with
  the GPU tolerations. The cluster autoscaler (or Karpenter) sees it Pending and adds a node.
  Its pods are never bound by name (gpupool's own pods are, so they never trigger a scale-up).
- *retire*: once the node is in the pool's inventory, the job is granted on it and the request
  pod is deleted in the same pass; a request pod that landed on the new node first holds its
  GPUs only until then (the job's bound pod waits on ``Insufficient nvidia.com/gpu`` meanwhile).

Contract: :func:`make_scale_up_pod` and :func:`plan_scale_up_pods` are pure; the backend lists,
creates and deletes (:meth:`gpupool.kube.jobs.KubeJobBackend.request_nodes`). The request pod is
API JSON; its GPU parts (resources, product affinity, tolerations, hardening) are the ones
:mod:`gpupool.kube.pods` builds for every gpupool pod, so it asks for what a job pod would.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpupool.core.inventory import NodePool
from gpupool.core.offers import Offer
from gpupool.core.queue import ScaleUp
from gpupool.kube.pods import (
    gpu_resources,
    hardened_context,
    hardened_pod_context,
    product_affinity,
    to_json,
    tolerations_for,
)

SCALE_UP_LABEL = "gpupool.io/scale-up"
FOR_ANNOTATION = "gpupool.io/scale-up-for"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
PAUSE_USER = 65535
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpupool", "app.kubernetes.io/component": "scale-up"}


def scale_up_pod_name(node_pool: str, index: int) -> str:
    return f"gpupool-scale-up-{node_pool}-{index}"


def make_scale_up_pod(
    want: ScaleUp,
    index: int,
    namespace: str,
    offer: Offer,
    node_pool: NodePool,
    *,
    tolerations: Sequence[Mapping[str, Any]] = (),
    product_labels: Mapping[str, Sequence[str]] | None = None,
    image: str = PAUSE_IMAGE,
) -> dict[str, Any]:
    """The request pod for node ``index`` of ``want`` (see *request pod*)."""
    resources = gpu_resources(offer, want.count)
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "pause",
                "image": image,
                "resources": {"requests": resources, "limits": resources},
                "securityContext": hardened_context({"readOnlyRootFilesystem": True}),
            }
        ],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "securityContext": hardened_pod_context({"runAsUser": PAUSE_USER}),
        "tolerations": to_json(tolerations_for(None, tolerations, gpu=True)) or [],
    }
    if node_pool.node_selector:
        spec["nodeSelector"] = dict(node_pool.node_selector)
    if offer.model is not None and product_labels is not None:
        spec["affinity"] = to_json(product_affinity(offer.model, product_labels))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": scale_up_pod_name(want.node_pool, index),
            "namespace": namespace,
            "labels": {SCALE_UP_LABEL: want.node_pool, **MANAGED_BY},
            "annotations": {FOR_ANNOTATION: scale_up_key(want)},
        },
        "spec": spec,
    }


def scale_up_key(want: ScaleUp) -> str:
    """What a request pod asks for, as its annotation says (a changed wish replaces the pod)."""
    return f"{want.count}x {want.offer}"


def plan_scale_up_pods(
    wanted: Iterable[ScaleUp], existing: Iterable[Mapping[str, Any]]
) -> tuple[list[tuple[ScaleUp, int]], list[str]]:
    """``(to create, to delete)``: each wanted node's pod that does not exist, and each existing
    request pod no longer wanted or asking for something else (created again by a later call,
    once it is gone: a pod being deleted keeps its name a while)."""
    want = {scale_up_pod_name(w.node_pool, i): (w, i) for w in wanted for i in range(w.nodes)}
    have = {
        p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(FOR_ANNOTATION, "")
        for p in existing
    }
    delete = sorted(
        name for name, key in have.items() if name not in want or key != scale_up_key(want[name][0])
    )
    create = [w for name, w in sorted(want.items()) if name not in have]
    return create, delete
