"""``KubeGPUSpawner`` (``gpupool-kube``): KubeSpawner with GPUs from the pool.

Vocabulary
- *accounting ledger*: on Kubernetes the pool decides *whether* a server gets a GPU (team quota,
  allowed offers, capacity read from the nodes' ``allocatable``, see
  :mod:`gpupool.kube.nodes`); the NVIDIA device plugin decides *which* device. The
  allocation's devices are the pool's bookkeeping, not device IDs to hand to CUDA.
- *manifest*: the ``V1Pod`` KubeSpawner builds (``get_pod_manifest``), which
  :func:`gpupool.kube.pods.apply_allocation` turns into one carrying the allocation:
  GPU resources, the model's ``nvidia.com/gpu.product`` affinity, the node binding
  (a required node affinity on ``metadata.name``: the node the ledger counted the devices on),
  GPU tolerations, priority class, scheduler name, and gpupool and Kueue labels (queue name and
  Kueue priority class).
- *shares*: a share of a GPU the device plugin shares (time-slicing or MPS) asks for one replica
  (``nvidia.com/gpu.shared`` or ``nvidia.com/gpu``, as the node publishes it), one of a GPU
  HAMi shares out for a virtual GPU with the share's memory (``hami_resources``):
  :class:`gpupool.kube.pods.ShareRequests` over the pool's inventory.
- *product labels*: model key to ``nvidia.com/gpu.product`` values: the built-in table, plus the
  products the Kubernetes inventory saw on the nodes, with ``gpu_product_labels`` overriding both.
- *GPU pod settings*: tolerations, priority class, scheduler, product labels, node binding, HAMi
  resources and Kueue labels are :class:`gpupool.kube.settings.KubeGPUSettings`, which this class
  and the job backend both inherit (``c.KubeGPUSettings.<name>`` sets both).
- *DRA*: with ``device_allocation = "dra"`` the notebook's GPUs are a ResourceClaim pinning
  them by UUID instead of ``nvidia.com/*`` resources (:mod:`gpupool_spawner.kube_dra`,
  :mod:`gpupool.kube.claims`); MIG instances and shares are refused (400) there.
- *profiles*: KubeSpawner's ``profile_list`` (z2jh's ``singleuser.profileList``, which z2jh's
  ``jupyterhub_config.py`` sets on ``c.KubeSpawner`` and this subclass inherits) works as in
  KubeSpawner: the ``profile`` user option, a profile's ``profile_options`` and their
  ``kubespawner_override`` (image, CPU, memory, ...) are KubeSpawner's own code
  (``load_user_options``). gpupool's offer, count and team apply on top; a profile entry may name
  the offers it allows with the extra key :data:`PROFILE_OFFERS_KEY` (KubeSpawner and z2jh's
  schema let extra keys through), enforced by the hub for every start, the default profile's for
  a start that names none. An unknown profile, or a choice a profile option lacks, is a 400
  before anything is allocated. The spawn form is KubeSpawner's profile form followed by
  gpupool's.

Contract: :class:`GPUSpawnerMixin` allocates before KubeSpawner starts, so the manifest is built
for the allocation of this start, never from spawner traits: a CPU-only server gets no
``nvidia.com/*`` resource whatever an earlier (failed) GPU spawn or a ``kubespawner_override``
left in ``extra_resource_limits`` (or ``extra_container_config``). No spawner trait is changed by
gpupool (KubeSpawner's profiles change them, as they do in KubeSpawner). A GPU pod runs where the
ledger counted its devices: a profile that pins it by name to another node
(``nodeSelector`` ``kubernetes.io/hostname``, or ``nodeName`` through ``extra_pod_config``) is
refused (400) and the devices released, rather than left Pending. An offer whose model has no
product labels is refused before any pod is made. The server's environment carries
``GPUPOOL_ALLOCATION``, ``GPUPOOL_OFFER``, ``GPUPOOL_TEAM`` and ``GPUPOOL_SIMULATED``, as the local
spawner's does; ``CUDA_VISIBLE_DEVICES`` is left to the device plugin. The notebook container is
hardened by default (``pod_hardening``; see *hardening* in :mod:`gpupool.kube.pods`): the
fields the admin's KubeSpawner settings leave unset get the hardened values, and what the admin
sets (``uid``, ``allow_privilege_escalation``, ``container_security_context``,
``pod_security_context``, a profile's ``kubespawner_override``) wins. ``poll`` reports a server
stopped (an :class:`~gpupool_spawner.mixin.UnknownExit` saying why) whose pod is being deleted
(``deletionTimestamp``) on a node that is not ready or gone, read with a ``GET`` of the node
(the chart's ClusterRole grants it): the taint eviction controller deletes it ``tolerationSeconds``
(300 s by default) after the node was lost, and its kubelet never confirms, so the pod stays
Terminating and KubeSpawner, which ignores ``deletionTimestamp``, would count it as running; the
mixin then releases its devices.
"""

from __future__ import annotations

import copy
from typing import Any

from jupyterhub.utils import maybe_future
from kubernetes_asyncio.client import V1Pod, V1ResourceRequirements
from kubernetes_asyncio.client.exceptions import ApiException
from kubespawner import KubeSpawner
from kubespawner.utils import get_k8s_model
from traitlets import Dict, default, validate

from gpupool.core.errors import InvalidRequest
from gpupool.core.ledger import Allocation
from gpupool.core.parse import clip
from gpupool.hub.errors import refuse
from gpupool.hub.form import PROFILE_OFFERS_KEY
from gpupool.kube.claims import DRA, claim_name, dra_refusal, use_claim
from gpupool.kube.nodes import not_ready_reason
from gpupool.kube.pods import (
    HARDENING,
    HOSTNAME_LABEL,
    apply_allocation,
    check_hardening,
    harden_notebook,
    product_values,
)
from gpupool.kube.settings import KubeGPUSettings
from gpupool_spawner.kube_dra import DRAClaims
from gpupool_spawner.mixin import GPUSpawnerMixin, UnknownExit
from gpupool_spawner.options import OfferLimit, others

PROFILE_FIELDS = ("profile", "profile-option-")
"""The spawn form fields KubeSpawner's profile form posts (the name, or its start)."""


class KubeGPUSpawner(GPUSpawnerMixin, DRAClaims, KubeSpawner, KubeGPUSettings):
    """KubeSpawner with GPUs from the pool; the GPU pod settings are
    :class:`gpupool.kube.settings.KubeGPUSettings` (``c.KubeGPUSettings.<name>`` for notebooks
    and jobs, ``c.KubeGPUSpawner.<name>`` for notebooks)."""

    pod_hardening = Dict(
        dict(HARDENING),
        config=True,
        help="""securityContext fields (API JSON) of the notebook container where KubeSpawner's
        settings (``uid``, ``allow_privilege_escalation``, ``container_security_context``,
        ``pod_security_context``...) leave them unset; ``runAsNonRoot`` is also left out for a
        container set to run as user 0. Default: ``runAsNonRoot: true``,
        ``allowPrivilegeEscalation: false``, ``capabilities: {drop: [ALL]}``, ``seccompProfile:
        {type: RuntimeDefault}``. ``{}`` adds none (an image that must start as root, e.g. to
        switch users or use sudo); a profile's ``kubespawner_override`` merges into it, and a
        key set to None there drops that field for the profile. Job pods are always hardened.
        Example::

            # allow images that start as root, keep the rest
            c.KubeGPUSpawner.pod_hardening = {
                "allowPrivilegeEscalation": False,
                "seccompProfile": {"type": "RuntimeDefault"},
            }
        """,
    )

    @validate("pod_hardening")
    def _valid_pod_hardening(self, proposal: dict[str, Any]) -> dict[str, Any]:
        return check_hardening(proposal["value"], "KubeGPUSpawner.pod_hardening")

    # -- a pod left on a lost node ------------------------------------------------------------
    _gpupool_lost = ""
    """Why the pod is lost, as the last ``poll`` found it (see the module docstring)."""

    async def poll(self) -> int | None:
        self._gpupool_lost = await self.gpupool_lost_pod()
        return await super().poll()

    def gpupool_exit_status(self, status: int | None) -> int | None:
        lost, self._gpupool_lost = self._gpupool_lost, ""
        if status is None and lost:
            return UnknownExit(lost)
        return status

    async def gpupool_lost_pod(self) -> str:
        """Why this server's pod is lost (being deleted on a node that is not ready or gone:
        see the module docstring), or ``""``. A node that cannot be read is not judged."""
        await self._start_watching_pods()
        key = f"{self.namespace}/{self.pod_name}"
        pod = self.pod_reflector.pods.get(key)
        node = ((pod or {}).get("spec") or {}).get("nodeName")
        if not pod or not node or not (pod.get("metadata") or {}).get("deletionTimestamp"):
            return ""
        try:
            found = await self.api.read_node(node, _request_timeout=self.k8s_api_request_timeout)
        except ApiException as e:
            if e.status == 404:
                return f"its pod {key} is being deleted on node {node}, which is gone"
            self.log.warning("gpupool: cannot read node %s of pod %s: %s", node, key, e.reason)
            return ""
        why = not_ready_reason(self.api.api_client.sanitize_for_serialization(found))
        if why is None:
            return ""
        return (
            f"its pod {key} is being deleted on node {node}, which {why}; the node's kubelet "
            "cannot confirm it, so it stays Terminating"
        )

    # -- product labels -----------------------------------------------------------------------
    def gpupool_product_labels(self) -> dict[str, tuple[str, ...]]:
        """The model → ``nvidia.com/gpu.product`` mapping in force (see the module docstring)."""
        return self.product_labels_for(self.gpupool.inventory)

    # -- the mixin's hook and KubeSpawner's manifest -------------------------------------------
    def gpupool_check_allocation(self, allocation: Allocation) -> None:
        if self.device_allocation == DRA and (why := dra_refusal(allocation)):
            raise refuse(400, f"Your {allocation.offer} cannot be given to this server: {why}.")
        offer = self.gpupool.ledger.offers.get(allocation.offer)
        if allocation.devices and offer is not None and offer.model:
            try:
                product_values(offer.model, self.gpupool_product_labels())
            except ValueError as e:
                raise refuse(503, f"Offer {offer.name} cannot be scheduled: {e}.") from None

    async def get_pod_manifest(self) -> V1Pod:
        pod: V1Pod = await super().get_pod_manifest()
        for container in pod.spec.containers or []:
            # ``extra_container_config`` (e.g. a profile's override) leaves a plain dict
            if isinstance(container.resources, dict):
                container.resources = get_k8s_model(V1ResourceRequirements, container.resources)
        allocation = self.gpupool_allocation
        self._gpupool_check_pins(pod, allocation)
        pod = harden_notebook(pod, self.pod_hardening)
        pod = apply_allocation(
            pod,
            allocation,
            self.gpupool_offer,
            tolerations=self.gpu_tolerations,
            priority_class_name=self.gpu_priority_class_name,
            scheduler_name=self.gpu_scheduler_name,
            product_labels=self.gpupool_product_labels(),
            kueue_queue_template=self.kueue_queue_template,
            kueue_priority_class=self.kueue_priority_class,
            bind_to_node=self.bind_to_node,
            shares=self.share_requests_for(self.gpupool.inventory),
        )
        if self.gpupool_uses_dra():  # its GPUs come from a claim (gpupool_spawner.kube_dra)
            pod = use_claim(pod, claim_name(self.pod_name))
        return pod

    def _gpupool_check_pins(self, pod: V1Pod, allocation: Allocation | None) -> None:
        """Refuse a GPU pod pinned by name to another node than the one the ledger chose."""
        if not (allocation and allocation.devices and allocation.node and self.bind_to_node):
            return
        pins = (
            (
                "nodeSelector kubernetes.io/hostname",
                (pod.spec.node_selector or {}).get(HOSTNAME_LABEL),
            ),
            ("nodeName", pod.spec.node_name),
        )
        for what, node in pins:
            if node and node != allocation.node:
                raise refuse(
                    400,
                    f"This server's profile pins it to node {node} ({what}), but the pool holds "
                    f"your {allocation.offer} on node {allocation.node}: choose another profile "
                    "or offer, or ask an admin to remove the pin from the profile.",
                )

    # -- KubeSpawner's profiles ----------------------------------------------------------------
    async def gpupool_profiles(self) -> list[dict[str, Any]]:
        """``profile_list`` as KubeSpawner's ``load_user_options`` reads it (a dict's values by
        key, a callable's result), initialized (slugs, one default profile); ``[]`` when none."""
        profiles: Any = self._sorted_dict_values(self.profile_list)
        if callable(profiles):
            profiles = await maybe_future(profiles(self))
        return list(self._get_initialized_profile_list(profiles) or [])

    async def gpupool_offer_limit(self, options: dict[str, Any]) -> OfferLimit | None:
        """The chosen (or default) profile's ``gpupool_offers``; an unknown profile, or a
        choice one of its ``profile_options`` does not have, is an :class:`InvalidRequest`."""
        profiles = await self.gpupool_profiles()
        if not profiles:
            return None
        try:
            self._validate_user_options(profiles)  # KubeSpawner's checks of self.user_options
            profile = self._get_profile(options.get("profile") or None, profiles)
        except ValueError as e:
            raise InvalidRequest(f"{str(e).rstrip('.')}.") from None
        name = str(profile.get("display_name") or profile["slug"])
        for key, option in (profile.get("profile_options") or {}).items():
            choice, choices = options.get(key), option.get("choices") or {}
            if options.get(f"{key}--unlisted-choice") or choice in (None, ""):
                continue
            if not isinstance(choice, str) or choice not in choices:
                raise InvalidRequest(
                    f"Profile {name!r} has no {key} {clip(choice)}: choose one of "
                    f"{', '.join(choices)}."
                )
        return self._gpupool_profile_offers(profile, name)

    def _gpupool_profile_offers(self, profile: dict[str, Any], name: str) -> OfferLimit | None:
        offers = profile.get(PROFILE_OFFERS_KEY)
        if offers is None:
            return None
        known = self.gpupool.ledger.offers
        if not isinstance(offers, list | tuple) or not all(
            isinstance(o, str) and o in known for o in offers
        ):
            self.log.error(
                "gpupool: KubeSpawner.profile_list[%r].%s must list offers of the pool (%s), "
                "got %r",
                profile["slug"],
                PROFILE_OFFERS_KEY,
                ", ".join(known),
                offers,
            )
            raise refuse(
                503,
                f"Profile {name!r} names offers this pool does not have ({clip(offers)}); "
                "an admin must fix its gpupool_offers.",
            )
        return OfferLimit(f"Profile {name!r}", tuple(offers))

    @default("options_form")
    def _gpupool_kube_options_form(self) -> Any:
        """gpupool's form alone, or, with a ``profile_list``, KubeSpawner's profile form
        followed by gpupool's (rendered per spawn page: a callable profile list is per user)."""
        if not self.profile_list:
            return self._render_gpupool_form
        return self._render_profiles_and_gpupool_form

    async def _render_profiles_and_gpupool_form(self, spawner: Any = None) -> str:
        profiles = copy.deepcopy(await self.gpupool_profiles())
        offers = self.gpupool.ledger.offers
        for profile in profiles:
            allowed = profile.get(PROFILE_OFFERS_KEY)
            if isinstance(allowed, list | tuple):
                labels = ", ".join(offers[o].label if o in offers else str(o) for o in allowed)
                description = str(profile.get("description") or "")
                profile["description"] = f"{description} (GPU choices: {labels})".strip()
        parts = [self._render_options_form(profiles), self._render_gpupool_form()]
        return "\n".join(p for p in parts if p)

    def gpupool_options_from_form(self, form_data: dict[str, list[str]]) -> dict[str, Any]:
        """gpupool's default ``options_from_form``; with a ``profile_list``, the profile fields
        are parsed by KubeSpawner's own parser (``profile``, its options by name), gpupool's
        fields by gpupool's, and every other field is passed through as it came."""
        if not self.profile_list:
            return super().gpupool_options_from_form(form_data)
        rest = others(form_data)
        profile_fields = {k: v for k, v in rest.items() if k.startswith(PROFILE_FIELDS)}
        theirs = {k: v for k, v in rest.items() if k not in profile_fields}
        profile = KubeSpawner._options_from_form(self, profile_fields) if profile_fields else {}
        return {**theirs, **profile, **self._gpupool_form_keys(form_data)}
