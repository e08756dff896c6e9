"""cloud_adapters.base: the helpers every adapter shares."""

from __future__ import annotations

import datetime as dt

import pytest

from cloud_adapters.base import parse_utc

UTC = dt.timezone.utc


@pytest.mark.parametrize("value, expected", [
    (dt.datetime(2026, 1, 1, 12, 0), dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),  # naive: taken as UTC
    (dt.datetime(2026, 1, 1, 13, 0, tzinfo=dt.timezone(dt.timedelta(hours=1))),
     dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),
    ("2026-01-01T12:00:00Z", dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),
    (" 2026-01-01T14:00:00+02:00 ", dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),
    ("2026-01-01T12:00:00.5", dt.datetime(2026, 1, 1, 12, 0, 0, 500000, tzinfo=UTC)),
    (1767268800, dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),
    (1767268800.25, dt.datetime(2026, 1, 1, 12, 0, 0, 250000, tzinfo=UTC)),
])
def test_parse_utc_reads_each_form_a_provider_sends(value, expected):
    parsed = parse_utc(value)
    assert parsed == expected and parsed.utcoffset() == dt.timedelta(0)


@pytest.mark.parametrize("value", [None, "", "   ", "yesterday", "2026-13-01T00:00:00Z", True, [2026]])
def test_parse_utc_is_none_for_an_unknown_time(value):
    assert parse_utc(value) is None
