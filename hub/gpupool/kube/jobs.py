"""``KubeJobBackend``: jobs as Kubernetes Indexed Jobs, one pod per node.

Vocabulary
- *objects*: per job, a ``batch/v1`` Job, a headless Service, a ConfigMap with the script and
  (with ``network_policy``) the job's NetworkPolicy, all named from the job id and labelled
  ``gpupool.io/job`` (see :mod:`gpupool.kube.manifests`). The others are owned by the Job
  (``ownerReferences``), so they go when it goes (cancel, or ``ttlSecondsAfterFinished``).
  Under DRA (``device_allocation = "dra"``) a ResourceClaimTemplate pinning the job's GPUs by
  UUID is one of them, and the pods ask it for their GPUs (see *job claims* in
  :mod:`gpupool.kube.claims`).
- *handle*: JSON with the namespace, the three names and the Job's ``uid``. A restarted hub
  finds the objects from the handle alone, or from the names (which depend only on the job id)
  when the hub went down before the handle was saved.
- *notebook pod template*: what the job pod is built from: ``pod_template_hook``'s answer if
  configured, else the owner's running notebook pod (KubeSpawner's labels), else
  ``pod_template`` with ``image``.
- *exit codes*: the observation's ``exit_codes`` are ``(rank, exit code)`` pairs, as the local
  backend's, but Kubernetes sees one process per node: each index's newest pod's ``job``
  container exit status (torchrun's) stands for every rank of that node (rank ``r`` ran on node
  ``r // gpus``), so the ranks of one node share one code (see
  :func:`gpupool.kube.job_status.rank_exit_codes`); the job's reason names nodes.
- *node binding*: GPU job pods are bound to the ledger's nodes (see
  :mod:`gpupool.kube.manifests`); a split the binding cannot make exact is logged.
- *log*: the pod log API of the newest pod with completion index ``rank // gpus``: every rank of
  that node, interleaved by line (rank_log marks where each rank starts). Offsets are bytes of
  the log as the API returns it now; the kubelet's log rotation can shorten it.

Contract: ``start`` creates the Job suspended, then its owned NetworkPolicy, ConfigMap and Service,
then resumes it (with a Kueue queue configured, Kueue's admission resumes it instead), so no pod
starts before its script and its network policy exist, and nothing outlives the Job: when any of
them cannot be created the Job is deleted and takes the others along. ``check`` reads, and writes
only to stop a job one of whose nodes was lost: the Job's conditions decide the end (``Complete``,
or ``Failed`` with its reason: ``BackoffLimitExceeded``, ``DeadlineExceeded``,
``PodFailurePolicy``); before that ``running`` means every node's pod runs (or has succeeded),
``starting`` says what the others wait for (Kueue's admission, for a Job still suspended), and
``queued`` that Kueue took the job back (*taken back* in :mod:`gpupool.kube.job_status`: a Job
suspended again after this hub saw it resumed, or while the job was ``running``): the manager
deletes it, releases its GPUs and requeues it, and its next start is a new Job that waits for
Kueue's admission again. A hub restarted between Kueue's admission and the job's ``running``
does not know it was admitted: such a Job taken back then waits for Kueue as before, holding
its GPUs. A job with a *stranded pod*
(:func:`gpupool.kube.job_status.stranded_pods`, the nodes read with a ``GET`` each, only for pods
being deleted or unschedulable) would never end before its deadline: its Job is deleted
(``Background``: the other pods stop) and, once no other pod is left running, the job is ``failed``
with the node's reason ("node gpu-2 is not ready (…)"), so its GPUs are released; the stranded pods
are left Terminating to the node's return (its kubelet then kills them) or to the pod garbage
collector (a hub restarted before the other pods ended, with no stranded pod left to read the reason
from, says ``lost``). A Job that is gone (404, or replaced by another object of that name) is
``lost`` once no pod of the job is left running; while its pods are still terminating the job is not
over (its GPUs are still in use). API errors other than 404 leave the job as it is, with the error
as the reason. ``cancel`` deletes the Job (``propagationPolicy: Background``), the Service, the
ConfigMap and the NetworkPolicy, and any pods left behind by a Job that is already gone. The API
client is one seam (``api_client_factory``); the global ``kubernetes_asyncio`` configuration is
never changed.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from aiohttp import ClientError
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from traitlets.config import Config

from gpupool.core.errors import InvalidRequest
from gpupool.core.inventory import NodePool
from gpupool.core.jobs import Job, JobSpec
from gpupool.core.ledger import Allocation
from gpupool.core.queue import ScaleUp
from gpupool.jobs.backend import Observation
from gpupool.kube.api import api_configuration
from gpupool.kube.claims import (
    DRA,
    DRAError,
    claim_template_name,
    job_pinned_uuids,
    make_claim_template,
    pinned_uuids,
    slice_devices,
    use_claim_template,
)
from gpupool.kube.job_claims import job_unhonoured, record_uuids, unallocatable_pods
from gpupool.kube.job_status import (
    TERMINAL_PHASES,
    JobRef,
    KubeError,
    api_message,
    latest_pods,
    nodes_to_read,
    observe_objects,
    phase,
    stranded_pods,
)
from gpupool.kube.manifests import (
    CONTAINER,
    JOB_LABEL,
    exact_binding,
    make_job,
    make_network_policy,
    make_script_configmap,
    make_service,
)
from gpupool.kube.pods import (
    label_value,
    queue_name,
)
from gpupool.kube.scale_up import SCALE_UP_LABEL, make_scale_up_pod, plan_scale_up_pods
from gpupool.kube.settings import (
    NOTEBOOK_SELECTOR,
    KubeJobSettings,
    notebook_pod,
    notebook_settings,
)


class KubeJobBackend(KubeJobSettings):
    """Runs jobs as Kubernetes Indexed Jobs (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._configuration: Any = None
        self._stopped: dict[str, str] = {}
        """Why this hub deleted a job's Job (its stranded pods' reason), by job id."""
        self._admitted: set[str] = set()
        self._read_back_done: set[str] = set()
        """DRA jobs whose pods' claims were read back and their UUIDs recorded (job ids)."""
        """Jobs whose Job this hub saw resumed by Kueue (job ids; see *taken back*)."""
        self.private_network = bool(self.network_policy)
        self.network_note = (
            "private: each job has a NetworkPolicy of its own (its pods and DNS only; the "
            "cluster's network plugin must enforce NetworkPolicy)"
            if self.network_policy
            else "shared: no NetworkPolicy per job (KubeJobBackend.network_policy is off)"
        )

    def validate(self, spec: JobSpec) -> None:
        """The base checks; and under DRA (``device_allocation = "dra"``), a job on MIG
        instances or shares is refused with the reason (whole GPUs only: see
        :mod:`gpupool.kube.claims`)."""
        super().validate(spec)
        offer = self.offer_named(spec.offer)
        if self.device_allocation == DRA and offer is not None and offer.kind in ("mig", "share"):
            raise InvalidRequest(
                f"Jobs on {spec.offer} cannot run on this hub: it gives GPUs through "
                "Kubernetes Dynamic Resource Allocation (KubeGPUSettings.device_allocation = "
                "'dra'), where gpupool gives whole GPUs only. Choose a whole-GPU offer."
            )

    @property
    def distinct_nodes(self) -> bool:  # type: ignore[override]
        """Bound pods of one Indexed Job share one template, so the binding is exact only when
        each of the job's nodes is its own machine (see :mod:`gpupool.kube.manifests`)."""
        return bool(self.bind_to_node)

    # -- the API client -----------------------------------------------------------------------
    async def api_client(self) -> Any:
        """A new ``ApiClient`` (use as ``async with``), from the factory or the credentials."""
        if self.api_client_factory is not None:
            made = self.api_client_factory()
            return await made if inspect.isawaitable(made) else made
        if self._configuration is None:
            self._configuration = await api_configuration()
        return client.ApiClient(self._configuration)

    @staticmethod
    def _apis(api: Any) -> tuple[Any, Any]:
        return client.BatchV1Api(api), client.CoreV1Api(api)

    @staticmethod
    def _networking(api: Any) -> Any:
        return client.NetworkingV1Api(api)

    async def _pods(self, api: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
        _, core = self._apis(api)
        listed = await core.list_namespaced_pod(
            namespace, label_selector=selector, _request_timeout=self.request_timeout
        )
        return [api.sanitize_for_serialization(p) for p in listed.items]

    # -- scale-up requests --------------------------------------------------------------------
    async def request_nodes(self, wanted: list[ScaleUp], node_pools: Sequence[NodePool]) -> None:
        """Make the request pods match ``wanted`` (see :mod:`gpupool.kube.scale_up`)."""
        pools = {p.name: p for p in node_pools}
        async with await self.api_client() as api:
            existing = await self._pods(api, self.namespace, SCALE_UP_LABEL)
            create, delete = plan_scale_up_pods(wanted, existing)
            _, core = self._apis(api)
            for name in delete:
                try:
                    await core.delete_namespaced_pod(
                        name, self.namespace, grace_period_seconds=0,
                        _request_timeout=self.request_timeout,
                    )  # fmt: skip
                except ApiException as e:
                    if e.status != 404:
                        raise
            for want, index in create:
                offer = self.offer_named(want.offer)
                if offer is None or want.node_pool not in pools:
                    continue
                body = make_scale_up_pod(
                    want, index, self.namespace, offer, pools[want.node_pool],
                    tolerations=self.gpu_tolerations, product_labels=self.product_labels(),
                )  # fmt: skip
                await self._create(core.create_namespaced_pod, self.namespace, body)
                self.log.info(
                    "gpupool: asked the autoscaler for a node of node pool %s (pod %s)",
                    want.node_pool,
                    body["metadata"]["name"],
                )

    # -- start --------------------------------------------------------------------------------
    async def pod_template_for(self, job: Job, api: Any) -> dict[str, Any]:
        """The notebook pod template of ``job`` (see the module docstring)."""
        if self.pod_template_hook is not None:
            found = self.pod_template_hook(self, job)
            found = await found if inspect.isawaitable(found) else found
            if found:
                return dict(found)
        if self.use_notebook_pod:
            selector = NOTEBOOK_SELECTOR.format(user=label_value(job.owner))
            try:
                pods = await self._pods(api, self.namespace, selector)
            except Exception as e:
                self.log.warning("gpupool: cannot read %s's notebook pod: %s", job.owner, e)
                pods = []
            found = notebook_pod(pods, job.owner)
            if found is not None:
                return found
        return dict(self.pod_template)

    async def start(self, job: Job, allocations: list[Allocation]) -> str:
        ref = JobRef.named(job, self.namespace)
        first = allocations[0] if allocations else None
        queue = None
        if self.kueue_queue_template and first is not None and first.devices:
            queue = queue_name(self.kueue_queue_template, first)
        async with await self.api_client() as api:
            batch, core = self._apis(api)
            body = make_job(
                job,
                allocations,
                pod_template=await self.pod_template_for(job, api),
                namespace=ref.namespace,
                script_configmap=ref.configmap,
                kueue_queue=queue,
                kueue_priority_class=self.kueue_priority_class,
                offer=self.offer_of(first) if first is not None else None,
                image=self.image,
                log_dir=self.log_dir,
                torchrun=self.torchrun,
                python=self.python,
                ttl_seconds_after_finished=self.ttl_seconds_after_finished,
                termination_grace_seconds=round(self.kill_grace),
                suspend=True,
                tolerations=self.gpu_tolerations,
                priority_class_name=self.gpu_priority_class_name,
                scheduler_name=self.gpu_scheduler_name,
                product_labels=self.product_labels(),
                bind_to_node=self.bind_to_node,
                keep_claims=self.keep_claims,
                shared_claim=self.shared_volume_claim,
                shared_mount_path=self.shared_volume_mount_path,
                shares=self.share_requests(),
            )
            if self.bind_to_node and not exact_binding(allocations):
                self.log.warning(
                    "gpupool: job %s: its nodes are split unevenly over machines (%s); its pods "
                    "are bound to those machines, but Kubernetes may not put as many on each",
                    job.id,
                    ", ".join(str(a.node) for a in allocations),
                )
            pinned: tuple[tuple[str, ...], int] | None = None
            if self.device_allocation == DRA and first is not None and first.devices:
                pinned = await self._pinned(api, allocations)  # before anything is made
                body = use_claim_template(body, claim_template_name(ref.job))
            created = await self._create(batch.create_namespaced_job, ref.namespace, body)
            owner = api.sanitize_for_serialization(created)
            ref = replace(ref, uid=owner["metadata"]["uid"])
            try:
                if self.network_policy:
                    networking = self._networking(api)
                    await self._replace(
                        networking.create_namespaced_network_policy,
                        networking.delete_namespaced_network_policy,
                        make_network_policy(job, ref.namespace, owner, dns=self.network_policy_dns),
                    )
                if pinned is not None:
                    resource = client.ResourceV1Api(api)
                    await self._replace(
                        resource.create_namespaced_resource_claim_template,
                        resource.delete_namespaced_resource_claim_template,
                        make_claim_template(
                            claim_template_name(ref.job), ref.namespace, *pinned, owner
                        ),
                    )
                await self._replace(
                    core.create_namespaced_config_map,
                    core.delete_namespaced_config_map,
                    make_script_configmap(job, ref.namespace, owner),
                )
                await self._replace(
                    core.create_namespaced_service,
                    core.delete_namespaced_service,
                    make_service(job, ref.namespace, owner),
                )
                if queue is None:
                    await batch.patch_namespaced_job(
                        ref.job,
                        ref.namespace,
                        {"spec": {"suspend": False}},
                        _request_timeout=self.request_timeout,
                    )
            except Exception:  # the Job takes what it owns along
                await self._delete(
                    batch.delete_namespaced_job,
                    ref.job,
                    ref.namespace,
                    propagation_policy="Background",
                )
                raise
        self.log.info(
            "gpupool: job %s is Kubernetes Job %s/%s%s",
            job.id,
            ref.namespace,
            ref.job,
            f" (Kueue queue {queue})" if queue else "",
        )
        return ref.handle()

    async def _pinned(self, api: Any, allocations: list[Allocation]) -> tuple[tuple[str, ...], int]:
        """The job's *pinned UUIDs* and GPUs per pod, from the nodes' ResourceSlices (see
        :func:`gpupool.kube.claims.job_pinned_uuids`); a :class:`KubeError` says why not."""
        resource = client.ResourceV1Api(api)
        try:
            found = await resource.list_resource_slice(_request_timeout=self.request_timeout)
        except ApiException as e:
            raise KubeError(
                f"Kubernetes refused to list ResourceSlices: {api_message(e)}"
            ) from None
        devices = slice_devices(api.sanitize_for_serialization(found.items))
        inventory = getattr(self._pool(), "inventory", None)
        try:
            if inventory is None:
                raise DRAError("the pool's inventory is not known to the job backend")
            return job_pinned_uuids(allocations, inventory, devices)
        except DRAError as e:
            raise KubeError(f"The job's GPUs cannot be pinned through DRA: {e}") from None

    async def _create(self, create: Any, namespace: str, body: dict[str, Any]) -> Any:
        kind, name = body["kind"], body["metadata"]["name"]
        try:
            return await create(namespace, body, _request_timeout=self.request_timeout)
        except ApiException as e:
            hint = _HINTS.get(e.status, "")
            raise KubeError(
                f"Kubernetes refused to create {kind} {namespace}/{name}: {api_message(e)}{hint}"
            ) from None

    async def _replace(self, create: Any, delete: Any, body: dict[str, Any]) -> None:
        """Create ``body``; one left from an earlier run of the job is deleted first."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            await create(namespace, body, _request_timeout=self.request_timeout)
        except ApiException as e:
            if e.status != 409:
                raise KubeError(
                    f"Kubernetes refused to create {body['kind']} {namespace}/{name}: "
                    f"{api_message(e)}{_HINTS.get(e.status, '')}"
                ) from None
            await self._delete(delete, name, namespace)
            await self._create(create, namespace, body)

    async def _delete(self, delete: Any, name: str, namespace: str, **options: Any) -> bool:
        """Delete one object; False if it was not there."""
        try:
            await delete(name, namespace, _request_timeout=self.request_timeout, **options)
        except ApiException as e:
            if e.status == 404:
                return False
            raise KubeError(
                f"Kubernetes refused to delete {namespace}/{name}: {api_message(e)}"
            ) from None
        return True

    # -- watching -----------------------------------------------------------------------------
    async def check(self, job: Job) -> Observation:
        """What the Job and its pods say now; works from the handle alone (hub restart)."""
        ref = JobRef.of(job, self.namespace)
        try:
            async with await self.api_client() as api:
                batch, _ = self._apis(api)
                try:
                    found = await batch.read_namespaced_job(
                        ref.job, ref.namespace, _request_timeout=self.request_timeout
                    )
                    obj = api.sanitize_for_serialization(found)
                except ApiException as e:
                    if e.status != 404:
                        raise
                    obj = None
                if obj is None or not self._ours(obj, job, ref):
                    return await self._gone(api, job, ref)
                selector = f"{JOB_LABEL}={label_value(job.id)}"
                pods = [
                    p
                    for p in await self._pods(api, ref.namespace, selector)
                    if _owned_by(p, obj["metadata"]["uid"])
                ]
                if not (obj.get("spec") or {}).get("suspend"):
                    self._admitted.add(job.id)
                admitted = job.state == "running" or job.id in self._admitted
                seen = observe_objects(obj, pods, job.spec.nodes, job.spec.gpus, admitted)
                if seen.state == "queued" or seen.ended:
                    self._admitted.discard(job.id)  # a next start is a new Job
                if seen.ended:
                    return seen
                stranded = await self._stranded(api, pods)
                if not stranded and seen.state == "running" and self.device_allocation == DRA:
                    wrong = await self._read_back(api, job, ref, pods)
                    stranded = {"": wrong} if wrong else {}
                if not stranded:
                    return seen
                cause = "; ".join(sorted(set(stranded.values())))
                self._stopped[job.id] = cause
                self.log.warning(
                    "gpupool: job %s: %s; deleting Kubernetes Job %s/%s",
                    job.id,
                    cause,
                    ref.namespace,
                    ref.job,
                )
                await self._delete(
                    batch.delete_namespaced_job,
                    ref.job,
                    ref.namespace,
                    propagation_policy="Background",
                )
                return await self._gone(api, job, ref)
        except (ApiException, ClientError, OSError, TimeoutError) as e:
            why = api_message(e) if isinstance(e, ApiException) else f"{type(e).__name__}: {e}"
            self.log.warning("gpupool: cannot look at job %s: %s", job.id, why)
            state = job.state if job.state in ("starting", "running") else "starting"
            return Observation(state, f"cannot reach the Kubernetes API ({why}); will retry")

    @staticmethod
    def _ours(obj: Mapping[str, Any], job: Job, ref: JobRef) -> bool:
        meta = obj.get("metadata") or {}
        if ref.uid:
            return bool(meta.get("uid") == ref.uid)
        return bool((meta.get("labels") or {}).get(JOB_LABEL) == label_value(job.id))

    async def _stranded(self, api: Any, pods: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        """The *stranded pods* of ``pods`` with why (reading the few nodes that decide it; a
        node that cannot be read is left out, logged)."""
        # under DRA, a pod whose pinned GPUs are held elsewhere never starts: stopped at once
        claims = unallocatable_pods(pods) if self.device_allocation == DRA else {}
        wanted = nodes_to_read(pods)
        if not wanted:
            return claims
        _, core = self._apis(api)
        nodes: dict[str, dict[str, Any] | None] = {}
        for name in sorted(wanted):
            try:
                found = await core.read_node(name, _request_timeout=self.request_timeout)
                nodes[name] = api.sanitize_for_serialization(found)
            except ApiException as e:
                if e.status == 404:
                    nodes[name] = None
                else:
                    self.log.warning("gpupool: cannot read node %s: %s", name, api_message(e))
        return {**stranded_pods(pods, nodes), **claims}

    async def _read_back(
        self, api: Any, job: Job, ref: JobRef, pods: Sequence[Mapping[str, Any]]
    ) -> str | None:
        """Once a DRA job runs: its pods' claims read back, compared with the pinned UUIDs
        (:func:`gpupool.kube.job_claims.job_unhonoured`) and recorded on the ledger's devices;
        why the job must stop where they differ, else None (also while not readable yet)."""
        pool = self._pool()
        ledger = getattr(pool, "ledger", None)
        if job.id in self._read_back_done or ledger is None:
            return None
        held = [ledger.allocations[i] for i in job.allocations if i in ledger.allocations]
        if not held:
            return None
        resource = client.ResourceV1Api(api)
        try:
            found = await resource.list_resource_slice(_request_timeout=self.request_timeout)
            listed = await resource.list_namespaced_resource_claim(
                ref.namespace, _request_timeout=self.request_timeout
            )
        except ApiException as e:
            self.log.warning("gpupool: job %s: cannot read its claims: %s", job.id, api_message(e))
            return None
        devices = slice_devices(api.sanitize_for_serialization(found.items))
        claims = api.sanitize_for_serialization(listed.items)
        try:
            pinned = {a.id: pinned_uuids(a, pool.inventory, devices) for a in held}
            wrong = job_unhonoured(held, pinned, pods, claims, devices)
        except (DRAError, LookupError) as e:
            self.log.info("gpupool: job %s: its claims are not read back yet: %s", job.id, e)
            return None
        self._read_back_done.add(job.id)
        if wrong:
            return (
                f"the GPUs given to the job's pods are not the ones the pool holds for it "
                f"({wrong}); an admin must check NVIDIA's DRA driver"
            )
        record_uuids(pool, pinned, self.log)
        self.log.info("gpupool: job %s holds %s", job.id, dict(pinned))
        return None

    async def _gone(self, api: Any, job: Job, ref: JobRef) -> Observation:
        selector = f"{JOB_LABEL}={label_value(job.id)}"
        pods = await self._pods(api, ref.namespace, selector)
        stranded = await self._stranded(api, pods)
        cause = "; ".join(sorted(set(stranded.values()))) or self._stopped.get(job.id, "")
        live = [p for p in pods if _live(p) and p["metadata"]["name"] not in stranded]
        if live:
            running = any(phase(p) == "Running" for p in live)
            head = f"{cause}: stopping the job" if cause else "its Kubernetes Job is gone"
            why = f"{head}; waiting for {len(live)} pod(s) to end"
            return Observation("running" if running else "starting", why)
        if cause:
            return Observation("failed", f"{cause}: the job cannot go on, so it was stopped")
        why = (
            f"its Kubernetes Job {ref.namespace}/{ref.job} is gone "
            "(deleted outside gpupool, or expired)"
        )
        return Observation("lost", why)

    async def wait(self, job: Job, timeout: float) -> None:
        await asyncio.sleep(timeout)

    # -- cancel -------------------------------------------------------------------------------
    async def cancel(self, job: Job) -> None:
        ref = JobRef.of(job, self.namespace)
        async with await self.api_client() as api:
            batch, core = self._apis(api)
            found = await self._delete(
                batch.delete_namespaced_job,
                ref.job,
                ref.namespace,
                propagation_policy="Background",
            )
            if not found:  # its pods have no owner to take them along
                await core.delete_collection_namespaced_pod(
                    ref.namespace,
                    label_selector=f"{JOB_LABEL}={label_value(job.id)}",
                    grace_period_seconds=round(self.kill_grace),
                    _request_timeout=self.request_timeout,
                )
            await self._delete(core.delete_namespaced_service, ref.service, ref.namespace)
            await self._delete(core.delete_namespaced_config_map, ref.configmap, ref.namespace)
            if self.network_policy:  # named as the Job
                networking = self._networking(api)
                await self._delete(
                    networking.delete_namespaced_network_policy, ref.job, ref.namespace
                )
        self.log.info("gpupool: deleted Kubernetes Job %s/%s", ref.namespace, ref.job)

    # -- logs ---------------------------------------------------------------------------------
    async def read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        """Bytes from ``offset`` of the log of the pod that ran ``rank`` (node ``rank //
        gpus``), at most ``log_chunk_bytes``, and the bytes known so far; ``(b"", 0)`` while
        that pod has no log (not created or not started yet, or deleted)."""
        ref = JobRef.of(job, self.namespace)
        index = rank // max(job.spec.gpus, 1)
        async with await self.api_client() as api:
            _, core = self._apis(api)
            selector = f"{JOB_LABEL}={label_value(job.id)}"
            pod = latest_pods(await self._pods(api, ref.namespace, selector)).get(index)
            if pod is None:
                return b"", 0
            response = await core.read_namespaced_pod_log(
                pod["metadata"]["name"],
                ref.namespace,
                container=CONTAINER,
                limit_bytes=offset + self.log_chunk_bytes,
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
            try:
                data, status = await response.read(), response.status
            finally:
                response.release()
        if status in (400, 404):  # waiting to start, or gone
            return b"", 0
        if status >= 300:
            raise KubeError(f"Kubernetes refused the log of pod {pod['metadata']['name']}")
        return data[offset:], len(data)


def check_kube_settings(config: Config) -> None:
    """Validate the GPU pod settings wherever they are set (``KubeGPUSettings``,
    ``KubeGPUSpawner``, ``KubeJobBackend``; the job backend's own where its section is
    configured), so that a bad value stops the hub at start, naming its setting key."""
    notebook_settings(config)
    if "KubeJobBackend" in config:
        KubeJobBackend(config=config)


_HINTS = {
    403: " (the hub's Role must grant it: the Helm chart's does)",
    409: " (an earlier run of this job still being deleted?)",
}


def _live(pod: Mapping[str, Any]) -> bool:
    return phase(pod) not in TERMINAL_PHASES


def _owned_by(pod: Mapping[str, Any], uid: str) -> bool:
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("uid") == uid for o in owners)
