"""JSON schemas of the custom resources the chart renders, for objects ``kubernetes_validate``
cannot check (it ships only the built-in kinds).

They are written from the CRDs' Go types (Kueue ``apis/kueue/v1beta2``: ResourceFlavor,
ClusterQueue, LocalQueue, WorkloadPriorityClass; Prometheus Operator
``monitoring.coreos.com/v1``: ServiceMonitor, PrometheusRule) and cover the fields this chart
sets, strictly: an unknown field, a missing required one, a bad name, quantity or duration, or
a namespace on a cluster-scoped kind, fails as it would at the API server.
Fields the chart never sets are left out, so a template that starts using one fails here until
its schema is added from the upstream type.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUANTITY = r"^[+-]?(\d+(\.\d*)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+)?$"
RESOURCE_NAME = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$"


def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": list(required),
    }


_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = _strict(
    {
        "name": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
        "namespace": {"type": "string", "pattern": DNS_SUBDOMAIN},
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
    },
    ("name",),
)
_QUANTITY = {"type": "string", "pattern": QUANTITY}
_SELECTOR = _strict(
    {
        "matchLabels": _STR_MAP,
        "matchExpressions": {
            "type": "array",
            "items": _strict(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)


def _object(api_version: str, kind: str, spec: dict[str, Any], namespaced: bool) -> dict[str, Any]:
    metadata = copy.deepcopy(_METADATA)
    if not namespaced:
        del metadata["properties"]["namespace"]
    return _strict(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": metadata,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


_RESOURCE_QUOTA = _strict(
    {
        "name": {"type": "string", "pattern": RESOURCE_NAME},
        "nominalQuota": _QUANTITY,
        "borrowingLimit": _QUANTITY,
        "lendingLimit": _QUANTITY,
    },
    ("name", "nominalQuota"),
)
_RESOURCE_GROUP = _strict(
    {
        "coveredResources": {
            "type": "array",
            "minItems": 1,
            "maxItems": 64,
            "items": {"type": "string", "pattern": RESOURCE_NAME},
        },
        "flavors": {
            "type": "array",
            "minItems": 1,
            "maxItems": 64,
            "items": _strict(
                {
                    "name": {"type": "string", "pattern": DNS_SUBDOMAIN},
                    "resources": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 64,
                        "items": _RESOURCE_QUOTA,
                    },
                },
                ("name", "resources"),
            ),
        },
    },
    ("coveredResources", "flavors"),
)

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"): _object(
        "kueue.x-k8s.io/v1beta2",
        "ResourceFlavor",
        _strict({"nodeLabels": _STR_MAP, "tolerations": {"type": "array"}}),
        namespaced=False,
    ),
    ("kueue.x-k8s.io/v1beta2", "ClusterQueue"): _object(
        "kueue.x-k8s.io/v1beta2",
        "ClusterQueue",
        _strict(
            {
                "cohortName": {"type": "string", "pattern": DNS_SUBDOMAIN},
                "namespaceSelector": _SELECTOR,
                "queueingStrategy": {"enum": ["StrictFIFO", "BestEffortFIFO"]},
                "preemption": _strict(
                    {
                        "reclaimWithinCohort": {"enum": ["Never", "LowerPriority", "Any"]},
                        "withinClusterQueue": {
                            "enum": ["Never", "LowerPriority", "LowerOrNewerEqualPriority"]
                        },
                    }
                ),
                "resourceGroups": {"type": "array", "maxItems": 16, "items": _RESOURCE_GROUP},
                "fairSharing": _strict({"weight": _QUANTITY}),
            }
        ),
        namespaced=False,
    ),
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): _object(
        "kueue.x-k8s.io/v1beta2",
        "LocalQueue",
        _strict({"clusterQueue": {"type": "string", "pattern": DNS_SUBDOMAIN}}, ("clusterQueue",)),
        namespaced=True,
    ),
    # WorkloadPriorityClass has no spec: value (int32, required) and description at the top.
    ("kueue.x-k8s.io/v1beta2", "WorkloadPriorityClass"): _strict(
        {
            "apiVersion": {"const": "kueue.x-k8s.io/v1beta2"},
            "kind": {"const": "WorkloadPriorityClass"},
            "metadata": {
                **_METADATA,
                "properties": {
                    k: v for k, v in _METADATA["properties"].items() if k != "namespace"
                },
            },
            "value": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
            "description": {"type": "string", "maxLength": 2048},
        },
        ("apiVersion", "kind", "metadata", "value"),
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _object(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        _strict(
            {
                "selector": _SELECTOR,
                "namespaceSelector": _strict(
                    {"any": {"type": "boolean"}, "matchNames": {"type": "array"}}
                ),
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _strict(
                        {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": r"^(0|(\d+(ms|s|m|h))+)$"},
                            "authorization": _strict(
                                {
                                    "type": {"type": "string"},
                                    "credentials": _strict(
                                        {"name": {"type": "string"}, "key": {"type": "string"}},
                                        ("key",),
                                    ),
                                }
                            ),
                        }
                    ),
                },
            },
            ("selector", "endpoints"),
        ),
        namespaced=True,
    ),
}


# Prometheus Operator's Duration (pkg/apis/monitoring/v1 types.go): "0", or units in order.
DURATION = r"^(0|(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?)$"
SCHEMAS[("monitoring.coreos.com/v1", "PrometheusRule")] = _object(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    _strict(
        {
            "groups": {
                "type": "array",
                "items": _strict(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "interval": {"type": "string", "pattern": DURATION},
                        "rules": {
                            "type": "array",
                            "items": {
                                **_strict(
                                    {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        # IntOrString in the type; an expression here
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": {"type": "string", "pattern": DURATION},
                                        "keep_firing_for": {
                                            "type": "string",
                                            "pattern": DURATION,
                                            "minLength": 1,
                                        },
                                        "labels": _STR_MAP,
                                        "annotations": _STR_MAP,
                                    },
                                    ("expr",),
                                ),
                                # a rule is an alert or a record, never both
                                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                            },
                        },
                    },
                    ("name",),
                ),
            },
        }
    ),
    namespaced=True,
)


def validate_custom(obj: dict[str, Any]) -> None:
    """Validate one rendered custom resource; ``KeyError`` for a kind without a schema here."""
    jsonschema.validate(obj, SCHEMAS[(obj["apiVersion"], obj["kind"])])
