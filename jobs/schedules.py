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
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from . import enqueueing, refresh
from . import lanes as lane_config
from .enqueueing import UNIQUE_KEY_LENGTH
from .exceptions import InvalidJob, LaneRefused, UnknownKind
from .models import CatchUp, Schedule
from .options import cron_problem, every_problem
from .registry import all_handlers, get_handler


def _column_length(model: Any, name: str) -> int:
    length = model._meta.get_field(name).max_length
    assert length is not None
    return int(length)


MAX_CATCH_UP_STEPS = 100_000  # slots walked when finding the latest missed one
SCHEDULE_OPTIONS = ("kind", "cron", "every", "args", "lane", "timezone", "catch_up")
# A slot's job carries the unique key ``schedule:<name>:<slot in UTC>`` (``slot_key``); with
# the longest slot text it must fit enqueue's bound, and the name the schedule row's column.
SLOT_KEY_PREFIX = "schedule:"
LONGEST_SLOT = "9999-12-31T23:59:59.999999+00:00"
MAX_NAME_LENGTH = min(
    _column_length(Schedule, "name"),
    UNIQUE_KEY_LENGTH - len(SLOT_KEY_PREFIX) - len(":") - len(LONGEST_SLOT),
)
MAX_KIND_LENGTH = _column_length(Schedule, "kind")
MAX_CRON_LENGTH = _column_length(Schedule, "cron")
MAX_TIMEZONE_LENGTH = _column_length(Schedule, "timezone")
MAX_LANE_LENGTH = _column_length(Schedule, "lane")


@dataclass(frozen=True)
class Declared:
    """One schedule as declared in code or settings.

    Everything a row copies is checked here, types and column lengths included: a
    declaration refused now is one line from ``manage.py check`` or the scheduler's start,
    where one accepted would fail every slot (or the start-up sync) later. Whether this
    process can enqueue its job (a handler for the kind, a lane that takes it) is
    ``enqueue_problem``'s question.
    """

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
        if not _text(self.name, MAX_NAME_LENGTH):
            raise ImproperlyConfigured(
                f"schedule {_shown(self.name)}: a schedule name is 1 to {MAX_NAME_LENGTH} "
                "characters (its slots' unique keys must fit)"
            )
        where = f"schedule {self.name!r}"
        if not _text(self.kind, MAX_KIND_LENGTH):
            raise ImproperlyConfigured(
                f"{where}: 'kind' must be a job kind of 1 to {MAX_KIND_LENGTH} characters"
            )
        self._check_timing(where)
        if self.catch_up not in CatchUp.values:
            raise ImproperlyConfigured(f"{where}: catch_up must be 'once' or 'skip'")
        if self.lane is not None and not _text(self.lane, MAX_LANE_LENGTH):
            raise ImproperlyConfigured(
                f"{where}: 'lane' must be a lane name of 1 to {MAX_LANE_LENGTH} characters"
            )
        if not isinstance(self.args, dict):
            raise ImproperlyConfigured(f"{where}: 'args' must be a JSON object")
        try:
            enqueueing.check_args(self.args)  # what enqueue (and the row) would refuse
        except InvalidJob as exc:
            raise ImproperlyConfigured(f"{where}: 'args': {exc}") from None

    def _check_timing(self, where: str) -> None:
        if not isinstance(self.cron, str) or len(self.cron) > MAX_CRON_LENGTH:
            raise ImproperlyConfigured(
                f"{where}: 'cron' must be a cron expression of at most {MAX_CRON_LENGTH} characters"
            )
        if bool(self.cron) == (self.every is not None):
            raise ImproperlyConfigured(f"{where}: give exactly one of 'cron' and 'every'")
        if self.every is not None:
            if problem := every_problem(self.every, "'every'"):
                raise ImproperlyConfigured(f"{where}: {problem}")
            object.__setattr__(self, "every", float(self.every))  # the row's column is a float
        if not _text(self.timezone, MAX_TIMEZONE_LENGTH):
            raise ImproperlyConfigured(
                f"{where}: 'timezone' must be a timezone name such as 'Europe/Berlin' "
                f"(at most {MAX_TIMEZONE_LENGTH} characters), not {self.timezone!r}"
            )
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ImproperlyConfigured(f"{where}: unknown timezone {self.timezone!r}") from None
        if self.cron and (problem := cron_problem(self.cron)):
            raise ImproperlyConfigured(f"{where}: bad cron {self.cron!r}: {problem}")

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


def _text(value: Any, most: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= most


def _shown(name: Any) -> str:
    """A name for a one-line message: a very long one shortened."""
    text = repr(name)
    return text if len(text) <= 60 else f"{text[:40]}… ({len(str(name))} characters)"


def slot_key(name: str, slot: datetime) -> str:
    """The unique key of a slot's job (at most 255 characters for any declared name)."""
    return f"{SLOT_KEY_PREFIX}{name}:{slot.astimezone(UTC).isoformat()}"


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
    """Every schedule declared by a handler, a provider or ``HOLDFAST_SCHEDULES``, by name;
    the first refused declaration raises ``ImproperlyConfigured``."""
    found, refused = _collect(providers)
    if refused:
        raise ImproperlyConfigured(refused[0])
    return found


def problems(providers: bool = True) -> list[str]:
    """Why declared schedules cannot run, one line each naming the schedule (none: all
    can). ``manage.py check`` reports them all, ``check_runnable`` the first."""
    found, refused = _collect(providers)
    try:
        lane_config.lanes()
    except ValueError:
        routable = False  # HOLDFAST_LANES itself is broken: holdfast.E001 says how
    else:
        routable = True
    found_problems = (enqueue_problem(item, routable, with_args=True) for item in found.values())
    return refused + [problem for problem in found_problems if problem]


def check_runnable() -> None:
    """Refuse to start a scheduler (``runscheduler``, ``runworker --with-scheduler``) with
    a schedule it could never enqueue, with one line naming it, instead of a loop that
    fails each pass or each slot. Reads no rows (not the providers), so it runs before the
    database is reachable; a broken ``HOLDFAST_LANES`` raises its own ``ValueError``."""
    lane_config.lanes()
    found = problems(providers=False)
    if found:
        more = f" (and {len(found) - 1} more: manage.py check lists them)" if found[1:] else ""
        raise ImproperlyConfigured(f"{found[0]}{more}")


class Routed(Protocol):
    """What enqueue needs to route a schedule's job: a ``Declared`` or a ``Schedule`` row."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def lane(self) -> str | None: ...
    @property
    def args(self) -> dict[str, Any]: ...


def enqueue_problem(item: Routed, routable: bool = True, with_args: bool = False) -> str | None:
    """Why this process could not enqueue the schedule's job, or None.

    Enqueue looks the kind up in this process's registry (``UnknownKind`` otherwise), so a
    kind handled only by workers elsewhere cannot be scheduled from here either: every
    slot would fail. ``routable``: also resolve its lane as enqueue would. ``with_args``:
    also check that the handler takes the schedule's args and derives its locks from them
    (a declaration's; every slot of one that does not would fail).
    """
    try:
        spec = get_handler(item.kind)
        if routable:
            lane_config.resolve(item.kind, item.lane, spec.lane)
        if with_args:
            enqueueing.check_handler_args(spec, item.args)
    except (UnknownKind, LaneRefused, InvalidJob) as exc:
        return f"schedule {item.name!r}: {exc}"
    return None


def _collect(providers: bool) -> tuple[dict[str, Declared], list[str]]:
    """The declarations that are valid, by name, and why each other one is refused."""
    found: dict[str, Declared] = {}
    refused: list[str] = []
    for spec in all_handlers():  # also imports every app's handlers.py, and its providers
        if spec.schedule is None:
            continue
        timing = "cron" if isinstance(spec.schedule, str) else "every"
        _declare(found, refused, spec.kind, spec.kind, origin="handler", **{timing: spec.schedule})
    for provider in _providers.values() if providers else ():
        for declaration in provider():
            found[declaration.name] = declaration
    if refresh.registered():
        name, every = refresh.REFRESH_KIND, float(settings.HOLDFAST_REFRESH_SECONDS)
        _declare(found, refused, name, name, every=every, origin="builtin")
    setting = getattr(settings, "HOLDFAST_SCHEDULES", None) or {}
    if not isinstance(setting, dict):
        kind_of = type(setting).__name__
        refused.append(f"HOLDFAST_SCHEDULES must be a dict of name to options, not {kind_of}")
        return found, refused
    for name, options in setting.items():
        problem = _options_problem(name, options)
        if problem:
            refused.append(problem)
            found.pop(name, None)  # not a handler's schedule of the same name instead
            continue
        _declare(found, refused, name, **options)
    return found, refused


def _options_problem(name: Any, options: Any) -> str | None:
    """Why one ``HOLDFAST_SCHEDULES`` entry is not a dict of known options, or None."""
    if not isinstance(options, dict):
        return f"schedule {_shown(name)}: its options must be a dict, not {type(options).__name__}"
    unknown = set(options) - set(SCHEDULE_OPTIONS)
    if unknown or "kind" not in options:
        return (
            f"schedule {_shown(name)}: needs 'kind' and accepts only "
            f"{', '.join(SCHEDULE_OPTIONS[1:])} (unknown: "
            f"{', '.join(sorted(map(str, unknown))) or 'none'})"
        )
    return None


def _declare(
    found: dict[str, Declared], refused: list[str], name: Any, *args: Any, **options: Any
) -> None:
    try:
        found[name] = Declared(name, *args, **options)
    except ImproperlyConfigured as exc:
        refused.append(str(exc))
        found.pop(name, None)


def slots_after(cron: str, every: float | None, timezone: str, anchor: datetime) -> Any:
    """Iterate the schedule's slots strictly after ``anchor`` (aware datetimes, UTC)."""
    if cron:
        local = anchor.astimezone(ZoneInfo(timezone))
        for slot in CronSim(_fixed_times(cron), local):
            if slot > anchor:  # cronsim may yield the anchor minute itself
                yield slot.astimezone(UTC)
        return
    assert every is not None
    step = timedelta(seconds=every)
    slot = anchor + step
    while True:
        yield slot
        slot += step


def _fixed_times(cron: str) -> str:
    """``cron`` with a leading ``*/N`` of its minute or hour field spelled as the range it
    means (``0-59/N``, ``0-23/N``). cronsim, as Debian's cron, treats a field that starts
    with ``*`` as an interval and moves none of its slots across a DST change: ``*/30 2 * *
    *`` in Europe/Berlin would not run on the spring-forward day and run four times on the
    autumn one. Spelled as a range it is the fixed times ``0,30 2 * * *`` are, which run
    once in the gap and once in the repeated hour, as documented."""
    fields = cron.split()
    for index, whole in ((0, "0-59"), (1, "0-23")):
        if index < len(fields) and fields[index].startswith("*/"):
            fields[index] = whole + fields[index][1:]
    return " ".join(fields)


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
        if slot > now:
            return latest, slot
        if steps >= MAX_CATCH_UP_STEPS:  # far behind: the latest slot is found from now
            return _latest_slot(cron, timezone, now), next_slot(cron, every, timezone, now)
        latest = slot
    raise AssertionError("unreachable: cron slots never end")


def _latest_slot(cron: str, timezone: str, now: datetime) -> datetime:
    """The cron schedule's latest slot at or before ``now``, walking back from it."""
    local = now.astimezone(ZoneInfo(timezone))
    for slot in CronSim(_fixed_times(cron), local, reverse=True):
        if slot <= now:
            return slot.astimezone(UTC)
    raise AssertionError("unreachable: cron slots never end")
