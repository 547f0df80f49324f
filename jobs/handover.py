"""SQLite: the shutdown release of a job whose worker cannot write it before it exits.

When ``HOLDFAST_SHUTDOWN_GRACE_SECONDS`` runs out while the handler sits inside
``ctx.atomic()``, the handler's transaction holds SQLite's one write lock, and the worker's
release (another connection) cannot be written until that transaction ends, which only the
process's exit does. The worker used to exit anyway: its lease later expired and the
attempt was charged (``lease_expired``; a job with one attempt went dead on a routine
restart). So the release is handed to a short-lived process started just before the exit:
it writes the same fenced release (``engine.release``: uncharged, outcome ``released``) once
the exit has freed the lock. It ignores SIGTERM: a service manager stopping the unit signals
every process left in it, and this one is done within a second or two. PostgreSQL needs none
of this: there the release waits for the job row, not for the whole database.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from contextlib import suppress
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog
from django.conf import settings

from .log import get_logger

if TYPE_CHECKING:  # jobs.sql imports the models: not before django.setup() (__main__)
    from .sql import Claimed

log = get_logger("jobs.worker")


def hand_over_release(job: Claimed, worker_id: str) -> None:
    """Start the process that releases ``job`` once this one has exited (if it cannot be
    started, the lease expires, and the attempt is charged)."""
    fields = dataclasses.asdict(job)
    fields["lease_expires_at"] = job.lease_expires_at.isoformat()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    try:
        subprocess.Popen(
            [sys.executable, "-m", "jobs.handover", json.dumps(fields), worker_id],
            cwd=settings.BASE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # not in the worker's process group: outlives its exit
        )
    except OSError as exc:
        log.error("release_handover_failed", job_id=job.id, error=str(exc))
        return
    log.warning("release_handed_over", job_id=job.id, lease_token=job.lease_token)


def release_handed_over(payload: str, worker_id: str) -> None:
    """The hand-over process: write the release (waiting for the worker's exit to free the
    lock: the connection's busy timeout), fenced by the lease token. The engine logs it
    (``job_released``, with the worker's id, or ``lease_lost`` if the job moved on), as it
    logs every release."""
    from . import engine
    from .exceptions import LeaseLost
    from .sql import Claimed

    fields: dict[str, Any] = json.loads(payload)
    fields["lease_expires_at"] = datetime.fromisoformat(fields["lease_expires_at"])
    fields["locks"] = tuple(fields["locks"])
    job = Claimed(**fields)
    # LeaseLost: reclaimed or settled meanwhile, and the engine logged it (lease_lost).
    with structlog.contextvars.bound_contextvars(worker_id=worker_id), suppress(LeaseLost):
        engine.release(job)


if __name__ == "__main__":
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from .log import configure

    configure()
    release_handed_over(sys.argv[1], sys.argv[2])
