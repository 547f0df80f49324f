"""System checks: ``manage.py check`` reports a misconfigured lane, schedule or lease."""

from __future__ import annotations

from typing import Any

from django.core import checks


@checks.register()
def check_lanes_and_schedules(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """One error per broken lane setting (E001) and per schedule that could never run
    (E002): refused, missing a handler for its kind in this process, or routed to a lane
    that does not exist or does not take the kind. ``runscheduler`` and ``runworker
    --with-scheduler`` refuse to start on the same schedules (``schedules.check_runnable``).
    """
    from . import lanes, registry, schedules

    try:
        registry.autodiscover()
    except Exception as exc:  # an app's handlers.py refused: said, not a traceback
        message = str(exc) or type(exc).__name__
        return [checks.Error(message, obj="handlers", id="holdfast.E005")]
    errors: list[checks.CheckMessage] = []
    try:
        lanes.lanes()
    except (ValueError, TypeError) as exc:
        errors.append(checks.Error(str(exc), obj="HOLDFAST_LANES", id="holdfast.E001"))
    else:
        errors.extend(
            checks.Error(problem, obj="handlers", id="holdfast.E005")
            for problem in handler_lane_problems()
        )
    # Not the providers: they read rows, and checks also run before ``migrate``.
    errors.extend(
        checks.Error(problem, obj="HOLDFAST_SCHEDULES", id="holdfast.E002")
        for problem in schedules.problems(providers=False)
    )
    return errors


def handler_lane_problems() -> list[str]:
    """A handler whose own ``lane=`` is not declared, or does not take its kind: every
    enqueue of the kind without an explicit lane would be refused, first met by whatever
    enqueues it (a request, a nightly job) rather than at deploy."""
    from . import lanes, registry
    from .exceptions import LaneRefused

    found = []
    for spec in registry.all_handlers():
        if spec.lane is None:
            continue
        try:
            lanes.resolve(spec.kind, None, spec.lane)
        except LaneRefused as exc:
            found.append(f"handler {spec.kind!r}: {exc}")
    return found


@checks.register()
def check_default_lease(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``HOLDFAST_LEASE_SECONDS`` within the bounds of every job's lease (E003): set in a
    settings module rather than the environment, it is not checked on reading, and each
    job that takes it would be refused by ``enqueue()`` or overflow the claim."""
    from django.conf import settings

    from .options import lease_seconds_problem

    problem = lease_seconds_problem(settings.HOLDFAST_LEASE_SECONDS)
    if problem is None:
        return []
    message = f"HOLDFAST_LEASE_SECONDS: {problem.removeprefix('lease_seconds ')}"
    return [checks.Error(message, obj="HOLDFAST_LEASE_SECONDS", id="holdfast.E003")]


@checks.register()
def check_retention(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The retention settings (E004): each a timedelta above 0, at most a century, or
    None. ``runscheduler`` and ``runworker --with-scheduler`` refuse to start on the same
    (``retention.check_settings``)."""
    from django.core.exceptions import ImproperlyConfigured

    from . import retention

    try:
        retention.check_settings()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), obj="HOLDFAST_RETAIN_*", id="holdfast.E004")]
    return []
