"""The ``ctx`` a handler receives: the job's identity and its fenced ways to write."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import transaction

from . import engine
from .exceptions import Cancelled, LeaseLost
from .sql import Claimed


class JobContext:
    """What a handler knows about its job, and how it writes under the lease.

    ``ctx.atomic()`` is ``transaction.atomic()`` plus a fence: it first locks the job row
    iff the job is still ``running`` under this lease token, so anything the block writes
    commits only while the lease holds (I2). ``ctx.atomic(complete=True, result=...)``
    also marks the job succeeded in the same transaction (I4).
    """

    Cancelled = Cancelled

    def __init__(self, job: Claimed, worker_id: str) -> None:
        self.job = job
        self.worker_id = worker_id
        self.completed = False
        self.settling = False  # set by the worker once the handler has returned
        self.result: Any = None
        self._lease_lost = threading.Event()
        self._cancel_requested = threading.Event()
        if job.cancel_requested:  # asked while an earlier attempt ran, and not honoured
            self._cancel_requested.set()

    job_id = property(lambda self: self.job.id)
    kind = property(lambda self: self.job.kind)
    lane = property(lambda self: self.job.lane)
    attempt = property(lambda self: self.job.attempt)
    max_attempts = property(lambda self: self.job.max_attempts)
    lease_token = property(lambda self: self.job.lease_token)
    args = property(lambda self: dict(self.job.args))

    @property
    def lease_lost(self) -> bool:
        """True once a heartbeat found the lease gone: nothing committed now can land."""
        return self._lease_lost.is_set()

    @property
    def cancel_requested(self) -> bool:
        """True once an operator asked to cancel this job; stop at a safe point."""
        return self._cancel_requested.is_set()

    def mark_lease_lost(self) -> None:
        self._lease_lost.set()

    def mark_cancel_requested(self) -> None:
        self._cancel_requested.set()

    @contextmanager
    def atomic(self, complete: bool = False, result: Any = None) -> Iterator[None]:
        """A transaction whose writes commit only while this attempt holds the lease."""
        if self.completed:
            raise RuntimeError(f"job {self.job_id} already completed in an earlier ctx.atomic()")
        try:
            with transaction.atomic():
                engine.fence(self.job_id, self.lease_token, self.job.lease_seconds)
                yield
                if complete:
                    engine.complete(self.job, result)
                    # Only once it commits: inside a handler's own outer transaction that
                    # later rolls back, the job is not complete and the worker settles it.
                    transaction.on_commit(lambda: self._mark_completed(result))
        except LeaseLost:
            self.mark_lease_lost()
            raise

    def _mark_completed(self, result: Any) -> None:
        self.completed = True
        self.result = result

    def heartbeat(self) -> None:
        """Renew the lease now (the worker also does this in the background)."""
        try:
            if engine.heartbeat(self.job):
                self.mark_cancel_requested()
        except LeaseLost:
            self.mark_lease_lost()
            raise

    def progress(self, done: int, total: int | None = None, note: str = "") -> None:
        """Record progress on the job, fenced like every other write."""
        with self.atomic():
            engine.record_progress(self.job, done, total, note)
