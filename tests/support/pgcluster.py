"""Throwaway PostgreSQL clusters for tests and for ``scripts/test.sh``.

A :class:`Cluster` owns one data directory under ``base_dir`` and drives the server with
the PostgreSQL binaries (``initdb``, ``pg_ctl``, ``pg_isready``, ``psql``). It is used two
ways:

* by ``scripts/test.sh`` when no PostgreSQL server is reachable::

      python -m tests.support.pgcluster start DIR     # prints the database URL
      python -m tests.support.pgcluster stop DIR --remove

* by tests that crash or restart the database under a running worker::

      from tests.support.pgcluster import Cluster, make_base_dir

      with Cluster(make_base_dir()) as cluster:
          cluster.create_database("holdfast")
          url = cluster.url("holdfast")
          ...
          cluster.restart(mode="immediate")   # crash-like restart (WAL recovery)
          cluster.kill()                      # SIGKILL the postmaster and its backends
          cluster.start()

The server listens on 127.0.0.1 only (and on a unix socket inside ``base_dir``), trusts
local connections as the superuser ``postgres``, and keeps PostgreSQL's durability
defaults (``fsync`` stays on, so crash tests mean something); only ``initdb`` runs with
``--no-sync``. Extra settings go through ``extra_conf``.

PostgreSQL refuses to run as root, so when this process is root every server command runs
as the ``postgres`` OS user (``runuser``, else ``su``), ``base_dir`` is handed to that
user, and its parent directories are made traversable (search permission only).

Only the standard library is needed.
"""

import argparse
import contextlib
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

__all__ = ["Cluster", "ConfValue", "StopMode", "find_bindir", "free_port", "make_base_dir"]

StopMode = Literal["smart", "fast", "immediate"]
ConfValue = str | int | float | bool

#: OS account that runs the server when this process is root.
OS_USER = "postgres"
#: Database superuser created by ``initdb`` (trust authentication, no password).
SUPERUSER = "postgres"
HOST = "127.0.0.1"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 60
_CONF_NAME = "holdfast.conf"
_CONF_KEY = re.compile(r"^[a-z_][a-z0-9_.]*$")
_PORT_LINE = re.compile(r"^port\s*=\s*(\d+)\s*$", re.MULTILINE)


def find_bindir() -> Path:
    """Return the directory holding the PostgreSQL server binaries.

    Looks at ``$PG_BINDIR``, then ``pg_config --bindir``, then the highest version under
    ``/usr/lib/postgresql/*/bin`` (Debian, Ubuntu), then ``initdb`` on ``PATH``.
    """
    candidates: list[Path] = []
    if env_dir := os.environ.get("PG_BINDIR"):
        candidates.append(Path(env_dir))
    if pg_config := shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
            if out:
                candidates.append(Path(out))
    candidates.extend(
        sorted(
            Path("/usr/lib/postgresql").glob("*/bin"),
            key=lambda p: _version_key(p.parent.name),
            reverse=True,
        )
    )
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).resolve().parent)
    for bindir in candidates:
        if all((bindir / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return bindir
    raise RuntimeError(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found via $PG_BINDIR, "
        "pg_config --bindir, /usr/lib/postgresql/*/bin or PATH; install them "
        "(e.g. `apt-get install postgresql`) or set PG_BINDIR"
    )


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name))


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def make_base_dir(prefix: str = "holdfast-pg-") -> Path:
    """Create a fresh directory (mode 0755) in the system temp dir for a :class:`Cluster`."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


def _format_conf_value(value: ConfValue) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int | float):
        return str(value)
    return "'" + value.replace("'", "''") + "'"


def _tail(path: Path, lines: int = 40, start: int = 0) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(start)
            data = handle.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(data.splitlines()[-lines:]) or "(log is empty)"


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return fields[0] != "Z"


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


class Cluster:
    """One throwaway PostgreSQL cluster living in ``base_dir``.

    ``base_dir`` may already hold a cluster made by an earlier :class:`Cluster` (for
    example the ``stop`` command of the CLI); it is then reused, port included unless
    ``port`` is given. When ``port`` is None a free port is picked.
    """

    def __init__(
        self,
        base_dir: Path,
        port: int | None = None,
        *,
        extra_conf: Mapping[str, ConfValue] | None = None,
        bindir: Path | None = None,
    ) -> None:
        self.base_dir = Path(base_dir).absolute()
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "sock"
        self.log_file = self.base_dir / "postgres.log"
        self.bindir = bindir or find_bindir()
        self.extra_conf: dict[str, ConfValue] = dict(extra_conf or {})
        for key in self.extra_conf:
            if not _CONF_KEY.match(key):
                raise ValueError(f"not a PostgreSQL setting name: {key!r}")
        self._as_root = os.geteuid() == 0
        saved = self._saved_port() if port is None else None
        # A port we picked may be re-picked if taken at the first start; never afterwards,
        # so clients keep a stable URL across restarts.
        self._may_repick_port = port is None and saved is None
        self.port: int = port if port is not None else (saved or free_port())

    def __repr__(self) -> str:
        return f"Cluster({str(self.base_dir)!r}, port={self.port})"

    # -- context manager ---------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.stop("fast")
        except RuntimeError:
            self.kill()

    # -- public API --------------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        """Connection URL for ``dbname`` as the superuser, over TCP on 127.0.0.1."""
        return f"postgres://{SUPERUSER}@{HOST}:{self.port}/{dbname}"

    @property
    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").is_file()

    def is_running(self) -> bool:
        """True if a postmaster is running on the data directory."""
        if not self.initialized:
            return False
        result = self._run([self._bin("pg_ctl"), "-D", str(self.data_dir), "status"])
        return result.returncode == 0

    def start(self, timeout: float = READY_TIMEOUT) -> None:
        """Create the cluster if needed, start it and wait until it accepts connections.

        Starting a cluster that is already running just waits for it to be ready.

        Raises RuntimeError (with the tail of the server log) if it does not come up.
        """
        self._prepare_dirs()
        self._initdb()
        if self.is_running():  # already up (started earlier, maybe by another process)
            self._may_repick_port = False
            self._wait_ready(timeout)
            return
        for attempt in range(3):
            self._write_conf()
            log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
            result = self._run(
                [
                    self._bin("pg_ctl"),
                    "-D",
                    str(self.data_dir),
                    "-l",
                    str(self.log_file),
                    "-w",
                    "-t",
                    str(int(timeout)),
                    "-s",
                    "start",
                ]
            )
            if result.returncode == 0:
                break
            log = _tail(self.log_file, start=log_start)
            if self._may_repick_port and attempt < 2 and "could not bind" in log:
                self.port = free_port()
                continue
            raise RuntimeError(
                f"PostgreSQL in {self.data_dir} failed to start on port {self.port} "
                f"(pg_ctl exit {result.returncode}): {result.stdout}{result.stderr}".rstrip()
                + f"\n--- tail of {self.log_file} ---\n{log}"
            )
        self._may_repick_port = False
        self._wait_ready(timeout)

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server (no-op when it is not running). ``immediate`` is crash-like."""
        if not self.is_running():
            return
        result = self._run(
            [
                self._bin("pg_ctl"),
                "-D",
                str(self.data_dir),
                "-m",
                mode,
                "-w",
                "-t",
                str(STOP_TIMEOUT),
                "-s",
                "stop",
            ]
        )
        if result.returncode != 0 and self.is_running():
            raise RuntimeError(
                f"PostgreSQL in {self.data_dir} did not stop ({mode}): "
                f"{result.stdout}{result.stderr}".rstrip()
                + f"\n--- tail of {self.log_file} ---\n{_tail(self.log_file)}"
            )

    def restart(self, mode: StopMode = "immediate") -> None:
        """Stop with ``mode`` (crash-like by default), then start on the same port."""
        self.stop(mode)
        self.start()

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends, as a crash would; no clean shutdown.

        The next :meth:`start` runs crash recovery. No-op when nothing is running.
        """
        pid = self._postmaster_pid()
        if pid is None or not _pid_alive(pid):
            self._remove_stale_pidfile(pid)
            return
        victims = [pid, *_children(pid)]
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:  # pg_ctl puts the postmaster in its own session
                os.killpg(pid, signal.SIGKILL)
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_pid_alive(victim) for victim in victims):
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL processes {victims} survived SIGKILL")
            time.sleep(0.05)
        self._remove_stale_pidfile(pid)

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        """Run ``sql`` with psql (unaligned, tuples only) and return its output."""
        psql = self.bindir / "psql"
        binary = str(psql) if psql.is_file() else shutil.which("psql")
        if binary is None:
            raise RuntimeError(f"psql not found in {self.bindir} nor on PATH")
        result = subprocess.run(
            [binary, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql, self.url(dbname)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            raise RuntimeError(f"psql failed on {dbname!r}: {result.stderr.strip()}")
        return result.stdout

    def create_database(self, name: str, *, exist_ok: bool = False) -> None:
        """Create database ``name`` (owned by the superuser)."""
        literal = "'" + name.replace("'", "''") + "'"
        if exist_ok and self.psql(f"SELECT 1 FROM pg_database WHERE datname = {literal}"):
            return
        identifier = '"' + name.replace('"', '""') + '"'
        self.psql(f"CREATE DATABASE {identifier}")

    # -- internals ---------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        return str(self.bindir / name)

    def _as_server_user(self, args: Sequence[str]) -> list[str]:
        if not self._as_root:
            return list(args)
        if runuser := shutil.which("runuser"):
            return [runuser, "-u", OS_USER, "--", *args]
        if su := shutil.which("su"):
            return [su, OS_USER, "-s", "/bin/sh", "-c", shlex.join(args)]
        raise RuntimeError("running as root but neither runuser nor su is available")

    def _run(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._as_server_user(args),
            cwd=self.base_dir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=STOP_TIMEOUT + 30,
        )

    def _server_ids(self) -> tuple[int, int]:
        try:
            entry = pwd.getpwnam(OS_USER)
        except KeyError:
            raise RuntimeError(
                f"running as root, but there is no {OS_USER!r} OS user to run PostgreSQL as "
                "(PostgreSQL refuses to run as root); create it or run as another user"
            ) from None
        return entry.pw_uid, entry.pw_gid

    def _prepare_dirs(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if not self._as_root:
            return
        uid, gid = self._server_ids()
        self.base_dir.chmod(0o755)
        for parent in self.base_dir.parents:
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                parent.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
        for path in (self.base_dir, self.socket_dir):
            os.chown(path, uid, gid)
        if self.log_file.exists():
            os.chown(self.log_file, uid, gid)

    def _initdb(self) -> None:
        if self.initialized:
            return
        result = self._run(
            [
                self._bin("initdb"),
                "-D",
                str(self.data_dir),
                "-A",
                "trust",
                "-U",
                SUPERUSER,
                "--no-sync",
                "--locale=C",
                "--encoding=UTF8",
            ]
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"initdb failed in {self.data_dir} (exit {result.returncode}):\n"
                f"{result.stdout}{result.stderr}"
            )
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(f"\n# Settings of tests/support/pgcluster.py\ninclude '{_CONF_NAME}'\n")

    def _write_conf(self) -> None:
        settings: dict[str, ConfValue] = {
            "listen_addresses": HOST,
            "port": self.port,
            "unix_socket_directories": str(self.socket_dir),
            **self.extra_conf,
        }
        path = self.data_dir / _CONF_NAME
        path.write_text("".join(f"{k} = {_format_conf_value(v)}\n" for k, v in settings.items()))
        if self._as_root:
            uid, gid = self._server_ids()
            os.chown(path, uid, gid)

    def _saved_port(self) -> int | None:
        try:
            match = _PORT_LINE.search((self.data_dir / _CONF_NAME).read_text())
        except OSError:
            return None
        return int(match.group(1)) if match else None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        command = [self._bin("pg_isready"), "-q", "-h", HOST, "-p", str(self.port)]
        command += ["-U", SUPERUSER, "-d", "postgres", "-t", "2"]
        while True:
            result = subprocess.run(command, capture_output=True, timeout=30)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                break
            if not self.is_running():
                raise RuntimeError(
                    f"PostgreSQL in {self.data_dir} exited while starting"
                    f"\n--- tail of {self.log_file} ---\n{_tail(self.log_file)}"
                )
            time.sleep(0.1)
        raise RuntimeError(
            f"PostgreSQL on {HOST}:{self.port} not ready after {timeout:.0f} s"
            f"\n--- tail of {self.log_file} ---\n{_tail(self.log_file)}"
        )

    def _postmaster_pid(self) -> int | None:
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError):
            return None

    def _remove_stale_pidfile(self, pid: int | None) -> None:
        # A SIGKILLed postmaster may linger as a zombie when nothing reaps orphans (some
        # container inits); its lock files would then make the next start believe it still
        # runs, since a zombie's pid answers kill(pid, 0).
        if pid is None or _pid_alive(pid):
            return
        locks = [self.data_dir / "postmaster.pid", *self.socket_dir.glob(".s.PGSQL.*.lock")]
        for lock in locks:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``start DIR`` prints the URL of a ready database; ``stop DIR`` stops it."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.pgcluster", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start (creating if needed); print the URL")
    start.add_argument("base_dir", type=Path)
    start.add_argument("--port", type=int, default=None, help="default: a free port")
    start.add_argument("--dbname", default="holdfast", help="database to create and print")
    stop = commands.add_parser("stop", help="stop the cluster in DIR")
    stop.add_argument("base_dir", type=Path)
    stop.add_argument("--mode", choices=["smart", "fast", "immediate"], default="fast")
    stop.add_argument("--remove", action="store_true", help="then delete DIR")
    args = parser.parse_args(argv)

    try:
        if args.command == "start":
            cluster = Cluster(args.base_dir, args.port)
            cluster.start()
            if args.dbname != "postgres":
                cluster.create_database(args.dbname, exist_ok=True)
            print(cluster.url(args.dbname))
        elif (args.base_dir / "data").exists():
            cluster = Cluster(args.base_dir)
            try:
                cluster.stop(args.mode)
            except RuntimeError:
                cluster.kill()
    except RuntimeError as exc:
        print(f"pgcluster: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.command == "stop" and args.remove:
            shutil.rmtree(args.base_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
