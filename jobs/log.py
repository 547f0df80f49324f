"""structlog set-up: JSON or console lines on stderr, per ``LOG_FORMAT`` and ``LOG_LEVEL``.

Every state transition logs one event; the job's identity (job id, kind, lane, attempt,
lease token, worker id) is bound with ``structlog.contextvars`` while the job runs, so
every line a handler logs carries it too.

Standard-library logging (``django.request`` with a 500's traceback, ``django.security``,
``py.warnings``, third-party libraries) goes through the same renderer: the ``LOGGING``
setting (``config/settings.py``) sends every record to one stderr handler formatted by
:class:`StdlibFormatter`, whatever ``DEBUG`` is.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import structlog
from django.conf import settings
from structlog.typing import EventDict

_configured = False


def _renderer(fmt: str | None = None) -> Any:
    fmt = fmt or settings.LOG_FORMAT or ("console" if sys.stderr.isatty() else "json")
    if fmt == "json":
        return JSONLines()
    return structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())


def _fallback(value: Any) -> Any:
    """What structlog's ``JSONRenderer`` writes for a value JSON has no type for."""
    try:
        return value.__structlog__()
    except AttributeError:
        return repr(value)


class JSONLines:
    """The JSON renderer: the same lines as ``structlog.processors.JSONRenderer()``, from
    one encoder built once (``json.dumps`` with ``default=`` builds a new encoder for every
    line)."""

    def __init__(self) -> None:
        self._encode = json.JSONEncoder(default=_fallback).encode

    def __call__(self, logger: Any, method: str, event_dict: EventDict) -> str:
        return self._encode(event_dict)


def _from_record(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    """A standard-library record's useful extras: its logger, and the HTTP request's
    method, path and status that ``django.request`` and ``django.security`` attach."""
    record = event_dict.get("_record")
    if record is None:
        return event_dict
    event_dict["logger"] = record.name
    request = getattr(record, "request", None)
    if request is not None and hasattr(request, "path"):
        event_dict.setdefault("method", getattr(request, "method", None))
        event_dict.setdefault("path", request.path)
    status = getattr(record, "status_code", None)
    if status is not None:
        event_dict.setdefault("status", status)
    return event_dict


class StdlibFormatter(structlog.stdlib.ProcessorFormatter):
    """Renders standard-library records exactly as structlog's own lines (JSON or console),
    traceback included (``exception``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _renderer(),
            ],
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                _from_record,
            ],
        )


class ClientFaultAsWarning(logging.Filter):
    """For ``django.security``'s records: a suspicious request (a ``Host`` not allowed,
    too many fields, a body too large) is the client's fault and answered 400, so it is a
    warning without a traceback, as every other 4xx is. Django logs each at error with its
    traceback: any scanner could fill the error stream operators alert on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


def configure(force: bool = False, fmt: str | None = None) -> None:
    """Set up structlog from the settings; ``fmt`` overrides ``LOG_FORMAT``."""
    global _configured
    if _configured and not force:
        return
    level = logging.getLevelNamesMapping().get(settings.LOG_LEVEL, logging.INFO)
    renderer = _renderer(fmt)
    # JSON lines carry a traceback as text (format_exc_info); the console renderer draws
    # it itself and warns on every exception when format_exc_info ran before it.
    tracebacks = (
        []
        if isinstance(renderer, structlog.dev.ConsoleRenderer)
        else [structlog.processors.format_exc_info]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            *tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write and one flush per line (a line is never held back in a buffer).
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        # Each module's logger is assembled once, not on every call: a line below the
        # level costs a method call, one at it the processors and one write.
        # ``structlog.testing.capture_logs`` still captures (it edits the processor list
        # in place); a later ``configure(force=True)`` reaches loggers not used yet.
        cache_logger_on_first_use=True,
    )
    _configured = True


def json_logs() -> None:
    """Log JSON lines from now on, whatever ``LOG_FORMAT`` says: ``--json`` of a command
    whose output is its log (``runworker``, ``runscheduler``)."""
    configure(force=True, fmt="json")


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


def bound_context() -> dict[str, Any]:
    """The log context bound right now, kept with an attempt's record."""
    return dict(structlog.contextvars.get_contextvars())
