"""Alertmanager webhook (payload version 4): parse, validate, and read the orders in the labels.

    python -m pytest tests/integration/test_collector_webhook.py

Pure functions from bytes to plain data; the HTTP service (``server.py``) calls them and the
directive store (``directives.py``) acts on what they return. The payload is documented at
https://prometheus.io/docs/alerting/latest/configuration/#webhook_config.

A firing alert orders something of a job through two labels: ``torchvitals_action`` (one of
``ACTIONS``) and ``job``. Any other alert is recorded by the store but never acted on.

Labels are bounded (``LabelLimits``): a name or value past ``max_label_bytes`` or an alert with
more than ``max_labels`` labels rejects the notification (reason ``label_too_large``, the
message naming the alert and the label), so nothing unbounded reaches the store.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from ..errors import TorchvitalsError
from ..protocol import ACTION_LABEL, ACTIONS, JOB_LABEL

VERSION = "4"
"""The only webhook payload version Alertmanager has shipped; another one is rejected."""
STATUSES = ("firing", "resolved")


class PayloadError(TorchvitalsError, ValueError):
    """A webhook body that cannot be used; ``reason`` is a short, bounded metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class LabelLimits:
    """Bounds on one alert's labels (``CollectorConfig`` sets them)."""

    max_label_bytes: int = 1024
    """Largest label name or value, in UTF-8 bytes (the fingerprint too)."""
    max_labels: int = 64
    """Most labels one alert may carry."""


@dataclass(frozen=True)
class Alert:
    """One alert of a notification, reduced to what the collector uses."""

    status: str
    labels: Mapping[str, str]
    fingerprint: str
    starts_at: str
    """Verbatim from the payload: HA replicas send the same string for the same alert."""


@dataclass(frozen=True)
class Notification:
    """One webhook delivery: a group of alerts."""

    group_key: str
    status: str
    receiver: str
    alerts: tuple[Alert, ...]


@dataclass(frozen=True)
class Order:
    """What a firing alert asks of a job; the store turns it into at most one directive."""

    job: str
    action: str
    fingerprint: str
    starts_at: str
    labels: Mapping[str, str]

    @property
    def key(self) -> str:
        """The alert's identity: repeats and HA duplicates share fingerprint and startsAt."""
        return f"{self.fingerprint}@{self.starts_at}"


_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)


def parse_rfc3339(text: str) -> datetime:
    """Read an RFC 3339 time the same way on every Python the package admits.

    ``datetime.fromisoformat`` reads neither a trailing ``Z`` nor more than six fraction digits
    before Python 3.11, and Alertmanager (Go's ``time.RFC3339Nano``) writes both, e.g.
    ``2026-12-01T10:00:00.123456789Z``. The fraction is truncated to microseconds, the most a
    ``datetime`` holds; a leap second (``:60``), which Go never writes, is refused.

    Args:
        text: the time: date, ``T`` (or ``t`` or a space, as RFC 3339 allows), time, optional
            fraction, and ``Z`` or a ``+hh:mm``/``-hh:mm`` offset (required).

    Returns:
        The time, timezone-aware.

    Raises:
        ValueError: ``text`` is not an RFC 3339 time (the message quotes it).
    """
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in match.group(1, 2, 3, 4, 5, 6))
    micro = int((match.group(7) or "0")[:6].ljust(6, "0"))
    if match.group(8):
        tz = timezone.utc
    else:
        hours, minutes = int(match.group(10)), int(match.group(11))
        if hours > 23 or minutes > 59:
            raise ValueError(f"not an RFC 3339 time (offset out of range): {text!r}")
        offset = timedelta(hours=hours, minutes=minutes)
        tz = timezone(-offset if match.group(9) == "-" else offset)
    try:
        return datetime(year, month, day, hour, minute, second, micro, tzinfo=tz)
    except ValueError as exc:  # month 13, February 30, second 60, ...
        raise ValueError(f"not an RFC 3339 time ({exc}): {text!r}") from None


def _require(obj: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in obj:
        raise PayloadError("missing_field", f"{where}: missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind):
        raise PayloadError(
            "invalid_field",
            f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}",
        )
    return value


def _status(value: str, where: str) -> str:
    if value not in STATUSES:
        raise PayloadError(
            "invalid_field", f"{where}: status must be 'firing' or 'resolved', got {value!r}"
        )
    return value


def _bounded(text: str, what: str, limits: LabelLimits) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_label_bytes:
        raise PayloadError(
            "label_too_large",
            f"{what} is {size} bytes, over the limit of {limits.max_label_bytes} (max_label_bytes)",
        )


def _alert(obj: Any, index: int, limits: LabelLimits) -> Alert:
    where = f"alerts[{index}]"
    if not isinstance(obj, dict):
        raise PayloadError("invalid_field", f"{where} must be an object")
    status = _status(_require(obj, "status", str, where), where)
    labels = _require(obj, "labels", dict, where)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise PayloadError("invalid_field", f"{where}: labels must map strings to strings")
    if len(labels) > limits.max_labels:
        raise PayloadError(
            "label_too_large",
            f"{where}: {len(labels)} labels, over the limit of {limits.max_labels} (max_labels)",
        )
    for name, value in labels.items():
        _bounded(name, f"{where}: a label name ({name[:40]!r}...)", limits)
        _bounded(value, f"{where}: label {name!r}", limits)
    fingerprint = _require(obj, "fingerprint", str, where)
    if not fingerprint:
        raise PayloadError("invalid_field", f"{where}: fingerprint must not be empty")
    _bounded(fingerprint, f"{where}: fingerprint", limits)
    starts_at = _require(obj, "startsAt", str, where)
    try:
        parse_rfc3339(starts_at)
    except ValueError:
        raise PayloadError(
            "invalid_field", f"{where}: startsAt is not an RFC 3339 time: {starts_at!r}"
        ) from None
    return Alert(status=status, labels=dict(labels), fingerprint=fingerprint, starts_at=starts_at)


def parse_notification(body: bytes, limits: LabelLimits = LabelLimits()) -> Notification:
    """Parse and validate one webhook body.

    Args:
        body: the raw request body.
        limits: the bounds on each alert's labels.

    Returns:
        The notification.

    Raises:
        PayloadError: with ``reason`` one of ``invalid_json``, ``unsupported_version``,
            ``missing_field``, ``invalid_field``, ``label_too_large``, and a message naming
            the offending field.
    """
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PayloadError("invalid_json", f"body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise PayloadError("invalid_field", "body must be a JSON object")
    version = _require(obj, "version", str, "payload")
    if version != VERSION:
        raise PayloadError(
            "unsupported_version",
            f"payload version {version!r} is not supported (expected {VERSION!r})",
        )
    group_key = _require(obj, "groupKey", str, "payload")
    status = _status(_require(obj, "status", str, "payload"), "payload")
    receiver = obj.get("receiver", "")
    alerts = _require(obj, "alerts", list, "payload")
    return Notification(
        group_key=group_key,
        status=status,
        receiver=receiver if isinstance(receiver, str) else "",
        alerts=tuple(_alert(a, i, limits) for i, a in enumerate(alerts)),
    )


def order_of(alert: Alert) -> Order | None:
    """Read what a firing alert orders.

    Args:
        alert: one validated alert.

    Returns:
        The order, or None when the alert is resolved, carries no known ``torchvitals_action``
        or names no ``job``: such an alert is recorded, not acted on.
    """
    action = alert.labels.get(ACTION_LABEL)
    job = alert.labels.get(JOB_LABEL)
    if alert.status != "firing" or action not in ACTIONS or not job:
        return None
    return Order(
        job=job,
        action=action,
        fingerprint=alert.fingerprint,
        starts_at=alert.starts_at,
        labels=alert.labels,
    )
