"""Refreshers: the TTL hook of the scheduler.

An app whose rows expire (an artifact's ``refresh_after``) registers a refresher: a
function that enqueues refresh jobs for at most ``limit`` due rows and returns how many
it enqueued. The built-in recurring job ``holdfast.refresh`` (every
``HOLDFAST_REFRESH_SECONDS``, declared only when a refresher exists) calls each one with
its batch size, so a backlog drains in bounded steps instead of one flood. Refreshers
should enqueue with a unique key per row, so that overlapping runs never double a refresh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .log import get_logger
from .registry import autodiscover

log = get_logger("jobs.refresh")

RefreshFunc = Callable[[int], int]
REFRESH_KIND = "holdfast.refresh"


@dataclass(frozen=True)
class Refresher:
    name: str
    func: RefreshFunc
    batch: int


_refreshers: dict[str, Refresher] = {}


def refresher(name: str, *, batch: int = 100) -> Callable[[RefreshFunc], RefreshFunc]:
    """Register ``func(limit) -> enqueued`` as the refresher called ``name``."""
    if batch < 1:
        raise ValueError("a refresher's batch must be at least 1")

    def register(func: RefreshFunc) -> RefreshFunc:
        _refreshers[name] = Refresher(name, func, batch)
        return func

    return register


def registered() -> list[Refresher]:
    autodiscover()
    return [_refreshers[name] for name in sorted(_refreshers)]


def run_all() -> dict[str, int]:
    """Call every refresher with its batch size; returns how many each enqueued."""
    enqueued = {}
    for item in registered():
        enqueued[item.name] = count = int(item.func(item.batch))
        log.info("refresh_enqueued", refresher=item.name, count=count, batch=item.batch)
    return enqueued
