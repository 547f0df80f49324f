"""Retention: finished jobs (with their attempts, events and lock rows, which the database
deletes with them) are deleted a set time after they finished.

``prune_jobs`` runs it once by hand; every scheduler (``runscheduler``, ``runworker
--with-scheduler``) runs it every ``HOLDFAST_RETENTION_SECONDS`` with the kept times of
``HOLDFAST_RETAIN_SUCCEEDED``, ``HOLDFAST_RETAIN_CANCELLED`` and ``HOLDFAST_RETAIN_DEAD``.
Deletes go in batches, each its own short transaction, oldest first; queued and running
jobs are never touched. The metrics' counters (``jobs_outcomecount``) are not job rows:
pruning never lowers them; each batch takes its jobs off the finished jobs' counts
(``jobs_jobcount``) in its own transaction.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models.functions import Now

from . import durations, sql
from .log import get_logger
from .models import FINISHED_STATES, Job, State

log = get_logger("jobs.retention")

BATCH = 5000
SCHEDULED_BATCHES = 20  # per state and scheduler pass: a pass never holds the loop long


RETAIN_SETTINGS = {
    State.SUCCEEDED: "HOLDFAST_RETAIN_SUCCEEDED",
    State.CANCELLED: "HOLDFAST_RETAIN_CANCELLED",
    State.DEAD: "HOLDFAST_RETAIN_DEAD",
}


def configured() -> dict[str, timedelta]:
    """The kept time of each finished state from the settings; a state set to ``off`` is
    kept forever (absent here)."""
    kept = {state: kept_for(name) for state, name in RETAIN_SETTINGS.items()}
    return {state.value: after for state, after in kept.items() if after is not None}


def kept_for(name: str) -> timedelta | None:
    """The retention setting ``name``: a timedelta above 0 and at most a century, or None
    (kept for ever). Anything else is ImproperlyConfigured naming it: given in a settings
    module rather than the environment, it is not checked on reading, and a wrong value
    either failed every retention pass (an int, a string: the table then grows for ever)
    or deleted what had just finished (0, negative)."""
    value = getattr(settings, name)
    if value is None:
        return None
    if not isinstance(value, timedelta) or not timedelta(0) < value <= durations.MAXIMUM:
        raise ImproperlyConfigured(
            f"{name} must be a timedelta above 0 and at most 36500 days, or None to keep "
            f"for ever; got {value!r}"
        )
    return value


def check_settings() -> None:
    """Every retention setting, the registered pruners' included; ImproperlyConfigured
    for the first that is wrong. Run where a scheduler starts, and by ``manage.py
    check``."""
    configured()
    for setting in _pruner_settings.values():
        kept_for(setting)


def prune(
    rules: Mapping[str, timedelta],
    *,
    batch: int = BATCH,
    max_batches: int | None = None,
    dry_run: bool = False,
    between: Callable[[], None] | None = None,
    tally: dict[str, int] | None = None,
) -> dict[str, int]:
    """Delete the jobs of each state in ``rules`` that finished longer ago than its time
    (database clock); returns how many per state (with ``dry_run``: how many would go).
    ``between`` runs after each batch (a worker's lease keeper renews there); ``tally``,
    if given, is the dict returned, filled batch by batch (a caller interrupted midway
    still knows what went)."""
    found: dict[str, int] = {} if tally is None else tally
    for state, older_than in rules.items():
        if state not in FINISHED_STATES:
            raise ValueError(f"only finished jobs are pruned, not {state!r} ones")
        old = Job.objects.filter(state=state, finished_at__lt=Now() - older_than)
        if dry_run:
            found[state] = old.count()
            continue
        found[state] = 0
        batches = 0
        while max_batches is None or batches < max_batches:
            with signals_held():  # the commit and its count: one step for an interrupt
                with transaction.atomic():
                    # SKIP LOCKED (PostgreSQL): two schedulers pruning at once split the rows.
                    rows = list(
                        old.select_for_update(skip_locked=True)
                        .order_by("finished_at")
                        .values_list("lane", "pk")[:batch]
                    )
                    if not rows:
                        break
                    by_lane: dict[str, list[int]] = defaultdict(list)
                    for lane, pk in rows:
                        by_lane[lane].append(pk)
                    gone: dict[tuple[str, str], int] = {}
                    for lane, ids in by_lane.items():
                        _, deleted = Job.objects.filter(pk__in=ids, state=state).delete()
                        gone[(lane, state)] = -deleted.get(Job._meta.label, 0)
                    sql.count_jobs(gone)  # the finished jobs' counts, in the same transaction
                found[state] -= sum(gone.values())
            batches += 1
            if between is not None:
                between()
    return found


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends: a batch's commit and its count in the
    tally are one step. A ``prune_jobs`` stopped between them said 5,000 jobs were pruned
    where 10,000 were.

    Their handlers are swapped, for the block, for one that notes the signal, which is
    raised again once the block is done. Masking the signal in this thread alone was not
    enough: the kernel hands a process's signal to any thread not blocking it, and
    Python then runs the handler in the main thread at once, inside the block (seen in CI,
    with a thread of an earlier test still alive). Outside the main thread there is
    nothing to hold: Python runs signal handlers only there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def note(signum: int, frame: object) -> None:
        caught.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in caught:
            signal.raise_signal(signum)


#: ``func(batch) -> deleted``: one batch of an app's own expired rows, deleted in its own
#: transaction; 0 when none is left. Registered with :func:`pruner`.
Pruner = Callable[[int], int]
_pruners: dict[str, Pruner] = {}
_pruner_settings: dict[str, str] = {}


def pruner(name: str, setting: str | None = None) -> Callable[[Pruner], Pruner]:
    """Register ``func`` as the pruner called ``name``: every scheduler's retention pass
    runs it, in batches as the jobs' own, so an app's history (resolved reconciliation
    issues, say) keeps a bounded size without a job of its own. ``setting``: the name of
    its retention setting, checked as the jobs' own (:func:`kept_for`, which the pruner
    reads it with)."""

    def register(func: Pruner) -> Pruner:
        _pruners[name] = func
        if setting is not None:
            _pruner_settings[name] = setting
        return func

    return register


def prune_registered(
    *, batch: int = BATCH, max_batches: int, between: Callable[[], None] | None = None
) -> dict[str, int]:
    """Run each registered pruner until it deletes nothing or ``max_batches``; returns the
    rows deleted per pruner."""
    found: dict[str, int] = {}
    for name in sorted(_pruners):
        found[name] = 0
        for _ in range(max_batches):
            with signals_held():
                deleted = _pruners[name](batch)
                found[name] += deleted
            if between is not None:
                between()
            if deleted < batch:
                break
    return found


class Retention:
    """The scheduler's retention pass, run at most every ``HOLDFAST_RETENTION_SECONDS``
    (sooner while a pass left rows behind)."""

    def __init__(self) -> None:
        self.next_at = 0.0

    def run_if_due(self, now: float, between: Callable[[], None] | None = None) -> None:
        if now < self.next_at:
            return
        rules = configured()
        deleted = prune(rules, max_batches=SCHEDULED_BATCHES, between=between) if rules else {}
        others = prune_registered(max_batches=SCHEDULED_BATCHES, between=between)
        left_behind = any(
            n >= SCHEDULED_BATCHES * BATCH for n in (*deleted.values(), *others.values())
        )
        self.next_at = now + (0.0 if left_behind else float(settings.HOLDFAST_RETENTION_SECONDS))
        if any(deleted.values()):
            log.info(
                "retention_pruned",
                deleted=deleted,
                kept_s={state: after.total_seconds() for state, after in rules.items()},
            )
        for name, count in others.items():
            if count:
                log.info("retention_pruned", pruner=name, deleted=count)
