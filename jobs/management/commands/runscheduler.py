import signal
import threading
from types import FrameType
from typing import Any

from django.core.management.base import CommandParser

from jobs import retention, scheduler, schedules
from jobs.log import get_logger, json_logs
from jobs.management.base import JobsCommand, refuse_unmigrated

log = get_logger("jobs.scheduler")


class Command(JobsCommand):
    help = "Enqueue due recurring jobs and refreshes, and reclaim expired leases."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)  # --json: its output is its log, as JSON lines
        parser.add_argument("--once", action="store_true", help="one pass, then exit 0")

    def handle(self, *args: Any, **options: Any) -> None:
        schedules.check_runnable()  # exit 2 naming a schedule that could never run
        retention.check_settings()  # ... or a retention setting it cannot use
        refuse_unmigrated()
        if options["as_json"]:
            json_logs()
        if options["once"]:
            scheduler.sync()
            scheduler.SchedulerLoop().run_once()
            return
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("scheduler_stopping", signal=signal.Signals(signum).name)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        log.info("scheduler_started")
        scheduler.SchedulerLoop(stop).run()
        log.info("scheduler_stopped")
