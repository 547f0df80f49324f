"""Job kinds used by the tests. Workers in subprocesses import them like any app's."""

import contextlib
import ctypes
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import structlog
from django.db import connection, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from jobs import LeaseLost, PermanentError, enqueue, handler
from jobs.context import JobContext
from jobs.refresh import refresher

from .models import Document, Effect, Span


def _effect(ctx: JobContext, label: str) -> None:
    Effect.objects.create(
        job_id=ctx.job_id,
        attempt=ctx.attempt,
        lease_token=ctx.lease_token,
        label=label,
        worker_id=ctx.worker_id,
    )


@handler("test.echo")
def echo(ctx: JobContext, **args: Any) -> dict[str, Any]:
    return {"args": args, "attempt": ctx.attempt}


@handler("test.noop")
def noop(ctx: JobContext, **args: Any) -> None:
    return None


@handler("test.fail", max_attempts=3, backoff=0)
def fail(ctx: JobContext, *, message: str = "boom") -> None:
    raise RuntimeError(f"{message} (attempt {ctx.attempt})")


@handler("test.cancelled_then_fail", max_attempts=3, backoff=0)
def cancelled_then_fail(ctx: JobContext) -> None:
    """An operator cancels the job while it runs; the handler hears of it (a renewal) but
    never checks, and fails."""
    from jobs import operations

    operations.cancel(ctx.job_id, actor="ops")
    ctx.heartbeat()
    assert ctx.cancel_requested
    raise RuntimeError(f"kept going and failed (attempt {ctx.attempt})")


@handler("test.permanent", backoff=0)
def permanent(ctx: JobContext) -> None:
    raise PermanentError("this input can never work")


@handler("test.flaky", max_attempts=5, backoff=0)
def flaky(ctx: JobContext, *, fail_times: int) -> int:
    if ctx.attempt <= fail_times:
        raise ConnectionError(f"transient failure {ctx.attempt}")
    return ctx.attempt


@handler("test.effect", lease_seconds=2, backoff=0, max_attempts=20)
def effect(ctx: JobContext, *, sleep: float = 0.0) -> str:
    """Sleeps, then writes its effect in the same transaction that completes the job."""
    if sleep:
        time.sleep(sleep)
    with ctx.atomic(complete=True, result="done"):
        _effect(ctx, "complete")
    return "done"


@handler("test.progress_then_sleep", lease_seconds=2, backoff=0, max_attempts=20)
def progress_then_sleep(ctx: JobContext, *, sleep: float = 0.0, marker: str = "") -> str:
    """Sleeps (stop or kill it here), then writes progress and completes with an effect."""
    if marker:
        with open(marker, "w") as handle:
            handle.write(str(os.getpid()))
    time.sleep(sleep)
    with ctx.atomic():
        _effect(ctx, "progress")
    with ctx.atomic(complete=True, result="done"):
        _effect(ctx, "complete")
    return "done"


@handler("test.sleep", backoff=0)
def sleep(ctx: JobContext, *, seconds: float, marker: str = "") -> float:
    """Sleeps; writes ``marker`` when it starts so a test knows the job is running."""
    if marker:
        with open(marker, "w") as handle:
            handle.write(str(os.getpid()))
    time.sleep(seconds)
    return seconds


@handler("test.slow_return", lease_seconds=2, backoff=0, max_attempts=20)
def slow_return(ctx: JobContext, *, sleep: float = 0.0, marker: str = "") -> dict[str, int]:
    """Sleeps (stop or kill it here), then returns: the worker writes the completion."""
    if marker:
        with open(marker, "w") as handle:
            handle.write(str(os.getpid()))
    time.sleep(sleep)
    return {"pid": os.getpid(), "lease_token": ctx.lease_token}


@handler("test.nul_result", backoff=0, max_attempts=2)
def nul_result(ctx: JobContext) -> dict[str, str]:
    """Returns text with a NUL character (PostgreSQL text and jsonb cannot hold one)."""
    return {"text": "before\x00after"}


@handler("test.nul_error", backoff=0, max_attempts=2)
def nul_error(ctx: JobContext) -> None:
    """Fails with a message holding raw bytes, as a parser quoting its input might."""
    raise ValueError("unparseable header: \x00\x01")


@handler("test.surrogate_error", backoff=0, max_attempts=2)
def surrogate_error(ctx: JobContext) -> None:
    """Fails naming a file as os.listdir gives an undecodable name: a lone surrogate."""
    raise ValueError("cannot read " + os.fsdecode(b"report-\xff.json"))


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot describe itself")


@handler("test.unprintable_error", backoff=0, max_attempts=2)
def unprintable_error(ctx: JobContext) -> None:
    """Fails with an exception whose ``str()`` raises."""
    raise Unprintable()


@handler("test.cancellable", backoff=0)
def cancellable(ctx: JobContext, *, seconds: float = 30.0, marker: str = "") -> str:
    """Works in small steps, committing progress, until done or asked to cancel."""
    if marker:
        with open(marker, "w") as handle:
            handle.write(str(os.getpid()))
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        if ctx.cancel_requested:
            raise ctx.Cancelled()
        step += 1
        ctx.progress(step, None, "working")
        time.sleep(0.1)
    return "finished"


@refresher("test.documents", batch=100)
def due_documents(limit: int) -> int:
    """Enqueue a refresh for at most ``limit`` documents whose TTL has passed."""
    due = Document.objects.filter(refresh_after__lte=timezone.now()).order_by("refresh_after")
    jobs = [
        enqueue("test.refresh_document", {"document_id": pk}, unique_key=f"refresh-doc:{pk}")
        for pk in due.values_list("pk", flat=True)[:limit]
    ]
    return len(jobs)


@handler("test.refresh_document", backoff=0)
def refresh_document(ctx: JobContext, *, document_id: int) -> None:
    with ctx.atomic(complete=True):
        Document.objects.filter(pk=document_id).update(
            refresh_after=timezone.now() + timedelta(days=28), refreshed=F("refreshed") + 1
        )


def _resources(args: dict[str, Any]) -> list[str]:
    return args["resources"]  # unchecked on purpose: the engine validates what locks return


@handler("test.locked", backoff=0, max_attempts=20, lease_seconds=2, locks=_resources)
def locked(ctx: JobContext, *, resources: list[str], seconds: float = 0.05, **labels: Any) -> str:
    """Holds its resource locks for ``seconds``, recording its span by the database clock.
    ``labels``: args the tests tell jobs apart by (and that COPY must carry exactly)."""
    with ctx.atomic():
        Span.objects.create(
            job_id=ctx.job_id,
            lease_token=ctx.lease_token,
            resources=resources,
            worker_id=ctx.worker_id,
            started_at=Now(),
        )
    time.sleep(seconds)
    with ctx.atomic(complete=True, result="done"):
        Span.objects.filter(job_id=ctx.job_id, lease_token=ctx.lease_token).update(ended_at=Now())
    return "done"


def _wait_for_gate(gate: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the test never opened the gate {gate}")
        time.sleep(0.02)


@handler("test.cancel_point", backoff=0, max_attempts=1, lease_seconds=1.5, locks=_resources)
def cancel_point(
    ctx: JobContext,
    *,
    gate: str,
    marker: str,
    progress: bool = False,
    honour: bool = True,
    resources: list[str] | None = None,
) -> str:
    """Waits at a gate (a file the test creates) while the test requests cancellation.

    With ``progress`` it first commits a progress report. After the gate its first safe
    point is inside a fenced block that has written an effect: honouring the request
    rolls that effect back; with ``honour=False`` the handler ignores it and completes.
    The short lease makes the worker's heartbeat (its fallback way to hear a cancel
    request) come every half second.
    """
    if progress:
        ctx.progress(1, 2, "before the gate")
    with open(marker, "w") as handle:
        handle.write(str(os.getpid()))
    _wait_for_gate(gate)
    with ctx.atomic():
        _effect(ctx, "after the gate")
        if honour and ctx.cancel_requested:
            raise ctx.Cancelled()
    return "finished"


@handler("test.freezable", backoff=0, max_attempts=5, lease_seconds=3, locks=_resources)
def freezable(
    ctx: JobContext,
    *,
    document_id: int,
    resources: list[str],
    marker: str = "",
    pause_before: float = 0.0,
    pause_in_block: float = 0.0,
    pause_after_block: float = 0.0,
) -> str:
    """A fenced block that locks a domain row (a Document) and records an effect, then
    completes with another effect. Its first attempt can pause before the block (freeze
    the worker in a heartbeat there), inside it (freeze it inside ``ctx.atomic()``) or,
    with ``pause_after_block``, inside the handler's own transaction that the block is
    nested in, after the block's fence locked the job row; later attempts run straight
    through. It ignores cancel requests."""
    first = ctx.attempt == 1
    if marker and first:
        with open(marker, "w") as handle:
            handle.write(str(os.getpid()))
    if first:
        time.sleep(pause_before)
    # With pause_after_block, the handler's own transaction is around the fenced block.
    outer = transaction.atomic() if pause_after_block else contextlib.nullcontext()
    with outer:
        with ctx.atomic():
            Document.objects.filter(pk=document_id).update(refreshed=F("refreshed") + 1)
            _effect(ctx, "progress")
            if first and pause_in_block:
                with open(f"{marker}.in-block", "w") as handle:
                    handle.write(str(os.getpid()))
                time.sleep(pause_in_block)
        if first and pause_after_block:
            with open(f"{marker}.in-block", "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(pause_after_block)
    with ctx.atomic(complete=True, result="done"):
        _effect(ctx, "complete")
    return "done"


@handler("test.raise_base", backoff=0, max_attempts=2)
def raise_base(ctx: JobContext, *, which: str) -> None:
    """Raises a BaseException that is not an Exception, as careless handler code does."""
    if which == "SystemExit":
        raise SystemExit(f"sys.exit() in attempt {ctx.attempt}")
    if which == "KeyboardInterrupt":
        raise KeyboardInterrupt(f"interrupted in attempt {ctx.attempt}")
    raise GeneratorExit(f"generator closed in attempt {ctx.attempt}")


@handler("test.hard_exit", backoff=0, max_attempts=3, lease_seconds=1)
def hard_exit(ctx: JobContext, *, ways: tuple[str, ...] = ("exit", "exit", "exit")) -> None:
    """Kills its own worker process, attempt n the n-th of ``ways``: ``exit``
    (``os._exit(1)``), ``segfault`` (a real one: reads address 0) or ``sigkill`` (what the
    OOM killer sends)."""
    way = ways[min(ctx.attempt, len(ways)) - 1]
    if way == "segfault":
        ctypes.string_at(0)
    elif way == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


@handler("test.misuse", backoff=0, max_attempts=2)
def misuse(ctx: JobContext, *, how: str) -> Any:
    """Careless handler code the worker must contain, one way per ``how``:

    - ``nested_complete``: ``ctx.atomic(complete=True)`` inside another (the outer one's
      completion then finds the job settled by the inner: LeaseLost, lease still held);
    - ``raise_lease_lost``: LeaseLost raised by hand;
    - ``progress_rolled_back``: reports progress inside its own transaction, which then
      rolls back;
    - ``cancel_itself``: raises ``ctx.Cancelled`` with no cancel request;
    - ``raise_after_complete``: raises after its ``ctx.atomic(complete=True)`` committed;
    - ``open_atomic`` / ``autocommit_off`` / ``raw_begin``: returns with a transaction
      open, an Effect row written in it;
    - ``replace_sigterm``: installs a SIGTERM handler that ignores the signal;
    - ``bind_context``: binds a key to the log context and never unbinds it;
    - ``fork``: forks; the child returns from the handler like its parent, which waits
      for it and returns its exit status;
    - ``thread``: starts a thread that is not a daemon and sleeps for an hour.
    """
    if how == "nested_complete":
        with ctx.atomic(complete=True, result="outer"):
            _effect(ctx, "outer")
            with ctx.atomic(complete=True, result="inner"):
                _effect(ctx, "inner")
    elif how == "raise_after_complete":
        with ctx.atomic(complete=True, result="done"):
            _effect(ctx, "complete")
        raise RuntimeError("cleanup failed after the job completed")
    elif how == "progress_rolled_back":
        with contextlib.suppress(RuntimeError), transaction.atomic():
            ctx.progress(5, 10, "halfway")  # the first call writes, inside this transaction
            raise RuntimeError("the handler's own transaction rolls back")
    elif how == "cancel_itself":
        raise ctx.Cancelled("its source was removed")
    elif how == "raise_lease_lost":
        raise LeaseLost("raised by the handler's own code")
    elif how == "open_atomic":
        transaction.atomic().__enter__()
        _effect(ctx, "left open")
    elif how == "autocommit_off":
        transaction.set_autocommit(False)
        _effect(ctx, "left open")
    elif how == "raw_begin":
        with connection.cursor() as cursor:
            cursor.execute("BEGIN")
        _effect(ctx, "left open")
    elif how == "replace_sigterm":
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    elif how == "bind_context":
        structlog.contextvars.bind_contextvars(leaked=f"from job {ctx.job_id}")
    elif how == "fork":
        child = os.fork()
        if child == 0:
            return "the child's"
        _, status = os.waitpid(child, 0)
        return {"child_exit": os.waitstatus_to_exitcode(status)}
    elif how == "thread":
        threading.Thread(target=time.sleep, args=(3600,), name="lingering", daemon=False).start()
    return how


if os.environ.get("HOLDFAST_TEST_LATE_KIND"):
    # A kind only some worker processes know: "new code" deployed to them alone.
    @handler("test.late_kind", backoff=0)
    def late_kind(ctx: JobContext) -> str:
        return f"run by {ctx.worker_id}"
