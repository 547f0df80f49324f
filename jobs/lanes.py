"""Lanes: named queues declared in ``HOLDFAST_LANES`` (DESIGN §5).

A lane may restrict the kinds it accepts (shell-style globs) and bound its queued jobs.
The lane ``default`` always exists and accepts every kind unless configured otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from django.conf import settings

from .exceptions import LaneRefused
from .options import MAX_LANE_NAME  # the job's lane column; it bounds lane-slot locks too


@dataclass(frozen=True)
class Lane:
    name: str
    kinds: tuple[str, ...] | None = None  # None: accepts every kind
    max_queued: int | None = None
    max_running: int | None = None
    on_full: str = "reject"

    def accepts(self, kind: str) -> bool:
        return self.kinds is None or any(fnmatchcase(kind, pattern) for pattern in self.kinds)


# Every option a lane takes: anything else is a typo that would silently change nothing.
LANE_OPTIONS = ("kinds", "max_queued", "max_running", "on_full")
ON_FULL = ("reject", "drop")
# PostgreSQL's claim passes the limits as ``int[]``: a larger max_running fails every claim.
MAX_RUNNING_LIMIT = 2**31 - 1


def _lane(name: Any, options: Any) -> Lane:
    """One lane from its settings, refusing at once what would misroute or break later:
    every enqueue and claim reads these, so a wrong type here is a traceback (or every job
    in the wrong lane) at run time, far from the setting that caused it."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LANE_NAME:
        raise ValueError(f"lane {name!r}: a lane name is 1 to {MAX_LANE_NAME} characters")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ValueError(f"lane {name!r}: its options must be a dict, not {type(options).__name__}")
    unknown = sorted(str(key) for key in options if key not in LANE_OPTIONS)
    if unknown:
        raise ValueError(
            f"lane {name!r}: unknown option(s) {', '.join(unknown)} "
            f"(a lane takes {', '.join(LANE_OPTIONS)})"
        )
    on_full = options.get("on_full", "reject")
    if on_full not in ON_FULL:
        raise ValueError(f"lane {name!r}: on_full must be 'reject' or 'drop', not {on_full!r}")
    return Lane(
        name=name,
        kinds=_kinds(name, options.get("kinds")),
        max_queued=_limit(name, "max_queued", options.get("max_queued")),
        max_running=_limit(name, "max_running", options.get("max_running"), MAX_RUNNING_LIMIT),
        on_full=on_full,
    )


def _kinds(name: str, kinds: Any) -> tuple[str, ...] | None:
    """A list of patterns. A string is refused: ``tuple("photo.*")`` is its characters, and
    the pattern ``*`` among them would send every kind to this lane."""
    if kinds is None:
        return None
    if not isinstance(kinds, list | tuple) or not all(
        isinstance(pattern, str) and pattern for pattern in kinds
    ):
        raise ValueError(
            f"lane {name!r}: kinds must be a list of non-empty kind patterns "
            f"(shell-style globs), not {kinds!r}"
        )
    return tuple(kinds)


def _limit(name: str, option: str, value: Any, most: int | None = None) -> int | None:
    """A bound of at least 1. Enqueue refuses a job when ``queued + 1 > max_queued``, so
    ``max_queued: 0`` would be a lane no job can enter, and ``max_running: 0`` one whose
    jobs never run: a lane that takes nothing says so with its ``kinds``."""
    if value is None:
        return None
    too_big = most is not None and isinstance(value, int) and value > most
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or too_big:
        upper = f" and at most {most}" if most is not None else ""
        raise ValueError(
            f"lane {name!r}: {option} must be a whole number of at least 1{upper}, not {value!r}"
        )
    return value


def lanes() -> dict[str, Lane]:
    setting = getattr(settings, "HOLDFAST_LANES", None)
    if setting is None:
        setting = {}
    if not isinstance(setting, dict):
        raise ValueError(
            f"HOLDFAST_LANES must be a dict of lane name to options, not {type(setting).__name__}"
        )
    configured: dict[Any, Any] = dict(setting)
    configured.setdefault("default", {})
    return {name: _lane(name, options) for name, options in configured.items()}


def resolve(kind: str, explicit: str | None, handler_lane: str | None) -> Lane:
    """Pick the lane for a new job: explicit, else the handler's, else first match, else default."""
    all_lanes = lanes()
    name = explicit or handler_lane
    if name is None:
        name = next(
            (lane.name for lane in all_lanes.values() if lane.kinds and lane.accepts(kind)),
            "default",
        )
    lane = all_lanes.get(name)
    if lane is None:
        raise LaneRefused(f"unknown lane {name!r} (declared: {', '.join(sorted(all_lanes))})")
    if not lane.accepts(kind):
        raise LaneRefused(f"lane {name!r} does not accept job kind {kind!r}")
    return lane


def running_limits(served: Sequence[str] | None) -> dict[str, int]:
    """``max_running`` of the served lanes (None: all lanes) that have one."""
    return {
        lane.name: int(lane.max_running)
        for lane in lanes().values()
        if lane.max_running is not None and (served is None or lane.name in served)
    }
