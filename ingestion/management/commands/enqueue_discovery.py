from typing import Any

from django.core.management.base import CommandParser

from ingestion.discovery import start_discovery
from ingestion.sources import get_source
from jobs.management.base import JobsCommand
from jobs.serialization import job_dict


class Command(JobsCommand):
    help = (
        "Discover a source now. While a discovery of it is queued or running, says so and "
        "enqueues nothing (exit 0)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("source")

    def handle(self, *args: Any, **options: Any) -> None:
        job, message = start_discovery(get_source(options["source"]))
        if options["as_json"]:
            self.emit_json(
                {
                    "enqueued": job is not None,
                    "job": None if job is None else job_dict(job),
                    "message": message,
                }
            )
        else:
            self.stdout.write(message)
