"""Two transactions racing for one decision, interleaved on purpose."""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.db import connection, transaction


def decided_in_turn[T](decide: Callable[[], T]) -> tuple[T, T]:
    """Run ``decide`` in two threads, each in its own transaction: the first holds its
    transaction open until the second has started and waited half a second, which it
    must (asserted) until the first commits. Returns (first's answer, second's)."""
    first_decided, release = threading.Event(), threading.Event()
    answers: dict[str, T] = {}

    def run(name: str, hold: bool) -> None:
        try:
            with transaction.atomic():
                answers[name] = decide()
                if hold:  # commit only once the other is deciding too
                    first_decided.set()
                    release.wait(10)
        finally:
            connection.close()

    first = threading.Thread(target=run, args=("first", True))
    second = threading.Thread(target=run, args=("second", False))
    first.start()
    assert first_decided.wait(10)
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waits for the first decision to commit
    release.set()
    first.join(10)
    second.join(10)
    return answers["first"], answers["second"]
