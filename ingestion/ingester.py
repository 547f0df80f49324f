"""The parallel spool ingester: N reader processes feeding one writer process.

::

    monitor (this process) ──names──► readers (N) ──entries──► writer ──► database
          ▲                             │                       │
          └──────────── outcomes (applied, quarantined, retry, gone) ◄──┘

* The **monitor** scans ``incoming/``, hands each new name to the readers once, and
  watches: the writer's exit code (a crashed writer stops the run, exit 1), the stuck
  rule (work pending, nothing applied or quarantined for ``stuck_after`` seconds: the
  children are killed, every file stays, exit 1) and the grace rule (a file waiting
  longer than ``grace`` seconds: the same, so an operator is alerted rather than data
  silently aging). It never touches the database.
* **Readers** read, hash, parse and validate files and store log excerpts in the blob
  store (:func:`ingestion.spool.read_entry`); no database.
* The **writer** is :class:`ingestion.spool.Writer`: batches flushed by size and by time,
  one transaction each, retried with backoff on database errors.

The last-terminal time is one shared ``multiprocessing.Value("d")`` (monotonic clock,
which is system-wide on Linux), updated under the counter lock on each apply commit and
each quarantine. Processes are forked: the monitor closes its database connections first,
and starts no threads.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.context import ForkContext
from multiprocessing.sharedctypes import Synchronized
from types import FrameType
from typing import Any

from django.db import connections

from jobs.log import get_logger

from .spool import (
    APPLIED,
    DEFAULT_GRACE_SECONDS,
    DUPLICATE,
    QUARANTINED,
    READ_RETRY_SECONDS,
    TERMINAL,
    Overdue,
    Spool,
    Stuck,
    Writer,
    read_entry,
    stuck_check,
)
from .submissions import Limits

log = get_logger("ingestion.ingester")

RETRY = "retry"  # a reader could not read the file (not its fault): try again later
GONE = "gone"  # the file disappeared before it was read
ERROR = "error"  # the writer's last database error (name is empty)


@dataclass(frozen=True)
class Options:
    workers: int = 2
    once: bool = False
    stuck_after: float = 60.0
    poll_seconds: float = 0.1
    progress_seconds: float = 5.0
    max_files: int = 500
    max_facts: int = 20_000
    flush_seconds: float = 0.25
    grace: float = DEFAULT_GRACE_SECONDS  # 0: no grace check


class Shared:
    """What the processes share: counters and the last-terminal time, under one lock."""

    def __init__(self, ctx: ForkContext) -> None:
        self.lock = ctx.Lock()
        self.applied: Synchronized[int] = ctx.Value("q", 0, lock=False)
        self.duplicates: Synchronized[int] = ctx.Value("q", 0, lock=False)
        self.quarantined: Synchronized[int] = ctx.Value("q", 0, lock=False)
        self.last_terminal: Synchronized[float] = ctx.Value("d", time.monotonic(), lock=False)

    def terminal(self, outcome: str) -> None:
        if outcome not in TERMINAL:
            return
        with self.lock:
            if outcome == APPLIED:
                self.applied.value += 1
            elif outcome == DUPLICATE:
                self.duplicates.value += 1
            elif outcome == QUARANTINED:
                self.quarantined.value += 1
            self.last_terminal.value = time.monotonic()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "applied": self.applied.value,
                "duplicates": self.duplicates.value,
                "quarantined": self.quarantined.value,
                "last_terminal": self.last_terminal.value,
            }


def _child_signals() -> None:
    # Ctrl-C reaches the whole process group: only the monitor decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _reader_main(
    spool: Spool,
    limits: Limits,
    names: multiprocessing.Queue[str | None],
    entries: multiprocessing.Queue[Any],
    outcomes: multiprocessing.Queue[tuple[str, str, str]],
) -> None:
    _child_signals()
    while True:
        name = names.get()
        if name is None:
            return
        try:
            entry = read_entry(spool, name, limits)
        except OSError as exc:
            log.warning("submission_unreadable", file=name, error=str(exc))
            outcomes.put((name, RETRY, str(exc)))
            continue
        if entry is None:
            outcomes.put((name, GONE, ""))
        else:
            entries.put(entry)


def _writer_main(
    spool: Spool,
    options: Options,
    entries: multiprocessing.Queue[Any],
    outcomes: multiprocessing.Queue[tuple[str, str, str]],
    shared: Shared,
) -> None:
    _child_signals()

    def report(name: str, outcome: str) -> None:
        shared.terminal(outcome)
        outcomes.put((name, outcome, ""))

    def report_error(message: str) -> None:
        outcomes.put(("", ERROR, message))

    writer = Writer(
        spool,
        report=report,
        report_error=report_error,
        max_files=options.max_files,
        max_facts=options.max_facts,
        flush_seconds=options.flush_seconds,
    )
    stopping = False
    try:
        while not (stopping and not writer.buffer):
            if not stopping and not writer.full:
                try:
                    item = entries.get(timeout=max(0.01, min(writer.wait_seconds(), 0.5)))
                except queue.Empty:
                    item = False
                if item is None:
                    stopping = True
                elif item is not False:
                    writer.add(item)
            if writer.due() or (stopping and writer.buffer and time.monotonic() >= writer.next_try):
                writer.flush()
            elif writer.full or stopping:
                time.sleep(min(writer.wait_seconds(), 0.5))
    finally:
        connections.close_all()


class _Stop:
    def __init__(self) -> None:
        self.signal: str | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signal.Signals(signum).name


def run(spool: Spool, options: Options, limits: Limits | None = None) -> dict[str, Any]:
    """Run the parallel ingester; return the final figures. Raises :class:`Stuck`,
    :class:`Overdue` (and RuntimeError when a child process dies) with every unfinished
    file left in place."""
    limits = limits or Limits.from_settings()
    spool.ensure()
    ctx = multiprocessing.get_context("fork")
    names: multiprocessing.Queue[str | None] = ctx.Queue()
    entries: multiprocessing.Queue[Any] = ctx.Queue(maxsize=max(64, 4 * options.workers))
    outcomes: multiprocessing.Queue[tuple[str, str, str]] = ctx.Queue()
    shared = Shared(ctx)

    connections.close_all()  # the children must not share the monitor's connections
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    writer = ctx.Process(
        target=_writer_main,
        args=(spool, options, entries, outcomes, shared),
        name="spool-writer",
        daemon=True,
    )
    writer.start()
    readers = [
        ctx.Process(
            target=_reader_main,
            args=(spool, limits, names, entries, outcomes),
            name=f"spool-reader-{i}",
            daemon=True,
        )
        for i in range(options.workers)
    ]
    for reader in readers:
        reader.start()
    log.info(
        "spool_ingester_started",
        spool=str(spool.root),
        workers=options.workers,
        writer_pid=writer.pid,
        once=options.once,
    )

    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    started = time.monotonic()
    in_flight: set[str] = set()
    retry_at: dict[str, float] = {}
    seen: set[str] = set()
    pending_since: float | None = None
    last_error = ""
    last_progress = started
    pending: list[str] = []

    def figures() -> dict[str, Any]:
        snap = shared.snapshot()
        elapsed = max(time.monotonic() - started, 1e-9)
        done = snap["applied"] + snap["duplicates"] + snap["quarantined"]
        return {
            "seen": len(seen),
            "applied": snap["applied"],
            "duplicates": snap["duplicates"],
            "quarantined": snap["quarantined"],
            "pending": len(pending),
            "elapsed_s": round(elapsed, 3),
            "files_per_s": round(done / elapsed, 1),
        }

    try:
        while True:
            while True:
                try:
                    name, outcome, detail = outcomes.get_nowait()
                except queue.Empty:
                    break
                if outcome == ERROR:
                    last_error = detail
                    continue
                in_flight.discard(name)
                if outcome == RETRY:
                    last_error = f"cannot read {name}: {detail}"
                    retry_at[name] = time.monotonic() + READ_RETRY_SECONDS
            if writer.exitcode is not None:
                raise RuntimeError(f"the spool writer exited with code {writer.exitcode}")
            for reader in readers:
                if reader.exitcode is not None:
                    raise RuntimeError(f"a spool reader exited with code {reader.exitcode}")

            now = time.monotonic()
            pending = spool.pending()
            overdue = spool.overdue(pending, options.grace)
            if overdue:
                raise Overdue(overdue)
            for name in pending:
                if name in in_flight or retry_at.get(name, 0.0) > now:
                    continue
                in_flight.add(name)
                seen.add(name)
                names.put(name)
            pending_since = (pending_since or now) if pending else None
            reason = stuck_check(
                len(pending), shared.snapshot()["last_terminal"], pending_since, options.stuck_after
            )
            if reason:
                if last_error:
                    reason += f"; last error: {last_error}"
                log.error("spool_stuck", **figures(), reason=reason)
                raise Stuck(reason)
            if now - last_progress >= options.progress_seconds:
                last_progress = now
                log.info("spool_progress", **figures())
            if stop.signal or (options.once and not pending):
                break
            time.sleep(options.poll_seconds)

        # Done (or asked to stop): let the readers finish and the writer flush its buffer.
        if stop.signal:  # names not yet read stay for the next run
            with contextlib.suppress(queue.Empty):
                while True:
                    names.get_nowait()
        for _ in readers:
            names.put(None)
        for reader in readers:
            reader.join()
        entries.put(None)
        while writer.exitcode is None:
            writer.join(timeout=options.poll_seconds)
            reason = stuck_check(
                len(spool.pending()),
                shared.snapshot()["last_terminal"],
                pending_since or time.monotonic(),
                options.stuck_after,
            )
            if reason:
                raise Stuck(reason)
        if writer.exitcode != 0:
            raise RuntimeError(f"the spool writer exited with code {writer.exitcode}")
        pending = spool.pending()
        result = figures()
        log.info("spool_ingester_stopped", **result, signal=stop.signal)
        return result
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in [writer, *readers]:
            if proc.exitcode is None:
                proc.kill()
        for proc in [writer, *readers]:
            proc.join(timeout=5)
        for q in (names, entries, outcomes):
            q.cancel_join_thread()
            with contextlib.suppress(Exception):
                q.close()
