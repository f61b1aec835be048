"""The webhook reads RFC 3339 times the same way on every Python the package admits (3.10 too,
whose ``datetime.fromisoformat`` reads neither ``Z`` nor nanoseconds).

    python -m pytest tests/unit/test_rfc3339.py
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from torchvitals.collector.webhook import PayloadError, parse_notification, parse_rfc3339

UTC = timezone.utc


@pytest.mark.parametrize(
    "text, expected",
    [
        # Alertmanager: Go's time.RFC3339Nano, nanoseconds truncated (not rounded) to microseconds.
        ("2026-12-01T10:00:00.123456789Z", datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)),
        ("2026-12-01T10:00:00.999999999Z", datetime(2026, 12, 1, 10, 0, 0, 999999, tzinfo=UTC)),
        ("2026-12-01T10:00:00Z", datetime(2026, 12, 1, 10, tzinfo=UTC)),
        ("2026-12-01t10:00:00z", datetime(2026, 12, 1, 10, tzinfo=UTC)),
        ("2026-12-01 10:00:00Z", datetime(2026, 12, 1, 10, tzinfo=UTC)),
        ("2026-12-01T10:00:00.5Z", datetime(2026, 12, 1, 10, 0, 0, 500000, tzinfo=UTC)),
        ("2026-12-01T10:00:00.000001Z", datetime(2026, 12, 1, 10, 0, 0, 1, tzinfo=UTC)),
        ("2026-12-01T11:30:00.25+01:30", datetime(2026, 12, 1, 10, 0, 0, 250000, tzinfo=UTC)),
        ("2026-12-01T05:00:00-05:00", datetime(2026, 12, 1, 10, tzinfo=UTC)),
        ("2026-12-01T10:00:00+00:00", datetime(2026, 12, 1, 10, tzinfo=UTC)),
        ("0001-01-01T00:00:00Z", datetime(1, 1, 1, tzinfo=UTC)),  # Alertmanager's zero endsAt
    ],
)
def test_alertmanager_times_are_read_to_the_microsecond(text, expected):
    parsed = parse_rfc3339(text)
    assert parsed == expected
    assert parsed.utcoffset() is not None


def test_the_offset_is_kept():
    assert parse_rfc3339("2026-12-01T11:30:00+01:30").utcoffset() == timedelta(hours=1, minutes=30)
    assert parse_rfc3339("2026-12-01T05:00:00-05:00").utcoffset() == timedelta(hours=-5)


@pytest.mark.parametrize(
    "text",
    [
        "yesterday",
        "",
        "2026-12-01",
        "2026-12-01T10:00:00",  # no offset: not RFC 3339
        "2026-12-01T10:00Z",
        "2026-12-01T10:00:00.Z",
        "2026-12-01T10:00:00,5Z",
        "2026-13-01T10:00:00Z",
        "2026-02-30T10:00:00Z",
        "2026-12-01T24:00:00Z",
        "2026-12-01T10:60:00Z",
        "2026-12-01T23:59:60Z",  # Go never writes a leap second
        "2026-12-01T10:00:00+24:00",
        "2026-12-01T10:00:00+01:60",
        "2026-12-01T10:00:00+0100",
        "2026-12-01T10:00:00Z ",
        " 2026-12-01T10:00:00Z",
        "2026-12-01T10:00:00Zjunk",
        "٢٠٢٦-12-01T10:00:00Z",  # non-ASCII digits
    ],
)
def test_anything_else_is_refused_quoting_it(text):
    with pytest.raises(ValueError, match="RFC 3339") as info:
        parse_rfc3339(text)
    assert repr(text) in str(info.value)


def _body(starts_at: str) -> bytes:
    return json.dumps(
        {
            "version": "4",
            "groupKey": "g",
            "status": "firing",
            "alerts": [
                {
                    "status": "firing",
                    "labels": {"job": "a", "torchvitals_action": "rollback"},
                    "fingerprint": "fp",
                    "startsAt": starts_at,
                }
            ],
        }
    ).encode()


def test_the_webhook_keeps_startsAt_verbatim_and_refuses_a_bad_one():
    # Verbatim: the directive's id hashes it, and HA replicas send the same string.
    assert (
        parse_notification(_body("2026-12-01T10:00:00.123456789Z")).alerts[0].starts_at
        == "2026-12-01T10:00:00.123456789Z"
    )
    with pytest.raises(PayloadError, match=r"alerts\[0\]: startsAt") as info:
        parse_notification(_body("2026-12-01T10:00:00"))
    assert info.value.reason == "invalid_field"
