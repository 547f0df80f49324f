"""The parallel spool ingester: N reader processes feeding one writer process.

::

    monitor (this process) ──names──► readers (N) ──entries──► writer ──► database
          ▲                             │                       │
          └──────────── outcomes (applied, quarantined, retry, gone) ◄──┘

It is the pipeline of :mod:`ingestion.spool` with its stages in processes; the rules are
all there, once. Here:

* The **monitor** (:class:`ingestion.spool.Monitor`) lists ``incoming/``, hands names to
  the readers in lists of up to :data:`HANDOUT_FILES` (at most a bounded number in
  flight), counts each file's outcome, and applies the stuck rule (work pending, nothing
  applied or quarantined for ``stuck_after`` seconds: the children are killed, every file
  stays, exit 1) and the grace rule, on time whatever the children are doing. It never
  touches the database.
* **Readers** run :func:`ingestion.spool.read_outcome` and send the entries on in lists
  of at most :data:`HANDOUT_FILES` files and :data:`HANDOUT_BYTES` bytes; no database.
* The **writer** is :class:`ingestion.spool.Writer`; it reports each file's outcome.

Children ignore SIGTERM and SIGINT: a stop sent to the whole process group (systemd's
default, Ctrl-C) reaches the monitor, which tells the readers to stop and the writer to
commit what it holds, waits for them (still watching the stuck rule) and exits 0.
Processes are forked: the monitor closes its database connections first, and starts no
threads of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from types import FrameType
from typing import Any, Protocol

from django.db import connections

from jobs.log import get_logger

from .spool import (
    DEFAULT_GRACE_SECONDS,
    DEFAULT_MAX_BATCH_FACTS,
    DEFAULT_MAX_BATCH_FILES,
    Entry,
    Monitor,
    Rate,
    Spool,
    Writer,
    current_dir,
    open_dir,
    read_outcome,
    settle_seconds,
)
from .submissions import MIB, Limits

__all__ = ["Options", "ProgressEvents", "ProgressLine", "Rate", "progress_for", "run"]

log = get_logger("ingestion.ingester")

#: Names go to the readers, and entries to the writer, in lists of at most this many
#: files: one queue message (a lock, a pickle, a pipe write) per file was most of the
#: hand-off's cost (docs/benchmarks.md).
HANDOUT_FILES = 16
#: ... and a reader's list of entries holds at most about this many bytes of files, so a
#: message of large submissions stays small (memory stays bounded).
HANDOUT_BYTES = 4 * MIB

#: The writer commits what it holds once no entry has arrived for this long: readers
#: that keep up send a list every few milliseconds, so a pause means the spool is drained
#: (for now) and waiting for the batch timer would only delay the last commit.
IDLE_SECONDS = 0.05
# Asked to stop (SIGTERM), the writer commits the batch it holds; while the database will
# not take it (down, locked), it gives the batch up after this long (at most half of
# --stuck-after), its files left in incoming/ for the next run, so the stop ends well
# inside a service manager's stop timeout (deploy/'s unit: 30 s). A writer
# blocked inside a commit is killed that much later again: its transaction rolls back.
STOP_FLUSH_SECONDS = 10.0
STOP_KILL_SECONDS = 5.0

ERROR = "error"  # the writer's last database error (name is empty)
FLUSHING = "flushing"  # the writer began a commit: (files, monotonic start) in detail, delay
FLUSHED = "flushed"  # ... and it returned

Outcome = tuple[str, str, str, float]  # (name, outcome, detail, delay)


@dataclass(frozen=True)
class Options:
    workers: int = 2
    once: bool = False
    stuck_after: float = 60.0
    poll_seconds: float = 0.1
    scan_seconds: float = 1.0  # while files are in flight, list incoming/ this often
    max_files: int = DEFAULT_MAX_BATCH_FILES
    max_facts: int = DEFAULT_MAX_BATCH_FACTS
    max_bytes: int | None = None  # default: HOLDFAST_SPOOL_MAX_BATCH_BYTES
    flush_seconds: float = 0.25
    grace: float = DEFAULT_GRACE_SECONDS  # 0: no grace check
    settle: float | None = None  # default: HOLDFAST_SPOOL_SETTLE_SECONDS
    log_batches: bool = True  # False: each batch's event at debug (a progress line shows it)


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


#: The figures whose change makes a new ``ingest_progress`` event worth logging.
COUNTED = ("seen", "applied", "duplicates", "quarantined", "pending")


class ProgressEvents:
    """``ingest_progress`` log events for logs that are not a terminal: one every
    ``interval`` seconds while running, but only when a count changed since the last one
    (an idle watcher logs nothing), and a final summary (``final=True``)."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.last = clock()
        self.logged: tuple[Any, ...] | None = None

    def update(self, figures: dict[str, Any]) -> None:
        now = self.clock()
        if now - self.last < self.interval:
            return
        counts = tuple(figures.get(name) for name in COUNTED)
        if counts == self.logged:
            return
        self.last = now
        self.logged = counts
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


# --- the processes ---------------------------------------------------------------------


def _child_signals() -> None:
    # A stop reaches the whole process group: only the monitor decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGKILL this child when the monitor dies (``kill -9`` of the command from a
    shell, outside a service manager's cgroup kill), instead of reading and writing on,
    holding its database connection, under no one. Safe for the writer too: a batch is
    one transaction, and files are deleted only after their ack committed (I6). Where
    ``prctl`` is missing, the queues' end stops the children as before."""
    parent = multiprocessing.parent_process()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os._exit(1)


def handouts(names: list[str], readers: int) -> list[list[str]]:
    """``names`` cut into chunks for the readers: at most :data:`HANDOUT_FILES` each, and
    small enough that every reader gets a share of a short list."""
    size = max(1, min(HANDOUT_FILES, math.ceil(len(names) / readers)))
    return [names[start : start + size] for start in range(0, len(names), size)]


def _put(q: multiprocessing.Queue[Any], item: Any, stop: Event) -> bool:
    """Put ``item`` unless asked to stop meanwhile (a full queue never blocks a stop)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


def _reader_main(
    spool: Spool,
    limits: Limits,
    settle: float,
    names: multiprocessing.Queue[list[str] | None],
    entries: multiprocessing.Queue[list[bytes]],
    outcomes: multiprocessing.Queue[list[Outcome]],
    stop: Event,
) -> None:
    _child_signals()
    directory = open_dir(spool.incoming)
    try:
        while not stop.is_set():
            try:
                chunk = names.get(timeout=0.2)
            except queue.Empty:
                continue
            if chunk is None:
                return
            directory = current_dir(spool.incoming, directory)  # one stat a handout
            found: list[bytes] = []
            size = 0
            reports: list[Outcome] = []
            for name in chunk:
                if stop.is_set():
                    return
                entry, outcome, detail, delay = read_outcome(spool, name, limits, directory, settle)
                if entry is None:
                    reports.append((name, outcome, detail, delay))
                    continue
                found.append(pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))
                size += entry.size
                if size >= HANDOUT_BYTES:
                    if not _put(entries, found, stop):
                        return
                    found, size = [], 0
            if reports:
                outcomes.put(reports)
            if found and not _put(entries, found, stop):
                return
    finally:
        if stop.is_set():  # what is still queued stays unread: never wait to flush it
            entries.cancel_join_thread()
        os.close(directory)


def _writer_main(
    spool: Spool,
    options: Options,
    entries: multiprocessing.Queue[list[bytes]],
    outcomes: multiprocessing.Queue[list[Outcome]],
    stop: Event,
    abandon: Event,
) -> None:
    _child_signals()
    reports: list[Outcome] = []

    def report(name: str, outcome: str, detail: str = "", delay: float = 0.0) -> None:
        reports.append((name, outcome, detail, delay))

    def report_error(message: str) -> None:
        reports.append(("", ERROR, message, 0.0))

    writer = Writer(
        spool,
        report=report,
        report_error=report_error,
        max_files=options.max_files,
        max_facts=options.max_facts,
        max_bytes=options.max_bytes,
        flush_seconds=options.flush_seconds,
        log_batches=options.log_batches,
    )
    held: deque[Entry] = deque()  # received, not yet in a batch (it did not fit)
    try:
        while True:
            stopping = stop.is_set()
            if stopping and not writer.buffer:
                return
            if abandon.is_set():  # stopping, and the database would not take the batch
                log.warning(
                    "spool_batch_abandoned",
                    files=len(writer.buffer),
                    reason="stopping, and the database did not take the batch in time: "
                    "its files stay in incoming/ for the next run",
                )
                return
            idle = False
            if not stopping:
                while held and writer.accepting and writer.room(held[0].size):
                    writer.add(held.popleft())
                if not held and writer.accepting:
                    timeout = IDLE_SECONDS if writer.buffer else 0.2
                    try:
                        found = entries.get(timeout=timeout)
                    except queue.Empty:
                        idle = True
                    else:
                        held.extend(pickle.loads(payload) for payload in found)
                        while held and writer.accepting and writer.room(held[0].size):
                            writer.add(held.popleft())
            if writer.due(idle=idle or stopping or bool(held)):
                # Sent before the commit, which may wait on a lock for a long time: the
                # monitor's stuck rule then says what the writer is waiting for.
                outcomes.put([("", FLUSHING, str(len(writer.buffer)), time.monotonic())])
                writer.flush()
                reports.append(("", FLUSHED, "", 0.0))
            elif writer.buffer and not writer.accepting:  # wait for the backoff
                time.sleep(min(writer.wait_seconds(), 0.2))
            if reports:
                outcomes.put(list(reports))
                reports.clear()
    finally:
        if reports:
            outcomes.put(list(reports))
        connections.close_all()


def _bound_the_last_flush(
    writer: multiprocessing.process.BaseProcess, abandon: Event, waited: float, limit: float
) -> None:
    """Stopping on a signal: past ``limit`` seconds the writer gives its batch up, and
    ``STOP_KILL_SECONDS`` later one still blocked in a commit is killed (rolled back)."""
    if waited > limit and not abandon.is_set():
        abandon.set()
    if waited > limit + STOP_KILL_SECONDS and writer.is_alive():
        log.warning("spool_writer_killed", reason="blocked in a commit while stopping")
        writer.kill()
        writer.join(timeout=5)


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
    settle = settle_seconds() if options.settle is None else options.settle
    progress = progress or ProgressEvents()
    spool.ensure()
    monitor = Monitor(
        spool,
        stuck_after=options.stuck_after,
        grace=options.grace,
        scan_seconds=options.scan_seconds,
    )
    ctx = multiprocessing.get_context("fork")
    names: multiprocessing.Queue[list[str] | None] = ctx.Queue()
    # Bounded: a slow writer holds the readers back instead of filling memory.
    entries: multiprocessing.Queue[list[bytes]] = ctx.Queue(maxsize=max(4, 2 * options.workers))
    outcomes: multiprocessing.Queue[list[Outcome]] = ctx.Queue()
    stop_children = ctx.Event()
    abandon = ctx.Event()  # stopping, and the writer's batch cannot be committed in time
    # Names handed out and not finished: enough to fill the writer's batches, no more.
    budget = 2 * options.max_files + 4 * HANDOUT_FILES * options.workers

    connections.close_all()  # the children must not share the monitor's connections
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    writer = ctx.Process(
        target=_writer_main,
        args=(spool, options, entries, outcomes, stop_children, abandon),
        name="spool-writer",
        daemon=True,
    )
    writer.start()
    readers = [
        ctx.Process(
            target=_reader_main,
            args=(spool, limits, settle, names, entries, outcomes, stop_children),
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

    def collect() -> None:
        while True:
            try:
                found = outcomes.get_nowait()
            except queue.Empty:
                return
            for name, outcome, detail, delay in found:
                if outcome == ERROR:
                    monitor.error(detail)
                elif outcome == FLUSHING:
                    monitor.flushing(delay, int(detail))
                elif outcome == FLUSHED:
                    monitor.flushing(None)
                else:
                    monitor.outcome(name, outcome, detail, delay)

    def children_alive() -> None:
        if writer.exitcode is not None:
            raise RuntimeError(f"the spool writer exited with code {writer.exitcode}")
        for reader in readers:
            if reader.exitcode is not None:
                raise RuntimeError(f"a spool reader exited with code {reader.exitcode}")

    try:
        while True:
            collect()
            children_alive()
            now = time.monotonic()
            if monitor.scan_due(now):
                monitor.scan(now)
            room = budget - monitor.in_flight
            if room > 0:
                for chunk in handouts(monitor.take(room, now), options.workers):
                    names.put(chunk)
            monitor.check(now)
            progress.update(monitor.figures())
            if stop.signal:
                break
            if options.once and monitor.drained:
                monitor.scan()
                if monitor.drained:
                    break
            time.sleep(options.poll_seconds)

        # Done (or asked to stop): the readers stop, the writer commits what it holds.
        stop_children.set()
        for _ in readers:  # wake them now rather than at their next poll
            names.put(None)
        with contextlib.suppress(queue.Full):
            entries.put_nowait([])
        flush_limit = min(STOP_FLUSH_SECONDS, options.stuck_after / 2)
        stopped_at = time.monotonic()
        while writer.is_alive() or any(reader.is_alive() for reader in readers):
            writer.join(timeout=options.poll_seconds)
            collect()
            monitor.check()
            progress.update(monitor.figures())
            if stop.signal:
                _bound_the_last_flush(writer, abandon, time.monotonic() - stopped_at, flush_limit)
        collect()
        if writer.exitcode != 0 and not abandon.is_set():
            raise RuntimeError(f"the spool writer exited with code {writer.exitcode}")
        result = monitor.figures()
        log.info("spool_ingester_stopped", **result, signal=stop.signal)
        return result
    finally:
        progress.finish(monitor.figures())
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
