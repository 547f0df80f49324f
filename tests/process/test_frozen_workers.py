"""A worker frozen (SIGSTOP: a paused VM, a cut network) inside ``ctx.atomic()`` or
inside a heartbeat never keeps its job, the job's resource locks or an operator's
``cancel_job`` waiting longer than two leases plus the reclaim interval (I3), and once
continued, its stale block and completion are refused (I2, I4). Real worker processes.

PostgreSQL only: on SQLite a process frozen inside a transaction holds the database's one
write lock until another worker kills it (test_frozen_sqlite.py; docs/architecture.md,
"Frozen workers").
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from jobs import enqueueing, operations
from jobs.exceptions import StateConflict
from jobs.models import Job, JobLock, Lease, Outcome, State
from tests.process.helpers import assert_engine_invariants, job_summary, wait_for_marker
from tests.support.workers import WorkerPool, WorkerProc, wait_until
from tests.testapp.models import Document, Effect

pytestmark = [pytest.mark.process, pytest.mark.postgres, pytest.mark.timeout(120)]

LEASE = 3.0  # test.freezable's lease
RECLAIM = 1.0  # HOLDFAST_RECLAIM_SECONDS of the test subprocesses
BOUND = 2 * LEASE + RECLAIM
SLACK = 4.0  # process scheduling on a loaded machine

# Freezes the process (every thread: SIGSTOP) right after the lease keeper's first job
# renewal statement returns, i.e. inside engine.heartbeat; only once across the processes
# sharing FREEZE_FLAG.
FREEZE_IN_HEARTBEAT = """
import os, re, signal, threading
from django.core.management import call_command
from django.db.backends import utils

real = utils.CursorWrapper.execute
renewal = re.compile(r"UPDATE\\W+jobs_job\\W+SET\\W+lease_expires_at.*heartbeat_at", re.S)

def execute(self, sql, params=None):
    result = real(self, sql, params)
    if threading.current_thread().name == "lease-keeper" and renewal.search(sql):
        try:
            os.close(os.open(os.environ["FREEZE_FLAG"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return result
        os.kill(os.getpid(), signal.SIGSTOP)
    return result

utils.CursorWrapper.execute = execute
call_command("runworker", "--worker-id", os.environ["WORKER_ID"])
"""


def _holder(job_id: int, procs: list[WorkerProc]) -> tuple[WorkerProc, WorkerProc]:
    """The worker holding the job, and the other one."""
    leased_by = wait_until(
        lambda: Job.objects.filter(pk=job_id).values_list("leased_by", flat=True).first(),
        20,
        message=lambda: job_summary([job_id]),
    )
    holder = next(proc for proc in procs if proc.name == leased_by)
    return holder, next(proc for proc in procs if proc is not holder)


def _frozen(proc: WorkerProc) -> bool:
    return proc._is_stopped()


def _cancel_within(job_id: int, seconds: float, row_locked: bool = False) -> Job | None:
    """``cancel_job`` on the job, from another connection; it must return in time. With
    ``row_locked`` (a frozen fence holds the job row) it may say so (StateConflict: None),
    unless the server ended the frozen session while it waited."""
    outcome: dict[str, object] = {}

    def cancel() -> None:
        try:
            outcome["job"] = operations.cancel(job_id, actor="tester")
        except Exception as exc:
            outcome["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=cancel, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"cancel_job still waiting after {seconds} s"
    if row_locked and isinstance(outcome.get("error"), StateConflict):
        assert time.monotonic() - started < seconds
        return None
    assert "error" not in outcome, outcome
    assert time.monotonic() - started < seconds
    return outcome["job"]  # type: ignore[return-value]


def _check_recovery(
    job_id: int,
    frozen: WorkerProc,
    other: WorkerProc,
    frozen_at: float,
    pool: WorkerPool,
    row_locked: bool = False,
) -> None:
    """Within the bound: the locks of the frozen lease are free and the other worker has
    completed the job; once continued, the frozen worker's writes are all refused."""
    # cancel_job answers at once (a request: the lease is still live; or, while a frozen
    # fence holds the job row, "busy, try again")
    cancelled = _cancel_within(job_id, 5.0, row_locked)
    assert (row_locked and cancelled is None) or (
        cancelled is not None and cancelled.state == State.RUNNING
    )
    # The request was recorded in time. Withdrawn here, so that what follows checks the
    # other worker completing the job: a requested cancel would end it at the reclaim
    # (tests/integration/test_cancel_phases.py covers that).
    Job.objects.filter(pk=job_id).update(cancel_requested=False)

    def locks_freed() -> bool:
        return not JobLock.objects.filter(job_id=job_id, lease_token=1).exists()

    wait_until(
        locks_freed,
        BOUND + SLACK - (time.monotonic() - frozen_at),
        interval=0.1,
        message=lambda: f"locks still held\n{job_summary([job_id])}\n{pool.describe()}",
    )
    wait_until(
        lambda: Job.objects.get(pk=job_id).state in (State.SUCCEEDED, State.CANCELLED),
        max(1.0, BOUND + SLACK - (time.monotonic() - frozen_at)),
        interval=0.1,
        message=lambda: f"not completed in time\n{job_summary([job_id])}\n{pool.describe()}",
    )
    assert _frozen(frozen), "the holder must still be frozen: the others did not wait for it"
    job = Job.objects.get(pk=job_id)
    assert job.leases.get(lease_token=1).outcome == Outcome.LEASE_EXPIRED
    if job.state == State.CANCELLED:
        # The request landed as the server ended the frozen session (the cancel had waited
        # for the row), and the reclaim saw it before the withdrawal above: the job ended
        # as the operator asked, at the reclaim, within the bound all the same.
        assert cancelled is not None and row_locked, job_summary([job_id])
        assert (job.last_error or "").startswith("cancelled on request"), job.last_error
    else:
        assert job.leases.get(lease_token=2).worker_id == other.name

    frozen.cont()
    # Continued, it finishes its sleep and meets the fence: its block and its completion
    # are refused, and it goes on working.
    frozen.wait_for_event("lease_lost", timeout=20)
    wait_until(
        lambda: (
            Lease.objects.get(job_id=job_id, lease_token=1).outcome == Outcome.LEASE_EXPIRED
            and frozen.events("lease_lost", during="job_retry_scheduled")
            + frozen.events("lease_lost", during="job_dead")
            + frozen.events("lease_lost", during="handler")
            + frozen.events("lease_lost", during="job_released")  # its session was ended
            # It heard the (withdrawn) cancel request once continued: its failed attempt
            # would have settled the job cancelled.
            + frozen.events("lease_lost", during="job_cancelled")
        ),
        20,
        message=frozen.describe,
    )
    assert frozen.alive, frozen.describe()
    effects = list(
        Effect.objects.filter(job_id=job_id).order_by("pk").values_list("label", "lease_token")
    )
    job = Job.objects.get(pk=job_id)
    if job.state == State.CANCELLED:  # ended at the reclaim (above): nothing of it committed
        assert effects == [] and Document.objects.get().refreshed == 0, effects
        assert job.lease_token == 1
    else:
        assert effects == [("progress", 2), ("complete", 2)], effects  # exactly one of each
        assert Document.objects.get().refreshed == 1
        assert (job.state, job.lease_token) == (State.SUCCEEDED, 2)
    for proc in (frozen, other):
        proc.terminate()
        assert proc.wait_exit(20) == 0, proc.describe()
    assert_engine_invariants(job_ids=[job_id], context=pool.describe())


def _document() -> Document:
    return Document.objects.create(url="https://example.test/frozen", refresh_after=timezone.now())


def test_a_worker_frozen_inside_ctx_atomic_holds_up_nothing(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """Frozen inside a fenced block that has locked a domain row: the server ends the
    idle session within a lease, the job is reclaimed within lease + reclaim interval and
    completed by the other worker; cancel_job answers at once."""
    procs = [workers.start("w-a"), workers.start("w-b")]
    marker = tmp_path / "attempt-1"
    job = enqueueing.enqueue(
        "test.freezable",
        {
            "document_id": _document().pk,
            "resources": ["frozen:1"],
            "marker": str(marker),
            "pause_in_block": 2 * LEASE,
        },
    )
    frozen, other = _holder(job.pk, procs)
    in_block = Path(f"{marker}.in-block")
    wait_for_marker(in_block, frozen)
    frozen.stop()
    frozen_at = time.monotonic()
    _check_recovery(job.pk, frozen, other, frozen_at, workers)


def test_a_worker_frozen_in_its_own_transaction_around_ctx_atomic_holds_up_nothing(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """The fenced block nested in the handler's own ``transaction.atomic()``: frozen after
    the block, its fence's lock on the job row lasts until the outer commit. The server
    ends that idle session within a lease too, so the job is reclaimed and completed in
    time."""
    procs = [workers.start("w-a"), workers.start("w-b")]
    marker = tmp_path / "attempt-1"
    job = enqueueing.enqueue(
        "test.freezable",
        {
            "document_id": _document().pk,
            "resources": ["frozen:1"],
            "marker": str(marker),
            "pause_after_block": 2 * LEASE,
        },
    )
    frozen, other = _holder(job.pk, procs)
    wait_for_marker(Path(f"{marker}.in-block"), frozen)
    frozen.stop()
    _check_recovery(job.pk, frozen, other, time.monotonic(), workers, row_locked=True)


def test_a_worker_frozen_inside_a_heartbeat_holds_up_nothing(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """Frozen inside engine.heartbeat, just after its renewal statement: the renewal is
    one statement in its own transaction, so nothing stays locked."""
    flag = tmp_path / "frozen-once"
    procs = [
        workers.spawn_python(
            name, FREEZE_IN_HEARTBEAT, env={"WORKER_ID": name, "FREEZE_FLAG": str(flag)}
        )
        for name in ("w-a", "w-b")
    ]
    for proc in procs:
        proc.wait_for_event("worker_started", timeout=30)
    job = enqueueing.enqueue(
        "test.freezable",
        {
            "document_id": _document().pk,
            "resources": ["frozen:1"],
            "pause_before": 2 * LEASE,
        },
    )
    holder, other = _holder(job.pk, procs)
    wait_until(lambda: _frozen(holder), 20, interval=0.02, message=holder.describe)
    holder.stopped = True  # it stopped itself; cont() sends SIGCONT
    _check_recovery(job.pk, holder, other, time.monotonic(), workers)
