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


@dataclass(frozen=True)
class Lane:
    name: str
    kinds: tuple[str, ...] | None = None  # None: accepts every kind
    max_queued: int | None = None
    max_running: int | None = None
    on_full: str = "reject"

    def accepts(self, kind: str) -> bool:
        return self.kinds is None or any(fnmatchcase(kind, pattern) for pattern in self.kinds)


def _lane(name: str, options: dict[str, Any]) -> Lane:
    kinds = options.get("kinds")
    on_full = options.get("on_full", "reject")
    if on_full not in ("reject", "drop"):
        raise ValueError(f"lane {name!r}: on_full must be 'reject' or 'drop', not {on_full!r}")
    return Lane(
        name=name,
        kinds=tuple(kinds) if kinds is not None else None,
        max_queued=options.get("max_queued"),
        max_running=options.get("max_running"),
        on_full=on_full,
    )


def lanes() -> dict[str, Lane]:
    configured: dict[str, dict[str, Any]] = dict(getattr(settings, "HOLDFAST_LANES", {}) or {})
    configured.setdefault("default", {})
    return {name: _lane(name, options or {}) for name, options in configured.items()}


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
