"""``manage.py ingest_submissions`` as operators run it: parallel reader processes, one
writer process, killed or blocked at the worst moments (I6, issue 5). Nothing that could
succeed on retry is quarantined; nothing is applied twice; no file is lost."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction

from ingestion.models import Fact, IngestedSubmission, ReconciliationIssue
from tests.support.workers import WorkerPool, parse_events, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


def submission(i: int, lab: str = "lab-1", stamp: str = "2026-11-30T10:00:00Z") -> dict[str, Any]:
    return {
        "schema": "holdfast.submission/v1",
        "lab": lab,
        "submitted_at": stamp,
        "facts": [
            {"entity": "run", "key": f"run-{i}-{j}", "attributes": {"i": i, "j": j}}
            for j in range(3)
        ],
        "log_excerpt": f"log of submission {i}",
    }


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    root = tmp_path / "spool"
    (root / "incoming").mkdir(parents=True)
    return root


def drop(spool: Path, name: str, content: dict[str, Any] | bytes) -> Path:
    data = json.dumps(content).encode() if isinstance(content, dict) else content
    staging = spool / f".{name}.partial"
    staging.write_bytes(data)
    return staging.rename(spool / "incoming" / name)


def fill(spool: Path, count: int = 6) -> dict[str, str]:
    """``count`` good submissions and one poison file; returns name -> sha256."""
    for i in range(count):
        drop(spool, f"s{i}.json", submission(i))
    drop(spool, "poison.json", b"{not json")
    return files(spool, "incoming")


def files(spool: Path, folder: str) -> dict[str, str]:
    directory = spool / folder
    if not directory.exists():
        return {}
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if not p.name.startswith(".")
    }


def ingest(workers: WorkerPool, spool: Path, *args: str, **env: str) -> Any:
    env.setdefault("HOLDFAST_SPOOL_SETTLE_SECONDS", "0")
    return workers.command(
        "ingest_submissions", "--spool", str(spool), "--once", *args, env=env, timeout=40
    )


def assert_nothing_happened(spool: Path, before: dict[str, str]) -> None:
    assert files(spool, "incoming") == before
    assert files(spool, "failed") == {}
    assert not IngestedSubmission.objects.exists()
    assert not Fact.objects.exists()
    assert not ReconciliationIssue.objects.exists()


def assert_applied_once(spool: Path, good: int = 6) -> None:
    assert files(spool, "incoming") == {}
    assert set(files(spool, "failed")) == {"poison.json", "poison.json.reason.json"}
    assert IngestedSubmission.objects.count() == good
    assert Fact.objects.count() == 3 * good
    assert ReconciliationIssue.objects.count() == 1


def one_line_failure(result: Any, *fragments: str) -> None:
    assert result.returncode == 1, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    reason = [line for line in result.stderr.splitlines() if line.startswith("CommandError")]
    assert len(reason) == 1, result.describe()
    for fragment in fragments:
        assert fragment in reason[0], result.describe()


def test_once_applies_and_quarantines_then_exits_0(workers: WorkerPool, spool: Path) -> None:
    fill(spool)
    drop(spool, "copy-of-s0.json", submission(0))
    result = ingest(workers, spool, "--workers", "3", "--json")
    assert result.returncode == 0, result.describe()
    figures = result.json()
    assert figures["applied"] == 6
    assert figures["duplicates"] == 1
    assert figures["quarantined"] == 1
    assert figures["pending"] == 0
    assert_applied_once(spool)
    reason = json.loads((spool / "failed" / "poison.json.reason.json").read_text())
    assert reason["stage"] == "json"


def test_an_empty_spool_exits_0_at_once(workers: WorkerPool, spool: Path) -> None:
    result = ingest(workers, spool, "--workers", "1")
    assert result.returncode == 0, result.describe()
    assert "0 applied" in result.stdout


@contextmanager
def facts_table_locked() -> Iterator[None]:
    """Another session holds a lock the writer needs, until the block ends."""
    if connection.vendor == "postgresql":
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("LOCK TABLE facts IN ACCESS EXCLUSIVE MODE")
            yield
        return
    holder = sqlite3.connect(connection.settings_dict["NAME"], timeout=1, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # SQLite's write lock: the writer waits on it
        yield
        holder.execute("ROLLBACK")
    finally:
        holder.close()


def test_a_file_older_than_the_grace_period_alerts_and_exits_1_leaving_it(
    workers: WorkerPool, spool: Path
) -> None:
    before = fill(spool, 2)
    # A file's age counts from its arrival (ctime), which no test can set back: wait.
    time.sleep(1.5)
    result = ingest(workers, spool, "--grace", "1")
    one_line_failure(result, "overdue", "incoming/", "grace period of 1 s")
    alerts = [e for e in parse_events(result.stderr) if e["event"] == "spool_overdue"]
    assert [e["grace_s"] for e in alerts] == [1.0]
    assert 1.4 < alerts[0]["age_s"] < 30
    assert_nothing_happened(spool, before)  # the old file and the others all stay

    # An operator who has looked drains it with a larger grace (or --grace 0).
    result = ingest(workers, spool, "--grace", "0")
    assert result.returncode == 0, result.describe()
    assert_applied_once(spool, good=2)


def test_a_copied_file_with_an_old_mtime_applies_without_an_alert(
    workers: WorkerPool, spool: Path
) -> None:
    fill(spool, 2)
    for path in (spool / "incoming").iterdir():  # cp -p / rsync -a: two hours old by mtime
        past = time.time() - 7200
        os.utime(path, (past, past))
    result = ingest(workers, spool, "--grace", "3600")
    assert result.returncode == 0, result.describe()
    assert not [e for e in parse_events(result.stderr) if e["event"] == "spool_overdue"]
    assert_applied_once(spool, good=2)


def test_a_blocked_database_leaves_every_file_and_exits_1_after_the_stuck_timeout(
    workers: WorkerPool, spool: Path
) -> None:
    before = fill(spool)
    with facts_table_locked():
        started = time.monotonic()
        result = ingest(workers, spool, "--stuck-after", "2")
        took = time.monotonic() - started
    one_line_failure(
        result,
        "stuck: 7 file(s) pending",
        "every file left in place",
        "the writer has waited",
        "for the database to commit a batch of",
    )
    assert took < 2 + 12, f"{took:.1f} s, start-up included: on time, not after the lock"
    assert_nothing_happened(spool, before)

    result = ingest(workers, spool)  # the lock is gone: everything applies, once
    assert result.returncode == 0, result.describe()
    assert_applied_once(spool)


def test_a_database_error_on_every_flush_is_retried_then_exits_1(
    workers: WorkerPool, spool: Path
) -> None:
    before = fill(spool)
    result = ingest(workers, spool, "--stuck-after", "2", HOLDFAST_SPOOL_FAULT="db_error")
    one_line_failure(result, "stuck", "last error: OperationalError: injected fault")
    flush_failures = [
        event for event in parse_events(result.stderr) if event["event"] == "spool_flush_failed"
    ]
    assert len(flush_failures) >= 3, result.describe()  # retried with backoff
    assert_nothing_happened(spool, before)

    assert ingest(workers, spool).returncode == 0
    assert_applied_once(spool)


def test_writer_killed_mid_flush_acks_nothing_and_the_next_run_applies_once(
    workers: WorkerPool, spool: Path
) -> None:
    before = fill(spool)
    run = workers.spawn(
        "ingester",
        "ingest_submissions",
        "--spool",
        str(spool),
        "--once",
        env={"HOLDFAST_SPOOL_FAULT": "pause_in_flush"},
    )
    paused = run.wait_for_event("spool_fault_paused", timeout=20)
    assert paused["pid"] != run.pid  # the writer is its own process
    os.kill(paused["pid"], signal.SIGKILL)
    assert run.wait_exit(timeout=15) == 1, run.describe()
    assert "the spool writer exited with code -9" in run.stderr()
    assert_nothing_happened(spool, before)

    result = ingest(workers, spool, "--json")
    assert result.returncode == 0, result.describe()
    assert result.json()["applied"] == 6
    assert_applied_once(spool)


def test_a_crash_between_commit_and_unlink_is_finished_by_the_next_scan(
    workers: WorkerPool, spool: Path
) -> None:
    before = fill(spool)
    result = ingest(workers, spool, HOLDFAST_SPOOL_FAULT="exit_after_commit")
    one_line_failure(result, "the spool writer exited with code 70")
    assert files(spool, "incoming") == before  # committed, but no file touched yet
    acks = dict(IngestedSubmission.objects.values_list("hash", "applied_at"))
    assert len(acks) == 6
    assert ReconciliationIssue.objects.count() == 1

    result = ingest(workers, spool, "--json")
    assert result.returncode == 0, result.describe()
    figures = result.json()
    assert (figures["applied"], figures["duplicates"], figures["quarantined"]) == (0, 6, 1)
    assert_applied_once(spool)
    assert dict(IngestedSubmission.objects.values_list("hash", "applied_at")) == acks


def test_watching_applies_new_files_and_stops_cleanly_on_sigterm(
    workers: WorkerPool, spool: Path
) -> None:
    run = workers.spawn("watcher", "ingest_submissions", "--spool", str(spool))
    run.wait_for_event("spool_ingester_started", timeout=20)
    drop(spool, "late.json", submission(1, stamp="2026-11-30T12:00:00Z"))
    wait_until(
        lambda: not (spool / "incoming" / "late.json").exists(),
        15,
        message=lambda: f"late.json was not applied\n{run.describe()}",
    )
    drop(spool, "older.json", submission(1, stamp="2026-11-30T11:00:00Z") | {"lab": "lab-1"})
    wait_until(
        lambda: IngestedSubmission.objects.count() == 2,
        15,
        message=lambda: f"older.json was not applied\n{run.describe()}",
    )
    run.terminate()
    assert run.wait_exit(timeout=10) == 0, run.describe()
    # The older submission was acked, but the newer facts stand.
    assert set(Fact.objects.values_list("submitted_at__hour", flat=True)) == {12}


def test_a_stop_while_the_database_refuses_every_batch_ends_in_time_leaving_the_files(
    workers: WorkerPool, spool: Path
) -> None:
    """SIGTERM while no batch can commit: the writer held its batch until --stuck-after
    (60 s by default), past the unit's 30 s stop timeout, so systemd killed it and no
    `spool_ingester_stopped` line was written. It gives the batch up after half the stuck
    time (at most 10 s); every file stays in incoming/ for the next run (audit)."""
    before = fill(spool)
    run = workers.spawn(
        "watcher",
        "ingest_submissions",
        "--spool",
        str(spool),
        "--stuck-after",
        "10",  # the batch is given up after 5 s, before the stuck rule would end the run
        env={"HOLDFAST_SPOOL_SETTLE_SECONDS": "0", "HOLDFAST_SPOOL_FAULT": "db_error"},
    )
    run.wait_for_event("spool_flush_failed", timeout=20)
    sent = time.monotonic()
    run.terminate()
    assert run.wait_exit(timeout=25) == 0, run.describe()
    assert time.monotonic() - sent < 9, run.describe()
    assert run.events("spool_batch_abandoned"), run.describe()
    assert run.events("spool_ingester_stopped", signal="SIGTERM"), run.describe()
    assert_nothing_happened(spool, before)

    assert ingest(workers, spool).returncode == 0
    assert_applied_once(spool)


def test_the_readers_and_writer_die_with_a_killed_monitor(workers: WorkerPool, spool: Path) -> None:
    """``kill -9`` of the command from a shell (no service manager to kill its group):
    its children must not read and write on, holding connections, under no one."""
    run = workers.spawn("watcher", "ingest_submissions", "--spool", str(spool), "--workers", "2")
    run.wait_for_event("spool_ingester_started", timeout=20)

    def children() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == run.pid:
                    found.append(int(entry.name))
        return found

    kids = wait_until(lambda: len(children()) >= 3 and children(), 10, message=run.describe)
    run.kill()

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return state[state.rindex(")") + 2] != "Z"

    wait_until(
        lambda: not any(alive(pid) for pid in kids),
        10,
        message=lambda: f"still alive: {[pid for pid in kids if alive(pid)]}",
    )


def test_an_incoming_directory_moved_aside_and_made_again_is_followed(
    workers: WorkerPool, spool: Path
) -> None:
    """The readers held the old ``incoming/`` open: each file the monitor found in the new
    one was "gone" in the old one, round and round, until the stuck rule fired."""
    run = workers.spawn(
        "watcher", "ingest_submissions", "--spool", str(spool), "--workers", "1",
        "--stuck-after", "8", env={"HOLDFAST_SPOOL_SETTLE_SECONDS": "0"},
    )  # fmt: skip
    run.wait_for_event("spool_ingester_started", timeout=20)
    drop(spool, "before.json", submission(1))
    wait_until(lambda: IngestedSubmission.objects.count() == 1, 15, message=run.describe)
    (spool / "incoming").rename(spool / "incoming.old")
    (spool / "incoming").mkdir()
    drop(spool, "after.json", submission(2))
    wait_until(
        lambda: IngestedSubmission.objects.count() == 2,
        15,
        message=lambda: f"after.json was not applied\n{run.describe()}",
    )
    assert files(spool, "incoming") == {}
    run.terminate()
    assert run.wait_exit(timeout=10) == 0, run.describe()
