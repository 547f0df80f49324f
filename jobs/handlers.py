"""The engine's own job kinds."""

from jobs.context import JobContext

from . import tasks_backend  # noqa: F401  (registers the django.task handler)
from .refresh import REFRESH_KIND, run_all
from .registry import handler


@handler(REFRESH_KIND, max_attempts=3)
def refresh(ctx: JobContext) -> dict[str, int]:
    """Enqueue a bounded batch of due refreshes from every registered refresher."""
    return run_all()
