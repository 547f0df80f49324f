"""Retry policies: how long a failed job waits before its next attempt."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: ``base * 2 ** (attempt - 1)``, capped, then jittered.

    ``jitter`` spreads the delay over ``[delay * (1 - jitter), delay]`` so that jobs that
    failed together (an outage) do not all come back in the same second.
    """

    base: float = 5.0
    cap: float = 3600.0
    jitter: float = 0.25

    def delay(self, attempt: int) -> float:
        exponent = min(max(attempt - 1, 0), 32)
        delay = min(self.cap, self.base * (2**exponent))
        return delay * (1 - self.jitter * random.random())


DEFAULT_RETRY = RetryPolicy()


def as_policy(
    backoff: RetryPolicy | Callable[[int], float] | float | int | None,
) -> Callable[[int], float]:
    """Accept the forms ``@handler(backoff=...)`` allows and return ``attempt -> seconds``."""
    if backoff is None:
        return DEFAULT_RETRY.delay
    if isinstance(backoff, RetryPolicy):
        return backoff.delay
    if isinstance(backoff, int | float):
        if not 0 <= backoff < float("inf"):  # the handler's own check names the bounds
            raise ValueError(f"backoff must be a number of seconds from 0, not {backoff!r}")
        fixed = float(backoff)
        return lambda attempt: fixed
    if callable(backoff):
        return backoff
    raise TypeError(f"backoff must be a RetryPolicy, a number or a callable, not {backoff!r}")
