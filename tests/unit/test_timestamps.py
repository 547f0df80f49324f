"""One reading of an ISO 8601 time for the CLI, the API and the spool (jobs.timestamps)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobs import timestamps


@given(
    st.datetimes(
        min_value=datetime(2, 1, 1),
        max_value=datetime(9998, 12, 31),
        timezones=st.builds(
            timezone, st.timedeltas(min_value=timedelta(hours=-23), max_value=timedelta(hours=23))
        ),
    )
)
def test_every_aware_time_reads_back_as_the_same_instant(moment: datetime) -> None:
    for text in (moment.isoformat(), moment.isoformat().lower(), moment.isoformat(sep=" ")):
        assert timestamps.parse(text) == moment


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-30T10:00:00Z", datetime(2026, 11, 30, 10, tzinfo=UTC)),
        ("2026-11-30t10:00:00z", datetime(2026, 11, 30, 10, tzinfo=UTC)),
        ("2026-11-30T12:00:00+02:00", datetime(2026, 11, 30, 10, tzinfo=UTC)),
        ("2016-12-31T23:59:60Z", datetime(2016, 12, 31, 23, 59, 59, tzinfo=UTC)),  # leap second
        ("2026-11-30T10:00:00.1234569Z", datetime(2026, 11, 30, 10, 0, 0, 123456, tzinfo=UTC)),
    ],
)
def test_rfc_3339_forms_read(text: str, expected: datetime) -> None:
    assert timestamps.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("2026-11-30T10:00:00", timestamps.NaiveTime),
        ("2026-11-30", timestamps.NaiveTime),
        ("2026-11-30T10:00:00Z\x00", timestamps.InvalidTime),
        ("2026-11-30T10:00:00Z\n", timestamps.InvalidTime),
        ("", timestamps.InvalidTime),
        ("yesterday", timestamps.InvalidTime),
        ("2026-11-30T10:00:00+25:00", timestamps.InvalidTime),
        ("\u0662026-11-30T10:00:00Z", timestamps.InvalidTime),
        ("9999-12-31T23:59:59-01:00", timestamps.OutOfRange),
        ("0001-01-01T00:00:00+01:00", timestamps.OutOfRange),
    ],
)
def test_what_is_not_an_aware_time_is_refused_by_kind(text: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        timestamps.parse(text)
