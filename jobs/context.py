"""The ``ctx`` a handler receives: the job's identity and its fenced ways to write."""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction

from . import engine, sql
from .enqueueing import unstorable
from .exceptions import Cancelled, LeaseLost, PermanentError
from .log import get_logger
from .sql import Claimed

log = get_logger("jobs.context")

PROGRESS_INTERVAL = 1.0  # seconds: at most one progress write per job and second
PROGRESS_NOTE_LENGTH = 1000  # characters of a progress note kept; the rest is cut off
SIDE_HEARTBEAT_TIMEOUT = 10.0  # seconds ctx.heartbeat() waits for a renewal on its own


class JobContext:
    """What a handler knows about its job, and how it writes under the lease.

    ``ctx.atomic()`` is ``transaction.atomic()`` plus a fence. It checks the lease when
    it opens (LeaseLost at once if it is gone) and, as the transaction's last statement,
    updates the job row iff the job is still ``running`` under this lease token, so what
    the block wrote commits only while the lease holds (I2): a stale block rolls back.
    ``ctx.atomic(complete=True, result=...)`` marks the job succeeded as that last
    statement instead (I4). No lock on the job row is held while the block's code runs, so
    a worker frozen inside it never holds up reclaim, cancel or heartbeats; on PostgreSQL
    the server also ends its session after one lease idle in the transaction (also when
    the block is nested in the handler's own transaction, which holds the fence's lock).
    """

    Cancelled = Cancelled

    def __init__(self, job: Claimed, worker_id: str, own_connection: bool = False) -> None:
        self.job = job
        self.worker_id = worker_id
        # Run by a worker (its rows committed): a heartbeat inside a transaction may use a
        # connection of its own. Built by hand (tests), it stays on the caller's.
        self.own_connection = own_connection
        # Set by a worker: asks its lease keeper to renew now, on the keeper's connection
        # (returns whether it did in time), so a heartbeat inside a transaction opens none.
        self.renew_elsewhere: Callable[[float], bool] | None = None
        self.completed = False
        self.settling = False  # set by the worker once the handler has returned
        self.result: Any = None
        self._pending_progress: tuple[int, int | None, str] | None = None
        self._progress_written_at = -math.inf
        # Flags the lease keeper sets from its thread and the handler's reads: a plain
        # attribute is set and read whole (nothing waits on them; an Event per flag per
        # job was a measurable part of a no-op job's cost).
        self._lease_lost = False
        # Asked while an earlier attempt ran, and not honoured: set from the start.
        self._cancel_requested = bool(job.cancel_requested)

    job_id = property(lambda self: self.job.id)
    kind = property(lambda self: self.job.kind)
    lane = property(lambda self: self.job.lane)
    attempt = property(lambda self: self.job.attempt)
    max_attempts = property(lambda self: self.job.max_attempts)
    lease_token = property(lambda self: self.job.lease_token)
    args = property(lambda self: dict(self.job.args))

    @property
    def lease_lost(self) -> bool:
        """True once a heartbeat found the lease gone: nothing committed now can land."""
        return self._lease_lost

    @property
    def cancel_requested(self) -> bool:
        """True once an operator asked to cancel this job; stop at a safe point."""
        return self._cancel_requested

    @property
    def progress_pending(self) -> bool:
        """A progress value the throttle holds back, not written yet."""
        return self._pending_progress is not None

    def mark_lease_lost(self) -> None:
        self._lease_lost = True

    def mark_cancel_requested(self, via: str) -> None:
        """Flag the operator's cancel request, logged once (``cancel_request_heard``)
        whoever heard it first: ``via`` ``notify`` (the keeper's LISTEN) or ``renewal``
        (a lease renewal read it: the keeper's, or the handler's ``ctx.heartbeat()``)."""
        if not self._cancel_requested:
            self._cancel_requested = True
            log.info("cancel_request_heard", job_id=self.job_id, via=via)

    @contextmanager
    def atomic(self, complete: bool = False, result: Any = None) -> Iterator[None]:
        """A transaction whose writes commit only while this attempt holds the lease."""
        if self.completed:
            raise RuntimeError(f"job {self.job_id} already completed in an earlier ctx.atomic()")
        if complete:
            check_result(result)  # before the block's effects: none is written for nothing
        written = None
        # The server ends a session idle in this transaction after one lease: set in the
        # outermost block, and in a worker in every block, since a block nested in the
        # handler's own transaction leaves its fence's lock on the job row until that
        # outer transaction ends. (Built by hand, e.g. in a test's transaction, only the
        # outermost block sets it: the caller's transaction is not the job's.)
        idle_timeout = self.own_connection or not connection.in_atomic_block
        # In a worker, a block nested in the handler's own transaction commits only with
        # it: the progress it writes stays pending until then (written again before the
        # settle if that transaction rolls back), so the last value is never lost.
        inside_handlers = self.own_connection and connection.in_atomic_block
        try:
            with transaction.atomic():
                engine.check_lease(self.job, idle_timeout=idle_timeout)
                yield
                # The fence is the block's last statement, so it and the commit serialize
                # with any reclaim or settle of the job row (see engine.fence). A held-back
                # progress write is guarded by state and lease token too, so it is a fence.
                written = self._write_pending_progress()
                if written is not None and inside_handlers:
                    self._pending_progress = written
                    transaction.on_commit(functools.partial(self._progress_committed, written))
                if complete:
                    engine.complete(self.job, result)
                    # Only once it commits: inside a handler's own outer transaction that
                    # later rolls back, the job is not complete and the worker settles it.
                    transaction.on_commit(lambda: self._mark_completed(result))
                elif written is None:
                    engine.fence(self.job_id, self.lease_token, self.job.lease_seconds)
        except LeaseLost:
            self.mark_lease_lost()
            raise
        except BaseException:
            if written is not None and self._pending_progress is None:
                self._pending_progress = written  # rolled back with the block: keep it
            raise

    def _progress_committed(self, written: tuple[int, int | None, str]) -> None:
        if self._pending_progress is written:  # no newer value came meanwhile
            self._pending_progress = None

    def _mark_completed(self, result: Any) -> None:
        self.completed = True
        self.result = result

    def heartbeat(self) -> None:
        """Renew the lease now (the worker also does this in the background).

        Inside a transaction (``ctx.atomic()``, or the handler's own) on PostgreSQL, in a
        worker, the renewal runs on a connection of its own: it commits at once, holds no
        lock in the handler's transaction and leaves its settings alone. Otherwise it is
        the bare fenced statement, in the caller's transaction, which it never changes the
        settings of. (SQLite has one writer at a time, so there it joins the transaction.)
        Once the job has completed there is no lease to renew, and it does nothing: DESIGN's
        own example heartbeats after its ``complete=True`` block.
        """
        if self.completed:
            return
        try:
            if self.own_connection and connection.in_atomic_block and sql.is_postgres():
                cancel_requested = self._heartbeat_elsewhere()
            else:
                cancel_requested = engine.heartbeat(self.job)
            if cancel_requested:
                self.mark_cancel_requested(via="renewal")
        except LeaseLost:
            self.mark_lease_lost()
            raise

    def _heartbeat_elsewhere(self) -> bool:
        if self.renew_elsewhere is not None:
            if not self.renew_elsewhere(SIDE_HEARTBEAT_TIMEOUT):
                return False  # not renewed now; the lease keeper renews it in the background
            if self.lease_lost:
                raise LeaseLost(
                    f"job {self.job_id} is no longer running under lease {self.lease_token}"
                )
            return self.cancel_requested
        outcome: dict[str, Any] = {}

        def renew() -> None:
            try:
                outcome["cancel"] = engine.heartbeat(self.job)
            except BaseException as exc:  # handed to the caller's thread
                outcome["error"] = exc
            finally:
                connection.close()

        side = threading.Thread(target=renew, name="ctx-heartbeat", daemon=True)
        side.start()
        side.join(SIDE_HEARTBEAT_TIMEOUT)
        if side.is_alive() or ("error" in outcome and not isinstance(outcome["error"], LeaseLost)):
            return False  # not renewed now; the lease keeper renews it in the background
        if "error" in outcome:
            raise outcome["error"]
        return bool(outcome["cancel"])

    def progress(self, done: int, total: int | None = None, note: str = "") -> None:
        """Record progress on the job, fenced like every other write.

        Throttled to one write (and one event row and log line) per
        ``PROGRESS_INTERVAL`` seconds; the latest value in between is kept and written by
        the next write that happens: a later ``progress()``, the next ``ctx.atomic()``
        block (inside its transaction, so ``complete=True`` commits it with the result), or
        the worker before it settles the attempt. The last value is never lost.
        """
        if self.lease_lost:
            raise LeaseLost(
                f"job {self.job_id} is no longer running under lease {self.lease_token}"
            )
        if problem := progress_problem(done, total, note):
            # Refused here, where the bug is: held back, it failed the next fenced block,
            # ``complete=True`` included, with a raw database error (helper-29 #2).
            raise ValueError(f"ctx.progress(): {problem}")
        self._pending_progress = (done, total, note[:PROGRESS_NOTE_LENGTH])
        if time.monotonic() - self._progress_written_at >= PROGRESS_INTERVAL:
            self.flush_progress()

    def flush_progress(self) -> None:
        """Write the progress held back by the throttle, if any (fenced)."""
        if self._pending_progress is not None and not self.completed:
            with self.atomic():
                pass  # atomic() writes the pending progress inside its transaction

    def _write_pending_progress(self) -> tuple[int, int | None, str] | None:
        """At the end of a fenced block: write the held-back progress (guarded: LeaseLost
        if the lease is gone); returns what it wrote (the block puts it back if it rolls
        back)."""
        pending = self._pending_progress
        if pending is None:
            return None
        done, total, note = pending
        engine.record_progress(self.job, done, total, note)
        self._pending_progress = None
        self._progress_written_at = time.monotonic()
        return pending


def progress_problem(done: Any, total: Any, note: Any) -> str | None:
    """What keeps a progress report from being stored (as JSON, in both databases)."""
    for name, value in (("done", done), ("total", total)):
        if value is None and name == "total":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name} must be a number, not {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} must be a finite number, not {value!r}"
    if not isinstance(note, str):
        return f"note must be a string, not {type(note).__name__}"
    if problem := unstorable(note):
        return f"note must not {problem}"
    return None


def check_result(result: Any) -> None:
    """A job's result is stored as JSON (strict: no NaN or Infinity, which the database's
    JSON refuses; no NUL or unpaired surrogate, which PostgreSQL refuses): anything else is
    the handler's bug, so a ``PermanentError`` (dead at once, with this reason, on both
    databases), never a retry that fails the same way ten times, nor a refused settle."""
    try:
        text = json.dumps(result, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise PermanentError(f"the handler's result is not JSON: {exc}") from None
    if ("\\u0000" in text or "\\ud" in text) and (problem := unstorable(result)):
        raise PermanentError(f"the handler's result cannot be stored: its strings {problem}")
