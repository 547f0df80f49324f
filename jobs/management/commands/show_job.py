from typing import Any

from django.core.management.base import CommandParser

from jobs.management.base import JobsCommand, row_id
from jobs.operations import get_job
from jobs.serialization import job_detail_dict


class Command(JobsCommand):
    help = "Show one job with every attempt: worker, lease token, timings, errors, log context."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("job_id", type=row_id)

    def handle(self, *args: Any, **options: Any) -> None:
        data = job_detail_dict(get_job(options["job_id"]))
        if options["as_json"]:
            self.emit_json(data)
            return
        leases, events = data.pop("leases"), data.pop("events")
        for key, value in data.items():
            if value not in (None, "", {}):
                self.stdout.write(f"{key:>17}: {value}")
        self.stdout.write(f"\nattempts ({len(leases)}):")
        for lease in leases:
            self.stdout.write(
                f"  #{lease['attempt']} token {lease['lease_token']} on {lease['worker_id']}: "
                f"{lease['outcome']}  acquired {lease['acquired_at']}  "
                f"released {lease['released_at'] or '-'}"
            )
            if lease["error_class"]:
                self.stdout.write(f"    {lease['error_class']}: {lease['error_message']}")
            if lease["traceback"]:
                for line in lease["traceback"].rstrip().splitlines():
                    self.stdout.write(f"    | {line}")
            if lease["context"]:
                self.stdout.write(f"    context: {lease['context']}")
        self.stdout.write(f"\nevents ({len(events)}):")
        for event in events:
            token = f" token {event['lease_token']}" if event["lease_token"] is not None else ""
            worker = f" on {event['worker_id']}" if event["worker_id"] else ""
            details = f"  {event['data']}" if event["data"] else ""
            self.stdout.write(f"  {event['at']}  {event['event']}{token}{worker}{details}")
