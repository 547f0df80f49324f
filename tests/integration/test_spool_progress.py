"""What an operator sees while ``ingest_submissions`` runs: one self-rewriting line on a
terminal (throttled, erased at the end), ``ingest_progress`` log events otherwise."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ingestion.ingester import ProgressEvents, ProgressLine, Rate, progress_for, render
from tests.support.workers import MANAGE, REPO, WorkerPool, parse_events

FIGURES = {
    "seen": 12,
    "applied": 9,
    "duplicates": 1,
    "quarantined": 1,
    "pending": 3,
    "elapsed_s": 2.5,
    "files_per_s": 4.4,
    "rate_files_per_s": 5.5,
}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_line_names_every_figure() -> None:
    assert render(FIGURES) == (
        "ingest: 12 seen, 9 applied, 1 quarantined, 1 duplicates, 3 pending, 5.5 files/s (2 s)"
    )


def test_the_line_rewrites_itself_at_most_four_times_a_second_and_is_erased() -> None:
    written: list[str] = []
    clock = Clock()
    line = ProgressLine(written.append, interval=0.25, clock=clock)
    line.update(FIGURES)
    clock.now += 0.1
    line.update({**FIGURES, "applied": 10})  # too soon: not drawn
    clock.now += 0.2
    line.update({**FIGURES, "applied": 11})
    line.finish(FIGURES)
    assert written == [
        f"\r{render(FIGURES)}\x1b[K\r",
        f"\r{render({**FIGURES, 'applied': 11})}\x1b[K\r",
        "\r\x1b[K",
    ]
    assert all("\n" not in text for text in written)


def test_a_line_never_drawn_is_not_erased() -> None:
    written: list[str] = []
    ProgressLine(written.append).finish(FIGURES)
    assert written == []


def test_without_a_terminal_progress_is_periodic_events_and_a_final_summary() -> None:
    clock = Clock()
    events = ProgressEvents(interval=10.0, clock=clock)
    with capture_logs() as logs:
        events.update(FIGURES)  # started just now: nothing yet
        clock.now += 10.0
        events.update(FIGURES)
        clock.now += 1.0
        events.update(FIGURES)
        events.finish({**FIGURES, "pending": 0})
    assert [(e["event"], e["final"], e["pending"]) for e in logs] == [
        ("ingest_progress", False, 3),
        ("ingest_progress", True, 0),
    ]


def test_the_rate_is_recent_not_a_lifetime_average() -> None:
    rate = Rate(window=5.0)
    assert rate.add(0.0, 0) == 0.0
    assert rate.add(10.0, 100) == 10.0
    assert rate.add(20.0, 100) == 0.0  # idle for the last 10 s


def test_the_terminal_is_chosen_by_isatty(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w") as not_a_terminal:
        assert isinstance(progress_for(not_a_terminal), ProgressEvents)
    primary, secondary = pty.openpty()
    try:
        with open(secondary, "w", closefd=False) as terminal:
            assert isinstance(progress_for(terminal), ProgressLine)
    finally:
        os.close(primary)
        os.close(secondary)


# --- the command, as operators run it --------------------------------------------------

SUBMISSIONS = 40


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    root = tmp_path / "spool"
    (root / "incoming").mkdir(parents=True)
    for i in range(SUBMISSIONS):
        doc = {
            "schema": "holdfast.submission/v1",
            "lab": "lab-progress",
            "submitted_at": "2026-11-30T10:00:00Z",
            "facts": [{"entity": "run", "key": f"run-{i}", "attributes": {"i": i}}],
        }
        (root / "incoming" / f"s{i:03}.json").write_text(json.dumps(doc))
    (root / "incoming" / "poison.json").write_text("{not json")
    return root


@pytest.fixture
def pool(worker_env: dict[str, str], tmp_path: Path) -> Iterator[WorkerPool]:
    workers = WorkerPool(worker_env, tmp_path / "logs")
    try:
        yield workers
    finally:
        workers.close()


def read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_on_a_terminal_the_command_draws_one_line_and_erases_it(
    spool: Path, worker_env: dict[str, str]
) -> None:
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, MANAGE, "ingest_submissions", "--spool", str(spool), "--once"],
            cwd=REPO,
            env={**worker_env, "TERM": "xterm-256color"},  # a terminal that takes colours
            stdin=subprocess.DEVNULL,
            stdout=secondary,
            stderr=secondary,
        )
        os.close(secondary)
        terminal = read_all(primary).decode()
        proc.wait(timeout=50)
    finally:
        os.close(primary)
    assert proc.returncode == 0, terminal
    drawn = [part for part in terminal.split("\r") if part.startswith("ingest: ")]
    assert drawn, terminal
    assert all(part.endswith("\x1b[K") for part in drawn), repr(terminal)
    assert "\x1b[31" not in terminal  # not coloured as an error, as Django styles stderr
    _, summary = terminal.rsplit("\r\x1b[K", 1)  # erased: the summary starts a clean line
    assert summary.startswith(f"{SUBMISSIONS} applied, 0 already applied, 1 quarantined")
    assert "spool_batch_applied" not in terminal  # the line shows batches; no log per batch


@pytest.mark.process
@pytest.mark.timeout(60)
def test_without_a_terminal_the_command_logs_events_and_no_carriage_return(
    spool: Path, pool: WorkerPool
) -> None:
    result = pool.command("ingest_submissions", "--spool", str(spool), "--once", timeout=50)
    assert result.returncode == 0, result.describe()
    assert "\r" not in result.stderr
    final = [e for e in parse_events(result.stderr) if e["event"] == "ingest_progress"][-1]
    assert final["final"] is True
    assert (final["applied"], final["quarantined"], final["pending"]) == (SUBMISSIONS, 1, 0)
    assert final["seen"] == SUBMISSIONS + 1
