"""A schedule that could never run is refused before any slot: by ``manage.py check``
(holdfast.E002, one error per schedule, naming it) and at a scheduler's start
(``schedules.check_runnable``). Neither reads a row: checks also run before ``migrate``,
and this layer has no database at all."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from structlog.testing import capture_logs

from jobs import handler, registry, scheduler, schedules
from jobs.checks import check_lanes_and_schedules
from jobs.worker import WorkerProcess, _KeeperState

GOOD = {"kind": "test.echo", "every": 60}
LANES = {"default": {}, "media": {"kinds": ["photo.*"]}}


def schedule_errors() -> list[str]:
    return [error.msg for error in check_lanes_and_schedules() if error.id == "holdfast.E002"]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({**GOOD, "timezone": None}, "'timezone' must be a timezone name"),
        ({"kind": "test.echo", "every": "abc"}, "'every' must be a number of seconds"),
        # Zero as a timedelta: the scheduler would divide by it on every pass.
        ({"kind": "test.echo", "every": 1e-7}, "'every' must be a number of seconds from 0.1"),
        ("oops", "its options must be a dict, not str"),
        ({**GOOD, "evry": 60}, "unknown: evry"),
        ({"every": 60}, "needs 'kind'"),
        ({**GOOD, "kind": "test.nokind"}, "no handler is registered for job kind 'test.nokind'"),
        # A Django task's path is not a kind: enqueue by kind knows only handlers.
        ({**GOOD, "kind": "tests.testapp.tasks.add"}, "no handler is registered"),
        ({**GOOD, "lane": "nolane"}, "unknown lane 'nolane'"),
        ({**GOOD, "lane": "media"}, "lane 'media' does not accept job kind 'test.echo'"),
        ({**GOOD, "args": {"x": float("nan")}}, "not JSON-serializable"),
        # Args every enqueue refuses: each slot failed, from the first (helper-29 #1).
        ({**GOOD, "kind": "test.fail", "args": {"mesage": "x"}}, "unexpected keyword argument"),
        ({**GOOD, "kind": "test.flaky"}, "missing a required keyword-only argument: 'fail_times'"),
        ({**GOOD, "kind": "test.locked", "args": {"resources": 7}}, "the locks of 'test.locked'"),
    ],
)
def test_a_schedule_that_could_never_run_is_an_error_naming_it(options, says):
    with override_settings(HOLDFAST_LANES=LANES, HOLDFAST_SCHEDULES={"bad": options, "ok": GOOD}):
        [error] = schedule_errors()
        assert error.startswith("schedule 'bad': ") and says in error, error
        with pytest.raises(ImproperlyConfigured) as raised:
            schedules.check_runnable()
        assert str(raised.value) == error


@override_settings(
    HOLDFAST_SCHEDULES={"n" * 201: GOOD, "ghost": {**GOOD, "kind": "test.nokind"}, "ok": GOOD}
)
def test_every_bad_schedule_is_reported_and_the_start_names_the_first():
    errors = schedule_errors()
    assert len(errors) == 2, errors
    assert "a schedule name is 1 to 200 characters" in errors[0] and len(errors[0]) < 200
    with pytest.raises(ImproperlyConfigured, match=r"\(and 1 more: manage.py check lists them\)"):
        schedules.check_runnable()


@override_settings(HOLDFAST_SCHEDULES=[GOOD])
def test_the_setting_itself_must_be_a_dict():
    assert schedule_errors() == ["HOLDFAST_SCHEDULES must be a dict of name to options, not list"]


@override_settings(
    HOLDFAST_LANES={"default": {"max_queued": "10"}}, HOLDFAST_SCHEDULES={"ok": GOOD}
)
def test_broken_lanes_are_one_lane_error_not_one_per_schedule_and_stop_the_start():
    errors = check_lanes_and_schedules()
    assert [error.id for error in errors] == ["holdfast.E001"]
    with pytest.raises(ValueError, match="lane 'default': max_queued"):
        schedules.check_runnable()


@override_settings(
    HOLDFAST_LANES=LANES,
    HOLDFAST_SCHEDULES={
        "nightly": {"kind": "test.echo", "cron": "0 3 * * *", "timezone": "Europe/Berlin"},
        "photos": {"kind": "test.echo", "every": 300, "lane": "default", "args": {"a": [1]}},
    },
)
def test_good_schedules_pass():
    assert schedule_errors() == []
    schedules.check_runnable()


def test_a_schedule_that_fails_to_sync_after_the_start_is_one_line_with_backoff(monkeypatch):
    """``runworker --with-scheduler``: a provider's schedule (a row, not checked at the
    start) that cannot be synced is logged without a traceback, less and less often."""

    def refuse(now: object = None) -> None:
        raise ImproperlyConfigured("schedule 'discover:x': bad cron 'nope': ...")

    monkeypatch.setattr(scheduler, "sync", refuse)
    worker = WorkerProcess(worker_id="w", with_scheduler=True)
    worker._scheduler = scheduler.SchedulerLoop()
    state = _KeeperState()
    with capture_logs() as logs:
        for _ in range(3):
            worker._schedule_pass(state)
    assert [log["event"] for log in logs] == ["scheduler_misconfigured"] * 3
    assert [log["retry_in"] for log in logs] == [0.5, 1.0, 2.0]
    assert "discover:x" in logs[0]["error"] and "exc_info" not in logs[0]


def test_a_handler_whose_own_lane_would_refuse_every_enqueue_is_an_error(monkeypatch):
    """Accepted at import and by ``check``: each enqueue of the kind was refused, first met
    by whatever enqueued it (helper-29 #5)."""
    registry.autodiscover()
    monkeypatch.setattr(registry, "_handlers", dict(registry._handlers))
    handler("check.nolane", lane="nolane")(_take_ctx)
    handler("check.media", lane="media")(_take_ctx)
    handler("check.photo", lane="media")(_take_ctx)  # a lane that takes its kind: fine
    with override_settings(HOLDFAST_LANES={**LANES, "media": {"kinds": ["check.photo"]}}):
        errors = [e.msg for e in check_lanes_and_schedules() if e.id == "holdfast.E005"]
    assert errors == [
        "handler 'check.media': lane 'media' does not accept job kind 'check.media'",
        "handler 'check.nolane': unknown lane 'nolane' (declared: default, media)",
    ]


def test_a_refused_handler_registration_is_an_error_not_a_traceback(monkeypatch):
    """``manage.py check`` (and ``migrate``, which runs it) printed the ValueError of an
    app's ``handlers.py`` as a traceback (helper-29 #6)."""

    def refuse(name: str) -> None:
        raise ValueError("handler 'app.job': max_attempts must be an integer from 1, not 0")

    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setattr(registry, "autodiscover_modules", refuse)
    [error] = check_lanes_and_schedules()
    assert (error.id, error.msg) == (
        "holdfast.E005",
        "handler 'app.job': max_attempts must be an integer from 1, not 0",
    )


def _take_ctx(ctx: object) -> None:
    return None
