"""gunicorn settings for Holdfast's internal API (docs/deployment.md).

    gunicorn -c deploy/gunicorn.conf.py config.wsgi:application

Everything comes from the environment, like the rest of Holdfast's settings.
"""

import logging
import os
import sys

import structlog

bind = os.environ.get("HOLDFAST_API_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("HOLDFAST_API_WORKERS", "2"))
# Sync workers (each request is a few indexed queries; the proxy buffers slow clients),
# whose own error answers are JSON like the API's, and which give up on a client that
# stops sending its request after a third of `timeout` (ops/gunicorn.py).
worker_class = "ops.gunicorn.JsonErrorsWorker"
timeout = 30  # a request running longer than this is killed (and logged) by the arbiter
# The longest request line gunicorn takes (its maximum): a search `q` of the API's 1,000
# characters fits in it when it is Latin text (up to 6 bytes a character, percent-encoded);
# a longer line is refused with a JSON 400 that says so.
limit_request_line = 8190
graceful_timeout = 25  # on SIGTERM, in-flight requests get this long to finish
max_requests = 10_000  # recycle workers now and then (bounded memory, whatever happens)
max_requests_jitter = 1_000
# Requests arrive from the TLS proxy on this host; say which peers may set
# X-Forwarded-Proto / X-Forwarded-For (Django reads the scheme: HOLDFAST_BEHIND_TLS_PROXY).
forwarded_allow_ips = os.environ.get("HOLDFAST_PROXY_IPS", "127.0.0.1,::1")
# The API logs its own events (JSON on stderr, as every Holdfast process): gunicorn's
# access log would only repeat them in another format.
accesslog = None
errorlog = "-"
loglevel = os.environ.get("LOG_LEVEL", "info").lower()


def _formatter() -> logging.Formatter:
    """gunicorn's own lines (start, worker boots and timeouts, bad requests) rendered like
    every other Holdfast line: JSON unless LOG_FORMAT=console (jobs/log.py), so
    `journalctl -u holdfast-api -o cat | jq` reads the whole log."""
    fmt = os.environ.get("LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    return structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
        foreign_pre_chain=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.add_logger_name,
        ],
    )


logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"structlog": {"()": _formatter}},
    "filters": {"slow_clients": {"()": "ops.gunicorn.SlowClients"}},
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stderr",
            "formatter": "structlog",
            "filters": ["slow_clients"],
        }
    },
    "root": {"handlers": ["stderr"], "level": loglevel.upper()},
    "loggers": {
        "gunicorn.error": {"handlers": ["stderr"], "level": loglevel.upper(), "propagate": False},
        "gunicorn.access": {"handlers": [], "level": "INFO", "propagate": False},
    },
}
