"""Exceptions of the job engine, importable from ``jobs``."""


class HoldfastError(Exception):
    """Base class of every error the engine raises on purpose."""


class LeaseLost(HoldfastError):
    """The job is no longer ``running`` under this worker's lease token.

    Raised by every fenced write (heartbeat, progress, ``ctx.atomic()``, settle) when the
    guard matched no row: the lease expired and was reclaimed, or an operator intervened.
    The transaction it was raised in rolls back, so nothing the stale attempt wrote lands.
    """


class TransactionLeftOpen(HoldfastError):
    """A handler returned (or raised) with a database transaction still open: an atomic
    block entered and never exited, autocommit turned off, a raw ``BEGIN``. The worker
    closes that connection (the database rolls the transaction back) and fails the
    attempt with this error: committing it would be committing a stranger's work, and
    keeping it would hold its locks (on SQLite, the database's only write lock) for ever.
    """


class PermanentError(HoldfastError):
    """Raise from a handler when retrying cannot help: the job goes straight to ``dead``."""


class Cancelled(HoldfastError):
    """Raise from a handler to honour a cancellation request (``ctx.Cancelled``)."""


class LaneFull(HoldfastError):
    """Enqueue refused: the lane already holds its ``max_queued`` jobs."""


class LaneRefused(HoldfastError):
    """Enqueue refused: the lane does not exist or does not accept this job kind."""


class UnknownKind(HoldfastError, LookupError):
    """No handler is registered for this job kind."""


class InvalidJob(HoldfastError, ValueError):
    """Enqueue options or arguments that can never make a valid job."""


class JobNotFound(HoldfastError, LookupError):
    """No job has this id."""


class StateConflict(HoldfastError):
    """An operator action that the job's current state does not allow."""
