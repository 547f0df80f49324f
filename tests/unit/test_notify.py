"""Channel names of the targeted wake-ups (jobs/notify.py)."""

from jobs.notify import CANCEL_CHANNEL, FREED_CHANNEL, NOTIFY_CHANNEL, lane_channel, worker_channels


def test_plain_lane_names_keep_their_name_and_odd_or_long_ones_are_hashed():
    assert lane_channel("discovery") == "holdfast_lane_discovery"
    for odd in ("Media", "a b", "ü", "x" * 41, 'q"uote', "holdfast_lane_x"):
        channel = lane_channel(odd)
        assert len(channel.encode()) <= 63
        assert channel.startswith("holdfast_lane.") or odd == "holdfast_lane_x"
    assert lane_channel("x" * 41) != lane_channel("x" * 42)


def test_a_worker_of_some_lanes_listens_on_theirs_and_one_of_every_lane_on_the_general():
    assert worker_channels(["b", "a", "a"]) == [
        "holdfast_lane_a",
        "holdfast_lane_b",
        FREED_CHANNEL,
        CANCEL_CHANNEL,
    ]
    assert worker_channels(None) == [NOTIFY_CHANNEL, FREED_CHANNEL, CANCEL_CHANNEL]
