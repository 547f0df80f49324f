"""Holdfast's durable job engine.

The public API: ``handler`` to register job kinds, ``enqueue`` and ``enqueue_many`` to
create jobs inside the caller's transaction, and the exceptions handlers and callers use.
"""

from typing import TYPE_CHECKING, Any

from .exceptions import (
    Cancelled,
    InvalidJob,
    JobNotFound,
    LaneFull,
    LaneRefused,
    LeaseLost,
    PermanentError,
    StateConflict,
    UnknownKind,
)
from .registry import handler
from .retry import RetryPolicy

if TYPE_CHECKING:
    from .enqueueing import enqueue, enqueue_many

__all__ = [
    "Cancelled",
    "InvalidJob",
    "JobNotFound",
    "LaneFull",
    "LaneRefused",
    "LeaseLost",
    "PermanentError",
    "RetryPolicy",
    "StateConflict",
    "UnknownKind",
    "enqueue",
    "enqueue_many",
    "handler",
]


def __getattr__(name: str) -> Any:
    # Enqueueing imports models, which must wait until Django's app registry is ready.
    if name in ("enqueue", "enqueue_many"):
        from . import enqueueing

        return getattr(enqueueing, name)
    raise AttributeError(f"module 'jobs' has no attribute {name!r}")
