"""The worker process: claim one job at a time (I7), run its handler, settle it.

Two threads, two database connections. The main thread claims (only kinds it has
handlers for), runs the handler and settles; idle, it sleeps until a wake-up, the next
job of its lanes falls due, or ``HOLDFAST_POLL_SECONDS``, whichever comes first. The
*lease keeper* owns the other, *side* connection (``jobs.notify``: to
``HOLDFAST_LISTEN_DATABASE_URL`` when set) and does everything else on it, in one loop
whose first step is always the heartbeat: it renews the current job's lease every third
of its length (fenced: a lost lease is flagged on ``ctx``; ``ctx.heartbeat()`` inside a
transaction asks it too), refreshes the worker's own heartbeat, enforces the shutdown
grace period, ends expired leases of other workers at least every
``HOLDFAST_RECLAIM_SECONDS`` (and prunes the rows of workers gone longer than
``HOLDFAST_WORKER_RETENTION_SECONDS``), runs the scheduler's passes with
``--with-scheduler``, and reads its LISTEN channels (wake-ups, freed locks, cancels) in
between, busy or idle. A reclaim there is bounded (a statement timeout of a quarter of the
shortest lease this worker may hold, a smaller batch after a timeout), and the scheduler's
passes renew between their steps, so neither delays this worker's own renewals past its
lease.

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
import contextvars
import dataclasses
import functools
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
from django.core.exceptions import ImproperlyConfigured
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    connections,
)

from . import engine, handover, notify, options, sql, workers
from . import lanes as lane_config
from .context import JobContext, check_result
from .exceptions import (
    Cancelled,
    InvalidJob,
    LeaseLost,
    PermanentError,
    TransactionLeftOpen,
    UnknownKind,
)
from .log import bound_context, get_logger
from .models import State
from .notify import PollWaker, SideListener
from .registry import HandlerSpec, all_handlers, autodiscover, bind, fits, get_handler
from .retry import DEFAULT_RETRY
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
KEEPER_TICK = 0.25  # seconds: the keeper's longest wait on its LISTEN channels
WORKER_BEAT_SECONDS = 5.0  # the worker row's heartbeat
MIN_RECLAIM_BATCH = 100
MIN_RECLAIM_BUDGET_MS = 200


class GaveUp(Exception):
    """A database step was abandoned because the worker is stopping."""


@dataclasses.dataclass
class _KeeperState:
    """What the lease keeper remembers between passes (times: monotonic)."""

    last_job_beat: tuple[tuple[int, int], float] | None = None  # ((job, lease token), time)
    next_worker_beat: float = 0.0
    next_reclaim: float = 0.0
    reclaim_limit: int = sql.RECLAIM_BATCH
    next_schedule: float = 0.0
    schedule_backoff: float = 0.5
    subscriptions_seen: int = 0  # the listener's LISTENs already caught up on
    next_frozen_check: float = 0.0  # SQLite: the next look for frozen lock holders


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
        self.worker_id = worker_id or workers.default_worker_id()
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
        self._current_since = 0.0  # monotonic: when the current job was claimed
        self._renewals: list[threading.Event] = []  # ctx.heartbeat() asking the keeper
        self._scheduler: SchedulerLoop | None = None
        self._min_lease = float(settings.HOLDFAST_LEASE_SECONDS)
        self.processed = 0
        self._waker: PollWaker = PollWaker()
        self._keeper_stop = threading.Event()
        self._current_lock = threading.Lock()
        self.kinds: list[str] = []  # the kinds this worker has handlers for: all it claims
        self._after_outage = False  # main thread: a database step failed since last check
        self._reclaim_hold = engine.ReclaimHold()  # the lease keeper's, after its outages
        # SQLite: the keeper's looks for a stopped worker holding the write lock (and the
        # registration's, before the keeper starts: a frozen holder would keep it waiting).
        self._frozen_watch = workers.FrozenHolderWatch(float(settings.HOLDFAST_RECLAIM_SECONDS))
        self._pid = os.getpid()  # a handler's forked child must not go on as this worker
        self._signals: tuple[int, ...] = ()  # the signals whose handlers this worker owns
        self._on_signal_handler = self._on_signal  # one bound method: compared by identity

    # --- lifecycle ---------------------------------------------------------------------

    def run(self) -> int:
        self._pid = os.getpid()  # this process's, whoever built the object
        autodiscover()
        self.kinds = engine.served_kinds()
        previous = self._install_signal_handlers()
        structlog.contextvars.bind_contextvars(worker_id=self.worker_id)
        self._waker = PollWaker(self.lanes)
        notify.log_polling(self.poll_seconds)
        # For small installs: the scheduler's passes, run by the lease keeper on its side
        # connection (no thread or connection of their own).
        self._scheduler = SchedulerLoop(self._keeper_stop) if self.with_scheduler else None
        self._min_lease = min(
            [float(settings.HOLDFAST_LEASE_SECONDS)]
            + [float(spec.lease_seconds) for spec in all_handlers() if spec.lease_seconds]
        )
        keeper = threading.Thread(target=self._keep_leases, name="lease-keeper", daemon=True)
        try:
            # A signal while the database is still unreachable stops the worker: it holds
            # nothing yet, so there is nothing to hand back.
            with contextlib.suppress(GaveUp):
                self._with_db_retry(self._register, give_up=lambda: self.stopping)
                keeper.start()
                self._loop()
        finally:
            self._keeper_stop.set()
            self._waker.close()
            if keeper.is_alive():
                keeper.join(timeout=10)
            self._quietly(lambda: workers.worker_stopped(self.worker_id))
            log.info("worker_exiting", processed=self.processed)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return 0

    def _register(self) -> None:
        """Write this worker's row. On SQLite the wait for the write lock is the keeper's
        reclaim budget, and each try first looks for a stopped worker holding it: a
        worker started after another froze inside a transaction would otherwise wait on
        it for ever, its own lease keeper not started yet."""
        if sql.is_postgres():
            workers.register_worker(self.worker_id, self.lanes, self.kinds)
            return
        self._quietly(self._end_frozen_holder)  # a read of /proc/locks when nobody holds it
        with sql.lock_waits_bounded(self._reclaim_budget_ms() / 1000):
            workers.register_worker(self.worker_id, self.lanes, self.kinds)

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
                    self._with_db_retry(self._reclaim_unless_held, give_up=lambda: self.stopping)
                job = self._claim()
                if job is None:
                    return
            if job is not None:
                job = self._run(job)  # settling it claims the next one in the same commit
            elif self.stopping:
                return
            else:
                self._waker.wait(self._idle_wait())

    def _idle_wait(self) -> float:
        """How long to sleep idle: until the next job of this worker's lanes falls due,
        at most ``poll_seconds`` (a few probes of the runnable index: ``sql.next_due_in``)."""
        try:
            due_in = sql.next_due_in(self.lanes, self.poll_seconds)
        except DatabaseError:
            return self.poll_seconds  # the next claim meets it and retries with backoff
        if due_in is None:
            return self.poll_seconds
        return min(self.poll_seconds, max(0.01, due_in + 0.005))

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
        self._signals = (signal.SIGTERM, signal.SIGINT)
        return {signum: signal.signal(signum, self._on_signal_handler) for signum in self._signals}

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
        ctx.renew_elsewhere = self._ask_keeper_to_renew
        with self._current_lock:
            self.current = (job, ctx)
            self._current_since = time.monotonic()
        bound = engine.job_log_context(job, self.worker_id)
        structlog.contextvars.bind_contextvars(**bound)
        following: Claimed | None = None
        try:
            verdict = self._execute(job, ctx)
            if verdict is not None and ctx.progress_pending:
                self._quietly(functools.partial(_flush_progress, ctx))  # throttle's last value
            ctx.settling = True  # from here on a heartbeat may rightly find the job settled
            if ctx.cancel_requested:
                verdict = self._after_cancel_request(verdict)
            following = self._settle(job, verdict)
            return following
        finally:
            with self._current_lock:
                self.current = None
            if following is None:
                structlog.contextvars.unbind_contextvars(*bound)
                structlog.contextvars.bind_contextvars(worker_id=self.worker_id)
            # else the next job's _run binds its identity over these same keys at once:
            # no line is logged in between.
            self.processed += 1

    @staticmethod
    def _after_cancel_request(verdict: engine.Verdict | None) -> engine.Verdict | None:
        """An attempt asked to cancel that did not end ``cancelled``: a success stands (and
        is logged as not honoured); anything else ends the job ``cancelled``, never in a
        further attempt."""
        if verdict is None or verdict.how.state == State.SUCCEEDED:
            # Recorded on the job too: its `settled` event says cancel_requested.
            log.warning("cancel_not_honoured", outcome=verdict.event if verdict else "done")
            return verdict
        if verdict.how.state in (State.QUEUED, State.DEAD):
            return engine.cancelled_on_request(verdict)
        return verdict

    def _execute(self, job: Claimed, ctx: JobContext) -> engine.Verdict | None:
        """Run the handler; return the verdict to write (None: nothing left to write).

        The handler runs in a copy of the worker's context, so what it binds to the log
        context (``structlog.contextvars``) ends with its job instead of following the
        worker into the next one.
        """
        if job.cancel_requested:  # asked while an earlier attempt ran: not run again
            return engine.CANCELLED_BEFORE_RUN
        scope = contextvars.copy_context()
        try:
            spec = get_handler(job.kind)
            try:
                result = scope.run(_call, spec, ctx, job.args)
            except BaseException:
                self._after_handler(raised=True)
                raise
            self._after_handler(raised=False)
            if ctx.completed:
                return None  # committed inside ctx.atomic(complete=True)
            if result is None:
                return engine.SUCCEEDED
            check_result(result)
            return engine.succeeded(result)
        except BaseException as exc:
            # Everything, SystemExit, KeyboardInterrupt and GeneratorExit included: the
            # worker's own shutdown never raises into the handler (SIGTERM and SIGINT set
            # a flag), so whatever arrives here is the handler's.
            return self._verdict_on(job, ctx, exc, scope)

    def _verdict_on(
        self, job: Claimed, ctx: JobContext, exc: BaseException, scope: contextvars.Context
    ) -> engine.Verdict | None:
        """The verdict of an attempt whose handler raised ``exc``."""
        if ctx.completed:  # its ctx.atomic(complete=True) committed: the job succeeded
            log.warning("handler_raised_after_complete", error=_error_line(exc))
            return None
        if isinstance(exc, Cancelled):
            if ctx.cancel_requested:
                return engine.CANCELLED
            return engine.cancelled_by_handler(" ".join(_description(exc).split()))
        if isinstance(exc, LeaseLost):
            log.warning("lease_lost", during="handler")
            # Usually the lease is gone and the fenced settle matches nothing. But
            # LeaseLost can also reach here while this attempt still holds the job: a
            # fenced write refused by the handler's own transaction (ctx.atomic(complete=
            # True) nested in another), or raised by hand. Then the settle lands, and the
            # attempt fails with it, instead of leaving the job running until reclaim.
            return engine.failed(job, self._failure(exc, scope, lease_held=True), _backoff(job))
        failure = self._failure(exc, scope)
        if isinstance(exc, DatabaseError) and sql.fault(exc) is not None:
            return self._interrupted(job, failure)
        return engine.failed(job, failure, _backoff(job))

    @staticmethod
    def _failure(
        exc: BaseException, scope: contextvars.Context, lease_held: bool = False
    ) -> engine.Failure:
        """The attempt's record of ``exc``, with the log context the handler had bound."""
        message = _description(exc)
        if lease_held:  # only stored if the fenced settle lands, i.e. the lease was held
            message = (
                "LeaseLost reached the worker while this attempt still held its lease (a "
                "fenced write refused inside the handler's own transaction, such as "
                f"ctx.atomic(complete=True) nested in another, or raised by hand): {message}"
            )
        return engine.Failure(
            error_class=engine.storable(_class_path(exc)),
            message=engine.storable(message),
            traceback=engine.storable(_handler_traceback(exc)),
            context=engine.storable(scope.run(bound_context)),
            permanent=isinstance(exc, PermanentError | UnknownKind),
        )

    def _after_handler(self, raised: bool) -> None:
        """Undo what a handler may have left behind that must not outlive it.

        - A forked child returning from the handler exits at once: going on, it would
          settle its parent's job and claim others over its parent's connection.
        - A handler that replaced SIGTERM/SIGINT's handler would leave the worker deaf to
          a graceful stop: ours are put back (``signal_handler_replaced``).
        - A database transaction left open is rolled back with its connection closed, and
          the attempt fails (``TransactionLeftOpen``): the settle would otherwise nest
          in it and never commit, holding its locks for ever.
        """
        if os.getpid() != self._pid:
            os._exit(1 if raised else 0)
        for signum in self._signals:
            if signal.getsignal(signum) is not self._on_signal_handler:
                log.warning("signal_handler_replaced", signal=signal.Signals(signum).name)
                signal.signal(signum, self._on_signal_handler)
        refuse_transaction_left_open()

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
        # A thread starts with a context of its own: every keeper line names its worker.
        structlog.contextvars.bind_contextvars(worker_id=self.worker_id)
        notify.use_side_database()  # this thread's connection: the side connection
        listener = SideListener(notify.worker_channels(self.lanes)) if notify.listens() else None
        state = _KeeperState()
        try:
            while not self._keeper_stop.is_set():
                self._keeper_tick(listener, state)
        except BaseException as exc:
            self._keeper_died(exc)
        finally:
            close_old_connections()
            connection.close()

    def _keeper_tick(self, listener: SideListener | None, state: _KeeperState) -> None:
        """One pass of the lease keeper: heartbeats first, then grace, reclaim, the
        scheduler, and the LISTEN channels until the next beat (at most ``KEEPER_TICK``).
        On SQLite, before all of these, the look for a frozen holder of the write lock."""
        if not sql.is_postgres():
            self._sqlite_frozen_holders(state)
        self._beat(state)
        with self._current_lock:
            current = self.current
        if current is not None:
            self._enforce_grace(current[0])
        if time.monotonic() >= state.next_reclaim:
            self._reclaim_pass(state)
            self._beat(state)
        if self._scheduler is not None and time.monotonic() >= state.next_schedule:
            self._schedule_pass(state)
        self._listen(listener, state)

    def _sqlite_frozen_holders(self, state: _KeeperState) -> None:
        """SQLite: the keeper waits for the write lock no longer than its reclaim budget (a
        quarter of its shortest lease), so that a stopped process holding the lock cannot
        keep it from this look: every reclaim interval, a stopped worker of this host
        that holds the lock is killed once its lease expired, or, running no job, once it
        was found so at two looks (``workers.FrozenHolderWatch``). Its job, if any, is
        then reclaimed as a dead worker's."""
        budget = self._reclaim_budget_ms()
        self._quietly(functools.partial(sql.sqlite_busy_timeout, budget))
        now = time.monotonic()
        if now < state.next_frozen_check:
            return
        state.next_frozen_check = now + float(settings.HOLDFAST_RECLAIM_SECONDS)
        self._quietly(self._end_frozen_holder)

    def _end_frozen_holder(self) -> None:
        """SQLite: one look of ``workers.FrozenHolderWatch`` at this database's lock."""
        self._frozen_watch.check()

    def _beat(self, state: _KeeperState) -> None:
        """Renew the current job's lease when due (or asked), and the worker's row."""
        now = time.monotonic()
        with self._current_lock:
            current, since = self.current, self._current_since
            asked, self._renewals = self._renewals, []
        if current is not None:
            job, ctx = current
            attempt = (job.id, job.lease_token)
            if state.last_job_beat is None or state.last_job_beat[0] != attempt:
                state.last_job_beat = (attempt, since)  # the claim renewed it
            if asked or now - state.last_job_beat[1] >= self._beat_interval(job):
                state.last_job_beat = (attempt, now)
                self._quietly(functools.partial(self._renew, ctx))
        for request in asked:
            request.set()
        if now >= state.next_worker_beat:
            state.next_worker_beat = now + WORKER_BEAT_SECONDS
            job_id = current[0].id if current else None
            self._quietly(functools.partial(workers.worker_heartbeat, self.worker_id, job_id))

    @staticmethod
    def _beat_interval(job: Claimed) -> float:
        return min(job.lease_seconds / 3, 5.0)

    def _ask_keeper_to_renew(self, timeout: float) -> bool:
        """For ``ctx.heartbeat()`` inside a transaction: the keeper renews at once, on its
        connection (no third one); returns whether it did within ``timeout``."""
        done = threading.Event()
        with self._current_lock:
            self._renewals.append(done)
        return done.wait(timeout)

    def _listen(self, listener: SideListener | None, state: _KeeperState) -> None:
        """Read the LISTEN channels until the next job beat is due (at most
        ``KEEPER_TICK``): cancels are flagged on ``ctx``, wake-ups wake the main thread
        only while it is idle, and nothing is left unread on the server. First, after a
        new LISTEN, catch up on what was notified before it (``_catch_up``)."""
        if listener is not None:
            self._catch_up(listener, state)
        timeout = KEEPER_TICK
        with self._current_lock:
            current = self.current
        if current is not None and state.last_job_beat is not None:
            due = state.last_job_beat[1] + self._beat_interval(current[0])
            timeout = min(timeout, max(0.0, due - time.monotonic()))
        notes = listener.poll(timeout) if listener is not None else None
        if notes is None:
            self._keeper_stop.wait(timeout)
            return
        cancels = {
            int(note.payload)
            for note in notes
            if note.channel == notify.CANCEL_CHANNEL and note.payload.isdigit()
        }
        with self._current_lock:
            current = self.current
        if current is None:
            if any(note.channel != notify.CANCEL_CHANNEL for note in notes):
                self._waker.wake()
            return
        job, ctx = current
        if job.id in cancels:
            ctx.mark_cancel_requested(via="notify")

    def _catch_up(self, listener: SideListener, state: _KeeperState) -> None:
        """After each LISTEN (the first, which may come after the first claim, or one
        after a reconnect): a notification sent before it took effect is lost, so the
        current job's lease is renewed now (the renewal reads its cancel request) and an
        idle main thread looks for work once more."""
        if listener.ensure() is None or listener.subscriptions == state.subscriptions_seen:
            return
        state.subscriptions_seen = listener.subscriptions
        with self._current_lock:
            current = self.current
        if current is None:
            self._waker.wake()
            return
        job, ctx = current
        state.last_job_beat = ((job.id, job.lease_token), time.monotonic())
        self._quietly(functools.partial(self._renew, ctx))

    def _reclaim_budget_ms(self) -> int:
        """The reclaim's statement timeout on the side connection: a quarter of the
        shortest lease this worker may hold, so a renewal behind it is still on time."""
        shortest = self._min_lease
        with self._current_lock:
            if self.current is not None:
                shortest = min(shortest, self.current[0].lease_seconds)
        budget = int(shortest * 1000 / 4)
        return max(MIN_RECLAIM_BUDGET_MS, min(sql.RECLAIM_STATEMENT_TIMEOUT_MS, budget))

    def _reclaim_pass(self, state: _KeeperState) -> None:
        """End other workers' expired leases, every ``HOLDFAST_RECLAIM_SECONDS`` (at once
        again while a pass fills its batch); a pass that ran out of time halves the batch."""
        every = float(settings.HOLDFAST_RECLAIM_SECONDS)
        if self._reclaim_hold.held():  # just back from an outage (``engine.ReclaimHold``)
            state.next_reclaim = time.monotonic() + min(every, KEEPER_TICK * 4)
            return
        limit = state.reclaim_limit
        try:
            reclaimed = engine.reclaim_expired(limit, timeout_ms=self._reclaim_budget_ms())
        except DatabaseError as exc:
            if _timed_out(exc) and limit > MIN_RECLAIM_BATCH:
                state.reclaim_limit = max(MIN_RECLAIM_BATCH, limit // 2)
                log.warning("reclaim_batch_reduced", batch=state.reclaim_limit)
                state.next_reclaim = time.monotonic() + KEEPER_TICK
                return
            state.next_reclaim = time.monotonic() + every
            self._quietly(functools.partial(_reraise, exc))
            return
        except Exception:
            log.exception("background_step_failed")
            state.next_reclaim = time.monotonic() + every
            return
        if len(reclaimed) >= limit:
            state.next_reclaim = 0.0  # a full batch: more may be waiting
            state.reclaim_limit = min(sql.RECLAIM_BATCH, limit * 2)
            return
        self._quietly(workers.prune_workers)  # rows of long-gone workers
        state.next_reclaim = time.monotonic() + every

    def _schedule_pass(self, state: _KeeperState) -> None:
        """``--with-scheduler``: one scheduler pass, renewing between its steps."""
        assert self._scheduler is not None
        try:
            sleep = self._scheduler.synced_pass(between=lambda: self._beat(state))
            state.schedule_backoff = 0.5
        except DatabaseError as exc:
            if _retryable(exc):  # an outage, or a server refusing writes (a failover)
                self._reclaim_hold.note(exc)
                log.error(
                    "database_unavailable",
                    during="scheduler",
                    error=_one_line(exc),
                    retry_in=state.schedule_backoff,
                )
                connection.close()
            else:
                log.exception("background_step_failed", during="scheduler")
            sleep, state.schedule_backoff = (
                state.schedule_backoff,
                min(state.schedule_backoff * 2, MAX_DB_BACKOFF),
            )
        except ImproperlyConfigured as exc:
            # A schedule declared after start (a provider's row) that cannot be synced: one
            # line, less and less often, while the jobs keep running; the start refused
            # the declarations it could see (``schedules.check_runnable``).
            sleep = state.schedule_backoff
            state.schedule_backoff = min(sleep * 2, MAX_DB_BACKOFF)
            log.error("scheduler_misconfigured", error=_one_line(exc), retry_in=sleep)
        except Exception:
            log.exception("background_step_failed", during="scheduler")
            sleep = state.schedule_backoff
        state.next_schedule = time.monotonic() + sleep

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
        self._quietly(lambda: workers.worker_stopped(self.worker_id))
        sys.stderr.flush()
        os._exit(EXIT_KEEPER_DIED)

    def _reclaim_unless_held(self) -> None:
        """``--burst``'s last reclaim before it leaves, unless just back from an outage
        (``engine.ReclaimHold``)."""
        if not self._reclaim_hold.held():
            engine.reclaim_expired()

    def _renew(self, ctx: JobContext) -> None:
        # Also while the main thread settles: a settle that waits out an outage (backing
        # off up to 30 s) would otherwise let the lease run out under a finished job, and
        # a reclaimer back first would run it again. The renewal is fenced; one that lands
        # after the settle matches nothing and is ignored below.
        if ctx.lease_lost:
            return
        try:
            ctx.heartbeat()
        except LeaseLost:
            if ctx.settling:
                return  # the main thread settled the job while this heartbeat was in flight
            log.warning("lease_lost", during="heartbeat", **engine.job_log_context(ctx.job))
        except DB_ERRORS as exc:
            error = _one_line(exc)
            log.warning("heartbeat_failed", **engine.job_log_context(ctx.job), error=error)
            self._reclaim_hold.note(exc)
            connection.close()

    def _enforce_grace(self, job: Claimed) -> None:
        """After the grace period, give the job back and exit, as if it never started."""
        if self.stop_requested_at is None:
            return
        if time.monotonic() - self.stop_requested_at < self.grace_seconds:
            return
        log.warning(
            "shutdown_grace_expired",
            **engine.job_log_context(job),
            grace_seconds=self.grace_seconds,
        )
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
            log.error("release_failed", **engine.job_log_context(job), error=_one_line(exc))
            held_by_handler = isinstance(exc, OperationalError) and sql.is_lock_wait(exc)
            if held_by_handler and not sql.is_postgres():  # the handler's own transaction
                handover.hand_over_release(job, self.worker_id)
        self._quietly(lambda: workers.worker_stopped(self.worker_id))
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
                self._reclaim_hold.note(exc)
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
            self._reclaim_hold.note(exc)
            connection.close()
        except Exception:
            log.exception("background_step_failed")


def refuse_transaction_left_open() -> None:
    """Raise ``TransactionLeftOpen`` (after rolling the transaction back with its
    connection) if the handler returned inside a database transaction. The Django task
    runner calls it too, before it completes the task in a transaction of its own, which
    would nest in the open one and never commit."""
    if _transaction_left_open():
        log.error("handler_left_transaction_open")
        _discard_connection()
        raise TransactionLeftOpen(
            "the handler returned with a database transaction still open (an atomic "
            "block never exited, autocommit turned off, or a raw BEGIN): it was rolled "
            "back and its connection closed"
        )


def _transaction_left_open() -> bool:
    """Whether the main connection is inside a transaction (worker code runs none across
    a handler call, so any such is the handler's)."""
    db = connections[DEFAULT_DB_ALIAS]  # one look-up: each through the proxy is another
    raw = db.connection
    if raw is None:
        return False
    if db.in_atomic_block or not db.autocommit:
        return True
    if sql.is_postgres():
        from psycopg.pq import TransactionStatus

        # Not UNKNOWN: a connection broken under the handler is a database fault, not this.
        return raw.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR)
    return bool(raw.in_transaction)


def _discard_connection() -> None:
    """Close the main connection whatever state it is in: the database rolls back what
    it held. Django keeps a connection closed inside an atomic block as unusable until
    that block exits, which this one never will: forget it, so the next statement
    connects afresh (``connect()`` resets the transaction state)."""
    connection.close()
    connection.in_atomic_block = False
    connection.connection = None


def _timed_out(exc: BaseException) -> bool:
    """The statement ran past its ``statement_timeout`` (PostgreSQL)."""
    import psycopg

    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    return isinstance(cause, psycopg.errors.QueryCanceled)


def _reraise(exc: BaseException) -> None:
    raise exc


def _flush_progress(ctx: JobContext) -> None:
    with contextlib.suppress(LeaseLost):  # the settle finds that out and logs it
        ctx.flush_progress()


def _retryable(exc: BaseException) -> bool:
    """An engine step that met this is run again after a pause: an outage, a timeout, a
    lost session or prepared statement, a server refusing writes."""
    return sql.unavailable(exc)


def _call(spec: HandlerSpec, ctx: JobContext, args: dict[str, Any]) -> Any:
    """Call the handler with the job's args, checked against its signature first: a
    mismatch is a ``PermanentError`` and the handler never runs (``enqueue()`` refuses
    such args, but a job of an earlier release of the handler may still hold them)."""
    if fits(spec.func, args):
        return spec.func(ctx, **args)
    try:
        bound = bind(spec, ctx, args)
    except InvalidJob as exc:
        raise PermanentError(str(exc)) from None
    return spec.func(*bound.args, **bound.kwargs)


def _handler_traceback(exc: BaseException) -> str:
    """The traceback from the handler's frame down, without the worker's own frame."""
    tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb.tb_next if tb else None))


def _backoff(job: Claimed) -> float:
    """The handler's delay before the next attempt. A backoff that raises, or answers with
    no delay the engine can store (NaN, negative, not a number), is the handler's bug and
    must cost neither the worker nor the job (I3): the default policy's delay, logged."""
    try:
        backoff = get_handler(job.kind).backoff
    except UnknownKind:
        return 0.0
    try:
        answer = backoff(job.attempt)
    except Exception as exc:
        log.error("backoff_failed", error=_error_line(exc))
        return DEFAULT_RETRY.delay(job.attempt)
    delay = options.retry_delay(answer)
    if delay is None:
        log.error("backoff_failed", error=f"the backoff returned {answer!r}, not seconds >= 0")
        return DEFAULT_RETRY.delay(job.attempt)
    return delay


def _class_path(exc: BaseException) -> str:
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _description(exc: BaseException) -> str:
    """``str(exc)``, or what stopped it: an exception's ``__str__`` is the handler's code
    too, and may raise."""
    try:
        return str(exc)
    except BaseException as failure:
        try:
            detail = f": {failure}"
        except BaseException:
            detail = ""
        return f"(its str() raised {_class_path(failure)}{detail})"


def _error_line(exc: BaseException) -> str:
    """``module.Class: message`` on one line, for a log field."""
    return f"{_class_path(exc)}: {_one_line(exc)}"


def _one_line(exc: BaseException) -> str:
    return " ".join(_description(exc).split()) or type(exc).__name__
