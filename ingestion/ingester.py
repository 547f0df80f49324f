"""The parallel spool ingester: N reader processes feeding one writer process.

::

    monitor (this process) ──names──► readers (N) ──entries──► writer ──► database
          ▲                             │                       │
          └──────────── outcomes (applied, quarantined, retry, gone) ◄──┘

* The **monitor** scans ``incoming/`` (every ``scan_seconds`` while files are in
  flight, at every poll otherwise), hands each new name to the readers once, in lists of
  up to :data:`HANDOUT_FILES`, and watches: the writer's exit code (a crashed writer
  stops the run, exit 1), the stuck rule (work pending, nothing applied or quarantined
  for ``stuck_after`` seconds: the children are killed, every file stays, exit 1) and
  the grace rule (a file waiting longer than ``grace`` seconds: the same, so an operator
  is alerted rather than data silently aging). It never touches the database.
* **Readers** read, hash, parse and validate files and store log excerpts in the blob
  store (:func:`ingestion.spool.read_entry`), and pass the entries of each list on as
  one message; no database.
* The **writer** is :class:`ingestion.spool.Writer`: batches flushed by size and by time,
  one transaction each, retried with backoff on database errors.

Operators see progress (:func:`progress_for`): one self-rewriting line on a terminal
(:class:`ProgressLine`), ``ingest_progress`` log events otherwise (:class:`ProgressEvents`).

The last-terminal time is one shared ``multiprocessing.Value("d")`` (monotonic clock,
which is system-wide on Linux), updated under the counter lock on each apply commit and
each quarantine. Processes are forked: the monitor closes its database connections first,
and starts no threads.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import queue
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import ForkContext
from multiprocessing.sharedctypes import Synchronized
from types import FrameType
from typing import Any, Protocol

from django.db import connections

from jobs.log import get_logger

from .spool import (
    APPLIED,
    DEFAULT_GRACE_SECONDS,
    DUPLICATE,
    QUARANTINED,
    READ_RETRY_SECONDS,
    TERMINAL,
    Entry,
    Overdue,
    Spool,
    Stuck,
    Writer,
    read_entry,
    stuck_check,
)
from .submissions import Limits

log = get_logger("ingestion.ingester")

#: Names go to the readers, and entries to the writer, in lists of at most this many
#: files: one queue message (a lock, a pickle, a pipe write) per file was most of the
#: hand-off's cost (docs/benchmarks.md).
HANDOUT_FILES = 16

#: The writer commits what it holds once no entry has arrived for this long: readers
#: that keep up send a list every few milliseconds, so a pause means the spool is drained
#: (for now) and waiting for the batch timer would only delay the last commit.
IDLE_SECONDS = 0.05

RETRY = "retry"  # a reader could not read the file (not its fault): try again later
GONE = "gone"  # the file disappeared before it was read
ERROR = "error"  # the writer's last database error (name is empty)


@dataclass(frozen=True)
class Options:
    workers: int = 2
    once: bool = False
    stuck_after: float = 60.0
    poll_seconds: float = 0.1
    scan_seconds: float = 1.0  # while files are in flight, list incoming/ this often
    max_files: int = 500
    max_facts: int = 20_000
    flush_seconds: float = 0.25
    grace: float = DEFAULT_GRACE_SECONDS  # 0: no grace check
    log_batches: bool = True  # False: each batch's event at debug (a progress line shows it)


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


# --- progress for operators -----------------------------------------------------------


class ProgressSink(Protocol):
    """Where the monitor reports its figures: every poll, then once at the end."""

    def update(self, figures: dict[str, Any]) -> None: ...

    def finish(self, figures: dict[str, Any]) -> None: ...


def render(figures: dict[str, Any]) -> str:
    """The progress line's text: what an operator watching a drain wants at a glance."""
    return (
        f"ingest: {figures['seen']} seen, {figures['applied']} applied, "
        f"{figures['quarantined']} quarantined, {figures['duplicates']} duplicates, "
        f"{figures['pending']} pending, {figures['rate_files_per_s']:g} files/s "
        f"({figures['elapsed_s']:.0f} s)"
    )


class ProgressLine:
    """One status line on a terminal, rewritten in place at most every ``interval`` seconds
    and erased by :meth:`finish`, so the command's summary and any error start on a clean
    line. Each draw erases to the end of the line and returns the cursor to column 0: a log
    line the other processes print meanwhile overwrites the status line instead of being
    glued to its end, and the next draw starts below it."""

    def __init__(
        self,
        write: Callable[[str], None],
        interval: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.write = write
        self.interval = interval
        self.clock = clock
        self.last = -float("inf")
        self.shown = False

    def update(self, figures: dict[str, Any]) -> None:
        now = self.clock()
        if now - self.last < self.interval:
            return
        self.last = now
        self.shown = True
        self.write(f"\r{render(figures)}\x1b[K\r")

    def finish(self, figures: dict[str, Any]) -> None:
        if self.shown:
            self.write("\r\x1b[K")
            self.shown = False


class ProgressEvents:
    """``ingest_progress`` log events for logs that are not a terminal: at most one every
    ``interval`` seconds while running, only when a count changed since the last one (an
    idle ingester logs nothing), and a final summary (``final=True``)."""

    COUNTS = ("seen", "applied", "duplicates", "quarantined", "pending")

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.last = clock()
        self.logged: tuple[Any, ...] = (0,) * len(self.COUNTS)  # nothing, at the start

    def update(self, figures: dict[str, Any]) -> None:
        now = self.clock()
        if now - self.last < self.interval:
            return
        counts = tuple(figures.get(name, 0) for name in self.COUNTS)
        if counts == self.logged:
            return
        self.last, self.logged = now, counts
        log.info("ingest_progress", **figures, final=False)

    def finish(self, figures: dict[str, Any]) -> None:
        log.info("ingest_progress", **figures, final=True)


def progress_for(stream: Any, write: Callable[[str], None] | None = None) -> ProgressSink:
    """A :class:`ProgressLine` when ``stream`` is a terminal (written with ``write``,
    default ``stream.write`` plus a flush), else :class:`ProgressEvents`."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return ProgressEvents()

    def to_stream(text: str) -> None:
        stream.write(text)
        stream.flush()

    return ProgressLine(write or to_stream)


class Rate:
    """Files finished per second over the last ``window`` seconds (a watcher that ran for
    hours still shows what it does now, not its lifetime average)."""

    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, done: int) -> float:
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()
        first_at, first_done = self.samples[0]
        return round((done - first_done) / (now - first_at), 1) if now > first_at else 0.0


# --- the processes ---------------------------------------------------------------------


def _child_signals() -> None:
    # Ctrl-C reaches the whole process group: only the monitor decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def handouts(names: list[str], readers: int) -> list[list[str]]:
    """``names`` cut into chunks for the readers: at most :data:`HANDOUT_FILES` each, and
    small enough that every reader gets a share of a short list."""
    size = max(1, min(HANDOUT_FILES, math.ceil(len(names) / readers)))
    return [names[start : start + size] for start in range(0, len(names), size)]


def _reader_main(
    spool: Spool,
    limits: Limits,
    names: multiprocessing.Queue[list[str] | None],
    entries: multiprocessing.Queue[list[Entry] | None],
    outcomes: multiprocessing.Queue[tuple[str, str, str]],
) -> None:
    _child_signals()
    while True:
        chunk = names.get()
        if chunk is None:
            return
        found: list[Entry] = []
        for name in chunk:
            try:
                entry = read_entry(spool, name, limits)
            except OSError as exc:
                log.warning("submission_unreadable", file=name, error=str(exc))
                outcomes.put((name, RETRY, str(exc)))
                continue
            if entry is None:
                outcomes.put((name, GONE, ""))
            else:
                found.append(entry)
        if found:
            entries.put(found)


def _writer_main(
    spool: Spool,
    options: Options,
    entries: multiprocessing.Queue[list[Entry] | None],
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
        log_batches=options.log_batches,
    )
    stopping = False
    try:
        while not (stopping and not writer.buffer):
            idle = False
            if not stopping and not writer.full:
                timeout = IDLE_SECONDS if writer.buffer else 0.5
                try:
                    found = entries.get(timeout=timeout)
                except queue.Empty:
                    found, idle = [], True
                if found is None:
                    stopping = True
                else:
                    for entry in found:
                        writer.add(entry)
            if writer.due(idle=idle or stopping):
                writer.flush()
            elif writer.buffer and (writer.full or stopping):  # wait for the backoff
                time.sleep(min(writer.wait_seconds(), 0.5))
    finally:
        connections.close_all()


class _Stop:
    def __init__(self) -> None:
        self.signal: str | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signal.Signals(signum).name


def run(
    spool: Spool,
    options: Options,
    limits: Limits | None = None,
    progress: ProgressSink | None = None,
) -> dict[str, Any]:
    """Run the parallel ingester; return the final figures. Raises :class:`Stuck`,
    :class:`Overdue` (and RuntimeError when a child process dies) with every unfinished
    file left in place. ``progress`` (default :class:`ProgressEvents`) gets the figures
    at every poll and once at the end, whatever the outcome."""
    limits = limits or Limits.from_settings()
    progress = progress or ProgressEvents()
    spool.ensure()
    ctx = multiprocessing.get_context("fork")
    names: multiprocessing.Queue[list[str] | None] = ctx.Queue()
    # Bounded: a slow writer holds the readers back instead of filling memory.
    entries: multiprocessing.Queue[list[Entry] | None] = ctx.Queue(
        maxsize=max(4, 2 * options.workers)
    )
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
    pending: set[str] = set()  # in incoming/ at the last scan and not finished since
    scanned_at = -float("inf")
    rate = Rate()

    def figures() -> dict[str, Any]:
        snap = shared.snapshot()
        now = time.monotonic()
        elapsed = max(now - started, 1e-9)
        done = snap["applied"] + snap["duplicates"] + snap["quarantined"]
        return {
            "seen": len(seen),
            "applied": snap["applied"],
            "duplicates": snap["duplicates"],
            "quarantined": snap["quarantined"],
            "pending": len(pending),
            "elapsed_s": round(elapsed, 3),
            "files_per_s": round(done / elapsed, 1),
            "rate_files_per_s": rate.add(now, done),
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
                if outcome in TERMINAL or outcome == GONE:
                    pending.discard(name)
                if outcome == RETRY:
                    last_error = f"cannot read {name}: {detail}"
                    retry_at[name] = time.monotonic() + READ_RETRY_SECONDS
            if writer.exitcode is not None:
                raise RuntimeError(f"the spool writer exited with code {writer.exitcode}")
            for reader in readers:
                if reader.exitcode is not None:
                    raise RuntimeError(f"a spool reader exited with code {reader.exitcode}")

            now = time.monotonic()
            # Listing a large incoming/ costs a stat per file: while handed-out work is in
            # flight, look for new files only every scan_seconds.
            if not in_flight or now - scanned_at >= options.scan_seconds:
                scanned_at = now
                listed = spool.pending()
                overdue = spool.overdue(listed, options.grace)
                if overdue:
                    raise Overdue(overdue)
                pending = set(listed)
                ready = [n for n in listed if n not in in_flight and retry_at.get(n, 0.0) <= now]
                for chunk in handouts(ready, options.workers):
                    in_flight.update(chunk)
                    seen.update(chunk)
                    names.put(chunk)
            pending_since = (pending_since or now) if pending else None
            reason = stuck_check(
                len(pending), shared.snapshot()["last_terminal"], pending_since, options.stuck_after
            )
            if reason:
                if last_error:
                    reason += f"; last error: {last_error}"
                log.error("spool_stuck", **figures(), reason=reason)
                raise Stuck(reason)
            progress.update(figures())
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
            pending = set(spool.pending())
            progress.update(figures())
            reason = stuck_check(
                len(pending),
                shared.snapshot()["last_terminal"],
                pending_since or time.monotonic(),
                options.stuck_after,
            )
            if reason:
                raise Stuck(reason)
        if writer.exitcode != 0:
            raise RuntimeError(f"the spool writer exited with code {writer.exitcode}")
        pending = set(spool.pending())
        result = figures()
        log.info("spool_ingester_stopped", **result, signal=stop.signal)
        return result
    finally:
        progress.finish(figures())
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
