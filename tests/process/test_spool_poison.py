"""Poison never stalls good data, through ``manage.py ingest_submissions`` (issue 13): the
same pipeline as the job handler's drain (tests/integration/test_spool_poison.py), with its
readers and writer in processes, stopped by signals and blocked by locks."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ingestion.models import Fact, IngestedSubmission, ReconciliationIssue
from tests.process.test_spool_crash import (
    drop,
    facts_table_locked,
    files,
    ingest,
    submission,
)
from tests.support.workers import WorkerPool, parse_events, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    root = tmp_path / "spool"
    (root / "incoming").mkdir(parents=True)
    return root


def raw(attributes: str, submitted_at: str = "2026-11-30T10:00:00Z") -> bytes:
    return (
        '{"schema": "holdfast.submission/v1", "lab": "lab-1", "submitted_at": '
        f'"{submitted_at}", "facts": [{{"entity": "run", "key": "raw", '
        f'"attributes": {attributes}}}]}}'
    ).encode()


def test_poison_of_every_kind_among_good_files_then_exit_0(
    workers: WorkerPool, spool: Path, tmp_path: Path
) -> None:
    incoming = spool / "incoming"
    for i in range(8):
        drop(spool, f"good-{i}.json", submission(i))
    drop(spool, "year-0.json", raw("{}", submitted_at="0001-01-01T00:00:00+01:00"))
    drop(spool, "deep.json", raw('{"a": ' + "[" * 5000 + "]" * 5000 + "}"))
    drop(spool, "deeper.json", raw('{"a": ' + "[" * 20000 + "]" * 20000 + "}"))
    with (incoming / "sparse.json").open("wb") as handle:
        handle.truncate(8 * 1024**3)
    os.mkfifo(tmp_path / "pipe")
    (incoming / "to-fifo.json").symlink_to(tmp_path / "pipe")
    os.mkfifo(incoming / "fifo.json")

    started = time.monotonic()
    result = ingest(workers, spool, "--workers", "2", "--json", "--stuck-after", "20")
    assert result.returncode == 0, result.describe()
    assert time.monotonic() - started < 30
    figures = result.json()
    assert (figures["applied"], figures["quarantined"], figures["pending"]) == (8, 6, 0)
    assert files(spool, "incoming") == {}
    quarantined = {"year-0", "deep", "deeper", "sparse", "to-fifo", "fifo"}
    assert set(os.listdir(spool / "failed")) == {
        f"{name}.json{suffix}" for name in quarantined for suffix in ("", ".reason.json")
    }
    assert ReconciliationIssue.objects.count() == 6
    assert IngestedSubmission.objects.count() == 8 and Fact.objects.count() == 24


def test_large_files_apply_in_byte_bounded_batches_and_bounded_memory(
    workers: WorkerPool, spool: Path
) -> None:
    """70 files of ~1.9 MB: batches of at most 16 MiB (the setting), none of them whole."""
    pad = "p" * 95_000
    for i in range(70):
        doc = submission(i)
        doc["facts"] = [
            {"entity": "run", "key": f"run-{i}-{j}", "attributes": {"pad": pad, "j": j}}
            for j in range(20)
        ]
        drop(spool, f"big-{i:02}.json", doc)
    size = sum(p.stat().st_size for p in (spool / "incoming").iterdir())
    assert size > 120 * 1024 * 1024
    code = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:])\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(f'PEAK_KIB={peak}', file=sys.stderr)\n"
        "sys.exit(done.returncode)\n"
    )
    argv = [sys.executable, "-c", code, sys.executable, "manage.py", "ingest_submissions"]
    result = workers._run(  # the pool's runner, with its environment
        [*argv, "--spool", str(spool), "--once", "--workers", "2", "--json"],
        {
            "HOLDFAST_SPOOL_MAX_BATCH_BYTES": str(16 * 1024 * 1024),
            "HOLDFAST_SPOOL_SETTLE_SECONDS": "0",
        },
        80,
    )
    assert result.returncode == 0, result.describe()
    assert result.json()["applied"] == 70
    assert IngestedSubmission.objects.count() == 70
    batches = [e for e in parse_events(result.stderr) if e["event"] == "spool_batch_applied"]
    assert len(batches) >= 8, batches
    assert all(e["bytes"] <= 16 * 1024 * 1024 for e in batches), batches
    peak_kib = int(result.stderr.rsplit("PEAK_KIB=", 1)[1].split()[0])
    assert peak_kib < 400 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB for {size >> 20} MiB"


def test_sigterm_to_the_process_group_stops_cleanly_with_exit_0(
    workers: WorkerPool, spool: Path
) -> None:
    run = workers.spawn(
        "watcher",
        "ingest_submissions",
        "--spool",
        str(spool),
        "--workers",
        "2",
        env={"HOLDFAST_SPOOL_SETTLE_SECONDS": "0"},
    )
    run.wait_for_event("spool_ingester_started", timeout=20)
    for i in range(5):
        drop(spool, f"s{i}.json", submission(i))
    wait_until(
        lambda: IngestedSubmission.objects.count() == 5,
        20,
        message=lambda: run.describe(),
    )
    os.killpg(run.pid, signal.SIGTERM)  # what systemd sends: the whole group
    assert run.wait_exit(timeout=20) == 0, run.describe()
    assert "Traceback" not in run.stderr(), run.describe()
    assert files(spool, "incoming") == {}


def test_the_stuck_exit_fires_after_sigterm_while_the_writer_is_blocked(
    workers: WorkerPool, spool: Path
) -> None:
    run = workers.spawn(
        "watcher",
        "ingest_submissions",
        "--spool",
        str(spool),
        "--stuck-after",
        "3",
        env={"HOLDFAST_SPOOL_SETTLE_SECONDS": "0"},
    )
    run.wait_for_event("spool_ingester_started", timeout=20)
    with facts_table_locked():
        for i in range(3):
            drop(spool, f"s{i}.json", submission(i))
        time.sleep(1.0)  # the writer is now waiting on the lock, mid-flush
        os.killpg(run.pid, signal.SIGTERM)
        stopped = time.monotonic()
        code = run.wait_exit(timeout=25)
        took = time.monotonic() - stopped
    assert code == 1, run.describe()
    assert took < 3 + 8, f"stopped after {took:.1f} s\n{run.describe()}"
    assert "stuck" in run.stderr()
    assert set(files(spool, "incoming")) == {"s0.json", "s1.json", "s2.json"}
    assert not IngestedSubmission.objects.exists()
