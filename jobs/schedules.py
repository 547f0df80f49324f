"""Schedule declarations and slot arithmetic.

Recurring work is declared in code (``@handler(..., schedule="0 3 * * *")`` or
``schedule=300`` seconds) or in the ``HOLDFAST_SCHEDULES`` setting. Cron expressions are
evaluated by ``cronsim`` in the schedule's own timezone, so "03:00 Europe/Berlin" stays
03:00 local across DST changes (a slot inside the spring-forward gap runs at the first
valid minute after it; an autumn repeated hour runs once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from . import refresh
from .models import CatchUp
from .registry import all_handlers

MAX_CATCH_UP_STEPS = 100_000  # slots walked when finding the latest missed one
MAX_EVERY = 100 * 365 * 86400.0  # seconds: an interval schedule runs at least once a century


@dataclass(frozen=True)
class Declared:
    """One schedule as declared in code or settings."""

    name: str
    kind: str
    cron: str = ""
    every: float | None = None
    args: dict[str, Any] = field(default_factory=dict)
    lane: str | None = None
    timezone: str = "UTC"
    catch_up: str = CatchUp.ONCE
    origin: str = "settings"

    def __post_init__(self) -> None:
        where = f"schedule {self.name!r}"
        if bool(self.cron) == (self.every is not None):
            raise ImproperlyConfigured(f"{where}: give exactly one of 'cron' and 'every'")
        if self.every is not None and not 0 < self.every <= MAX_EVERY:  # also refuses NaN
            raise ImproperlyConfigured(
                f"{where}: 'every' must be a number of seconds from 0 to {MAX_EVERY:g}"
            )
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ImproperlyConfigured(f"{where}: unknown timezone {self.timezone!r}") from None
        if self.cron:
            try:
                CronSim(self.cron, datetime.now(zone))
            except CronSimError as exc:
                raise ImproperlyConfigured(f"{where}: bad cron {self.cron!r}: {exc}") from None
        if self.catch_up not in CatchUp.values:
            raise ImproperlyConfigured(f"{where}: catch_up must be 'once' or 'skip'")
        if not isinstance(self.args, dict):
            raise ImproperlyConfigured(f"{where}: 'args' must be a JSON object")

    def definition(self) -> dict[str, Any]:
        """The fields a schedule row copies from its declaration."""
        return {
            "kind": self.kind,
            "cron": self.cron,
            "every": self.every,
            "args": self.args,
            "lane": self.lane,
            "timezone": self.timezone,
            "catch_up": self.catch_up,
            "origin": self.origin,
        }


ScheduleProvider = Callable[[], Iterable[Declared]]
_providers: dict[str, ScheduleProvider] = {}


def schedule_provider(name: str) -> Callable[[ScheduleProvider], ScheduleProvider]:
    """Register a function returning schedules kept as rows elsewhere (e.g. one per source).

    ``sync`` asks every provider each time it runs, so an app that adds or removes such a
    schedule calls ``jobs.scheduler.sync()`` afterwards; a provider's schedule that
    disappears is marked undeclared like any other.
    """

    def register(func: ScheduleProvider) -> ScheduleProvider:
        _providers[name] = func
        return func

    return register


def declared(providers: bool = True) -> dict[str, Declared]:
    """Every schedule declared by a handler, a provider or ``HOLDFAST_SCHEDULES``, by name."""
    found: dict[str, Declared] = {}
    for spec in all_handlers():  # also imports every app's handlers.py, and its providers
        if spec.schedule is None:
            continue
        if isinstance(spec.schedule, str):
            found[spec.kind] = Declared(spec.kind, spec.kind, cron=spec.schedule, origin="handler")
        else:
            every = float(spec.schedule)
            found[spec.kind] = Declared(spec.kind, spec.kind, every=every, origin="handler")
    for provider in _providers.values() if providers else ():
        for declaration in provider():
            found[declaration.name] = declaration
    if refresh.registered():
        found[refresh.REFRESH_KIND] = Declared(
            refresh.REFRESH_KIND,
            refresh.REFRESH_KIND,
            every=float(settings.HOLDFAST_REFRESH_SECONDS),
            origin="builtin",
        )
    for name, options in (getattr(settings, "HOLDFAST_SCHEDULES", {}) or {}).items():
        options = dict(options)
        unknown = set(options) - {"kind", "cron", "every", "args", "lane", "timezone", "catch_up"}
        if unknown or "kind" not in options:
            raise ImproperlyConfigured(
                f"HOLDFAST_SCHEDULES[{name!r}] needs 'kind' and accepts cron, every, args, "
                f"lane, timezone, catch_up (unknown: {', '.join(sorted(unknown)) or 'none'})"
            )
        every = options.pop("every", None)
        found[name] = Declared(name, every=None if every is None else float(every), **options)
    return found


def slots_after(cron: str, every: float | None, timezone: str, anchor: datetime) -> Any:
    """Iterate the schedule's slots strictly after ``anchor`` (aware datetimes, UTC)."""
    if cron:
        local = anchor.astimezone(ZoneInfo(timezone))
        for slot in CronSim(cron, local):
            if slot > anchor:  # cronsim may yield the anchor minute itself
                yield slot.astimezone(UTC)
        return
    assert every is not None
    step = timedelta(seconds=every)
    slot = anchor + step
    while True:
        yield slot
        slot += step


def next_slot(cron: str, every: float | None, timezone: str, after: datetime) -> datetime:
    return next(iter(slots_after(cron, every, timezone, after)))


def catch_up(
    cron: str, every: float | None, timezone: str, due: datetime, now: datetime
) -> tuple[datetime, datetime]:
    """For a schedule due at ``due`` (<= now): the latest slot <= now, and the next one after.

    Interval schedules keep their grid (``due + k * every``), so a restart does not shift
    them; cron schedules walk their slots (bounded).
    """
    if every is not None:
        step = timedelta(seconds=every)
        latest = due + step * ((now - due) // step)  # exact: timedelta arithmetic, no floats
        return latest, latest + step
    latest = due
    for steps, slot in enumerate(slots_after(cron, every, timezone, due)):
        if slot > now or steps >= MAX_CATCH_UP_STEPS:
            return latest, slot if slot > now else next_slot(cron, every, timezone, now)
        latest = slot
    raise AssertionError("unreachable: cron slots never end")
