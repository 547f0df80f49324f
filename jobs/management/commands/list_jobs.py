from typing import Any

from django.core.management.base import CommandParser

from jobs import operations
from jobs.management.base import JobsCommand, limit
from jobs.models import Job, State
from jobs.serialization import job_dict


class Command(JobsCommand):
    help = "List jobs, newest first, filtered by state, lane and kind."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--state", choices=State.values)
        parser.add_argument("--lane")
        parser.add_argument("--kind", help="a job kind, or a Django task's function path")
        parser.add_argument("--limit", type=limit, default=50)

    def handle(self, *args: Any, **options: Any) -> None:
        jobs = Job.objects.order_by("-pk")
        for field in ("state", "lane"):
            if options[field]:
                jobs = jobs.filter(**{field: options[field]})
        if options["kind"]:
            jobs = jobs.filter(operations.kind_filter(options["kind"]))
        rows = [job_dict(job) for job in operations.rows_by_id(jobs, 0, options["limit"])]
        if not rows:  # none: a kind or lane nothing knows is a typo, not "no jobs"
            operations.check_filters(options["kind"], options["lane"])
        if options["as_json"]:
            self.emit_json({"count": len(rows), "jobs": rows})
            return
        self.stdout.write(
            f"{'id':>8}  {'state':<10} {'lane':<12} {'attempts':>8}  kind / last error"
        )
        for row in rows:
            self.stdout.write(
                f"{row['id']:>8}  {row['state']:<10} {row['lane']:<12} "
                f"{row['attempts']:>3}/{row['max_attempts']:<4}  {row['kind']}"
                + (f" {row['task']}" if row["task"] else "")
                + (f"  — {_one_line(row['last_error'])}" if row["last_error"] else "")
            )
        self.stdout.write(f"({len(rows)} shown)")


ERROR_SHOWN = 200  # characters of the last error a listing line shows (show_job: all)


def _one_line(error: str) -> str:
    """The error as one line of a listing: its whitespace runs as one space, cut to
    ``ERROR_SHOWN`` characters (a 64 KB message filled the terminal; --json has it all)."""
    line = " ".join(error.split())
    return line if len(line) <= ERROR_SHOWN else line[: ERROR_SHOWN - 1] + "…"
