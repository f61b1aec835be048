"""JSON schemas of the custom resources the chart renders, for the fields the chart sets.

Written down by hand from the upstream CRDs, closed (``additionalProperties: false``) where the
upstream object is, so a misspelt field fails here instead of being pruned silently by the API
server (structural CRDs drop unknown fields without an error):

- PodMonitor, ServiceMonitor, PrometheusRule (monitoring.coreos.com/v1) and AlertmanagerConfig
  (monitoring.coreos.com/v1alpha1): prometheus-operator v0.80.0,
  ``example/prometheus-operator-crd/monitoring.coreos.com_*.yaml``.
- PyTorchJob (kubeflow.org/v1): kubeflow/training-operator v1.8.1,
  ``manifests/base/crds/kubeflow.org_pytorchjobs.yaml``. Its pod templates are checked by
  kubernetes-validate as core ``PodTemplate`` objects, not here.

Only the subset of each CRD that the chart uses is listed: a field upstream accepts but the chart
never sets fails here too, which is the point — extending the chart means extending this file
against the upstream CRD of the same version.
"""

from __future__ import annotations

from typing import Any

_STRING = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
# monitoring.coreos.com Duration (pattern copied from the v0.80.0 CRDs).
_DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    "(([0-9]+)s)?(([0-9]+)ms)?)$",
}


def _closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }
    if required:
        schema["required"] = required
    return schema


_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "labels": _LABELS,
        "annotations": _LABELS,
    },
}
_LABEL_SELECTOR = _closed({"matchLabels": _LABELS, "matchExpressions": {"type": "array"}})
_SECRET_KEY = _closed({"name": _STRING, "key": _STRING, "optional": {"type": "boolean"}}, ["key"])


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


_SECRET_OR_CONFIGMAP = _closed({"secret": _SECRET_KEY, "configMap": _SECRET_KEY})
_ENDPOINT = _closed(
    {
        "port": _STRING,  # a named container port
        "path": _STRING,
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "scheme": {"enum": ["http", "https"]},
        # SafeTLSConfig (v0.80.0): the CA and client certificate from secrets or config maps.
        "tlsConfig": _closed(
            {
                "ca": _SECRET_OR_CONFIGMAP,
                "cert": _SECRET_OR_CONFIGMAP,
                "keySecret": _SECRET_KEY,
                "serverName": _STRING,
                "insecureSkipVerify": {"type": "boolean"},
            }
        ),
    }
)

PODMONITOR = _resource(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    _closed(
        {
            "jobLabel": _STRING,
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _closed(
                {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STRING}}
            ),
            "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
        },
        ["selector"],
    ),
)

SERVICEMONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _closed(
        {
            "jobLabel": _STRING,
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _closed(
                {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STRING}}
            ),
            "endpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
        },
        ["selector"],
    ),
)

_RULE = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "record": _STRING,
        "alert": _STRING,
        # IntOrString upstream; a rule's expression is always a string in our files.
        "expr": {"type": ["string", "integer"]},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    "required": ["expr"],
    # A rule either records or alerts (the operator's admission webhook enforces it).
    "oneOf": [
        {"required": ["record"], "not": {"required": ["alert"]}},
        {"required": ["alert"], "not": {"required": ["record"]}},
    ],
}
PROMETHEUSRULE = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    _closed(
        {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": _closed(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _DURATION,
                        "limit": {"type": "integer"},
                        "labels": _LABELS,
                        "rules": {"type": "array", "items": _RULE},
                    },
                    ["name"],
                ),
            },
        }
    ),
)

_MATCHER = _closed(
    {
        "name": {"type": "string", "minLength": 1},
        "value": _STRING,
        "matchType": {"enum": ["!=", "=", "=~", "!~"]},
    },
    ["name"],
)
ALERTMANAGERCONFIG = _resource(
    "monitoring.coreos.com/v1alpha1",
    "AlertmanagerConfig",
    _closed(
        {
            "route": _closed(
                {
                    "receiver": _STRING,
                    "groupBy": {"type": "array", "items": _STRING},
                    "groupWait": _STRING,
                    "groupInterval": _STRING,
                    "repeatInterval": _STRING,
                    "matchers": {"type": "array", "items": _MATCHER},
                    "continue": {"type": "boolean"},
                }
            ),
            "receivers": {
                "type": "array",
                "items": _closed(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "webhookConfigs": {
                            "type": "array",
                            "items": _closed(
                                {
                                    "url": {"type": "string", "pattern": "^https?://"},
                                    "sendResolved": {"type": "boolean"},
                                    "maxAlerts": {"type": "integer", "minimum": 0},
                                    "httpConfig": _closed(
                                        {
                                            "authorization": _closed(
                                                {"type": _STRING, "credentials": _SECRET_KEY}
                                            )
                                        }
                                    ),
                                }
                            ),
                        },
                    },
                    ["name"],
                ),
            },
        }
    ),
)

_REPLICA = _closed(
    {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},  # a PodTemplateSpec: validated by kubernetes-validate
    },
    ["template"],
)
PYTORCHJOB = _resource(
    "kubeflow.org/v1",
    "PyTorchJob",
    _closed(
        {
            "nprocPerNode": _STRING,  # *string upstream: "auto", "cpu", "gpu" or a number
            "runPolicy": _closed(
                {
                    "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                    "backoffLimit": {"type": "integer", "minimum": 0},
                    "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                    "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                }
            ),
            "pytorchReplicaSpecs": _closed({"Master": _REPLICA, "Worker": _REPLICA}, ["Master"]),
        },
        ["pytorchReplicaSpecs", "runPolicy"],
    ),
)

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): PODMONITOR,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICEMONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUSRULE,
    ("monitoring.coreos.com/v1alpha1", "AlertmanagerConfig"): ALERTMANAGERCONFIG,
    ("kubeflow.org/v1", "PyTorchJob"): PYTORCHJOB,
}
