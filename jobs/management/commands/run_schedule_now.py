from typing import Any

from django.core.management.base import CommandParser

from jobs import scheduler
from jobs.management.base import JobsCommand
from jobs.serialization import job_dict


class Command(JobsCommand):
    help = "Enqueue a schedule's job now; its next slot is not disturbed."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("name")

    def handle(self, *args: Any, **options: Any) -> None:
        job = scheduler.run_now(options["name"], actor="cli")
        if options["as_json"]:
            self.emit_json(job_dict(job))
        else:
            self.stdout.write(str(job.pk))
