import logging
import os
import sys
import threading
from typing import Any

from django.core.management.base import CommandParser
from django.db import DatabaseError

from jobs import lanes as lane_config
from jobs import retention, schedules, workers
from jobs.log import get_logger, json_logs
from jobs.management.base import JobsCommand, bad_input, refuse_unmigrated
from jobs.models import Worker
from jobs.worker import WorkerProcess

MAX_WORKER_ID = Worker._meta.get_field("id").max_length or 200

log = get_logger("jobs.worker")


def refuse_twin(worker_id: str) -> None:
    """Exit 2 if a live worker already runs under ``worker_id`` (``workers.live_twin``).
    A database that cannot answer is the worker's to wait out, not a usage error."""
    try:
        twin = workers.live_twin(worker_id)
    except DatabaseError:
        return
    if twin is not None:
        raise bad_input(
            f"--worker-id {worker_id!r} is in use by a live worker ({twin}): two processes "
            "with one id would give back each other's jobs; choose another id, or stop that "
            "worker first"
        )


class Command(JobsCommand):
    help = "Run one worker process: claim jobs one at a time, run them, settle them."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)  # --json: its output is its log, as JSON lines
        parser.add_argument("--lanes", help="comma-separated lanes to serve (default: all)")
        parser.add_argument(
            "--burst", action="store_true", help="exit 0 once no runnable job remains"
        )
        parser.add_argument("--worker-id", help="identity in leases and logs (default host:pid)")
        parser.add_argument(
            "--with-scheduler",
            action="store_true",
            help="also run the scheduler in this process (small installs)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        lanes = None
        if options["lanes"]:
            lanes = [name.strip() for name in options["lanes"].split(",") if name.strip()]
            declared = lane_config.lanes()
            unknown = [name for name in lanes if name not in declared]
            if unknown or not lanes:
                raise bad_input(
                    f"unknown lane(s) {', '.join(unknown) or '(none given)'}; "
                    f"declared: {', '.join(sorted(declared))}"
                )
        worker_id = options["worker_id"]
        if worker_id is not None and (
            len(worker_id) > MAX_WORKER_ID or not worker_id.isprintable()
        ):
            raise bad_input(f"--worker-id must be at most {MAX_WORKER_ID} printable characters")
        refuse_unmigrated()
        if worker_id is not None:
            refuse_twin(worker_id)
        if options["with_scheduler"]:
            # As runscheduler: a schedule that could never run is refused here, not a
            # failing scheduler pass (with its traceback) twice a second while jobs run.
            schedules.check_runnable()
            retention.check_settings()
        if options["as_json"]:
            json_logs()
        WorkerProcess(
            worker_id=worker_id,
            lanes=lanes,
            burst=options["burst"],
            with_scheduler=options["with_scheduler"],
        ).run()
        exit_despite_handler_threads()


def exit_despite_handler_threads() -> None:
    """Exit now if a handler left a thread running that is not a daemon: the interpreter
    would wait for it at exit, so a stopped worker (its row already marked stopped, its
    job settled) never ended, and ``--burst`` never returned (a deploy step that hangs
    until it is killed). The threads are named in a warning first."""
    left = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if not left:
        return
    log.warning("handler_threads_left", threads=sorted(t.name for t in left))
    logging.shutdown()  # flush every log handler: os._exit skips the interpreter's exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
