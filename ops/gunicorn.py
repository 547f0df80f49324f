"""gunicorn's worker for the internal API (``worker_class`` in deploy/gunicorn.conf.py).

gunicorn answers some requests itself, before Django sees them: a request line or header
over its limits, a malformed header, a worker killed for running past ``timeout``. It
wrote those answers as HTML pages; the API promises JSON on every status, so this worker
writes them in the API's shape, ``{"error": …, "code": …}``, with the same status.

It also bounds how long a client may leave the worker waiting for the next bytes of its
request (``READ_TIMEOUT_SHARE`` of gunicorn's ``timeout``). A sync worker serves one
request at a time, so a client that sent half a body and stopped held it until the arbiter
killed it at ``timeout`` (an HTML 500): two such clients stalled the whole API. A stalled
body now ends that request alone with a JSON 400 (``ops.parsers``), and a stalled request
line or header closes the connection (gunicorn logs it), well before the arbiter steps in.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

from gunicorn import util
from gunicorn.workers.sync import SyncWorker

READ_TIMEOUT_SHARE = 1 / 3  # of gunicorn's timeout (30 s): 10 s for the next bytes
CODES = {
    400: "bad_request",
    403: "permission_denied",
    431: "headers_too_large",
    500: "server_error",
    501: "not_implemented",
}


def write_error(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's ``util.write_error`` (an HTML page), as the API's JSON error."""
    error = " ".join((mesg or reason).split())[:1000]
    body = json.dumps({"error": error, "code": CODES.get(status_int, "error")}).encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode("latin-1")
    util.write_nonblock(sock, head + body)


class JsonErrorsWorker(SyncWorker):
    """The sync worker, with gunicorn's own errors as JSON and a bounded wait for a
    client's bytes (see the module docstring)."""

    def handle(self, listener: Any, client: socket.socket, addr: Any) -> None:
        client.settimeout(max(1.0, self.cfg.timeout * READ_TIMEOUT_SHARE))
        super().handle(listener, client, addr)


class SlowClients(logging.Filter):
    """gunicorn logs a client that stopped sending its request line or headers (the read
    timeout above) as an error with a traceback; it is the client's doing: one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], TimeoutError):
            record.msg, record.args = "client too slow to send its request: connection closed", ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


# Every error page gunicorn writes goes through util.write_error (base.Worker.handle_error
# looks it up at call time): in this worker's process, it writes JSON.
util.write_error = write_error
