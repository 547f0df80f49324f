"""The worker process: claim one job at a time (I7), run its handler, settle it.

Three threads share the work, each with its own database connection. The main thread
claims (only kinds it has handlers for), runs the handler and settles. The *lease
keeper* renews the current job's lease every third of its length (fenced: a lost lease
is flagged on ``ctx``), refreshes the worker's own heartbeat, hears cancel requests and
enforces the shutdown grace period. The *reclaimer* ends expired leases of other workers
at least every ``HOLDFAST_RECLAIM_SECONDS`` (and prunes the rows of workers gone longer
than ``HOLDFAST_WORKER_RETENTION_SECONDS``), on its own connection and timing, so a big
reclaim never delays this worker's own renewals.

A handler cannot kill its worker: anything it raises (``SystemExit`` and
``KeyboardInterrupt`` included) is a failed attempt. If the lease keeper itself dies, the
worker gives back what it holds (uncharged) and exits non-zero (``EXIT_KEEPER_DIED``) for
its supervisor to restart it.

A database outage never kills the worker: every database step is retried with backoff
capped at 30 s, and a job whose settlement could not be written is settled when the
database returns (or, if its lease ran out meanwhile, left to the reclaimer). A database
fault is never the job's failure: a handler that met one (a restart, a failover, a
prepared statement a migration invalidated; ``sql.fault``) gives its job back uncharged,
and a claim the database refuses is retried with backoff, never fatal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TypeVar

import structlog
from django.conf import settings
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
)

from . import engine, sql
from . import lanes as lane_config
from .context import JobContext
from .exceptions import Cancelled, LeaseLost, PermanentError, UnknownKind
from .log import bound_context, get_logger
from .notify import (
    CancelListener,
    PollWaker,
    cancel_listener_for_database,
    waker_for_database,
)
from .registry import HandlerSpec, autodiscover, get_handler
from .scheduler import SchedulerLoop
from .sql import Claimed

log = get_logger("jobs.worker")

T = TypeVar("T")
DB_ERRORS = (OperationalError, InterfaceError)
MAX_DB_BACKOFF = 30.0
INTERRUPTED_RETRY_SECONDS = 1.0  # a job given back after a database fault runs again then
RELEASE_LOCK_WAIT = 2.0  # seconds the shutdown release may wait for the job row
EXIT_KEEPER_DIED = 70  # EX_SOFTWARE: the lease keeper thread died; restart the worker
KEEPER_DEATH_RELEASE_SECONDS = 10.0  # how long a dying keeper tries to give jobs back


class GaveUp(Exception):
    """A database step was abandoned because the worker is stopping."""


@dataclasses.dataclass
class _KeeperState:
    """What the lease keeper remembers between passes."""

    last_job_beat: tuple[int, float] | None = None  # (lease id, monotonic time)
    next_worker_beat: float = 0.0


class WorkerProcess:
    def __init__(
        self,
        worker_id: str | None = None,
        lanes: Sequence[str] | None = None,
        burst: bool = False,
        poll_seconds: float | None = None,
        grace_seconds: float | None = None,
        with_scheduler: bool = False,
    ) -> None:
        self.worker_id = worker_id or engine.default_worker_id()
        self.lanes = list(lanes) if lanes else None
        self.limits = lane_config.running_limits(self.lanes)  # lane -> max_running
        self.burst = burst
        self.with_scheduler = with_scheduler
        self.poll_seconds = float(
            settings.HOLDFAST_POLL_SECONDS if poll_seconds is None else poll_seconds
        )
        self.grace_seconds = float(
            settings.HOLDFAST_SHUTDOWN_GRACE_SECONDS if grace_seconds is None else grace_seconds
        )
        self.stop_requested_at: float | None = None
        self.current: tuple[Claimed, JobContext] | None = None
        self.processed = 0
        self._waker: PollWaker = PollWaker()
        self._keeper_stop = threading.Event()
        self._current_lock = threading.Lock()
        self.kinds: list[str] = []  # the kinds this worker has handlers for: all it claims
        self._after_outage = False  # main thread: a database step failed since last check

    # --- lifecycle ---------------------------------------------------------------------

    def run(self) -> int:
        autodiscover()
        self.kinds = engine.served_kinds()
        previous = self._install_signal_handlers()
        structlog.contextvars.bind_contextvars(worker_id=self.worker_id)
        self._waker = waker_for_database()
        keeper = threading.Thread(target=self._keep_leases, name="lease-keeper", daemon=True)
        reclaimer = threading.Thread(target=self._reclaim_loop, name="reclaimer", daemon=True)
        # For small installs: the scheduler's loop in a thread of its own (own connection).
        schedules = threading.Thread(
            target=SchedulerLoop(self._keeper_stop).run, name="scheduler", daemon=True
        )
        try:
            # A signal while the database is still unreachable stops the worker: it holds
            # nothing yet, so there is nothing to hand back.
            with contextlib.suppress(GaveUp):
                self._with_db_retry(
                    lambda: engine.register_worker(self.worker_id, self.lanes, self.kinds),
                    give_up=lambda: self.stopping,
                )
                keeper.start()
                reclaimer.start()
                if self.with_scheduler:
                    schedules.start()
                self._loop()
        finally:
            self._keeper_stop.set()
            self._waker.close()
            for thread in (keeper, reclaimer, schedules):
                if thread.is_alive():
                    thread.join(timeout=10)
            self._quietly(lambda: engine.worker_stopped(self.worker_id))
            log.info("worker_exiting", processed=self.processed)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return 0

    @property
    def stopping(self) -> bool:
        return self.stop_requested_at is not None

    def _loop(self) -> None:
        job: Claimed | None = None
        while True:
            if job is None:
                job = self._claim()
            if job is None and self.burst and not self.stopping:
                # Before leaving, recover what dead workers left behind and look once more.
                with contextlib.suppress(GaveUp):
                    self._with_db_retry(engine.reclaim_expired, give_up=lambda: self.stopping)
                job = self._claim()
                if job is None:
                    return
            if job is not None:
                job = self._run(job)  # settling it claims the next one in the same commit
            elif self.stopping:
                return
            else:
                self._waker.wait(self.poll_seconds)

    def _claim(self) -> Claimed | None:
        if self.stopping:
            return None
        try:

            def step() -> Claimed | None:
                self._release_orphans(keep=None)
                return engine.claim(self.worker_id, self.lanes, self.limits, self.kinds)

            return self._with_db_retry(
                step,
                give_up=lambda: self.stopping,
                refusals_too=True,  # a claim the database refuses is retried, not fatal
            )
        except GaveUp:
            return None

    def _install_signal_handlers(self) -> dict[int, Any]:
        """SIGTERM/SIGINT stop the worker gracefully; returns the handlers they replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {
            signum: signal.signal(signum, self._on_signal)
            for signum in (signal.SIGTERM, signal.SIGINT)
        }

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            log.warning("worker_killed", signal=name)
            os._exit(128 + signum)
        self.stop_requested_at = time.monotonic()
        log.info("worker_stopping", signal=name, grace_seconds=self.grace_seconds)
        self._waker.wake()

    # --- one job -----------------------------------------------------------------------

    def _run(self, job: Claimed) -> Claimed | None:
        """Run ``job``, settle it, and return the next job claimed in that same commit."""
        ctx = JobContext(job, self.worker_id, own_connection=True)
        with self._current_lock:
            self.current = (job, ctx)
        bound = engine.job_log_context(job, self.worker_id)
        structlog.contextvars.bind_contextvars(**bound)
        try:
            verdict = self._execute(job, ctx)
            if verdict is not None:
                self._quietly(functools.partial(_flush_progress, ctx))  # throttle's last value
            ctx.settling = True  # from here on a heartbeat may rightly find the job settled
            if ctx.cancel_requested and verdict is not engine.CANCELLED:
                # Recorded on the job too: its `settled` event says cancel_requested.
                log.warning("cancel_not_honoured", outcome=verdict.event if verdict else "done")
            return self._settle(job, verdict)
        finally:
            with self._current_lock:
                self.current = None
            structlog.contextvars.unbind_contextvars(*bound)
            structlog.contextvars.bind_contextvars(worker_id=self.worker_id)
            self.processed += 1

    def _execute(self, job: Claimed, ctx: JobContext) -> engine.Verdict | None:
        """Run the handler; return the verdict to write (None: nothing left to write)."""
        try:
            spec = get_handler(job.kind)
            bound = _bind(spec, ctx, job.args)
            result = spec.func(*bound.args, **bound.kwargs)
            if ctx.completed:
                return None  # committed inside ctx.atomic(complete=True)
            _check_json(result)
            return engine.succeeded(result)
        except LeaseLost:
            log.warning("lease_lost", during="handler")
            return None
        except Cancelled:
            return engine.CANCELLED
        except BaseException as exc:
            # Everything, SystemExit, KeyboardInterrupt and GeneratorExit included: the
            # worker's own shutdown never raises into the handler (SIGTERM and SIGINT set
            # a flag), so whatever arrives here is the handler's, and a failed attempt.
            failure = engine.Failure(
                error_class=_class_path(exc),
                message=str(exc),
                traceback=_handler_traceback(exc),
                context=bound_context(),
                permanent=isinstance(exc, PermanentError | UnknownKind),
            )
            if isinstance(exc, DatabaseError) and sql.fault(exc) is not None:
                return self._interrupted(job, failure)
            return engine.failed(job, failure, _backoff(job))

    def _interrupted(self, job: Claimed, failure: engine.Failure) -> engine.Verdict:
        """The handler met a database fault, not a failure of its job: give it back."""
        log.warning("job_interrupted", error=f"{failure.error_class}: {failure.message}")
        connection.close()  # a fresh session: reconnected, statements prepared anew
        return engine.interrupted(job, failure, INTERRUPTED_RETRY_SECONDS)

    def _settle(self, job: Claimed, verdict: engine.Verdict | None) -> Claimed | None:
        """Write the verdict and claim the next job (unless stopping) in one commit.

        A database outage is waited out: the statement is retried until it lands. If the
        lease ran out meanwhile and the job was reclaimed, the fenced settle matches
        nothing (logged as ``lease_lost``): that job belongs to another attempt now.
        """

        def write(verdict: engine.Verdict | None) -> Claimed | None:
            def step() -> Claimed | None:
                self._release_orphans(keep=job.id)
                return engine.settle_and_claim(
                    job,
                    verdict,
                    None if self.stopping else self.worker_id,
                    self.lanes,
                    self.limits,
                    self.kinds,
                )

            return self._with_db_retry(step)

        try:
            return write(verdict)
        except DatabaseError as exc:  # not an outage: the database refuses this outcome
            log.error("settlement_refused", job_id=job.id, error=_one_line(exc))
            failure = engine.Failure(
                error_class=_class_path(exc),
                message=f"the attempt's outcome could not be stored: {_one_line(exc)}",
                traceback="",
                context=bound_context(),
                permanent=True,
            )
            return write(engine.failed(job, failure, 0.0))

    # --- the lease keeper thread -------------------------------------------------------

    def _keep_leases(self) -> None:
        listener = cancel_listener_for_database()
        state = _KeeperState()
        try:
            while not self._keeper_stop.is_set():
                self._keeper_tick(listener, state)
        except BaseException as exc:
            self._keeper_died(exc)
        finally:
            if listener is not None:
                listener.close()
            close_old_connections()
            connection.close()

    def _keeper_tick(self, listener: CancelListener | None, state: _KeeperState) -> None:
        """One pass of the lease keeper: hear cancels, renew, heartbeat, enforce grace."""
        cancels = listener.poll(0.25) if listener else set()
        if listener is None:
            self._keeper_stop.wait(0.25)
        now = time.monotonic()
        with self._current_lock:
            current = self.current
        if current is not None:
            job, ctx = current
            if job.id in cancels and not ctx.cancel_requested:
                log.info("cancel_request_heard", job_id=job.id)
                ctx.mark_cancel_requested()
            interval = min(job.lease_seconds / 3, 5.0)
            if state.last_job_beat is None or state.last_job_beat[0] != job.lease_id:
                state.last_job_beat = (job.lease_id, now)
            elif now - state.last_job_beat[1] >= interval:
                state.last_job_beat = (job.lease_id, now)
                self._quietly(functools.partial(self._renew, ctx))
            self._enforce_grace(job)
        if now >= state.next_worker_beat:
            state.next_worker_beat = now + 5
            job_id = current[0].id if current else None
            self._quietly(functools.partial(engine.worker_heartbeat, self.worker_id, job_id))

    def _keeper_died(self, exc: BaseException) -> None:
        """The lease keeper failed: nothing renews leases any more. Stop taking work, give
        back (uncharged) whatever this worker holds, and exit non-zero at once, so that a
        supervisor restarts a healthy worker instead of this one holding jobs that expire
        under it."""
        log.critical(
            "lease_keeper_died",
            error_class=_class_path(exc),
            error=_one_line(exc),
            traceback="".join(traceback.format_exception(exc)),
        )
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
        deadline = time.monotonic() + KEEPER_DEATH_RELEASE_SECONDS
        while time.monotonic() < deadline:
            try:
                connection.close()
                released = engine.release_orphans(self.worker_id)
                log.warning("jobs_released_by_dying_keeper", job_ids=released)
                break
            except Exception as error:
                log.error("release_failed", error=_one_line(error))
                time.sleep(0.5)
        self._quietly(lambda: engine.worker_stopped(self.worker_id))
        sys.stderr.flush()
        os._exit(EXIT_KEEPER_DIED)

    def _reclaim_loop(self) -> None:
        """End other workers' expired leases, every ``HOLDFAST_RECLAIM_SECONDS`` (at once
        again while a pass fills its batch), on this thread's own connection."""
        every = float(settings.HOLDFAST_RECLAIM_SECONDS)
        try:
            while not self._keeper_stop.is_set():
                reclaimed: list[int] = []
                self._quietly(lambda: reclaimed.extend(engine.reclaim_expired()))  # noqa: B023
                if len(reclaimed) < sql.RECLAIM_BATCH:
                    self._quietly(engine.prune_workers)  # rows of long-gone workers
                    self._keeper_stop.wait(every)
        finally:
            close_old_connections()
            connection.close()

    def _renew(self, ctx: JobContext) -> None:
        if ctx.lease_lost or ctx.settling:
            return
        try:
            ctx.heartbeat()
        except LeaseLost:
            if ctx.settling:
                return  # the main thread settled the job while this heartbeat was in flight
            log.warning(
                "lease_lost", during="heartbeat", job_id=ctx.job_id, lease_token=ctx.lease_token
            )
        except DB_ERRORS as exc:
            log.warning("heartbeat_failed", job_id=ctx.job_id, error=_one_line(exc))
            connection.close()

    def _enforce_grace(self, job: Claimed) -> None:
        """After the grace period, give the job back and exit, as if it never started."""
        if self.stop_requested_at is None:
            return
        if time.monotonic() - self.stop_requested_at < self.grace_seconds:
            return
        log.warning("shutdown_grace_expired", job_id=job.id, grace_seconds=self.grace_seconds)
        try:
            # The handler may hold the job row (a long ctx.atomic block): wait a little,
            # never forever; if the release cannot be written, the lease expires instead.
            with sql.lock_waits_bounded(RELEASE_LOCK_WAIT):
                engine.release(job)
        except LeaseLost:
            with self._current_lock:
                moved_on = self.current is None or self.current[0] is not job
            if moved_on:
                return  # settled meanwhile, maybe with the next job claimed: look again
        except DatabaseError as exc:
            log.error("release_failed", job_id=job.id, error=_one_line(exc))
        self._quietly(lambda: engine.worker_stopped(self.worker_id))
        sys.stderr.flush()
        os._exit(0)

    # --- database outages --------------------------------------------------------------

    def _with_db_retry(
        self,
        step: Callable[[], T],
        give_up: Callable[[], bool] | None = None,
        refusals_too: bool = False,
    ) -> T:
        """Run ``step``; while the database is unreachable, log and retry with backoff.

        With ``refusals_too`` every database error is retried so, not only outages.
        """
        delay = 0.5
        while True:
            try:
                return step()
            except DatabaseError as exc:
                if not (refusals_too or _retryable(exc)):
                    raise
                event = "database_unavailable" if _retryable(exc) else "database_refused"
                log.error(event, error=_one_line(exc), retry_in=delay)
                connection.close()
                self._after_outage = True
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline:
                    if give_up is not None and give_up():
                        raise GaveUp() from exc
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, MAX_DB_BACKOFF)

    def _release_orphans(self, keep: int | None) -> None:
        """After an outage, before the next claim: give back (uncharged) any job leased to
        this worker that it is not running (``keep``), e.g. a claim whose commit landed
        but whose acknowledgement was lost with the connection."""
        if self._after_outage:
            engine.release_orphans(self.worker_id, keep)
            self._after_outage = False

    def _quietly(self, step: Callable[[], Any]) -> None:
        """Run a background step; log its failure instead of letting it end the thread."""
        try:
            step()
        except DatabaseError as exc:
            if not _retryable(exc):
                log.exception("background_step_failed")
                return
            log.warning("database_unavailable", error=_one_line(exc), during="background")
            connection.close()
        except Exception:
            log.exception("background_step_failed")


def _flush_progress(ctx: JobContext) -> None:
    with contextlib.suppress(LeaseLost):  # the settle finds that out and logs it
        ctx.flush_progress()


def _retryable(exc: BaseException) -> bool:
    """An engine step that met this is run again after a pause: an outage, a timeout, a
    lost session or prepared statement."""
    return isinstance(exc, DB_ERRORS) or sql.fault(exc) is not None


@functools.cache
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)  # about 50 µs: once per handler, not once per job


def _bind(spec: HandlerSpec, ctx: JobContext, args: dict[str, Any]) -> inspect.BoundArguments:
    """Check the job's args against the handler's signature before running it."""
    try:
        return _signature(spec.func).bind(ctx, **args)
    except TypeError as exc:
        raise PermanentError(f"args do not match handler {spec.kind!r}: {exc}") from None


def _handler_traceback(exc: BaseException) -> str:
    """The traceback from the handler's frame down, without the worker's own frame."""
    tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb.tb_next if tb else None))


def _check_json(result: Any) -> None:
    try:
        json.dumps(result)
    except (TypeError, ValueError) as exc:
        raise PermanentError(f"the handler returned a value that is not JSON: {exc}") from None


def _backoff(job: Claimed) -> float:
    try:
        return float(get_handler(job.kind).backoff(job.attempt))
    except UnknownKind:
        return 0.0


def _class_path(exc: BaseException) -> str:
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
