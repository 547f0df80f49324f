"""Pure logic: retry policies, lane routing and the handler registry (no database)."""

import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from jobs import LaneRefused, RetryPolicy, UnknownKind, handler
from jobs import lanes as lane_config
from jobs.registry import get_handler
from jobs.retry import as_policy


@given(st.integers(min_value=1, max_value=10_000))
def test_default_backoff_is_exponential_from_5s_capped_at_an_hour(attempt):
    delay = RetryPolicy().delay(attempt)
    expected = min(3600.0, 5.0 * 2 ** min(attempt - 1, 32))
    assert expected * 0.75 <= delay <= expected


def test_backoff_forms():
    assert as_policy(0)(7) == 0.0
    assert as_policy(lambda attempt: attempt * 2.0)(3) == 6.0
    with pytest.raises(ValueError):
        as_policy(-1)
    with pytest.raises(TypeError):
        as_policy("soon")  # type: ignore[arg-type]


@override_settings(
    HOLDFAST_LANES={
        "discovery": {"kinds": ["ingestion.discover_*"]},
        "media": {"kinds": ["photo.*"]},
    }
)
def test_lane_resolution_order():
    assert lane_config.resolve("photo.resize", None, None).name == "media"
    assert lane_config.resolve("ingestion.discover_source", None, None).name == "discovery"
    assert lane_config.resolve("other.kind", None, None).name == "default"
    assert lane_config.resolve("photo.resize", "default", "media").name == "default"
    assert lane_config.resolve("photo.resize", None, "media").name == "media"
    with pytest.raises(LaneRefused, match="does not accept"):
        lane_config.resolve("other.kind", "media", None)
    with pytest.raises(LaneRefused, match="unknown lane"):
        lane_config.resolve("other.kind", "ghost", None)


def test_registry_refuses_two_handlers_for_one_kind():
    @handler("unit.once")
    def first(ctx):  # pragma: no cover - never run
        return None

    with pytest.raises(ValueError, match="already has a handler"):

        @handler("unit.once")
        def second(ctx):  # pragma: no cover - never run
            return None

    assert get_handler("unit.once").func is first
    with pytest.raises(UnknownKind):
        get_handler("unit.never")


@pytest.mark.parametrize("options", [{"max_attempts": 0}, {"lease_seconds": 0}])
def test_handler_options_are_validated(options):
    with pytest.raises(ValueError):
        handler("unit.bad", **options)
