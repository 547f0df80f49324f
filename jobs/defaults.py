"""Default values of the engine's settings, for projects that do not set them.

``jobs`` is a reusable app: a project adds it to ``INSTALLED_APPS`` (and, for Django's
Tasks API, the ``TASKS`` backend) without copying Holdfast's settings module. Holdfast's
own ``config/settings.py`` reads each of these from the environment (DESIGN §7).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    "HOLDFAST_LEASE_SECONDS": 60,
    "HOLDFAST_SHUTDOWN_GRACE_SECONDS": 25,
    "HOLDFAST_POLL_SECONDS": 1,
    "HOLDFAST_RECLAIM_SECONDS": 5,
    "HOLDFAST_WORKER_RETENTION_SECONDS": 7 * 86400,
    "HOLDFAST_PREPARED_STATEMENTS": True,
    "HOLDFAST_LISTEN_DATABASE": None,  # settings dict of a direct connection for LISTEN
    "HOLDFAST_REFRESH_SECONDS": 300,
    # Built-in retention (jobs.retention); None keeps that state's jobs forever.
    "HOLDFAST_RETAIN_SUCCEEDED": timedelta(days=14),
    "HOLDFAST_RETAIN_CANCELLED": timedelta(days=14),
    "HOLDFAST_RETAIN_DEAD": timedelta(days=90),
    "HOLDFAST_RETENTION_SECONDS": 600,
    "HOLDFAST_LANES": {"default": {}},
    "HOLDFAST_SCHEDULES": {},
    "LOG_FORMAT": None,  # json, or console on a TTY
    "LOG_LEVEL": "INFO",
}


def apply() -> None:
    """Give every engine setting the project did not set its default."""
    for name, value in DEFAULTS.items():
        if not hasattr(settings, name):
            setattr(settings, name, value)
