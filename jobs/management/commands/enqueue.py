from typing import Any

from django.core.management.base import CommandParser

from jobs import strict_json, timestamps
from jobs.enqueueing import enqueue
from jobs.management.base import JobsCommand, bad_input, decimal_number, whole_number
from jobs.serialization import job_dict


class Command(JobsCommand):
    help = "Enqueue one job and print its id."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("kind")
        # Django pops an option named "args" from a command's options: use another dest.
        parser.add_argument("--args", dest="job_args", default="{}", help="JSON object")
        parser.add_argument("--lane")
        parser.add_argument("--priority", type=whole_number, default=0)
        when = parser.add_mutually_exclusive_group()
        when.add_argument("--delay", type=decimal_number, help="seconds from now")
        when.add_argument("--run-at", help="ISO 8601 time with offset")
        parser.add_argument("--unique-key")
        parser.add_argument("--max-attempts", type=whole_number)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            job_args = strict_json.loads(options["job_args"])
        except ValueError as exc:
            raise bad_input(f"--args is not valid JSON: {exc}") from None
        if not isinstance(job_args, dict):  # null too: not "no arguments", but not an object
            kind = "null" if job_args is None else type(job_args).__name__
            raise bad_input(f"--args must be a JSON object, got {kind}")
        run_at = None
        if options["run_at"] is not None:  # given, even empty: read it
            try:
                run_at = timestamps.parse(options["run_at"])
            except timestamps.InvalidTime as exc:
                raise bad_input(f"--run-at: {exc}") from None
        job = enqueue(
            options["kind"],
            job_args,
            lane=options["lane"],
            priority=options["priority"],
            delay=options["delay"],
            run_at=run_at,
            unique_key=options["unique_key"],
            max_attempts=options["max_attempts"],
        )
        if job is None:  # a full lane whose on_full is "drop": exit 0, as the engine returns
            reason = "the lane is full and drops new jobs"
            if options["as_json"]:
                self.emit_json({"id": None, "dropped": True, "reason": reason})
            else:
                self.stdout.write(f"dropped: {reason}")
            return
        if options["as_json"]:
            self.emit_json(job_dict(job))
        else:
            self.stdout.write(str(job.pk))
