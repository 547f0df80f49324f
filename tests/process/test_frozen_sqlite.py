"""SQLite: a worker frozen (SIGSTOP, a debugger) inside ``ctx.atomic()`` holds the
database's one write lock, and there is no server to end its transaction. The other
workers' lease keepers find it (stopped, of this host, its lease expired, the lock not
free) and kill it, so it never keeps its job or its locks waiting longer than two leases
plus the reclaim interval (I3); its uncommitted block is rolled back, and the job is
completed once (I4). Real worker processes. PostgreSQL ends such a session itself:
test_frozen_workers.py.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from django.utils import timezone

from jobs import enqueueing
from jobs import workers as workers_module
from jobs.models import Job, JobLock, Outcome, State
from tests.conftest import on_postgres
from tests.process.helpers import assert_engine_invariants, job_summary, wait_for_marker
from tests.support.workers import WorkerPool, WorkerProc, wait_until
from tests.testapp.models import Document, Effect

pytestmark = [
    pytest.mark.process,
    pytest.mark.timeout(120),
    pytest.mark.skipif(on_postgres(), reason="SQLite only: PostgreSQL ends a frozen session"),
]

LEASE = 3.0  # test.freezable's lease
RECLAIM = 1.0  # HOLDFAST_RECLAIM_SECONDS of the test subprocesses
BOUND = 2 * LEASE + RECLAIM
SLACK = 4.0  # process scheduling on a loaded machine


def _wait_succeeded(job_ids: list[int]) -> None:
    wait_until(
        lambda: all(
            state == State.SUCCEEDED
            for state in Job.objects.filter(pk__in=job_ids).values_list("state", flat=True)
        ),
        20,
        message=lambda: job_summary(job_ids),
    )


def _freezable(marker: Path, **pause: float) -> Job:
    """A ``test.freezable`` job whose first attempt writes ``marker`` and pauses so."""
    document = Document.objects.create(url="https://example.test/f", refresh_after=timezone.now())
    args = {"document_id": document.pk, "resources": ["frozen:1"], "marker": str(marker)}
    return enqueueing.enqueue("test.freezable", {**args, **pause})


def test_a_worker_frozen_inside_ctx_atomic_is_killed_and_its_job_completed_once(
    workers: WorkerPool, tmp_path: Path
) -> None:
    procs = [workers.start("w-a"), workers.start("w-b"), workers.start("w-c")]
    marker = tmp_path / "attempt-1"
    job = _freezable(marker, pause_in_block=2 * LEASE)
    wait_for_marker(Path(f"{marker}.in-block"), procs[0])
    holder_name = Job.objects.get(pk=job.pk).leased_by
    frozen = next(proc for proc in procs if proc.name == holder_name)
    others = [proc for proc in procs if proc is not frozen]
    frozen.stop()
    frozen_at = time.monotonic()
    others_jobs = [enqueueing.enqueue("test.echo", {"n": n}).pk for n in range(5)]

    wait_until(
        lambda: Job.objects.get(pk=job.pk).state == State.SUCCEEDED,
        BOUND + SLACK,
        interval=0.1,
        message=lambda: f"not completed in time\n{job_summary([job.pk])}\n{workers.describe()}",
    )
    assert time.monotonic() - frozen_at <= BOUND + SLACK
    assert frozen.wait_exit(10) == -signal.SIGKILL, frozen.describe()
    killers = [
        entry
        for proc in others
        for entry in proc.events("frozen_worker_killed")
        if entry["worker_id"] == frozen.name
    ]
    assert len(killers) >= 1 and killers[0]["job_ids"] == [job.pk], killers
    assert killers[0]["level"] == "error"

    done = Job.objects.get(pk=job.pk)
    assert done.lease_token == 2 and done.leased_by is None
    assert done.leases.get(lease_token=1).outcome == Outcome.LEASE_EXPIRED
    assert done.leases.get(lease_token=2).worker_id in {proc.name for proc in others}
    assert not JobLock.objects.filter(job_id=job.pk).exists()
    # The frozen block never committed: each effect once, by the second attempt.
    effects = list(
        Effect.objects.filter(job_id=job.pk).order_by("pk").values_list("label", "lease_token")
    )
    assert effects == [("progress", 2), ("complete", 2)], effects
    assert Document.objects.get().refreshed == 1
    _wait_succeeded(others_jobs)
    for proc in others:
        assert proc.alive, proc.describe()
        proc.terminate()
        assert proc.wait_exit(20) == 0, proc.describe()
    assert_engine_invariants(job_ids=[job.pk, *others_jobs], context=workers.describe())


def _frozen_in_block_until_killed(worker: WorkerProc, tmp_path: Path, killer: WorkerProc) -> Job:
    """A ``test.freezable`` job that ``worker`` claims; stopped inside its block, the worker
    must be killed (SIGKILL) within the bound. Returns the job."""
    marker = tmp_path / "attempt-1"
    job = _freezable(marker, pause_in_block=4 * LEASE)
    wait_for_marker(Path(f"{marker}.in-block"), worker)
    worker.stop()
    frozen_at = time.monotonic()
    assert worker.wait_exit(BOUND + SLACK) == -signal.SIGKILL, killer.describe()
    assert time.monotonic() - frozen_at <= BOUND + SLACK
    return job


def test_with_one_worker_the_scheduler_kills_it_when_it_freezes_inside_ctx_atomic(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """Only the other workers' lease keepers looked for a frozen holder: with one worker
    and ``runscheduler`` (a small install's shape) the job stayed running, every write was
    refused and a cancel answered "locked" until someone killed the worker by hand
    (helper-27 #1). The scheduler looks too, as every reclaimer should."""
    scheduler = workers.spawn("scheduler", "runscheduler")
    scheduler.wait_for_event("scheduler_started", timeout=20)
    worker = workers.start("w-only")
    job = _frozen_in_block_until_killed(worker, tmp_path, scheduler)
    [killed] = scheduler.events("frozen_worker_killed")
    assert (killed["worker_id"], killed["job_ids"]) == ("w-only", [job.pk])
    enqueueing.enqueue("test.echo")  # writes go through again
    again = workers.start("w-next")
    _wait_succeeded([job.pk])
    assert Job.objects.get(pk=job.pk).leases.get(lease_token=1).outcome == Outcome.LEASE_EXPIRED
    assert again.alive and scheduler.alive, workers.describe()


def test_a_frozen_holder_is_killed_in_time_by_a_worker_whose_own_heartbeats_it_blocks(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """The healthy worker is running a job (2 s lease) when the other freezes holding the
    lock: its heartbeats meet "database is locked", and each closed its connection. The
    next step of that lease-keeper pass opened a new one with the settings' 20 s wait, so
    it looked for the frozen holder every 20 s: killed after about a minute, and the
    healthy job's lease ran out meanwhile (dead, with one attempt allowed)."""
    healthy = workers.start("w-healthy")
    busy = enqueueing.enqueue("test.effect", {"sleep": 3 * LEASE}, max_attempts=1)
    wait_until(lambda: Job.objects.get(pk=busy.pk).state == State.RUNNING, 10)
    frozen = workers.start("w-frozen")
    job = _frozen_in_block_until_killed(frozen, tmp_path, healthy)
    assert healthy.events("heartbeat_failed"), "the healthy worker never met the held lock"
    _wait_succeeded([busy.pk, job.pk])
    done = Job.objects.get(pk=busy.pk)
    assert (done.attempts, done.lease_token) == (1, 1), job_summary([busy.pk])
    assert healthy.alive, healthy.describe()


def test_a_stopped_worker_holding_no_lock_is_left_alone(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """Stopped between transactions (in its handler, outside any block): the lock is
    free, the job is reclaimed as usual, and the process is not killed."""
    procs = [workers.start("w-a"), workers.start("w-b")]
    marker = tmp_path / "attempt-1"
    job = _freezable(marker, pause_before=2 * LEASE)
    wait_for_marker(marker, procs[0])
    frozen = next(proc for proc in procs if proc.name == Job.objects.get(pk=job.pk).leased_by)
    frozen.stop()
    wait_until(
        lambda: Job.objects.get(pk=job.pk).state == State.SUCCEEDED,
        BOUND + SLACK,
        interval=0.1,
        message=lambda: f"not completed in time\n{job_summary([job.pk])}\n{workers.describe()}",
    )
    assert frozen.alive and frozen._is_stopped()
    assert not any(proc.events("frozen_worker_killed") for proc in procs)
    assert workers_of_this_host_stopped(frozen.pid)
    frozen.cont()


def workers_of_this_host_stopped(pid: int) -> bool:
    state = workers_module.process_state(pid)
    return state is not None and state[0] in ("T", "t")


def test_a_stopped_worker_is_not_killed_for_a_lock_another_process_holds(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """Stopped outside any transaction while another, healthy process holds the write
    lock past the stopped worker's lease (a big enqueue_many, the ingester's commit):
    the kernel names that process as the holder, so the stopped worker is left alone."""
    import sqlite3

    from django.db import connection

    procs = [workers.start("w-a"), workers.start("w-b")]
    marker = tmp_path / "attempt-1"
    job = _freezable(marker, pause_before=4 * LEASE)
    wait_for_marker(marker, procs[0])
    frozen = next(proc for proc in procs if proc.name == Job.objects.get(pk=job.pk).leased_by)
    frozen.stop()
    holder = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None, timeout=5)
    try:
        holder.execute("BEGIN IMMEDIATE")
        assert workers_module.write_lock_holder(connection.settings_dict["NAME"]) > 0
        time.sleep(LEASE + 3 * RECLAIM)  # its lease expires; the others look three times
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    assert frozen.alive and frozen._is_stopped()
    assert not any(proc.events("frozen_worker_killed") for proc in procs)
    frozen.cont()


# A worker stopped inside its own claim transaction while it runs no job: its lease keeper
# thread is stopped with it, and the patched claim leaves the empty queue's BEGIN
# IMMEDIATE open when it stops, holding the write lock.
FREEZE_IN_IDLE_CLAIM = """
import os, signal
from pathlib import Path
from django.core.management import call_command
from jobs import sql

marker = Path({marker!r})
original = sql._sqlite_statements

def statements(run, params, lane_filter, *, settle, claim):
    result = original(run, params, lane_filter, settle=settle, claim=claim)
    if claim and not settle and result[1] is None and not marker.exists():
        marker.write_text("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)  # inside BEGIN IMMEDIATE, before COMMIT
    return result

sql._sqlite_statements = statements
call_command("runworker", "--worker-id", "w-idle")
"""


def _freeze_idle_worker(workers: WorkerPool, tmp_path: Path) -> WorkerProc:
    marker = tmp_path / "idle-frozen"
    idle = workers.spawn_python("w-idle", FREEZE_IN_IDLE_CLAIM.format(marker=str(marker)))
    wait_for_marker(marker, idle)
    wait_until(idle._is_stopped, 10, message=idle.describe)
    idle.stopped = True  # the pool continues it at teardown if it still lives
    return idle


def _killed(procs: list[WorkerProc], name: str) -> list[dict[str, object]]:
    return [
        e for proc in procs for e in proc.events("frozen_worker_killed") if e["worker_id"] == name
    ]


def test_an_idle_worker_frozen_inside_its_claim_is_killed(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """No job, so no lease to expire: the others' keepers find it stopped with the lock at
    two looks a reclaim interval apart, and kill it; the queue goes on."""
    procs = [workers.start("w-a"), workers.start("w-b")]
    idle = _freeze_idle_worker(workers, tmp_path)
    frozen_at = time.monotonic()
    assert idle.wait_exit(2 * RECLAIM + 2 * LEASE + SLACK) == -signal.SIGKILL, idle.describe()
    assert time.monotonic() - frozen_at <= 2 * RECLAIM + 2 * LEASE + SLACK
    killers = _killed(procs, "w-idle")
    assert killers and killers[0]["job_ids"] == [] and killers[0]["level"] == "error", killers
    jobs = [enqueueing.enqueue("test.echo", {"n": n}).pk for n in range(3)]
    _wait_succeeded(jobs)
    for proc in procs:
        assert proc.alive, proc.describe()


def test_a_worker_started_after_another_froze_holding_the_lock_kills_it(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """The only other worker is the frozen one, so no lease keeper runs: the new worker's
    registration, which waits on the lock, looks for the holder itself."""
    idle = _freeze_idle_worker(workers, tmp_path)
    late = workers.start("w-late", wait_started=False)
    late.wait_for_event("worker_started", timeout=4 * LEASE + SLACK)
    assert idle.wait_exit(10) == -signal.SIGKILL, idle.describe()
    assert _killed([late], "w-idle"), late.describe()
    job = enqueueing.enqueue("test.echo", {"n": 1})
    wait_until(
        lambda: Job.objects.get(pk=job.pk).state == State.SUCCEEDED,
        20,
        message=lambda: job_summary([job.pk]) + late.describe(),
    )


def test_a_stopped_process_that_is_not_a_worker_is_left_alone(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """A stopped shell holding the lock is not a worker of this database: nobody kills it
    (an operator's process is the operator's to end)."""
    marker = tmp_path / "shell-frozen"
    code = (
        "import os, signal, sqlite3\nfrom pathlib import Path\nfrom django.db import connection\n"
        "held = sqlite3.connect(connection.settings_dict['NAME'], isolation_level=None)\n"
        "held.execute('BEGIN IMMEDIATE')\n"
        f"Path({str(marker)!r}).write_text('x')\nos.kill(os.getpid(), signal.SIGSTOP)\n"
    )
    shell = workers.spawn_python("shell", code)
    wait_for_marker(marker, shell)
    wait_until(shell._is_stopped, 10, message=shell.describe)
    shell.stopped = True
    procs = [workers.start("w-a", wait_started=False)]
    time.sleep(3 * RECLAIM + 2 * LEASE)
    assert shell.alive and shell._is_stopped()
    assert not _killed(procs, "shell")
    shell.kill()


# Stands in for a scheduler or ingester stopped inside its transaction: named as one
# (``manage.py runscheduler``), it takes the write lock, says so, and stops itself.
FROZEN_SERVICE = """
import os, signal, sqlite3
from pathlib import Path

db = sqlite3.connect({database!r}, isolation_level=None, timeout=5)
db.execute("BEGIN IMMEDIATE")
Path({marker!r}).write_text("holding")
os.kill(os.getpid(), signal.SIGSTOP)
"""


def _stopped_holding_the_lock(workers: WorkerPool, tmp_path: Path, command: str) -> WorkerProc:
    """``manage.py COMMAND`` as ``FROZEN_SERVICE``: stopped, holding the write lock."""
    from django.db import connection

    marker = tmp_path / "holding"
    script = tmp_path / "manage.py"
    script.write_text(
        FROZEN_SERVICE.format(database=connection.settings_dict["NAME"], marker=str(marker))
    )
    proc = WorkerProc(command, [sys.executable, str(script), command], workers.env, tmp_path)
    workers.procs.append(proc)
    wait_for_marker(marker, proc)
    wait_until(proc._is_stopped, 10, message=proc.describe)
    proc.stopped = True
    return proc


@pytest.mark.parametrize("command", ["runscheduler", "ingest_submissions"])
def test_a_scheduler_or_ingester_frozen_with_the_lock_is_killed_by_a_worker(
    workers: WorkerPool, tmp_path: Path, command: str
) -> None:
    """Only workers (with a row) were killed: a frozen ``runscheduler`` or ingester held
    every write of the installation for as long as it stayed stopped (helper-27 #2). Their
    transactions are crash-safe (I5, I6), so a worker kills them as it kills a worker."""
    watcher = workers.start("w-watch")
    service = _stopped_holding_the_lock(workers, tmp_path, command)
    assert service.wait_exit(4 * RECLAIM + SLACK) == -signal.SIGKILL, watcher.describe()
    [killed] = _killed([watcher], f"{command} (pid {service.pid})")
    assert killed["job_ids"] == [] and "for " in str(killed["reason"])
    job = enqueueing.enqueue("test.echo")
    _wait_succeeded([job.pk])


def test_a_stopped_process_that_is_no_holdfast_service_is_left_alone(
    workers: WorkerPool, tmp_path: Path
) -> None:
    watcher = workers.start("w-watch")
    shell = _stopped_holding_the_lock(workers, tmp_path, "shell")
    time.sleep(4 * RECLAIM)
    assert shell.alive and not _killed([watcher], f"shell (pid {shell.pid})")
    shell.kill()
