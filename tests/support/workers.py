"""Real ``manage.py`` subprocesses for the process-level tests.

A :class:`WorkerPool` starts ``manage.py runworker`` processes (and one-shot commands)
with a given environment, from the repository root, with stdout and stderr going to
files (never pipes, so a chatty process can never block on a full pipe). Workers log
structlog JSON lines on stderr (``LOG_FORMAT=json``), which :class:`WorkerProc` parses
into events the tests wait for.

Every wait has a deadline; when one runs out, the assertion message carries what the
processes printed, so a failure in CI explains itself::

    pool = WorkerPool(env, tmp_path / "logs")
    worker = pool.start("w1")
    worker.wait_for_event("worker_started")
    ...
    pool.close()   # SIGCONT + SIGKILL whatever is still running

The ``workers`` fixture in ``tests/process/conftest.py`` wraps this with cleanup.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
MANAGE = str(REPO / "manage.py")

#: How much of each process's output a failure message shows.
TAIL_LINES = 40


def wait_until[T](
    predicate: Callable[[], T],
    timeout: float,
    *,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition not met",
) -> T:
    """Poll ``predicate`` until it returns something truthy; return that value.

    Raises AssertionError after ``timeout`` seconds, with ``message`` (called if it is a
    function, so it can describe the state at the moment of failure).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"after {timeout:.1f} s: {text}")
        time.sleep(interval)


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no output file)"
    kept = text.splitlines()[-lines:]
    return "\n".join(kept) if kept else "(empty)"


def parse_events(text: str) -> list[dict[str, Any]]:
    """The JSON objects among ``text``'s lines (structlog events); other lines are skipped."""
    events = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def _matches(event: Mapping[str, Any], name: str | None, fields: Mapping[str, Any]) -> bool:
    if name is not None and event.get("event") != name:
        return False
    return all(event.get(key) == value for key, value in fields.items())


class WorkerProc:
    """One subprocess (usually ``runworker``) with its output files."""

    def __init__(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.stdout_path = log_dir / f"{name}.stdout"
        self.stderr_path = log_dir / f"{name}.stderr"
        self.started_at = time.monotonic()
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.popen = subprocess.Popen(
                self.argv,
                cwd=REPO,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: close() reaps its children
            )
        self.stopped = False  # SIGSTOPped by us and not yet continued

    def __repr__(self) -> str:
        return f"<WorkerProc {self.name} pid={self.pid} rc={self.returncode}>"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    # --- output ------------------------------------------------------------------------

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def events(self, name: str | None = None, **fields: Any) -> list[dict[str, Any]]:
        """Logged events so far, optionally only those named ``name`` with ``fields``."""
        return [e for e in parse_events(self.stderr()) if _matches(e, name, fields)]

    def describe(self) -> str:
        state = "running" if self.alive else f"exited {self.returncode}"
        if self.stopped:
            state += " (SIGSTOPped)"
        return (
            f"--- {self.name} (pid {self.pid}, {state}): {' '.join(self.argv[1:])}\n"
            f"stdout:\n{_tail(self.stdout_path)}\nstderr:\n{_tail(self.stderr_path)}"
        )

    # --- waiting -----------------------------------------------------------------------

    def wait_for_event(self, name: str, timeout: float = 15.0, **fields: Any) -> dict[str, Any]:
        """Wait until this process logs event ``name`` (with ``fields``); return it.

        Fails early, with the output, if the process exits without logging it.
        """

        def found() -> dict[str, Any] | None:
            hits = self.events(name, **fields)
            if hits:
                return hits[0]
            if not self.alive:
                # It may have logged the event just before exiting: read once more.
                hits = self.events(name, **fields)
                if hits:
                    return hits[0]
                raise AssertionError(
                    f"{self.name} exited ({self.returncode}) without logging {name} "
                    f"{fields or ''}\n{self.describe()}"
                )
            return None

        return wait_until(
            found,
            timeout,
            message=lambda: f"{self.name} did not log {name} {fields or ''}\n{self.describe()}",
        )

    def wait_exit(self, timeout: float = 15.0) -> int:
        """Wait for the process to exit; return its exit code (negative: killed by signal)."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout:.1f} s\n{self.describe()}"
            ) from None

    # --- signals -----------------------------------------------------------------------

    def send(self, signum: int) -> None:
        if self.alive:
            self.popen.send_signal(signum)

    def terminate(self) -> None:
        self.send(signal.SIGTERM)

    def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL and reap; returns the exit code (-9 unless it had already exited)."""
        self.cont()
        self.send(signal.SIGKILL)
        return self.wait_exit(timeout)

    def stop(self) -> None:
        """SIGSTOP every thread of the process (its lease keeper too)."""
        self.send(signal.SIGSTOP)
        self.stopped = True
        wait_until(self._is_stopped, 5.0, interval=0.01, message=f"{self.name} did not stop")

    def cont(self) -> None:
        if self.stopped:
            self.send(signal.SIGCONT)
            self.stopped = False

    def _is_stopped(self) -> bool:
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return not self.alive
        return fields[0] in ("T", "t")


@dataclass
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.argv[1:])}\nexit {self.returncode}\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        )

    def json(self) -> Any:
        try:
            return json.loads(self.stdout)
        except ValueError:
            raise AssertionError(f"not JSON on stdout\n{self.describe()}") from None


class WorkerPool:
    """Starts worker processes and commands with one environment; cleans them all up."""

    def __init__(self, env: Mapping[str, str], log_dir: Path) -> None:
        self.env = dict(env)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[WorkerProc] = []

    def _env(self, overrides: Mapping[str, str] | None) -> dict[str, str]:
        env = dict(self.env)
        env.update(overrides or {})
        return env

    def start(
        self,
        name: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        wait_started: bool = True,
        timeout: float = 20.0,
    ) -> WorkerProc:
        """Start ``manage.py runworker --worker-id NAME ARGS``.

        With ``wait_started`` (the default), return once it has logged ``worker_started``:
        its signal handlers are installed and it is about to claim.
        """
        if any(proc.name == name for proc in self.procs):
            raise ValueError(f"a process named {name!r} was already started")
        argv = [sys.executable, MANAGE, "runworker", "--worker-id", name, *args]
        proc = WorkerProc(name, argv, self._env(env), self.log_dir)
        self.procs.append(proc)
        if wait_started:
            proc.wait_for_event("worker_started", timeout=timeout)
        return proc

    def spawn(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> WorkerProc:
        """Start ``manage.py ARGS`` in the background (not necessarily a worker)."""
        argv = [sys.executable, MANAGE, *args]
        proc = WorkerProc(name, argv, self._env(env), self.log_dir)
        self.procs.append(proc)
        return proc

    def spawn_python(
        self, name: str, code: str, *, env: Mapping[str, str] | None = None
    ) -> WorkerProc:
        """Start ``code`` in the background in a fresh interpreter with Django set up: e.g.
        a worker with a fault injected (``call_command("runworker", ...)`` at its end)."""
        prelude = "import django\ndjango.setup()\n"
        proc = WorkerProc(
            name, [sys.executable, "-c", prelude + code], self._env(env), self.log_dir
        )
        self.procs.append(proc)
        return proc

    def command(
        self, *args: str, env: Mapping[str, str] | None = None, timeout: float = 30.0
    ) -> CommandResult:
        """Run ``manage.py ARGS`` to completion and return its exit code and output."""
        return self._run([sys.executable, MANAGE, *args], env, timeout)

    def python(
        self, code: str, *, env: Mapping[str, str] | None = None, timeout: float = 30.0
    ) -> CommandResult:
        """Run ``code`` in a fresh interpreter with Django set up (per this pool's env)."""
        prelude = "import django\ndjango.setup()\n"
        result = self._run([sys.executable, "-c", prelude + code], env, timeout)
        if result.returncode != 0:
            raise AssertionError(f"python subprocess failed\n{result.describe()}")
        return result

    def _run(self, argv: list[str], env: Mapping[str, str] | None, timeout: float) -> CommandResult:
        """Run ``argv`` to completion in this pool's environment; a hang fails the test."""
        try:
            done = subprocess.run(
                argv,
                cwd=REPO,
                env=self._env(env),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"$ {' '.join(argv[1:])} still running after {timeout} s\n"
                f"stdout:\n{exc.stdout!r}\nstderr:\n{exc.stderr!r}"
            ) from None
        return CommandResult(argv, done.returncode, done.stdout, done.stderr)

    @property
    def running(self) -> list[WorkerProc]:
        return [proc for proc in self.procs if proc.alive]

    def describe(self) -> str:
        """Every process's tail of output, for assertion messages."""
        return "\n".join(proc.describe() for proc in self.procs) or "(no processes)"

    def close(self) -> None:
        """Kill (SIGCONT, then SIGKILL) and reap every process still running, and any
        child it left behind (the spool ingester's readers and writer), so that nothing
        keeps a database session open past the test."""
        for proc in self.procs:
            if proc.alive:
                with contextlib.suppress(AssertionError, OSError):
                    proc.kill()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
