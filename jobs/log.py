"""structlog set-up: JSON or console lines on stderr, per ``LOG_FORMAT`` and ``LOG_LEVEL``.

Every state transition logs one event; the job's identity (job id, kind, lane, attempt,
lease token, worker id) is bound with ``structlog.contextvars`` while the job runs, so
every line a handler logs carries it too.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from django.conf import settings

_configured = False


def configure(force: bool = False) -> None:
    global _configured
    if _configured and not force:
        return
    fmt = settings.LOG_FORMAT or ("console" if sys.stderr.isatty() else "json")
    level = logging.getLevelNamesMapping().get(settings.LOG_LEVEL, logging.INFO)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


def bound_context() -> dict[str, Any]:
    """The log context bound right now, kept with an attempt's record."""
    return dict(structlog.contextvars.get_contextvars())
