"""A real PgBouncer in transaction mode for tests (standard library only).

```python
with PgBouncer(tmp_path / "bouncer", server_host="127.0.0.1", server_port=5432) as bouncer:
    url = bouncer.url("test_holdfast")  # postgres://postgres@127.0.0.1:PORT/test_holdfast
```

It listens on a free port of 127.0.0.1 and passes every database to the server as user
``postgres`` (``auth_type = any``: the tests' server trusts local connections). The pool
is small, so clients share server connections and any session state one leaves behind
(a prepared statement, a LISTEN, a ``SET``) reaches another: what production poolers do.

The binary is found on ``PATH``, in ``/usr/sbin`` or ``/usr/bin``, or at ``$PGBOUNCER``.
When it is missing, ``find_pgbouncer`` raises with the install command: the PgBouncer
tests fail, never skip, unless ``HOLDFAST_SKIP_PGBOUNCER=1`` says knowingly to skip them
(``scripts/test.sh`` names them loudly then). As root it runs as the ``postgres`` OS user
(PgBouncer refuses to run as root).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.support.pgcluster import free_port

INSTALL_HINT = (
    "PgBouncer is not installed: apt-get install -y pgbouncer (CI's .ci/run does), set "
    "PGBOUNCER=/path/to/pgbouncer, or HOLDFAST_SKIP_PGBOUNCER=1 to skip these tests knowingly"
)
OS_USER = "postgres"


class PgBouncerMissing(RuntimeError):
    pass


def find_pgbouncer() -> str:
    candidates = [os.environ.get("PGBOUNCER", ""), shutil.which("pgbouncer") or ""]
    candidates += ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise PgBouncerMissing(INSTALL_HINT)


class PgBouncer:
    def __init__(
        self,
        base_dir: Path,
        *,
        server_host: str,
        server_port: int,
        server_user: str = "postgres",
        pool_size: int = 3,
    ) -> None:
        self.binary = find_pgbouncer()
        self.base_dir = Path(base_dir)
        self.port = free_port()
        self.server = (server_host, server_port, server_user)
        self.pool_size = pool_size
        self.log_file = self.base_dir / "pgbouncer.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, dbname: str) -> str:
        return f"postgres://{self.server[2]}@127.0.0.1:{self.port}/{dbname}"

    def start(self, timeout: float = 10.0) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        host, port, user = self.server
        conf = self.base_dir / "pgbouncer.ini"
        conf.write_text(
            "[databases]\n"
            f"* = host={host} port={port} user={user}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 200\n"
            f"logfile = {self.log_file}\n"
            f"pidfile = {self.base_dir / 'pgbouncer.pid'}\n"
        )
        argv = [self.binary, str(conf)]
        if os.geteuid() == 0:
            entry = pwd.getpwnam(OS_USER)
            for path in (self.base_dir, conf):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            _traversable(self.base_dir)
            argv = [self.binary, "-u", OS_USER, str(conf)]
        with open(self.base_dir / "stderr.log", "wb") as stderr:
            self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start:\n{self.describe()}")
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"pgbouncer not listening after {timeout} s:\n{self.describe()}")

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGINT)  # immediate shutdown
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def describe(self) -> str:
        texts = []
        for path in (self.base_dir / "stderr.log", self.log_file):
            if path.exists():
                texts.append(path.read_text(errors="replace")[-4000:])
        return f"pgbouncer on port {self.port}\n" + "\n".join(texts)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _traversable(path: Path) -> None:
    """Let the ``postgres`` user reach ``path`` (pytest's tmp dirs are 0700 root)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)
