"""LISTEN connections back off while the database is unreachable."""

import time

from jobs.notify import RECONNECT_MIN, CancelListener

UNREACHABLE = {"NAME": "holdfast", "HOST": "127.0.0.1", "PORT": "1", "USER": "nobody"}


def test_a_failed_listen_connection_is_not_retried_at_once():
    listener = CancelListener(UNREACHABLE)
    assert listener.poll(0.0) == set()  # tries, fails (connection refused), backs off
    started = time.monotonic()
    for _ in range(20):  # the lease keeper polls every 0.25 s: none of these may connect
        assert listener.poll(0.0) == set()
    assert time.monotonic() - started < RECONNECT_MIN / 2
    assert listener._backoff == 2 * RECONNECT_MIN
    listener.close()
