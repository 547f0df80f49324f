"""HOLDFAST_LANES validation: a lane setting that would misroute jobs or break enqueue and
claims later is refused when the lanes are read, naming the lane and the option (no database).
"""

import pytest
from django.core import checks
from django.test import override_settings

from jobs import lanes as lane_config
from jobs.checks import check_lanes_and_schedules


def lane_errors() -> list[checks.CheckMessage]:
    return [error for error in check_lanes_and_schedules() if error.id == "holdfast.E001"]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"kinds": "photo.*"}, "kinds must be a list"),  # tuple("photo.*") has the pattern "*"
        ({"kinds": ["photo.*", ""]}, "kinds must be a list of non-empty"),
        ({"kinds": ["photo.*", 7]}, "kinds must be a list"),
        ({"kinds": {"photo.*": 1}}, "kinds must be a list"),
        ({"max_queued": "10"}, "max_queued must be a whole number"),
        ({"max_queued": 0}, "max_queued must be a whole number of at least 1"),
        ({"max_queued": 2.5}, "max_queued must be a whole number"),
        ({"max_queued": True}, "max_queued must be a whole number"),
        ({"max_running": -1}, "max_running must be a whole number of at least 1"),
        ({"max_running": 0}, "max_running must be a whole number of at least 1"),
        ({"max_running": False}, "max_running must be a whole number"),
        ({"max_running": 2**31}, "at most 2147483647"),
        ({"max_runing": 2}, "unknown option(s) max_runing"),
        ({"on_full": "block"}, "on_full must be 'reject' or 'drop'"),
        (["photo.*"], "its options must be a dict, not list"),
        ("photo.*", "its options must be a dict, not str"),
    ],
)
def test_a_bad_lane_is_refused_naming_the_lane_and_the_option(options, says):
    with override_settings(HOLDFAST_LANES={"default": {}, "media": options}):
        with pytest.raises(ValueError, match="lane 'media'") as raised:
            lane_config.lanes()
        assert says in str(raised.value)
        [error] = lane_errors()
        assert "lane 'media'" in error.msg and says in error.msg


@pytest.mark.parametrize("name", ["", "x" * 101, 7])
def test_a_lane_name_must_fit_the_job_lane_column(name):
    with (
        override_settings(HOLDFAST_LANES={name: {}}),
        pytest.raises(ValueError, match="a lane name is 1 to 100 characters"),
    ):
        lane_config.lanes()


@override_settings(HOLDFAST_LANES=["default"])
def test_the_setting_itself_must_be_a_dict():
    with pytest.raises(ValueError, match="HOLDFAST_LANES must be a dict"):
        lane_config.lanes()
    assert len(lane_errors()) == 1


@override_settings(
    HOLDFAST_LANES={
        "default": None,  # no options
        "media": {"kinds": ("photo.*",), "max_queued": 500, "on_full": "drop"},
        "discovery": {"kinds": ["ingestion.discover_*"], "max_running": 2},
        "closed": {"kinds": []},  # accepts no kind
    }
)
def test_good_lanes_pass_and_a_pattern_list_routes_only_what_it_matches():
    assert lane_errors() == []
    declared = lane_config.lanes()
    assert declared["media"].kinds == ("photo.*",) and declared["media"].max_queued == 500
    assert lane_config.running_limits(None) == {"discovery": 2}
    assert lane_config.resolve("other.kind", None, None).name == "default"
    assert lane_config.resolve("photo.resize", None, None).name == "media"
    assert not declared["closed"].accepts("other.kind")
