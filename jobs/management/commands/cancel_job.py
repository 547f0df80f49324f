from typing import Any

from django.core.management.base import CommandParser

from jobs import operations
from jobs.management.base import JobsCommand, row_id
from jobs.serialization import job_dict


class Command(JobsCommand):
    help = "Cancel a queued job now, or ask a running job to stop at its next safe point."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("job_id", type=row_id)

    def handle(self, *args: Any, **options: Any) -> None:
        job = operations.cancel(options["job_id"], actor="cli")
        if options["as_json"]:
            self.emit_json(job_dict(job))
        elif job.state == "cancelled":
            self.stdout.write(f"job {job.pk} cancelled")
        else:
            self.stdout.write(
                f"job {job.pk} is running on {job.leased_by}: cancellation requested; "
                "it stops at its next safe point if its handler honours the request"
            )
