"""Sample handlers for the demo: one that succeeds, one that is flaky, one that always fails."""

from typing import Any

from jobs import handler
from jobs.context import JobContext

# Retry at once, so that the demo's burst worker (which stops when nothing is runnable)
# shows the retries; real handlers keep the default exponential backoff.
QUICK_RETRY = 0


@handler("demo.greet")
def greet(ctx: JobContext, *, name: str) -> dict[str, Any]:
    return {"greeting": f"hello, {name}", "attempt": ctx.attempt}


@handler("demo.flaky", max_attempts=5, backoff=QUICK_RETRY)
def flaky(ctx: JobContext, *, fail_times: int) -> dict[str, Any]:
    """Fails its first ``fail_times`` attempts, like a server that is briefly down."""
    if ctx.attempt <= fail_times:
        raise ConnectionError(f"upstream refused the connection (attempt {ctx.attempt})")
    return {"succeeded_on_attempt": ctx.attempt}


@handler("demo.broken", max_attempts=3, backoff=QUICK_RETRY)
def broken(ctx: JobContext, *, path: str) -> None:
    """Always fails: after three attempts the job is dead, with every error kept."""
    raise FileNotFoundError(f"no such report: {path}")
