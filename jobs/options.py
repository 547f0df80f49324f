"""The bounds of a job's options, checked once for every way they are given.

``enqueue()``, ``@handler(...)`` and a Django task's ``OPTIONS`` (``jobs.tasks_backend``)
take the same options; each asks the functions here what is wrong with a value (``None``:
nothing) and raises its own kind of error (``InvalidJob``, ``ValueError`` at import, a
system check). A bound here is one the engine depends on: a lease past a day, or a retry
delay past a century, would overflow the database's timestamps (a claim that fails
forever, on every worker, is a poison job no handler can fix).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

from cronsim import CronSim, CronSimError

from .retry import RetryPolicy

MAX_ATTEMPTS_LIMIT = 1_000_000
# A lease is renewed while the job runs (every third of it, at most every 5 s), so a long
# job needs no long lease; a long lease only delays the reclaim after a crash (I3).
MAX_LEASE_SECONDS = 86_400.0
MAX_DELAY = timedelta(days=365 * 100)
MAX_EVERY = 100 * 365 * 86400.0  # seconds: an interval schedule runs at least once a century
# Seconds: an interval schedule runs at most ten times a second (the scheduler passes twice
# a second); below a microsecond the interval would be zero, and the scheduler divides by it.
MIN_EVERY = 0.1
MAX_LANE_NAME = 100  # the job row's lane column (which also bounds the lane-slot lock names)


def is_number(value: Any) -> bool:
    """An int or float, not a bool (``True`` is an int to Python, never a count here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def max_attempts_problem(value: Any) -> str | None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_ATTEMPTS_LIMIT
    ):
        return f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}, not {value!r}"
    return None


def lease_seconds_problem(value: Any) -> str | None:
    if not is_number(value) or not 0 < value <= MAX_LEASE_SECONDS:  # also refuses NaN
        return (
            f"lease_seconds must be a number of seconds above 0 and at most "
            f"{MAX_LEASE_SECONDS:g} (a day), not {value!r}"
        )
    return None


def lane_problem(value: Any) -> str | None:
    """A lane given by name (``enqueue(lane=…)``, ``@handler(lane=…)``); whether it is
    declared is ``jobs.lanes.resolve``'s to say, at enqueue."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LANE_NAME:
        return f"lane must be a lane's name of 1 to {MAX_LANE_NAME} characters, not {value!r}"
    return None


def every_problem(value: Any, name: str = "every") -> str | None:
    """An interval schedule's seconds: from ``MIN_EVERY`` to ``MAX_EVERY``."""
    if not is_number(value) or not MIN_EVERY <= value <= MAX_EVERY:  # also refuses NaN
        return (
            f"{name} must be a number of seconds from {MIN_EVERY:g} to {MAX_EVERY:g}, not {value!r}"
        )
    return None


def cron_problem(expression: str) -> str | None:
    """Why a cron expression is refused, or None: five fields (minute, hour, day of month,
    month, day of week) that cronsim reads. cronsim also reads six, the first being
    seconds (Quartz's order): ``0 3 * * * *`` would run at minute 3 of every hour, where a
    reader of the usual five sees 03:00 and a sixth field (a year?). Refused, with the
    interval form to use for runs under a minute."""
    fields = len(expression.split())
    if fields != 5:
        return (
            f"a cron expression has five fields (minute hour day-of-month month "
            f"day-of-week), not {fields}; for intervals under a minute use 'every'"
        )
    try:
        CronSim(expression, datetime.now(UTC))
    except CronSimError as exc:
        return str(exc)
    return None


def delay_problem(value: Any, name: str = "delay") -> str | None:
    """A number of seconds (or a timedelta) from 0 to ``MAX_DELAY``."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if not is_number(seconds) or not 0 <= seconds <= MAX_DELAY.total_seconds():
        return f"{name} must be from 0 to {MAX_DELAY.days} days in seconds, not {value!r}"
    return None


def backoff_problem(value: Any) -> str | None:
    """``@handler(backoff=…)``: None, a number of seconds, a ``RetryPolicy`` or a callable."""
    if isinstance(value, RetryPolicy):
        for name in ("base", "cap"):
            problem = delay_problem(getattr(value, name), f"RetryPolicy.{name}")
            if problem:
                return problem
        if not is_number(value.jitter) or not 0 <= value.jitter <= 1:
            return f"RetryPolicy.jitter must be from 0 to 1, not {value.jitter!r}"
        return None
    if value is None or callable(value):
        return None
    if is_number(value):
        return delay_problem(value, "backoff")
    return f"backoff must be a RetryPolicy, a number of seconds or a callable, not {value!r}"


def retry_delay(seconds: Any) -> float | None:
    """A backoff's answer as a delay the engine can store: capped at ``MAX_DELAY``; None
    for one that is not a number of seconds at or above 0 (NaN, a string, negative)."""
    if not is_number(seconds) or math.isnan(seconds) or seconds < 0:
        return None
    return float(min(seconds, MAX_DELAY.total_seconds()))
