"""The benchmark's job kinds, registered like any app's (autodiscovered at worker start)."""

import time
from typing import Any

from jobs import handler
from jobs.context import JobContext


@handler("bench.noop", max_attempts=1)
def noop(ctx: JobContext, **args: Any) -> None:
    """Does nothing: what is left to measure is the engine's own cost per job."""
    return None


@handler("bench.sleep", max_attempts=1)
def sleep(ctx: JobContext, seconds: float = 1.0, **args: Any) -> None:
    """Holds its worker busy for ``seconds`` (the backends row counts a running worker's
    connections)."""
    time.sleep(seconds)
